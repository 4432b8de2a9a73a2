"""Binding: hard negatives (data.py's scene swaps and noun-phrase rule, align.py --hard-negatives),
the harder binding test (shapes.binding_sets), the position-aware tiny CNN, and the relation-aware
variant methods/pal_rel.py.

Each test checks against an independent reference: exact strings written by hand,
naive loops over pairs / anchors / patches / words, and a linear probe.
"""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import random_features

import align
import negatives
import shapes
import shapes_encoders
from methods.cov import CoV
from methods.linear import Linear
from methods.pal import PAL
from methods.pal_rel import PALRel, grid_positions, sincos


# ---------------------------------------------------------------- the swaps (data.py)
def two_object_scene(colour_b="blue", shape_b="square", size_b="large"):
    a = dict(shape="circle", size="small", colour="red", x=10, y=30, r=6)       # left of b
    b = dict(shape=shape_b, size=size_b, colour=colour_b, x=50, y=32, r=12)
    return dict(objects=[a, b], background=None)


def test_scene_swaps_are_the_minimal_pairs_written_by_hand():
    s = two_object_scene()
    assert shapes.scene_swaps(s, 0) == ["a small blue circle to the left of a large red square",
                                      "a small red circle to the right of a large blue square",
                                      "a large blue square to the left of a small red circle"]
    assert shapes.scene_swaps(s, 1) == ["a large red square to the right of a small blue circle",
                                      "a large blue square to the left of a small red circle",
                                      "a small red circle to the right of a large blue square"]
    assert shapes.scene_swaps(s, 3, object_order=False) == [
        "a picture of a large red square and a small blue circle , the circle is to the left of the square",
        "a picture of a large blue square and a small red circle , the circle is to the right of the square"]
    # same colours: no attribute swap; identical phrases: reversing the relation would stay true
    same = two_object_scene(colour_b="red", shape_b="circle", size_b="small")
    assert shapes.scene_swaps(same, 0) == []
    assert shapes.scene_swaps(dict(objects=same["objects"][:1], background=None), 0) == []


def test_hard_negatives_never_hold_the_own_caption_and_always_differ():
    train = shapes.shapes_world()["train"]
    assert len(train.hard_negatives) == len(train.captions)
    n_with = 0
    for cap, negs in zip(train.captions, train.hard_negatives):
        assert cap not in negs and len(set(negs)) == len(negs) <= 3
        assert all(n != cap for n in negs)
        n_with += bool(negs)
    assert n_with > 0.6 * len(train.captions)   # every multi-object scene but the identical-object ones


def test_binding_captions_and_distractors_are_never_training_hard_negatives():
    world = shapes.shapes_world()
    sets = [v for k, v in world.items() if k.startswith("binding")]
    held_out = {c for b in sets for c in [*b.captions, *(d for v in b.distractors.values() for d in v)]}
    negatives = {c for negs in world["train"].hard_negatives for c in negs}
    assert negatives and not (negatives & held_out)
    assert sum(len(negs) == 3 for negs in world["train"].hard_negatives) > 0.4 * len(world["train"].captions)  # 45.5%


COCO_STYLE = {  # caption -> the swaps of the noun-phrase rule, written by hand
    "A red bus parked next to a white car.": ["A white bus parked next to a red car."],
    "A cat sitting on a table.": ["A table sitting on a cat."],
    "A man in a black shirt riding a brown horse.": ["A man in a brown shirt riding a black horse.",
                                                    "A black shirt in a man riding a brown horse."],
    "Two dogs playing in the snow.": ["The snow playing in two dogs."],
    "A dog lying under a wooden bench.": ["A wooden bench lying under a dog."],
    "A plate of food with a fork and a knife.": [],               # no modifiers, no asymmetric relation
    "A blue and yellow train at the station.": [],                # coordinated adjectives: not read
    "People walking down a busy street.": [],
    "A teddy bear on top of a bed.": ["A bed on top of a teddy bear."],
    "A kitchen with a stove and a sink.": [],
    "A koala sitting on a candy cane.": ["A candy cane sitting on a koala."],   # nouns in no list
    "An old man is standing behind a large red truck.": ["A red man is standing behind a large old truck.",
                                                         "A large red truck is standing behind an old man."],
}


