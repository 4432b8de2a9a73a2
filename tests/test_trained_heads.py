"""Trained global baselines (MLP, T2C, Linear_RS, MLP_RS, SAIL): shapes, gradients,
a tiny training run on planted pairs, batch-permutation invariance; plus loss oracles."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_features

from features import Features
from methods.mlp import MLP
from methods.sail import SAIL, siglip_loss
from methods.structure import MLPRS, LinearRS
from methods.t2c import T2C

D_V, D_L = 12, 16
SMALL = {MLP: {}, T2C: {}, LinearRS: dict(K=32), MLPRS: dict(K=32, rank=8), SAIL: dict(K=32)}


def planted_pairs(N, seed=0):
    """text = fixed random linear map of the image feature + noise."""
    g = torch.Generator().manual_seed(0)
    M = torch.randn(D_V, D_L, generator=g)
    g.manual_seed(seed + 1)
    x = torch.randn(N, D_V, generator=g)
    y = x @ M + 0.3 * torch.randn(N, D_L, generator=g)
    return Features.from_vectors(x), Features.from_vectors(y)


def train(method, img, txt, steps=150, B=64):
    d = method.defaults
    opt_cls = torch.optim.Adam if d["optimizer"] == "adam" else torch.optim.AdamW
    kw = dict(betas=d["betas"]) if "betas" in d else {}
    opt = opt_cls(method.parameters(), lr=d["lr"], weight_decay=d["weight_decay"], **kw)
    g = torch.Generator().manual_seed(0)
    losses = []
    method.train()
    for _ in range(steps):
        idx = torch.randperm(len(img), generator=g)[:B]
        loss, logs = method.loss(img[idx], txt[idx])
        opt.zero_grad()
        loss.backward()
        if "grad_clip" in d:
            torch.nn.utils.clip_grad_norm_(method.parameters(), d["grad_clip"])
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("cls", SMALL, ids=lambda c: c.__name__)
def test_shapes_and_gradient_flow(cls):
    torch.manual_seed(0)
    m = cls(D_V, D_L, **SMALL[cls])
    img = random_features(6, 1 + 4, D_V, grid=(2, 2), seed=1)
    txt = random_features(6, 3, D_L, seed=2)
    e_v, e_l = m.embed_image(img), m.embed_text(txt)
    assert e_v.shape[0] == 6 and e_l.shape == e_v.shape
    assert torch.allclose(e_v.norm(dim=1), torch.ones(6), atol=1e-5)
    assert m.score(e_v, e_l).shape == (6, 6)
    assert m.dense_image(img).shape == (6, 4, e_v.shape[1])
    train(m, img, txt, steps=2, B=6)                       # MLP_RS: W_2 = 0 at init, so W_1 and alpha
    loss, logs = m.loss(img, txt)                          # get gradients only after a first step
    m.zero_grad()
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert all(isinstance(v, float) or (v.dim() == 0 and not v.requires_grad) for v in logs.values())  # no host sync


@pytest.mark.parametrize("cls", SMALL, ids=lambda c: c.__name__)
def test_tiny_training_run_learns_planted_map(cls):
    torch.manual_seed(0)
    m = cls(D_V, D_L, **SMALL[cls])
    img, txt = planted_pairs(640)
    losses = train(m, img[:512], txt[:512])
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    m.eval()
    with torch.no_grad():
        S = m.score(m.embed_image(img[512:]), m.embed_text(txt[512:]))      # (128, 128) held out
        r1_i2t = (S.argmax(1) == torch.arange(128)).float().mean()
        r1_t2i = (S.argmax(0) == torch.arange(128)).float().mean()
        assert r1_i2t > 0.3 and r1_t2i > 0.3, (r1_i2t, r1_t2i)              # chance: 1/128
        perm = torch.randperm(128)
        S_p = m.score(m.embed_image(img[512:][perm]), m.embed_text(txt[512:]))
        assert torch.allclose(S_p, S[perm], atol=1e-6)


def test_siglip_loss_matches_loop():
    g = torch.Generator().manual_seed(3)
    h_v = F.normalize(torch.randn(5, 4, generator=g), dim=1)
    h_l = F.normalize(torch.randn(5, 4, generator=g), dim=1)
    naive = 0.0
    for i in range(5):
        for j in range(5):
            z = 1.0 if i == j else -1.0
            naive -= math.log(1 / (1 + math.exp(-z * (20.0 * float(h_v[i] @ h_l[j]) - 10.0))))
    assert math.isclose(siglip_loss(h_v, h_l, 20.0, -10.0).item(), naive / 5, rel_tol=1e-5)


def test_mlp_text_input_is_f_T_as_the_paper_writes_and_t2c_normalises():
    """MLP-alignment (§4.1, App. E): g_bar(f_T(t)) on the raw text feature, the same in
    training and inference (methods/mlp.py choice 1), reimplemented here from its
    weights; text_input="l2" feeds y / ||y||. T2C normalises (the authors' code does,
    in training and at inference). Both keep the image side the identity."""
    img, txt = random_features(4, 1, D_V, seed=4), random_features(4, 1, D_L, seed=5)
    mlp = MLP(D_V, D_L).eval()
    W1, W2, ln = mlp.g_bar[0], mlp.g_bar[3], mlp.g_bar[4]
    paper = lambda y: F.normalize(ln(W2(F.gelu(W1(y)))), dim=1)          # g_bar(y), Eq. (2), eval mode
    torch.testing.assert_close(mlp.embed_text(txt), paper(txt.pooled))
    loss, _ = mlp.loss(img, txt)                                           # training reads the same input
    torch.testing.assert_close(loss, (1 - (paper(txt.pooled) * F.normalize(img.pooled, dim=1)).sum(1)).mean())
    l2 = MLP(D_V, D_L, text_input="l2").eval()
    l2.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(l2.embed_text(txt), paper(F.normalize(txt.pooled, dim=1)))
    for m in (mlp, T2C(D_V, D_L)):
        assert torch.allclose(m.embed_image(img), F.normalize(img.pooled, dim=1))
    t2c = T2C(D_V, D_L)
    scaled = Features.from_vectors(7.0 * txt.pooled)
    assert torch.allclose(t2c.embed_text(scaled), t2c.embed_text(txt), atol=1e-5)
    loss, _ = t2c.loss(img, txt)
    mapped = F.normalize(txt.pooled, dim=1) @ t2c.W.weight.T
    assert torch.isclose(loss, ((mapped - F.normalize(img.pooled, dim=1)) ** 2).mean())
