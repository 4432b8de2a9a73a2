"""The data path's fast forms against their naive forms: layer selection (each layer's kNN once,
pooled on the device, cached), concurrent extraction, the feature reader, chunked evaluation."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import encoders
import features
import layers
import model_files
import shapes
import shapes_encoders as se
import similarity
from infra import folder, shards

ROOT = Path(__file__).resolve().parents[1]


def tiny_shapes(n=40, seed=0):
    """A small Shapes PairSet and randomly initialised tiny encoders (no pretraining needed)."""
    w = shapes.shapes_world(seed, n_train=n, n_test=2, n_cls=2, n_seg=2, n_bind=2)
    vocab = se.SPECIALS + sorted({x for c in w["train"].captions for x in se.WordTokenizer.split(c)})
    torch.manual_seed(seed)
    img = se.ShapesImageEncoder(se.TinyImageEncoder(len(shapes.CLASS_NAMES), pos=True))
    txt = se.ShapesTextEncoder(se.TinyTextEncoder(len(vocab)), se.WordTokenizer(vocab))
    return w, img, txt


def naive_pooled(img, txt, images, captions):
    """Each layer's pooled vectors from its own forward pass, as layer selection first read them."""
    x = se.shapes_pixels(images)
    X = {l: img.model(x, l).mean((2, 3)) for l in range(1, 5)}
    ids, mask = txt.tokenizer(captions)
    m = mask[..., None].float()
    Y = {l: (txt.model(ids, mask, l) * m).sum(1) / m.sum(1) for l in range(1, txt.n_layers + 1)}
    return X, Y


@pytest.mark.parametrize("metric", ["mknn", "cka"])
def test_layer_selection_equals_the_naive_pairwise_form_and_a_rerun_reads_the_cache(metric, tmp_path, monkeypatch):
    w, img, txt = tiny_shapes()
    pairs = w["train"]
    n = 30
    pick = torch.randperm(len(pairs.images), generator=torch.Generator().manual_seed(0))[:n].sort().values
    first = {}
    for j, i in enumerate(pairs.txt_to_img.tolist()):
        first.setdefault(i, j)
    with torch.no_grad():
        X, Y = naive_pooled(img, txt, pairs.images[pick], [pairs.captions[first[i]] for i in pick.tolist()])
    k = 7                                                     # ceil(2 * 30^(1/3))
    naive = {(a, b): (similarity.mutual_knn(X[a], Y[b], k) if metric == "mknn" else similarity.cka(X[a], Y[b]))
             for a in X for b in Y}
    li, lt, table = layers.select_layers(img, txt, pairs, metric, n=n, batch_size=8, log=lambda s: None,
                                           cache_dir=tmp_path)
    assert table == naive                                     # to the last digit
    assert (li, lt) == max(naive, key=naive.get) and (img.layer, txt.layer) == (li, lt)
    assert len(list((tmp_path / "layers").glob("*.json"))) == 1
    img.layer = txt.layer = -1

    def no_forward(*a, **k):
        raise AssertionError("a cached selection ran an encoder")
    monkeypatch.setattr(img, "pooled_layers", no_forward)
    monkeypatch.setattr(txt, "pooled_layers", no_forward)
    lines = []
    again = layers.select_layers(img, txt, pairs, metric, n=n, batch_size=8, log=lines.append, cache_dir=tmp_path)
    assert again == (li, lt, table) and (img.layer, txt.layer) == (li, lt) and "cached" in lines[0]
    with pytest.raises(AssertionError, match="cached selection ran"):   # other pairs: another key
        layers.select_layers(img, txt, pairs, metric, n=n - 1, log=lambda s: None, cache_dir=tmp_path)


def test_mutual_knn_and_cka_tables_equal_the_pairwise_measures():
    g = torch.Generator().manual_seed(1)
    Xs = {a: torch.randn(50, d, generator=g) for a, d in ((1, 8), (2, 16), (3, 4))}
    Ys = {b: torch.randn(50, d, generator=g) + 0.5 * Xs[1][:, :1] for b, d in ((1, 12), (2, 6))}
    got, want = similarity.mutual_knn_table(Xs, Ys, 5), {(a, b): similarity.mutual_knn(Xs[a], Ys[b], 5)
                                                          for a in Xs for b in Ys}
    assert got == want, f"mutual_knn_table {got}, expected the pairwise mutual_knn {want}"
    got, want = similarity.cka_table(Xs, Ys), {(a, b): similarity.cka(Xs[a], Ys[b]) for a in Xs for b in Ys}
    assert got == want, f"cka_table {got}, expected the pairwise cka {want}"
    got = similarity.mutual_knn_table({0: Xs[1]}, {0: Xs[1]}, 5)[0, 0]
    assert got == 1.0, f"mutual_knn_table of a set with itself {got}, expected 1.0"
    knn = (similarity.knn_indices(Xs[1], 5), similarity.knn_indices(Ys[2], 5))       # the tables mutual_knn reads
    got, want = similarity.mutual_knn(Xs[1], Ys[2], 5, knn=knn), similarity.mutual_knn(Xs[1], Ys[2], 5)
    assert got == want > 0, f"mutual_knn with the kNN tables given {got}, expected {want} as without them (> 0)"
    got = similarity.mutual_knn(Xs[1], Ys[2], 5, knn=(knn[0], knn[0]))
    assert got == 1.0, f"mutual_knn given the same kNN table twice {got}, expected 1.0 (it reads the tables given)"


