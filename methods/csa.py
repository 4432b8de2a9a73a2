"""CSA: canonical correlation analysis of the two frozen feature spaces (closed form).

Li et al., "CSA: Data-efficient Mapping of Unimodal Features to Multimodal Features"
(ICLR 2025), as a baseline of "Supervised Classification Heads as Semantic Prototypes:
Unlocking Vision-Language Alignment via Weight Recycling" (its Eq. (2):
g(f_I(x)) ~ g_bar(f_T(t)) with g, g_bar linear, found by CCA).

CCA finds A (D_v, d), B (D_l, d) maximising corr(A_i^T x, B_i^T y) per dimension,
with the projected dimensions uncorrelated within each view. Solved here in seven steps (this
file's numbering, not equations of the paper; the code carries "step (n)"):

    (1) x <- x / ||x||,  y <- y / ||y||                           one input normalisation
    (2) S_xx, S_yy, S_xy  covariances of the mean-centred views (+ ridge r I)
    (3) S_xx = L_x L_x^T,  S_yy = L_y L_y^T                      Cholesky
    (4) T = L_x^{-1} S_xy L_y^{-T} = U diag(rho) V^T              SVD (whitened cross-covariance)
    (5) A = L_x^{-T} U[:, :d],  B = L_y^{-T} V[:, :d]             canonical directions
    (6) emb_v = normalise(A^T (x - mu_x)),  emb_l = normalise(B^T (y - mu_y))
    (7) s(x, y) = sum_{i<=d} rho_i emb_v,i emb_l,i                CSA's weighted similarity

Symbols -> variables: mu_x, mu_y -> self.mu_v, self.mu_l; A, B -> self.A, self.B;
rho -> self.rho; d -> self.d; r -> ridge * trace(S) / D (per view).
The file: covariances (step 2), cca (steps 3-5), the method (steps 1, 6, 7), then the ridge
selection of choice 3.

Deviations / choices:
1. CCA by torch.linalg in float64 (Cholesky whitening + SVD), not the authors' cca_zoo call; the
   covariances accumulate over chunks of rows, so a large set costs D x D memory, not N x D.
2. Every input row is L2-normalised before centring (normalize=True), so unit head rows and raw
   image features (BEiT pooled: norm ~28) share one space (--align-data weights+pairs); on Shapes
   pairs alone it is a wash (RSum 380.3 unit, 381.6 raw).
3. Ridge r = ridge * trace(S) / D per view, chosen per run (ridge="auto", the default): the best ridge
   depends on the encoder pair (0.1 chosen on the tiny encoders segments 36.5 mIoU-fg on EfficientNet-Lite2
   + MiniLM, where the other methods reach 96-98), so no fixed value travels. fit() holds out 20% of the
   distinct images with their pairs (at most 2,000 images; an image is a distinct pooled row, so no image
   is on both sides), fits each of RIDGES (4 a decade) on the rest and scores the held-out pairs by the
   mean reciprocal rank of the true partner, both ways: of the pooled vectors, and, when fit() is given
   the images' patch tokens, of each held-out image's mean patch embedding (the dense path segmentation
   reads, step (6) on every patch): score = the mean of the two. Then it refits on every pair at the
   best ridge; self.choice holds the table, which the run prints and metrics.json keeps. No test image is
   read: fit() sees only the alignment pairs.
4. ridge="auto" below MIN_SELECT pairs has nothing to hold out and takes ridge = 1.0 (24 head rows:
   plain CCA finds 23 perfectly correlated directions that mean nothing); ridge 0.0 is plain CCA
   (needs N > D).
5. rho are the singular values of the regularised T (CSA's diag(Z1^T Z2) / N at ridge 0), not
   correlations measured again on the projected training views.
6. d = min(d, D_v, D_l, N - 1); buffers are sized min(d, D_v, D_l) at construction, so
   state_dict shapes never depend on the data; unused columns stay 0 (rho_i = 0).
7. dense_image projects every unit patch token with the pooled-feature mean and A (the MaskCLIP
   trick); patch tokens are not what CCA was fitted on.
"""
import torch
import torch.nn.functional as F

from . import Method

RIDGES = tuple(m * 10.0 ** e for e in range(-4, 2) for m in (1, 2, 3, 5))  # ridge="auto": 1e-4 ... 50, x mean variance
MIN_SELECT = 50                                # fewer training pairs: no held-out split, ridge 1.0
DENSE_IMAGES = 500                             # held-out images whose patch tokens the dense score reads


