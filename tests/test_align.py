"""align.py: the training loop (NaN stop, resume, determinism), the feature cache, and subprocess runs.

The runs share one cache directory for the whole session (conftest.cache_dir), so
the tiny encoders are pretrained once (about two minutes on 2 CPU cores) and reused.
"""
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import random_features, train_with

import align
import train
from infra import cache, run
from methods.linear import Linear

ROOT = Path(__file__).resolve().parents[1]


def loop_args(**kw):
    base = dict(epochs=3, batch_size=16, lr=None, weight_decay=None, seed=0, resume=False)
    return Namespace(**{**base, **kw})


def planted_pairs(n=64):
    img = random_features(n, 5, 8, grid=(2, 2), seed=1)
    W = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    txt = random_features(n, 4, 6, seed=3)
    txt.pooled = img.pooled @ W + 0.1 * txt.pooled
    return img, txt


class StopAtCall(Linear):
    """Linear whose n-th loss call raises (an interrupted run), or returns NaN."""

    def __init__(self, *a, n=5, nan=False, **kw):
        super().__init__(*a, **kw)
        self.calls, self.n, self.nan = 0, n, nan

    def loss(self, img, txt):
        loss, logs = super().loss(img, txt)
        self.calls += 1
        if self.calls == self.n and not self.nan:
            raise KeyboardInterrupt
        return (loss * float("nan") if self.calls == self.n else loss), logs


def test_training_is_deterministic_and_resume_continues_exactly(tmp_path):
    img, txt = planted_pairs()   # 64 pairs, batch 16: 4 steps an epoch
    torch.manual_seed(0)
    straight = Linear(8, 6, K=4)
    whole = train_with(straight, img, txt, loop_args(), tmp_path / "a", "cpu")
    torch.manual_seed(0)
    interrupted = StopAtCall(8, 6, K=4, n=10)      # dies in epoch 3, after the checkpoint of epoch 2
    with pytest.raises(KeyboardInterrupt):
        train_with(interrupted, img, txt, loop_args(), tmp_path / "b", "cpu")
    resumed = Linear(8, 6, K=4)
    cut = train_with(resumed, img, txt, loop_args(resume=True), tmp_path / "b", "cpu")
    for k, v in straight.state_dict().items():
        assert torch.allclose(v, resumed.state_dict()[k], atol=1e-6), k
    # history.csv's rows: every epoch once, the checkpoint's epochs 1-2 carried over by --resume
    assert [r["epoch"] for r in cut["history"]] == [r["epoch"] for r in whole["history"]] == [1, 2, 3]
    for a, b in zip(whole["history"], cut["history"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["lr"] == pytest.approx(b["lr"])


def test_nan_loss_stops_with_epoch_and_step_and_keeps_the_checkpoint(tmp_path):
    img, txt = planted_pairs()   # 64 pairs, batch 16: 4 steps an epoch; call 6 = epoch 2, step 2
    m = StopAtCall(8, 6, K=4, n=6, nan=True)
    with pytest.raises(FloatingPointError, match=r"epoch 2, step 2"):
        train_with(m, img, txt, loop_args(), tmp_path, "cpu")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)   # where --resume reads it
    assert saved["epoch"] == 0 and all(torch.isfinite(v).all() for v in saved["method"].values())


def test_an_out_of_memory_step_is_one_line_naming_a_batch_that_halves_it(tmp_path, monkeypatch):
    """The device's memory is a boundary: a step that does not fit is one line naming a batch that halves it,
    and the checkpoint of every finished epoch stays for --resume."""
    img, txt = planted_pairs()   # 64 pairs, batch 16: 4 steps an epoch; call 6 = epoch 2, step 2
    m = StopAtCall(8, 6, K=4, n=6)
    monkeypatch.setattr(StopAtCall, "loss", lambda self, i, t: (_ for _ in ()).throw(torch.OutOfMemoryError("x"))
                        if (setattr(self, "n", self.n - 1) or self.n) == 0 else Linear.loss(self, i, t))
    loop = dict(epochs=3, batch_size=16, lr=1e-3, weight_decay=0.0, seed=0)
    with pytest.raises(SystemExit) as e:
        train.fit_or_train(m, img, txt, loop, tmp_path, "cpu")
    assert str(e.value) == ("error: out of memory on cpu in a step of 16 pairs; pass --batch-size 8 (or smaller --hp "
                            "values), then rerun with --resume (the cached features and every finished epoch are kept)")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["epoch"] == 0


def test_final_loss_is_the_last_epoch_s_printed_mean(tmp_path, capsys):
    """metrics.json's train.final_loss is the figure the run prints last (the epoch's mean loss to 4
    decimals), not a float32 step loss whose last digits depend on the CPU's kernels."""
    img, txt = planted_pairs(128)                  # batch 16: 8 steps an epoch
    torch.manual_seed(0)
    result = train_with(Linear(8, 6, K=4), img, txt, loop_args(epochs=2), tmp_path, "cpu")
    epochs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] epoch")]
    printed = float(epochs[-1].split(" loss ")[1].split()[0])
    assert len(epochs) == 2 and result["final_loss"] == printed, (result, epochs)
    assert result["final_loss"] == round(result["final_loss"], 4) and printed > 0


