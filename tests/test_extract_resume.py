"""An extraction never loses its work: a Ctrl-C keeps every finished batch (a set that fits one file) or
shard (a memory-mapped set), and the rerun says how many it kept and encodes only the rest; the disk
check says the cache's size before any extraction and refuses a disk too small for it.

References: an uninterrupted extraction of the same inputs (equal features, bit for bit); the calls
counted on the encoder; the bytes counted by hand."""
import shutil
from collections import namedtuple

import pytest
import torch
from test_loading import RandomEncoder

from infra import cache, shards
from infra.errors import RunError


class Interrupted(RandomEncoder):
    """RandomEncoder whose at-th encode raises KeyboardInterrupt (a Ctrl-C), counting its calls."""

    def __init__(self, *a, at=None):
        super().__init__(*a)
        self.at, self.calls = at, 0

    def encode(self, inputs, device="cpu"):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().encode(inputs, device)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_ctrl_c_keeps_every_finished_batch_and_the_rerun_says_so(sharded, ragged, tmp_path, monkeypatch, capsys):
    """10 inputs in batches of 2 (5 batches; sharded: one batch a shard), Ctrl-C in the 4th batch's forward:
    3 batches kept, said at the interrupt and at the rerun, which encodes only the last 2; the features
    equal an uninterrupted run's."""
    if sharded:
        monkeypatch.setattr(shards, "MEMMAP_BYTES", 0)
        monkeypatch.setattr(shards, "SHARD_BYTES", 1)
    args = dict(batch_size=2, dataset="t", split="a", modality="x")
    enc = Interrupted("e", 5, 4, ragged, at=4)
    with pytest.raises(KeyboardInterrupt):
        cache.extract(enc, list(range(10)), tmp_path / "c", **args)
    unit = "shards" if sharded else "batches"
    lines = capsys.readouterr().out.splitlines()
    assert any(f"interrupted: 3 of 5 {unit}" in x for x in lines), lines
    again = Interrupted("e", 5, 4, ragged)
    got = cache.extract(again, list(range(10)), tmp_path / "c", **args)
    lines = capsys.readouterr().out.splitlines()
    kept = [x for x in lines if "kept from" in x]
    assert len(kept) == 1 and f"3 of 5 {unit}" in kept[0], lines
    assert again.calls == 2                                   # the last two batches only
    want = cache.extract(RandomEncoder("e", 5, 4, ragged), list(range(10)), tmp_path / "fresh", **args)
    rows = torch.arange(10)
    got, want = (got[rows], want[rows]) if sharded else (got, want)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
    assert torch.equal(got.pooled, want.pooled)
    if not sharded:
        assert not list((tmp_path / "c" / "features").glob("*.batches"))     # the file replaced its batches


def test_batches_of_another_batch_size_are_not_kept(tmp_path, monkeypatch):
    """A rerun with another batch size encodes everything again: its batches would not be the same rows."""
    args = dict(dataset="t", split="a", modality="x")
    with pytest.raises(KeyboardInterrupt):
        cache.extract(Interrupted("e", 5, 4, True, at=3), list(range(10)), tmp_path, batch_size=2, **args)
    enc = Interrupted("e", 5, 4, True)
    cache.extract(enc, list(range(10)), tmp_path, batch_size=5, **args)
    assert enc.calls == 2


Usage = namedtuple("Usage", "total used free")


