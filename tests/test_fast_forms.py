"""Fast forms against their paper forms: values AND gradients, on random input with padding.

methods/fast_cap.py's chunked_cap (Eqs. 3-6 in cache-sized chunks, hand-written backward) against
the exercise's cap(relative(...)) through autograd, and against torch.autograd.gradcheck in float64;
PAL and PAL-Rel with fast=True against fast=False; PAL-Rel's embeddings against a form with a
separate softmax over the patches for beta. A student copy's fast_cap.py is the paper form
(exercises/paper_cap.py): the kernel's tests skip there."""
import pytest
import torch
import torch.nn.functional as F
from conftest import random_features

from methods import fast_cap
from methods.fast_cap import chunked_cap
from methods.pal import PAL, cap, relative
from methods.pal_rel import PALRel, grid_positions, sincos

needs_fast = pytest.mark.skipif(not hasattr(fast_cap, "ChunkedCAP"), reason="a student copy: no fast form")


def padded_input(B=7, T=9, D=5, c=2, seed=0, dtype=torch.float32):
    """Z (B, T, D) with large garbage in the padding, a mask with rows of 1..T real tokens and a column
    padded in every row (dropped by chunked_cap), V (B, T, c)."""
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(B, T, D, generator=g, dtype=dtype)
    lengths = [T - 1, 1, 4, T - 1, 2, 6, 3][:B]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]              # (B, T)
    Z[~mask] = 100 * torch.randn(int((~mask).sum()), D, generator=g, dtype=dtype)
    V = torch.randn(B, T, c, generator=g, dtype=dtype)
    return Z, mask, V


def naive(Z, A, mask, tau_p, V):
    R = relative(Z, A)                                                         # Eq. (4), (B, T, K)
    p, alpha = cap(R, mask, tau_p)                                             # Eq. (5)-(6)
    return p, alpha.transpose(1, 2) @ V                                        # (B, K), (B, K, c)


@needs_fast
@pytest.mark.parametrize("tau_p", [0.03, 0.3])
@pytest.mark.parametrize("chunk_elements", [1, 3 * 9 * 11, 2 ** 18])          # 1 row, 3 rows (7 = 3 + 3 + 1), all
def test_chunked_cap_matches_naive_form_values_and_gradients(tau_p, chunk_elements):
    Z, mask, V = padded_input()
    A = torch.randn(11, 5, generator=torch.Generator().manual_seed(1))
    leaves = [x.clone().requires_grad_() for x in (Z, A, V)]
    fast = [x.clone().requires_grad_() for x in (Z, A, V)]
    w_p, w_Y = torch.randn(7, 11), torch.randn(7, 11, 2)                       # a random loss of both outputs
    p0, Y0 = naive(leaves[0], leaves[1], mask, tau_p, leaves[2])
    p1, Y1 = chunked_cap(fast[0], fast[1], mask, tau_p, V=fast[2], chunk_elements=chunk_elements)
    assert torch.allclose(p1, p0, atol=1e-6) and torch.allclose(Y1, Y0, atol=1e-5)
    ((p0 * w_p).sum() + (Y0 * w_Y).sum()).backward()
    ((p1 * w_p).sum() + (Y1 * w_Y).sum()).backward()
    for a, b in zip(leaves, fast):
        assert torch.allclose(b.grad, a.grad, atol=1e-4, rtol=1e-4)
    assert (fast[0].grad[~mask] == 0).all()                                   # padding gets no gradient
    with torch.no_grad():                                                      # the eval path: nothing kept
        p2, Y2 = chunked_cap(Z, A, mask, tau_p, V=V, chunk_elements=chunk_elements)
    assert torch.allclose(p2, p0, atol=1e-6) and torch.allclose(Y2, Y0, atol=1e-5)


@needs_fast
def test_chunked_cap_without_values_and_without_padding():
    Z, mask, _ = padded_input()
    mask = torch.ones_like(mask)
    A = torch.randn(11, 5, requires_grad=True)
    p0 = naive(Z, A, mask, 0.03, torch.zeros(7, 9, 1))[0]
    (gA,) = torch.autograd.grad(p0.square().sum(), A)
    p1, Y = chunked_cap(Z, A, mask, 0.03, chunk_elements=2 * 9 * 11)
    assert Y.numel() == 0 and torch.allclose(p1, p0, atol=1e-6)
    assert torch.allclose(torch.autograd.grad(p1.square().sum(), A)[0], gA, atol=1e-4)


