"""recycling.py against constructed data with known answers and naive loops."""
import math
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import random_features, train_with
from recorded import expected
from test_real import models  # noqa: F401  (the tiny Hugging Face models fixture)

import align
import eval_sets
import recycling as R
import similarity as S
from features import Features
from infra.errors import RunError


def orthogonal(D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0].float()


# ---------------------------------------------------------------- alignment data

def test_weight_pairs_normalises_rows_and_keeps_text_tokens():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 10, generator=g) * torch.arange(1, 7)[:, None]     # rows of different norms
    class_text = random_features(6, 4, 7, lengths=[1, 2, 3, 4, 2, 1])
    img, txt = R.weight_pairs(W, class_text)
    assert img.tokens.shape == (6, 1, 10) and img.mask.all()
    assert torch.allclose(img.pooled.norm(dim=1), torch.ones(6))
    assert torch.allclose(img.pooled * W.norm(dim=1, keepdim=True), W, atol=1e-5)   # same directions
    assert torch.equal(txt.tokens, class_text.tokens) and torch.equal(txt.mask, class_text.mask)


def test_augment_is_the_union():
    pairs_img, pairs_txt = random_features(5, 9, 10, grid=(2, 4)), random_features(5, 6, 7, lengths=[6] * 5)
    w_img, w_txt = R.weight_pairs(torch.randn(3, 10), random_features(3, 2, 7, seed=1))
    img, txt = R.augment(pairs_img, pairs_txt, w_img, w_txt)
    assert len(img) == len(txt) == 8
    assert torch.equal(img.pooled[5:], w_img.pooled) and torch.equal(txt.pooled[:5], pairs_txt.pooled)
    assert img.mask[5:, 0].all() and not img.mask[5:, 1:].any()            # head rows: one real token


# ---------------------------------------------------------------- Table 1

def test_neural_collapse_exact_collapse_gives_100():
    # orthogonal rows of different norms; every feature of class i a positive multiple of w_i, b = 0
    W = orthogonal(8)[:5] * torch.tensor([1.0, 3.0, 0.5, 2.0, 7.0])[:, None]
    labels = torch.arange(5).repeat(4)
    feats = W[labels] * torch.rand(20, 1, generator=torch.Generator().manual_seed(0)).add(0.1)
    d = R.neural_collapse_check(W, torch.zeros(5), feats, labels)
    assert d == {"linear_top1": 100.0, "cosine_top1": 100.0, "nobias_top1": 100.0}, \
        f"{d} on exactly collapsed features (every feature a positive multiple of its class's row), expected " \
        f"linear_top1, cosine_top1, nobias_top1 all 100"


def test_neural_collapse_bias_and_norm_change_the_answer():
    W = torch.eye(2)
    feats, labels = torch.tensor([[1.0, 0.9]]), torch.tensor([0])
    d = R.neural_collapse_check(W, torch.tensor([0.0, 0.5]), feats, labels)  # 0.9 + 0.5 > 1: bias flips it
    assert d == {"linear_top1": 0.0, "cosine_top1": 100.0, "nobias_top1": 100.0}, \
        f"{d}: f = (1, 0.9), b = (0, 0.5), expected linear_top1 0, cosine_top1 100, nobias_top1 100 (the bias " \
        f"flips the linear head only)"
    W = torch.tensor([[10.0, 0.0], [0.0, 1.0]])                             # now the norm decides
    d = R.neural_collapse_check(W, torch.zeros(2), torch.tensor([[0.2, 1.0]]), labels)
    assert d == {"linear_top1": 100.0, "cosine_top1": 0.0, "nobias_top1": 100.0}, \
        f"{d}: rows of norm 10 and 1, f = (0.2, 1), expected linear_top1 100, cosine_top1 0, nobias_top1 100 " \
        f"(the cosine classifier ignores the norms, W f does not)"


# ---------------------------------------------------------------- mutual kNN, CKA

