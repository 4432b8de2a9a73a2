"""Every method on the Shapes world, mean ± sd over seeds: the results tables of docs/results.md.

    python benchmarks/results_table.py                 # all methods, seeds 0 1 2, 5 epochs each
    python benchmarks/results_table.py --methods pal linear --seeds 0
    python benchmarks/results_table.py --image-encoder efficientnet-lite2 --text-encoder minilm \
        --out results/table-real --cache-dir .cache                  # every method on real encoders
    python benchmarks/results_table.py --methods pal linear --cpu-defaults --no-variants   # as `python align.py` runs

Runs align.py once per (row, seed) in a subprocess (the encoders and features come from the shared
cache), then prints a markdown table of the means ± sd: retrieval R@1 both ways and RSum, zero-shot
top-1, segmentation mIoU-fg, binding (--binding-groups: also the harder binding groups).

One budget rule for every row: each trained method trains the same --epochs (5 by default) on the same
6,000 pairs, at its own default batch, learning rate and hyperparameters; the CoV-Align trio (cov,
text_guided, filip) at a CPU setting, a 128-d shared space and batch 64 (text_guided's per-pair
aggregation costs B^2 a step). CSA and ASIF are closed form. VARIANTS adds rows for what the rule
changes or the paper ablates: SAIL at its default schedule, CoV under each other reading of its threshold
mask (methods/cov.py, choice 6; mask=none: every patch in every region).
"""
import argparse
import ast
import inspect
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from methods.cov import MASKS, CoV  # noqa: E402  (the mask's readings: a row each)

METHODS = ["pal", "pal_rel", "cov", "text_guided", "filip", "fa", "linear", "linear_rs", "mlp_rs", "sail", "mlp", "t2c", "csa", "asif"]
CLOSED_FORM = {"csa", "asif"}                           # no training loop: no --epochs
CPU_SETTING = {"cov": ["--hp", "dim=128", "--batch-size", "64"],
               "text_guided": ["--hp", "K=128", "--batch-size", "64"],
               "filip": ["--hp", "K=128", "--batch-size", "64"]}
# rows beside the rule's: (row name, method, flags, whether the table's --epochs applies)
VARIANTS = {"sail": [("sail (default, 40 epochs)", "sail", ["--epochs", "40"], False)],   # on a CPU, without
            # --epochs, align.py's FLOP budget would cut its schedule
            "cov": [(f"cov mask={m}", "cov", ["--hp", f"mask={m}"], True)    # the threshold mask's other
                    for m in MASKS if m != inspect.signature(CoV).parameters["mask"].default]}  # readings (choice 6)
COLUMNS = [("retrieval", "i2t_r1", "I2T R@1"), ("retrieval", "t2i_r1", "T2I R@1"), ("retrieval", "rsum", "RSum"),
           ("classification", "cls", "zero-shot top-1"), ("segmentation", "seg", "seg mIoU-fg"),
           ("binding", "binding_acc", "binding"), ("train", "seconds", "train s")]
GROUPS = [(f"binding_{g}", "binding_acc", g) for g in ("canonical", "styles", "templates", "combos")]


def row_folder(out_root, row, seed):
    return Path(out_root) / f"{row.replace(' ', '_').replace('(', '').replace(')', '').replace('=', '-')}-seed{seed}"


def run(row, method, seed, extra, out_root, cache_dir, reuse=False):
    """metrics.json of one (row, seed); a failed run stops the table (no row of fewer seeds is printed)."""
    out = row_folder(out_root, row, seed)
    cmd = [sys.executable, str(ROOT / "align.py"), "--method", method, "--seed", str(seed), "--out", str(out),
           "--cache-dir", str(cache_dir), "--threads", "1", "--no-figures", *extra]
    if reuse and (out / "metrics.json").exists():       # a finished run of an earlier call: its flags checked
        same_flags(out, cmd[2:])
        return json.loads((out / "metrics.json").read_text())
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: {row} seed {seed} failed (rc {r.returncode}); the table is not written:\n{r.stderr[-2000:]}")
    return json.loads((out / "metrics.json").read_text())