def test_disk_check_says_the_size_and_refuses_a_disk_too_small(tmp_path, monkeypatch):
    """An image set of 10 rows x 5 tokens x 4 and a text set whose first 64 captions are at most 6 tokens:
    the bytes counted by hand; refused (before any extraction) when the disk has one byte less."""
    img, txt = RandomEncoder("i", 5, 4, ragged=False), RandomEncoder("t", 6, 4, ragged=True)
    parts = lambda m: dict(dataset="d", split="s", modality=m)
    need = [cache.planned_bytes(img, list(range(10)), tmp_path, **parts("image")),
            cache.planned_bytes(txt, list(range(70)), tmp_path, **parts("text"))]
    assert need == [10 * (2 * 5 * 4 + 2 * 4 + 5), 70 * (2 * 6 * 4 + 2 * 4 + 6)]
    lines = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 0, sum(need)))
    cache.check_disk(sum(need), tmp_path / "not" / "yet", log=lines.append)       # a folder not made yet: its disk
    assert lines == [f"[features] cache on disk: {sum(need) / 1e9:.2f} GB to write (0 sets already cached); "
                     f"{sum(need) / 1e9:.2f} GB free on the disk of {tmp_path.resolve()}"]
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 0, sum(need) - 1))
    with pytest.raises(RunError, match="needs .* on disk .* --cache-dir on a larger disk"):
        cache.check_disk(sum(need), tmp_path, log=lines.append)
    cache.extract(img, list(range(10)), tmp_path, batch_size=4, **parts("image"))
    assert cache.planned_bytes(img, list(range(10)), tmp_path, **parts("image")) == 0      # cached: nothing to write


@pytest.mark.slow
def test_a_run_on_a_full_disk_stops_before_any_extraction(tmp_path, monkeypatch, capsys):
    """python align.py with a disk of 1 kB free: one error line naming the size, no feature file written."""
    import align
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 0, 1000))
    with pytest.raises(RunError, match="the feature cache needs"):
        align.main(["--threads", "1", "--epochs", "1", "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o"),
                    "--no-figures"])
    assert not list((tmp_path / "c" / "features").glob("*.pt"))


def test_a_real_image_encoder_on_a_cpu_extracts_in_small_batches(tmp_path):
    """An encoder with prepare (the real image encoders) on a CPU: batches of CPU_IMAGE_BATCH; others of
    EXTRACT_BATCH (the Shapes encoders: the default run's batches)."""
    class Prepared(RandomEncoder):
        def __init__(self):
            super().__init__("p", 5, 4, False)
            self.sizes = []

        def prepare(self, rows, device):
            return rows

        def encode_prepared(self, rows, device):
            self.sizes.append(len(rows))
            return super().encode(rows, device)

        def encode(self, rows, device="cpu"):
            self.sizes.append(len(rows))
            return super().encode(rows, device)
    enc, n = Prepared(), cache.CPU_IMAGE_BATCH * 2 + 3
    cache.extract(enc, list(range(n)), tmp_path, dataset="d", split="s", modality="image")
    assert enc.sizes == [cache.CPU_IMAGE_BATCH, cache.CPU_IMAGE_BATCH, 3]
    plain = Interrupted("q", 5, 4, False)
    cache.extract(plain, list(range(n)), tmp_path, dataset="d", split="s", modality="image")
    assert plain.calls == 1 and cache.EXTRACT_BATCH >= n                 # one batch of EXTRACT_BATCH


def test_on_cuda_the_range_check_runs_on_the_device_before_the_copy_back(tmp_path, monkeypatch):
    """A Hugging Face image encoder extracting on the (simulated) GPU: every batch is checked where it was made
    (device tensors, fp32 before the cast), never scanned again on the host; a value beyond fp16 is still
    one error line."""
    from PIL import Image
    from simulated_device import simulated_cuda
    from test_pipeline import random_dinov2

    from infra import shards
    seen, real = [], shards.check_fp16
    monkeypatch.setattr(shards, "check_fp16", lambda f, enc: (seen.append((f.tokens.is_cuda, f.tokens.dtype)),
                                                              real(f, enc)))
    g = torch.Generator().manual_seed(0)
    imgs = [Image.fromarray((torch.rand(40, 50, 3, generator=g) * 255).byte().numpy()) for _ in range(5)]
    enc = random_dinov2()
    with simulated_cuda(monkeypatch):
        f = cache.extract(enc, imgs, tmp_path, batch_size=2, device="cuda", dataset="t", split="a", modality="image")
        assert not f.tokens.is_cuda and f.tokens.dtype == torch.float16
        assert seen and all(s == (True, torch.float32) for s in seen), seen       # 3 batches, on the device
        enc.model.layernorm.bias.data.fill_(1e5)                                   # every token beyond fp16
        with pytest.raises(RunError, match="beyond 65504"):
            cache.extract(enc, imgs, tmp_path / "b", batch_size=2, device="cuda", dataset="t", split="b",
                          modality="image")