def covariances(X, Y, chunk=8192):
    """Step (2): means and (co)variances of paired rows X (N, D_v), Y (N, D_l), in float64 on X's device."""
    # EXERCISE 7 (CCA): means mu_x (D_v,), mu_y (D_l,), covariances S_xx, S_yy, S_xy of the centred views, float64,
    #   summed over chunks of rows, divided by N - 1 (the tests compare S with torch.cov, which divides by N - 1)
    N, dev = len(X), X.device
    mu_x = sum(X[i:i + chunk].double().sum(0) for i in range(0, N, chunk)) / N   # (D_v,)
    mu_y = sum(Y[i:i + chunk].double().sum(0) for i in range(0, N, chunk)) / N   # (D_l,)
    S_xx = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64, device=dev)
    S_yy = torch.zeros(Y.shape[1], Y.shape[1], dtype=torch.float64, device=dev)
    S_xy = torch.zeros(X.shape[1], Y.shape[1], dtype=torch.float64, device=dev)
    for i in range(0, N, chunk):
        x = X[i:i + chunk].double() - mu_x                 # (chunk, D_v) centred
        y = Y[i:i + chunk].double() - mu_y                 # (chunk, D_l) centred
        S_xx += x.T @ x
        S_yy += y.T @ y
        S_xy += x.T @ y
    return mu_x, mu_y, S_xx / (N - 1), S_yy / (N - 1), S_xy / (N - 1)
    # END EXERCISE 7


def cca(S_xx, S_yy, S_xy, d, ridge):
    """Steps (3)-(5): canonical directions A (D_v, d), B (D_l, d) and correlations rho (d,) of
    covariances S, with ridge r = ridge * tr(S) / D per view."""
    # EXERCISE 7 (CCA): S + r I = L L^T (Cholesky, r = ridge * tr(S) / D), T = L_x^-1 S_xy L_y^-T = U diag(rho) V^T
    #   (SVD); A = L_x^-T U[:, :d] (D_v, d), B = L_y^-T V[:, :d] (D_l, d), rho[:d]
    eye = lambda S: torch.eye(len(S), dtype=S.dtype, device=S.device)
    L_x = torch.linalg.cholesky(S_xx + ridge * S_xx.trace() / len(S_xx) * eye(S_xx))   # S_xx + r I = L_x L_x^T
    L_y = torch.linalg.cholesky(S_yy + ridge * S_yy.trace() / len(S_yy) * eye(S_yy))
    # T = L_x^{-1} S_xy L_y^{-T}: the cross-covariance of the whitened views
    T = torch.linalg.solve_triangular(L_x, S_xy, upper=False)                 # (D_v, D_l)
    T = torch.linalg.solve_triangular(L_y, T.T, upper=False).T                # (D_v, D_l)
    U, rho, Vh = torch.linalg.svd(T, full_matrices=False)                    # rho: canonical correlations
    # back from whitened to raw coordinates: A = L_x^{-T} U, B = L_y^{-T} V
    A = torch.linalg.solve_triangular(L_x.T, U[:, :d], upper=True)           # (D_v, d)
    B = torch.linalg.solve_triangular(L_y.T, Vh[:d].T, upper=True)           # (D_l, d)
    return A, B, rho[:d]
    # END EXERCISE 7


class CSA(Method):
    defaults = dict(epochs=0)  # closed form: fit() only, no training loop
    ranges = dict(d="[1, inf)", ridge="[0, inf)")  # valid --hp values (align.py)
    hp_words = dict(ridge=("auto",))               # --hp ridge=auto: choice 3
    fit_reads_patches = True                       # fit(img, txt, patches): the held-out images' tokens (choice 3)

    def __init__(self, d_image, d_text, d=200, ridge="auto", normalize=True):  # d: weight-recycling App. E;
        super().__init__()                                                  # ridge, normalize: choices 3, 2
        self.d, self.ridge, self.normalize = min(d, d_image, d_text), ridge, normalize
        self.register_buffer("mu_v", torch.zeros(d_image))
        self.register_buffer("mu_l", torch.zeros(d_text))
        self.register_buffer("A", torch.zeros(d_image, self.d))
        self.register_buffer("B", torch.zeros(d_text, self.d))
        self.register_buffer("rho", torch.zeros(self.d))
        self.chosen_ridge = None                           # what fit() used (a float)
        self.choice = None                                 # ridge="auto": {"setting", "chosen", "table"}

    def unit(self, x):
        """Step (1), the one input normalisation (choice 2), at fit and at test: rows to unit L2 norm, fp32."""
        return F.normalize(x.float(), dim=-1) if self.normalize else x.float()

    @torch.no_grad()
    def fit(self, img, txt, patches=None):
        """CCA of the pairs (img, txt: Features of pooled vectors); patches: the same images' Features with
        their patch tokens (optional), read for the held-out images' dense score of choice 3."""
        X, Y = self.unit(img.pooled), self.unit(txt.pooled)          # (N, D_v), (N, D_l), choice 2
        ridge = self.ridge
        if ridge == "auto" and len(X) >= MIN_SELECT:
            ridge, table = select_ridge(X, Y, self.d, patches=patches, unit=self.unit)
            self.choice = {"setting": "ridge", "chosen": ridge, "table": table}
        elif ridge == "auto":
            ridge = 1.0
        self.chosen_ridge = float(ridge)
        mu_x, mu_y, S_xx, S_yy, S_xy = covariances(X, Y)
        d = min(self.d, len(X) - 1)
        A, B, rho = cca(S_xx, S_yy, S_xy, d, ridge)       # (D_v, d), (D_l, d), (d,)
        self.mu_v.copy_(mu_x)
        self.mu_l.copy_(mu_y)
        self.A.zero_()[:, :d] = A.float()
        self.B.zero_()[:, :d] = B.float()
        self.rho.zero_()[:d] = rho.float()
        return self

    def embed_image(self, img):
        return F.normalize((self.unit(img.pooled) - self.mu_v) @ self.A, dim=-1)      # step (6), (B, d)

    def embed_text(self, txt):
        return F.normalize((self.unit(txt.pooled) - self.mu_l) @ self.B, dim=-1)      # step (6), (B, d)

    def score(self, img_emb, txt_emb):
        return (img_emb * self.rho) @ txt_emb.T            # step (7): sum_i rho_i x_i y_i, (N_img, N_txt)

    def dense_image(self, img):
        return F.normalize((self.unit(img.patches()) - self.mu_v) @ self.A, dim=-1)   # (B, H*W, d)


