"""CPU extraction of EfficientNet-Lite2 at several batch sizes and thread counts: which the CPU default takes.

    python benchmarks/bench_cpu_extract.py                 # 48 synthetic 640x480 JPEGs, batches 8-256, 1-2 threads
    python benchmarks/bench_cpu_extract.py --images 16 --batches 8 16 --threads 1   # seconds

Each configuration runs in its own process (a fresh heap: what one batch size leaves in the allocator does
not help the next): decode + resize + forward alone (the bound), then cache.extract over the same files
(the pipeline: decode a batch ahead in a thread, forward, fp16, the batch written). Images/s, the
process's minor page faults and peak resident memory. --keep-freed also runs each with glibc's
MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ raised (freed memory kept for the next batch), to
separate the allocator's page faults from the forward.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KEEP = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(2**30)}


def one(images, batch, threads, work):
    """In this process: (forward-alone images/s, pipeline images/s, minor faults, peak MB)."""
    import torch

    import cnn_encoders
    import data
    from infra import cache
    torch.set_num_threads(threads)
    enc = cnn_encoders.load_efficientnet_lite("efficientnet-lite2")
    enc.fingerprint = "bench"
    paths = sorted(str(p) for p in Path(images).glob("*.jpg"))
    imgs = data.LazyImages(paths)
    enc.encode_prepared(enc.prepare(imgs[:2], "cpu"), "cpu")                     # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(imgs), batch):
        enc.encode_prepared(enc.prepare(imgs[i:i + batch], "cpu"), "cpu")
    alone = len(imgs) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    cache.extract(enc, imgs, work, batch_size=batch, dataset="bench", split="x", modality="image")
    pipe = len(imgs) / (time.perf_counter() - t0)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return alone, pipe, ru.ru_minflt, ru.ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--keep-freed", action="store_true", help="also each with glibc's freed memory kept")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        images, batch, threads, work = args.child
        print(json.dumps(one(images, int(batch), int(threads), work)))
        return
    from bench_pipeline import jpegs
    work = Path(tempfile.mkdtemp(prefix="bench_cpu_extract_"))
    jpegs(work / "jpegs", args.images)
    print(f"[bench] EfficientNet-Lite2 on the CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}), "
          f"{args.images} synthetic 640x480 JPEGs; each configuration in its own process")
    print("    batch threads allocator    forward alone img/s   pipeline img/s   ratio   minor faults   peak MB")
    rows = []
    for keep in ([False, True] if args.keep_freed else [False]):
        for threads in args.threads:
            for batch in args.batches:
                env = dict(os.environ, **(KEEP if keep else {}))
                r = subprocess.run([sys.executable, __file__, "--child", str(work / "jpegs"), str(batch), str(threads),
                                    str(work / f"c{batch}-{threads}-{keep}")], env=env, capture_output=True, text=True)
                alone, pipe, faults, peak = json.loads(r.stdout.strip().splitlines()[-1])
                rows.append((pipe, batch, threads, keep))
                print(f"    {batch:5d} {threads:7d} {'kept' if keep else 'default':10s} {alone:18.2f} {pipe:16.2f} "
                      f"{pipe / alone:7.2f} {faults:14,d} {peak:9.0f}")
    best = max(rows)
    print(f"    best pipeline: batch {best[1]}, {best[2]} thread(s), allocator {'kept' if best[3] else 'default'}: "
          f"{best[0]:.2f} images/s")


if __name__ == "__main__":
    main()
