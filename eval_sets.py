"""The evaluation sets on disk, each optional: torchvision classification sets (zero-shot top-1)
and semantic segmentation sets (VOC20, Pascal Context 59, ADE20K 150; mIoU over foreground).

evaluation_sets(root) returns every one found under --data-root, keyed by name; a set that is
absent (no folder) is one printed line and the run goes on without it; a set that is present is
read whole before any work, and any fault in it is one `error:` line naming it.
"""
import collections
import re
from pathlib import Path

import numpy as np
import torch

from data import IGNORE, LabelSet, LazyImages, MaskSet, centre_square, tree_identity
from infra.errors import RunError
from infra.run import guard

SEG_SIZE = 224  # side of the stored segmentation masks (the usual ViT input side)


# ----------------------------------------------------------------- zero-shot classification sets
# name: (torchvision class, test-split kwargs, label attribute, class-name attribute)
TORCHVISION_SETS = {
    "stl10": ("STL10", dict(split="test"), "labels", "classes"),
    "cifar10": ("CIFAR10", dict(train=False), "targets", "classes"),
    "cifar100": ("CIFAR100", dict(train=False), "targets", "classes"),
    "caltech101": ("Caltech101", {}, "y", "categories"),
    "dtd": ("DTD", dict(split="test"), "_labels", "classes"),
    "eurosat": ("EuroSAT", {}, "targets", "classes"),
    "food101": ("Food101", dict(split="test"), "_labels", "classes"),
    "flowers102": ("Flowers102", dict(split="test"), "_labels", "classes"),
    "pets": ("OxfordIIITPet", dict(split="test"), "_labels", "classes"),
}


EUROSAT_CLASSES = ["AnnualCrop", "Forest", "HerbaceousVegetation", "Highway", "Industrial", "Pasture", "PermanentCrop",
                   "Residential", "River", "SeaLake"]   # its class folders (torchvision's EuroSAT reads the folders)


def pretty(name):
    """A class name as words: "AnnualCrop" -> "annual crop", "aquarium_fish" -> "aquarium fish"."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).replace("_", " ").lower().strip()


def torchvision_set(name, root):
    """LabelSet of one torchvision classification set's test split, or None (one printed line) when absent."""
    import torchvision.datasets as tvd
    cls, kwargs, label_attr, names_attr = TORCHVISION_SETS[name]
    if not (Path(root) / name).is_dir():
        return None                             # optional: evaluation_sets names every set not found in one line
    again = (f"download it again (torchvision's {cls}(root=..., download=True)), or move the folder away to run "
             f"without it")
    with guard(f"{name} in {Path(root) / name}", again):
        ds = getattr(tvd, cls)(str(Path(root) / name), download=False, **kwargs)
        listed = next((getattr(ds, a) for a in ("_image_files", "_images", "samples", "imgs") if hasattr(ds, a)), [])
        if len(ds) == 0:
            raise ValueError("no images")
    paths = [item[0] if isinstance(item, tuple) else item for item in listed]
    LazyImages([p for p in paths if isinstance(p, (str, Path))]).check(f"{name} images", again)  # each file's header
    labels = torch.as_tensor(np.asarray(getattr(ds, label_attr)), dtype=torch.long)
    names = [pretty(c) for c in getattr(ds, names_attr)]
    if name == "eurosat":                       # its class folders are its classes: a lost one, a 9-way top-1
        found = list(getattr(ds, names_attr))
        lost = [c for c in EUROSAT_CLASSES if c not in found]
        if lost and set(found) <= set(EUROSAT_CLASSES):
            raise RunError(f"eurosat in {Path(root) / name} has {len(found)} of EuroSAT's {len(EUROSAT_CLASSES)} class "
                           f"folders (missing: {', '.join(lost)}); its top-1 would be over the others alone: {again}")
        if lost:
            print(f"[data] eurosat: {Path(root) / name} holds classes of its own ({', '.join(found[:5])}"
                  f"{', ...' if len(found) > 5 else ''}), not EuroSAT's: scored as a {len(found)}-class set")
    images = LazyImages(range(len(ds)), load=lambda i: ds[i][0], source=lambda: tree_identity(Path(root) / name),
                        files=paths if len(paths) == len(ds) else None)    # ds[i] reads paths[i]
    return LabelSet(images, labels, names)


# ----------------------------------------------------------------- zero-shot segmentation sets
VOC_CLASSES = ["aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "dining table",
               "dog", "horse", "motorbike", "person", "potted plant", "sheep", "sofa", "train", "tv monitor"]