def test_word_swap_rule_on_coco_style_captions():
    for caption, expected in COCO_STYLE.items():
        assert negatives.word_swaps(caption) == expected, caption
    applies = sum(bool(negatives.word_swaps(c)) for c in COCO_STYLE) / len(COCO_STYLE)
    assert applies == 8 / 12
    captions = shapes.shapes_world()["train"].captions
    frac = sum(bool(negatives.word_swaps(c)) for c in captions) / len(captions)
    assert abs(frac - 0.6558) < 1e-4             # 3935 of 6000: the captions that name two or three objects


def test_word_swaps_on_every_shapes_form_never_give_a_true_caption():
    """On fresh two-object scenes in the 5 training styles and the 5 held-out templates: no swap is a
    true caption of the scene in any form; in styles 0, 1, 2, 4 the rule finds exactly the attribute
    and object-order minimal pairs; the fraction of captions it applies to, per kind."""
    rng = np.random.default_rng(7)
    forms = list(range(5)) + [f"h{k}" for k in range(5)]
    counts = {f: [0, 0] for f in forms}
    n = 0
    while n < 200:
        s = shapes.sample_scene(rng, 2)
        a, b = s["objects"]
        if a["colour"] == b["colour"] or a["shape"] == b["shape"]:
            continue
        n += 1
        rows = {f: shapes.minimal_pairs(s, f) for f in forms}
        true = {t for t, _ in rows.values()}
        for f, (t, dis) in rows.items():
            swaps = negatives.word_swaps(t)
            assert t not in swaps and not (set(swaps) & true), (t, swaps)
            counts[f][0] += dis["attribute_swap"] in swaps
            counts[f][1] += len(set(swaps) - {dis["attribute_swap"]}) > 0
            if f in (0, 1, 2, 4):
                assert swaps == [dis["attribute_swap"], dis["object_swap"]]
    assert counts == {0: [200, 200], 1: [200, 200], 2: [200, 200], 3: [200, 200], 4: [200, 200],
                      "h0": [200, 0], "h1": [200, 0], "h2": [200, 103], "h3": [200, 103], "h4": [200, 0]}
    # h0 and h4 have no noun phrase on one side of the relation ("to the left of X is Y", "... of it"),
    # h1 no relation phrase of the list; h2 and h3 swap at "on" ("on its left", "on the left"), never "above it"


# ---------------------------------------------------------------- the harder binding test (shapes.binding_sets)
def replay_world(seed, n_train, n_test, n_cls, n_seg, n_bind):
    """The world's scenes drawn again exactly as shapes_world draws them, from its one stream."""
    rng = np.random.default_rng(seed)
    n_obj = lambda: int(rng.integers(1, 4))
    train = [shapes.sample_scene(rng, n_obj()) for _ in range(n_train)]
    test = [shapes.sample_scene(rng, n_obj()) for _ in range(n_test)]
    [shapes.sample_scene(rng, 1) for _ in range(n_cls)] + [shapes.sample_scene(rng, n_obj()) for _ in range(n_seg)]
    bind = []
    while len(bind) < n_bind:
        s = shapes.sample_scene(rng, 2)
        if s["objects"][0]["colour"] != s["objects"][1]["colour"]:
            bind.append(s)
    styles = [int(rng.integers(5)) for _ in train]
    return train, test, bind, styles


def test_harder_sets_leave_every_other_set_as_it_was():
    size = dict(n_train=40, n_test=6, n_cls=5, n_seg=5, n_bind=12)
    w = shapes.shapes_world(3, **size)
    train, test, bind, styles = replay_world(3, **size)
    assert w["train"].captions == [shapes.caption(s, k) for s, k in zip(train, styles)]
    assert torch.equal(w["train"].images, shapes.render_all(train)[0])
    assert w["test"].captions == [shapes.caption(s, k) for s in test for k in range(5)]
    assert w["binding"].captions == [shapes.caption(s, 0) for s in bind]
    c = w["binding_canonical"]                                    # the binding set plus its object-order swaps
    assert torch.equal(c.images, w["binding"].images) and c.captions == w["binding"].captions
    for kind in ("attribute_swap", "relation_swap"):
        assert c.distractors[kind] == w["binding"].distractors[kind]
    for name in ("binding_canonical", "binding_styles", "binding_templates", "binding_combos"):
        assert len(w[name].images) == len(w[name].captions) == 12 and list(w[name].distractors) == [
            "attribute_swap", "relation_swap", "object_swap"]


