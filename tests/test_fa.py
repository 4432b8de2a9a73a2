"""FA (methods/fa.py): projectors against explicit per-token loops, invariances, gradients,
PAL's parameter count, and a planted training run."""
import torch
import torch.nn.functional as F
from conftest import random_features

from features import Features
from methods.fa import FA, masked_mean


def image_features(B, D, grid=(3, 4), seed=0):
    """Image Features: token 0 global, then H*W patches (no padding)."""
    H, W = grid
    return random_features(B, 1 + H * W, D, grid=grid, seed=seed)


def model(d_image=8, d_text=6, **hp):
    torch.manual_seed(0)
    return FA(d_image, d_text, K=5, **hp).eval()        # eval: dropout off


def test_shapes_of_every_output():
    m = model()
    img, txt = image_features(4, 8), random_features(3, 7, 6, lengths=[7, 2, 5], seed=1)
    assert m.embed_image(img).shape == (4, 5) and m.embed_text(txt).shape == (3, 5)
    assert m.score(m.embed_image(img), m.embed_text(txt)).shape == (4, 3)
    for dense in ("local", "sum"):
        d = model(dense=dense).dense_image(img)
        assert d.shape == (4, 12, 5) and torch.allclose(d.norm(dim=-1), torch.ones(4, 12))
    m.train()
    loss, logs = m.loss(image_features(3, 8), txt)
    assert loss.dim() == 0 and torch.isfinite(loss) and set(logs) == {"nce", "tau"}


def test_embeddings_match_per_token_loops():
    """Eqs. (3)-(4) with Python loops: project each token alone, average, add / apply the head."""
    m = model()
    img, txt = image_features(3, 8, seed=2), random_features(3, 7, 6, lengths=[7, 1, 4], seed=3)
    with torch.no_grad():
        for b in range(3):
            loc = [m.P_loc(img.tokens[b, t]) for t in range(1, img.tokens.shape[1])]
            z_v = m.P_cls(img.tokens[b, 0]) + sum(loc) / len(loc)
            assert torch.allclose(m.embed_image(img)[b], z_v / z_v.norm(), atol=1e-6)
            words = [m.P_txt(txt.tokens[b, t]) for t in range(7) if txt.mask[b, t]]
            z_l = m.G((sum(words) / len(words))[None])[0]
            assert torch.allclose(m.embed_text(txt)[b], z_l / z_l.norm(), atol=1e-6)
    z, mask = torch.randn(2, 4, 3), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.allclose(masked_mean(z, mask), torch.stack([z[0, :2].mean(0), z[1].mean(0)]))


def test_dense_image_local_and_sum():
    """local: P_loc per patch; sum: its mean over patches is z_v, so it normalises to embed_image."""
    img = image_features(2, 8, seed=4)
    local = model().dense_image(img)
    with torch.no_grad():
        assert torch.allclose(local[1, 5], F.normalize(model().P_loc(img.patches()[1, 5]), dim=-1), atol=1e-6)
        m = model(dense="sum")
        z = m.P_loc(img.patches()) + m.P_cls(img.tokens[:, 0])[:, None]      # un-normalised dense vectors
        assert torch.allclose(m.dense_image(img), F.normalize(z, dim=-1), atol=1e-6)
        assert torch.allclose(F.normalize(z.mean(1), dim=-1), m.embed_image(img), atol=1e-6)
        assert not torch.allclose(local, m.dense_image(img), atol=1e-3)


def test_text_padding_with_garbage_does_not_change_embedding():
    m = model()
    txt = random_features(3, 5, 6, lengths=[5, 2, 3], seed=5)
    garbage = 100 * torch.randn(3, 4, 6)                  # 4 more padded columns with large values
    tokens = torch.cat([txt.tokens, garbage], 1)
    tokens[1, 2:5] = 7.0                                  # and garbage in the existing padding
    mask = torch.cat([txt.mask, torch.zeros(3, 4, dtype=torch.bool)], 1)
    padded = Features(tokens=tokens, mask=mask, pooled=txt.pooled)
    assert torch.allclose(m.embed_text(txt), m.embed_text(padded), atol=1e-6)


