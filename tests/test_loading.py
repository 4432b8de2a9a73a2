"""Batch loading (read-ahead of memory-mapped sets), the CPU defaults (threads, training budget) and the allocator.

References: the plain loader (img[idx], txt[idx] in the main thread) for the read-ahead; FLOPs counted by
hand from Linear's shapes for the budget rule.
"""
import threading
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import interrupted, random_features, train_with

import features
import shapes
import train as budget
from infra import cache, shards
from methods.linear import Linear

ROOT = Path(__file__).resolve().parents[1]


class RandomEncoder:
    """An encoder whose outputs are fixed random rows (by index): what extract() caches, ragged texts included."""
    layer, preprocess = -1, "none"

    def __init__(self, name, T, D, ragged):
        self.name, self.T, self.D, self.ragged = name, T, D, ragged

    def encode(self, inputs, device="cpu"):
        rows = torch.as_tensor(list(inputs))
        lengths = (2 + rows % (self.T - 1)).tolist() if self.ragged else None
        f = random_features(len(rows), self.T, self.D, grid=None if self.ragged else (2, 2), lengths=lengths,
                            seed=int(rows[0]))
        return f


def stored_and_dense(tmp_path, monkeypatch, n=70):
    """The same pairs as memory-mapped StoredFeatures (shards of 16 rows) and as in-RAM Features."""
    monkeypatch.setattr(shards, "MEMMAP_BYTES", 0)            # every set goes to shards
    monkeypatch.setattr(shards, "SHARD_BYTES", 1)            # one batch per shard
    enc_i, enc_t = RandomEncoder("img", 5, 8, ragged=False), RandomEncoder("txt", 6, 6, ragged=True)
    img = cache.extract(enc_i, list(range(n)), tmp_path, batch_size=16, dataset="t", split="a", modality="image")
    txt = cache.extract(enc_t, list(range(n)), tmp_path, batch_size=16, dataset="t", split="a", modality="text")
    assert features.is_stored(img) and features.is_stored(txt) and len(img.tokens_files) == -(-n // 16)
    return (img, txt), (img[:], txt[:])


def test_read_ahead_gives_the_plain_loaders_batches_in_order(tmp_path, monkeypatch):
    (img, txt), (img_d, txt_d) = stored_and_dense(tmp_path, monkeypatch)
    order = torch.randperm(len(img), generator=torch.Generator().manual_seed(0))
    index_batches = [order[s * 16:(s + 1) * 16] for s in range(len(img) // 16)]
    seen_threads = []
    ahead = []
    for idx, a, b in features.batch_loader(img, txt, iter(index_batches), "cpu"):
        seen_threads.append(any(t.name == "read-ahead" for t in threading.enumerate()))
        ahead.append((idx, a, b))
    assert all(seen_threads[:-1])      # read by the background thread (after the last batch it may have ended)
    assert not any(t.name == "read-ahead" for t in threading.enumerate())   # and it has ended
    assert len(ahead) == len(index_batches)
    for (idx, a, b), want in zip(ahead, index_batches):
        assert torch.equal(idx, want)
        plain_a, plain_b = img_d[want].to("cpu"), txt_d[want].to("cpu")      # the plain loader, in RAM
        for x, y in ((a, plain_a), (b, plain_b)):
            assert x.tokens.dtype == torch.float32 and torch.equal(x.tokens, y.tokens)
            assert torch.equal(x.mask, y.mask) and torch.equal(x.pooled, y.pooled) and x.grid == y.grid


def test_training_on_memory_mapped_sets_matches_in_ram_and_resumes_exactly(tmp_path, monkeypatch):
    (img, txt), (img_d, txt_d) = stored_and_dense(tmp_path, monkeypatch, n=64)
    args = lambda resume=False: Namespace(epochs=3, batch_size=16, lr=None, weight_decay=None, seed=0, resume=resume)
    runs = {}
    for name, (a, b) in {"ram": (img_d, txt_d), "mmap": (img, txt)}.items():
        torch.manual_seed(0)
        runs[name] = Linear(8, 6, K=4)
        train_with(runs[name], a, b, args(), tmp_path / name, "cpu")

    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        # epoch 3 (call 10 of 12)
        train_with(interrupted(Linear, at_call=10)(8, 6, K=4), img, txt, args(), tmp_path / "cut", "cpu")
    assert not any(t.name == "read-ahead" for t in threading.enumerate())   # the reader stopped with the loop
    resumed = Linear(8, 6, K=4)
    train_with(resumed, img, txt, args(resume=True), tmp_path / "cut", "cpu")
    for k, v in runs["ram"].state_dict().items():
        assert torch.equal(v, runs["mmap"].state_dict()[k]), k
        assert torch.equal(v, resumed.state_dict()[k]), k


def test_an_exception_in_the_reader_thread_is_raised_in_the_callers_thread():
    def make(i):
        if i == 3:
            raise ValueError(f"unreadable shard {i} in {threading.current_thread().name}")
        return i * i
    got = []
    with pytest.raises(ValueError, match="unreadable shard 3 in read-ahead"):
        for v in features.read_ahead(make, range(6)):
            got.append(v)
    assert got == [0, 1, 4]                                        # everything before the failure, in order
    assert not any(t.name == "read-ahead" for t in threading.enumerate())
    it = features.read_ahead(lambda i: i, range(1000))              # leaving early stops the reader
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()
    assert not any(t.name == "read-ahead" for t in threading.enumerate())


# ----------------------------------------------------------------------------- CPU defaults
def linear_gflop(B, D_v, D_l, K):
    """Linear.loss forward, by hand: P_v, P_l on the pooled vectors and the (B, B) similarity."""
    return 2 * (B * D_v * K + B * D_l * K + B * K * B) / 1e9


def test_forward_gflop_counts_the_matrix_products_and_changes_nothing():
    img, txt = random_features(40, 5, 8, grid=(2, 2), seed=1), random_features(40, 4, 6, seed=2)
    m = Linear(8, 6, K=4)
    before, rng = {k: v.clone() for k, v in m.state_dict().items()}, torch.get_rng_state()
    assert budget.forward_gflop(m, img, txt, 32) == pytest.approx(linear_gflop(32, 8, 6, 4))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert budget.cpu_threads(budget.BIG_STEP_GFLOP, 2) == 2 and budget.cpu_threads(0.9 * budget.BIG_STEP_GFLOP, 2) == 1
    assert budget.cpu_threads(None, 4) == 1


def test_cpu_default_caps_epochs_by_the_budget_and_halves_an_over_budget_batch(monkeypatch):
    N, D = 2048, 64
    img, txt = random_features(N, 2, D, seed=1), random_features(N, 3, D, seed=2)
    m = Linear(D, D, K=512)                                       # defaults: 20 epochs, batch 256
    tflop = lambda B, epochs: 3 * linear_gflop(B, D, D, 512) * (N // B) * epochs / 1000
    # within the budget: the paper's settings stand
    monkeypatch.setattr(budget, "CPU_BUDGET_TFLOP", tflop(256, 20) * 1.01)
    assert budget.cpu_default(None, None, m, img, txt)[1:] == ({}, None)
    # 7.5 epochs' worth: 7 epochs at the paper's batch (56 steps), and the line says so
    monkeypatch.setattr(budget, "MIN_STEPS", 50)
    monkeypatch.setattr(budget, "CPU_BUDGET_TFLOP", tflop(256, 7.5))
    gflop, change, line = budget.cpu_default(None, None, m, img, txt)
    assert change == dict(epochs=7, batch_size=256) and gflop == pytest.approx(linear_gflop(256, D, D, 512))
    assert "epochs 7, batch 256 (the method's own: epochs 20, batch 256" in line and "--epochs" in line
    # fewer than MIN_STEPS steps in the budget: halved once (128: 16 steps an epoch, 10 epochs = 160 >= 100)
    monkeypatch.setattr(budget, "MIN_STEPS", 100)
    assert 7 * 8 < 100 <= int(tflop(256, 7.5) // tflop(128, 1)) * 16
    change = budget.cpu_default(None, None, m, img, txt)[1]
    assert change == dict(epochs=int(tflop(256, 7.5) // tflop(128, 1)), batch_size=128)
    # --batch-size given: never halved
    assert budget.cpu_default(None, 256, m, img, txt)[1] == dict(epochs=7, batch_size=256)
    monkeypatch.setattr(budget, "MIN_STEPS", 1)
    # one epoch at batch 128 is over the budget, one at 64 is not (per epoch, the (B, B) term grows with B):
    # the batch is halved twice, then 1 epoch
    monkeypatch.setattr(budget, "CPU_BUDGET_TFLOP", tflop(64, 1.2))
    assert tflop(128, 1) > budget.CPU_BUDGET_TFLOP
    gflop, change, line = budget.cpu_default(None, None, m, img, txt)
    assert change == dict(epochs=1, batch_size=64) and gflop == pytest.approx(linear_gflop(64, D, D, 512))
    assert "epochs 1, batch 64 (the method's own: epochs 20, batch 256" in line
    # --epochs given: nothing changes, whatever the budget
    monkeypatch.setattr(budget, "CPU_BUDGET_TFLOP", 1e-9)
    assert budget.cpu_default(3, None, m, img, txt)[1:] == ({}, None)
    # a step budget ("steps": 400, e.g. MLP) is the paper's count too: ceil(400 / steps per epoch) epochs
    m.defaults = dict(Linear.defaults, steps=400, epochs=None)
    monkeypatch.setattr(budget, "CPU_BUDGET_TFLOP", tflop(256, 10.5))
    _, change, line = budget.cpu_default(None, None, m, img, txt)
    assert change["epochs"] == 10 and "the method's own: epochs 50" in line   # 400 steps / 8 per epoch


# ----------------------------------------------------------------------------- the cold path: rendering
def test_render_with_grids_made_once_matches_the_per_call_grids():
    import numpy as np
    rng = np.random.default_rng(7)
    scenes = [shapes.sample_scene(rng, int(rng.integers(1, 4))) for _ in range(20)]
    for obj in (o for s in scenes for o in s["objects"]):
        yy, xx = np.mgrid[0:shapes.SIZE, 0:shapes.SIZE] + 0.5             # the grid as render made it per call
        dx, dy, r = xx - obj["x"], yy - obj["y"], obj["r"]
        naive = {"circle": dx ** 2 + dy ** 2 <= r ** 2, "square": (abs(dx) <= 0.85 * r) & (abs(dy) <= 0.85 * r),
                 "triangle": (dy >= -r) & (dy <= 0.8 * r) & (abs(dx) <= 0.6 * (dy + r)),
                 "cross": ((abs(dx) <= r / 3) & (abs(dy) <= r)) | ((abs(dy) <= r / 3) & (abs(dx) <= r))}[obj["shape"]]
        assert np.array_equal(shapes.shape_mask(obj), naive)
    images, shape_masks, object_masks = shapes.render_all(scenes)
    one_by_one = [shapes.render(s) for s in scenes]
    assert images.is_contiguous() and images.shape == (20, 3, shapes.SIZE, shapes.SIZE)
    for k, x in enumerate((images, shape_masks, object_masks)):
        assert torch.equal(x, torch.stack([r[k] for r in one_by_one]))
