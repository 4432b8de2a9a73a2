"""Representation similarity between two paired sets of vectors.

One home for the measures that layer selection (layers.select_layers) and the
weight-recycling analyses (recycling.py, Fig. 1) both use:
    mutual_knn   mutual k-nearest-neighbour alignment (Huh et al. 2024, platonic-rep)
    cka          linear CKA (Kornblith et al. 2019) of L2-normalised rows, as STRUCTURE's layer selection
"""
import torch
import torch.nn.functional as F


def knn_indices(X, k):
    """(N, k) indices of each row's k nearest rows by cosine, self excluded."""
    # EXERCISE 9 (Fig. 1): the k nearest OTHER rows of each row of X (N, D) by cosine -> (N, k) indices
    Xn = F.normalize(X.float(), dim=-1)
    sim = Xn @ Xn.T                                          # (N, N) cosine
    sim.fill_diagonal_(float("-inf"))                        # a row is not its own neighbour
    return sim.topk(k, dim=1).indices
    # END EXERCISE 9


def mutual_knn(X, Y, k, knn=None):
    """Mutual k-NN alignment m_NN (Huh et al. 2024; the paper's Fig. 1 metric):
    X (N, Dx), Y (N, Dy) paired rows; mean over i of |kNN_X(i) ∩ kNN_Y(i)| / k.
    knn: (knn_indices(X, k), knn_indices(Y, k)) when the caller has them already (mutual_knn_table)."""
    # EXERCISE 9 (Fig. 1, Huh et al.): m_NN = mean over i of |kNN_X(i) ∩ kNN_Y(i)| / k
    #   for paired rows X (N, Dx), Y (N, Dy); knn, when given, holds the two (N, k) index tables to use
    N = len(X)
    assert len(Y) == N and 0 < k < N
    idx_X, idx_Y = knn if knn is not None else (knn_indices(X, k), knn_indices(Y, k))
    in_X = torch.zeros(N, N, dtype=torch.bool, device=X.device).scatter_(1, idx_X, True)
    in_Y = torch.zeros(N, N, dtype=torch.bool, device=X.device).scatter_(1, idx_Y, True)
    return ((in_X & in_Y).sum(1).float() / k).mean().item()
    # END EXERCISE 9


def mutual_knn_table(Xs, Ys, k):
    """{(a, b): mutual_knn(Xs[a], Ys[b], k)} for every pair of two families of paired sets, each set's
    kNN computed once (len(Xs) + len(Ys) times, not 2 len(Xs) len(Ys)), on the sets' device."""
    idx_X = {a: knn_indices(X, k) for a, X in Xs.items()}                 # {a: (N, k)}
    idx_Y = {b: knn_indices(Y, k) for b, Y in Ys.items()}                 # {b: (N, k)}
    return {(a, b): mutual_knn(X, Y, k, knn=(idx_X[a], idx_Y[b])) for a, X in Xs.items() for b, Y in Ys.items()}


def cka(X, Y, normalize=True):
    """Linear CKA: HSIC(K, L) = tr(K H L H) with K = X X^T, L = Y Y^T, H = I - 11^T/N;
    CKA = HSIC_KL / sqrt(HSIC_KK HSIC_LL). Uses tr(K H L H) = ||Xc^T Yc||_F^2
    with column-centred Xc = H X, Yc = H Y, so no N x N matrix is formed.

    normalize (default): every row is L2-normalised first, as STRUCTURE's CKA
    (its metric config normalize: true) and platonic-rep's measure_alignment do;
    on raw rows a few large-norm samples dominate K and L."""
    X, Y = X.double(), Y.double()
    if normalize:
        X, Y = F.normalize(X, dim=-1), F.normalize(Y, dim=-1)                # (N, Dx), (N, Dy) unit rows
    Xc = X - X.mean(0)                                       # (N, Dx) = H X
    Yc = Y - Y.mean(0)                                       # (N, Dy) = H Y
    hsic = lambda A, B: (A.T @ B).pow(2).sum()
    return (hsic(Xc, Yc) / (hsic(Xc, Xc) * hsic(Yc, Yc)).sqrt()).item()


def cka_table(Xs, Ys, normalize=True):
    """{(a, b): cka(Xs[a], Ys[b], normalize)}, each set centred (and its HSIC with itself) once: the same values."""
    def prepare(X):
        X = X.double()
        X = F.normalize(X, dim=-1) if normalize else X
        Xc = X - X.mean(0)
        return Xc, (Xc.T @ Xc).pow(2).sum()
    P, Q = {a: prepare(X) for a, X in Xs.items()}, {b: prepare(Y) for b, Y in Ys.items()}
    return {(a, b): ((Xc.T @ Yc).pow(2).sum() / (hxx * hyy).sqrt()).item()
            for a, (Xc, hxx) in P.items() for b, (Yc, hyy) in Q.items()}
