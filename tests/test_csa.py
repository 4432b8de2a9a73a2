"""CSA (methods/csa.py): CCA against a planted correlation structure and closed forms.

The planted structures are linear, so the tests of the CCA itself turn CSA's input
normalisation off (normalize=False); test_one_input_normalisation checks it."""
import torch

from features import Features
from methods.csa import CSA, covariances


def projected_corr(A, B, S_xx, S_yy, S_xy):
    """(d,) correlations of the projected views A_i^T x, B_i^T y under covariances S."""
    cov = (A * (S_xy @ B)).sum(0)                                              # diag(A^T S_xy B)
    return cov / ((A * (S_xx @ A)).sum(0) * (B * (S_yy @ B)).sum(0)).sqrt()


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
    csa = CSA(img.pooled.shape[1], txt.pooled.shape[1], d=4, normalize=False, ridge="auto").fit(img, txt)
    found = lambda t: ", ".join(f"{x:.3f}" for x in t.tolist())
    assert torch.allclose(csa.rho, torch.tensor(rho), atol=0.02), \
        f"canonical correlations {found(csa.rho)}, expected the planted 0.9, 0.7, 0.5, 0.3"
    # the projected (un-normalised) views correlate per dimension at rho_i, across dims at 0
    u = (img.pooled - csa.mu_v) @ csa.A
    v = (txt.pooled - csa.mu_l) @ csa.B
    assert torch.allclose(corr(u, v), torch.tensor(rho), atol=0.02), \
        f"the projected views x A, y B correlate at {found(corr(u, v))} per dimension, expected the planted 0.9, 0.7, 0.5, 0.3"
    assert corr(u[:, :1], v[:, 1:2]).abs() < 0.03, \
        f"canonical variate 1 of x correlates with variate 2 of y at {corr(u[:, :1], v[:, 1:2]).item():.3f}, expected 0"
    # within a view the canonical variates are uncorrelated with unit variance
    assert torch.allclose(torch.cov(u.T), torch.eye(4), atol=0.02), \
        f"the covariance of x's canonical variates is off the expected identity by " \
        f"{(torch.cov(u.T) - torch.eye(4)).abs().max():.3f}"


def test_matches_generalised_eigenproblem():
    img, txt = planted_views(300, [0.8, 0.4], extra_v=2, extra_l=1, seed=1)
    csa = CSA(4, 3, ridge=0.0, normalize=False).fit(img, txt)               # d = min(200, 4, 3) = 3
    X = img.pooled.double() - img.pooled.double().mean(0)
    Y = txt.pooled.double() - txt.pooled.double().mean(0)
    S_xx, S_yy, S_xy = X.T @ X, Y.T @ Y, X.T @ Y
    # rho^2 are the eigenvalues of S_xx^-1 S_xy S_yy^-1 S_yx (the textbook CCA form)
    M = torch.linalg.solve(S_xx, S_xy) @ torch.linalg.solve(S_yy, S_xy.T)
    eig = torch.linalg.eigvals(M).real.sort(descending=True).values[:3]
    assert torch.allclose(csa.rho.double() ** 2, eig, atol=1e-4), \
        f"rho^2 = {(csa.rho.double() ** 2).tolist()}, expected the eigenvalues of S_xx^-1 S_xy S_yy^-1 S_yx {eig.tolist()}"


def test_one_dimensional_views_give_absolute_pearson():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 1, generator=g)
    y = -0.6 * x + torch.randn(500, 1, generator=g)
    csa = CSA(1, 1, ridge=0.0, normalize=False).fit(Features.from_vectors(x), Features.from_vectors(y))
    assert torch.allclose(csa.rho, corr(x, y).abs(), atol=1e-5), \
        f"rho {csa.rho.tolist()} of two 1-d views, expected their |Pearson r| {corr(x, y).abs().tolist()}"