def test_mutual_knn_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(25, 5, generator=g)
    Y = torch.cat([X, torch.zeros(25, 2)], 1) + 0.7 * torch.randn(25, 7, generator=g)
    for k in (1, 3, 7):
        got, want = S.mutual_knn(X, Y, k), expected("naive_mutual_knn", X, Y, k)
        assert abs(got - want) < 1e-6, (f"mutual_knn at k = {k}: {got:.4f}, expected {want:.4f} (m_NN, Fig. 1: the "
                                        f"mean over rows i of |kNN_X(i) & kNN_Y(i)| / k)")


def test_knn_with_duplicate_rows_never_lists_a_row_itself():
    """12 rows, 6 distinct ones each twice: a row's own index and its twin's tie at cosine 1. A row is never its
    own neighbour, its twin is its nearest, and m_NN at k = 1 of two spaces with the same twins is 1."""
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(6, 5, generator=g).repeat(2, 1), torch.randn(6, 7, generator=g).repeat(2, 1)
    twin = (torch.arange(12) + 6) % 12
    for k in (1, 3):
        idx = S.knn_indices(X, k)
        assert tuple(idx.shape) == (12, k), f"knn_indices(X, {k}) has shape {tuple(idx.shape)}, expected (12, {k})"
        own = [i for i in range(12) if i in idx[i].tolist()]
        assert not own, (f"with duplicate rows (row i = row i + 6), rows {own} list themselves among their {k} "
                         f"nearest neighbours, expected none (Fig. 1's kNN is over the OTHER rows; a row ties with its "
                         f"twin)")
        no_twin = [i for i in range(12) if idx[i, 0] != twin[i]]
        assert not no_twin, (f"with duplicate rows, rows {no_twin}: first neighbour {idx[no_twin[0], 0].item()}, "
                             f"expected its twin {twin[no_twin[0]].item()} (cosine 1)")
    got = S.mutual_knn(X, Y, 1)
    assert got == 1.0, (f"mutual_knn at k = 1 of two spaces with the same duplicate rows is {got:.4f}, expected 1 "
                        f"(each row's one neighbour is its twin in both)")


def test_mutual_knn_identical_and_independent():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(400, 16, generator=g)
    got = S.mutual_knn(X, X, 10)
    assert got == 1.0, f"mutual_knn of a space with itself is {got:.4f}, expected 1"
    scales = torch.rand(400, 1, generator=g) * 10 + 0.1
    got = S.mutual_knn(X, X * scales, 10)
    assert got == 1.0, (f"mutual_knn of X with each row rescaled by its own positive factor is {got:.4f}, expected 1 "
                        f"(neighbours by cosine: a row's length does not move them)")
    got = S.mutual_knn(X, 3 * X @ orthogonal(16), 10)
    assert got == 1.0, f"mutual_knn with a rotated, scaled copy is {got:.4f}, expected 1 (cosine neighbours)"
    Y = torch.randn(400, 12, generator=g)
    got = S.mutual_knn(X, Y, 10)
    assert abs(got - 10 / 399) < 0.01, f"mutual_knn of independent spaces is {got:.4f}, expected about chance, k / (N - 1) = 0.025"


def test_cka_against_naive_formula_and_invariances():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(40, 6, generator=g), torch.randn(40, 9, generator=g)
    Y[:, :6] += X
    N = 40
    H = torch.eye(N, dtype=torch.float64) - 1.0 / N
    hsic = lambda A, B: torch.trace(A @ H @ B @ H)
    naive = lambda A, B: (lambda K, L: hsic(K, L) / (hsic(K, K) * hsic(L, L)).sqrt())(A @ A.T, B @ B.T).item()
    unit = lambda A: A.double() / A.double().norm(dim=1, keepdim=True)
    # STRUCTURE / platonic-rep: rows L2-normalised, then linear CKA of the Gram matrices
    assert abs(S.cka(X, Y) - naive(unit(X), unit(Y))) < 1e-10
    assert abs(S.cka(X, Y, normalize=False) - naive(X.double(), Y.double())) < 1e-10
    assert abs(S.cka(X, 2.5 * X @ orthogonal(6)) - 1.0) < 1e-6
    assert abs(S.cka(X, X + 4.0, normalize=False) - 1.0) < 1e-10              # centring removes offsets