@needs_fast
@pytest.mark.parametrize("tau_p", [0.03, 0.2])
def test_chunked_cap_gradcheck_float64(tau_p):
    Z, mask, V = padded_input(B=4, T=5, D=3, dtype=torch.float64)
    A = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    f = lambda Z, A, V: chunked_cap(Z, A, mask, tau_p, V=V, chunk_elements=2 * 5 * 6)  # chunks of 2 rows
    assert torch.autograd.gradcheck(f, tuple(x.requires_grad_() for x in (Z, A, V)))


def naive_pal_rel(m, img, txt):
    """PAL-Rel's (R1)-(R4) embeddings with a separate softmax over the patches for beta."""
    Z, mask = PAL.Z(img, "image")
    R = relative(Z, m.A_v)                                                     # (B, 1 + H*W, K)
    h_v = F.normalize(cap(R, mask, m.tau_p)[0], dim=-1)
    H, W = img.grid
    beta = (R[:, 1:1 + H * W] / m.tau_p).softmax(dim=1)                        # (R1), (B, H*W, K)
    c = beta.transpose(1, 2) @ grid_positions(H, W)                           # (B, K, 2)
    e_v = torch.cat([h_v, (c - c.mean(dim=1, keepdim=True)).flatten(1)], dim=1)
    R = relative(txt.tokens, m.A_l)
    p, alpha = cap(R, txt.mask, m.tau_p)
    B, L, _ = txt.tokens.shape
    G = (F.normalize(txt.pooled, dim=-1) @ m.V).view(B, 2, m.P)               # (R2) G(t)
    o = F.normalize(txt.tokens, dim=-1) @ m.U + sincos(torch.arange(float(L)), m.P) @ G.transpose(1, 2)  # (R2)
    d = alpha.transpose(1, 2) @ o                                              # (R3)
    return e_v, torch.cat([F.normalize(p, dim=-1), d.flatten(1) / m.K], dim=1)


@pytest.mark.parametrize("fast", [pytest.param(True, marks=needs_fast), False])
def test_pal_rel_matches_its_naive_form_values_and_gradients(fast):
    img = random_features(5, 1 + 6, 5, grid=(2, 3))
    txt = random_features(5, 6, 4, lengths=[6, 3, 1, 4, 2], seed=1)
    torch.manual_seed(0)
    m = PALRel(5, 4, K=7, fast=fast, order="index")                       # the naive form above: the index code
    with torch.no_grad():
        m.U.normal_()                                                          # the relation part live
        m.V.normal_()
    e_v, e_l = naive_pal_rel(m, img, txt)
    S0 = (e_v @ e_l.T).sum()
    g0 = torch.autograd.grad(S0, list(m.parameters()))
    e_v1, e_l1 = m.embed_image(img), m.embed_text(txt)
    assert torch.allclose(e_v1, e_v, atol=1e-6) and torch.allclose(e_l1, e_l, atol=1e-6)
    g1 = torch.autograd.grad((e_v1 @ e_l1.T).sum(), list(m.parameters()))
    for a, b in zip(g0, g1):
        assert torch.allclose(b, a, atol=1e-4, rtol=1e-4)


