"""What data.file_scan's image-header check costs: one stat per file alone, then one stat and one header
(PIL.Image.open: format and size, no pixel decoded) per file, on synthetic 640x480 JPEGs.

    python benchmarks/bench_file_scan.py                    # 2,000 JPEGs, best of 3
    python benchmarks/bench_file_scan.py --images 200 --repeat 1

The files were just written, so they are in the page cache: a first run on a cold disk also waits for
the disk (one small read per file, from the start of the file).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rng = np.random.default_rng(0)
        base = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
        paths = []
        for i in range(args.images):
            path = Path(folder) / f"{i:05d}.jpg"
            Image.fromarray(np.roll(base, i, axis=1)).save(path, quality=90)
            paths.append(path)
        for images, what in ((False, "stat only"), (True, "stat + header")):
            best = min(timed(paths, images) for _ in range(args.repeat))
            print(f"{what:14s} {args.images / best:10,.0f} images/s  ({best * 1e3:.0f} ms for {args.images})")


def timed(paths, images):
    t0 = time.perf_counter()
    _, faults = data.file_scan(paths, images=images)
    assert not faults, faults
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
