"""benchmarks/gpu_check.py in its CPU form: every step of the GPU check runs here, so it cannot rot."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_every_step_on_the_cpu(cache_dir, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                        "--cache-dir", str(cache_dir), "--work", str(tmp_path), "--timeout", "1800"],
                       cwd=ROOT, capture_output=True, text=True, timeout=2000)
    table = r.stdout[r.stdout.index("gpu_check on"):]
    assert r.returncode == 0, table + r.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()[3:]}
    assert rows == dict(default="ok", cov="ok", analyses="ok", resume="ok", torchrun="ok", pipeline="ok")


def test_gpu_check_skips_torchrun_on_one_gpu_with_its_reason(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import argparse

    import gpu_check
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(device="cuda", tiny=False, cache_dir=None)
    got = {name: skip for name, _, _, skip in gpu_check.steps(args, tmp_path, tmp_path, tmp_path)}
    assert got == dict(default=None, cov=None, analyses=None, resume=None, pipeline=None,
                       torchrun="1 GPU(s): NCCL takes one GPU per rank")