# ---------------------------------------------------------------- choice 3: ridge="auto", picked on held-out pairs
def held_out_split(X, held_out=0.2, max_held_out=2000, seed=0):
    """(val, fit) pair indices of choice 3: a seeded `held_out` share of the distinct images (distinct rows
    of X; at most max_held_out) held out with all their pairs."""
    image = image_ids(X)                                                        # (N,) image id of each pair
    n_img = int(image.max()) + 1
    perm = torch.randperm(n_img, generator=torch.Generator().manual_seed(seed)).to(X.device)
    is_val = torch.zeros(n_img, dtype=torch.bool, device=X.device)
    is_val[perm[:min(max(2, int(held_out * n_img)), max_held_out)]] = True
    return is_val[image].nonzero().squeeze(1), (~is_val[image]).nonzero().squeeze(1)


def image_ids(X):
    """(N,) the image of each pair: equal rows of X are one image, numbered in order of first appearance (so
    with every row distinct the ids are 0, 1, ..., N - 1)."""
    _, image = torch.unique(X, dim=0, return_inverse=True)                      # ids in sorted-row order
    first = torch.full((int(image.max()) + 1,), len(X), device=X.device).scatter_reduce(
        0, image, torch.arange(len(X), device=X.device), "amin")               # each id's first pair
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(len(first), device=X.device)
    return rank[image]


def reciprocal_ranks(s, same):
    """Mean reciprocal rank of the true partners, both ways, of scores s (n_img, n_txt); same (n_img, n_txt)
    True where the caption belongs to the image (the best-ranked of an image's captions counts)."""
    true_t = s.masked_fill(~same, float("-inf")).amax(0)                    # (n_txt,) each caption's own image
    rank_t2i = (s >= true_t[None]).sum(0)
    true_i = s.masked_fill(~same, float("-inf")).amax(1)                    # (n_img,) each image's best caption
    rank_i2t = ((s >= true_i[:, None]) & ~same).sum(1) + 1
    return 0.5 * ((1 / rank_i2t).mean() + (1 / rank_t2i).mean()).item()


def select_ridge(X, Y, d, ridges=RIDGES, max_held_out=2000, seed=0, patches=None, unit=None):
    """Choice 3 (ridge="auto"): the ridge whose CSA, fitted on the other pairs, best matches the held-out
    pairs (mean reciprocal rank of the true partner, both ways, under the rho-weighted cosine s(x, y)) of
    the pooled vectors, and of the held-out images' mean patch embeddings when `patches` (Features of the
    pairs' images with their patch tokens) is given. Returns (ridge, {ridge: {"mrr", "dense_mrr", "score"}})."""
    val, fit = held_out_split(X, max_held_out=max_held_out, seed=seed)
    images, image = torch.unique(X[val], dim=0, return_inverse=True)        # the held-out images, (n_img, D_v)
    first = torch.full((len(images),), len(val), device=X.device).scatter_reduce(
        0, image, torch.arange(len(val), device=X.device), "amin")          # a pair of each held-out image
    same = image[None, :] == torch.arange(len(images), device=X.device)[:, None]   # (n_img, n_val)
    dense = None
    if patches is not None:                                                 # (n, H*W, D_v) unit patch tokens
        rows = val[first[:DENSE_IMAGES]].to(patches.pooled.device)
        dense = unit(patches[rows].patches()).to(X.device)
    mu_x, mu_y, *S_fit = covariances(X[fit], Y[fit])
    d_fit = min(d, len(fit) - 1)
    table = {}
    for r in ridges:
        A, B, rho = cca(*S_fit, d_fit, r)
        v = F.normalize((Y[val].double() - mu_y) @ B, dim=-1).float() * rho.float()    # (n_val, d)
        u = F.normalize((images.double() - mu_x) @ A, dim=-1).float()                   # (n_img, d)
        row = {"mrr": reciprocal_ranks(u @ v.T, same)}
        if dense is not None:                                               # step (6) on every patch, averaged
            p = F.normalize((dense.double() - mu_x) @ A, dim=-1).mean(1)
            p = F.normalize(p, dim=-1).float()                              # (n_dense, d)
            cols = image < len(p)                                           # the captions of those images
            row["dense_mrr"] = reciprocal_ranks(p @ v[cols].T, same[:len(p), cols])
        row["score"] = sum(row.values()) / len(row)
        table[r] = row
    return max(table, key=lambda r: table[r]["score"]), table