def test_minimal_pairs_written_by_hand():
    s = two_object_scene()                                       # a small red circle left of a large blue square
    assert shapes.minimal_pairs(s, 0) == ("a small red circle to the left of a large blue square", {
        "attribute_swap": "a small blue circle to the left of a large red square",
        "relation_swap": "a small red circle to the right of a large blue square",
        "object_swap": "a large blue square to the left of a small red circle"})
    assert shapes.minimal_pairs(s, 3)[1]["object_swap"] == \
        "a picture of a small red circle and a large blue square , the square is to the left of the circle"
    got = {f: shapes.minimal_pairs(s, f) for f in ("h0", "h1", "h2", "h3", "h4")}
    assert [t for t, _ in got.values()] == [
        "to the left of a large blue square is a small red circle",
        "a large blue square is to the right and a small red circle is to the left",
        "a large blue square has a small red circle on its left",
        "a large blue square is flanked on the left by a small red circle",
        "a large blue square , with a small red circle to the left of it"]
    assert got["h2"][1] == {"attribute_swap": "a large red square has a small blue circle on its left",
                            "relation_swap": "a large blue square has a small red circle on its right",
                            "object_swap": "a small red circle has a large blue square on its left"}


PHRASE = r"an? (?:(?:small|large) )?(?:" + "|".join(shapes.COLOUR_NAMES) + ") (?:" + "|".join(shapes.SHAPES) + ")"


def skeleton(caption):
    """The caption's wording with every object phrase and shape word replaced: its template."""
    return re.sub(r"\b(" + "|".join(shapes.SHAPES) + r")\b", "S", re.sub(PHRASE, "X", caption))


def test_held_out_templates_are_in_no_training_caption_and_pairs_in_no_training_relation():
    world = shapes.shapes_world()
    seen = {skeleton(c) for split in ("train", "test") for c in world[split].captions}
    assert len(seen) == 3 * 4 * 2 + 4   # 3 wordings (styles 0, 1, 4 share one) x 4 relations x 2 or 3 objects; 1 object
    assert not seen & {skeleton(c) for c in world["binding_templates"].captions}
    assert len({skeleton(c) for c in world["binding_templates"].captions}) == 5 * 4  # every template, relation
    train, _, _, _ = replay_world(0, 6000, 500, 480, 300, 300)
    related = shapes.related_pairs(train)
    phrases = lambda c: frozenset(re.findall(PHRASE, c)[:2])
    assert related == {phrases(shapes.caption(s, 0)) for s in train if len(s["objects"]) >= 2}
    combos = world["binding_combos"]
    assert all(len(phrases(c)) == 2 and phrases(c) not in related for c in combos.captions)
    assert len({phrases(c) for c in combos.captions}) == 25          # the 25 such pairs (colour and shape differ)
    styles = world["binding_styles"]
    assert sum(phrases(c) not in related for c in styles.captions if re.search("small|large", c)) == 10  # of 240


def test_harder_sets_swaps_are_three_different_false_captions():
    world = shapes.shapes_world()
    negatives = {c for negs in world["train"].hard_negatives for c in negs}
    for name in ("binding_styles", "binding_templates", "binding_combos"):
        s = world[name]
        for i, true in enumerate(s.captions):
            dis = [s.distractors[k][i] for k in ("attribute_swap", "relation_swap", "object_swap")]
            assert len({true, *dis}) == 4 and not ({true, *dis} & negatives)
            assert sorted(true.split()) == sorted(dis[0].split()) == sorted(dis[2].split())  # same words


# ---------------------------------------------------------------- align.py's hard-negative term
def naive_hard_negative_loss(method, img, txt, neg, has_neg, scale):
    """-log softmax over [the B captions, image i's own swaps] at the true caption, one image at a time,
    on the score the method's contrastive loss scales (contrastive_score)."""
    B, M = has_neg.shape
    s = method.contrastive_score
    total = 0.0
    for i in range(B):
        v = method.embed_image(img[[i]])
        logits = [s(v, method.embed_text(txt[[j]]))[0, 0] for j in range(B)]
        logits += [s(v, method.embed_text(neg[[i * M + m]]))[0, 0] for m in range(M) if has_neg[i, m]]
        logits = torch.stack(logits) * scale
        total = total - logits.log_softmax(0)[i]
    return total / B


