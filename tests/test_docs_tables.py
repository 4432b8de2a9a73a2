"""Every table docs/ shows from a benchmark is the script's own output: docs/tables/<name>.json is the table.json
benchmarks/results_table.py (or benchmarks/cov_mask.py) wrote beside its runs (per-seed figures and the command),
or the figures of one align.py run (run-*.json), and docs/results.md holds what the script renders from it, row for
row. The slow tier reruns each table's command at a size that finishes (RERUN: the seeds it reruns, as
docs/results.md states beside the table) and compares the figures with the JSON within TOLERANCE: a stale JSON
fails."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cov_mask  # noqa: E402
import csa_ridges  # noqa: E402
import results_table  # noqa: E402

ALL = sorted((ROOT / "docs" / "tables").glob("*.json"))
TABLES = [p for p in ALL if json.loads(p.read_text())["command"].startswith("python benchmarks/results_table.py")]
MASK_TABLES = [p for p in ALL if json.loads(p.read_text())["command"].startswith("python benchmarks/cov_mask.py")]
RIDGE_TABLES = [p for p in ALL if json.loads(p.read_text())["command"].startswith("python benchmarks/csa_ridges.py")]


@pytest.mark.parametrize("path", TABLES, ids=[p.stem for p in TABLES])
def test_docs_hold_the_table_the_script_measured(path):
    table = json.loads(path.read_text())
    doc = (ROOT / "docs" / "results.md").read_text()
    assert table["command"] in doc, f"docs/results.md does not give the command of {path.name}: {table['command']}"
    for line in results_table.markdown(table).splitlines():
        assert line in doc, f"docs/results.md lacks the row of {path.name} the script renders:\n{line}"
    base = next(iter(table["rows"]))
    for line in results_table.differences(table, base).splitlines()[2:]:
        assert line in doc, f"docs/results.md lacks the per-task difference row of {path.name}:\n{line}"


def test_the_markdown_is_the_mean_and_sd_of_the_seeds():
    table = {"columns": ["RSum", "zero-shot top-1", "seg mIoU-fg", "binding"],
             "rows": {"a": [[1.0, 3.0], [2.0, 2.0], [5.0, 7.0], [0.0, 0.0]], "b": [[2.0, 6.0], [2.0, 2.0], [5.0, 7.0],
                                                                             [0.0, 0.0]]}}
    assert results_table.markdown(table).splitlines()[2] == "| a | 2.0 ± 1.4 | 2.0 ± 0.0 | 6.0 ± 1.4 | 0.0 ± 0.0 |"
    assert results_table.differences(table, "a").splitlines()[2].startswith("| b | +2.0 ± 1.4 (+1.4 sd) | +0.0 ± 0.0 |")


RUNS = sorted((ROOT / "docs" / "tables").glob("run-*.json"))


def run_row(run, name):
    """The Shapes table's row of one align.py run (its metrics.json's figures kept in docs/tables/run-*.json)."""
    r = run["retrieval"]
    cells = [r["i2t_r1"], r["t2i_r1"], r["rsum"], run["top1"], run["miou_fg"], run["binding"]]
    return f"| {name} | " + " | ".join(f"{x:.1f}" for x in cells) + " |"


@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_the_shapes_rows_of_a_chosen_setting_are_the_run_s(path):
    """The csa and sail rows of docs/results.md and README.md are their runs' metrics, with the command."""
    run = json.loads(path.read_text())
    doc, readme = (ROOT / "docs" / "results.md").read_text(), (ROOT / "README.md").read_text()
    assert run_row(run, run["row"]) in doc, f"docs/results.md lacks {run_row(run, run['row'])}"
    assert run_row(run, run["row"].split(" (")[0]) in readme.replace(" | 25.1 / 19.2 |", " |").replace(
        " | 38.6 / 29.2 |", " |"), f"README.md lacks {run_row(run, run['row'].split(' (')[0])}"
    assert run["command"].split(" --threads")[0] in doc.replace("\n", " ")


