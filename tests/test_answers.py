"""The instructors' answers (exercises/answers.md) and the course's rows of docs/results.md hold the figures of
the sheet's runs, as exercises/make_answers.py recorded them (exercises/answers_figures.json); a rerun of one
run gives the recorded figures. Not in a student copy (make_student_copy.py leaves the answers out).

After a change that moves a figure: `python exercises/make_answers.py` (every run, ~8 min of CPU), or
`--only RUN ...` for the runs it moves."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exercises"))
import make_answers as ma  # noqa: E402

FIGURES = json.loads(ma.FIGURES.read_text())


def test_every_run_has_its_recorded_figures():
    assert set(FIGURES) == {*ma.RUNS, "e6", "machine"}, sorted(FIGURES)
    for name in ma.RUNS:
        assert {"i2t_r1", "t2i_r1", "rsum", "top1", "miou_fg", "cpu_s"} <= set(FIGURES[name]), name


def test_answers_md_is_the_template_filled_with_the_recorded_figures():
    want = ma.render(ma.TEMPLATE.read_text(), FIGURES)
    got = ma.ANSWERS.read_text()
    assert got == want, ("exercises/answers.md is not answers_template.md filled with answers_figures.json: run "
                         "python exercises/make_answers.py --render")
    assert f"{FIGURES['e1-cap']['rsum']:.1f}" in got


def test_the_rows_of_pal_and_asif_in_the_results_tables_are_the_recorded_figures():
    for doc, rows in ma.DOC_ROWS.items():
        text = doc.read_text()
        assert ma.results_rows(text, FIGURES, rows) == text, f"{doc.name}: python exercises/make_answers.py --render"


def sheet_commands():
    """{align.py arguments without --out: experiment} of every run the sheet's experiments E1-E5 give."""
    sheet = (ROOT / "exercises" / "README.md").read_text().split("## Experiments")[1].split("**E6.")[0]
    out = {}
    for e, part in re.findall(r"\*\*(E\d)\.(.*?)(?=\*\*E\d\.|\Z)", sheet, re.S):
        for cmd in re.findall(r"python align\.py ([^`\n]*)", part):
            args = re.sub(r"\s*--out \S+", "", cmd).strip()
            out[args] = e
    return out


def test_the_script_runs_the_sheets_commands():
    """Every run of the script is a command of the sheet (E4's and E5's N and encoder spelled out), and every
    command of the sheet is one of the script's runs, or E5's `--method pal`, which on a CPU is E1's CAP run."""
    sheet = sheet_commands()
    runs = {args: name for name, args in ma.RUNS.items()}
    e4 = {"--method mlp --align-data weights --epochs 200", "--method mlp --num-pairs 25 --epochs 200",
          "--method mlp --num-pairs 100 --epochs 200", "--method mlp --align-data weights+pairs --num-pairs 25 "
                                                       "--epochs 200"}
    e5 = {"--method pal", "--method linear", "--method pal --text-encoder minilm",
          "--method linear --text-encoder minilm", "--method pal_rel --epochs 5"}
    assert e4 <= set(runs) and e5 - {"--method pal"} <= set(runs)
    named = {a for a, e in sheet.items() if e in ("E1", "E2", "E3")}
    assert len(named) == 9 and named <= set(runs), sorted(named - set(runs))
    assert set(runs) <= named | e4 | e5, sorted(set(runs) - named - e4 - e5)
    assert "--method pal" in sheet and "--method pal_rel --epochs 5" in sheet


@pytest.mark.slow
def test_a_rerun_gives_the_recorded_figures(cache_dir, tmp_path):
    """E2's p = 1 run (closed form, seconds): the figures answers.md quotes."""
    name = "e2-p1"
    r = subprocess.run([sys.executable, "align.py", *shlex.split(ma.RUNS[name]), "--threads", "1", "--cache-dir",
                        str(cache_dir), "--out", str(tmp_path / name)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    got = ma.figures_of(json.loads((tmp_path / name / "metrics.json").read_text()))
    want = {k: v for k, v in FIGURES[name].items() if k != "cpu_s"}
    assert got == want, (name, got, want)
