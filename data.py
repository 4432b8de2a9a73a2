"""Datasets: the built-in Shapes world (the default, no files needed) and real sets on disk.

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

The Shapes world: 1-3 coloured shapes in two sizes on varied backgrounds,
captions that bind attributes and relations ("a small red circle to the left
of a large blue square"), five paraphrases per test image like COCO's Karpathy
test, and minimal-pair distractors for a binding test (with held-out wordings
and object pairs, docs/binding.md).
"""
import collections
import functools
import hashlib
import json
import os
import re
import stat
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

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
             if p["colour"] != q["colour"] and p["shape"] != q["shape"] and frozenset([phrase(p), phrase(q)]) not in seen]

    def draw(make, style):
        scenes, rows = [], []
        while len(scenes) < n:
            s = make()
            a, b = s["objects"]
            true, dis = minimal_pairs(s, style(len(scenes)))
            if a["colour"] != b["colour"] and a["shape"] != b["shape"] and not ({true, *dis.values()} & taken):
                scenes.append(s)
                rows.append((true, dis))
        return render_all(scenes)[0], rows

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


# ---------------------------------------------------------------------------
# Composition-aware hard negatives (NegCLIP; "When and why vision-language models behave like
# bags-of-words", Yuksekgonul et al., ICLR 2023)
# ---------------------------------------------------------------------------
# For each training caption, captions that use the same words but bind them
# differently. The Shapes world makes them from the scene (scene_swaps); any other
# caption gets a rule over its noun phrases (word_swaps), with no list of nouns.
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


# The closed word classes the rule reads (open classes, nouns and adjectives, are whatever they delimit).
DETERMINERS = {"a", "an", "the", "this", "that", "these", "those", "its", "his", "her", "their", "my", "your",
               "our", "some", "one", "two", "three", "four", "five", "several", "many", "another", "each"}
# asymmetric relations only ("next to", "near", "with" read the same both ways); longest first
RELATION_WORDS = ["to the left of", "to the right of", "on top of", "in front of", "left of", "right of", "above",
                  "below", "under", "underneath", "beneath", "behind", "inside", "on", "in"]
BOUNDARY = {"and", "or", "but", "with", "of", "at", "by", "for", "from", "to", "into", "onto", "near", "next",
            "beside", "over", "through", "down", "up", "across", "along", "around", "while", "as", "is", "are",
            "was", "were", "be", "has", "have", "there", "that", "which", "who", "it", "them", "above", "below",
            "under", "underneath", "beneath", "behind", "inside", "on", "in"}  # ends a noun phrase
AUXILIARIES = {"is", "are", "was", "were", "sits", "sit", "stands", "stand", "lies", "lie", "being"}


def _words(text):
    return re.findall(r"[\w']+|[^\w\s]", text)


def _join(words, spaced):
    """The words as one caption: a space before each word, and before punctuation where the caption had one."""
    return "".join((" " if k and (gap or w[:1].isalnum()) else "") + w for k, (w, gap) in enumerate(zip(words, spaced)))


def _verb_form(word):
    return len(word) > 4 and (word.endswith("ing") or word.endswith("ed"))


def noun_phrases(words):
    """Noun phrases as (start, end) spans of a word list, end exclusive: a determiner (or the caption's
    first word), then modifiers and a noun, up to the first closed-class word, punctuation or verb form
    (a word ending in -ing / -ed after the phrase's first word); the noun is the span's last word."""
    low, spans, i = [w.lower() for w in words], [], 0
    while i < len(low):
        if low[i] in DETERMINERS or (i == 0 and low[i].isalpha() and low[i] not in BOUNDARY):
            c = j = i + (low[i] in DETERMINERS)                        # c: the first modifier or noun
            while j < len(low) and low[j].isalpha() and low[j] not in BOUNDARY and low[j] not in DETERMINERS \
                    and not (j > c and _verb_form(low[j])):
                j += 1
            if j > c:
                spans.append((i, j))
                i = j
                continue
        i += 1
    return spans


def _articles(words):
    """a / an agreeing with the next word (a swap can put "old" after "a")."""
    def fix(x, n):
        if x.lower() not in ("a", "an"):
            return x
        a = "an" if n[:1].lower() in "aeiou" else "a"
        return a.capitalize() if x[:1].isupper() else a
    return [fix(x, n) for x, n in zip(words, words[1:] + [""])]


