"""The Shapes world: deterministic, captions state the scene's facts, distractors are minimal pairs."""
import numpy as np
import torch

import data
import shapes
from features import Features
from shapes_encoders import WordTokenizer

SMALL = dict(n_train=12, n_test=4, n_cls=6, n_seg=3, n_bind=4)


def test_world_is_deterministic_from_its_seed():
    a, b, c = shapes.shapes_world(0, **SMALL), shapes.shapes_world(0, **SMALL), shapes.shapes_world(1, **SMALL)
    assert torch.equal(a["train"].images, b["train"].images) and a["train"].captions == b["train"].captions
    assert torch.equal(a["seg"].masks, b["seg"].masks)
    assert not torch.equal(a["train"].images, c["train"].images)


def test_set_layout_matches_the_karpathy_style_protocol():
    w = shapes.shapes_world(0, **SMALL)
    assert w["train"].images.shape == (12, 3, shapes.SIZE, shapes.SIZE) and w["train"].images.dtype == torch.uint8
    assert len(w["train"].captions) == 12 and torch.equal(w["train"].txt_to_img, torch.arange(12))
    assert len(w["test"].captions) == 20 and w["test"].txt_to_img.tolist() == [i // 5 for i in range(20)]
    assert w["cls"].labels.max() < len(shapes.CLASS_NAMES) and w["cls"].masks.shape == (6, shapes.SIZE, shapes.SIZE)
    assert set(w["seg"].masks.unique().tolist()) <= set(range(len(shapes.SHAPES))) | {data.IGNORE}


def test_relation_follows_the_larger_displacement():
    a = dict(shape="circle", size="small", colour="red", x=10, y=30, r=6)
    b = dict(shape="square", size="large", colour="blue", x=50, y=34, r=11)
    assert shapes.relation(a, b) == "left" and shapes.relation(b, a) == "right"
    c = dict(b, x=12, y=60)
    assert shapes.relation(a, c) == "above" and shapes.relation(c, a) == "below"
    scene = {"objects": [a, b]}
    assert shapes.caption(scene, 0) == "a small red circle to the left of a large blue square"
    assert shapes.caption(scene, 1) == "a large blue square to the right of a small red circle"
    assert shapes.caption(scene, 4) == "a red circle to the left of a blue square"


def test_binding_distractors_are_minimal_pairs():
    """Attribute swap: the same bag of words, in another binding. Relation swap: one relation word changed."""
    w = shapes.shapes_world(0, **SMALL)
    for true, attr, rel in zip(w["binding"].captions, *w["binding"].distractors.values()):
        assert attr != true and sorted(attr.split()) == sorted(true.split())
        diff = [(x, y) for x, y in zip(true.split(), rel.split()) if x != y]
        assert len(true.split()) == len(rel.split()) and len(diff) == 1


def test_masks_cover_exactly_the_drawn_pixels():
    obj = dict(shape="square", size="large", colour="green", x=32, y=32, r=10)
    scene = {"objects": [obj], "background": dict(base=100.0, tint=np.zeros(3), gradient=np.zeros(2), noise_seed=0)}
    img, shape_mask, object_mask = shapes.render(scene)
    inside = shape_mask == shapes.SHAPES.index("square")
    assert inside.sum() == 18 * 18  # |dx| <= 8.5 at pixel centres: 18 columns and rows
    assert (object_mask[inside] == shapes.CLASS_NAMES.index("green square")).all()
    assert (img[1][inside].float().mean() - shapes.COLOURS["green"][1]).abs() < 5


def test_tokenizer_pads_at_the_end_and_aligns_words():
    tok = WordTokenizer(["[PAD]", "[CLS]", "[MASK]", "[UNK]", "a", "red", "circle"])
    ids, mask = tok(["a red circle", "a circle"])
    assert ids.tolist() == [[1, 4, 5, 6], [1, 4, 6, 0]] and mask.tolist() == [[True] * 4, [True] * 3 + [False]]
    assert tok.words("a red circle") == ["[CLS]", "a", "red", "circle"]


def test_features_slicing_trims_padding_and_cat_pads():
    f = Features(tokens=torch.randn(3, 5, 2),
                 mask=torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).bool(),
                 pooled=torch.randn(3, 2))
    assert f[[0, 2]].tokens.shape == (2, 2, 2) and torch.equal(f[[0, 2]].tokens, f.tokens[[0, 2], :2])
    g = Features.cat([f[[0]], f[[1]]])
    assert g.tokens.shape == (2, 3, 2) and g.mask.tolist() == [[True, True, False], [True, True, True]]
    v = Features.from_vectors(torch.randn(4, 2))
    assert v.tokens.shape == (4, 1, 2) and v.mask.all()