def test_cka_ignores_a_per_row_scale_as_the_reference_does():
    """A few large-norm rows moved the raw-feature CKA; the reference's row
    normalisation makes the score depend on directions only."""
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(60, 8, generator=g), torch.randn(60, 5, generator=g)
    Y[:, :3] += X[:, :3]
    scale = torch.ones(60, 1)
    scale[:6] = 30.0                                                         # a few large-norm samples
    assert abs(S.cka(X * scale, Y) - S.cka(X, Y)) < 1e-8                      # fp32 rounding of X * scale
    assert abs(S.cka(X * scale, Y, normalize=False) - S.cka(X, Y, normalize=False)) > 0.05


def test_neural_collapse_check_matches_naive_loop():
    """Table 1 on random rows of different norms, one image at a time: argmax_i of w_i . f + b_i,
    of cos(w_i, f) and of w_i . f."""
    g = torch.Generator().manual_seed(2)
    for _ in range(20):          # heads whose three figures differ (the first draw, at seed 2)
        W = torch.randn(6, 5, generator=g) * torch.rand(6, 1, generator=g).add(0.2) * 3
        b = torch.randn(6, generator=g)
        feats = torch.randn(40, 5, generator=g)
        labels, expect = expected("naive_neural_collapse", W, b, feats)   # labels: the cosine's argmax but for 8
        if len(set(expect.values())) == 3:                                # images
            break
    assert len(set(expect.values())) == 3, f"(the test's own check) {expect}: expected three different figures"
    got = R.neural_collapse_check(W, b, feats, labels)
    assert got.keys() == expect.keys(), f"keys {sorted(got)}, expected {sorted(expect)}"
    for k in expect:
        assert abs(got[k] - expect[k]) < 1e-4, f"{k} = {got[k]:.2f}, expected {expect[k]:.2f} (Table 1's three heads)"


# ---------------------------------------------------------------- Fig. 1

def test_prototype_alignment_head_rows_vs_noisy_means():
    g = torch.Generator().manual_seed(0)
    C, D = 20, 12
    T = torch.randn(C, 10, generator=g)
    W = torch.cat([T, torch.zeros(C, 2)], 1) @ orthogonal(D)               # a rotated copy of the text space
    labels = torch.arange(C).repeat_interleave(6)
    feats = W[labels] * 3 + 2.0 * torch.randn(len(labels), D, generator=g)
    d = R.prototype_alignment(W, feats, labels, T, counts=(1, 2, 5, 10), k=(3, 5), repeats=2)
    keys = {f"{s}_k{k}" for k in (3, 5) for s in ("head", "mean1", "mean2", "mean5", "meanall")}
    assert set(d) == keys, f"keys {sorted(d)}, expected {sorted(keys)}"
    for k in ("head_k3", "head_k5"):                                       # the head IS the text geometry
        assert d[k] == 1.0, f"{k} = {d[k]:.3f}, expected 1: head rows that are a rotated copy of the text space"
    assert d["mean1_k5"] < d["mean5_k5"], \
        f"mean1_k5 = {d['mean1_k5']:.3f} >= mean5_k5 = {d['mean5_k5']:.3f}, expected mean1_k5 < mean5_k5: averaging more images helps"
    assert d["mean5_k5"] < 1.0, f"mean5_k5 = {d['mean5_k5']:.3f}: noisy class means align perfectly, expected < 1"


# ---------------------------------------------------------------- Appendix I

