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

TABLES = sorted((ROOT / "docs" / "tables").glob("*.json"))


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
