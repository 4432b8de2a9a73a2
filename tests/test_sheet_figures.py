"""The course sheet's exact end-to-end figures (exercises/README.md) are what the reference prints."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def sheet_runs():
    """[(align.py arguments, {metric: printed figure})] for each run the sheet gives figures of."""
    text = re.sub(r"\s+", " ", (ROOT / "exercises" / "README.md").read_text())
    runs = []
    for cmd, figures in re.findall(r"`python align\.py ([^`]*)`[^`]*?prints ((?:`\w+ [\d.]+`(?:,? (?:and )?)?)+)",
                                   text):
        runs.append((cmd.split(), dict(re.findall(r"`(\w+) ([\d.]+)`", figures))))
    return runs


def test_the_sheet_gives_three_exact_runs():
    runs = sheet_runs()
    assert len(runs) == 3 and all(set(f) == {"rsum", "top1", "miou_fg"} for _, f in runs), runs


@pytest.mark.slow
@pytest.mark.parametrize("k", range(3))
def test_the_reference_prints_the_sheet_figures_to_the_last_digit(k, cache_dir, tmp_path):
    args, figures = sheet_runs()[k]
    if "--method" not in args:
        args = [*args, "--hp", "fast=False"]           # a student copy trains PAL's paper form
    r = subprocess.run([sys.executable, "align.py", *args, "--cache-dir", str(cache_dir), "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    got = {"rsum": m["retrieval"]["rsum"], "top1": m["classification"]["cls"]["top1"],
           "miou_fg": m["segmentation"]["seg"]["miou_fg"]}
    assert {k: f"{v:.2f}" for k, v in got.items()} == figures, (args, got)