def test_training_loop_waits_on_the_host_per_epoch_not_per_step(tmp_path, capsys):
    """A GPU runs ahead of the host only if the loop never waits for it: the loss is summed on the device,
    its finiteness looked at every FINITE_EVERY steps and at the epoch's end, the logs printed as epoch
    means. Counted with conftest.HostSyncs, the syncs in the loop's own lines and the method's loss (what
    runs on the training device); the optimiser's step count and the host-side row indexing stay on the host
    on a GPU too."""
    from conftest import HostSyncs
    img, txt = planted_pairs(512)                  # batch 16: 32 steps an epoch
    torch.manual_seed(0)
    with HostSyncs() as syncs:
        train_with(Linear(8, 6, K=4), img, txt, loop_args(epochs=2), tmp_path, "cpu")
    on_device = [w for w in syncs.where if w.startswith(("align.py", "methods/", "infra/distributed.py"))]
    assert len(on_device) <= 2 * 4, f"{len(on_device)} host syncs in 64 steps: {on_device[:12]}"
    epochs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] epoch")]
    assert len(epochs) == 2 and all(" nce " in line for line in epochs), epochs   # the logs' epoch means
    nce = [float(line.split(" nce ")[1].split()[0]) for line in epochs]
    loss = [float(line.split(" loss ")[1].split()[0]) for line in epochs]
    assert nce == loss                                     # Linear's loss is its InfoNCE


def test_nan_loss_stops_within_finite_every_steps_at_its_first_step(tmp_path, monkeypatch):
    """Between two looks the loop runs on (on NaN weights after a NaN step); the error still names the
    first non-finite step, and no checkpoint of that epoch is written."""
    monkeypatch.setattr(train, "FINITE_EVERY", 4)
    img, txt = planted_pairs(256)                  # batch 16: 16 steps an epoch
    m = StopAtCall(8, 6, K=4, n=22, nan=True)      # call 22 = epoch 2, step 6: seen after step 8
    with pytest.raises(FloatingPointError, match=r"loss is nan at epoch 2, step 6\. The last good checkpoint is "):
        train_with(m, img, txt, loop_args(), tmp_path, "cpu")
    assert m.calls == 16 + 8                       # steps 7 and 8 ran, not step 9
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)   # beside --out
    assert saved["epoch"] == 0 and all(torch.isfinite(v).all() for v in saved["method"].values())


class CountingEncoder:
    name, layer, preprocess = "counting", -1, "none"

    def __init__(self):
        self.calls = 0

    def encode(self, texts, device="cpu"):
        self.calls += 1
        return random_features(len(texts), 3, 4, seed=len(texts))


def test_feature_cache_is_reused_keyed_and_rebuilt_when_broken(tmp_path, capsys):
    enc = CountingEncoder()
    a = cache.extract(enc, ["x"] * 10, tmp_path, batch_size=4, dataset="d", split="s", modality="text")
    b = cache.extract(enc, ["x"] * 10, tmp_path, batch_size=4, dataset="d", split="s", modality="text")
    assert enc.calls == 3 and torch.equal(a.tokens, b.tokens) and a.tokens.dtype == torch.float16
    cache.extract(enc, ["x"] * 10, tmp_path, batch_size=4, dataset="d", split="other", modality="text")
    assert enc.calls == 6                                     # another key: computed again
    files = list((tmp_path / "features").iterdir())
    assert len(files) == 2 and not any(".tmp" in f.name for f in files)
    path = [f for f in files if f.name.startswith("d-s-")][0]
    path.write_bytes(path.read_bytes()[:100])                 # a half-written file
    c = cache.extract(enc, ["x"] * 10, tmp_path, batch_size=4, dataset="d", split="s", modality="text")
    assert enc.calls == 9 and torch.equal(a.tokens, c.tokens) and "unreadable" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_one_clear_error():
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        align.main(["--device", "cuda"])


def test_hp_parsing_checks_names():
    assert run.parse_hp(Linear, ["K=64", "tau=0.1"]) == {"K": 64, "tau": 0.1}
    with pytest.raises(SystemExit, match="one of"):
        run.parse_hp(Linear, ["k=64"])


# ----------------------------------------------------------------------------- subprocess runs
def run_align(cache_dir, out, *extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "align.py"), "--cache-dir", str(cache_dir), "--out", str(out), "--threads", "1",
           "--no-figures", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_align_runs_end_to_end_and_reruns_identically(cache_dir, tmp_path):
    """Two runs side by side on one (here cold) cache: one pretrains and extracts, the other waits and reads."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, str(ROOT / "align.py"), "--cache-dir", str(cache_dir), "--out",
                               str(tmp_path / f"run{i}"), "--threads", "1", "--no-figures", "--method", "linear",
                               "--epochs", "3"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
    runs = []
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        runs.append(json.loads((tmp_path / f"run{i}" / "metrics.json").read_text()))
    m = runs[0]
    assert set(m["retrieval"]) >= {"i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum",
                                   "i2t_map", "i2t_p1", "i2t_p5", "t2i_p1"}
    assert m["retrieval"]["i2t_r1"] > 5 * 100 / 500          # chance is 0.2%
    assert m["classification"]["cls"]["top1"] > 3 * 100 / 24  # chance is 4.2%
    assert m["segmentation"]["seg"]["miou_fg"] > 30
    for r in runs:
        r["train"].pop("seconds")
        for row in r["train"].get("history", []):             # per-epoch rows: their seconds are wall time
            row.pop("seconds")
    assert runs[0] == runs[1]                                  # --seed gives identical metrics
    assert ("retrieval" in r and (tmp_path / "run0" / "config.json").exists()
            and (tmp_path / "run0" / "model.safetensors").exists())


@pytest.mark.slow
def test_align_rejects_unknown_names(cache_dir, tmp_path):
    r = run_align(cache_dir, tmp_path, "--method", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr and "pal" in r.stderr
    r = run_align(cache_dir, tmp_path, "--image-encoder", "no-such-model")
    assert r.returncode != 0 and "no-such-model" in (r.stderr + r.stdout)
