"""ASIF (methods/asif.py): relative representations against a per-sample Python loop."""
import torch
import torch.nn.functional as F
from conftest import assert_same, random_features
from recorded import expected

from features import Features
from methods.asif import ASIF


def test_relative_representation_matches_loop():
    img, txt = random_features(30, 1, 6, seed=0), random_features(30, 1, 5, seed=1)
    asif = ASIF(6, 5, k=7, p=3).fit(img, txt)
    q = random_features(4, 1, 6, seed=2)
    emb = asif.embed_image(q)
    assert emb.shape == (4, 30), f"embed_image has shape {tuple(emb.shape)}, expected (4, 30): one entry per anchor"
    for b in range(4):
        ref = expected("naive_relative", q.pooled[b], img.pooled, 7, 3)
        assert_same(emb[b], ref, f"image {b}'s relative representation (k 7, p 3)", atol=1e-5, rtol=0)
    assert ((emb > 0).sum(1) <= 7).all(), f"up to {(emb > 0).sum(1).max()} non-zero entries per row, expected <= k = 7"
    emb_l = asif.embed_text(txt[:3])
    for b in range(3):
        ref = expected("naive_relative", txt.pooled[b], txt.pooled, 7, 3)
        assert_same(emb_l[b], ref, f"text {b}'s relative representation (k 7, p 3)", atol=1e-5, rtol=0)


def test_relative_representation_at_the_default_even_power():
    """p = 8 (even): the top-k keeps the most SIMILAR anchors and negative cosines are clamped before the
    power; a power taken first would rank an anchor at cosine -0.9 like one at +0.9."""
    img, txt = random_features(30, 1, 6, seed=0), random_features(30, 1, 5, seed=1)
    q = random_features(4, 1, 6, seed=2)
    for k in (5, 25):                                      # k = 25 of 30 keeps negative cosines too
        asif = ASIF(6, 5, k=k).fit(img, txt)
        assert asif.p == 8, f"ASIF's default p = {asif.p}, expected 8"
        emb = asif.embed_image(q)
        for b in range(4):
            ref = expected("naive_relative", q.pooled[b], img.pooled, k, 8)
            assert_same(emb[b], ref, f"image {b}'s relative representation at k {k}, p 8 (the k largest cosines, "
                        f"clamped at 0, to the power p, L2-normalised)", atol=1e-5, rtol=0)


def test_k_capped_by_anchor_count_and_n_anchors():
    img, txt = random_features(10, 1, 4, seed=3), random_features(10, 1, 4, seed=4)
    asif = ASIF(4, 4).fit(img, txt)                        # k = 800 > 10 anchors
    e = asif.embed_image(img)
    assert e.shape == (10, 10), f"k = 800 with 10 anchors: shape {tuple(e.shape)}, expected (10, 10)"
    assert torch.isfinite(e).all(), \
        "k = 800 with 10 anchors gives NaN or inf, expected finite entries (cap k at the number of anchors)"
    assert (e >= 0).all(), f"smallest entry {e.min().item():.3g}, expected >= 0 (clamp at 0)"
    capped = ASIF(4, 4, n_anchors=6).fit(img, txt)
    assert capped.anchors_v.shape == (6, 4), f"n_anchors 6: image anchors {tuple(capped.anchors_v.shape)}, " \
                                             "expected (6, 4)"
    assert capped.anchors_l.shape == (6, 4), f"n_anchors 6: text anchors {tuple(capped.anchors_l.shape)}, " \
                                             "expected (6, 4)"
    # the same pairs on both sides: anchor j of each modality comes from one training pair
    j = (F.normalize(img.pooled, dim=1) @ capped.anchors_v.T).argmax(0)
    assert torch.equal(j, (F.normalize(txt.pooled, dim=1) @ capped.anchors_l.T).argmax(0)), \
        "the image and text anchors do not come from the same training pairs, expected anchor j of both from pair j"


def test_retrieval_on_paired_clusters_and_permutation():
    # 20 concepts; each modality sees the concept through its own random map + noise
    g = torch.Generator().manual_seed(5)
    c = torch.randn(20, 8, generator=g)
    M_v, M_l = torch.randn(8, 12, generator=g), torch.randn(8, 9, generator=g)
    lab = torch.arange(200) % 20
    noisy = lambda M: (c[lab] + 0.3 * torch.randn(200, 8, generator=g)) @ M
    img, txt = Features.from_vectors(noisy(M_v)), Features.from_vectors(noisy(M_l))
    asif = ASIF(12, 9, k=50, p=8).fit(img[:150], txt[:150])
    S = asif.score(asif.embed_image(img[150:]), asif.embed_text(txt[150:]))     # (50, 50)
    same = lab[150:, None] == lab[None, 150:]
    # the best caption of every held-out image is of its concept (chance 1/20)
    hit = same[torch.arange(50), S.argmax(1)].float().mean()
    assert hit > 0.8, \
        f"{100 * hit:.0f}% of held-out images find a caption of their concept first, expected over 80% (chance 5%)"
    perm = torch.randperm(50)
    S_p = asif.score(asif.embed_image(img[150:][perm]), asif.embed_text(txt[150:]))
    assert torch.allclose(S_p, S[perm]), "scores of the permuted images are not the expected permuted scores"


def test_dense_image_matches_pooled_representation():
    img = random_features(5, 1 + 4, 6, grid=(2, 2), seed=6)
    txt = random_features(5, 2, 3, seed=7)
    asif = ASIF(6, 3, k=3).fit(img, txt)
    img.tokens[:, 2] = img.pooled
    dense = asif.dense_image(img)
    assert dense.shape == (5, 4, 5), f"dense_image has shape {tuple(dense.shape)}, expected (B, H*W, N_a) = (5, 4, 5)"
    assert torch.allclose(dense[:, 1], asif.embed_image(img), atol=1e-6), \
        "a patch equal to the pooled vector does not get the image's representation, expected it to"


def test_one_input_normalisation_at_fit_and_at_test():
    """Rows at any scale (unit head rows next to raw features of norm ~28) give the same
    anchors and embeddings as unit rows, at fit and at test."""
    img, txt = random_features(12, 1, 6, seed=8), random_features(12, 1, 5, seed=9)
    g = torch.Generator().manual_seed(0)
    scaled = lambda f: Features.from_vectors(f.pooled * (28 * torch.rand(len(f), 1, generator=g) + 0.1))
    unit = lambda f: Features.from_vectors(F.normalize(f.pooled, dim=-1))
    a, b = ASIF(6, 5, k=5).fit(unit(img), unit(txt)), ASIF(6, 5, k=5).fit(scaled(img), scaled(txt))
    assert torch.allclose(a.anchors_v, b.anchors_v, atol=1e-6) and torch.allclose(a.anchors_l, b.anchors_l, atol=1e-6)
    q = random_features(4, 1, 6, seed=10)
    assert torch.allclose(a.embed_image(scaled(q)), a.embed_image(unit(q)), atol=1e-6)
