"""The COCO-scale feature cache: memory-mapped shards, ragged text, resume, and the training loop on it."""
import argparse

import pytest
import torch
from conftest import train_with

from features import Features
from infra import cache, shards
from infra.shards import StoredFeatures
from methods.linear import Linear


class FakeEncoder:
    """Deterministic features of integer items: item i has 1 + i // 10 real tokens (text) or a 2x2 grid (images)."""
    layer, preprocess = -1, "none"

    def __init__(self, image=False, fail_after=None, name="fake"):
        self.image, self.fail_after, self.name, self.calls = image, fail_after, name, 0

    def encode(self, items, device="cpu"):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt("interrupted")                           # a run stopped mid-extraction
        items = torch.as_tensor(list(items))
        lengths = torch.full_like(items, 5) if self.image else 1 + items // 10
        T = int(lengths.max())
        t, d = torch.arange(T)[None, :, None], torch.arange(3)[None, None]
        tokens = items[:, None, None] + 0.125 * t + 0.25 * d                  # (B, T, 3), exact in fp16
        mask = torch.arange(T)[None] < lengths[:, None]
        tokens = tokens * mask[..., None]
        return Features(tokens=tokens.float(), mask=mask, pooled=tokens.sum(1) / lengths[:, None],
                        grid=(2, 2) if self.image else None)


def extract(enc, n, tmp_path, **kw):
    return cache.extract(enc, list(range(n)), tmp_path, batch_size=4, dataset="d", split="s", modality="m", **kw)


def shard_rows(monkeypatch, rows, image=False):
    """Every set goes to the memory-mapped layout, `rows` rows per shard (sized from the first batch's rows)."""
    monkeypatch.setattr(shards, "MEMMAP_BYTES", 0)
    monkeypatch.setattr(shards, "SHARD_BYTES", rows * 2 * (5 if image else 1) * 3)  # rows x fp16 x T x D


@pytest.mark.parametrize("image", [False, True])
def test_memmapped_rows_equal_the_in_memory_features(tmp_path, monkeypatch, image):
    n = 30
    shard_rows(monkeypatch, 12, image)
    ref = FakeEncoder(image).encode(range(n))                             # the whole set at once, in RAM
    f = extract(FakeEncoder(image), n, tmp_path)
    assert isinstance(f, StoredFeatures) and len(f) == n and f.grid == ref.grid
    idx = torch.tensor([29, 3, 17, 3, 0, 12])                             # across shards, unsorted, repeated
    got = f[idx]
    T = int(ref.mask[idx].sum(1).max())                                   # padded to the longest of these rows
    assert got.tokens.shape == (6, T, 3) and got.tokens.dtype == torch.float16
    assert torch.equal(got.tokens, ref.tokens[idx, :T].half()) and torch.equal(got.mask, ref.mask[idx, :T])
    assert torch.equal(got.pooled, ref.pooled[idx].half()) and torch.equal(f[2:5].tokens, f[[2, 3, 4]].tokens)
    if image:
        assert got.patches().shape == (6, 4, 3)
    # tokens are stored ragged: a shard file holds exactly its rows' real tokens, no padding
    assert len(list((tmp_path / "features").glob("*/*.tokens.npy"))) == 3  # 12 + 12 + 6 rows
    real = ref.mask.sum(1)
    assert [len(f.tokens_files[s]) for s in range(3)] == [int(real[a:a + 12].sum()) for a in (0, 12, 24)]


def test_an_interrupted_extraction_resumes_without_redoing_finished_shards(tmp_path, monkeypatch):
    n = 30                                                                # 8 batches, 3 shards of 3 / 3 / 2 batches
    shard_rows(monkeypatch, 12)
    with pytest.raises(KeyboardInterrupt):
        extract(FakeEncoder(fail_after=5), n, tmp_path)                   # shard 0 done, shard 1 interrupted
    enc = FakeEncoder()
    f = extract(enc, n, tmp_path)
    assert enc.calls == 5                                                 # shards 1 and 2 only
    assert torch.equal(f[:].tokens, FakeEncoder().encode(range(n)).tokens.half())
    enc = FakeEncoder()
    extract(enc, n, tmp_path)
    assert enc.calls == 0                                                 # all done: read back, nothing encoded
    meta = next((tmp_path / "features").glob("*/00002.pt"))
    meta.write_bytes(meta.read_bytes()[:50])                              # a broken shard is redone, alone
    extract(enc, n, tmp_path)
    assert enc.calls == 2