@pytest.mark.parametrize("make", [lambda: Linear(8, 6, K=5), lambda: PALRel(8, 6, K=7)])
def test_hard_negative_loss_matches_a_loop(make):
    torch.manual_seed(0)
    method = make()
    if isinstance(method, PALRel):
        torch.nn.init.normal_(method.U)          # a non-zero relation part
    B, M = 5, 2
    img = random_features(B, 5, 8, grid=(2, 2), seed=1)
    txt = random_features(B, 4, 6, lengths=[4, 3, 2, 4, 1], seed=2)
    neg = random_features(B * M, 4, 6, lengths=[4, 3] * B, seed=3)
    has_neg = torch.tensor([[True, True], [True, False], [False, False], [True, True], [False, True]])
    got = negatives.hard_negative_loss(method, img, txt, neg, has_neg, negatives.contrastive_scale(method))
    want = naive_hard_negative_loss(method, img, txt, neg, has_neg, negatives.contrastive_scale(method))
    assert torch.allclose(got, want, atol=1e-5)
    # the training loop's path: method.loss first, then the term on the same batch, same value
    method.loss(img, txt)
    after = negatives.hard_negative_loss(method, img, txt, neg, has_neg, negatives.contrastive_scale(method))
    assert torch.allclose(after, want, atol=1e-5)
    # no swaps at all: the term is the image -> text half of InfoNCE
    none = negatives.hard_negative_loss(method, img, txt, neg, torch.zeros(B, M, dtype=torch.bool), 1 / method.tau)
    S = method.score(method.embed_image(img), method.embed_text(txt)) / method.tau
    assert torch.allclose(none, F.cross_entropy(S, torch.arange(B)), atol=1e-5)


def test_filip_hard_negative_term_is_negclip_on_its_own_image_to_text_score():
    """FILIP's loss scales s_i2t (mean over patches of the max over words, its Eq. (4)) by 1 / tau; the
    NegCLIP term must use the same logits, not score()'s s_i2t + s_t2i in [-2, 2]."""
    from methods.filip import FILIP
    torch.manual_seed(0)
    filip = FILIP(8, 6, K=16)
    B, M = 6, 2
    img = random_features(B, 5, 8, grid=(2, 2), seed=1)
    txt = random_features(B, 4, 6, lengths=[4, 3, 2, 4, 1, 3], seed=2)
    neg = random_features(B * M, 4, 6, lengths=[4, 3] * B, seed=3)
    has_neg = torch.ones(B, M, dtype=torch.bool)

    def s_i2t(i, w):             # by hand: mean over image i's patches of the max over caption w's real words
        v = filip.embed_image(img[[i]])[0]                               # (H*W, K)
        y = filip.embed_text(w)[0][w.mask[0]]                            # (L_real, K)
        return torch.stack([max(v[q] @ y[l] for l in range(len(y))) for q in range(len(v))]).mean()

    total = 0.0
    for i in range(B):
        logits = [s_i2t(i, txt[[j]]) for j in range(B)] + [s_i2t(i, neg[[i * M + m]]) for m in range(M)]
        total = total - (torch.stack(logits) / filip.tau).log_softmax(0)[i]
    want = total / B
    with torch.no_grad():
        got = negatives.hard_negative_loss(filip, img, txt, neg, has_neg, negatives.contrastive_scale(filip))
    assert negatives.contrastive_scale(filip) == 1 / filip.tau
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    # and without swaps, the term is the image -> text half of FILIP's own InfoNCE logits
    from methods.cov import max_mean
    i2t = max_mean(filip.embed_image(img), filip.embed_text(txt))[0] / filip.tau
    with torch.no_grad():
        none = negatives.hard_negative_loss(filip, img, txt, neg, torch.zeros(B, M, dtype=torch.bool), 1 / filip.tau)
    assert torch.allclose(none, F.cross_entropy(i2t, torch.arange(B)), atol=1e-5)