@pytest.mark.parametrize("path", MASK_TABLES, ids=[p.stem for p in MASK_TABLES])
def test_docs_hold_the_cov_mask_table_the_script_measured(path):
    """The validation table of CoV's mask readings, as benchmarks/cov_mask.py renders it, and its command."""
    table = json.loads(path.read_text())
    doc = (ROOT / "docs" / "results.md").read_text()
    assert table["command"] in doc, f"docs/results.md does not give the command of {path.name}: {table['command']}"
    assert cov_mask.choose(table["table"]) == table["chosen"], "the recorded choice is not the rule's"
    for line in cov_mask.tables(table["table"], table["chosen"]).splitlines():
        assert line in doc, f"docs/results.md lacks the row of {path.name} the script renders:\n{line}"


@pytest.mark.parametrize("path", RIDGE_TABLES, ids=[p.stem for p in RIDGE_TABLES])
def test_docs_hold_the_csa_ridge_table_the_script_measured(path):
    """CSA's held-out ridge scores beside each ridge's test figures, as benchmarks/csa_ridges.py prints them."""
    table = json.loads(path.read_text())
    doc = (ROOT / "docs" / "results.md").read_text()
    assert table["command"] in doc.replace("\n", " "), f"docs/results.md does not give {path.name}'s command"
    assert max(table["rows"], key=lambda r: r[3])[0] == table["chosen"], "the chosen ridge is not the best score"
    for line in csa_ridges.lines(table):
        assert line in doc, f"docs/results.md lacks the row of {path.name} the script prints:\n{line}"


# ----------------------------------------------------------------------------- the slow tier: each command rerun

# the seeds the slow tier reruns of each table (the table's own epochs and settings): seed 0 where a table's three
# seeds take over ten minutes of one core; docs/results.md says so beside the table
RERUN = {"cov-readings": [0], "cov-mask-validation": [0], "linear-5-epochs": [0, 1, 2], "csa-ridges-tiny": [0],
         "pal-linear-cpu-defaults": [0], "real-encoders": [0], "csa-ridges-lite2": [0],
         "pal-linear-cpu-defaults-lite2": [0], "real-encoders-sail": [0]}
# the rows rerun where not every row is (--methods, no variants): the EfficientNet-Lite2 tables share one encoding
# of the world's 8,780 images (encode_in_two_processes), then the rows that take minutes, not an hour. The
# encoding runs at the tables' --threads 1: Lite2's features at 2 threads differ by float rounding (1.8e-5), and
# 5 epochs of CoV magnify that to 4 RSum (a rerun on such features fails on CoV's row; linear's holds)
ROWS = {"real-encoders": ["cov", "linear"], "real-encoders-sail": ["sail"]}
# the reruns started in the background as soon as the Lite2 world is encoded, and compared last: SAIL's 5-epoch
# row takes 14 minutes of one core (its per-epoch validation embeds 1,000 images' 81 patches through a 35M-weight
# head), and every other rerun runs at one thread, so the second core runs it meanwhile (its 40-epoch row, 92
# minutes, is not rerun: docs/results.md says so beside the table)
IN_BACKGROUND = {"real-encoders-sail"}
STARTED = {}      # table stem -> (the rerun's process, its --out folder, its log file)
# |rerun - JSON| allowed on every figure (percent, or RSum points), wall times excepted. A rerun on the machine
# and thread count that measured a table repeats it to the last digit; another CPU's kernels moved one binding
# decision of the default run (binding_templates 52.22 / 52.11, docs/benchmarks.md), and cov-mask-validation
# holds its fits' printed 4 significant digits: 0.5 covers both, and a stale JSON (a table of other code or
# weights) is off by points.
TOLERANCE = 0.5


# glibc keeps freed memory for the next batch instead of returning it: 10x fewer page faults and about 1.8x the
# images/s of a CPU encoding on a busy machine (benchmarks/bench_cpu_extract.py --keep-freed); the features are the same
KEEP_FREED = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(2**30)}


ENCODED = set()   # the cache folders encode_in_two_processes has filled this session