def test_modality_gap_planted_shift_is_significant_and_separable():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(300, 16, generator=g)
    W = torch.randn(150, 16, generator=g) + 3.0 * torch.ones(16)           # head rows shifted far off
    d = R.modality_gap(W, feats, n_perm=300)
    assert d["p_value"] < 0.01 and d["gap"] > d["null_mean"] + 10 * d["null_std"]
    assert d["separability"] > 98


def test_modality_gap_no_shift_and_null_matches_closed_form():
    g = torch.Generator().manual_seed(1)
    feats, W = torch.randn(300, 16, generator=g), torch.randn(150, 16, generator=g)
    d = R.modality_gap(W, feats, n_perm=1000)
    assert d["p_value"] > 0.01 and abs(d["gap"] - d["null_mean"]) < 3 * d["null_std"]
    assert d["separability"] < 75
    # a random split of M rows into nA + nB: E||mean_A - mean_B||^2 = M^2 tr(Sigma) / (nA nB (M - 1))
    Z = F.normalize(torch.cat([W, feats]), dim=1)
    M, nA, nB = 450, 150, 300
    expected = M ** 2 * Z.var(0, unbiased=False).sum() / (nA * nB * (M - 1))
    assert abs(d["null_mean"] ** 2 + d["null_std"] ** 2 - expected) / expected < 0.1


# ---------------------------------------------------------------- Table 2

def clusters(C=4, per_class=10, D=16, noise=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = orthogonal(D, seed)[:C] * 5
    labels = torch.arange(C).repeat_interleave(per_class)
    return centres[labels] + noise * torch.randn(len(labels), D, generator=g), labels


def test_few_shot_separated_clusters_are_solved():
    feats, labels = clusters()
    d = R.few_shot(feats, labels, runs=3)
    for n in (1, 2, 4):
        assert d[f"ncc_{n}shot"] == 100.0 and d[f"knn_{n}shot"] == 100.0 and d[f"ncc_{n}shot_std"] == 0.0


def test_few_shot_one_shot_knn_is_ncc_and_supports_are_disjoint_from_test():
    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(60, 8, generator=g), torch.arange(6).repeat(10)
    seen = []

    def spy(support_feats, support_labels):                   # records what it is given and asked
        def logits_fn(query):
            nearest = (F.normalize(query, dim=1) @ F.normalize(support_feats, dim=1).T).max(1).values
            seen.append((len(support_feats), len(query), nearest.max().item()))
            return F.one_hot(torch.zeros(len(query), dtype=torch.long), 6).float()  # always class 0
        return logits_fn
    d = R.few_shot(feats, labels, support_shots=(1, 3), runs=2, aligned_classifier=spy)
    assert d["knn_1shot"] == d["ncc_1shot"]
    assert [s[:2] for s in seen] == [(6, 60 - 18), (18, 60 - 18)] * 2    # test = all but the 3-shot pool
    assert all(s[2] < 1 - 1e-4 for s in seen)                             # no support image is tested
    assert abs(d["mlp_3shot"] - 100 / 6) < 1e-4                           # always class 0: 7 of 42 right


def naive_knn(support, support_labels, query, k):
    preds = []
    for q in query:
        sims = sorted(((F.cosine_similarity(q, s, dim=0).item(), int(y)) for s, y in zip(support, support_labels)),
                      reverse=True)[:k]
        votes = Counter(y for _, y in sims)
        top = max(votes.values())
        preds.append(next(y for _, y in sims if votes[y] == top))        # tie: the nearest tied class
    return torch.tensor(preds)


def test_knn_predict_matches_naive_vote():
    g = torch.Generator().manual_seed(0)
    support = F.normalize(torch.randn(24, 5, generator=g), dim=1)
    support_labels, query = torch.arange(6).repeat(4), F.normalize(torch.randn(30, 5, generator=g), dim=1)
    for k in (1, 2, 3, 4):
        assert torch.equal(R.knn_predict(support, support_labels, query, 6, k),
                           naive_knn(support, support_labels, query, k))


class StandInMLP(nn.Module):
    """The methods/mlp.py contract in miniature: text -> image space, loss 1 - cos."""

    def __init__(self, d_image, d_text):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_text, 32), nn.GELU(), nn.Linear(32, d_image))

    def embed_image(self, img):
        return F.normalize(img.pooled, dim=-1)

    def embed_text(self, txt):
        return F.normalize(self.net(txt.pooled), dim=-1)

    def loss(self, img, txt):
        loss = (1 - (self.embed_image(img) * self.embed_text(txt)).sum(-1)).mean()
        return loss, {"cos_loss": loss.item()}