def word_swaps(text):
    """Hard negatives of any caption by a rule over its noun phrases (noun_phrases, no list of nouns):

    1. attribute swap: the first two noun phrases with modifiers (words between the determiner and
       the noun) exchange their modifiers nearest the noun that differ
       ("a red bus next to a white car" -> "a white bus next to a red car");
    2. object swap: at the first relation phrase (RELATION_WORDS, asymmetric, longest first) that has
       a noun phrase right after it and one before it (at most two auxiliaries or verb forms between),
       the two noun phrases exchange places ("a cat sitting on a table" -> "a table sitting on a cat").
    Returns the swaps that apply (0, 1 or 2 captions), each different from the text."""
    w = _words(text)
    low = [x.lower() for x in w]
    spaced = [m.start() > 0 and text[m.start() - 1].isspace() for m in re.finditer(r"[\w']+|[^\w\s]", text)]
    spans, perms = noun_phrases(w), []
    det = lambda s: int(low[s[0]] in DETERMINERS)
    mods = [s for s in spans if s[1] - s[0] - det(s) >= 2]            # determiner, >= 1 modifier, noun
    if len(mods) >= 2:
        (i0, j0), (i1, j1) = mods[:2]
        m0, m1 = range(j0 - 2, i0 + det(mods[0]) - 1, -1), range(j1 - 2, i1 + det(mods[1]) - 1, -1)
        pair = next(((p, q) for p, q in zip(m0, m1) if low[p] != low[q]), None)  # nearest the noun first
        if pair:
            perm = list(range(len(w)))
            perm[pair[0]], perm[pair[1]] = pair[1], pair[0]
            perms.append(perm)
    starts = {s[0]: s for s in spans}
    for at in range(len(low)):
        rel = next((r.split() for r in RELATION_WORDS if low[at:at + len(r.split())] == r.split()), None)
        if rel is None or at + len(rel) not in starts:
            continue
        before = [s for s in spans if s[1] <= at and all(low[k] in AUXILIARIES or _verb_form(low[k])
                                                          for k in range(s[1], at)) and at - s[1] <= 2]
        if before:
            (i0, j0), (i1, j1) = before[-1], starts[at + len(rel)]
            k = list(range(len(w)))
            perms.append(k[:i0] + k[i1:j1] + k[j0:i1] + k[i0:j0] + k[j1:])
        break                                                         # the first relation phrase that starts one
    out = []
    for perm in perms:
        v = [w[k] if k else low[0] if low[0] in DETERMINERS else w[0] for k in perm]  # the capital stays first
        if w[0][:1].isupper():
            v[0] = v[0][:1].upper() + v[0][1:]
        out.append(_join(_articles(v), [spaced[k] for k in perm]))
    return [c for c in dict.fromkeys(out) if c.lower() != text.lower()]  # once each (same-shape objects: one)


def text_corpus(n, seed):
    """Captions of n random scenes, no images: the text encoder's unimodal pretraining corpus."""
    rng = np.random.default_rng(seed)
    out = [caption(sample_scene(rng, int(rng.integers(1, 4))), int(rng.integers(5))) for _ in range(n)]
    out += [t.format(c) for c in CLASS_NAMES for t in TEMPLATES] + [t.format(s) for s in SHAPES for t in TEMPLATES]
    return out