def encode_in_two_processes(cache_dir):
    """The EfficientNet-Lite2 + MiniLM features of the Shapes world into cache_dir, two processes at once at the
    tables' one thread each (bit for bit what their runs would encode): the training set in one, every other set
    in the other. The tables' runs then find them cached. Once a session: later tables skip it."""
    if str(cache_dir) in ENCODED:
        return
    code = ("import sys, torch; import align; torch.set_num_threads(1); "
            "args = align.parse_args(['--image-encoder', 'efficientnet-lite2', '--text-encoder', 'minilm', "
            "'--cache-dir', sys.argv[1], '--threads', '1']); run = align.load_inputs(args, 'cpu'); "
            "sets = {k: s for k, s in run.sets.items() if (k == 'train') == (sys.argv[2] == 'train')}; "
            "align.extract_features(args, run, 'cpu', sets, checked=True)")
    env = {**os.environ, **KEEP_FREED}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(cache_dir), part], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env) for part in ("train", "rest")]
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, f"encoding the world with Lite2 failed:\n{err[-2000:]}"
    ENCODED.add(str(cache_dir))


def off(old, new, what):
    """The figures of `what` that differ by more than TOLERANCE: ["name: JSON x, rerun y", ...]."""
    return [f"{what}: JSON {old:.4g}, rerun {new:.4g}"] if abs(old - new) > TOLERANCE else []


def rerun_argv(path, seeds, cache_dir, out):
    """(script, argv) of path's command rerun with --seeds seeds into out (argparse keeps the last --seeds)."""
    argv = shlex.split(json.loads(path.read_text())["command"])[2:]
    argv += ["--seeds", *map(str, seeds), "--out", str(out), "--cache-dir", str(cache_dir)]
    argv += ["--methods", *ROWS[path.stem], "--no-variants"] if path.stem in ROWS else []
    return ROOT / json.loads(path.read_text())["command"].split()[1], argv


def rerun_table(path, seeds, cache_dir, out):
    """The table.json of path's command rerun with --seeds seeds into out."""
    script, argv = rerun_argv(path, seeds, cache_dir, out)
    if script.stem == "cov_mask":
        return cov_mask.main(argv)
    if script.stem == "csa_ridges":                               # one fit, no seeds
        return csa_ridges.main([a for a in argv if a != "--seeds" and not a.isdigit()])
    r = subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"{script.name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return json.loads((out / "table.json").read_text())


def start_in_background(path, cache_dir, tmp_path_factory):
    """Start path's rerun (a results_table.py subprocess, one thread) unless it is running already."""
    if path.stem not in STARTED:
        out = tmp_path_factory.mktemp(path.stem) / "rerun"
        script, argv = rerun_argv(path, RERUN[path.stem], cache_dir, out)
        log = open(out.parent / "output.txt", "w")                # noqa: SIM115 (closed when the rerun is joined)
        STARTED[path.stem] = (subprocess.Popen([sys.executable, str(script), *argv], cwd=ROOT, stdout=log,
                                               stderr=subprocess.STDOUT), out, log)


@pytest.fixture(scope="module", autouse=True)
def no_rerun_left_running():
    """A background rerun not joined (its test failed first, or was interrupted) is stopped with the module."""
    yield
    for proc, _, log in STARTED.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def join_background(path):
    """The table.json of path's background rerun, once it has finished."""
    proc, out, log = STARTED[path.stem]
    proc.wait()
    log.close()
    assert proc.returncode == 0, f"{path.name}'s rerun failed:\n{Path(log.name).read_text()[-3000:]}"
    return json.loads((out / "table.json").read_text())


def stale_figures(path, table, rerun, seeds):
    """Every figure of the JSON `table` that the rerun of `seeds` does not repeat within TOLERANCE."""
    bad = []
    if isinstance(table.get("rows"), list):                       # csa_ridges.py: [[ridge, figures...] per ridge]
        bad += [f"chosen ridge {rerun['chosen']}, the JSON's {table['chosen']}"] * (rerun["chosen"] != table["chosen"])
        for old, new in zip(table["rows"], rerun["rows"], strict=True):
            bad += [f for name, a, b in zip(("mrr", "dense_mrr", "score"), old[1:4], new[1:4])
                    for f in off(100 * a, 100 * b, f"ridge {old[0]:g}, {name} x 100")]
            bad += off(old[4], new[4], f"ridge {old[0]:g}, test RSum") + off(old[5], new[5], f"ridge {old[0]:g}, seg")
    elif "rows" in table:                                          # results_table.py: {row: [[per seed] per column]}
        rows = ROWS.get(path.stem, list(table["rows"]))
        assert list(rerun["rows"]) == rows, f"{path.name}: rows {rows}, the command now makes {list(rerun['rows'])}"
        for row, values in ((r, table["rows"][r]) for r in rows):
            for column, old, new in zip(table["columns"], values, rerun["rows"][row]):
                if column != "train s":
                    bad += [f for i, s in enumerate(seeds)
                            for f in off(old[table["seeds"].index(s)], new[i], f"{row}, {column}, seed {s}")]
    else:                                                          # cov_mask.py: {reading: {metric: [per seed]}}
        assert list(rerun["table"]) == list(table["table"]), f"{path.name}: readings differ"
        for reading, metrics in table["table"].items():
            for k, old in metrics.items():
                bad += [f for i, s in enumerate(seeds)
                        for f in off(old[table["seeds"].index(s)], rerun["table"][reading][k][i], f"{reading}, {k}, "
                                     f"seed {s}")]
    return bad


