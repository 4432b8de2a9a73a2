"""Every method on the Shapes world, the median of 3 seeds: the results table of docs/results.md.

    python benchmarks/results_table.py                 # all methods, seeds 0 1 2 (about 40 min on 2 CPU cores)
    python benchmarks/results_table.py --methods pal linear --seeds 0
    python benchmarks/results_table.py --image-encoder efficientnet-lite2 --text-encoder minilm --seeds 0 \
        --out results/table-real --cache-dir .cache                  # every method on real encoders

Runs align.py once per (method, seed) in a subprocess (the encoders and features
come from the shared cache), then prints a markdown table of the medians:
retrieval R@1 both ways and RSum, zero-shot top-1, segmentation mIoU-fg, binding
(--binding-groups: also the harder binding groups, canonical / styles / templates / combos).
Per-method extra flags (EXTRA) are the ones docs/results.md states next to the table.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["pal", "pal_rel", "cov", "text_guided", "filip", "fa", "linear", "linear_rs", "mlp_rs", "sail", "mlp", "t2c", "csa", "asif"]
# the global heads default to their papers' long schedules (MLP: 500 epochs at batch 512 on 80K pairs);
# on 6K Shapes pairs we give every trained method the same budget of 20 epochs
EXTRA = {m: ["--epochs", "20"] for m in ["linear_rs", "mlp_rs", "sail", "mlp", "t2c"]}
# the token-level region/word methods: a 128-d shared space, batch 64, 5 epochs (the paper's 512-d, batch 128,
# 30 epochs is hours on a CPU for text_guided, whose per-pair aggregation costs B^2 per step)
EXTRA.update({"cov": ["--hp", "dim=128", "--batch-size", "64", "--epochs", "5"],
              "text_guided": ["--hp", "K=128", "--batch-size", "64", "--epochs", "5"],
              "filip": ["--hp", "K=128", "--batch-size", "64", "--epochs", "5"]})
COLUMNS = [("retrieval", "i2t_r1", "I2T R@1"), ("retrieval", "t2i_r1", "T2I R@1"), ("retrieval", "rsum", "RSum"),
           ("classification", "cls", "zero-shot top-1"), ("segmentation", "seg", "seg mIoU-fg"),
           ("binding", "binding_acc", "binding"), ("train", "seconds", "train s")]
GROUPS = [(f"binding_{g}", "binding_acc", g) for g in ("canonical", "styles", "templates", "combos")]


def run(method, seed, extra, out_root, cache_dir):
    out = out_root / f"{method}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "align.py"), "--method", method, "--seed", str(seed), "--out", str(out),
           "--cache-dir", str(cache_dir), "--threads", "1", "--no-figures", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  {method} seed {seed} FAILED:\n{r.stderr[-2000:]}")
        return None
    return json.loads((out / "metrics.json").read_text())


def cell(m, group, key):
    v = m[group][key]
    return v["top1"] if group == "classification" else v["miou_fg"] if group == "segmentation" else v


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=METHODS, help="methods to run")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (the table shows the median)")
    p.add_argument("--out", default="results/table", help="where each run's folder goes")
    p.add_argument("--cache-dir", default=".cache", help="shared encoder/feature cache")
    p.add_argument("--image-encoder", default="shapes-cnn", help="align.py --image-encoder of every run")
    p.add_argument("--text-encoder", default="shapes-text", help="align.py --text-encoder of every run")
    p.add_argument("--binding-groups", action="store_true", help="also a column per harder binding group")
    args = p.parse_args()
    columns = COLUMNS[:-1] + GROUPS + COLUMNS[-1:] if args.binding_groups else COLUMNS
    encoders = ["--image-encoder", args.image_encoder, "--text-encoder", args.text_encoder]
    rows = []
    for method in args.methods:
        runs = [run(method, s, encoders + EXTRA.get(method, []), Path(args.out), args.cache_dir) for s in args.seeds]
        runs = [r for r in runs if r is not None]
        if not runs:
            continue
        med = [statistics.median(cell(r, g, k) for r in runs) for g, k, _ in columns]
        rows.append((method, med))
        print(f"{method:12s} " + "  ".join(f"{v:7.1f}" for v in med), flush=True)
    print("\n| method | " + " | ".join(c for _, _, c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for method, med in rows:
        print(f"| {method} | " + " | ".join(f"{v:.1f}" for v in med) + " |")
    print(f"\nmedian of seeds {args.seeds}; command: python benchmarks/results_table.py")


if __name__ == "__main__":
    main()