def test_hard_negative_loss_has_finite_gradients_with_a_learned_scale():
    """SAIL's logit scale is a parameter: a row without swaps must not send 0 * -inf = NaN into its gradient
    (it did: SAIL --hard-negatives stopped with a NaN loss at step 2)."""
    from methods.sail import SAIL
    torch.manual_seed(0)
    sail = SAIL(8, 6, K=16, width=2)
    img = random_features(4, 5, 8, grid=(2, 2), seed=1)
    txt = random_features(4, 3, 6, seed=2)
    neg = random_features(8, 3, 6, seed=3)
    has_neg = torch.tensor([[True, False], [False, False], [True, True], [False, True]])
    scale = negatives.contrastive_scale(sail)
    loss = negatives.hard_negative_loss(sail, img, txt, neg, has_neg, scale)
    loss.backward()
    assert torch.isfinite(sail.log_t.grad) and sail.log_t.grad != 0
    assert all(torch.isfinite(p.grad).all() for p in sail.parameters() if p.grad is not None)
    with torch.no_grad():
        assert torch.allclose(loss, naive_hard_negative_loss(sail, img, txt, neg, has_neg, scale), atol=1e-5)


def test_hard_negative_loss_trains_cov_through_its_inference_only_score():
    """CoV marks score() no_grad; the term must still reach its parameters, at CoV's InfoNCE temperature."""
    torch.manual_seed(0)
    cov = CoV(8, 6, dim=16, n_regions=2)
    assert negatives.contrastive_scale(cov) == 1 / cov.tau_g
    img = random_features(4, 5, 8, grid=(2, 2), seed=1)
    txt = random_features(4, 3, 6, seed=2)
    neg = random_features(4, 3, 6, seed=3)
    loss = negatives.hard_negative_loss(cov, img, txt, neg, torch.ones(4, 1, dtype=torch.bool),
                                        negatives.contrastive_scale(cov))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in cov.parameters())


@pytest.mark.slow
def test_align_runs_with_hard_negatives_and_refuses_non_contrastive_methods(cache_dir, tmp_path, capsys):
    m = align.main(["--method", "linear", "--hard-negatives", "--epochs", "1", "--num-pairs", "300",
                    "--batch-size", "64", "--eval-images", "20", "--cache-dir", str(cache_dir), "--out", str(tmp_path),
                    "--no-figures", "--threads", "1"])
    assert math.isfinite(m["train"]["final_loss"]) and "binding_relation_swap" in m["binding"]
    for split in ("canonical", "styles", "templates", "combos"):          # the harder test, in every run
        assert set(m[f"binding_{split}"]) == {"binding_acc", "binding_attribute_swap", "binding_relation_swap",
                                              "binding_object_swap"}
    assert m["binding_canonical"]["binding_attribute_swap"] == m["binding"]["binding_attribute_swap"]
    out = capsys.readouterr().out
    assert "[hard negatives] " in out and "binding_templates" in out
    with pytest.raises(SystemExit, match="contrastive"):
        align.main(["--method", "mlp", "--hard-negatives", "--cache-dir", str(cache_dir), "--out", str(tmp_path)])