def lite2(path):
    return "efficientnet-lite2" in json.loads(path.read_text())["command"]


# the Lite2 tables first (the world is encoded, then the background reruns start), the background ones last
ORDER = sorted(TABLES + MASK_TABLES + RIDGE_TABLES, key=lambda p: (p.stem in IN_BACKGROUND, not lite2(p), p.stem))


@pytest.mark.slow
@pytest.mark.parametrize("path", ORDER, ids=[p.stem for p in ORDER])
def test_each_docs_table_is_what_its_command_prints_now(path, cache_dir, tmp_path, tmp_path_factory, request):
    """The table's command rerun (the seeds of RERUN) gives the JSON's figures within TOLERANCE."""
    assert path.stem in RERUN, f"{path.name}: no rerun size in RERUN (add one that finishes, and say it in docs)"
    if lite2(path):
        encode_in_two_processes(cache_dir)
        selected = {item.callspec.params["path"].stem for item in request.session.items
                    if item.originalname == "test_each_docs_table_is_what_its_command_prints_now"}
        for p in ORDER:
            if p.stem in IN_BACKGROUND and p.stem in selected:
                start_in_background(p, cache_dir, tmp_path_factory)
    table, seeds = json.loads(path.read_text()), RERUN[path.stem]
    if path.stem in IN_BACKGROUND:
        rerun = join_background(path)
    else:
        rerun = rerun_table(path, seeds, cache_dir, tmp_path / "rerun")
    bad = stale_figures(path, table, rerun, seeds)
    assert not bad, f"{path.name} is stale: {len(bad)} figures differ from its command's rerun by more than " \
        f"{TOLERANCE}:\n" + "\n".join(bad[:20])


RUN_FIGURES = {"i2t_r1": ("retrieval", "i2t_r1"), "t2i_r1": ("retrieval", "t2i_r1"), "rsum": ("retrieval", "rsum"),
               "top1": ("classification", "cls", "top1"), "miou_fg": ("segmentation", "seg", "miou_fg"),
               "binding": ("binding", "binding_acc")}


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNS, ids=[p.stem for p in RUNS])
def test_each_docs_run_is_what_its_command_prints_now(path, cache_dir, tmp_path):
    """A run-*.json's align.py command rerun whole: its figures within TOLERANCE, its chosen setting the same."""
    import align  # noqa: PLC0415
    run = json.loads(path.read_text())
    argv = shlex.split(run["command"])[2:] + ["--cache-dir", str(cache_dir), "--out", str(tmp_path / "run")]
    metrics = align.main(argv)
    bad = []
    for name, keys in RUN_FIGURES.items():
        new = metrics
        for k in keys:
            new = new[k]
        old = run["retrieval"][name] if keys[0] == "retrieval" else run[name]
        bad += off(old, new, name)
    chosen = metrics["train"]["chosen"]
    if chosen != run["chosen"] and "history" in run:   # SAIL: another epoch of the same validation score is a tie
        score = {r["epoch"]: r["val_score"] for r in run["history"]}   # (epochs 32 and 35 both 276.55, rounded)
        bad += off(score[run["chosen"]["epochs"]], score[chosen["epochs"]], f"val_score of epoch {chosen['epochs']}")
    elif chosen != run["chosen"]:
        bad.append(f"chosen {chosen}, the JSON's {run['chosen']}")
    assert not bad, f"{path.name} is stale: {bad}"
