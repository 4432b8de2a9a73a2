"""Every table docs/ shows from a benchmark is the script's own output: docs/tables/<name>.json is the table.json
benchmarks/results_table.py wrote beside its runs (per-seed figures and the command), and docs/results.md holds
the markdown the script renders from it, row for row."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import results_table  # noqa: E402

TABLES = [p for p in sorted((ROOT / "docs" / "tables").glob("*.json")) if not p.stem.startswith("run-")]


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
