"""Datasets: the built-in Shapes world (the default, no files needed).

Every loader returns plain containers of raw samples; encoders.py turns them
into frozen features. Images are anything indexable that yields a (3, S, S)
uint8 tensor or a PIL image (the Shapes world: one uint8 tensor (N, 3, S, S)).

    PairSet   images, captions (list[str]), txt_to_img (LongTensor, caption -> image)
    LabelSet  images, labels (LongTensor), class_names, templates, optional masks
    MaskSet   images, masks (LongTensor (N, S, S), IGNORE = background), class_names, templates
    BindingSet images, captions (true, one per image), distractors {kind: list[str]}

The Shapes world (DESIGN.md): 1-3 coloured shapes in two sizes on varied
backgrounds, captions that bind attributes and relations ("a small red circle
to the left of a large blue square"), five paraphrases per test image like
COCO's Karpathy test, and minimal-pair distractors for a binding test.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

IGNORE = 255  # mask value of background / unlabelled pixels (ignored by mIoU-fg)


@dataclass
class PairSet:
    images: object
    captions: list
    txt_to_img: torch.Tensor


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
# The Shapes world: scenes
# ---------------------------------------------------------------------------
SIZE = 64                                   # image side in pixels
SHAPES = ["circle", "square", "triangle", "cross"]
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 230),
           "yellow": (235, 215, 40), "purple": (150, 60, 200), "orange": (245, 140, 30)}
COLOUR_NAMES = list(COLOURS)
RADIUS = {"small": (6, 8), "large": (11, 13)}  # pixel radius range per size word
CLASS_NAMES = [f"{c} {s}" for c in COLOUR_NAMES for s in SHAPES]  # the image encoder's head classes
TEMPLATES = ["a photo of a {}.", "a {}.", "an image of a {}."]    # zero-shot prompts
RELATIONS = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}
OPPOSITE = {"left": "right", "right": "left", "above": "below", "below": "above"}


def sample_scene(rng, n_objects):
    """A scene: a background and n non-overlapping objects (dicts with shape, colour, size, x, y, r)."""
    objects = []
    while len(objects) < n_objects:
        size = ["small", "large"][rng.integers(2)]
        r = int(rng.integers(*RADIUS[size], endpoint=True))
        x, y = rng.integers(r + 1, SIZE - r - 1, size=2)
        if all((x - o["x"]) ** 2 + (y - o["y"]) ** 2 > (r + o["r"] + 3) ** 2 for o in objects):
            objects.append(dict(shape=SHAPES[rng.integers(len(SHAPES))], size=size,
                                colour=COLOUR_NAMES[rng.integers(len(COLOURS))], x=int(x), y=int(y), r=r))
    background = dict(base=rng.uniform(60, 200), tint=rng.uniform(-15, 15, size=3),
                      gradient=rng.uniform(-40, 40, size=2), noise_seed=int(rng.integers(2**31)))
    return dict(objects=objects, background=background)


def shape_mask(obj):
    """(SIZE, SIZE) bool: the pixels covered by one object."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] + 0.5
    dx, dy, r = xx - obj["x"], yy - obj["y"], obj["r"]
    if obj["shape"] == "circle":
        return dx ** 2 + dy ** 2 <= r ** 2
    if obj["shape"] == "square":
        return (abs(dx) <= 0.85 * r) & (abs(dy) <= 0.85 * r)
    if obj["shape"] == "triangle":  # apex up, base at the bottom
        return (dy >= -r) & (dy <= 0.8 * r) & (abs(dx) <= 0.6 * (dy + r))
    return ((abs(dx) <= r / 3) & (abs(dy) <= r)) | ((abs(dy) <= r / 3) & (abs(dx) <= r))  # cross


def render(scene):
    """Scene -> (image (3, S, S) uint8, shape-class mask (S, S), colour-shape-class mask (S, S))."""
    bg = scene["background"]
    yy, xx = np.mgrid[0:SIZE, 0:SIZE] / SIZE - 0.5
    noise = np.random.default_rng(bg["noise_seed"]).normal(0, 8, size=(SIZE, SIZE, 1))
    img = bg["base"] + bg["tint"] + (bg["gradient"][0] * xx + bg["gradient"][1] * yy)[..., None] + noise
    shape_cls = np.full((SIZE, SIZE), IGNORE, dtype=np.int64)
    object_cls = np.full((SIZE, SIZE), IGNORE, dtype=np.int64)
    for obj in scene["objects"]:
        m = shape_mask(obj)
        img[m] = np.array(COLOURS[obj["colour"]]) + noise[m] * 0.5
        shape_cls[m] = SHAPES.index(obj["shape"])
        object_cls[m] = CLASS_NAMES.index(f"{obj['colour']} {obj['shape']}")
    img = torch.from_numpy(np.clip(img, 0, 255).astype(np.uint8)).permute(2, 0, 1)
    return img, torch.from_numpy(shape_cls), torch.from_numpy(object_cls)


# ---------------------------------------------------------------------------
# The Shapes world: captions
# ---------------------------------------------------------------------------
def phrase(obj, with_size=True):
    words = f"{obj['size']} {obj['colour']} {obj['shape']}" if with_size else f"{obj['colour']} {obj['shape']}"
    return ("an " if words[0] in "aeiou" else "a ") + words


