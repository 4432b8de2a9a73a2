"""Nothing non-finite is saved or scored: a NaN gradient stops training before its checkpoint, --resume
refuses NaN weights, evaluation refuses NaN embeddings, --lr past float32 is refused up front, and the
error names the cause it can see."""
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import random_features, train_with

import evaluate
import train
from infra import storage
from infra.errors import RunError
from methods.linear import Linear

ROOT = Path(__file__).resolve().parents[1]


def loop_args(**kw):
    return Namespace(**{**dict(epochs=3, batch_size=16, lr=None, weight_decay=None, seed=0, resume=False), **kw})


def pairs(n=64):
    return random_features(n, 5, 8, grid=(2, 2), seed=1), random_features(n, 4, 6, seed=3)


class NaNGradient(Linear):
    """Linear whose loss stays finite while its gradient at the n-th call is NaN."""

    def __init__(self, *a, n=6, **kw):
        super().__init__(*a, **kw)
        self.calls, self.n = 0, n

    def loss(self, img, txt):
        loss, logs = super().loss(img, txt)
        self.calls += 1
        if self.calls == self.n:
            total = sum(p.sum() for p in self.parameters())
            total.register_hook(lambda g: g * float("nan"))                    # its gradient: 0 -> NaN
            loss = loss + 0 * total                                            # the value unchanged
        return loss, logs


def test_a_finite_loss_with_a_nan_gradient_stops_before_any_nan_save(tmp_path):
    img, txt = pairs()        # 64 pairs, batch 16: 4 steps an epoch; call 8 = epoch 2's last step
    m = NaNGradient(8, 6, K=4, n=8)
    with pytest.raises(FloatingPointError, match=r"a trained parameter holds NaN or inf after epoch 2 \(every "
                                                 r"loss was finite"):
        train_with(m, img, txt, loop_args(), tmp_path, "cpu")
    assert not all(torch.isfinite(p).all() for p in m.parameters())           # the weights did go NaN
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert saved["epoch"] == 0, "the NaN epoch wrote a checkpoint"
    assert all(torch.isfinite(v).all() for v in saved["method"].values()), "a checkpoint holds NaN"
    assert not (tmp_path / "model.safetensors").exists()


def test_resume_refuses_a_checkpoint_holding_nan(tmp_path):
    img, txt = pairs()
    train_with(Linear(8, 6, K=4), img, txt, loop_args(epochs=1), tmp_path, "cpu")
    ckpt = tmp_path / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=True)
    name = next(iter(state["method"]))
    state["method"][name] = state["method"][name] * float("nan")
    storage.atomic_save(state, ckpt)                                          # with its checksum
    with pytest.raises(RunError, match=rf"holds NaN or inf in {name}"):
        train.load_checkpoint(ckpt, {})


def test_a_non_finite_first_loss_blames_the_settings_not_the_learning_rate(tmp_path):
    class Overflow(Linear):
        def loss(self, img, txt):
            loss, logs = super().loss(img, txt)
            return loss / 0.0, logs                                            # inf at the very first step

    with pytest.raises(FloatingPointError) as e:
        train_with(Overflow(8, 6, K=4), *pairs(), loop_args(), tmp_path, "cpu")
    msg = str(e.value)
    assert "before any update" in msg and "--hp" in msg and "Try a lower --lr" not in msg, msg
    assert "--resume" not in msg, f"no checkpoint exists, yet the message says --resume: {msg}"


def test_evaluation_refuses_nan_embeddings():
    m = Linear(8, 6, K=4)
    with torch.no_grad():
        m.img_proj.weight.fill_(float("nan")) if hasattr(m, "img_proj") else next(m.parameters()).fill_(float("nan"))
    img, txt = pairs(12)
    with pytest.raises(RunError, match=r"NaN or inf"):
        evaluate.retrieval(m, img, txt, torch.arange(12))
    S = torch.full((3, 3), float("nan"))
    with pytest.raises(RunError, match=r"score matrix holds 9 NaN"):
        evaluate.finite(S, "the score matrix")


@pytest.mark.slow
def test_lr_past_float32_is_refused_before_any_work(tmp_path):
    r = subprocess.run([sys.executable, "align.py", "--method", "linear", "--lr", "1e39", "--out", str(tmp_path / "o"),
                        "--cache-dir", str(tmp_path / "c")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: --lr 1e+39"), r.stderr[-500:]
    assert not (tmp_path / "c").exists(), "the features were built before the refusal"
