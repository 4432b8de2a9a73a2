"""Where the training set's features live while the loop runs (features.Feed): on the device once when they fit,
streamed otherwise, decided from sizes alone; checked on the simulated CUDA device (tests/simulated_device.py).

References: the streamed batches (host index, then the copy) for the device-resident ones; the host syncs
counted at two epoch lengths (a per-step sync shows as a difference) for "0 per step"."""
import traceback
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import HostSyncs, random_features, train_with
from simulated_device import simulated_cuda
from test_loading import stored_and_dense

import features
import methods
from features import Features

ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def cached_pairs(n, seed=0):
    """n image-text pairs as the feature cache holds them: fp16, 17 image tokens (4 x 4 + global), ragged words."""
    img = random_features(n, 17, 8, grid=(4, 4), seed=seed + 1)
    txt = random_features(n, 9, 6, lengths=[3 + i % 6 for i in range(n)], seed=seed + 2)
    half = lambda f: Features(f.tokens.half(), f.mask, f.pooled.half(), f.grid)
    return half(img), half(txt)


class RepoSyncs(HostSyncs):
    """HostSyncs whose `where` is the innermost frame in this repository's own code (not the tests' helpers,
    not torch): the optimiser's step count, a host tensor on a GPU too, is left out."""

    def count(self, name):
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if f.filename.startswith(ROOT) and "/tests/" not in f.filename]
        self.calls.append(name)
        self.where.append("optimiser" if any("torch/optim/" in f.filename for f in stack) else
                          f"{frames[-1].filename.removeprefix(ROOT)}:{frames[-1].lineno}" if frames else "torch")


def train_on_device(name, n, tmp_path, monkeypatch, memory=141 * 2**30):
    img, txt = cached_pairs(n)
    args = Namespace(epochs=1, batch_size=16, lr=None, weight_decay=None, seed=0, resume=False)
    with simulated_cuda(monkeypatch, memory=memory) as counts:
        torch.manual_seed(0)
        m = methods.METHODS[name](8, 6).to("cuda")
        with RepoSyncs() as syncs:
            result = train_with(m, img, txt, args, tmp_path, "cuda")
        device_syncs = counts["sync"]
    return result, [w for w in syncs.where if w not in ("torch", "optimiser")], device_syncs


@pytest.mark.parametrize("name", ["pal", "cov", "linear"])
def test_device_resident_training_waits_on_the_host_0_times_a_step(name, tmp_path, monkeypatch, capsys):
    """4 and 8 steps an epoch: the same host syncs (the epoch's end only), counted two ways: every sync
    in the repository's code (HostSyncs) and every value read from a device tensor (the simulated device)."""
    _, short, short_dev = train_on_device(name, 64, tmp_path / "a", monkeypatch)
    _, long, long_dev = train_on_device(name, 128, tmp_path / "b", monkeypatch)
    assert len(long) == len(short) and long_dev == short_dev, (sorted(set(long) - set(short)), long_dev, short_dev)
    assert short_dev <= 6, short_dev                    # the epoch's end: finiteness, its loss, its logs
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[features] training set:")]
    assert len(line) == 2 and "on the GPU, loaded once" in line[0], line


def test_too_little_device_memory_streams_the_same_training(tmp_path, monkeypatch, capsys):
    """A GPU too small for the features: streamed (pinned host batches) and said so; the same losses to float
    rounding as the device-resident run (the resident batches keep the set's full padded width)."""
    resident, _, _ = train_on_device("pal", 64, tmp_path / "a", monkeypatch)
    streamed, _, _ = train_on_device("pal", 64, tmp_path / "b", monkeypatch, memory=1000)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[features] training set:")]
    assert "on the GPU" in lines[0] and "in RAM; each step indexes its batch into a pinned buffer" in lines[1]
    assert "exceed" in lines[1], lines[1]
    assert streamed["final_loss"] == pytest.approx(resident["final_loss"], abs=2e-4)


def test_the_decision_counts_every_byte_of_both_sets(monkeypatch, capsys):
    """Tokens, mask and pooled of both sets, against RESIDENT_SHARE of the GPU's memory: one byte over streams."""
    img, txt = cached_pairs(32)
    need = (32 * 17 * 8 * 2 + 32 * 17 + 32 * 8 * 2) + (32 * 9 * 6 * 2 + 32 * 9 + 32 * 6 * 2)
    assert features.dense_bytes(img) + features.dense_bytes(txt) == need
    for memory, resident in ((need / features.RESIDENT_SHARE + 1, True), (need / features.RESIDENT_SHARE - 2, False)):
        with simulated_cuda(monkeypatch, memory=int(memory)):
            assert features.Feed(img, txt, "cuda", log=lambda s: None).resident == resident, memory


def test_resident_batches_equal_the_streamed_ones(tmp_path, monkeypatch):
    """Memory-mapped shards (ragged texts) loaded onto the device in chunks: each step's rows equal the
    streamed batch's, padding columns aside (exactly 0, masked)."""
    (img, txt), _ = stored_and_dense(tmp_path, monkeypatch)
    monkeypatch.setattr(features, "RESIDENT_CHUNK_BYTES", 5 * 8 * 2 * 7)      # 7 rows a copy: chunks of their own width
    order = torch.randperm(len(img), generator=torch.Generator().manual_seed(0))
    batches = [order[s * 16:(s + 1) * 16] for s in range(len(img) // 16)]
    with simulated_cuda(monkeypatch) as counts:
        feed = features.Feed(img, txt, "cuda", log=lambda s: None)
        assert feed.resident
        got = list(feed.batches(iter(batches)))
        want = list(features.batch_loader(img, txt, iter(batches), "cuda"))
        for (i, a, b), (j, c, d) in zip(got, want, strict=True):
            assert torch.equal(i, j) and a.tokens.is_cuda and a.tokens.dtype == torch.float32
            for x, y in ((a, c), (b, d)):
                t = y.tokens.shape[1]
                assert torch.equal(x.tokens[:, :t].cpu(), y.tokens.cpu()) and not x.tokens[:, t:].cpu().any()
                assert torch.equal(x.mask[:, :t].cpu(), y.mask.cpu()) and not x.mask[:, t:].cpu().any()
                assert torch.equal(x.pooled.cpu(), y.pooled.cpu())
    assert counts["pin_memory"] >= len(batches)              # the streamed batches were read into pinned buffers


def test_pinned_host_rows_equal_the_plain_index(tmp_path, monkeypatch):
    """The streamed path's one copy: rows read straight into a pinned buffer, equal to f[idx]."""
    (img, txt), (img_d, txt_d) = stored_and_dense(tmp_path, monkeypatch)
    idx = torch.tensor([40, 3, 3, 17, 69, 0])
    with simulated_cuda(monkeypatch) as counts:
        for f in (img, txt, img_d, txt_d):
            got, want = features.host_rows(f, idx, pinned=True), f[idx]
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
            assert torch.equal(got.pooled, want.pooled) and got.grid == want.grid
    assert counts["pin_memory"] >= 4 * 3