def test_finetune_mlp_classifier_learns_the_shots_and_leaves_the_original():
    torch.manual_seed(0)
    feats, labels = clusters(C=5, per_class=8, D=12, noise=0.3)
    class_text = random_features(5, 3, 7, seed=3)
    mlp = StandInMLP(12, 7)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    support = torch.cat([(labels == c).nonzero()[:2, 0] for c in range(5)])
    logits_fn = R.finetune_mlp_classifier(mlp, class_text, feats[support], labels[support], steps=100, lr=5e-3)
    assert logits_fn(feats).shape == (40, 5)
    assert (logits_fn(feats).argmax(1) == labels).float().mean() == 1.0
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())


# ---------------------------------------------------------------- all together

def test_run_analyses_and_table():
    g = torch.Generator().manual_seed(0)
    C, D = 8, 16
    W = torch.randn(C, D, generator=g)
    make = lambda n: (W.repeat(n, 1) + 0.5 * torch.randn(C * n, D, generator=g), torch.arange(C).repeat(n))
    (f_tr, y_tr), (f_te, y_te) = make(10), make(8)
    d = R.run_analyses(W, torch.zeros(C), [f"c{i}" for i in range(C)], f_tr, y_tr, f_te, y_te,
                       torch.randn(C, 6, generator=g), n_perm=50)
    assert set(d) >= {"neural_collapse", "prototype_alignment", "modality_gap", "few_shot"}
    assert d["neural_collapse"]["cosine_top1"] > 90 and "head_k3" in d["prototype_alignment"]
    table = R.analyses_table(d)
    assert "Table 1" in table and "Appendix I" in table and "ncc_4shot" in table and "null_std" in table
    assert "ncc_4shot_std" not in table


