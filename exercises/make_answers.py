"""Run the sheet's experiments and write every figure of the answers from their results.

    python exercises/make_answers.py                 # run every experiment, then write the answers
    python exercises/make_answers.py --jobs 2        # two runs at a time (CPU times are per run either way)
    python exercises/make_answers.py --only e2-p1    # rerun these runs alone, keep the others' figures
    python exercises/make_answers.py --render        # no runs: rewrite the answers from the recorded figures

Each run in RUNS is the sheet's command (exercises/README.md) plus `--threads 1 --cache-dir
CACHE --out results/answers/<name>` (its folder is emptied first: a rerun of changed code
is refused in a folder that holds another code's run). From each run's metrics.json the
figures the answers quote go into exercises/answers_figures.json, with the run's CPU time
(the process's user + system time, the budget a student's laptop needs), and then:
  exercises/answers.md     = exercises/answers_template.md with every {{run.figure}} filled in;
  docs/results.md, README.md   the "pal" and "asif" rows of their results tables, which are
                           these runs' figures too (E1's CAP run, E2's default run).
tests/test_sheet_figures.py checks that both agree with answers_figures.json, and (slow) that
a rerun of one run gives the recorded figures. None of these files is in a student copy.
Measured: 17 runs, 462 s of CPU in all (one core each), 20 min wall at --jobs 1 on a 2-core
VM shared with other jobs; the first run on a fresh --cache-dir also extracts the tiny
encoders' features.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # the project: infra.errors
from infra.errors import RunError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "exercises" / "answers_template.md"
ANSWERS = ROOT / "exercises" / "answers.md"
FIGURES = ROOT / "exercises" / "answers_figures.json"
RESULTS_DOC = ROOT / "docs" / "results.md"
README = ROOT / "README.md"

# name -> the sheet's command (what follows `python align.py`); E1's three runs share one schedule (--epochs 15,
# PAL's CPU default), E3 gives every eps (its default is not part of the question)
RUNS = {
    "e1-global": "--method pal --hp pooling=global --epochs 15",
    "e1-mean": "--method pal --hp pooling=mean --epochs 15",
    "e1-cap": "--method pal --epochs 15",
    "e2-default": "--method asif",
    "e2-p1": "--method asif --hp p=1",
    "e2-k50": "--method asif --hp k=50",
    "e3-eps0.0": "--method cov --hp dim=128 --hp mask=scores_renorm --batch-size 64 --epochs 5 --hp eps=0",
    "e3-eps0.7": "--method cov --hp dim=128 --hp mask=scores_renorm --batch-size 64 --epochs 5 --hp eps=0.7",
    "e3-eps0.9": "--method cov --hp dim=128 --hp mask=scores_renorm --batch-size 64 --epochs 5 --hp eps=0.9",
    "e4-weights": "--method mlp --align-data weights --epochs 200",
    "e4-pairs25": "--method mlp --num-pairs 25 --epochs 200",
    "e4-pairs100": "--method mlp --num-pairs 100 --epochs 200",
    "e4-weights+pairs25": "--method mlp --align-data weights+pairs --num-pairs 25 --epochs 200",
    "e5-linear": "--method linear",
    "e5-pal-minilm": "--method pal --text-encoder minilm",
    "e5-linear-minilm": "--method linear --text-encoder minilm",
    "e5-pal_rel": "--method pal_rel --epochs 5",
}
E6 = ("import torch, evaluate; print(evaluate.retrieval_metrics(torch.zeros(500, 2500), "
      "torch.arange(500).repeat_interleave(5)))")
# the rows of the results tables (docs/results.md, README.md) that are these runs: first cell -> run; a row's
# six figures (I2T R@1, T2I R@1, RSum, top-1, mIoU-fg, binding) are set, its further cells (the papers') kept
DOC_ROWS = {RESULTS_DOC: {"pal (seed 0)": "e1-cap", "asif": "e2-default"},
            README: {"pal": "e1-cap", "asif": "e2-default"}}


def figures_of(metrics):
    """metrics.json -> the figures the answers quote, flat (percent as printed, analyses as they are)."""
    r, m = metrics["retrieval"], metrics
    out = {"i2t_r1": r["i2t_r1"], "t2i_r1": r["t2i_r1"], "rsum": r["rsum"],
           "top1": m["classification"]["cls"]["top1"], "miou_fg": m["segmentation"]["seg"]["miou_fg"]}
    if "binding" in m:
        out.update(binding=m["binding"]["binding_acc"], attribute_swap=m["binding"]["binding_attribute_swap"],
                   relation_swap=m["binding"]["binding_relation_swap"])
    out.update({k: v for k, v in m.get("analysis", {}).items() if isinstance(v, (int, float))})
    return out


def run_one(name, cache_dir):
    """One align.py run -> (name, its figures and CPU seconds)."""
    out = ROOT / "results" / "answers" / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "align.py", *shlex.split(RUNS[name]), "--threads", "1", "--cache-dir", str(cache_dir),
           "--out", str(out)]
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    log = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RunError(f"{name} ({shlex.join(cmd)}) failed:\n{log[-3000:]}")
    figs = figures_of(json.loads((out / "metrics.json").read_text()))
    figs["cpu_s"] = round(usage.ru_utime + usage.ru_stime)
    print(f"[{name}] {time.time() - t0:.0f} s wall, {figs['cpu_s']} s CPU: rsum {figs['rsum']:.2f}", flush=True)
    return name, figs


def e6_figures():
    out = subprocess.run([sys.executable, "-c", E6], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    d = json.loads(out.strip().replace("'", '"'))
    return {k: d[k] for k in ("i2t_r1", "t2i_r1", "rsum", "i2t_map")}


def machine():
    """What the runs ran on, in words the answers print."""
    import platform

    import torch
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    return {"cpu": f"{cpu}, {os.cpu_count()} cores", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


# ----------------------------------------------------------------------------- writing the figures

PLACE = re.compile(r"\{\{([\w.+-]+?)\.([\w+-]+)(?::([^}]*))?\}\}")


def derived(f):
    """Figures the prose states that are computed from the runs' (orders, differences)."""
    def order(names, labels, key):
        ranked = sorted(zip(names, labels), key=lambda p: f[p[0]][key])
        return " < ".join(lab for _, lab in ranked)
    d = {"e1_rsum_order": order(["e1-global", "e1-mean", "e1-cap"], ["global", "mean", "CAP"], "rsum"),
         "e1_seg_order": order(["e1-global", "e1-mean", "e1-cap"], ["global", "mean", "CAP"], "miou_fg"),
         "e2_rsum_order": order(["e2-p1", "e2-default", "e2-k50"], ["p = 1", "the default", "k = 50"], "rsum"),
         "e2_top1_order": order(["e2-p1", "e2-default", "e2-k50"], ["p = 1", "the default", "k = 50"], "top1"),
         "e2_seg_order": order(["e2-p1", "e2-default", "e2-k50"], ["p = 1", "the default", "k = 50"], "miou_fg"),
         "e3_rsum_order": order(["e3-eps0.0", "e3-eps0.7", "e3-eps0.9"], ["eps 0", "eps 0.7", "eps 0.9"], "rsum"),
         "e3_seg_order": order(["e3-eps0.0", "e3-eps0.7", "e3-eps0.9"], ["eps 0", "eps 0.7", "eps 0.9"],
                               "miou_fg")}
    for a, b in (("e5-pal-minilm", "e1-cap"), ("e5-linear-minilm", "e5-linear"), ("e4-weights+pairs25", "e4-pairs25"),
                 ("e1-cap", "e1-mean"), ("e1-mean", "e1-global")):
        for k in ("rsum", "top1", "miou_fg"):
            d[f"{a}-minus-{b}_{k}"] = f[a][k] - f[b][k]
    for k in ("top1", "miou_fg", "rsum"):                       # E4: what the 24 head rows are worth in pairs
        w, p25, p100 = f["e4-weights"][k], f["e4-pairs25"][k], f["e4-pairs100"][k]
        d[f"e4_{k}_worth"] = ("fewer than 25 pairs" if w < min(p25, p100) else "more than 100 pairs"
                              if w > max(p25, p100) else "between 25 and 100 pairs")
    return d


