"""Datasets: the containers every loader returns, and the real sets on disk (COCO, Flickr30K,
torchvision classification sets, VOC / Pascal Context / ADE20K segmentation).

Every loader returns plain containers of raw samples; encoders.py turns them
into frozen features. Images are anything indexable that yields a (3, S, S)
uint8 tensor or a PIL image (the Shapes world: one uint8 tensor (N, 3, S, S);
real sets: LazyImages, which opens one file at a time, so nothing holds all
images in RAM).

    PairSet   images, captions (list[str]), txt_to_img (LongTensor, caption -> image),
              hard_negatives (optional: per caption, its composition-swapped captions)
    LabelSet  images, labels (LongTensor), class_names, templates, optional masks
    MaskSet   images, masks ((N, S, S) integer, IGNORE = background), class_names, templates
    BindingSet images, captions (true, one per image), distractors {kind: list[str]}

The built-in Shapes world (the default, no files needed) is in shapes.py; identity() says what
a set's features are computed from, for the feature cache's key.
"""
import collections
import hashlib
import json
import os
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from infra.errors import RunError, first_line

IGNORE = 255  # mask value of background / unlabelled pixels (ignored by mIoU-fg)


@dataclass
class PairSet:
    images: object
    captions: list
    txt_to_img: torch.Tensor
    hard_negatives: list | None = None  # per caption: its swapped captions (list[str]; --hard-negatives)


@dataclass
class LabelSet:
    images: object
    labels: torch.Tensor
    class_names: list
    templates: list = field(default_factory=lambda: ["a photo of a {}."])
    masks: torch.Tensor | None = None  # optional (N, S, S) class-index masks (Shapes: which pixels the object covers)


@dataclass
class MaskSet:
    images: object
    masks: torch.Tensor
    class_names: list
    templates: list = field(default_factory=lambda: ["a photo of a {}."])


@dataclass
class BindingSet:
    images: object
    captions: list
    distractors: dict


# ---------------------------------------------------------------------------
# Real datasets on disk: standard layouts, lazy images
# ---------------------------------------------------------------------------
# The layouts below are the ones the official archives unpack to. A missing
# REQUIRED file (the COCO / Flickr30K Karpathy split) is one error naming the
# layout and where to download it; a missing OPTIONAL evaluation set is one
# printed line, and the run goes on without it.
#
# Choices (where the papers are silent):
# 1. COCO train = the Karpathy "train" split (the 82,783 train2014 images; PAL's
#    "~80K pairs"), one caption per image: the FIRST one, so every run and
#    method sees the same pairs. Test = Karpathy "test": 5,000 images, their
#    first 5 captions (25,000). Flickr30K likewise (29K train, 1K test). An
#    image with no caption is left out (one printed line): every caption keeps
#    its own image through txt_to_img, and retrieval has no query without an answer.
# 2. Classification: the test split of each torchvision set, read with
#    download=False from <data-root>/<name> as torchvision's download=True
#    writes it. Class names are torchvision's, "_" and CamelCase split into
#    lower-case words ("AnnualCrop" -> "annual crop"). Caltech101 and EuroSAT
#    have no test split: all their images are used.
# 3. Segmentation: each image and its mask are centre-cropped to a square;
#    masks are resized (nearest) to SEG_SIZE x SEG_SIZE and stored uint8. A
#    square image is resized straight to the encoder's input size (encoders.py),
#    so mask pixels and patch tokens cover the same square. Background and
#    unlabelled pixels are IGNORE (PAL's mIoU-fg): VOC20 = VOC2012 val, 20
#    classes; Pascal Context = the 59-class mmsegmentation layout; ADE20K = the
#    150 classes of ADEChallengeData2016.
# 4. Faults are found before any encoder runs: the split file is parsed and
#    checked entry by entry (valid UTF-8 JSON, an "images" list, every entry's
#    filename / split (one of Karpathy's four) / sentences, every sentence's "raw"),
#    and every image and mask file is checked to exist, be non-empty and have an
#    image header PIL reads (not a text file, not a decompression bomb), each fault
#    one `error:` line naming the file. A file cut short past its header (a
#    truncated JPEG) is one line naming it when it is decoded; there are no worker
#    processes. A mask must have its image's size (their crops cover the same
#    pixels), be a one-band PNG (not RGB, not a JPEG) and hold only the set's labels
#    and 255, and a segmentation ids file must list each image once (its pixels
#    would count twice).
# 5. 16-bit grey images (PIL modes I;16, I) are scaled to 8 bits (/ 257), not
#    clipped at 255; float grey images (mode F, float TIFFs) in [0, 1] are scaled by 255, others
#    taken as 0..255; 16-bit colour PNGs PIL already reads as 8-bit RGB.
# 6. identity(): what features of a set are computed from, for the feature
#    cache key and the training checkpoint: image files by path, size and
#    modification time (one stat each, where a content hash of COCO's images
#    would read 19 GB on every run), texts and in-memory images by content.


