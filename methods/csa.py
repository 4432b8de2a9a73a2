"""CSA: canonical correlation analysis of the two frozen feature spaces (closed form).

Li et al., "CSA: Data-efficient mapping of unimodal features to multimodal
features" (ICLR 2025), as used as a baseline in "Supervised Classification Heads
as Semantic Prototypes: Unlocking Vision-Language Alignment via Weight Recycling"
(its Eq. (2): g(f_I(x)) ~ g_bar(f_T(t)) with g, g_bar linear, found by CCA).

CCA finds A (D_v, d), B (D_l, d) maximising corr(A_i^T x, B_i^T y) per dimension,
with the projected dimensions uncorrelated within each view. Solved here as

    S_xx, S_yy, S_xy   covariances of the mean-centred views (+ ridge r I)
    S_xx = L_x L_x^T,  S_yy = L_y L_y^T                      Cholesky
    T = L_x^{-1} S_xy L_y^{-T} = U diag(rho) V^T              SVD (whitened cross-covariance)
    A = L_x^{-T} U[:, :d],  B = L_y^{-T} V[:, :d]             canonical directions
    emb_v = normalise(A^T (x - mu_x)),  emb_l = normalise(B^T (y - mu_y))
    s(x, y) = sum_{i<=d} rho_i emb_v,i emb_l,i                CSA's weighted similarity

Symbols -> variables: mu_x, mu_y -> self.mu_v, self.mu_l; A, B -> self.A, self.B;
rho -> self.rho; d -> self.d; r -> ridge * trace(S) / D.

Deviations / choices:
1. CCA is solved with torch.linalg in float64 (Cholesky whitening + SVD), not with
   the CSA authors' code; covariances are accumulated in chunks of rows, so an
   80K x 1024 set needs only D x D memory beyond the features.
2. Ridge r = ridge * trace(S) / D per view (ridge = 1e-3): keeps the Cholesky
   stable when D > N or the features are rank-deficient; it shrinks every
   correlation slightly (by about a factor 1 / (1 + ridge) for isotropic views).
3. d = min(d, D_v, D_l, N - 1); buffers are sized min(d, D_v, D_l) at construction
   (so state_dict shapes never depend on the data) and unused columns stay 0
   (rho_i = 0: they add nothing to the score).
4. dense_image projects every patch token with the pooled-feature mean and A (the
   MaskCLIP trick); patch tokens are not what CCA was fitted on.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def covariances(X, Y, chunk=8192):
    """Means and (co)variances of paired rows X (N, D_v), Y (N, D_l), in float64."""
    N = len(X)
    mu_x = sum(X[i:i + chunk].double().sum(0) for i in range(0, N, chunk)) / N   # (D_v,)
    mu_y = sum(Y[i:i + chunk].double().sum(0) for i in range(0, N, chunk)) / N   # (D_l,)
    S_xx = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64)
    S_yy = torch.zeros(Y.shape[1], Y.shape[1], dtype=torch.float64)
    S_xy = torch.zeros(X.shape[1], Y.shape[1], dtype=torch.float64)
    for i in range(0, N, chunk):
        x = X[i:i + chunk].double() - mu_x                 # (chunk, D_v) centred
        y = Y[i:i + chunk].double() - mu_y                 # (chunk, D_l) centred
        S_xx += x.T @ x
        S_yy += y.T @ y
        S_xy += x.T @ y
    return mu_x, mu_y, S_xx / (N - 1), S_yy / (N - 1), S_xy / (N - 1)


class CSA(nn.Module):
    defaults = dict(epochs=0)  # closed form: fit() only, no training loop
    ranges = dict(d="[1, inf)", ridge="[0, inf)")  # valid --hp values (align.py)

    def __init__(self, d_image, d_text, d=200, ridge=1e-3):  # d: weight-recycling App. E; ridge: our choice
        super().__init__()
        self.d, self.ridge = min(d, d_image, d_text), ridge
        self.register_buffer("mu_v", torch.zeros(d_image))
        self.register_buffer("mu_l", torch.zeros(d_text))
        self.register_buffer("A", torch.zeros(d_image, self.d))
        self.register_buffer("B", torch.zeros(d_text, self.d))
        self.register_buffer("rho", torch.zeros(self.d))

    @torch.no_grad()
    def fit(self, img, txt):
        X, Y = img.pooled, txt.pooled                      # (N, D_v), (N, D_l)
        mu_x, mu_y, S_xx, S_yy, S_xy = covariances(X, Y)
        # ridge r = ridge * (mean variance): S + r I is positive definite
        S_xx += self.ridge * S_xx.trace() / len(S_xx) * torch.eye(len(S_xx), dtype=S_xx.dtype)
        S_yy += self.ridge * S_yy.trace() / len(S_yy) * torch.eye(len(S_yy), dtype=S_yy.dtype)
        L_x = torch.linalg.cholesky(S_xx)                  # S_xx = L_x L_x^T
        L_y = torch.linalg.cholesky(S_yy)
        # T = L_x^{-1} S_xy L_y^{-T}: the cross-covariance of the whitened views
        T = torch.linalg.solve_triangular(L_x, S_xy, upper=False)                 # (D_v, D_l)
        T = torch.linalg.solve_triangular(L_y, T.T, upper=False).T                # (D_v, D_l)
        U, rho, Vh = torch.linalg.svd(T, full_matrices=False)                    # rho: canonical correlations
        d = min(self.d, len(X) - 1)
        # back from whitened to raw coordinates: A = L_x^{-T} U, B = L_y^{-T} V
        A = torch.linalg.solve_triangular(L_x.T, U[:, :d], upper=True)           # (D_v, d)
        B = torch.linalg.solve_triangular(L_y.T, Vh[:d].T, upper=True)           # (D_l, d)
        self.mu_v.copy_(mu_x)
        self.mu_l.copy_(mu_y)
        self.A.zero_()[:, :d] = A.float()
        self.B.zero_()[:, :d] = B.float()
        self.rho.zero_()[:d] = rho[:d].float()
        return self

    def embed_image(self, img):
        return F.normalize((img.pooled - self.mu_v) @ self.A, dim=-1)      # (B, d)

    def embed_text(self, txt):
        return F.normalize((txt.pooled - self.mu_l) @ self.B, dim=-1)      # (B, d)

    def score(self, img_emb, txt_emb):
        return (img_emb * self.rho) @ txt_emb.T            # s(x, y) = sum_i rho_i x_i y_i, (N_img, N_txt)

    def dense_image(self, img):
        return F.normalize((img.patches() - self.mu_v) @ self.A, dim=-1)   # (B, H*W, d)
