"""evaluate.py against hand-made cases with known answers and naive per-query loops."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_same, random_features
from recorded import expected

import evaluate as ev
from features import Features

# ----------------------------------------------------------------------------- stand-in methods

class Cosine(nn.Module):
    """Pooled features as embeddings, cosine score; records the block sizes score() sees."""
    def __init__(self, p_drop=0.0):
        super().__init__()
        self.drop = nn.Dropout(p_drop)
        self.calls = []

    def embed_image(self, img):
        return F.normalize(self.drop(img.pooled), dim=-1)

    def embed_text(self, txt):
        return F.normalize(self.drop(txt.pooled), dim=-1)

    def dense_image(self, img):
        return F.normalize(img.patches(), dim=-1)

    def score(self, a, b):
        self.calls.append((len(a), len(b)))
        return a @ b.T


class TokenLevel(Cosine):
    """Token-level stand-in: score = sum over text words of the max over image tokens (zero rows = padding)."""
    def embed_image(self, img):
        return F.normalize(img.tokens, dim=-1)                           # (B, T, K)

    def embed_text(self, txt):
        return F.normalize(txt.tokens, dim=-1) * txt.mask[..., None]     # (B, L, K), padding exactly 0

    def score(self, a, b):
        sim = torch.einsum("iqk,jlk->ijql", a, b)                        # (N_img, N_txt, Q, L)
        return sim.max(2).values.sum(-1)


# ----------------------------------------------------------------------------- naive retrieval references

def uneven_captions(N_img, seed=0):
    """Most images with 5 captions, some with 1, 3 or 7, shuffled."""
    counts = [5] * N_img
    counts[0], counts[1], counts[2] = 1, 3, 7
    txt_to_img = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    return txt_to_img[torch.randperm(len(txt_to_img), generator=torch.Generator().manual_seed(seed))]


# ----------------------------------------------------------------------------- retrieval

def test_recalls_on_hand_made_matrix_with_known_ranks():
    txt_to_img = torch.tensor([0, 0, 1, 1, 2, 2])
    S = torch.tensor([
        # caption: 0     1     2     3     4     5
        [0.90, 0.10, 0.80, 0.20, 0.30, 0.40],    # image 0: best own caption 0.90 is first -> rank 0
        [0.50, 0.60, 0.70, 0.75, 0.95, 0.20],    # image 1: best own 0.75, one other above -> rank 1
        [0.90, 0.80, 0.85, 0.70, 0.10, 0.20],    # image 2: best own 0.20, four others above -> rank 4
    ])
    # t2i ranks, column by column: cap0 1 (tie with image 2 counts against), cap1 2, cap2 2,
    # cap3 0, cap4 2, cap5 2 (0.40 above, 0.20 tie)
    m = ev.retrieval_metrics(S, txt_to_img)
    want(m, "i2t_r1", 100 / 3, "i2t ranks 0, 1, 4")
    want(m, "i2t_r5", 100, "i2t ranks 0, 1, 4")
    want(m, "i2t_r10", 100, "i2t ranks 0, 1, 4")
    want(m, "t2i_r1", 100 / 6, "t2i ranks 1, 2, 2, 0, 2, 2: a tie counts against the truth")
    want(m, "t2i_r5", 100, "t2i ranks 1, 2, 2, 0, 2, 2")
    want(m, "rsum", 100 / 3 + 200 + 100 / 6 + 200, "the sum of the six recalls")
    want(m, "i2t_p1", 1 / 3, "only image 0's best caption is first")
    want(m, "t2i_p1", 1 / 6, "only caption 3's image is first")
    # image 2's own captions sit at positions 5 and 6 of its list: AP = (1/5 + 2/6) / 2
    # image 1: positions 2 and 3 -> (1/2 + 2/3) / 2; image 0: positions 1 and 6 -> (1 + 2/6) / 2
    ap = [(1 + 2 / 6) / 2, (1 / 2 + 2 / 3) / 2, (1 / 5 + 2 / 6) / 2]
    want(m, "i2t_map", sum(ap) / 3, "own captions at positions (1, 6), (2, 3), (5, 6)")
    want(m, "i2t_p5", (1 / 5 + 2 / 5 + 1 / 5) / 3, "1, 2 and 1 own captions in the top 5")


def test_constant_scores_count_ties_against_the_ground_truth():
    txt_to_img = torch.tensor([0, 0, 1, 1])
    m = ev.retrieval_metrics(torch.zeros(2, 4), txt_to_img)
    # i2t rank 2 (both other captions first), t2i rank 1: R@1 = 0 both ways, R@5 = R@10 = 100
    tie = "all scores equal: a tie counts against the truth"
    for key, value in (("i2t_r1", 0), ("t2i_r1", 0), ("rsum", 400), ("i2t_p1", 0), ("t2i_p1", 0)):
        want(m, key, value, tie, exact=True)
    # own captions after the 2 others: positions 3 and 4
    want(m, "i2t_map", (1 / 3 + 2 / 4) / 2, tie + ", own captions at positions 3 and 4")
    # NaN scores count as -inf: a NaN ground truth is never ranked first
    S = torch.eye(2).repeat_interleave(2, dim=1)
    S[0, 0] = S[0, 1] = float("nan")
    want(ev.retrieval_metrics(S, txt_to_img), "i2t_r1", 50, "image 0's own scores are NaN: they rank last")


@pytest.mark.parametrize("seed", [0, 1])
def test_retrieval_metrics_match_naive_loops(seed):
    txt_to_img = uneven_captions(30, seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):          # scores whose R@1 and mAP lie strictly inside their range (the first draw, at seed 0)
        S = torch.randn(30, len(txt_to_img), generator=g)
        ref = expected("naive_retrieval", S, txt_to_img)
        if 0 < ref["i2t_r1"] < 100 and 0 < ref["i2t_map"] < 1:
            break
    m = ev.retrieval_metrics(S, txt_to_img, chunk=16)   # small chunk: exercise the chunking
    assert m.keys() == ref.keys(), f"keys {sorted(m)}, expected {sorted(ref)}"
    for k in ref:
        assert m[k] == pytest.approx(ref[k], abs=1e-5), f"{k} = {m[k]:.5g}, expected {ref[k]:.5g} (the naive loop)"
    assert 0 < m["i2t_r1"] < 100, f"i2t_r1 = {m['i2t_r1']:.4g}, expected a percent strictly inside (0, 100) here"
    assert 0 < m["i2t_map"] < 1, f"i2t_map = {m['i2t_map']:.4g}, expected a fraction strictly inside (0, 1) here"


def test_retrieval_metrics_invariant_to_consistent_permutation():
    txt_to_img = uneven_captions(12)
    S = torch.randn(12, len(txt_to_img), generator=torch.Generator().manual_seed(3))
    pi, pt = torch.randperm(12), torch.randperm(len(txt_to_img))
    inv_pi = torch.argsort(pi)                 # new index of each old image
    m = ev.retrieval_metrics(S, txt_to_img)
    m2 = ev.retrieval_metrics(S[pi][:, pt], inv_pi[txt_to_img[pt]])
    for k in m:
        assert m2[k] == pytest.approx(m[k], abs=1e-5), \
            f"{k} = {m2[k]:.5g} after permuting images and captions consistently, expected {m[k]:.5g} as before"


def test_score_matrix_chunked_equals_full():
    a, b = torch.randn(37, 8), torch.randn(53, 8)
    method = Cosine()
    S = ev.score_matrix(method, a, b, chunk=10)
    torch.testing.assert_close(S, a @ b.T)
    assert max(max(c) for c in method.calls) <= 10 and len(method.calls) == 4 * 6
    # token-level too
    tok = TokenLevel()
    A, B = torch.randn(5, 3, 4), torch.randn(7, 2, 4)
    torch.testing.assert_close(ev.score_matrix(tok, A, B, chunk=2), tok.score(A, B))


def test_retrieval_end_to_end_is_perfect_for_near_copies_and_uses_eval_mode():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 16, generator=g)
    txt_to_img = torch.arange(20).repeat_interleave(5)
    y = x[txt_to_img] + 0.01 * torch.randn(100, 16, generator=g)
    method = Cosine(p_drop=0.9)               # in training mode the dropout would scramble everything
    method.train()
    m = ev.retrieval(method, Features.from_vectors(x), Features.from_vectors(y), txt_to_img, batch_size=7)
    near = "captions are near copies of their image"
    want(m, "rsum", 600, near)
    want(m, "i2t_map", 1, near)
    want(m, "i2t_p5", 1, near)
    want(m, "t2i_p1", 1, near, exact=True)
    assert method.training, "retrieval() left the method in eval mode, expected its training flag restored"


# ----------------------------------------------------------------------------- embed

def test_embed_zero_pads_token_level_batches():
    txt = random_features(4, 6, 3, lengths=[2, 2, 5, 3])
    out = ev.embed(lambda f: f.tokens * 2, txt, batch_size=2)
    assert out.shape == (4, 5, 3)               # first batch trimmed to 2 tokens, second to 5
    torch.testing.assert_close(out, 2 * txt.tokens[:, :5])
    assert (out[0, 2:] == 0).all() and (out[3, 3:] == 0).all()
    lin = nn.Linear(3, 2)
    g = ev.embed(lambda f: lin(f.pooled), txt, batch_size=3)
    torch.testing.assert_close(g, lin(txt.pooled).detach())
    assert not g.requires_grad


def test_embed_reads_fp16_features():
    f = random_features(5, 1, 4)
    half = Features(tokens=f.tokens.half(), mask=f.mask, pooled=f.pooled.half())
    out = ev.embed(lambda b: b.pooled, half, batch_size=2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, f.pooled.half().float())


# ----------------------------------------------------------------------------- classification

def want(metrics, key, value, why, exact=False):
    """metrics[key] == value (approximately unless exact), with a message saying what was expected and why."""
    got = metrics[key]
    ok = got == value if exact else got == pytest.approx(value)
    assert ok, f"{key} = {got:.4g}, expected {value:.4g} ({why})"


def test_template_average_matches_naive():
    C, n, K = 3, 4, 5
    t = torch.randn(C * n, K)
    w = ev.template_average(t, n)
    want = expected("naive_template_average", t, n)
    for c in range(C):
        assert_same(w[c], want[c], f"class {c}'s embedding (each of its {n} templates normalised, averaged, "
                    f"normalised)")


def test_token_level_class_logits_average_scores_over_templates():
    C, n = 2, 3
    img = torch.randn(4, 3, 5)
    txt = torch.randn(C * n, 2, 5)
    txt[1, 1] = 0                                # one padded word
    logits = ev.class_logits(TokenLevel(), img, ev.template_average(txt, n), n)
    assert logits.shape == (4, C), f"class_logits has shape {tuple(logits.shape)}, expected (N, C) = (4, {C})"
    want = expected("naive_token_class_logits", img, txt, n)
    for i in range(4):
        for c in range(C):
            ref = float(want[i, c])
            assert float(logits[i, c]) == pytest.approx(ref, abs=1e-5), (
                f"image {i}, class {c}: logit {float(logits[i, c]):.4f}, expected the mean over its {n} templates' "
                f"scores is {ref:.4f} (prompts are class-major)")


def test_classification_with_class_mean_prompts_is_perfect():
    g = torch.Generator().manual_seed(0)
    C, n, D = 5, 3, 12
    means = torch.randn(C, D, generator=g)
    labels = torch.randint(0, C, (40,), generator=g)
    x = means[labels] + 0.05 * torch.randn(40, D, generator=g)
    # each template: the class mean at a different scale (normalisation removes it)
    prompts = means.repeat_interleave(n, dim=0) * torch.tensor([1.0, 2.0, 0.5]).repeat(C)[:, None]
    img, cls = Features.from_vectors(x), Features.from_vectors(prompts)
    want(ev.classification(Cosine(), img, labels, cls, n, batch_size=16), "top1", 100,
         "images near their class mean, prompts = the class mean at 3 scales")
    wrong = labels.clone()
    wrong[:10] = (wrong[:10] + 1) % C
    want(ev.classification(Cosine(), img, wrong, cls, n), "top1", 75, "10 of 40 labels changed")


# ----------------------------------------------------------------------------- segmentation

def test_miou_hand_made_and_ignore_pixels_excluded():
    gt = torch.tensor([[0, 0, 1],
                       [1, 255, 255]])
    pred = torch.tensor([[0, 1, 1],
                         [1, 0, 1]])
    # class 0: I = 1, U = 2 (pred 1 + gt 2 - 1); class 1: I = 2, U = 3 (pred 3 + gt 2 - 2) -> (1/2 + 2/3) / 2
    got = miou_of(pred, gt, 2)
    assert got == pytest.approx(100 * (1 / 2 + 2 / 3) / 2), \
        f"mIoU {got:.4g}, expected 58.33 (class 0: I 1 / U 2, class 1: I 2 / U 3; the 255 pixels ignored)"
    pred2 = pred.clone()
    pred2[1, 1:] = torch.tensor([1, 0])           # only ignored pixels changed
    got2 = miou_of(pred2, gt, 2)
    assert got2 == got, (f"changing the prediction on ignored (255) pixels moves mIoU from {got:.4g} to {got2:.4g}, "
                         f"expected {got:.4g} unchanged")
    # a class predicted but absent from gt counts with IoU 0; a class absent from both does not count
    got = miou_of(torch.tensor([0, 2]), torch.tensor([0, 0]), 4)
    assert got == pytest.approx(100 * (1 / 2 + 0) / 2), (
        f"mIoU {got:.4g}, expected 25 (class 0 IoU 1/2, class 2 predicted but absent IoU 0, classes 1 and 3 "
        f"absent from both: not counted)")
    try:                                          # a label outside 0..C-1 that is not ignore_index
        miou_of(torch.tensor([0]), torch.tensor([7]), 2)
    except ValueError:
        pass
    else:
        pytest.fail("iou_counts(pred [0], gt [7], C = 2) returned, expected a ValueError: a label outside 0..C-1 "
                    "(other than ignore_index) is an error")


def test_miou_accumulates_over_the_set_not_per_image():
    gt1, pred1 = torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)   # 4 px class 0, right
    gt2 = torch.tensor([[0, 1], [1, 1]])
    pred2 = torch.ones(2, 2, dtype=torch.long)                                                # all class 1
    per_image = (miou_of(pred1, gt1, 2) + miou_of(pred2, gt2, 2)) / 2
    pooled = miou_of(torch.stack([pred1, pred2]), torch.stack([gt1, gt2]), 2)
    assert per_image == pytest.approx((100 + 100 * (0 + 3 / 4) / 2) / 2), \
        f"(the test's own check) per-image mean {per_image:.4g}, expected 68.75"
    assert pooled == pytest.approx(100 * (4 / 5 + 3 / 4) / 2), \
        f"mIoU of the two images together {pooled:.4g}, expected 77.5 (intersections and unions summed over the set)"


def one_hot_world(N=6, C=3, H=4, W=4, up=2, seed=0):
    """Images whose patch tokens are one-hot class vectors; masks = the class map upsampled, some pixels ignored."""
    g = torch.Generator().manual_seed(seed)
    cls_map = torch.randint(0, C, (N, H, W), generator=g)
    patches = F.one_hot(cls_map.flatten(1), C).float()                       # (N, H*W, C)
    tokens = torch.cat([patches.mean(1, keepdim=True), patches], dim=1)       # global token first
    img = Features(tokens=tokens, mask=torch.ones(N, 1 + H * W, dtype=torch.bool), pooled=tokens[:, 0], grid=(H, W))
    masks = cls_map.repeat_interleave(up, 1).repeat_interleave(up, 2)        # (N, H*up, W*up)
    masks[:, 0, :] = 255
    return img, masks


def test_segmentation_one_hot_dense_is_perfect_and_matches_known_swap():
    C, n = 3, 2
    img, masks = one_hot_world(C=C)
    prompts = Features.from_vectors(torch.eye(C).repeat_interleave(n, dim=0))   # class-major templates
    want(ev.segmentation(Cosine(), img, masks, prompts, n, batch_size=4), "miou_fg", 100,
         "one-hot patches scored against one-hot class prompts")
    swapped = masks.clone()                            # ground truth with classes 0 and 1 exchanged
    swapped[masks == 0], swapped[masks == 1] = 1, 0
    want(ev.segmentation(Cosine(), img, swapped, prompts, n), "miou_fg", 100 / 3,
         "classes 0 and 1 swapped in the truth")


def test_segmentation_with_token_level_method_runs_per_patch():
    # dense_image of a token-level method: one (1, K) "image" per patch
    class Dense(TokenLevel):
        def dense_image(self, img):
            return F.normalize(img.patches(), dim=-1)[:, :, None]           # (B, H*W, 1, K)
    C = 3
    img, masks = one_hot_world(C=C)
    prompts = Features(tokens=torch.eye(C)[:, None], mask=torch.ones(C, 1, dtype=torch.bool), pooled=torch.eye(C))
    want(ev.segmentation(Dense(), img, masks, prompts, 1), "miou_fg", 100, "a token-level method, one patch per image")


def test_segmentation_upsamples_logits_bilinearly():
    """Random patch logits at a non-integer scale (3x4 grid -> 10x11 masks): the ground truth is the argmax
    of the per-pixel bilinear reference, so the protocol must score 100; nearest upsampling or
    align_corners=True change many pixels (checked below) and score less."""
    g = torch.Generator().manual_seed(0)
    N, C, H, W, Hm, Wm = 4, 3, 3, 4, 10, 11
    patches = torch.randn(N, H * W, C, generator=g)
    tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)
    img = Features(tokens=tokens, mask=torch.ones(N, 1 + H * W, dtype=torch.bool), pooled=tokens[:, 0], grid=(H, W))
    logits = F.normalize(patches, dim=-1).view(N, H, W, C).permute(0, 3, 1, 2)     # Cosine vs one-hot prompts
    masks = torch.stack([expected("naive_bilinear", l, Hm, Wm).argmax(0) for l in logits])     # (N, Hm, Wm)
    masks[:, 0, :3] = 255                                                           # a few ignored pixels
    prompts = Features.from_vectors(torch.eye(C))
    want(ev.segmentation(Cosine(), img, masks, prompts, 1, batch_size=3), "miou_fg", 100,
         "the truth is the argmax of the logits of the 3 x 4 grid (H x W: not square, img.grid is (H, W) and the "
         "patches come row after row) upsampled bilinearly (align_corners=False) to 10 x 11")
    valid = masks != 255
    for kw in (dict(mode="nearest"), dict(mode="bilinear", align_corners=True)):
        other = F.interpolate(logits, size=(Hm, Wm), **kw).argmax(1)
        assert (other != masks)[valid].float().mean() > 0.05, \
            f"(the test's own check) {kw} upsampling, expected to differ from the truth on > 5% of the pixels"


def test_segmentation_sums_intersections_and_unions_over_all_batches():
    """Batches of 2 over 5 images whose masks disagree with the prediction differently: mIoU from the
    intersections and unions of ALL pixels. Each image is a 1 x 1 grid, so any upsampling predicts its one
    patch's class on every pixel: this check reads the sums alone."""
    g = torch.Generator().manual_seed(1)
    N, C, Hm, Wm = 5, 3, 5, 7
    patches = torch.randn(N, 1, C, generator=g)
    tokens = torch.cat([patches, patches], 1)
    img = Features(tokens=tokens, mask=torch.ones(N, 2, dtype=torch.bool), pooled=tokens[:, 0], grid=(1, 1))
    pred = patches[:, 0].argmax(-1)[:, None, None].expand(N, Hm, Wm)                 # (N, Hm, Wm)
    masks = torch.randint(0, C, (N, Hm, Wm), generator=g)
    masks[:, :, 0] = 255
    valid = masks != 255
    inter = [int(((pred == c) & (masks == c) & valid).sum()) for c in range(C)]
    union = [int((((pred == c) | (masks == c)) & valid).sum()) for c in range(C)]
    assert all(union), "(the test's own check) expected every class in the prediction or the truth"
    expect = 100 * sum(i / u for i, u in zip(inter, union)) / C
    per_image = []
    for n in range(N):
        i_n = [int(((pred[n] == c) & (masks[n] == c) & valid[n]).sum()) for c in range(C)]
        u_n = [int((((pred[n] == c) | (masks[n] == c)) & valid[n]).sum()) for c in range(C)]
        per_image.append(100 * sum(i / u for i, u in zip(i_n, u_n) if u) / sum(u > 0 for u in u_n))
    prompts = Features.from_vectors(torch.eye(C))
    got = ev.segmentation(Cosine(), img, masks, prompts, 1, batch_size=2)["miou_fg"]
    assert got == pytest.approx(expect, abs=1e-4), (
        f"mIoU {got:.4g} over 5 images in batches of 2, expected {expect:.4g}: the set's mIoU is the mean over "
        f"classes of (intersections summed over every image) / (unions summed over every image); the mean of "
        f"the per-image mIoUs here is {sum(per_image) / N:.4g}, the last batch's alone "
        f"{ev.segmentation(Cosine(), img[4:], masks[4:], prompts, 1)['miou_fg']:.4g}")
    assert abs(sum(per_image) / N - expect) > 1, "(the test's own check) expected the per-image mean to differ"