def rgb(img, upright=True):
    """A PIL image as 8-bit RGB, as transformers' load_image and convert_to_rgb read it: turned upright by
    its EXIF orientation (not upright=False: a segmentation mask holds the stored pixels), transparent
    pixels composited onto white; 16- and 32-bit grey images scaled from 0..65535 to 0..255, not
    clipped, float grey images in [0, 1] scaled by 255."""
    from PIL import Image, ImageOps
    if upright:
        img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16") or img.mode == "I":
        grey = np.clip(np.round(np.asarray(img, dtype=np.float64) / 257), 0, 255).astype(np.uint8)
        img = Image.fromarray(grey)                                     # mode L
    elif img.mode == "F":                                               # 32-bit float grey (a float TIFF)
        a = np.asarray(img, dtype=np.float64)
        scale = 255 if np.nanmax(a, initial=0) <= 1 else 1             # floats in [0, 1], else already 0..255
        img = Image.fromarray(np.clip(np.round(np.nan_to_num(a) * scale), 0, 255).astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:    # onto white
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba)
    return img.convert("RGB")


def file_scan(paths, images=True):
    """(identity, faults) of files: identity hashes every path, size, mtime and ctime (one stat each;
    the ctime, which no program sets back, tells a file rewritten with its old size and mtime); faults maps
    "missing" (or a folder), "empty (0 bytes)" and, of images, "unreadable" to [(path, exception or None)]."""
    from PIL import Image
    lines, faults = [], collections.defaultdict(list)
    for p in map(os.path.realpath, paths):              # a file by its real path: a symlinked root is the same data
        try:
            st = os.stat(p)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):                  # or a folder where an image should be
            faults["missing"].append((Path(p), None))
            continue
        lines.append(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n")
        if st.st_size == 0:
            faults["empty (0 bytes)"].append((Path(p), None))
        elif images:        # the header only (format, size; PIL's decompression-bomb check), no pixel decoded:
            try:            # a file cut short past its header (a truncated JPEG) is found when LazyImages decodes it
                Image.open(p).close()
            except Exception as e:                      # not an image, a bomb, no read permission
                faults["unreadable"].append((Path(p), e))
    return "files " + hashlib.sha1("".join(lines).encode()).hexdigest()[:16], faults


def tree_identity(folder):
    """identity of every file under folder (a torchvision set's download), by path, size, mtime and ctime."""
    return file_scan(sorted(p for p in Path(folder).rglob("*") if p.is_file()), images=False)[0]


class LazyImages:
    """A sequence of images opened one at a time: item i = load(keys[i]) as an RGB PIL image.

    keys are file paths (load = PIL open) or indices into a torchvision dataset.
    square=True centre-crops to a square (segmentation sets). Slicing gives a lazy view.
    listed_in: the file that lists the images; files: the files of keys that are not paths (both named in the
    error of an image that cannot be read). source: for keys that are not paths, their identity (a callable).
    """

    def __init__(self, keys, load=None, square=False, listed_in=None, source=None, files=None):
        self.keys, self.load, self.square, self.listed_in, self.source = list(keys), load, square, listed_in, source
        self.files, self._scan = files, None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return LazyImages(self.keys[i], self.load, self.square, self.listed_in, self.source,
                              self.files and self.files[i])
        from PIL import Image
        key = self.keys[i]
        try:
            # also forces the decode: a broken file fails here
            img = rgb(self.load(key) if self.load else Image.open(key), upright=not self.square)
        except Exception as e:
            raise RunError(f"cannot read image {self.files[i] if self.files else key} ({type(e).__name__}: {e}); "
                           f"{self.fix(e)}") from None
        return centre_square(img) if self.square else img

    def fix(self, e):
        """What to do about an image file that cannot be read (e: why)."""
        from PIL import Image
        return (("if the image is genuine, downscale it" if isinstance(e, Image.DecompressionBombError)
                 else "replace it (extract it again from its archive)")
                + (f" or remove its entry from {self.listed_in}" if self.listed_in else ""))

    def scan(self):
        """(identity, faults), computed once (file_scan: one stat and one image header per file)."""
        if self._scan is None:
            if self.load is None:
                self._scan = file_scan(self.keys)
            else:
                self._scan = (f"{self.source() if self.source else 'unknown'} rows {hash_values(self.keys)}", {})
        return self._scan

    def check(self, what, fix=None):
        """Stop with one line when any file is missing, empty or no image PIL can open, before any encoder
        runs. fix: what to do, when not to restore the files or remove their entries."""
        faults = self.scan()[1]
        how = next((h for h in ("missing", "empty (0 bytes)", "unreadable") if faults.get(h)), None)
        if how:
            (path, e), n = faults[how][0], len(faults[how])
            if e is not None:
                raise RunError(f"{n} of {len(self)} {what} cannot be read as images, e.g. {path} "
                               f"({type(e).__name__}: {first_line(e)}); {fix or self.fix(e)}")
            raise RunError(f"{n} of {len(self)} {what} are {how}, e.g. {path}; " + (fix or "restore them (extract "
                           "them again from their archive)" + (f" or remove their entries from {self.listed_in}"
                                                               if self.listed_in else "")))


def hash_values(values):
    """sha1 of a list of plain values (texts, numbers), exact."""
    return hashlib.sha1(json.dumps(list(values), ensure_ascii=False).encode()).hexdigest()[:16]


def identity(x):
    """What features of x are computed from, as a short string; equal strings = the same inputs.

    x: LazyImages (file paths, sizes, mtimes: file_scan), a tensor or array (its bytes),
    a list of texts or numbers (their values), a list of PIL images (their pixels), or a
    whole set (PairSet, LabelSet, MaskSet, BindingSet: its images and every other field).
    """
    if isinstance(x, LazyImages):
        return x.scan()[0]
    if isinstance(x, (torch.Tensor, np.ndarray)):
        a = x.detach().cpu().contiguous().numpy() if isinstance(x, torch.Tensor) else np.ascontiguousarray(x)
        return f"array {a.dtype} {a.shape} " + hashlib.sha1(a.view(np.uint8).reshape(-1).data).hexdigest()[:16]
    if isinstance(x, (PairSet, LabelSet, MaskSet, BindingSet)):
        parts = {k: identity(v) if isinstance(v, (LazyImages, torch.Tensor, np.ndarray)) else hash_values([repr(v)])
                 for k, v in vars(x).items() if v is not None}
        return hashlib.sha1(repr(sorted(parts.items())).encode()).hexdigest()[:16]
    x = list(x)
    if all(isinstance(v, (str, int, float)) for v in x):
        return f"values {len(x)} {hash_values(x)}"
    from PIL import Image
    if all(isinstance(v, Image.Image) for v in x):
        h = hashlib.sha1()
        for v in x:
            h.update(f"{v.mode} {v.size}".encode() + v.tobytes())
        return f"pil {len(x)} " + h.hexdigest()[:16]
    raise TypeError(f"identity(): no rule for a list of {type(x[0]).__name__}")


def centre_square(img):
    """The largest centred square of a PIL image."""
    w, h = img.size
    s = min(w, h)
    left, top = (w - s) // 2, (h - s) // 2
    return img.crop((left, top, left + s, top + s))


def pixels(image, size=224):
    """Any image of a set -> uint8 (3, size, size): centre square, resized (figures, analyse())."""
    if isinstance(image, torch.Tensor):
        return image
    from PIL import Image
    img = centre_square(rgb(image)).resize((size, size), Image.BICUBIC)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


def missing(what, path, layout, url):
    """The one error of a missing required file: what, where it was looked for, the layout, the source."""
    raise RunError(f"{what} not found at {path}.\nExpected layout:\n{layout}\nDownload: {url}")


COCO_LAYOUT = """  <data-root>/coco/              (or <data-root> itself)
      dataset_coco.json          Karpathy split file (captions included)
      train2014/COCO_train2014_*.jpg
      val2014/COCO_val2014_*.jpg"""
COCO_URL = ("images: https://cocodataset.org/#download (2014 Train images, 2014 Val images); "
            "Karpathy split: https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip")
FLICKR_LAYOUT = """  <data-root>/flickr30k/         (or <data-root> itself)
      dataset_flickr30k.json     Karpathy split file (captions included)
      flickr30k-images/*.jpg"""
FLICKR_URL = ("images: https://shannon.cs.illinois.edu/DenotationGraph/ (request form); "
              "Karpathy split: https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip")
KARPATHY_SPLITS = ("train", "val", "test", "restval")
SPLIT_FILE = 'a Karpathy split file: {"images": [{"filename", "split", "sentences": [{"raw"}, ...]}, ...]}'


def read_split_file(path):
    """The entries of a Karpathy split file, every field this loader reads checked: one `error:` line per fault."""
    again = "unpack it again from caption_datasets.zip"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")                # a byte-order mark (an editor's UTF-8) is not a fault
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise RunError(f"{path}: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}) is not UTF-8; "
                         f"save the file as UTF-8 or {again}") from None
    try:
        split_file = json.loads(text)
    except json.JSONDecodeError as e:
        raise RunError(f"{path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}; "
                         f"truncated?); {again}") from None
    entries = split_file.get("images") if isinstance(split_file, dict) else None
    if not isinstance(entries, list):
        raise RunError(f"{path} has no \"images\" list: it is not {SPLIT_FILE}")
    for i, e in enumerate(entries):
        where = f"{path}: images[{i}]" + (f" ({e['filename']})" if isinstance(e, dict) and e.get("filename") else "")
        if not isinstance(e, dict):
            raise RunError(f"{where} is not an object: it is not {SPLIT_FILE}")
        for field_, kind in (("filename", str), ("split", str), ("sentences", list)):
            if not isinstance(e.get(field_), kind) or (field_ == "filename" and not e[field_]):
                raise RunError(f"{where} has no {field_!r} ({kind.__name__}); fix or remove that entry, "
                                 f"or {again}")
        if e["split"] not in KARPATHY_SPLITS:                       # "Test", "train ": never silently left out
            raise RunError(f"{where}: its split {e['split']!r} is not one of Karpathy's ("
                           f"{', '.join(KARPATHY_SPLITS)}); fix that entry, or {again}")
        if not isinstance(e.get("filepath", ""), str):
            raise RunError(f"{where}: its 'filepath' is not a folder name (str); fix or remove that entry, "
                             f"or {again}")
        for field_ in ("filepath", "filename"):       # read from <root> only: never ../ or an absolute path
            value = e.get(field_, "")
            if os.path.isabs(value) or ".." in Path(value).parts:
                raise SystemExit(f"error: {where}: its {field_} {value!r} points outside the data folder (an "
                                 f"absolute path or ../); give the image's name inside it, or remove that entry")
        for k, s in enumerate(e["sentences"]):
            if not isinstance(s, dict) or not isinstance(s.get("raw"), str):
                raise RunError(f"{where}: sentences[{k}] has no 'raw' text; fix or remove that sentence, "
                                 f"or {again}")
    return entries


def entry_path(image_dir, e):
    """The image file of a Karpathy-split entry: <image_dir>/<filepath>/<filename> (COCO has a filepath)."""
    return Path(image_dir) / e.get("filepath", "") / e["filename"]


def check_listed_once(entries, image_dir, path, splits=("train", "test")):
    """Every image of the splits used listed once: a test image listed twice has two right answers
    (its duplicate ties with it), a test image also in train is a training pair scored as a test one."""
    seen = {}
    for i, e in enumerate(entries):
        if e["split"] not in splits:
            continue
        f = os.path.realpath(entry_path(image_dir, e))      # a symlink to a training image is that image
        try:                                                # ... and so is a hard link: the same inode
            st = os.stat(f)
            same = (st.st_dev, st.st_ino)
        except OSError:
            same = f                                        # missing: said where the files are scanned
        j = seen.setdefault(same, i)
        if j != i:
            why = "a test image that is also a training image inflates the test numbers" \
                if e["split"] != entries[j]["split"] else "each image is listed once, with all its captions"
            raise RunError(f"{path}: images[{j}] ({entries[j]['split']}) and images[{i}] ({e['split']}) are "
                             f"the same image file {f} (a link to the other, or the same entry; {why}); remove "
                             f"one of the two entries")


def text_fault(text):
    """Why a caption is no text to align, or None: "is empty" when it holds no visible character
    (spaces, zero-width or control characters alone tokenize to nothing), "holds a lone surrogate"
    when it is not valid Unicode (a JSON "\\ud83d" without its pair: tokenizers refuse it)."""
    bad = next((i for i, c in enumerate(text) if unicodedata.category(c) == "Cs"), None)
    if bad is not None:
        return (f"holds a lone surrogate {ascii(text[bad])} at character {bad} (half of an emoji?), so it is "
                f"not valid Unicode text")
    if all(unicodedata.category(c)[0] in "ZC" for c in text):
        return "is empty"
    return None


def karpathy_pairs(entries, image_dir, n_captions, listed_in=None):
    """PairSet of Karpathy-split entries: the first n_captions captions of each image (images without one left out)."""
    kept = [e for e in entries if e["sentences"]]
    paths, captions, txt_to_img = [], [], []
    for i, e in enumerate(kept):
        paths.append(entry_path(image_dir, e))
        for k, s in enumerate(e["sentences"][:n_captions]):
            why = text_fault(s["raw"])                  # no token to align; said here, where the entry is known
            if why:
                raise RunError(f"{listed_in}: {e['split']} image {e['filename']}: sentences[{k}] {why}; "
                                 f"give it text or remove that sentence")
            captions.append(s["raw"].strip())
            txt_to_img.append(i)
    return PairSet(LazyImages(paths, listed_in=listed_in), captions, torch.tensor(txt_to_img)), len(entries) - len(kept)


def split_file_folder(root, sub, split_file, layout, url, name):
    """The folder holding a Karpathy split file, <root>/<sub> or <root>; missing: the one error with the layout."""
    root = Path(root)
    base = root / sub if (root / sub).is_dir() else root
    if not (base / split_file).exists():
        missing(f"{name} Karpathy split file {split_file}", base / split_file, layout, url)
    return base


def check_root(name, root):
    """--data-root holds the set's split file: said at start, before any encoder loads or pretrains."""
    if name == "coco":
        split_file_folder(root, "coco", "dataset_coco.json", COCO_LAYOUT, COCO_URL, "COCO")
    if name == "flickr":
        split_file_folder(root, "flickr30k", "dataset_flickr30k.json", FLICKR_LAYOUT, FLICKR_URL, "Flickr30K")


def data_folder(name, root):
    """What a --data-root names, by the real path of the data (symlinks followed): <root> and
    <root>/coco (for COCO; flickr30k for Flickr) are the same data. None for shapes."""
    if name == "shapes" or root is None:
        return None
    real = os.path.realpath(root)
    sub = {"coco": "coco", "flickr": "flickr30k"}.get(name)
    if sub and os.path.basename(real) == sub and not os.path.isdir(os.path.join(real, sub)):
        real = os.path.dirname(real)
    return real


def karpathy_dataset(root, sub, split_file, image_dir, layout, url, name):
    """{"train", "test"} PairSets from a Karpathy split file; one clear error when anything is missing."""
    base = split_file_folder(root, sub, split_file, layout, url, name)
    entries = read_split_file(base / split_file)
    check_listed_once(entries, base / image_dir, base / split_file)
    sets = {}
    for split, n_captions in (("train", 1), ("test", 5)):
        chosen = [e for e in entries if e["split"] == split]
        if not chosen:
            found = ", ".join(f"{k} {v}" for k, v in collections.Counter(e["split"] for e in entries).items())
            raise RunError(f"{base / split_file} has no images in split {split!r} (its splits: "
                             f"{found or 'none'}); this loader trains on Karpathy's 'train' and tests on 'test': "
                             f"name the splits so, or unpack it again from caption_datasets.zip")
        sets[split], dropped = karpathy_pairs(chosen, base / image_dir, n_captions, base / split_file)
        if dropped:
            print(f"[data] {name} {split}: {dropped} image(s) without captions left out")
        images = sets[split].images
        if len(images.scan()[1]["missing"]) == len(images):              # a wrong folder, not a few lost files
            missing(f"{name} {split} images (e.g. {images.keys[0].name})", images.keys[0].parent, layout, url)
        images.check(f"{name} {split} images")
    print(f"[data] {name}: {len(sets['train'].images)} train pairs, {len(sets['test'].images)} test images / "
          f"{len(sets['test'].captions)} captions")
    return sets


def coco(root="data"):
    """COCO 2014 + Karpathy split (train: one caption per image; test: 5K / 25K), and Flickr30K's
    test split as "flickr" when present (align.py adds eval_sets.evaluation_sets)."""
    sets = karpathy_dataset(root, "coco", "dataset_coco.json", "", COCO_LAYOUT, COCO_URL, "COCO")
    flickr_dir = Path(root) / "flickr30k"
    if (flickr_dir / "dataset_flickr30k.json").exists():
        sets["flickr"] = karpathy_dataset(root, "flickr30k", "dataset_flickr30k.json", "flickr30k-images",
                                          FLICKR_LAYOUT, FLICKR_URL, "Flickr30K")["test"]
    return sets


def flickr(root="data"):
    """Flickr30K + Karpathy split (train: one caption per image; test: 1K / 5K)."""
    sets = karpathy_dataset(root, "flickr30k", "dataset_flickr30k.json", "flickr30k-images",
                            FLICKR_LAYOUT, FLICKR_URL, "Flickr30K")
    return sets


DATASETS = {"coco": coco, "flickr": flickr}   # real sets on disk; "shapes" is shapes.py