def same_flags(out, flags):
    """--reuse: the finished run in out was made with `flags`, else stop (its config.json says what it ran)."""
    sys.path.insert(0, str(ROOT))
    import align  # noqa: PLC0415  (only --reuse needs align's parser)
    want = vars(align.parse_args(flags))
    config = json.loads((out / "config.json").read_text())
    hp = dict(h.split("=", 1) for h in want.pop("hp") or [])
    diff = [k for k, v in want.items() if k in config and k not in ("out", "cache_dir", "epochs", "batch_size",
                                                                     "lr", "weight_decay") and config[k] != v
            and not (k == "device" and v == "auto")]        # the run holds the device auto resolved to
    diff += [k for k in ("epochs", "batch_size", "lr", "weight_decay") if want[k] is not None and config[k] != want[k]]
    diff += [f"hp.{k}" for k, v in hp.items() if config["hp"].get(k) != literal(v)]
    if diff:
        sys.exit(f"error: --reuse: {out} was run with other settings ({', '.join(diff)}); remove it or pass "
                 f"another --out")


def literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text                                     # a bare word, e.g. mask=paper


def cell(m, group, key):
    v = m[group][key]
    return v["top1"] if group == "classification" else v["miou_fg"] if group == "segmentation" else v


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=METHODS, help="methods to run")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (the table shows mean ± sd)")
    p.add_argument("--epochs", type=int, default=5, help="the epochs of every trained method (the budget rule)")
    p.add_argument("--cpu-defaults", action="store_true",
                   help="no --epochs: each method at align.py's CPU default (its own schedule, cut to the CPU FLOP "
                        "budget where over it; train.py's cpu_default), as a user's `python align.py` runs")
    p.add_argument("--no-variants", action="store_true", help="only the rule's rows (no VARIANTS)")
    p.add_argument("--reuse", action="store_true", help="read a row's finished run in --out instead of running it")
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
        plan = [(method, method, [], True)] + ([] if args.no_variants else VARIANTS.get(method, []))
        for row, name, flags, budget in plan:
            epochs = ["--epochs", str(args.epochs)] if budget and name not in CLOSED_FORM and not args.cpu_defaults \
                else []
            extra = encoders + CPU_SETTING.get(name, []) + flags + epochs
            runs = [run(row, name, s, extra, Path(args.out), args.cache_dir, args.reuse) for s in args.seeds]
            runs = [r for r in runs if r is not None]
            if not runs:
                continue
            values = [[cell(r, g, k) for r in runs] for g, k, _ in columns]
            rows.append((row, values))
            print(f"{row:24s} " + "  ".join(f"{mean_sd(v):>12s}" for v in values), flush=True)
    print()
    print(markdown({"columns": [c for _, _, c in columns], "rows": dict(rows)}))
    command = f"python benchmarks/results_table.py {' '.join(sys.argv[1:])}"
    budget = "at align.py's CPU defaults" if args.cpu_defaults else f"{args.epochs} epochs"
    print(f"\nmean ± sd over seeds {args.seeds}; every trained method {budget}; command: {command}")
    table = {"command": command, "seeds": args.seeds, "columns": [c for _, _, c in columns],
             "rows": {row: [[round(x, 4) for x in v] for v in values] for row, values in rows}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "table.json").write_text(json.dumps(table, indent=1))   # what docs/ is checked against


def markdown(table):
    """The markdown table of a table.json ({"columns", "rows": {row: [[per seed] per column]}}), as docs/ holds it."""
    lines = ["| method | " + " | ".join(table["columns"]) + " |", "|---" * (len(table["columns"]) + 1) + "|"]
    lines += [f"| {row} | " + " | ".join(mean_sd(v) for v in values) + " |" for row, values in table["rows"].items()]
    return "\n".join(lines)


def differences(table, base, columns=("RSum", "zero-shot top-1", "seg mIoU-fg", "binding")):
    """Each row against the row `base`, task by task: the mean ± sd of the per-seed differences (the same seed
    on both sides) and that mean in units of its sd, so a task's gain is read against its own seed spread."""
    idx = [table["columns"].index(c) for c in columns]
    lines = ["| against " + base + " | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row, values in table["rows"].items():
        if row == base:
            continue
        cells = []
        for i in idx:
            d = [a - b for a, b in zip(values[i], table["rows"][base][i])]
            sd = statistics.stdev(d) if len(d) > 1 else 0.0
            cells.append(f"{statistics.fmean(d):+.1f} ± {sd:.1f}" + (f" ({statistics.fmean(d) / sd:+.1f} sd)" if sd else ""))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_sd(values):
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


if __name__ == "__main__":
    main()