def render_all(scenes):
    images, shape_masks, object_masks = zip(*(render(s) for s in scenes))
    images = torch.from_numpy(np.stack([i.permute(1, 2, 0).numpy() for i in images])).permute(0, 3, 1, 2)  # (N, 3, S, S)
    return images.contiguous(), torch.stack(shape_masks), torch.stack(object_masks)  # one copy, not N strided ones


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
    train_images = render_all(train)[0]
    test_images = render_all(test)[0]
    cls_images, _, cls_masks = render_all(cls)
    seg_images, seg_masks, _ = render_all(seg)
    bind_images = render_all(bind)[0]
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
        "cls": LabelSet(cls_images, torch.tensor([CLASS_NAMES.index(f"{s['objects'][0]['colour']} {s['objects'][0]['shape']}")
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
#    filename / split / sentences, every sentence's "raw"), and every image and
#    mask file is checked to exist and be non-empty, each fault one `error:`
#    line naming the file. A file that exists but cannot be decoded (truncated,
#    a decompression bomb) is one line naming it when it is read; there are no
#    worker processes. A mask must have its image's size (their crops cover the same pixels),
#    be a one-band PNG (not RGB, not a JPEG) and hold only the set's labels and 255, and a
#    segmentation ids file must list each image once (its pixels would count twice).
# 5. 16-bit grey images (PIL modes I;16, I) are scaled to 8 bits (/ 257), not
#    clipped at 255; float grey images (mode F, float TIFFs) in [0, 1] are scaled by 255, others
#    taken as 0..255; 16-bit colour PNGs PIL already reads as 8-bit RGB.
# 6. identity(): what features of a set are computed from, for the feature
#    cache key and the training checkpoint: image files by path, size and
#    modification time (one stat each, where a content hash of COCO's images
#    would read 19 GB on every run), texts and in-memory images by content.
SEG_SIZE = 224  # side of the stored segmentation masks (the usual ViT input side)


def rgb(img):
    """A PIL image as 8-bit RGB; 16- and 32-bit grey images scaled from 0..65535 to 0..255, not clipped,
    float grey images in [0, 1] scaled by 255."""
    from PIL import Image
    if img.mode.startswith("I;16") or img.mode == "I":
        grey = np.clip(np.round(np.asarray(img, dtype=np.float64) / 257), 0, 255).astype(np.uint8)
        img = Image.fromarray(grey)                                     # mode L
    elif img.mode == "F":                                               # 32-bit float grey (a float TIFF)
        a = np.asarray(img, dtype=np.float64)
        scale = 255 if np.nanmax(a, initial=0) <= 1 else 1             # floats in [0, 1], else already 0..255
        img = Image.fromarray(np.clip(np.round(np.nan_to_num(a) * scale), 0, 255).astype(np.uint8))
    return img.convert("RGB")


def file_scan(paths):
    """(identity, missing, empty) of image files: a hash of every path, size and mtime, one stat each."""
    lines, missing, empty = [], [], []
    for p in map(os.path.realpath, paths):              # a file by its real path: a symlinked root is the same data
        try:
            st = os.stat(p)
        except OSError:
            missing.append(Path(p))
            continue
        if not stat.S_ISREG(st.st_mode):                                 # a folder where an image should be
            missing.append(Path(p))
            continue
        if st.st_size == 0:
            empty.append(Path(p))
        lines.append(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n")
    return "files " + hashlib.sha1("".join(lines).encode()).hexdigest()[:16], missing, empty


def tree_identity(folder):
    """identity of every file under folder (a torchvision set's download), by path, size and mtime."""
    return file_scan(sorted(p for p in Path(folder).rglob("*") if p.is_file()))[0]


class LazyImages:
    """A sequence of images opened one at a time: item i = load(keys[i]) as an RGB PIL image.

    keys are file paths (load = PIL open) or indices into a torchvision dataset.
    square=True centre-crops to a square (segmentation sets). Slicing gives a lazy view.
    listed_in: the file that lists the images (named in the error of a file that cannot be read).
    source: for keys that are not paths, a callable giving the identity of what they are read from.
    """

    def __init__(self, keys, load=None, square=False, listed_in=None, source=None):
        self.keys, self.load, self.square, self.listed_in, self.source = list(keys), load, square, listed_in, source
        self._scan = None

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return LazyImages(self.keys[i], self.load, self.square, self.listed_in, self.source)
        from PIL import Image
        key = self.keys[i]
        try:
            img = rgb(self.load(key) if self.load else Image.open(key))  # also forces the decode: a broken file fails here
        except Exception as e:
            bomb = isinstance(e, Image.DecompressionBombError)
            fix = ("if the image is genuine, downscale it" if bomb else "replace it (extract it again from its archive)") \
                + (f" or remove its entry from {self.listed_in}" if self.listed_in else "")
            raise SystemExit(f"error: cannot read image {key} ({type(e).__name__}: {e}); {fix}") from None
        return centre_square(img) if self.square else img

    def scan(self):
        """(identity, missing files, empty files), computed once (file_scan; one stat per file)."""
        if self._scan is None:
            if self.load is None:
                self._scan = file_scan(self.keys)
            else:
                self._scan = (f"{self.source() if self.source else 'unknown'} rows {hash_values(self.keys)}", [], [])
        return self._scan

    def check(self, what):
        """Stop with one line when any file is missing or empty, before any encoder runs."""
        _, absent, empty = self.scan()
        for bad, how in ((absent, "missing"), (empty, "empty (0 bytes)")):
            if bad:
                raise SystemExit(f"error: {len(bad)} of {len(self)} {what} are {how}, e.g. {bad[0]}; restore them "
                                 f"(extract them again from their archive)"
                                 + (f" or remove their entries from {self.listed_in}" if self.listed_in else ""))


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
    raise SystemExit(f"error: {what} not found at {path}.\nExpected layout:\n{layout}\nDownload: {url}")


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
SPLIT_FILE = 'a Karpathy split file: {"images": [{"filename", "split", "sentences": [{"raw"}, ...]}, ...]}'


def read_split_file(path):
    """The entries of a Karpathy split file, every field this loader reads checked: one `error:` line per fault."""
    again = "unpack it again from caption_datasets.zip"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")                # a byte-order mark (an editor's UTF-8) is not a fault
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise SystemExit(f"error: {path}: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}) is not UTF-8; "
                         f"save the file as UTF-8 or {again}") from None
    try:
        split_file = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}; "
                         f"truncated?); {again}") from None
    entries = split_file.get("images") if isinstance(split_file, dict) else None
    if not isinstance(entries, list):
        raise SystemExit(f"error: {path} has no \"images\" list: it is not {SPLIT_FILE}")
    for i, e in enumerate(entries):
        where = f"{path}: images[{i}]" + (f" ({e['filename']})" if isinstance(e, dict) and e.get("filename") else "")
        if not isinstance(e, dict):
            raise SystemExit(f"error: {where} is not an object: it is not {SPLIT_FILE}")
        for field_, kind in (("filename", str), ("split", str), ("sentences", list)):
            if not isinstance(e.get(field_), kind) or (field_ == "filename" and not e[field_]):
                raise SystemExit(f"error: {where} has no {field_!r} ({kind.__name__}); fix or remove that entry, "
                                 f"or {again}")
        if not isinstance(e.get("filepath", ""), str):
            raise SystemExit(f"error: {where}: its 'filepath' is not a folder name (str); fix or remove that entry, "
                             f"or {again}")
        for k, s in enumerate(e["sentences"]):
            if not isinstance(s, dict) or not isinstance(s.get("raw"), str):
                raise SystemExit(f"error: {where}: sentences[{k}] has no 'raw' text; fix or remove that sentence, "
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
        j = seen.setdefault(f, i)
        if j != i:
            why = "a test image that is also a training image inflates the test numbers" \
                if e["split"] != entries[j]["split"] else "each image is listed once, with all its captions"
            raise SystemExit(f"error: {path}: images[{j}] ({entries[j]['split']}) and images[{i}] ({e['split']}) are "
                             f"the same image {f} ({why}); remove one of the two entries")


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
                raise SystemExit(f"error: {listed_in}: {e['split']} image {e['filename']}: sentences[{k}] {why}; "
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
            raise SystemExit(f"error: {base / split_file} has no images in split {split!r} (its splits: "
                             f"{found or 'none'}); this loader trains on Karpathy's 'train' and tests on 'test': "
                             f"name the splits so, or unpack it again from caption_datasets.zip")
        sets[split], dropped = karpathy_pairs(chosen, base / image_dir, n_captions, base / split_file)
        if dropped:
            print(f"[data] {name} {split}: {dropped} image(s) without captions left out")
        images = sets[split].images
        _, absent, _ = images.scan()
        if len(absent) == len(images):                                       # a wrong folder, not a few lost files
            missing(f"{name} {split} images (e.g. {images.keys[0].name})", images.keys[0].parent, layout, url)
        images.check(f"{name} {split} images")
    print(f"[data] {name}: {len(sets['train'].images)} train pairs, {len(sets['test'].images)} test images / "
          f"{len(sets['test'].captions)} captions")
    return sets


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


def pretty(name):
    """A class name as words: "AnnualCrop" -> "annual crop", "aquarium_fish" -> "aquarium fish"."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).replace("_", " ").lower().strip()


def torchvision_set(name, root):
    """LabelSet of one torchvision classification set's test split, or None (one printed line) when absent."""
    import torchvision.datasets as tvd
    cls, kwargs, label_attr, names_attr = TORCHVISION_SETS[name]
    try:
        ds = getattr(tvd, cls)(str(Path(root) / name), download=False, **kwargs)
    except (RuntimeError, FileNotFoundError, OSError) as e:
        print(f"[data] {name}: not found under {Path(root) / name} (optional; put torchvision's {cls}(root=..., "
              f"download=True) layout there) - skipped [{type(e).__name__}]")
        return None
    labels = torch.as_tensor(np.asarray(getattr(ds, label_attr)), dtype=torch.long)
    names = [pretty(c) for c in getattr(ds, names_attr)]
    images = LazyImages(range(len(ds)), load=lambda i: ds[i][0], source=lambda: tree_identity(Path(root) / name))
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
    try:
        size = Image.open(image).size if image is not None else None              # its header only
    except Exception as e:
        raise SystemExit(f"error: cannot read image {image} ({type(e).__name__}: {e}); replace it (extract it "
                         f"again from its archive)") from None
    again = "use the set's own label PNGs (extract them again from their archive)"
    try:
        m = Image.open(path)
        if size not in (None, m.size):
            raise SystemExit(f"error: mask {path} is {m.size[0]} x {m.size[1]} pixels but its image {image} is "
                             f"{size[0]} x {size[1]}: one of them belongs to another image; extract both again "
                             f"from their archive")
        if m.format == "JPEG":                                                    # lossy: labels change at edges
            raise SystemExit(f"error: mask {path} is a JPEG: its lossy compression changes the labels along every "
                             f"edge; {again}")
        if len(m.getbands()) > 1:                                                 # RGB, RGBA, LA: colours
            raise SystemExit(f"error: mask {path} is a colour image (mode {m.mode}): its pixels are colours, not "
                             f"class labels (a palette mask saved as {m.mode}?); {again}, one label per pixel")
        a = np.asarray(m)                                                         # every pixel, before the crop
        bad = (a > top) & (a != IGNORE)
        if bad.any():
            raise SystemExit(f"error: mask {path} holds label {int(a[bad].min())} on {int(bad.sum())} pixels, but "
                             f"this set's labels are 0..{top} and {IGNORE} (unlabelled): it is not one of its label "
                             f"PNGs (a palette mask saved as grey reads colours as labels); {again}")
        m = centre_square(m).resize((SEG_SIZE, SEG_SIZE), Image.NEAREST)
        return torch.from_numpy(lut[np.asarray(m, dtype=np.uint8)])
    except Exception as e:
        raise SystemExit(f"error: cannot read mask {path} ({type(e).__name__}: {e}); replace it (extract it again "
                         f"from its archive)") from None


def segmentation_set(name, root):
    """MaskSet of one segmentation set's validation split, or None (one printed line) when absent."""
    ids_file, image_pattern, mask_pattern, names, first_label = SEGMENTATION_SETS[name]
    root = Path(root)
    if ids_file is None:  # ADE20K: every annotation file of the folder
        folder = (root / mask_pattern).parent
        masks = folder.glob("*.png") if folder.is_dir() else []
        ids = sorted(p.stem for p in masks if not p.name.startswith("._"))   # ._x.png: macOS's metadata of x.png
    else:
        ids = (root / ids_file).read_text(encoding="utf-8-sig").split() if (root / ids_file).exists() else []
        twice = [i for i, n in collections.Counter(ids).items() if n > 1]
        if twice:                               # its pixels would count twice in every class's IoU
            raise SystemExit(f"error: {root / ids_file} lists {twice[0]} {ids.count(twice[0])} times "
                             f"({len(twice)} id(s) listed more than once); list each image once")
    if not ids:
        print(f"[data] {name}: not found under {root} (optional; expected {ids_file or mask_pattern}; "
              f"from {SEGMENTATION_URLS[name]}) - skipped")
        return None
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
    for name in SEGMENTATION_SETS:
        sets[name] = segmentation_set(name, root)
    return {k: v for k, v in sets.items() if v is not None}


def coco(root="data"):
    """COCO 2014 + Karpathy split (train: one caption per image; test: 5K / 25K), plus the
    evaluation sets found under root (and Flickr30K's test split as "flickr" when present)."""
    sets = karpathy_dataset(root, "coco", "dataset_coco.json", "", COCO_LAYOUT, COCO_URL, "COCO")
    flickr_dir = Path(root) / "flickr30k"
    if (flickr_dir / "dataset_flickr30k.json").exists():
        sets["flickr"] = karpathy_dataset(root, "flickr30k", "dataset_flickr30k.json", "flickr30k-images",
                                          FLICKR_LAYOUT, FLICKR_URL, "Flickr30K")["test"]
    return sets | evaluation_sets(root)


def flickr(root="data"):
    """Flickr30K + Karpathy split (train: one caption per image; test: 1K / 5K), plus the evaluation sets."""
    sets = karpathy_dataset(root, "flickr30k", "dataset_flickr30k.json", "flickr30k-images",
                            FLICKR_LAYOUT, FLICKR_URL, "Flickr30K")
    return sets | evaluation_sets(root)


DATASETS = {"shapes": shapes_world, "coco": coco, "flickr": flickr}