@pytest.mark.slow
def test_bench_pipeline_prints_every_figure_at_a_tiny_size(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--tiny", "--work",
                        str(tmp_path), "--json", str(tmp_path / "out.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for label in ("reader rows/s", "numpy fancy-index rows/s", "loader rows/s", "decode images/s", "model images/s",
                  "pipeline images/s", "layer selection s", "naive layer selection s", "rerun (cached) s",
                  "scoring alone s", "evaluation", "host work per shard s", "host ms per batch",
                  "device-resident: host ms per step", "streamed:        host ms per step", "on an H100"):
        assert label in r.stdout, (label, r.stdout)
    host = next(line for line in r.stdout.splitlines() if "host work per shard s" in line)
    assert "4 rows x 257 x 32 fp16" in host and "forward per shard s" in host, host   # next to the forward's time
    figures = json.loads((tmp_path / "out.json").read_text())
    assert {"reader", "extraction", "layers", "evaluation", "steps"} <= set(figures)
    assert "host_per_shard_s" in figures["extraction"] and "host_per_batch_ms" in figures["extraction"]
    assert {"cov_gflop", "pal_resident_host_ms", "pal_streamed_host_ms"} <= set(figures["steps"])
    assert all(v["value"] > 0 and v["ratio"] > 0 for section in figures.values() for v in section.values())


class RaggedEncoder:
    """Random rows with their own lengths (texts) or one length (images), for the shard reader."""

    def __init__(self, name, T, D, ragged):
        self.name, self.layer, self.preprocess, self.fingerprint = name, -1, "none", name
        self.T, self.D, self.ragged = T, D, ragged

    def encode(self, rows, device="cpu"):
        from features import Features
        g = torch.Generator().manual_seed(int(rows[0]))
        B = len(rows)
        n = torch.randint(1, self.T + 1, (B,), generator=g) if self.ragged else torch.full((B,), self.T)
        mask = torch.arange(self.T)[None] < n[:, None]
        tokens = torch.randn(B, self.T, self.D, generator=g) * mask[..., None]
        return Features(tokens=tokens, mask=mask, pooled=tokens.sum(1), grid=None if self.ragged else (1, self.T - 1))


@pytest.mark.parametrize("ragged", [False, True])
def test_shard_reader_equals_a_row_by_row_read_in_the_order_asked(ragged, tmp_path, monkeypatch):
    import numpy as np

    from infra import cache
    monkeypatch.setattr(shards, "MEMMAP_BYTES", 0)
    monkeypatch.setattr(shards, "SHARD_BYTES", 1)                 # one batch (8 rows) per shard
    f = cache.extract(RaggedEncoder("r", 5, 4, ragged), list(range(30)), tmp_path, batch_size=8, dataset="t",
                      split="a", modality="x")
    assert len(f.tokens_files) == 4
    lengths, flat = f.lengths.tolist(), [np.load(p, mmap_mode="r")
                                         for p in sorted((tmp_path / "features").rglob("*.tokens.npy"))]
    def naive(rows):                                             # row r of shard s: its own slice of the file
        T = max(lengths[r] for r in rows)
        out = torch.zeros(len(rows), T, 4, dtype=torch.float16)
        for b, r in enumerate(rows):
            s, local = r // 8, r % 8
            start = sum(lengths[s * 8:s * 8 + local])
            out[b, :lengths[r]] = torch.from_numpy(np.array(flat[s][start:start + lengths[r]]))
        return out
    g = torch.Generator().manual_seed(3)
    for idx in (torch.randperm(30, generator=g)[:13], torch.tensor([29, 3, 3, 17, 0]), torch.arange(5, 11),
                torch.tensor([9])):
        got = f[idx]
        assert torch.equal(got.tokens, naive(idx.tolist()))
        assert torch.equal(got.mask, torch.arange(got.tokens.shape[1])[None] < f.lengths[idx][:, None])
        assert torch.equal(got.pooled, f.pooled[idx])
    assert torch.equal(f[:].tokens, naive(list(range(30))))


def test_read_ahead_pool_keeps_the_order_and_the_values():
    import random
    import time
    def slow(i):
        time.sleep(random.random() * 0.003)                     # workers finish out of order
        return i * i
    assert list(features.read_ahead(slow, range(40), depth=5, workers=3)) == [i * i for i in range(40)]
    assert list(features.read_ahead(slow, iter([]), depth=2, workers=2)) == []


def random_dinov2(layer=-1):
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(0)
    model = Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                     image_size=28, patch_size=14)).eval()
    enc = encoders.HFImageEncoder("random-dinov2", model, model_files.ImagePreprocess(32, 28), layer)
    enc.fingerprint = "random"
    return enc


