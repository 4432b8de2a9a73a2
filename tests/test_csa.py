"""CSA (methods/csa.py): CCA against a planted correlation structure and closed forms."""
import torch

from features import Features
from methods.csa import CSA


def planted_views(N, rho, extra_v=3, extra_l=2, seed=0):
    """Latent pairs (s_x,i, s_y,i) with corr rho_i, plus independent noise dims, mixed per view."""
    g = torch.Generator().manual_seed(seed)
    rho = torch.tensor(rho, dtype=torch.float64)
    s_x = torch.randn(N, len(rho), generator=g, dtype=torch.float64)
    s_y = rho * s_x + (1 - rho ** 2).sqrt() * torch.randn(N, len(rho), generator=g, dtype=torch.float64)
    z_x = torch.cat([s_x, torch.randn(N, extra_v, generator=g, dtype=torch.float64)], 1)
    z_y = torch.cat([s_y, torch.randn(N, extra_l, generator=g, dtype=torch.float64)], 1)
    M_x = torch.randn(z_x.shape[1], z_x.shape[1], generator=g, dtype=torch.float64) + 2 * torch.eye(z_x.shape[1])
    M_y = torch.randn(z_y.shape[1], z_y.shape[1], generator=g, dtype=torch.float64) + 2 * torch.eye(z_y.shape[1])
    X, Y = (z_x @ M_x + 3.0).float(), (z_y @ M_y - 1.0).float()     # offsets: CSA must centre
    return Features.from_vectors(X), Features.from_vectors(Y)


def corr(a, b):
    a, b = a - a.mean(0), b - b.mean(0)
    return (a * b).sum(0) / (a.norm(dim=0) * b.norm(dim=0))


def test_planted_correlations_are_recovered():
    rho = [0.9, 0.7, 0.5, 0.3]
    img, txt = planted_views(20000, rho)
    csa = CSA(img.pooled.shape[1], txt.pooled.shape[1], d=4).fit(img, txt)
    assert torch.allclose(csa.rho, torch.tensor(rho), atol=0.02), csa.rho
    # the projected (un-normalised) views correlate per dimension at rho_i, across dims at 0
    u = (img.pooled - csa.mu_v) @ csa.A
    v = (txt.pooled - csa.mu_l) @ csa.B
    assert torch.allclose(corr(u, v), torch.tensor(rho), atol=0.02)
    assert corr(u[:, :1], v[:, 1:2]).abs() < 0.03
    # within a view the canonical variates are uncorrelated with unit variance
    assert torch.allclose(torch.cov(u.T), torch.eye(4), atol=0.02)


def test_matches_generalised_eigenproblem():
    img, txt = planted_views(300, [0.8, 0.4], extra_v=2, extra_l=1, seed=1)
    csa = CSA(4, 3, ridge=0.0).fit(img, txt)               # d = min(200, 4, 3) = 3
    X = img.pooled.double() - img.pooled.double().mean(0)
    Y = txt.pooled.double() - txt.pooled.double().mean(0)
    S_xx, S_yy, S_xy = X.T @ X, Y.T @ Y, X.T @ Y
    # rho^2 are the eigenvalues of S_xx^-1 S_xy S_yy^-1 S_yx (the textbook CCA form)
    M = torch.linalg.solve(S_xx, S_xy) @ torch.linalg.solve(S_yy, S_xy.T)
    eig = torch.linalg.eigvals(M).real.sort(descending=True).values[:3]
    assert torch.allclose(csa.rho.double() ** 2, eig, atol=1e-4)


def test_one_dimensional_views_give_absolute_pearson():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 1, generator=g)
    y = -0.6 * x + torch.randn(500, 1, generator=g)
    csa = CSA(1, 1, ridge=0.0).fit(Features.from_vectors(x), Features.from_vectors(y))
    assert torch.allclose(csa.rho, corr(x, y).abs(), atol=1e-5)


def test_score_is_rho_weighted_dot_and_permutes_with_batch():
    img, txt = planted_views(2000, [0.9, 0.5])
    csa = CSA(5, 4).fit(img, txt)
    e_v, e_l = csa.embed_image(img[:7]), csa.embed_text(txt[:5])
    assert torch.allclose(e_v.norm(dim=1), torch.ones(7), atol=1e-5)
    S = csa.score(e_v, e_l)
    naive = torch.tensor([[sum(csa.rho[i] * e_v[a, i] * e_l[b, i] for i in range(csa.d)) for b in range(5)]
                          for a in range(7)])
    assert torch.allclose(S, naive, atol=1e-5)
    perm = torch.randperm(7)
    assert torch.allclose(csa.score(csa.embed_image(img[perm]), e_l), S[perm], atol=1e-6)
    # true pairs score higher than mismatched ones on average
    S_all = csa.score(csa.embed_image(img[:200]), csa.embed_text(txt[:200]))
    assert S_all.diag().mean() > S_all.mean() + 0.2


def test_few_samples_and_dense_image():
    from conftest import random_features
    img = random_features(10, 1 + 4, 6, grid=(2, 2), seed=3)
    txt = random_features(10, 3, 8, seed=4)
    csa = CSA(6, 8).fit(img, txt)                          # d = min(200, 6, 8, 10 - 1) = 6
    assert csa.A.shape == (6, 6) and torch.isfinite(csa.A).all()
    dense = csa.dense_image(img)
    assert dense.shape == (10, 4, 6)
    # a patch token equal to the pooled vector gets the image embedding
    img.tokens[:, 1] = img.pooled
    assert torch.allclose(csa.dense_image(img)[:, 0], csa.embed_image(img), atol=1e-5)
    small = CSA(6, 8).fit(img[:4], txt[:4])               # N - 1 = 3 canonical pairs only
    assert (small.rho[3:] == 0).all() and (small.A[:, 3:] == 0).all()


def test_covariances_in_chunks_match_the_whole_set():
    """Centring uses the mean of the WHOLE set, whatever the chunk size: rows with a drift (chunk means
    differ from the global mean) against torch.cov."""
    from methods.csa import covariances
    g = torch.Generator().manual_seed(3)
    X = torch.randn(50, 4, generator=g) + torch.linspace(0, 5, 50)[:, None]       # mean drifts along the rows
    Y = torch.randn(50, 3, generator=g) - torch.linspace(0, 3, 50)[:, None]
    mu_x, mu_y, S_xx, S_yy, S_xy = covariances(X, Y, chunk=7)
    C = torch.cov(torch.cat([X, Y], 1).double().T)                                # (7, 7), divides by N - 1
    assert torch.allclose(mu_x, X.double().mean(0)) and torch.allclose(mu_y, Y.double().mean(0))
    assert torch.allclose(S_xx, C[:4, :4]) and torch.allclose(S_yy, C[4:, 4:]) and torch.allclose(S_xy, C[:4, 4:])