# ----------------------------------------------------------------------------- binding

def test_binding_on_constructed_case():
    e = torch.eye(4, 6)
    true = Features.from_vectors(e)
    attr = Features.from_vectors(e + 0.5 * torch.eye(4, 6).roll(1, 1))         # always a lower cosine
    rel = e.clone()
    rel[3] = torch.eye(6)[5]                                                   # only image 3's distractor differs
    m = ev.binding(Cosine(), Features.from_vectors(e), true,
                   {"attribute": attr, "relation": Features.from_vectors(rel)}, batch_size=3)
    assert m["binding_attribute"] == pytest.approx(100)
    assert m["binding_relation"] == pytest.approx(25)                          # ties (identical caption) fail
    assert m["binding_acc"] == pytest.approx(62.5)


def test_paired_scores_are_the_diagonal():
    a, b = torch.randn(11, 4), torch.randn(11, 4)
    torch.testing.assert_close(ev.paired_scores(Cosine(), a, b, chunk=4), (a * b).sum(1))


# ----------------------------------------------------------------------------- printing

def test_results_table_one_line_per_group():
    metrics = {"retrieval": {"i2t_r1": 56.3, "rsum": 395.1234, "i2t_p1": 0.5371},
               "classification": {"shapes": {"top1": 95.3}, "cifar": {"top1": 48.8}},
               "train": {"epochs": 20}}
    lines = ev.results_table(metrics).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("retrieval") and "i2t_r1 56.30" in lines[0] and "i2t_p1 0.5371" in lines[0]
    assert lines[1].startswith("classification/shapes") and "top1 95.30" in lines[1]
    assert "epochs 20" in lines[3]
    assert len({line.index(line.split()[1]) for line in lines}) == 1           # values start in one column


def miou_of(pred, gt, C, ignore_index=255):
    """mIoU-fg (percent) of predictions vs ground truth, pooled over all pixels given."""
    return ev.miou_from_counts(*ev.iou_counts(pred, gt, C, ignore_index))

