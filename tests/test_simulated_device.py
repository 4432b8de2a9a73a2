"""align.py's CUDA paths on a simulated device (tests/simulated_device.py): the training device's
tensors are kept apart from the host's, so an op that mixes them fails as on a GPU, and the
CUDA-only branches (side stream, pinned buffers, autocast, decode threads) run their control flow."""
import json

import pytest
import torch

from simulated_device import simulated_cuda

TINY = ["--device", "cuda", "--threads", "1", "--epochs", "1", "--eval-images", "24"]


def run(cache_dir, out, *flags, monkeypatch):
    import align
    with simulated_cuda(monkeypatch) as counts:
        metrics = align.main([*TINY, "--cache-dir", str(cache_dir), "--out", str(out), *flags])
    return metrics, counts


def test_default_run_writes_its_metrics_and_figures_on_the_device(cache_dir, tmp_path, monkeypatch):
    """python align.py (PAL, figures on) on CUDA: the anchor figure's heatmaps cross to the host."""
    metrics, counts = run(cache_dir, tmp_path / "run", monkeypatch=monkeypatch)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["retrieval"]["rsum"] == pytest.approx(metrics["retrieval"]["rsum"]) and saved["retrieval"]["rsum"] > 0
    assert "analysis" in saved and (tmp_path / "run" / "pal_anchors_0.png").exists()
    assert counts["stream"] >= 1 and counts["pin_memory"] >= 1      # the side-stream loader ran