@pytest.mark.parametrize("layer", [-1, 1])
def test_extraction_pipeline_equals_the_serial_encode(layer, tmp_path):
    """uint8 pixels prepared a batch ahead, normalised on the device: the features of encode(), to the last digit."""
    from PIL import Image

    from infra import cache
    g = torch.Generator().manual_seed(0)
    imgs = [Image.fromarray((torch.rand(40 + 3 * i, 50, 3, generator=g) * 255).byte().numpy()) for i in range(7)]
    enc = random_dinov2(layer)
    want = enc.encode(imgs)
    got = enc.encode_prepared(enc.prepare(imgs, "cpu"), "cpu")
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pooled, want.pooled) and got.grid == want.grid
    f = cache.extract(enc, imgs, tmp_path, batch_size=3, dataset="t", split="a", modality="image")   # 3 batches
    assert torch.equal(f.tokens, want.tokens.half()) and torch.equal(f.pooled, want.pooled.half())


def test_progress_lines_count_from_the_start_and_give_an_eta(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(folder.time, "time", lambda: now[0])
    lines = []
    p = folder.Progress("[x]", 1000, every=10, log=lines.append, t0=90.0)   # the first batch took 10 s
    p.update(100)
    now[0] = 101.0
    p.update(100)                                                  # 1 s since the last line: none
    now[0] = 111.0
    p.update(300)
    assert lines == ["[x] 100/1000 rows (10%), 10 rows/s, 10s elapsed, ETA 1m30s",
                     "[x] 500/1000 rows (50%), 24 rows/s, 21s elapsed, ETA 21s"]


def token_sets(I=12, T=70, D=16, seed=0):
    from features import Features
    g = torch.Generator().manual_seed(seed)
    img = Features(torch.randn(I, 17, D, generator=g), torch.ones(I, 17, dtype=torch.bool),
                   torch.randn(I, D, generator=g), (4, 4))
    n = torch.randint(2, 25, (T,), generator=g)
    mask = torch.arange(int(n.max()))[None] < n[:, None]
    txt = Features(torch.randn(T, mask.shape[1], D, generator=g) * mask[..., None], mask,
                   torch.randn(T, D, generator=g))
    return img, txt


@pytest.mark.parametrize("name", ["filip", "cov", "text_guided"])
def test_scores_by_caption_length_equal_the_padded_form(name):
    import evaluate
    import methods
    img, txt = token_sets()
    torch.manual_seed(0)
    m = methods.METHODS[name](16, 16)
    with evaluate.inference(m):
        a, b = evaluate.embed(m.embed_image, img), evaluate.embed(m.embed_text, txt)
        padded = evaluate.score_matrix(m, a, b, chunk=16)                 # every chunk padded to the longest text
        bucketed = evaluate.score_matrix(m, a, b, chunk=16, by_length=True)
        naive = torch.tensor([[float(m.score(a[i:i + 1], b[j:j + 1, :int(txt.mask[j].sum())])) for j in range(len(b))]
                              for i in range(len(a))])                    # each caption alone, unpadded
    torch.testing.assert_close(bucketed, padded, rtol=0, atol=1e-6)
    torch.testing.assert_close(bucketed, naive, rtol=0, atol=1e-6)
    assert evaluate.real_lengths(b).tolist() == txt.mask.sum(1).tolist()


def test_asif_dense_image_in_chunks_equals_the_whole_batch():
    from methods.asif import ASIF
    img, _ = token_sets(I=5, D=8)
    m = ASIF(8, 8, k=3)
    g = torch.Generator().manual_seed(1)
    m.anchors_v = torch.nn.functional.normalize(torch.randn(30, 8, generator=g), dim=-1)
    whole = m.dense_image(img)
    assert whole.shape == (5, 16, 30)
    assert torch.equal(whole, m.relative(img.patches(), m.anchors_v))    # under the chunk: the one-call form
    for chunk in (30, 7 * 30, 79 * 30):                                   # 1, 7, 79 patch rows at a time
        torch.testing.assert_close(m.dense_image(img, chunk=chunk), whole, rtol=0, atol=1e-6)  # matmul rounding


def test_text_guided_default_chunk_is_the_cpu_one():
    from methods.text_guided import TextGuided
    img, txt = token_sets(I=6, T=9)
    torch.manual_seed(0)
    m = TextGuided(16, 16, K=8)
    a, b = m.embed_image(img), m.embed_text(txt)
    m2 = TextGuided(16, 16, K=8, score_chunk=2 ** 20)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m.score(a, b), m2.score(a, b))