CONTEXT_CLASSES = [  # the 59 classes of mmsegmentation's PascalContextDataset59, label k + 1 in the PNGs
    "aeroplane", "bag", "bed", "bedclothes", "bench", "bicycle", "bird", "boat", "book", "bottle", "building", "bus",
    "cabinet", "car", "cat", "ceiling", "chair", "cloth", "computer", "cow", "cup", "curtain", "dog", "door", "fence",
    "floor", "flower", "food", "grass", "ground", "horse", "keyboard", "light", "motorbike", "mountain", "mouse",
    "person", "plate", "platform", "potted plant", "road", "rock", "sheep", "shelves", "sidewalk", "sign", "sky",
    "snow", "sofa", "table", "track", "train", "tree", "truck", "tv monitor", "wall", "water", "window", "wood"]


ADE_CLASSES = [  # the 150 classes of ADEChallengeData2016 (objectInfo150), label k + 1 in the PNGs
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass", "cabinet", "sidewalk",
    "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair", "car", "water", "painting", "sofa",
    "shelf", "house", "sea", "mirror", "rug", "field", "armchair", "seat", "fence", "desk", "rock", "wardrobe", "lamp",
    "bathtub", "railing", "cushion", "base", "box", "column", "signboard", "chest of drawers", "counter", "sand",
    "sink", "skyscraper", "fireplace", "refrigerator", "grandstand", "path", "stairs", "runway", "case",
    "pool table", "pillow", "screen door", "stairway", "river", "bridge", "bookcase", "blind", "coffee table",
    "toilet", "flower", "book", "hill", "bench", "countertop", "stove", "palm", "kitchen island", "computer",
    "swivel chair", "boat", "bar", "arcade machine", "hovel", "bus", "towel", "light", "truck", "tower",
    "chandelier", "awning", "streetlight", "booth", "television receiver", "airplane", "dirt track", "apparel",
    "pole", "land", "bannister", "escalator", "ottoman", "bottle", "buffet", "poster", "stage", "van", "ship",
    "fountain", "conveyer belt", "canopy", "washer", "plaything", "swimming pool", "stool", "barrel", "basket",
    "waterfall", "tent", "bag", "minibike", "cradle", "oven", "ball", "food", "step", "tank", "trade name",
    "microwave", "pot", "animal", "bicycle", "lake", "dishwasher", "screen", "blanket", "sculpture", "hood",
    "sconce", "vase", "traffic light", "tray", "ashcan", "fan", "pier", "crt screen", "plate", "monitor",
    "bulletin board", "shower", "radiator", "glass", "clock", "flag"]


# name: (ids file, image pattern, mask pattern, class names, label of class 0 in the PNGs), relative to <data-root>
SEGMENTATION_SETS = {
    "voc20": ("VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt", "VOCdevkit/VOC2012/JPEGImages/{}.jpg",
              "VOCdevkit/VOC2012/SegmentationClass/{}.png", VOC_CLASSES, 1),
    "context": ("VOCdevkit/VOC2010/ImageSets/SegmentationContext/val.txt", "VOCdevkit/VOC2010/JPEGImages/{}.jpg",
                "VOCdevkit/VOC2010/SegmentationClassContext/{}.png", CONTEXT_CLASSES, 1),
    "ade20k": (None, "ADEChallengeData2016/images/validation/{}.jpg",
               "ADEChallengeData2016/annotations/validation/{}.png", ADE_CLASSES, 1),
}


SEGMENTATION_URLS = {
    "voc20": "http://host.robots.ox.ac.uk/pascal/VOC/voc2012/VOCtrainval_11-May-2012.tar",
    "context": "VOC2010 trainval tar + mmsegmentation's tools/dataset_converters/pascal_context.py",
    "ade20k": "http://data.csail.mit.edu/places/ADEchallenge/ADEChallengeData2016.zip",
}


