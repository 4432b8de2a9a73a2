"""The Shapes world: the built-in dataset (the default run's; no files, no network).

Scenes of 1-3 coloured shapes in two sizes on varied backgrounds, rendered at SIZE x SIZE,
with captions that bind attributes and relations ("a small red circle to the left of a large
blue square"), five paraphrases per test image like COCO's Karpathy test, zero-shot
classification and segmentation sets over its 24 colour-shape classes, and minimal-pair
distractors for a binding test (with held-out wordings and object pairs, docs/binding.md).
shapes_world() returns the sets in data.py's containers; cached_world keeps them on disk.
"""
import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

from data import IGNORE, BindingSet, LabelSet, MaskSet, PairSet

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


_CENTRES = np.mgrid[0:SIZE, 0:SIZE] + 0.5          # (2, S, S) pixel centres (y, x), made once (render is the cold path)


_UNIT = np.mgrid[0:SIZE, 0:SIZE] / SIZE - 0.5      # (2, S, S) pixel corners in [-0.5, 0.5), the background gradient


def shape_mask(obj):
    """(SIZE, SIZE) bool: the pixels covered by one object."""
    yy, xx = _CENTRES
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
    yy, xx = _UNIT
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


# Held-out phrasings (never in training, the test set or the text encoder's corpus): where a
# is relative to b (rel), stated with b named first, the relation word first, each object
# with its own side, "b has a on its left", the passive, and a pronoun.
SIDE = {"left": "to the left", "right": "to the right", "above": "above", "below": "below"}


ON_ITS = {"left": "on its left", "right": "on its right", "above": "above it", "below": "below it"}


PASSIVE = {"left": "flanked on the left by", "right": "flanked on the right by", "above": "topped by",
           "below": "propped up by"}


HELD_OUT_TEMPLATES = [
    lambda A, rel, B: f"{RELATIONS[rel]} {B} is {A}",                           # relation word first
    lambda A, rel, B: f"{B} is {SIDE[OPPOSITE[rel]]} and {A} is {SIDE[rel]}",   # each object its own side
    lambda A, rel, B: f"{B} has {A} {ON_ITS[rel]}",                             # "X has Y on its left"
    lambda A, rel, B: f"{B} is {PASSIVE[rel]} {A}",                             # passive
    lambda A, rel, B: f"{B} , with {A} {RELATIONS[rel]} it",                    # b first, a pronoun
]


def state(a, rel, b, style):
    """A two-object caption: a is `rel` of b, in training style 0..4 or held-out template "h0".."h4"."""
    if isinstance(style, str):
        return HELD_OUT_TEMPLATES[int(style[1:])](phrase(a), rel, phrase(b))
    return caption(None, style, rel_override=rel, objects=[a, b])


def minimal_pairs(scene, style):
    """A two-object scene's true caption and its three minimal pairs in one style (training or held-out):
    attribute swap (the colours exchanged), relation-word swap (the relation word reversed, the objects
    in place) and object-order swap (the objects exchanged, the same relation words; ARO's VG-Relation)."""
    a, b = scene["objects"]
    rel = relation(a, b)
    return state(a, rel, b, style), {
        "attribute_swap": state(dict(a, colour=b["colour"]), rel, dict(b, colour=a["colour"]), style),
        "relation_swap": state(a, OPPOSITE[rel], b, style),
        "object_swap": state(b, rel, a, style)}


def place(rng, specs):
    """A scene of the given objects (dicts with shape, colour, size) at random non-overlapping places."""
    objects = []
    while len(objects) < len(specs):
        spec = specs[len(objects)]
        r = int(rng.integers(*RADIUS[spec["size"]], endpoint=True))
        x, y = rng.integers(r + 1, SIZE - r - 1, size=2)
        if all((x - o["x"]) ** 2 + (y - o["y"]) ** 2 > (r + o["r"] + 3) ** 2 for o in objects):
            objects.append(dict(spec, x=int(x), y=int(y), r=r))
    background = dict(base=rng.uniform(60, 200), tint=rng.uniform(-15, 15, size=3),
                      gradient=rng.uniform(-40, 40, size=2), noise_seed=int(rng.integers(2**31)))
    return dict(objects=objects, background=background)


def related_pairs(scenes):
    """The unordered pairs of object phrases (size colour shape) whose relation the scenes' captions state."""
    return {frozenset([phrase(s["objects"][0]), phrase(s["objects"][1])]) for s in scenes if len(s["objects"]) >= 2}


OBJECT_TYPES = [dict(size=z, colour=c, shape=h) for z in RADIUS for c in COLOUR_NAMES for h in SHAPES]