# ---------------------------------------------------------------- PAL-Rel (methods/pal_rel.py)
def naive_pal_rel_score(m, img, txt):
    """(R1)-(R4) with loops over images, texts, anchors, patches and words."""
    H, W = img.grid
    S = torch.zeros(len(img), len(txt))
    norm = lambda v: v / v.norm()
    for i in range(len(img)):
        Z = img.tokens[i, 1:1 + H * W]                                                   # the patches (PAL's Z)
        R = torch.stack([torch.stack([F.cosine_similarity(Z[t], m.A_v[k], dim=0) for k in range(m.K)])
                         for t in range(len(Z))])                                        # (H*W, K)
        p_v = torch.stack([(R[:, k] / m.tau_p).softmax(0) @ R[:, k] for k in range(m.K)])
        c = []
        for k in range(m.K):
            beta = (R[:, k] / m.tau_p).softmax(0)
            c.append(sum(beta[r * W + q] * torch.tensor([(q + 0.5) / W * 2 - 1, (r + 0.5) / H * 2 - 1])
                         for r in range(H) for q in range(W)))
        c = torch.stack(c)
        c_bar = c.mean(0)
        for j in range(len(txt)):
            L = int(txt.mask[j].sum())
            Y = txt.tokens[j, :L]
            Rl = torch.stack([torch.stack([F.cosine_similarity(Y[w], m.A_l[k], dim=0) for k in range(m.K)])
                              for w in range(L)])                                        # (L, K)
            p_l = torch.stack([(Rl[:, k] / m.tau_p).softmax(0) @ Rl[:, k] for k in range(m.K)])
            code = lambda x: torch.tensor([math.sin(x / 10000 ** (2 * i / m.P)) for i in range(m.P // 2)] +
                                          [math.cos(x / 10000 ** (2 * i / m.P)) for i in range(m.P // 2)])
            if m.order == "local":                                                       # (R2) word j places w
                rho = torch.stack([norm(Y[v]) @ m.u for v in range(L)]).softmax(0)
                o = [norm(Y[w]) @ m.U + sum(rho[v] * (norm(Y[v]) @ m.V).reshape(2, m.C)[:, w - v + m.W]
                                            for v in range(L) if abs(w - v) <= m.W) for w in range(L)]
            else:
                G = (norm(txt.pooled[j]) @ m.V).reshape(2, m.P)                          # (R2) G(t)
                r = 0.0
                if m.order == "relation":
                    rho = torch.stack([norm(Y[v]) @ m.u for v in range(L)]).softmax(0)
                    r = sum(rho[v] * v for v in range(L))
                o = [norm(Y[w]) @ m.U + G @ code(w - r) for w in range(L)]
            rel = 0.0
            for k in range(m.K):
                alpha = (Rl[:, k] / m.tau_p).softmax(0)
                d = sum(alpha[w] * o[w] for w in range(L))
                rel = rel + (c[k] - c_bar) @ d
            S[i, j] = norm(p_v) @ norm(p_l) + rel / m.K
    return S


@pytest.mark.parametrize("order", ["local", "relation", "index"])
def test_pal_rel_matches_a_loop_and_starts_as_pal(order):
    torch.manual_seed(0)
    m = PALRel(8, 6, K=4, tau_p=0.5, P=8, order=order, W=2)
    img = random_features(3, 1 + 6, 8, grid=(2, 3), seed=1)
    txt = random_features(4, 5, 6, lengths=[5, 2, 3, 4], seed=2)
    pal = PAL(8, 6, K=4, tau_p=0.5)
    pal.load_state_dict({"A_v": m.A_v, "A_l": m.A_l})
    with torch.no_grad():
        at_init = m.score(m.embed_image(img), m.embed_text(txt))
        assert torch.allclose(at_init, pal.score(pal.embed_image(img), pal.embed_text(txt)), atol=1e-6)  # U = V = 0
        m.U.normal_()
        got = m.score(m.embed_image(img), m.embed_text(txt))
        assert torch.allclose(got, naive_pal_rel_score(m, img, txt), atol=1e-5)
        assert not torch.allclose(got, at_init, atol=1e-3)
        m.V.normal_()                                                      # the word-order term of (R2) too
        if m.u is not None:
            m.u.normal_()                                                  # rho not uniform
        both = m.score(m.embed_image(img), m.embed_text(txt))
        assert torch.allclose(both, naive_pal_rel_score(m, img, txt), atol=1e-5)
        assert not torch.allclose(both, got, atol=1e-3)
    assert torch.allclose(grid_positions(2, 3), torch.tensor([[-2 / 3, -0.5], [0, -0.5], [2 / 3, -0.5],
                                                              [-2 / 3, 0.5], [0, 0.5], [2 / 3, 0.5]]))


def test_pal_rel_tells_left_from_right_where_pal_cannot():
    """Planted: object A (anchor 0) in the left patch, B (anchor 1) in the right one of a 1x4 grid.
    Caption words [is_A, is_B, r]: a contextual encoder's subject token carries r = +1 for "left of",
    the object token r = -1 ("A right of B" flips both). U reads r as an x offset. PAL's part scores
    both captions the same; PAL-Rel scores the true one higher."""
    from features import Features
    m = PALRel(4, 3, K=2, tau_p=0.05, order="index")
    with torch.no_grad():
        m.A_v.copy_(torch.eye(4)[:2])
        m.A_l.copy_(torch.eye(3)[:2])
        m.U.copy_(torch.tensor([[0.0, 0], [0, 0], [-1, 0]]))         # r -> x offset -r
    tok = torch.zeros(1, 5, 4)
    tok[0, 1, 0] = tok[0, 4, 1] = 1.0                                # A in patch 0 (left), B in patch 3 (right)
    tok[0, 0, 2:] = tok[0, 2, 2:] = tok[0, 3, 2:] = 1.0              # mean token, background patches
    img = Features(tok, torch.ones(1, 5, dtype=torch.bool), tok[:, 0], grid=(1, 4))

    def caption(r):                                                  # "A <left if r = 1 else right> of B"
        y = torch.tensor([[[1.0, 0, r], [0, 1.0, -r]]])
        return Features(y, torch.ones(1, 2, dtype=torch.bool), y.mean(1))
    with torch.no_grad():
        e_v = m.embed_image(img)
        true, swapped = (m.score(e_v, m.embed_text(caption(r))).item() for r in (1.0, -1.0))
        pal_part = [m.embed_text(caption(r))[:, :m.K] for r in (1.0, -1.0)]
    assert torch.allclose(pal_part[0], pal_part[1])                  # PAL alone cannot tell them apart
    assert true > swapped + 0.1 / m.K


def test_pal_rel_reads_the_relation_from_word_order_and_the_pooled_text():
    """Planted as above, but the word tokens are NOT contextual (is_A, is_B only): the relation is only in
    the pooled text t = (0, 0, r) and in which object comes first. V maps r to G(t) with
    G(t) q_0 = (-r, 0) (the first phrase goes to dir(relation)) and G(t) q_1 = (r, 0).
    "A left of B" (r = 1) and its paraphrase "B right of A" score the same and above the swap "A right of B"."""
    from features import Features
    m = PALRel(4, 3, K=2, tau_p=0.05, P=2, order="index")
    q0, q1 = torch.tensor([0.0, 1.0]), torch.tensor([math.sin(1.0), math.cos(1.0)])    # the P = 2 code of w = 0, 1
    g = torch.linalg.solve(torch.stack([q0, q1]), torch.tensor([-1.0, 1.0]))          # G's x row for r = 1
    assert torch.allclose(sincos(torch.arange(2.0), 2), torch.stack([q0, q1]), atol=1e-6)
    with torch.no_grad():
        m.A_v.copy_(torch.eye(4)[:2])
        m.A_l.copy_(torch.eye(3)[:2])
        m.V.copy_(torch.tensor([[0.0] * 4, [0.0] * 4, [g[0], g[1], 0.0, 0.0]]))       # rows of V: t's dims
    tok = torch.zeros(1, 5, 4)
    tok[0, 1, 0] = tok[0, 4, 1] = 1.0                                # A in patch 0 (left), B in patch 3 (right)
    tok[0, 0, 2:] = tok[0, 2, 2:] = tok[0, 3, 2:] = 1.0
    img = Features(tok, torch.ones(1, 5, dtype=torch.bool), tok[:, 0], grid=(1, 4))

    def caption(first, second, r):                                   # "<first> <left if r = 1 else right> of <second>"
        words = torch.eye(3)[[first, second]][None]                  # (1, 2, 3): is_A / is_B, no relation in them
        return Features(words, torch.ones(1, 2, dtype=torch.bool), torch.tensor([[0.0, 0.0, r]]))
    with torch.no_grad():
        e_v = m.embed_image(img)
        true, paraphrase, swapped = (m.score(e_v, m.embed_text(c)).item()
                                     for c in (caption(0, 1, 1.0), caption(1, 0, -1.0), caption(0, 1, -1.0)))
    assert abs(true - paraphrase) < 1e-6
    assert true > swapped + 0.1 / m.K


def test_pal_rel_local_order_reads_offsets_from_the_relation_word_not_indices():
    """Planted: words is_A, is_B, LEFT, filler (one-hot, no context). rho picks LEFT; M(LEFT) puts the
    word just before it left (x -1), the word just after it right (x +1), W = 1. "A LEFT B" scores the
    image (A left of B) above "B LEFT A", and so do the same captions after a 2-word prefix and with B
    moved out of the window ("B filler A LEFT": only A is placed), where an index code would move."""
    from features import Features
    m = PALRel(4, 4, K=2, tau_p=0.05, order="local", W=1)
    with torch.no_grad():
        m.A_v.copy_(torch.eye(4)[:2])
        m.A_l.copy_(torch.eye(4)[:2])
        m.u.copy_(torch.tensor([0.0, 0, 20, 0]))                      # rho: LEFT
        m.V.zero_()
        m.V[2].copy_(torch.tensor([-1.0, 0, 1, 0, 0, 0]))             # M(LEFT): x offsets for w - j = -1, 0, +1
    tok = torch.zeros(1, 5, 4)
    tok[0, 1, 0] = tok[0, 4, 1] = 1.0                                # A in patch 0 (left), B in patch 3 (right)
    tok[0, 0, 2:] = tok[0, 2, 2:] = tok[0, 3, 2:] = 1.0
    img = Features(tok, torch.ones(1, 5, dtype=torch.bool), tok[:, 0], grid=(1, 4))
    A, B, LEFT, X = torch.eye(4)

    def score(*words):
        y = torch.stack(words)[None]
        with torch.no_grad():
            return m.score(m.embed_image(img), m.embed_text(Features(y, torch.ones(1, len(words), dtype=torch.bool),
                                                                       y.mean(1)))).item()
    for prefix in ([], [X, X]):
        assert score(*prefix, A, LEFT, B) > score(*prefix, B, LEFT, A) + 0.1 / m.K
        assert score(*prefix, A, LEFT, B) == pytest.approx(score(A, LEFT, B), abs=1e-6)  # the prefix moves nothing
    assert score(B, X, A, LEFT) > score(A, X, B, LEFT) + 0.05 / m.K        # B is out of the window


# ---------------------------------------------------------------- the position-aware tiny CNN
def position_probe(encoder, images):
    """Ridge probe (one-hot, 64-way) of each patch token's grid cell: train on half the images, test on
    the other half. Returns the held-out accuracy over all patches and over interior patches."""
    X = encoder.encode(images).patches().float()                     # (N, H*W, D)
    N, P, D = X.shape
    y = torch.arange(P).expand(N, P)
    h = N // 2
    Xtr, Xte, ytr, yte = X[:h].reshape(-1, D), X[h:].reshape(-1, D), y[:h].reshape(-1), y[h:].reshape(-1)
    mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-6
    A = lambda Z: torch.cat([(Z - mu) / sd, torch.ones(len(Z), 1)], 1)
    Wt = torch.linalg.solve(A(Xtr).T @ A(Xtr) + 0.1 * torch.eye(D + 1), A(Xtr).T @ F.one_hot(ytr, P).float())
    hit = (A(Xte) @ Wt).argmax(1) == yte
    side = int(math.isqrt(P))
    r, c = yte // side, yte % side
    inner = (r > 0) & (r < side - 1) & (c > 0) & (c < side - 1)      # away from the zero-padded border
    return hit.float().mean().item(), hit[inner].float().mean().item()


def test_sincos_code_is_the_closed_form():
    pe = shapes_encoders.sincos_2d(8, 3, 5)                                   # D/4 = 2 frequencies: 1 and 1/100
    assert pe.shape == (8, 3, 5)
    x, y = 4, 2
    assert torch.allclose(pe[:, y, x], torch.tensor([math.sin(x), math.sin(x / 100), math.cos(x), math.cos(x / 100),
                                                     math.sin(y), math.sin(y / 100), math.cos(y), math.cos(y / 100)]))


def test_the_position_code_puts_each_patch_tokens_place_in_it():
    """The architecture, at one random initialisation: with the sin-cos code before the last block each
    patch token says where it is; without it only the zero-padded border does."""
    images, _ = shapes.pretrain_images(200, seed=777)
    acc = {}
    for pos in (True, False):
        torch.manual_seed(0)
        model = shapes_encoders.TinyImageEncoder(len(shapes.CLASS_NAMES) + 1, pos=pos)
        enc = shapes_encoders.ShapesImageEncoder(model)
        assert enc.name == ("shapes-cnn-pos1" if pos else "shapes-cnn")   # separate feature cache keys
        acc[pos] = position_probe(enc, images)
    chance = 1 / 64
    assert acc[True][1] > 0.9 and acc[False][1] < 10 * chance          # measured 99.8% and 7.5% (interior)
    assert acc[True][0] > acc[False][0] + 0.5                            # measured 99.9% and 20.0% (all patches)