def read_mask(path, lut, image=None, top=255):
    """A label PNG -> uint8 (SEG_SIZE, SEG_SIZE): centre square, nearest resize, labels mapped by lut.
    image: its image file, which must have the mask's size (else the crops would cover other pixels).
    top: the set's highest label; a mask with another label (but IGNORE), a colour mask or a JPEG is refused."""
    from PIL import Image
    size = Image.open(image).size if image is not None else None     # its header, already read by LazyImages.check
    again = "use the set's own label PNGs (extract them again from their archive)"
    try:
        m = Image.open(path)
        if size not in (None, m.size):
            raise RunError(f"mask {path} is {m.size[0]} x {m.size[1]} pixels but its image {image} is "
                             f"{size[0]} x {size[1]}: one of them belongs to another image; extract both again "
                             f"from their archive")
        if m.format == "JPEG":                                                    # lossy: labels change at edges
            raise RunError(f"mask {path} is a JPEG: its lossy compression changes the labels along every "
                             f"edge; {again}")
        if len(m.getbands()) > 1:                                                 # RGB, RGBA, LA: colours
            raise RunError(f"mask {path} is a colour image (mode {m.mode}): its pixels are colours, not "
                             f"class labels (a palette mask saved as {m.mode}?); {again}, one label per pixel")
        a = np.asarray(m)                                                         # every pixel, before the crop
        bad = (a > top) & (a != IGNORE)
        if bad.any():
            raise RunError(f"mask {path} holds label {int(a[bad].min())} on {int(bad.sum())} pixels, but "
                             f"this set's labels are 0..{top} and {IGNORE} (unlabelled): it is not one of its label "
                             f"PNGs (a palette mask saved as grey reads colours as labels); {again}")
        m = centre_square(m).resize((SEG_SIZE, SEG_SIZE), Image.NEAREST)
        return torch.from_numpy(lut[np.asarray(m, dtype=np.uint8)])
    except Exception as e:
        raise RunError(f"cannot read mask {path} ({type(e).__name__}: {e}); replace it (extract it again "
                         f"from its archive)") from None


def segmentation_set(name, root):
    """MaskSet of one segmentation set's validation split, or None (one printed line) when absent. Its images are
    the ids its ids file lists (ADE20K: every image and every mask of its folders); each must have both files."""
    ids_file, image_pattern, mask_pattern, names, first_label = SEGMENTATION_SETS[name]
    root = Path(root)
    if ids_file is None:  # ADE20K: a .jpg without its .png (or a .png without its .jpg) is a missing file
        folders = [(root / pattern).parent for pattern in (image_pattern, mask_pattern)]
        where = " and ".join(map(str, folders))
        present = any(f.is_dir() for f in folders)
        ids = sorted({p.stem for f, pattern in zip(folders, (image_pattern, mask_pattern)) if f.is_dir()
                      for p in f.glob("*" + Path(pattern).suffix)
                      if not p.name.startswith("._")})                 # ._x.png: macOS's metadata of x.png
    else:
        where, present = root / ids_file, (root / ids_file).exists()
        ids = where.read_text(encoding="utf-8-sig").split() if present else []
        twice = [i for i, n in collections.Counter(ids).items() if n > 1]
        if twice:                               # its pixels would count twice in every class's IoU
            raise RunError(f"{where} lists {twice[0]} {ids.count(twice[0])} times "
                             f"({len(twice)} id(s) listed more than once); list each image once")
    if not present:
        return None                             # optional: evaluation_sets names every set not found in one line
    if not ids:                                 # present but broken: an error, never "not found"
        raise RunError(f"{where} {'lists' if ids_file else 'hold'} no images; extract {name} again from "
                       f"{SEGMENTATION_URLS[name]}, or move its folder away to run without it")
    listed_in = root / ids_file if ids_file else None
    images = LazyImages([root / image_pattern.format(i) for i in ids], square=True, listed_in=listed_in)
    images.check(f"{name} images")                                   # every file before any is read
    LazyImages([root / mask_pattern.format(i) for i in ids], listed_in=listed_in).check(f"{name} masks")
    lut = np.full(256, IGNORE, dtype=np.uint8)                       # background, unlabelled -> IGNORE
    lut[first_label:first_label + len(names)] = np.arange(len(names))  # label k + first_label -> class k
    masks = torch.stack([read_mask(root / mask_pattern.format(i), lut, root / image_pattern.format(i),
                                   top=first_label + len(names) - 1) for i in ids])   # (N, S, S) uint8
    return MaskSet(images, masks, names)


def evaluation_sets(root):
    """Every optional classification / segmentation set found under root, keyed by name."""
    sets = {}
    for name in TORCHVISION_SETS:
        sets[name] = torchvision_set(name, root)
    for name in SEGMENTATION_SETS:          # ANY fault nobody listed (an ids file that is a folder): one line
        with guard(f"{name} in {root}", f"extract it again from {SEGMENTATION_URLS[name]}, or move its folder away"):
            sets[name] = segmentation_set(name, root)
    absent = [k for k, v in sets.items() if v is None]
    if absent:
        print(f"[data] optional evaluation sets not found under {root}, left out: {', '.join(absent)} "
              f"(docs/real-data.md: where each goes)")
    return {k: v for k, v in sets.items() if v is not None}