def binding_sets(seed, n, train, bind, bind_images, taken):
    """The harder binding test: BindingSets of two-object scenes, three minimal pairs each
    (minimal_pairs), n scenes each. Drawn from their own RNG stream, after the world's sets, so the
    training and test data do not depend on them.

    canonical: the binding set's scenes and images in style 0 (its attribute and relation swaps are
               the binding set's).
    styles:    new scenes, scene i in training style i % 5.
    templates: new scenes, scene i in held-out template i % 5 (HELD_OUT_TEMPLATES).
    combos:    new scenes of two objects that no training caption relates to each other
               (related_pairs), scene i in style i % 4 (the styles that name sizes).
    The new scenes' objects differ in colour AND shape, so the three swaps are three different
    captions (and style 3's "the circle is left of the square" names each object once); no true
    caption or distractor is in `taken` (the training hard negatives)."""
    rng = np.random.default_rng((seed, 1))
    seen = related_pairs(train)
    novel = [(p, q) for i, p in enumerate(OBJECT_TYPES) for q in OBJECT_TYPES[i + 1:]
             if p["colour"] != q["colour"] and p["shape"] != q["shape"]
             and frozenset([phrase(p), phrase(q)]) not in seen]

    def draw(make, style):
        scenes, rows = [], []
        while len(scenes) < n:
            s = make()
            a, b = s["objects"]
            true, dis = minimal_pairs(s, style(len(scenes)))
            if a["colour"] != b["colour"] and a["shape"] != b["shape"] and not ({true, *dis.values()} & taken):
                scenes.append(s)
                rows.append((true, dis))
        return render_all(scenes, masks=False)[0], rows

    def novel_pair():
        p, q = novel[rng.integers(len(novel))]
        return place(rng, [p, q] if rng.integers(2) else [q, p])

    groups = {"canonical": (bind_images, [minimal_pairs(s, 0) for s in bind]),
              "styles": draw(lambda: sample_scene(rng, 2), lambda i: i % 5),
              "templates": draw(lambda: sample_scene(rng, 2), lambda i: f"h{i % len(HELD_OUT_TEMPLATES)}"),
              "combos": draw(novel_pair, lambda i: i % 4)}
    return {f"binding_{g}": BindingSet(images, [t for t, _ in rows], {k: [d[k] for _, d in rows] for k in rows[0][1]})
            for g, (images, rows) in groups.items()}


def binding_distractors(scene):
    """Minimal pairs of the canonical caption: colours of the first two objects swapped; relation reversed."""
    a, b = scene["objects"][:2]
    swapped = [dict(a, colour=b["colour"]), dict(b, colour=a["colour"])] + scene["objects"][2:]
    return {"attribute_swap": caption(scene, 0, objects=swapped),
            "relation_swap": caption(scene, 0, rel_override=OPPOSITE[relation(a, b)])}


def scene_swaps(scene, style, object_order=True):
    """Hard negatives of a scene's caption in paraphrase style `style` (0..4), from the scene itself.

    attribute swap: the colours of the first two objects exchanged (if they differ);
    relation swap: their relation reversed (if their phrases differ, else it stays true);
    object-order swap: the two objects exchanged under the same relation words (ARO's VG-Relation swap).
    A one-object scene has none. Every swap differs from the true caption and from the others
    (two objects that differ only in colour have one attribute and object-order swap)."""
    if len(scene["objects"]) < 2:
        return []
    a, b = scene["objects"][:2]
    true, out = caption(scene, style), []
    if a["colour"] != b["colour"]:
        swapped = [dict(a, colour=b["colour"]), dict(b, colour=a["colour"])] + scene["objects"][2:]
        out.append(caption(scene, style, objects=swapped))
    if phrase(a, style != 4) != phrase(b, style != 4):
        out.append(caption(scene, style, rel_override=OPPOSITE[relation(a, b)]))
        if object_order:
            out.append(caption(scene, style, rel_override=relation(a, b), objects=[b, a] + scene["objects"][2:]))
    return [c for c in dict.fromkeys(out) if c != true]


def text_corpus(n, seed):
    """Captions of n random scenes, no images: the text encoder's unimodal pretraining corpus."""
    rng = np.random.default_rng(seed)
    out = [caption(sample_scene(rng, int(rng.integers(1, 4))), int(rng.integers(5))) for _ in range(n)]
    out += [t.format(c) for c in CLASS_NAMES for t in TEMPLATES] + [t.format(s) for s in SHAPES for t in TEMPLATES]
    return out


def render_all(scenes, masks=True):
    """(images (N, 3, S, S) uint8, shape masks (N, S, S), colour-shape masks (N, S, S)), each scene written
    in place (no list of N renders and no stacked copy: 6,000 renders' int64 masks alone were 0.8 GB);
    masks=False: (images, None, None)."""
    images = torch.empty(len(scenes), 3, SIZE, SIZE, dtype=torch.uint8)
    shape_masks, object_masks = (torch.empty(len(scenes), SIZE, SIZE, dtype=torch.int64) if masks else None
                                 for _ in range(2))
    for i, scene in enumerate(scenes):
        images[i], shape_mask, object_mask = render(scene)
        if masks:
            shape_masks[i], object_masks[i] = shape_mask, object_mask
    return images, shape_masks, object_masks


