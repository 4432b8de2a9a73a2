"""The papers' ablations on the Shapes world: PAL (Table 5 pooling, Fig. 4 K sweep,
Table 7 tau_p sweep) and CoV-Align (its ablation table, eps and N_q sweeps).

    python benchmarks/ablations.py pal        # about 15 min on 2 CPU cores
    python benchmarks/ablations.py cov        # about 15 min
    python benchmarks/ablations.py pal --jobs 2   # two runs at a time (one thread each)

Each variant is one align.py run (seed 0) with the flags shown; the table gives
retrieval R@1 both ways, RSum, zero-shot top-1 and segmentation mIoU-fg.
"""
import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COV = ["--hp", "dim=128", "--batch-size", "64", "--epochs", "5"]  # as benchmarks/results_table.py (CPU budget)
VARIANTS = {
    "pal": [("CAP (default)", []),
            ("global token only", ["--hp", "pooling=global"]),
            ("mean over tokens", ["--hp", "pooling=mean"]),
            ("K=64", ["--hp", "K=64"]), ("K=128", ["--hp", "K=128"]), ("K=256", ["--hp", "K=256"]),
            ("tau_p=0.01", ["--hp", "tau_p=0.01"]), ("tau_p=0.1", ["--hp", "tau_p=0.1"]),
            ("tau_p=0.3", ["--hp", "tau_p=0.3"])],
    "cov": [("full", COV),
            ("- deformable", COV + ["--hp", "deformable=False"]),
            ("- L_v2v", COV + ["--hp", "use_v2v=False"]),
            ("- L_conc", COV + ["--hp", "use_conc=False"]),
            ("eps=0.7", COV + ["--hp", "eps=0.7"]), ("eps=0.9", COV + ["--hp", "eps=0.9"]),
            ("N_q=4", COV + ["--hp", "n_regions=4"]), ("N_q=16", COV + ["--hp", "n_regions=16"])],
}


def run(method, name, flags, out_root, cache_dir):
    out = out_root / f"{method}-{name.replace(' ', '_').replace('=', '')}"
    cmd = [sys.executable, str(ROOT / "align.py"), "--method", method, "--out", str(out), "--cache-dir",
           str(cache_dir), "--threads", "1", "--no-figures", *flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return name, flags, None, r.stderr[-1500:]
    return name, flags, json.loads((out / "metrics.json").read_text()), ""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", choices=sorted(VARIANTS), help="whose ablations to run")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--out", default="results/ablations", help="where each run's folder goes")
    p.add_argument("--cache-dir", default=".cache", help="shared encoder/feature cache")
    args = p.parse_args()
    with ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda v: run(args.method, *v, Path(args.out), args.cache_dir), VARIANTS[args.method]))
    print(f"| {args.method} variant | flags | I2T R@1 | T2I R@1 | RSum | zero-shot top-1 | seg mIoU-fg |")
    print("|---|---|---|---|---|---|---|")
    for name, flags, m, err in done:
        if m is None:
            print(f"| {name} | `{' '.join(flags)}` | failed: {err.splitlines()[-1] if err else '?'} |||||")
            continue
        r = m["retrieval"]
        print(f"| {name} | `{' '.join(flags)}` | {r['i2t_r1']:.1f} | {r['t2i_r1']:.1f} | {r['rsum']:.1f} | "
              f"{m['classification']['cls']['top1']:.1f} | {m['segmentation']['seg']['miou_fg']:.1f} |")


if __name__ == "__main__":
    main()