def test_score_is_rho_weighted_dot_and_permutes_with_batch():
    img, txt = planted_views(2000, [0.9, 0.5])
    csa = CSA(5, 4, normalize=False, ridge="auto").fit(img, txt)
    e_v, e_l = csa.embed_image(img[:7]), csa.embed_text(txt[:5])
    assert torch.allclose(e_v.norm(dim=1), torch.ones(7), atol=1e-5), \
        f"image embeddings of norms {e_v.norm(dim=1).tolist()}, expected 1"
    S = csa.score(e_v, e_l)
    naive = torch.tensor([[sum(csa.rho[i] * e_v[a, i] * e_l[b, i] for i in range(csa.d)) for b in range(5)]
                          for a in range(7)])
    assert torch.allclose(S, naive, atol=1e-5), \
        f"scores differ by up to {(S - naive).abs().max():.3g} from the expected sum_i rho_i u_i v_i"
    perm = torch.randperm(7)
    assert torch.allclose(csa.score(csa.embed_image(img[perm]), e_l), S[perm], atol=1e-6), \
        "scores of the permuted images are not the expected permuted scores"
    # true pairs score higher than mismatched ones on average
    S_all = csa.score(csa.embed_image(img[:200]), csa.embed_text(txt[:200]))
    assert S_all.diag().mean() > S_all.mean() + 0.2, \
        f"true pairs score {S_all.diag().mean():.3f} on average, all pairs {S_all.mean():.3f}: expected the true " \
        f"pairs over {S_all.mean() + 0.2:.3f}"


def test_few_samples_and_dense_image():
    from conftest import random_features
    img = random_features(10, 1 + 4, 6, grid=(2, 2), seed=3)
    txt = random_features(10, 3, 8, seed=4)
    csa = CSA(6, 8, ridge="auto").fit(img, txt)                          # d = min(200, 6, 8, 10 - 1) = 6
    assert csa.A.shape == (6, 6), f"A has shape {tuple(csa.A.shape)}, expected (D_v, d) = (6, 6)"
    assert torch.isfinite(csa.A).all(), "A has NaN or inf entries (10 samples, ridge 'auto'), expected finite ones"
    dense = csa.dense_image(img)
    assert dense.shape == (10, 4, 6), f"dense_image has shape {tuple(dense.shape)}, expected (10, 4, 6)"
    # a patch token equal to the pooled vector gets the image embedding
    img.tokens[:, 1] = img.pooled
    assert torch.allclose(csa.dense_image(img)[:, 0], csa.embed_image(img), atol=1e-5), \
        "a patch equal to the pooled vector does not get the image's embedding, expected it to"
    small = CSA(6, 8, ridge="auto").fit(img[:4], txt[:4])  # N - 1 = 3 canonical pairs only
    assert (small.rho[3:] == 0).all(), \
        f"rho = {small.rho.tolist()}, expected 0 from the 4th on: 4 samples give N - 1 = 3 canonical pairs"
    assert (small.A[:, 3:] == 0).all(), "A's columns 4-6 are not 0, expected 0: 4 samples give N - 1 = 3 canonical pairs"


def anisotropic_views(N, rho, extra_v, extra_l, signal_var=1.0, noise_var=1.0, cond=None, seed=0):
    """Planted pairs as in planted_views, mixed so that each view's covariance has condition number ~cond:
    cond given: random rotations with singular values log-spaced over sqrt(cond) (signal and noise mixed);
    else the signal dims have variance signal_var, the noise dims noise_var (a spiked covariance).
    The mixing depends only on the dimensions, so two calls draw from the same distribution."""
    g = torch.Generator().manual_seed(seed)
    rho = torch.tensor(rho, dtype=torch.float64)
    s_x = torch.randn(N, len(rho), generator=g, dtype=torch.float64)
    s_y = rho * s_x + (1 - rho ** 2).sqrt() * torch.randn(N, len(rho), generator=g, dtype=torch.float64)
    z_x = torch.cat([signal_var ** 0.5 * s_x, noise_var ** 0.5 * torch.randn(N, extra_v, generator=g, dtype=torch.float64)], 1)
    z_y = torch.cat([signal_var ** 0.5 * s_y, noise_var ** 0.5 * torch.randn(N, extra_l, generator=g, dtype=torch.float64)], 1)

    def mix(D):
        h = torch.Generator().manual_seed(100 + D)
        Q1 = torch.linalg.qr(torch.randn(D, D, generator=h, dtype=torch.float64))[0]
        if cond is None:
            return Q1
        Q2 = torch.linalg.qr(torch.randn(D, D, generator=h, dtype=torch.float64))[0]
        return Q1 @ torch.diag(torch.logspace(0, 0.5 * torch.log10(torch.tensor(cond)).item(), D,
                                              dtype=torch.float64)) @ Q2
    X, Y = z_x @ mix(z_x.shape[1]), z_y @ mix(z_y.shape[1])
    return Features.from_vectors(X.float()), Features.from_vectors(Y.float())