def test_weight_only_alignment_then_few_shot_with_the_real_mlp():
    """§4.1 then §4.2 few-shot, end to end: align methods/mlp.py on D_weights only,
    then fine-tune copies of it on the shots (planted world: head rows = a linear
    image of the class-name text, images = head rows + noise)."""
    import pytest
    mlp_module = pytest.importorskip("methods.mlp")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    C, d_i, d_t = 12, 16, 10
    T = torch.randn(C, d_t, generator=g)
    W = T @ torch.randn(d_t, d_i, generator=g)                             # (C, d_i) head rows
    labels = torch.arange(C).repeat(8)
    feats = F.normalize(W, dim=1)[labels] + 0.1 * torch.randn(len(labels), d_i, generator=g)
    class_text = Features.from_vectors(T)
    w_img, w_txt = R.weight_pairs(W, class_text)
    mlp = mlp_module.MLP(d_i, d_t)
    opt = torch.optim.Adam(mlp.parameters(), lr=5e-3)
    for _ in range(300):                                                   # D_weights only: no image-text pair
        loss, _ = mlp.loss(w_img, w_txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    mlp.eval()
    with torch.no_grad():
        zero_shot = mlp.embed_image(Features.from_vectors(feats)) @ mlp.embed_text(class_text).T
    assert (zero_shot.argmax(1) == labels).float().mean() > 0.9
    aligned = lambda sf, sl: R.finetune_mlp_classifier(mlp, class_text, sf, sl, steps=30)
    d = R.few_shot(feats, labels, support_shots=(1, 2), runs=2, aligned_classifier=aligned)
    assert d["mlp_1shot"] > 90 and d["mlp_2shot"] > 90


def test_weight_aligned_mlp_anneals_the_lr_as_a_cosine_to_zero():
    """App. E: Adam with the lr annealed on a cosine, lr_t = lr (1 + cos(pi t / T)) / 2, against a hand loop that
    sets that closed form before each step (same seed: the same init and dropout masks)."""
    from methods.mlp import MLP
    g = torch.Generator().manual_seed(0)
    C, d_i, d_t, T, lr = 6, 8, 5, 20, 5e-3
    W, names = torch.randn(C, d_i, generator=g), Features.from_vectors(torch.randn(C, d_t, generator=g))
    torch.manual_seed(1)
    got = R.weight_aligned_mlp(W, names, steps=T, lr=lr)
    torch.manual_seed(1)
    ref = MLP(d_i, d_t)
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    w_img, w_txt = R.weight_pairs(W, names)
    for t in range(T):
        opt.param_groups[0]["lr"] = lr * (1 + math.cos(math.pi * t / T)) / 2
        loss, _ = ref.loss(w_img, w_txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not got.training, "the aligned MLP comes back in eval mode (dropout off)"
    for (name, a), b in zip(got.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-6), f"{name}: max |diff| {float((a - b).abs().max()):.3g} after {T} " \
                                                 f"steps against the cosine-annealed hand loop"


def test_weights_plus_pairs_on_a_memory_mapped_training_set(tmp_path, monkeypatch):
    """D_aug = pairs ∪ head rows when the pairs are StoredFeatures (sharded, memory-mapped):
    rows equal the in-memory union, batches read only their own rows, the training loop runs on it."""
    import argparse

    from test_cache import FakeEncoder, extract, shard_rows

    from infra.shards import StoredFeatures
    from methods.linear import Linear
    n = 30
    shard_rows(monkeypatch, 12, image=True)
    img = extract(FakeEncoder(image=True), n, tmp_path / "a")
    shard_rows(monkeypatch, 12)
    txt = extract(FakeEncoder(), n, tmp_path / "b")
    assert isinstance(img, StoredFeatures) and isinstance(txt, StoredFeatures)
    w_img, w_txt = R.weight_pairs(torch.randn(4, 3), random_features(4, 2, 3, seed=2))
    aug_img, aug_txt = R.augment(img, txt, w_img, w_txt)
    ref_img, ref_txt = R.augment(img[:].to("cpu"), txt[:].to("cpu"), w_img, w_txt)   # the whole set in RAM
    assert len(aug_img) == len(aug_txt) == n + 4
    assert torch.allclose(aug_img.pooled, ref_img.pooled) and torch.allclose(aug_txt.pooled, ref_txt.pooled)
    for idx in (torch.tensor([33, 2, 29, 30, 14]), torch.tensor([31, 30]), slice(28, 34)):
        for aug, ref in ((aug_img, ref_img), (aug_txt, ref_txt)):
            got, want = aug[idx], ref[idx]
            T = got.tokens.shape[1]
            assert torch.equal(got.mask, want.mask[:, :T]) and not want.mask[:, T:].any()
            assert torch.allclose(got.tokens, want.tokens[:, :T]) and torch.allclose(got.pooled, want.pooled)
            assert got.grid == want.grid
    assert aug_img[torch.tensor([31, 30])].patches().shape == (2, 4, 3)          # head rows only: full grid
    asked = []
    read = StoredFeatures.__getitem__
    monkeypatch.setattr(StoredFeatures, "__getitem__", lambda self, i: asked.append(len(torch.arange(len(self))[i].reshape(-1))) or read(self, i))
    args = argparse.Namespace(epochs=2, batch_size=8, lr=1e-2, weight_decay=0.0, seed=0, resume=False)
    torch.manual_seed(0)
    result = train_with(Linear(3, 3), aug_img, aug_txt, args, tmp_path, "cpu")
    assert result["final_loss"] == result["final_loss"] and asked and max(asked) <= 8  # batches only, never all rows


@pytest.mark.slow
def test_analyses_run_on_real_data_with_a_head_and_a_torchvision_set(tmp_path, monkeypatch, models):
    """--analyses on --data coco with a BEiT checkpoint's head (cat / dog / car) and
    a torchvision set (EuroSAT's ImageFolder layout, classes cat, dog, car, forest). Table 1 is
    checked against the checkpoint's own logits; Table 2 uses "A photo of a {class}"."""
    from test_real import VISION, write_image, write_karpathy
    from transformers import BeitConfig, BeitForImageClassification

    import align
    import encoders
    from infra import cache
    root = tmp_path / "data"
    write_karpathy(root / "coco", n_train=8, n_test=3)
    for c, cls in enumerate(["cat", "dog", "car", "Forest"]):
        for i in range(10):
            write_image(root / "eurosat" / "eurosat" / "2750" / cls / f"{cls}_{i}.jpg", seed=400 + 10 * c + i, size=(16, 16))
    torch.manual_seed(0)
    head = {0: "cat", 1: "dog", 2: "car"}
    model = BeitForImageClassification(BeitConfig(**VISION, use_mean_pooling=True, id2label=head,
                                                  label2id={v: k for k, v in head.items()})).eval()
    model.save_pretrained(tmp_path / "beit")
    prompts, extract = [], cache.extract
    spy = lambda enc, inputs, *a, **kw: (prompts.append(list(inputs)) if kw.get("modality") == "fewshot" else None) \
        or extract(enc, inputs, *a, **kw)
    monkeypatch.setattr(cache, "extract", spy)
    m = align.main(["--data", "coco", "--data-root", str(root), "--method", "linear", "--epochs", "1", "--analyses",
                    "--image-encoder", str(tmp_path / "beit"), "--text-encoder", str(models / "bert"), "--no-figures",
                    "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), "--threads", "1"])
    rec = m["recycling"]
    assert set(rec) == {"eurosat"}
    assert set(rec["eurosat"]) == {"neural_collapse", "prototype_alignment", "modality_gap", "few_shot"}
    # Table 1: the head's top-1 on the held-out (odd) images of head classes = the checkpoint's own logits
    s = eval_sets.torchvision_set("eurosat", root)
    head_of = {v: k for k, v in head.items()}
    odd = [i for i in range(len(s.labels)) if i % 2 == 1 and s.class_names[s.labels[i]] in head_of]
    y = torch.tensor([head_of[s.class_names[s.labels[i]]] for i in odd])
    with torch.no_grad():
        logits = model(pixel_values=encoders.load_hf_image(str(tmp_path / "beit")).transform([s.images[i] for i in odd])).logits
    want = 100 * (logits.argmax(1) == y).float().mean().item()
    assert abs(rec["eurosat"]["neural_collapse"]["linear_top1"] - want) < 1e-4
    assert {"ncc_1shot", "knn_4shot", "mlp_4shot"} <= set(rec["eurosat"]["few_shot"])
    assert prompts == [[f"A photo of a {c}" for c in s.class_names]]


def test_analyses_say_in_one_line_what_is_skipped(capsys):
    import argparse

    class NoHead:
        def head(self):
            raise RunError("tiny-dinov2 has no linear classification head. Use ...")

    class Head:
        def head(self):
            return torch.randn(3, 4), torch.zeros(3), ["a", "b", "c"]
    args = argparse.Namespace(data="coco", data_root="/data")
    assert R.recycling_analyses(align.Run(NoHead(), None, {}), args, "cpu") == {}
    assert R.recycling_analyses(align.Run(Head(), None, {"train": None}), args, "cpu") == {}
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[analyses] skipped: tiny-dinov2 has no linear classification head. Use ...",
                   "[analyses] skipped: --data coco has no classification set (put one of stl10, cifar10, cifar100, "
                   "caltech101, dtd, eurosat, food101, flowers102, pets in torchvision's layout under /data/<name>)"]


def test_few_shot_fine_tuning_uses_one_pair_per_class_the_normalised_mean_of_its_shots():
    """App. H and its code: stage 2 fine-tunes on (normalise(mean of the class's
    unit shots), class text) - one pair per class - not on every shot separately."""
    g = torch.Generator().manual_seed(0)
    seen = []

    class Spy(StandInMLP):
        def loss(self, img, txt):
            seen.append((img.pooled.clone(), txt.pooled.clone()))
            return super().loss(img, txt)
    class_text = random_features(4, 2, 7, seed=5)
    shots = torch.randn(9, 12, generator=g) * torch.rand(9, 1, generator=g) * 10   # shots of different norms
    labels = torch.tensor([2, 0, 2, 3, 0, 2, 3, 3, 0])                              # class 1 has no shot
    R.finetune_mlp_classifier(Spy(12, 7), class_text, shots, labels, steps=3)
    assert len(seen) == 3
    img, txt = seen[0]
    for row, c in enumerate([0, 2, 3]):
        unit = [F.normalize(shots[i], dim=0) for i in range(9) if labels[i] == c]
        want = sum(unit) / len(unit)
        assert torch.allclose(img[row], want / want.norm(), atol=1e-6)
        assert torch.equal(txt[row], class_text.pooled[c])
    assert len(img) == 3
    R.finetune_mlp_classifier(Spy(12, 7), class_text, shots, labels, steps=1, class_mean=False)
    assert len(seen[-1][0]) == 9                                                    # every shot its own pair


def test_analysis_features_read_what_the_head_reads():
    """A masked set gives the object patches to a patch head ("patches", the Shapes head) and one
    pooled vector an image to a real head ("pooled"), even images the train half in both."""
    from types import SimpleNamespace

    import data
    img = random_features(4, 1 + 4, 3, grid=(2, 2), seed=7)
    masks = torch.full((4, 4, 4), data.IGNORE)
    masks[:, :2, :2] = 0                                                     # the object covers patch 0 of each image
    s = SimpleNamespace(masks=masks, labels=torch.tensor([1, 0, 2, 1]))
    feats, labels, even = R.analysis_features(s, img, "pooled")
    assert torch.equal(feats, img.pooled.float()) and torch.equal(labels, s.labels)
    assert even.tolist() == [True, False, True, False]
    feats, labels, even = R.analysis_features(s, img, "patches")
    assert torch.equal(feats, img.patches()[:, 0].float()) and torch.equal(labels, s.labels)


def test_head_labels_by_name_else_the_heads_own_top1():
    """Classes of the set that are head classes (by name) keep their head row; a set with no head
    class at all is labelled by argmax W f + b, image by image."""
    g = torch.Generator().manual_seed(3)
    W, b, feats = torch.randn(5, 4, generator=g), torch.randn(5, generator=g), torch.randn(30, 4, generator=g)
    heads = ["cat", "dog", "tabby, tabby cat", "car", "tree"]
    y, source = R.head_labels(W, b, feats, ["Dog", "boat", "tabby cat"], heads)
    assert source == "names" and y.tolist() == [1, -1, 2]
    y, source = R.head_labels(W, b, feats, ["red circle", "blue square"], heads)
    naive = [max(range(5), key=lambda i: float(W[i] @ f + b[i])) for f in feats]
    assert source == "top-1" and y.tolist() == naive
    nc = R.neural_collapse_check(W, b, feats, y)
    assert nc["linear_top1"] == 100.0                                        # by construction