def test_small_sets_stay_one_in_memory_file(tmp_path):
    f = extract(FakeEncoder(), 10, tmp_path)
    assert isinstance(f, Features) and [p.suffix for p in (tmp_path / "features").iterdir()] == [".pt"]


def test_the_training_loop_streams_batches_from_the_memmap(tmp_path, monkeypatch):
    n = 40
    shard_rows(monkeypatch, 12)
    img = extract(FakeEncoder(image=True), n, tmp_path / "a")
    txt = extract(FakeEncoder(), n, tmp_path / "b")
    assert isinstance(img, StoredFeatures) and isinstance(txt, StoredFeatures)
    torch.manual_seed(0)
    method = Linear(3, 3)
    args = argparse.Namespace(epochs=2, batch_size=8, lr=1e-2, weight_decay=0.0, seed=0, resume=False)
    result = train_with(method, img, txt, args, tmp_path, "cpu")
    assert result["final_loss"] is not None and result["final_loss"] == result["final_loss"]  # finite, ran


def test_the_writer_thread_writes_the_serial_path_s_shards_beside_the_forward(tmp_path, monkeypatch):
    """Shard n is written in a writer thread while shard n + 1 is encoded: the same files as one after the
    other, and the forward of shard 1 runs before shard 0's write is done."""
    import threading
    n = 30                                                                # 3 shards of 12 / 12 / 6 rows
    shard_rows(monkeypatch, 12)
    inputs = list(range(n))

    class Watched(FakeEncoder):
        def encode(self, items, device="cpu"):
            if items[0] == 12:
                shard_1_encoding.set()
            return super().encode(items, device)

    serial_write, threads = shards.write_shard, []

    def write_shard(folder, s, parts, key):
        threads.append(threading.current_thread().name)
        if s == 0 and threads[-1] != "MainThread":
            assert shard_1_encoding.wait(10), "shard 1 was not encoded while shard 0 was written"
        return serial_write(folder, s, parts, key)

    monkeypatch.setattr(shards, "write_shard", write_shard)
    files = {}
    for writer in (False, True):
        shard_1_encoding = threading.Event()
        folder = tmp_path / str(writer) / "k"
        plan = shards.shard_plan(Watched(), inputs, folder, "k", 4, "cpu")
        shards.write_shards(Watched(), inputs, folder, "k", plan, range(plan["n_shards"]), 4, "cpu", writer=writer)
        metas = [torch.load(folder / f"{s:05d}.pt", weights_only=True) for s in range(3)]
        files[writer] = ([(folder / f"{s:05d}.tokens.npy").read_bytes() for s in range(3)],
                         [(m["lengths"], m["pooled"], m["tokens_file"]["crc"]) for m in metas])
    assert threads[:3] == ["MainThread"] * 3 and all(t.startswith("shard-writer") for t in threads[3:])
    assert len(threads) == 6 and files[True][0] == files[False][0]
    for (l1, p1, c1), (l2, p2, c2) in zip(*(files[w][1] for w in (True, False))):
        assert torch.equal(l1, l2) and torch.equal(p1, p2) and p1.dtype == torch.float16 and c1 == c2


@pytest.mark.parametrize("rows", [None, 12])                             # one file; shards
def test_extraction_concatenates_fp16_batches_never_fp32(tmp_path, monkeypatch, rows):
    """Every batch is cast to fp16 as it comes (the first from encode() included), so the host never holds
    an fp32 copy of a set or a shard: each Features.cat of extracted batches is fp16."""
    if rows:
        shard_rows(monkeypatch, rows)
    cat, dtypes = Features.cat, []

    def watched(parts):
        out = cat(parts)
        dtypes.append((out.tokens.dtype, out.pooled.dtype))
        return out

    monkeypatch.setattr(Features, "cat", staticmethod(watched))
    f = extract(FakeEncoder(), 30, tmp_path)                              # FakeEncoder: fp32, as encode() on a CPU
    assert dtypes and set(dtypes) == {(torch.float16, torch.float16)}, dtypes
    assert torch.equal(f[:].tokens, FakeEncoder().encode(range(30)).tokens.half())
