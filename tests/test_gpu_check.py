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
    assert rows == dict(default="ok", cov="ok", analyses="ok", resume="ok", torchrun="ok", shards="ok", pipeline="ok")


def test_gpu_check_skips_torchrun_on_one_gpu_with_its_reason(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import argparse

    import gpu_check
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = argparse.Namespace(device="cuda", tiny=False, cache_dir=None)
    got = {name: skip for name, _, _, skip in gpu_check.steps(args, tmp_path, tmp_path, tmp_path)}
    assert got == dict(default=None, cov=None, analyses=None, resume=None, pipeline=None, shards=None,
                       torchrun="1 GPU(s): NCCL takes one GPU per rank")


def gpu_check_steps(tmp_path, tiny, world=None, models=None):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import argparse

    import gpu_check
    args = argparse.Namespace(device="cuda", tiny=tiny, cache_dir=None)
    return {name: cmd for name, cmd, _, _ in gpu_check.steps(args, tmp_path, world or tmp_path, models or tmp_path)}


def test_gpu_check_trains_one_step_through_shards_and_benchmarks_the_pipeline_at_coco_sizes(tmp_path):
    """Its fixture stayed under shards.MEMMAP_BYTES (2 GiB), so the shard writer on the GPU, training from
    memory-mapped shards through the reader threads and the side-stream copy (COCO's streamed path) never
    ran in it. The shards step runs align.py through benchmarks/align_sharded.py with 0.25 GiB (under its
    0.54 GB of train tokens) and --stream, with its own cache; bench_pipeline runs at COCO token counts."""
    cmds = gpu_check_steps(tmp_path, tiny=False)
    shards_step = cmds["shards"]
    assert shards_step[1:7] == [str(ROOT / "benchmarks" / "align_sharded.py"), "--memmap-bytes", str(2**28),
                                "--shard-bytes", str(64 * 2**20), "--stream"]
    assert shards_step[shards_step.index("--cache-dir") + 1] == str(tmp_path / "cache-shards")
    assert "--coco-size" in cmds["pipeline"]


@pytest.mark.slow
def test_the_shards_step_trains_from_memory_mapped_shards_on_the_simulated_device(tmp_path, monkeypatch):
    """The shards step's own command (tiny sizes) on the simulated CUDA device: the features are written as
    shards, training reads them through the side-stream copy, and metrics.json is written."""
    from simulated_device import simulated_cuda

    import align
    import features
    from infra import shards
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check
    world = gpu_check.write_world(tmp_path / "data", True)
    models = gpu_check.write_models(tmp_path / "models", True)
    cmd = gpu_check_steps(tmp_path, True, world, models)["shards"]
    monkeypatch.setattr(shards, "MEMMAP_BYTES", int(cmd[cmd.index("--memmap-bytes") + 1]))  # as the wrapper does
    monkeypatch.setattr(shards, "SHARD_BYTES", int(cmd[cmd.index("--shard-bytes") + 1]))
    assert "--stream" in cmd
    monkeypatch.setattr(features, "RESIDENT_SHARE", 0.0)
    with simulated_cuda(monkeypatch) as counts:
        align.main(cmd[cmd.index("--stream") + 1:])
    assert (tmp_path / "shards" / "metrics.json").exists()
    assert list((tmp_path / "cache-shards").rglob("*.tokens.npy"))
    assert counts["stream"] >= 1 and counts["pin_memory"] >= 1