@needs_fast
@pytest.mark.parametrize("pooling", ["cap", "mean", "global"])
def test_pal_fast_and_paper_forms_give_the_same_embeddings_loss_and_gradients(pooling):
    """PAL(fast=True) and PAL(fast=False), same anchors, on images (global slot masked) and padded text."""
    img = random_features(6, 1 + 6, 5, grid=(2, 3), seed=4)
    txt = random_features(6, 7, 4, lengths=[7, 3, 1, 5, 2, 6], seed=5)
    torch.manual_seed(0)
    fast, paper = PAL(5, 4, K=9, pooling=pooling, fast=True), PAL(5, 4, K=9, pooling=pooling, fast=False)
    paper.load_state_dict(fast.state_dict())
    for x, modality in ((img, "image"), (txt, "text")):
        torch.testing.assert_close(fast.pool(x, modality), paper.pool(x, modality), atol=1e-6, rtol=1e-5)
    l_fast, l_paper = fast.loss(img, txt)[0], paper.loss(img, txt)[0]
    torch.testing.assert_close(l_fast, l_paper, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(l_fast, list(fast.parameters())),
                    torch.autograd.grad(l_paper, list(paper.parameters()))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_text_guided_score_matches_v_hat_formed_values_and_gradients():
    """The fast form against the paper form (v_hat formed, text_guided_score_paper), which is checked
    against a loop over the pairs and words."""
    from methods.text_guided import TextGuided, text_guided_score, text_guided_score_paper
    naive_text_guided_score = text_guided_score_paper
    g = torch.Generator().manual_seed(3)
    v = F.normalize(torch.randn(4, 6, 8, generator=g), dim=-1)
    v[1, 4:] = 0                                                               # padded patches
    w = 2 * torch.randn(5, 3, 8, generator=g)                                  # not unit: cos normalises w too
    w[2, 1:] = 0                                                               # padded words
    leaves, fast = [(v.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
    S0, S1 = naive_text_guided_score(*leaves, 0.1), text_guided_score(*fast, 0.1)
    assert torch.allclose(S1, S0, atol=1e-6)
    weight = torch.randn(4, 5, generator=g)
    (S0 * weight).sum().backward()
    (S1 * weight).sum().backward()
    for a, b in zip(leaves, fast):
        assert torch.allclose(b.grad, a.grad, atol=1e-5)
    m = TextGuided(8, 8, K=8, score_chunk=2 * 3 * 6)                           # score() in chunks of 2 pairs
    assert torch.allclose(m.score(v, w), S0.detach(), atol=1e-6)
    assert torch.allclose(TextGuided(8, 8, K=8, fast=False).score(v, w), S0.detach(), atol=1e-6)
    # the paper form against a loop: a_jp = softmax over the real patches of v_p . w_j / tau_a (the method's words
    # are unit vectors, so this is Eq. (1)'s cosine), v_hat_j = sum_p a_jp v_p
    for i in range(4):
        real_v = v[i][v[i].abs().sum(-1) > 0]                                  # (N_i, K)
        for t in range(5):
            real_w = w[t][w[t].abs().sum(-1) > 0]                              # (L_t, K)
            cos = [F.cosine_similarity((real_v @ wj / 0.1).softmax(0) @ real_v, wj, dim=0) for wj in real_w]
            assert abs(S0[i, t].item() - sum(cos).item() / len(cos)) < 1e-5


@needs_fast
def test_pal_loss_and_backward_at_coco_size_waits_on_the_host_at_most_10_times():
    """One PAL training step at COCO's token count (257 image tokens: a 16 x 16 grid + the global slot;
    K = 512, batch 256; D small, it does not change the count): every host sync counted (conftest.HostSyncs).
    On a GPU each one stalls the queue; a chunk loop with one per chunk made it ~300."""
    from conftest import HostSyncs
    B = 256
    img = random_features(B, 257, 16, grid=(16, 16), seed=1)
    txt = random_features(B, 32, 16, lengths=[8 + i % 25 for i in range(B)], seed=2)   # padded words
    m = PAL(16, 16, K=512)
    with HostSyncs() as syncs:
        loss, logs = m.loss(img, txt)
        loss.backward()
    assert len(syncs) <= 10, f"{len(syncs)} host syncs: {syncs.calls[:20]}"
    assert m.A_v.grad.abs().sum() > 0 and m.A_l.grad.abs().sum() > 0
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in logs.values())


@needs_fast
def test_chunk_is_sized_for_the_device():
    """A CPU's chunk fits its L2 cache (2 COCO samples); a GPU's takes a whole COCO batch in one chunk."""
    from methods.fast_cap import CHUNK_ELEMENTS
    T, K = 256, 512                                                            # COCO patches, PAL's K
    assert CHUNK_ELEMENTS["cpu"] // (T * K) == 2
    assert CHUNK_ELEMENTS["gpu"] // (T * K) >= 256