def test_auto_ridge_recovers_planted_correlations_on_anisotropic_views():
    """Covariance condition number ~2000, signal spread over all directions. A ridge relative to the mean
    variance shrinks rho here (1e-3 took 0.9 to 0.81); a tiny one recovers them, and ridge="auto" picks a
    small ridge (its held-out score is a rank, which a slight shrink of rho does not change)."""
    rho = [0.9, 0.7, 0.5, 0.3]
    img, txt = anisotropic_views(20000, rho, 3, 2, cond=2000.0)
    c = torch.linalg.cond(torch.cov(img.pooled.double().T))
    assert 1500 < c < 2500, c
    csa = CSA(7, 6, d=4, normalize=False, ridge=1e-4).fit(img, txt)
    assert torch.allclose(csa.rho, torch.tensor(rho), rtol=0.03), csa.rho
    assert CSA(7, 6, d=4, normalize=False, ridge="auto").fit(img, txt).chosen_ridge <= 3e-3


def test_auto_ridge_generalises_with_few_pairs_in_many_dimensions():
    """400 pairs, ~200 dims per view, the correlated pairs on the high-variance
    directions (condition number ~2000): a small ridge fits noise (training rho ~0.99, held-out
    collapse); the held-out choice picks a large one and the NEW pairs correlate as planted."""
    rho = [0.9, 0.7, 0.5, 0.3]
    kw = dict(extra_v=200, extra_l=150, noise_var=1 / 2000)
    img, txt = anisotropic_views(400, rho, **kw, seed=0)
    new_img, new_txt = anisotropic_views(5000, rho, **kw, seed=1)      # same distribution, unseen pairs
    held_out = lambda csa: projected_corr(csa.A[:, :4].double(), csa.B[:, :4].double(),
                                          *covariances(new_img.pooled, new_txt.pooled)[2:])
    csa = CSA(204, 154, d=4, normalize=False, ridge="auto").fit(img, txt)
    assert csa.chosen_ridge >= 0.1
    assert torch.allclose(held_out(csa).float(), torch.tensor(rho), atol=0.06), held_out(csa)
    small = CSA(204, 154, d=4, ridge=1e-3, normalize=False).fit(img, txt)
    assert (small.rho > 0.9).all() and held_out(small)[2:].abs().max() < 0.15   # over-fitted: no signal left