def test_permuting_the_batch_permutes_the_scores():
    m = model()
    img, txt = image_features(5, 8, seed=6), random_features(5, 6, 6, lengths=[6, 3, 1, 4, 6], seed=7)
    S = m.score(m.embed_image(img), m.embed_text(txt))
    p, q = torch.randperm(5), torch.randperm(5)
    assert torch.allclose(m.score(m.embed_image(img[p]), m.embed_text(txt[q])), S[p][:, q], atol=1e-6)


def test_gradients_reach_every_projector_and_tau():
    m = model().train()
    loss, _ = m.loss(image_features(6, 8, seed=8), random_features(6, 4, 6, lengths=[4, 2, 3, 4, 1, 2], seed=9))
    loss.backward()
    for name in ("P_cls", "P_loc", "P_txt", "G"):
        grads = [p.grad for p in getattr(m, name).parameters()]
        assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0, name
    assert m.tau.grad is not None and m.tau.grad != 0


def test_tau_is_clamped_before_each_loss():
    m = model().train()
    img, txt = image_features(3, 8), random_features(3, 2, 6, seed=1)
    with torch.no_grad():
        m.tau.fill_(2.0)
    assert m.loss(img, txt)[1]["tau"] == 0.5
    with torch.no_grad():
        m.tau.fill_(-1.0)
    assert abs(m.loss(img, txt)[1]["tau"] - 0.001) < 1e-9


def test_parameter_count_matches_pal_table_1():
    """DINOv2-L + RoBERTa-L (D = 1024 each): K = 512 gives PAL's "4.5M"; the code's K = 1024 gives 11.6M."""
    n = lambda K: sum(p.numel() for p in FA(1024, 1024, K=K).parameters())
    token_projector = lambda D, K: 2 * D + (D * K + K) * 2 + K * K + K   # LayerNorm, W_a, W_b, W_c
    text_head = lambda K: 2 * (K * K + K) + 2 * K                       # W_d, W_e, LayerNorm
    assert n(512) == 3 * token_projector(1024, 512) + text_head(512) + 1 == 4_469_249
    assert round(n(1024) / 1e6, 1) == 11.6


def test_planted_training_learns_the_map():
    """Text tokens = a fixed random linear map of the image's tokens + noise; the loss drops and
    held-out in-batch retrieval beats chance by far."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    D_v, D_l, T, N = 12, 10, 5, 512
    M = torch.randn(D_v, D_l, generator=g)

    def pairs(n):
        x = torch.randn(n, T, D_v, generator=g)                              # token 0 + 2x2 patches
        lengths = torch.randint(2, T + 1, (n,), generator=g)
        mask = torch.arange(T)[None] < lengths[:, None]
        y = (x @ M + 0.3 * torch.randn(n, T, D_l, generator=g)) * mask[..., None]   # word t <- image token t
        img = Features(tokens=x, mask=torch.ones(n, T, dtype=torch.bool), pooled=x.mean(1), grid=(2, 2))
        return img, Features(tokens=y, mask=mask, pooled=masked_mean(y, mask))

    img, txt = pairs(N)
    torch.manual_seed(0)
    m = FA(D_v, D_l, K=16)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.02)
    losses = []
    for _step in range(150):
        idx = torch.randperm(N)[:64]
        loss, _ = m.loss(img[idx], txt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    m.eval()
    test_img, test_txt = pairs(64)
    with torch.no_grad():
        S = m.score(m.embed_image(test_img), m.embed_text(test_txt))     # (64, 64)
    r1_i2t = (S.argmax(1) == torch.arange(64)).float().mean()
    r1_t2i = (S.argmax(0) == torch.arange(64)).float().mean()
    assert r1_i2t > 0.3 and r1_t2i > 0.3                                   # chance: 1/64
