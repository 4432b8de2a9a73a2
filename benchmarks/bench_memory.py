"""Benchmark: the peak resident memory of the default `python align.py`, cold and warm, as
`/usr/bin/time -v` reports it, and which stage of the run holds it.

    python benchmarks/bench_memory.py                     # cold (a fresh --cache-dir), then warm
    python benchmarks/bench_memory.py --root /tmp/old     # another checkout's align.py (git archive <commit>)

Each run is `/usr/bin/time -v python align.py --threads 1 --cache-dir <tmp> --out <tmp>` (the default
run, its figures on). While it runs, its resident memory (VmRSS) is read every 0.1 s and charged to
the stage the run last printed ([world], [features], [train], ...). Prints, per run: time's
"Maximum resident set size", the stage at the peak, and each stage's peak.
"""
import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb(pid):
    """VmRSS of pid and its descendants, in MB (0 when gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) // 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, AttributeError, ValueError):
            pass
    return total


def measure(root, cache_dir, out, extra=()):
    """(time's max RSS in MB, {stage: peak MB}, stage at the peak, wall seconds) of one run."""
    cmd = ["/usr/bin/time", "-v", sys.executable, str(Path(root) / "align.py"), "--threads", "1",
           "--cache-dir", str(cache_dir), "--out", str(out), *extra]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stage, peaks, err = ["start"], {}, []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()

    def read_stages():
        for line in proc.stdout:
            m = re.match(r"\[(\w+)\]", line)
            if m:
                stage[0] = m.group(1)
    threading.Thread(target=read_stages, daemon=True).start()
    while proc.poll() is None:
        mb = rss_mb(proc.pid)
        peaks[stage[0]] = max(peaks.get(stage[0], 0), mb)
        time.sleep(0.1)
    text = "".join(err)
    if proc.returncode:
        raise SystemExit(f"align.py failed (exit {proc.returncode}):\n{text[-3000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) // 1024
    return peak, peaks, max(peaks, key=peaks.get), time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(ROOT), help="the checkout whose align.py runs (default: this one)")
    p.add_argument("--cold-only", action="store_true", help="skip the warm run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("cold", "a")] + ([] if args.cold_only else [("warm", "b")])
        for name, out in runs:
            peak, peaks, at, wall = measure(args.root, Path(tmp) / "cache", Path(tmp) / out)
            stages = ", ".join(f"{s} {mb}" for s, mb in peaks.items())
            print(f"{name}: maximum resident set size {peak} MB ({peak / 1000:.2f} GB; /usr/bin/time -v), "
                  f"at [{at}]; {wall:.0f} s wall", flush=True)
            print(f"  peak MB by stage: {stages}", flush=True)


if __name__ == "__main__":
    main()