@functools.lru_cache(maxsize=2)  # built once per process (tests run align.main many times); read-only
def shapes_world(seed=0, n_train=6000, n_test=500, n_cls=480, n_seg=300, n_bind=300):
    """The built-in dataset: a dict of the sets align.py trains and evaluates on.

    train: PairSet, one caption per image (as PAL's COCO setting), with each caption's
        scene_swaps as hard negatives (none of them a binding caption or distractor).
    test: PairSet, 5 paraphrases per image (styles 0..4), like the Karpathy test.
    cls: LabelSet of single-object images over the 24 colour-shape classes.
    seg: MaskSet over the 4 shape classes (background ignored).
    binding: BindingSet of two-object scenes with distractor captions.
    binding_canonical, binding_styles, binding_templates, binding_combos: the harder binding test
        (binding_sets), three minimal pairs per scene, held-out phrasings and object pairs.
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
    train_images = render_all(train, masks=False)[0]
    test_images = render_all(test, masks=False)[0]
    cls_images, _, cls_masks = render_all(cls)
    seg_images, seg_masks, _ = render_all(seg)
    bind_images = render_all(bind, masks=False)[0]
    dis = [binding_distractors(s) for s in bind]
    styles = [int(rng.integers(5)) for _ in train]   # the paraphrase style of each training caption
    # decontamination: no binding caption (true or distractor) is ever a training hard negative
    held_out = {c for s, d in zip(bind, dis) for c in [caption(s, 0), *d.values()]}
    swaps = [[c for c in scene_swaps(s, k, object_order=False) if c not in held_out] for s, k in zip(train, styles)]
    harder = binding_sets(seed, n_bind, train, bind, bind_images, {c for negs in swaps for c in negs})
    # the harder sets are drawn against the attribute and relation swaps; the object-order swaps are kept out of them
    held_out |= {c for b in harder.values() for c in [*b.captions, *(d for v in b.distractors.values() for d in v)]}
    hard_negatives = [[c for c in scene_swaps(s, k) if c not in held_out] for s, k in zip(train, styles)]
    return {
        "train": PairSet(train_images, [caption(s, k) for s, k in zip(train, styles)], torch.arange(n_train),
                         hard_negatives),
        "test": PairSet(test_images, [caption(s, k) for s in test for k in range(5)],
                        torch.arange(n_test).repeat_interleave(5)),
        "cls": LabelSet(cls_images,
                        torch.tensor([CLASS_NAMES.index(f"{s['objects'][0]['colour']} {s['objects'][0]['shape']}")
                                      for s in cls]), CLASS_NAMES, TEMPLATES, cls_masks),
        "seg": MaskSet(seg_images, seg_masks, SHAPES, TEMPLATES),
        "binding": BindingSet(bind_images, [caption(s, 0) for s in bind],
                              {k: [d[k] for d in dis] for k in dis[0]}),
        **harder,
    }


def pretrain_images(n, seed):
    """Labelled images for the image encoder's unimodal (supervised) pretraining: images and
    colour-shape-class masks (24 classes, IGNORE = background). No captions are involved."""
    rng = np.random.default_rng(seed)
    images, _, object_masks = render_all([sample_scene(rng, int(rng.integers(1, 4))) for _ in range(n)])
    return images, object_masks


# ---------------------------------------------------------------------------
# The world, cached on disk
# ---------------------------------------------------------------------------
# shapes_world renders 8,480 images (about 5 s of one core); the first run writes its sets to
# <cache-dir>/world/, keyed by the sizes, the seed and the bytes of this file and data.py (the code
# that draws and holds it), so an edit to the world never reads a stale one.
_WORLDS = {}  # built or read once per process (tests run align.main many times); read-only


def world_key(seed, sizes):
    """The world's cache key: the seed, the set sizes and the bytes of this file and data.py."""
    import data
    source = hashlib.sha1(b"".join(Path(f).read_bytes() for f in (__file__, data.__file__))).hexdigest()[:12]
    return "shapes-world-" + hashlib.sha1(repr((seed, source, sorted(sizes.items()))).encode()).hexdigest()[:12]


def cached_world(cache_dir, seed=0, **sizes):
    """shapes_world(seed, **sizes), read from cache_dir/world when built before (same sets, same
    tensors), else built and written there (atomic, checksummed)."""
    from infra.storage import atomic_save, safe_load
    key = world_key(seed, sizes)
    path = Path(cache_dir) / "world" / f"{key}.pt"
    if path in _WORLDS:
        return _WORLDS[path]
    saved = safe_load(path, expect_key=key)
    if saved is None:
        sets = shapes_world(seed, **sizes)
        atomic_save({"key": key, "sets": {name: (type(s).__name__, vars(s)) for name, s in sets.items()}}, path)
    else:
        kinds = {k.__name__: k for k in (PairSet, LabelSet, MaskSet, BindingSet)}
        sets = {name: kinds[kind](**fields) for name, (kind, fields) in saved["sets"].items()}
    _WORLDS[path] = sets
    return sets
