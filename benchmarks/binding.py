"""The README's binding table (issue 14): methods x text encoder x hard negatives.

    python benchmarks/binding.py --cache-dir .cache                  # pal, linear, pal_rel; seed 0
    python benchmarks/binding.py --methods pal --seeds 0 1 2 --hard-negatives on --texts minilm
    python benchmarks/binding.py --jobs 2                            # two runs at a time

Runs align.py once per (method, text encoder, hard negatives, seed) in a subprocess
(--threads 1, --epochs EPOCHS, the position-aware image encoder, features from the
shared cache), skips a run whose metrics.json already exists (so an interrupted
grid resumes), and prints a markdown table of the medians over seeds: attribute
swap, relation swap (both %, chance 50), retrieval RSum, zero-shot top-1.
Text encoders: "shapes-text" (the tiny masked-word transformer) and MiniLM
(all-MiniLM-L6-v2; --minilm names it: "minilm", or its folder).
"""
import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = [("binding", "binding_attribute_swap", "attribute swap"), ("binding", "binding_relation_swap", "relation swap"),
           ("retrieval", "rsum", "RSum"), ("classification", "cls", "zero-shot top-1"), ("train", "seconds", "train s")]


def run(method, text, minilm, hard, seed, args):
    tag = f"{method}-{text}-{'hn' if hard else 'nohn'}-seed{seed}"
    out = Path(args.out) / tag
    claim = Path(args.out) / f"{tag}.claimed"
    if not (out / "metrics.json").exists():
        if claim.exists():                        # another runner of this grid has it
            print(f"  {tag}: running elsewhere (remove {claim} if it is not)", flush=True)
            return None
        claim.touch()
        cmd = [sys.executable, str(ROOT / "align.py"), "--method", method, "--seed", str(seed), "--out", str(out),
               "--cache-dir", str(args.cache_dir), "--threads", "1", "--no-figures", "--epochs", str(args.epochs),
               "--text-encoder", minilm if text == "minilm" else "shapes-text", *(["--hard-negatives"] if hard else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (Path(args.out) / f"{tag}.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            print(f"  {tag} FAILED:\n{r.stderr[-2000:]}", flush=True)
            claim.unlink()
            return None
    m = json.loads((out / "metrics.json").read_text())
    print(f"  {tag}: " + "  ".join(f"{c} {cell(m, g, k):.1f}" for g, k, c in COLUMNS), flush=True)
    return m


def cell(m, group, key):
    v = m[group][key]
    return v["top1"] if group == "classification" else v


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["pal", "linear", "pal_rel"], help="methods to run")
    p.add_argument("--texts", nargs="+", default=["shapes-text", "minilm"], choices=["shapes-text", "minilm"])
    p.add_argument("--hard-negatives", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (the table shows the median)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs of every run")
    p.add_argument("--minilm", default="minilm", help="the MiniLM --text-encoder value (alias or folder)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses one thread)")
    p.add_argument("--out", default="results/binding", help="where each run's folder goes")
    p.add_argument("--cache-dir", default=".cache", help="shared encoder/feature cache")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    grid = [(m, t, h == "on") for m in args.methods for t in args.texts for h in args.hard_negatives]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = {g: pool.submit(lambda g: [run(*g[:2], args.minilm, g[2], s, args) for s in args.seeds], g) for g in grid}
        runs = {g: [r for r in f.result() if r is not None] for g, f in runs.items()}
    print("\n| method | text | hard negatives | " + " | ".join(c for _, _, c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for (method, text, hard), rs in runs.items():
        if rs:
            med = [statistics.median(cell(r, g, k) for r in rs) for g, k, _ in COLUMNS]
            print(f"| {method} | {text} | {'yes' if hard else 'no'} | " + " | ".join(f"{v:.1f}" for v in med) + " |")
    print(f"\nmedian of seeds {args.seeds}, {args.epochs} epochs, --threads 1")


if __name__ == "__main__":
    main()
