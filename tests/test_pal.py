"""PAL (methods/pal.py): CAP and the ablation poolings against naive loops, invariances,
gradient flow to the anchors only, the Table 4 anchor overlap on a planted case, a tiny
training run on planted data, and analyse() figures.

The tests of the exercises' functions (relative, cap, info_nce) build PAL with fast=False, so
they run the paper form, cap(relative(Z, A)); tests/test_fast_forms.py checks the fast form
against it. Their assertions say what differs, for exercises/grade.py's one line."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same, random_features
from recorded import expected

from features import Features
from methods.losses import info_nce, info_nce_of_logits
from methods.pal import PAL, anchor_overlap, cap, relative


def same_rows(got, want, what, atol=1e-5, padded=None):
    """Assert got == want (B, ...) row by row; the message names the rows that differ and by how much."""
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    diff = (got.detach() - want.detach()).abs().reshape(len(got), -1).amax(1).nan_to_num(nan=float("inf"))
    bad = (diff > atol).nonzero()[:, 0].tolist()
    note = ""
    if padded is not None and bad:
        note = " (the padded ones)" if set(bad) <= set(padded) else f" (rows {padded} are the padded ones)"
    assert not bad, f"{what}: rows {bad}{note} differ from the expected values by up to {diff.max().item():.3g}"


def text_and_image(B=3, seed=0):
    img = random_features(B, 1 + 6, 5, grid=(2, 3), seed=seed)
    txt = random_features(B, 6, 4, lengths=[6, 3, 1][:B] + [4] * max(0, B - 3), seed=seed + 1)
    return img, txt


@pytest.mark.parametrize("pooling", ["cap", "mean"])
def test_pooling_matches_naive_loop(pooling):
    img, txt = text_and_image()
    m = PAL(5, 4, K=7, tau_p=0.3, pooling=pooling, fast=False)
    with torch.no_grad():
        p_v, p_l = m.pool(img, "image"), m.pool(txt, "text")
        h_l = m.embed_text(txt)
        if pooling == "cap":                  # the exercise's own functions, called directly
            p_v_ex = cap(relative(img.tokens[:, 1:], m.A_v), img.mask[:, 1:], 0.3)[0]
            p_l_ex = cap(relative(txt.tokens, m.A_l), txt.mask, 0.3)[0]
    ref_v = torch.stack([expected("naive_p", img.tokens[b, 1:], img.mask[b, 1:], m.A_v, 0.3, pooling)
                         for b in range(len(img))])
    ref_l = torch.stack([expected("naive_p", txt.tokens[b], txt.mask[b], m.A_l, 0.3, pooling) for b in range(len(txt))])
    same_rows(p_v, ref_v, f"image p ({pooling} over the 6 patches, tau_p 0.3)")
    same_rows(p_l, ref_l, f"text p ({pooling} over the words, tau_p 0.3)", padded=[1, 2])
    same_rows(h_l, F.normalize(ref_l, dim=-1), "text h = p / ||p|| (Eq. 7)", padded=[1, 2])
    if pooling == "cap":
        same_rows(p_v_ex, ref_v, "cap(relative(Z, A_v), mask, 0.3)[0] on the image patches")
        same_rows(p_l_ex, ref_l, "cap(relative(Z, A_l), mask, 0.3)[0] on the words", padded=[1, 2])


def test_cap_at_default_tau_p_matches_naive_loop():
    img, txt = text_and_image()
    m = PAL(5, 4, K=5, fast=False)                          # tau_p = 0.03: sharp attention
    with torch.no_grad():
        p_l = m.pool(txt, "text")
        p_l_ex = cap(relative(txt.tokens, m.A_l), txt.mask, 0.03)[0]        # the exercise's functions
    ref = torch.stack([expected("naive_p", txt.tokens[b], txt.mask[b], m.A_l, 0.03, "cap") for b in range(len(txt))])
    same_rows(p_l, ref, "text p at tau_p 0.03 (PAL.pool)", padded=[1, 2])
    same_rows(p_l_ex, ref, "cap(relative(Z, A_l), mask, 0.03)[0]", padded=[1, 2])


def test_global_pooling_is_relative_representation_of_one_vector():
    img, txt = text_and_image()
    m = PAL(5, 4, K=6, pooling="global", fast=False)
    with torch.no_grad():
        p_v, p_l = m.pool(img, "image"), m.pool(txt, "text")
    ref_v, ref_l = expected("cosines", img.pooled, m.A_v), expected("cosines", txt.pooled, m.A_l)
    same_rows(p_v, ref_v, "image p of the global vector (cosines to the anchors)")
    same_rows(p_l, ref_l, "text p of the pooled vector (cosines to the anchors)")


@pytest.mark.parametrize("pooling", ["cap", "mean"])
def test_padding_does_not_change_h(pooling):
    _, txt = text_and_image()
    m = PAL(5, 4, K=8, pooling=pooling, fast=False)
    garbage = 100 * torch.randn(len(txt), 3, 4)              # padded tokens with large garbage
    padded = Features(tokens=torch.cat([txt.tokens, garbage], 1),
                      mask=torch.cat([txt.mask, torch.zeros(len(txt), 3, dtype=torch.bool)], 1),
                      pooled=txt.pooled)
    with torch.no_grad():
        h, h_padded = m.embed_text(txt), m.embed_text(padded)
    diff = (h - h_padded).abs().amax(1)
    bad = (diff.nan_to_num(nan=float("inf")) > 1e-6).nonzero()[:, 0].tolist()
    assert not bad, (f"text h of rows {bad} changes by up to {diff.max().item():.3g} when 3 padded tokens of "
                     f"large garbage (mask False) are appended, expected no change: padded tokens must get weight 0")


def test_permuting_the_batch_permutes_the_scores():
    img, txt = text_and_image(B=5)
    m = PAL(5, 4, K=8, fast=False)
    pi, pt = torch.randperm(5), torch.randperm(5)
    with torch.no_grad():
        S = m.score(m.embed_image(img), m.embed_text(txt))
        S_perm = m.score(m.embed_image(img[pi]), m.embed_text(txt[pt]))
    gap = (S_perm - S[pi][:, pt]).abs().max().item()
    assert gap <= 1e-6, f"scores of the permuted batch differ by up to {gap:.3g} from the expected permuted scores"
    assert S.abs().max() <= 1 + 1e-6, \
        f"a score of {S.abs().max().item():.3g}, expected |S| <= 1: h_v, h_l are not unit length"


def test_gradients_reach_the_anchors_and_only_them():
    img, txt = text_and_image(B=4)
    m = PAL(5, 4, K=8, fast=False)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["A_v", "A_l"], f"PAL's parameters {names}, expected ['A_v', 'A_l']"
    loss, logs = m.loss(img, txt)
    loss.backward()
    for name, A in (("A_v", m.A_v), ("A_l", m.A_l)):
        assert A.grad is not None, f"no gradient reaches {name}, expected one through cap and the loss"
        assert torch.isfinite(A.grad).all(), f"the gradient of {name} is not finite, expected finite"
        assert A.grad.abs().sum() > 0, f"the gradient of {name} is 0, expected a non-zero one"
    for t in (img.tokens, txt.tokens, img.pooled, txt.pooled):
        assert not t.requires_grad and t.grad is None, "a gradient reaches the frozen features, expected none"
    assert logs["nce"] == pytest.approx(loss.item()), f"logs['nce'] = {float(logs['nce']):.5f}, expected the loss " \
                                                      f"{loss.item():.5f}"


def test_anchor_gradient_matches_finite_differences_with_padding():
    _, txt = text_and_image()
    txt = txt.to("cpu", torch.float64)
    A = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    h = lambda A: F.normalize(cap(relative(txt.tokens, A), txt.mask, 0.03)[0], dim=-1)  # Eq. (3)-(7)
    assert torch.autograd.gradcheck(h, (A,), raise_exception=False), \
        "the anchors' gradient of h = normalise(cap(relative(Z, A))) differs from finite differences (float64), " \
        "expected them equal"


def test_info_nce_is_the_mean_of_both_directions():
    """Eq. (8) against a loop: (CE over each image's row + CE over each caption's column) / 2."""
    g = torch.Generator().manual_seed(0)
    h_v, h_l = F.normalize(torch.randn(6, 5, generator=g), dim=-1), F.normalize(torch.randn(6, 5, generator=g), dim=-1)
    tau = 0.05
    i2t, t2i = expected("info_nce_directions", h_v @ h_l.T / tau)              # image->text, text->image
    assert abs(i2t - t2i) > 0.1, "(the test's own check) expected the two directions to differ here"
    got, want = info_nce(h_v, h_l, tau).item(), (i2t + t2i) / 2
    # the loss with tau left out, and with tau applied twice: a wrong value that matches one names it
    tau_wrong = {f"the loss with tau applied {how} ({form})": sum(expected("info_nce_directions", h_v @ h_l.T / t)) / 2
                 for how, form, t in (("nowhere", "cosines as logits", 1.0), ("twice", "logits / tau^2", tau ** 2))}
    which = [name for name, value in tau_wrong.items() if got == pytest.approx(value, rel=1e-5)]
    assert got == pytest.approx(want, rel=1e-5), (
        f"info_nce = {got:.4f}, expected {want:.4f} (Eq. 8: the mean of image->text, {i2t:.4f} alone, and "
        f"text->image, {t2i:.4f} alone)" + (f": {got:.4f} is {which[0]}, Eq. 8 divides the cosines by tau once"
                                            if which else ""))
    got = info_nce_of_logits(h_v @ h_l.T / tau).item()
    assert got == pytest.approx(want, rel=1e-5), (
        f"info_nce_of_logits = {got:.4f}, expected {want:.4f} (the mean of the rows' cross-entropy, {i2t:.4f} "
        f"alone, and the columns', {t2i:.4f} alone)")
    # two matrices (FILIP's image->text and text->image similarities): the rows of the first, the columns of the second
    s2 = (h_v @ h_l.T / tau) ** 2 / 20
    want = (i2t + expected("info_nce_directions", s2)[1]) / 2
    got = info_nce_of_logits(h_v @ h_l.T / tau, s2).item()
    assert got == pytest.approx(want, rel=1e-5), (
        f"info_nce_of_logits(logits, logits_t2i) = {got:.4f}, expected {want:.4f} (the rows of logits and the "
        f"columns of logits_t2i)")


def test_anchor_overlap_on_planted_top5_sets():
    N, K = 3, 40
    p_v, p_l = torch.full((N, K), -1.0), torch.full((N, K), -1.0)
    for i in range(N):                     # pair i lives on anchors 10i..10i+9: mismatched overlap 0
        p_v[i, 10 * i + torch.arange(5)] = torch.tensor([5.0, 4, 3, 2, 1])        # weights 5..1 / 15
        p_l[i, 10 * i + torch.tensor([2, 3, 4, 5, 6])] = 1.0                      # 3 shared: 2, 3, 4
    out = anchor_overlap(p_v, p_l)
    assert out["anchor_overlap_matched"] == pytest.approx(3 / 5)
    assert out["anchor_overlap_mismatched"] == 0
    # weighted Dice: min(3/15, 1/5) + min(2/15, 1/5) + min(1/15, 1/5) = 6/15
    assert out["anchor_dice_matched"] == pytest.approx(6 / 15)
    assert out["anchor_dice_mismatched"] == 0
    # equal weights: Dice reduces to the set Dice 2|A∩B|/(|A|+|B|)
    p_v[p_v > 0] = 1.0
    assert anchor_overlap(p_v, p_l)["anchor_dice_matched"] == pytest.approx(3 / 5)
    # two pairs: the mismatched partner of 0 must be 1 and vice versa
    two = anchor_overlap(torch.eye(2, 7) + torch.arange(7.0) / 100,
                         torch.eye(2, 7).flip(0) + torch.arange(7.0) / 100, top=1)
    assert two["anchor_overlap_matched"] == 0 and two["anchor_overlap_mismatched"] == 1


def planted_pairs(N=256, seed=0, Dv=24, Dl=32, C=16):
    """Images: 16 patches (4x4), 3 of them concept vectors, the rest noise around a shared
    background direction. Captions: CLS + the 3 concepts + 2 fillers, all mapped by one fixed
    random linear map with noise, variable length and padded."""
    g = torch.Generator().manual_seed(seed)
    concepts, M, bg = torch.randn(C, Dv, generator=g), torch.randn(Dl, Dv, generator=g), torch.randn(Dv, generator=g)
    c = torch.stack([torch.randperm(C, generator=g)[:3] for _ in range(N)])          # (N, 3)
    pos = torch.stack([torch.randperm(16, generator=g)[:3] for _ in range(N)])
    patches = bg + 0.8 * torch.randn(N, 16, Dv, generator=g)
    for j in range(3):
        patches[torch.arange(N), pos[:, j]] = concepts[c[:, j]] + 0.3 * torch.randn(N, Dv, generator=g)
    tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)                  # global + patches
    img = Features(tokens, torch.ones(N, 17, dtype=torch.bool), tokens[:, 0], (4, 4))
    words = torch.cat([bg.expand(N, 1, Dv), concepts[c], bg + 0.8 * torch.randn(N, 2, Dv, generator=g)], 1)
    t_tok = words @ M.T + 0.1 * torch.randn(N, 6, Dl, generator=g)
    mask = torch.arange(8)[None] < torch.randint(4, 7, (N,), generator=g)[:, None]   # (N, 8)
    t_tok = torch.cat([t_tok, torch.zeros(N, 2, Dl)], 1) * mask[..., None]
    return img, Features(t_tok, mask, t_tok.sum(1) / mask.sum(1, keepdim=True))


def test_tiny_training_run_on_planted_pairs():
    torch.manual_seed(0)
    img, txt = planted_pairs()
    m = PAL(24, 32, K=64)
    opt = torch.optim.AdamW(m.parameters(), lr=PAL.defaults["lr"], weight_decay=PAL.defaults["weight_decay"])
    losses = []
    for _step in range(100):                                        # full batch of 256 pairs
        loss, _ = m.loss(img, txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and losses[-1] < 0.5 * losses[0]        # chance level is log 256 = 5.5
    with torch.no_grad():
        S = m.score(m.embed_image(img), m.embed_text(txt))
    r1 = (S.argmax(1) == torch.arange(256)).float().mean().item()
    assert r1 > 0.3                                                 # chance: 1/256


def test_dense_image_is_normalised_per_patch_relative_representation():
    img, _ = text_and_image()
    m = PAL(5, 4, K=7, fast=False)
    with torch.no_grad():
        d = m.dense_image(img)
    assert d.shape == (3, 6, 7), f"dense_image has shape {tuple(d.shape)}, expected (3, 6, 7): (B, H*W, K)"
    r = expected("cosines", img.tokens[1, 1 + 4][None], m.A_v)[0]                           # patch 4
    assert_same(d[1, 4], r / r.norm(), "patch 4 of image 1 (its cosines to the anchors, normalised per patch)",
                atol=1e-5, rtol=0)


def test_analyse_writes_figures_and_returns_overlaps(tmp_path):
    from PIL import Image
    N = 300                                                        # > 256: pooled in chunks
    img, txt = planted_pairs(N=N)
    words = [[f"w{t}" for t in range(int(txt.mask[i].sum()))] for i in range(N)]
    images = torch.randint(0, 256, (N, 3, 32, 32), dtype=torch.uint8)
    m = PAL(24, 32, K=16)
    out = m.analyse(img, txt, images, words, lambda im, name: im.save(tmp_path / name))
    with torch.no_grad():
        assert out == pytest.approx(anchor_overlap(m.pool(img, "image"), m.pool(txt, "text")), abs=1e-6)
    assert set(out) == {"anchor_overlap_matched", "anchor_overlap_mismatched",
                        "anchor_dice_matched", "anchor_dice_mismatched"}
    assert all(0 <= v <= 1 for v in out.values())
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == [f"pal_anchors_{i}.png" for i in range(4)]
    w, h = Image.open(tmp_path / "pal_anchors_0.png").size
    assert w > 4 * 160 and h > 160


def test_cap_reads_a_head_row_in_d_aug_as_its_one_token():
    """D_aug = pairs ∪ head rows (weights+pairs): each image is pooled over its patches,
    each head row over its one vector, exactly as when each is pooled alone."""
    from methods.pal import PAL
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(3, 1 + 16, 8, generator=g)
    images = Features(tokens=tokens, mask=torch.ones(3, 17, dtype=torch.bool), pooled=tokens[:, 0], grid=(4, 4))
    rows = Features.from_vectors(torch.randn(2, 8, generator=g))
    torch.manual_seed(0)
    m = PAL(8, 8, K=6)
    both = m.pool(Features.cat([images, rows]), "image")                         # (5, K)
    torch.testing.assert_close(both[:3], m.pool(images, "image"))
    torch.testing.assert_close(both[3:], m.pool(rows, "image"))
    R = torch.nn.functional.normalize(rows.pooled, dim=-1) @ torch.nn.functional.normalize(m.A_v, dim=-1).T
    torch.testing.assert_close(both[3:], R)                                      # one token: p = R (Eq. 5-6)