def render(template, figures):
    """The template with every {{run.figure}} or {{run.figure:format}} replaced (format default .1f; d.* are
    derived figures)."""
    values = dict(figures, d=derived(figures))

    def fill(m):
        run, key, fmt = m[1], m[2], m[3]
        if run not in values or key not in values[run]:
            raise KeyError(f"{m[0]}: no figure {key!r} of {run!r} (the runs: {sorted(values)})")
        v = values[run][key]
        if isinstance(v, str):
            return v
        return format(v, fmt if fmt is not None else ".1f")
    text = PLACE.sub(fill, template)
    if "{{" in text:
        raise KeyError(f"a placeholder of another form: {text[text.index('{{'):][:60]}")
    return text


def results_rows(text, figures, rows):
    """A doc's text with its rows {first cell: run} of a results table set from the figures."""
    for label, run in rows.items():
        f = figures[run]
        cells = (f"{f['i2t_r1']:.1f} | {f['t2i_r1']:.1f} | {f['rsum']:.1f} | {f['top1']:.1f} | {f['miou_fg']:.1f} | "
                 f"{f['binding']:.1f} |")
        text, n = re.subn(rf"^(\| {re.escape(label)} \| )(?:[^|\n]*\|){{6}}", lambda m, cells=cells: m[1] + cells,
                          text, count=1, flags=re.M)
        if n != 1:
            raise RunError(f"no row '| {label} |' with six figures in a results table")
    return text


def write_all(figures):
    ANSWERS.write_text(render(TEMPLATE.read_text(), figures))
    for doc, rows in DOC_ROWS.items():
        doc.write_text(results_rows(doc.read_text(), figures, rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache"), help="align.py's --cache-dir (shared by the runs)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses one thread)")
    p.add_argument("--only", nargs="+", default=None, choices=sorted(RUNS), metavar="RUN",
                   help=f"rerun only these, keep the other recorded figures (runs: {', '.join(RUNS)})")
    p.add_argument("--render", action="store_true", help="run nothing: write the answers from the recorded figures")
    args = p.parse_args(argv)
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    if not args.render:
        names = args.only or list(RUNS)
        t0 = time.time()
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            figures.update(pool.map(lambda n: run_one(n, args.cache_dir), names))
        if args.only is None:
            figures["e6"] = e6_figures()
        figures["machine"] = machine()
        figures = {k: figures[k] for k in [*RUNS, "e6", "machine"] if k in figures}
        FIGURES.write_text(json.dumps(figures, indent=1, sort_keys=False) + "\n")
        print(f"{len(names)} runs in {time.time() - t0:.0f} s wall; figures in {FIGURES.relative_to(ROOT)}")
    write_all(figures)
    print(f"wrote {ANSWERS.relative_to(ROOT)} and the rows of PAL and ASIF in docs/results.md and README.md")


if __name__ == "__main__":
    main()
