"""STRUCTURE (methods/structure.py): R_S against explicit loops, its invariances, the warm-up."""
import math

import torch
from conftest import assert_gradient_matches_finite_differences, random_features
from recorded import expected

from methods.structure import MLPRS, LinearRS, js_divergence, structure_reg


def test_rs_matches_loops():
    g = torch.Generator().manual_seed(0)
    X, Z = torch.randn(9, 5, generator=g), torch.randn(9, 7, generator=g)
    for tau in (0.05, 0.5):
        got, want = structure_reg(X, Z, tau).item(), expected("naive_rs", X, Z, tau)
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), \
            f"R_S at tau {tau} = {got:.6f}, expected {want:.6f} (the loops: normalise, centre, softmax rows, JS)"


def test_rs_zero_for_identity_and_rotation_positive_otherwise():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(16, 6, generator=g)
    got = structure_reg(X, X, 0.05).item()
    assert abs(got) < 1e-6, f"R_S of a space with itself is {got:.3g}, expected 0"
    Q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g))
    got = structure_reg(X, 3.0 * X @ Q, 0.05).item()
    assert abs(got) < 1e-5, f"R_S of a rotated, scaled copy is {got:.3g}, expected 0"   # rotation, scale keep cosines
    got = structure_reg(X, torch.randn(16, 6, generator=g), 0.05).item()
    assert got > 0.01, f"R_S of two independent spaces is {got:.3g}, expected > 0.01"  # (the diagonal dominates)
    P = torch.softmax(torch.randn(4, 4, generator=g), 1)
    assert js_divergence(P, P).abs() < 1e-7, f"JS(P || P) = {js_divergence(P, P).item():.3g}, expected 0"
    assert js_divergence(P, P.flip(0)) <= math.log(2), \
        f"JS divergence {js_divergence(P, P.flip(0)).item():.4f}, expected at most its bound log 2 = 0.6931"


def test_rs_gradient_matches_finite_differences():
    """LinearRS and MLPRS train THROUGH R_S: its gradient must reach both spaces, through P as through Q."""
    g = torch.Generator().manual_seed(2)
    X, Z = torch.randn(7, 5, generator=g), torch.randn(7, 4, generator=g)
    assert_gradient_matches_finite_differences(lambda X, Z: structure_reg(X, Z, 0.5), [X, Z], "R_S(X, Z) at tau 0.5")


def test_identity_head_has_zero_regulariser():
    img, txt = random_features(12, 1, 8, seed=2), random_features(12, 1, 8, seed=3)
    m = LinearRS(8, 8, K=8)
    with torch.no_grad():
        m.g_v.weight.copy_(torch.eye(8))
        m.g_l.weight.copy_(torch.eye(8))
    m.step.fill_(10 ** 6)                                  # lambda fully on
    loss, logs = m.loss(img, txt)
    assert logs["r_s"] < 1e-6, f"R_S of identity heads on equal features is {logs['r_s']:.3g}, expected 0"
    assert math.isclose(loss.item(), logs["nce"], rel_tol=1e-5), \
        f"the loss {loss.item():.5f}, expected the InfoNCE {logs['nce']:.5f} alone when R_S = 0"


def test_lambda_warmup_counts_training_steps_only():
    img, txt = random_features(8, 1, 6, seed=4), random_features(8, 1, 5, seed=5)
    m = LinearRS(6, 5, K=16, lam=10.0, warmup=4)
    lams = [m.loss(img, txt)[1]["lambda"] for _ in range(6)]
    assert lams == [0.0, 2.5, 5.0, 7.5, 10.0, 10.0]
    m.eval()
    m.loss(img, txt)
    assert m.step.item() == 6                              # evaluation calls do not advance it
    assert "step" in m.state_dict()


def test_mlp_rs_starts_as_its_linear_skip():
    img = random_features(5, 1 + 4, 6, grid=(2, 2), seed=6)
    m = MLPRS(6, 5, K=16, rank=4).eval()
    assert math.isclose(torch.sigmoid(m.g_v.alpha).item(), 1 / (1 + math.exp(4)), rel_tol=1e-6)
    expected = torch.nn.functional.normalize(img.pooled @ m.g_v.P.weight.T, dim=-1)
    assert torch.allclose(m.embed_image(img), expected, atol=1e-6)   # W_2 = 0: residual is off
    assert m.dense_image(img).shape == (5, 4, 16)
