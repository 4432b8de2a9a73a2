"""Weight recycling, the shape of the paper's Figure 4: the gain from adding the
classifier-head rows to the alignment data as the number of image-text pairs grows.

    python benchmarks/sweep_recycling.py                       # MLP aligner, about 5 min on 2 CPU cores
    python benchmarks/sweep_recycling.py --method linear --pairs 0 100 1000

For each pair count n it runs align.py twice, with --align-data pairs (n pairs)
and weights+pairs (the same n pairs plus the 24 head rows with their class
names), and prints zero-shot top-1 and retrieval R@1 for both and the gain.
n = 0 is alignment from the head weights alone (no image-text pair at all).
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(method, align_data, n, epochs, out_root, cache_dir):
    out = out_root / f"{method}-{align_data}-{n}"
    cmd = [sys.executable, str(ROOT / "align.py"), "--method", method, "--align-data", align_data,
           "--num-pairs", str(n), "--out", str(out), "--cache-dir", str(cache_dir), "--threads", "1",
           "--no-figures", "--epochs", str(epochs)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"align.py failed for {align_data} n={n}:\n{r.stderr[-2000:]}")
    m = json.loads((out / "metrics.json").read_text())
    return m["classification"]["cls"]["top1"], m["retrieval"]["i2t_r1"], m["retrieval"]["t2i_r1"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="mlp", help="an aligner that trains on global vectors")
    p.add_argument("--pairs", nargs="+", type=int, default=[0, 25, 100, 300, 1000, 6000], help="pair counts")
    p.add_argument("--epochs", type=int, default=200, help="epochs per run (tiny sets: one step an epoch)")
    p.add_argument("--out", default="results/sweep_recycling", help="where each run's folder goes")
    p.add_argument("--cache-dir", default=".cache", help="shared encoder/feature cache")
    args = p.parse_args()
    print(f"{'pairs':>6} | {'top-1 pairs':>11} {'+weights':>9} {'gain':>6} | {'I2T R@1 pairs':>13} {'+weights':>9} "
          f"{'gain':>6} | {'T2I R@1 pairs':>13} {'+weights':>9} {'gain':>6}")
    for n in args.pairs:
        aug = run(args.method, "weights+pairs", n, args.epochs, Path(args.out), args.cache_dir)
        base = run(args.method, "pairs", n, args.epochs, Path(args.out), args.cache_dir) if n > 0 else (None,) * 3
        cells = []
        for b, a in zip(base, aug):
            cells.append(f"{'-' if b is None else f'{b:.1f}':>13} {a:9.1f} {'-' if b is None else f'{a - b:+.1f}':>6}")
        print(f"{n:6d} | " + " | ".join(cells), flush=True)
    print("chance: top-1 4.2 (24 classes), R@1 0.2 (500 images)")


if __name__ == "__main__":
    main()