def test_projected_corr_is_the_correlation_of_the_projected_rows():
    img, txt = planted_views(500, [0.8, 0.4], seed=4)
    A, B = torch.randn(5, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    _, _, *S = covariances(img.pooled, txt.pooled)
    u, v = img.pooled.double() @ A, txt.pooled.double() @ B
    assert torch.allclose(projected_corr(A, B, *S), corr(u, v), atol=1e-10)


def test_one_input_normalisation_at_fit_and_at_test():
    """Every input row is L2-normalised before centring, at fit and at test: a per-row
    scale (raw image features of norm ~28 next to unit head rows) changes nothing."""
    img, txt = planted_views(300, [0.9, 0.6], seed=5)
    g = torch.Generator().manual_seed(0)
    scale = lambda f, s: Features.from_vectors(f.pooled * s)
    s_img, s_txt = 28 * torch.rand(300, 1, generator=g) + 0.5, torch.rand(300, 1, generator=g) + 0.1
    unit = lambda f: Features.from_vectors(torch.nn.functional.normalize(f.pooled, dim=-1))
    ref = CSA(5, 4, ridge="auto").fit(unit(img), unit(txt))                            # fitted on unit rows
    raw = CSA(5, 4, ridge="auto").fit(scale(img, s_img), scale(txt, s_txt))            # the same rows at other scales
    assert ref.chosen_ridge == raw.chosen_ridge
    for name in ("mu_v", "mu_l", "rho"):
        assert torch.allclose(getattr(ref, name), getattr(raw, name), atol=1e-5), name
    # applied to raw test features (norm ~28): the embedding of the unit rows
    q = Features.from_vectors(img.pooled[:20])
    e_unit = ref.embed_image(unit(q))
    assert torch.allclose(ref.embed_image(scale(q, 28.0)), e_unit, atol=1e-5)
    assert torch.allclose(raw.embed_image(q), e_unit, atol=1e-4)
    assert torch.allclose(ref.embed_text(scale(txt[:20], 3.0)), ref.embed_text(unit(txt[:20])), atol=1e-5)


def test_covariances_in_chunks_match_the_whole_set():
    """Centring uses the mean of the WHOLE set, whatever the chunk size: rows with a drift (chunk means
    differ from the global mean) against torch.cov."""
    from methods.csa import covariances
    g = torch.Generator().manual_seed(3)
    X = torch.randn(50, 4, generator=g) + torch.linspace(0, 5, 50)[:, None]       # mean drifts along the rows
    Y = torch.randn(50, 3, generator=g) - torch.linspace(0, 3, 50)[:, None]
    mu_x, mu_y, S_xx, S_yy, S_xy = covariances(X, Y, chunk=7)
    C = torch.cov(torch.cat([X, Y], 1).double().T)                                # (7, 7), divides by N - 1
    for name, got, want in (("mu_x", mu_x, X.double().mean(0)), ("mu_y", mu_y, Y.double().mean(0)),
                            ("S_xx", S_xx, C[:4, :4]), ("S_yy", S_yy, C[4:, 4:]), ("S_xy", S_xy, C[:4, 4:])):
        assert tuple(got.shape) == tuple(want.shape), f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert got.dtype == torch.float64, (f"{name} is {got.dtype}, expected torch.float64: the reference works in "
                                            f"float64 (the marker says so; .double() before the sums)")
        assert torch.allclose(got, want), (f"{name} in chunks of 7 rows differs by up to "
                                           f"{(got - want).abs().max():.3g} from the expected whole set's (torch.cov, "
                                           f"dividing by N - 1)")


def F_unit(x):
    return torch.nn.functional.normalize(x.float(), dim=-1)


def class_views(N, classes, seed, G=40, k=4, D_c=30, D_n=10):
    """Pairs of G planted classes: a shared latent z = class centre + within-class spread (k dims, one
    linear map serves every class, seen or not) and, per class, an image offset u_g and a text offset
    v_g that are unrelated across classes (D_c low-variance dims: only memorising the seen classes
    links them), plus independent noise. Pairs are drawn from the given classes."""
    h = torch.Generator().manual_seed(0)                                      # the classes: one draw for all calls
    C, U, V = 2.0 * torch.randn(G, k, generator=h), 0.1 * torch.randn(G, D_c, generator=h), 0.1 * torch.randn(G, D_c, generator=h)
    g = torch.Generator().manual_seed(seed)
    c = classes[torch.randint(len(classes), (N,), generator=g)]              # (N,) class of each pair
    z = C[c] + 0.5 * torch.randn(N, k, generator=g)
    view = lambda O: torch.cat([z + 0.3 * torch.randn(N, k, generator=g), O[c] + 0.02 * torch.randn(N, D_c, generator=g),
                                0.3 * torch.randn(N, D_n, generator=g)], 1)
    return Features.from_vectors(view(U)), Features.from_vectors(view(V)), c


def mean_reciprocal_rank(csa, img, txt):
    s = csa.score(csa.embed_image(img), csa.embed_text(txt))
    return (1 / (s >= s.diagonal()[:, None]).sum(1)).mean().item()


def test_the_ridge_grid_is_fine_and_auto_takes_its_best():
    """ridge="auto" searches 4 ridges a decade (1, 2, 3, 5 x 10^k), so 0.3, 2, 3 and 5 are candidates, and
    fit() uses the candidate of the best held-out score (select_ridge's own scores)."""
    from methods.csa import RIDGES, select_ridge
    for r in (0.3, 2.0, 3.0, 5.0):
        assert any(abs(c - r) < 1e-9 for c in RIDGES), f"ridge {r} is not a candidate of {RIDGES}"
    img, txt, _ = class_views(600, torch.arange(20), seed=0)
    best, scores = select_ridge(img.pooled.float(), txt.pooled.float(), 44)
    assert len(scores) == len(RIDGES) and scores[best]["score"] == max(r["score"] for r in scores.values())
    assert CSA(44, 44, ridge="auto").fit(img, txt).chosen_ridge == select_ridge(
        F_unit(img.pooled), F_unit(txt.pooled), 44)[0]

