"""Every registered method runs through align.py end to end: train (or fit), evaluate, save.

A quick in-process run per method on a small slice of the Shapes world, so that
no method can drift away from the interface that align.py and evaluate.py use.
"""
import json
import math

import pytest

import align
from methods import METHODS


# PAL runs in the quick tier (the one end-to-end run of `python -m pytest -q`); the others in the full one.
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "pal" else pytest.mark.slow)
                                  for n in sorted(METHODS)])
def test_method_runs_end_to_end(name, cache_dir, tmp_path):
    metrics = align.main(["--method", name, "--epochs", "1", "--num-pairs", "64", "--batch-size", "32",
                          "--eval-images", "20", "--cache-dir", str(cache_dir), "--out", str(tmp_path),
                          "--no-figures", "--threads", "1"])
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["retrieval"].keys() == metrics["retrieval"].keys() and (tmp_path / "model.safetensors").exists() \
        and (tmp_path / "history.csv").exists()
    values = [saved["retrieval"]["rsum"], saved["classification"]["cls"]["top1"],
              saved["segmentation"]["seg"]["miou_fg"]]
    assert all(math.isfinite(v) and v >= 0 for v in values)
    assert 0 <= saved["retrieval"]["i2t_r1"] <= saved["retrieval"]["i2t_r5"] <= saved["retrieval"]["i2t_r10"] <= 100


@pytest.mark.slow
def test_weight_recycling_paths_run_end_to_end(cache_dir, tmp_path):
    """--align-data weights (no image-text pair) and --analyses through align.py."""
    m = align.main(["--method", "linear", "--align-data", "weights", "--epochs", "50", "--eval-images", "100",
                    "--analyses", "--cache-dir", str(cache_dir), "--out", str(tmp_path), "--no-figures",
                    "--threads", "1"])
    assert m["classification"]["cls"]["top1"] > 3 * 100 / 24          # far above chance from 24 head rows alone
    assert set(m["recycling"]) == {"cls"}                               # the Shapes classification set
    rec = m["recycling"]["cls"]
    assert set(rec) == {"neural_collapse", "prototype_alignment", "modality_gap", "few_shot"}
    assert abs(rec["neural_collapse"]["linear_top1"] - rec["neural_collapse"]["cosine_top1"]) < 5  # Table 1's finding
    assert rec["modality_gap"]["p_value"] < 0.05
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["recycling"]["cls"]["few_shot"].keys() == rec["few_shot"].keys()
