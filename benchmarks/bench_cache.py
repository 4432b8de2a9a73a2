"""Benchmark: the memory-mapped feature cache at COCO-like scale, on synthetic features.

    python benchmarks/bench_cache.py                     # 20K x 257 x 384 fp16 = 3.9 GB on disk
    python benchmarks/bench_cache.py --n 2000            # a quick look

1. extraction: a synthetic image encoder (random tokens, 16 x 16 grid + CLS) goes
   through cache.extract(), which writes ~256 MB shards to --dir;
2. training reads: the batches align.py's training loop asks for (a random
   permutation, batches of --batch rows, feats[idx].to("cpu")) for --epochs
   epochs; the first epoch starts from a cold page cache for these files
   (posix_fadvise DONTNEED on our own shards only, nothing system-wide).
Prints rows/s per window of steps (min / median / max) and the process's memory:
RssAnon (the heap: batches, pooled vectors; what must stay bounded) and RssFile
(mapped file pages; StoredFeatures unmaps the pages it has read, so it stays flat).
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from features import Features  # noqa: E402
from infra import (
    cache,  # noqa: E402
    shards,  # noqa: E402
)


def memory_mb():
    """{'RssAnon': MB, 'RssFile': MB, 'VmHWM': MB} of this process, from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class SyntheticImageEncoder:
    """Random fp32 tokens (B, 1 + 16*16, D) per batch: the cost of a real encoder is not what is measured."""
    name, layer, preprocess = "synthetic", -1, "none"

    def __init__(self, T, D):
        self.T, self.D = T, D

    def encode(self, items, device="cpu"):
        g = torch.Generator().manual_seed(int(items[0]))
        tokens = torch.randn(len(items), self.T, self.D, generator=g)
        side = int((self.T - 1) ** 0.5)
        return Features(tokens=tokens, mask=torch.ones(len(items), self.T, dtype=torch.bool), pooled=tokens[:, 0],
                        grid=(side, side))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20000, help="rows (images)")
    p.add_argument("--tokens", type=int, default=257, help="tokens per row (CLS + 16 x 16 patches)")
    p.add_argument("--dim", type=int, default=384, help="feature dimension")
    p.add_argument("--batch", type=int, default=256, help="rows per training batch")
    p.add_argument("--epochs", type=int, default=2, help="passes over the cache")
    p.add_argument("--window", type=int, default=10, help="steps per rate measurement")
    p.add_argument("--dir", default="/tmp/bench_cache", help="cache folder (deleted afterwards unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the cache folder")
    args = p.parse_args()
    torch.set_num_threads(1)
    gb = args.n * args.tokens * args.dim * 2 / 2**30
    print(f"[bench] {args.n} x {args.tokens} x {args.dim} fp16 = {gb:.2f} GB of tokens; memory at start {memory_mb()}")

    import shutil
    shutil.rmtree(args.dir, ignore_errors=True)  # measure a fresh extraction
    t0 = time.time()
    enc = SyntheticImageEncoder(args.tokens, args.dim)
    shards.MEMMAP_BYTES = 0  # always the memory-mapped layout, whatever --n
    feats = cache.extract(enc, list(range(args.n)), args.dir, batch_size=args.batch, dataset="bench",
                             split="train", modality="image")   # prints one line per shard
    dt = time.time() - t0
    assert isinstance(feats, shards.StoredFeatures)
    print(f"[bench] extraction (incl. random generation): {dt:.1f}s, {args.n / dt:.0f} rows/s, "
          f"{gb * 1024 / dt:.0f} MB/s written; {len(feats.tokens_files)} shards; memory {memory_mb()}")

    for f in Path(args.dir).rglob("*.tokens.npy"):  # cold start: drop OUR files from the page cache
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    steps = len(feats) // args.batch
    args.window = max(1, min(args.window, steps // 4))
    for epoch in range(args.epochs):
        order = torch.randperm(len(feats), generator=torch.Generator().manual_seed(epoch))
        rates, mems, t_win, t_epoch = [], [], time.time(), time.time()
        for step in range(steps):
            batch = feats[order[step * args.batch:(step + 1) * args.batch]].to("cpu")  # what train.train does
            batch.tokens.mean()                                                          # touch every value
            if (step + 1) % args.window == 0:
                rates.append(args.window * args.batch / (time.time() - t_win))
                mems.append(memory_mb())
                t_win = time.time()
        mb_s = steps * args.batch * args.tokens * args.dim * 2 / 2**20 / (time.time() - t_epoch)
        anon = [m["RssAnon"] for m in mems]
        print(f"[bench] epoch {epoch + 1} ({'cold' if epoch == 0 else 'warm'} page cache): {steps} steps; rows/s per "
              f"{args.window}-step window min {min(rates):.0f} / median {statistics.median(rates):.0f} "
              f"/ max {max(rates):.0f} "
              f"({mb_s:.0f} MB/s); RssAnon {min(anon):.0f}-{max(anon):.0f} MB, RssFile up to "
              f"{max(m['RssFile'] for m in mems):.0f} MB, peak RSS {mems[-1]['VmHWM']:.0f} MB")
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