def relation(a, b):
    """Where a is relative to b, along the axis of larger displacement (image y grows downwards)."""
    dx, dy = a["x"] - b["x"], a["y"] - b["y"]
    if abs(dx) >= abs(dy):
        return "left" if dx < 0 else "right"
    return "above" if dy < 0 else "below"


def caption(scene, style, rel_override=None, objects=None):
    """One caption of a scene in paraphrase style 0..4 (all styles state the same facts)."""
    objs = objects or scene["objects"]
    sized = style != 4  # style 4 drops sizes, the others keep them
    if len(objs) == 1:
        a = phrase(objs[0], sized)
        return [a, f"there is {a}", f"a picture of {a}", f"an image showing {a}", a][style]
    a, b = objs[0], objs[1]
    rel = rel_override or relation(a, b)
    A, B = phrase(a, sized), phrase(b, sized)
    first = [f"{A} {RELATIONS[rel]} {B}",
             f"{B} {RELATIONS[OPPOSITE[rel]]} {A}",
             f"there is {A} {RELATIONS[rel]} {B}",
             f"a picture of {B} and {A} , the {a['shape']} is {RELATIONS[rel]} the {b['shape']}",
             f"{A} {RELATIONS[rel]} {B}"][style]
    if len(objs) == 3:
        first += f" and {phrase(objs[2], sized)}"
    return first


def binding_distractors(scene):
    """Minimal pairs of the canonical caption: colours of the first two objects swapped; relation reversed."""
    a, b = scene["objects"][:2]
    swapped = [dict(a, colour=b["colour"]), dict(b, colour=a["colour"])] + scene["objects"][2:]
    return {"attribute_swap": caption(scene, 0, objects=swapped),
            "relation_swap": caption(scene, 0, rel_override=OPPOSITE[relation(a, b)])}


def text_corpus(n, seed):
    """Captions of n random scenes, no images: the text encoder's unimodal pretraining corpus."""
    rng = np.random.default_rng(seed)
    out = [caption(sample_scene(rng, int(rng.integers(1, 4))), int(rng.integers(5))) for _ in range(n)]
    out += [t.format(c) for c in CLASS_NAMES for t in TEMPLATES] + [t.format(s) for s in SHAPES for t in TEMPLATES]
    return out


def render_all(scenes):
    images, shape_masks, object_masks = zip(*(render(s) for s in scenes))
    return torch.stack(images), torch.stack(shape_masks), torch.stack(object_masks)


def shapes_world(seed=0, n_train=6000, n_test=500, n_cls=480, n_seg=300, n_bind=300):
    """The built-in dataset: a dict of the sets align.py trains and evaluates on.

    train: PairSet, one caption per image (as PAL's COCO setting).
    test: PairSet, 5 paraphrases per image (styles 0..4), like the Karpathy test.
    cls: LabelSet of single-object images over the 24 colour-shape classes.
    seg: MaskSet over the 4 shape classes (background ignored).
    binding: BindingSet of two-object scenes with distractor captions.
    """
    rng = np.random.default_rng(seed)
    n_obj = lambda: int(rng.integers(1, 4))
    train = [sample_scene(rng, n_obj()) for _ in range(n_train)]
    test = [sample_scene(rng, n_obj()) for _ in range(n_test)]
    cls = [sample_scene(rng, 1) for _ in range(n_cls)]
    seg = [sample_scene(rng, n_obj()) for _ in range(n_seg)]
    bind = []
    while len(bind) < n_bind:  # two objects that differ in colour, so a colour swap changes the caption
        s = sample_scene(rng, 2)
        if s["objects"][0]["colour"] != s["objects"][1]["colour"]:
            bind.append(s)
    train_images = render_all(train)[0]
    test_images = render_all(test)[0]
    cls_images, _, cls_masks = render_all(cls)
    seg_images, seg_masks, _ = render_all(seg)
    bind_images = render_all(bind)[0]
    dis = [binding_distractors(s) for s in bind]
    return {
        "train": PairSet(train_images, [caption(s, int(rng.integers(5))) for s in train],
                         torch.arange(n_train)),
        "test": PairSet(test_images, [caption(s, k) for s in test for k in range(5)],
                        torch.arange(n_test).repeat_interleave(5)),
        "cls": LabelSet(cls_images, torch.tensor([CLASS_NAMES.index(f"{s['objects'][0]['colour']} {s['objects'][0]['shape']}")
                                                  for s in cls]), CLASS_NAMES, TEMPLATES, cls_masks),
        "seg": MaskSet(seg_images, seg_masks, SHAPES, TEMPLATES),
        "binding": BindingSet(bind_images, [caption(s, 0) for s in bind],
                              {k: [d[k] for d in dis] for k in dis[0]}),
    }


def pretrain_images(n, seed):
    """Labelled images for the image encoder's unimodal (supervised) pretraining: images and
    colour-shape-class masks (24 classes, IGNORE = background). No captions are involved."""
    rng = np.random.default_rng(seed)
    images, _, object_masks = render_all([sample_scene(rng, int(rng.integers(1, 4))) for _ in range(n)])
    return images, object_masks


DATASETS = {"shapes": shapes_world}
