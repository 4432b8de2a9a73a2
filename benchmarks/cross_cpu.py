"""The same figures under another CPU's kernels: the default run and the course sheet's exact runs.

Each run goes twice, each time from a fresh cache (world, features; the tiny encoders come from
weights/): once with this machine's own kernels and once with other ones selected by environment
variables (PyTorch's ATen_CPU_CAPABILITY, MKL's MKL_ENABLE_INSTRUCTIONS), the closest one machine
gets to a second CPU. metrics.json must be identical, all but the training time.

    python benchmarks/cross_cpu.py                     # the default run + the three sheet runs
    python benchmarks/cross_cpu.py --skip-default      # the sheet runs only (minutes, not an hour)
    python benchmarks/cross_cpu.py --other avx2        # on an AVX-512 machine: AVX2 as the second CPU

`--other default` (no vector kernels) trains about 30x slower in some ops: the default run alone
takes tens of minutes there. Exit status 1 when any figure differs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHEET = "--eval-images", "50", "--threads", "1", "--no-figures"
RUNS = {  # name -> align.py arguments (exercises/README.md's exact runs, the reference in its paper form)
    "default": ("--threads", "1", "--no-figures"),
    "sheet pal": ("--epochs", "1", "--hp", "fast=False", *SHEET),
    "sheet csa": ("--method", "csa", *SHEET),
    "sheet asif": ("--method", "asif", *SHEET),
}
MKL = {"default": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512"}


def without_time(m):
    """metrics.json without its wall-clock fields."""
    if isinstance(m, dict):
        return {k: without_time(v) for k, v in m.items() if "seconds" not in k}
    return m


def flat(m, prefix=""):
    if isinstance(m, dict):
        return {k2: v2 for k, v in m.items() for k2, v2 in flat(v, f"{prefix}{k}.").items()}
    return {prefix.rstrip("."): m}


def run(name, args, env, folder):
    out = folder / name.replace(" ", "-")
    t0 = time.time()
    r = subprocess.run([sys.executable, "align.py", *args, "--cache-dir", str(folder / "cache"), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: {name} failed:\n{r.stderr[-3000:]}")
    return without_time(json.loads((out / "metrics.json").read_text())), time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", default="default", choices=sorted(MKL),
                    help="the other kernels: ATEN_CPU_CAPABILITY (and the matching MKL_ENABLE_INSTRUCTIONS)")
    ap.add_argument("--skip-default", action="store_true", help="only the course sheet's three runs")
    ap.add_argument("--keep", default=None,
                    help="keep each setting's cache and runs in KEEP/<setting> (else a temporary folder)")
    args = ap.parse_args()
    runs = {k: v for k, v in RUNS.items() if not (args.skip_default and k == "default")}
    base = {k: v for k, v in os.environ.items()
            if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")}
    settings = {"native": base,
                args.other: {**base, "ATEN_CPU_CAPABILITY": args.other, "MKL_ENABLE_INSTRUCTIONS": MKL[args.other]}}
    got = {}
    for setting, env in settings.items():
        with tempfile.TemporaryDirectory() as tmp:                  # a fresh cache per setting
            folder = Path(args.keep) / setting if args.keep else Path(tmp)
            if folder.exists() and any(folder.iterdir()):
                raise SystemExit(f"error: {folder} is not empty: the runs need a fresh cache")
            for name, a in runs.items():
                got[setting, name], sec = run(name, a, env, folder)
                print(f"[{setting:>7}] {name:<10} {sec:6.0f} s  rsum {got[setting, name]['retrieval']['rsum']:.2f}",
                      flush=True)
    differ = 0
    for name in runs:
        a, b = (flat(got[s, name]) for s in settings)
        bad = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        differ += bool(bad)
        print(f"{name:<10} {'identical' if not bad else f'{len(bad)} figures differ'} ({len(a)} figures)")
        for k in bad[:20]:
            print(f"    {k}: native {a.get(k)}  {args.other} {b.get(k)}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
