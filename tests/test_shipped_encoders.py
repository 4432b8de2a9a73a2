"""The default tiny encoders come from the repository's weights file, checked by its sha256."""
import shutil
from pathlib import Path

import pytest
import torch

import shapes
import shapes_encoders as se

MB = 2**20


def test_the_shipped_file_is_small_has_the_shipped_hash_and_both_encoders_pass_their_gates():
    assert se.SHIPPED.is_file() and se.SHIPPED.stat().st_size < 5 * MB
    assert se.sha256(se.SHIPPED) == se.SHIPPED_SHA256
    w = se.load_shipped()
    assert set(w) == {"image", "text", "vocab", "acc"}
    assert w["acc"]["image"] >= 0.95 and 0.55 <= w["acc"]["text"] <= 0.70, w["acc"]
    assert all(t.dtype == torch.float32 for t in [*w["image"].values(), *w["text"].values()] if t.is_floating_point())


def test_seed_0_loads_the_shipped_weights_without_pretraining(tmp_path, monkeypatch):
    monkeypatch.setattr(se, "pretrain_both", lambda *a, **k: pytest.fail("pretrained"))
    monkeypatch.setattr(se, "pretrain_image_encoder", lambda *a, **k: pytest.fail("pretrained"))
    monkeypatch.setattr(se, "pretrain_text_encoder", lambda *a, **k: pytest.fail("pretrained"))
    image, text = se.load_shapes_encoders(tmp_path, log=lambda *a: None)
    w = se.load_shipped()
    assert all(torch.equal(v, image.model.state_dict()[k]) for k, v in w["image"].items())
    assert all(torch.equal(v, text.model.state_dict()[k]) for k, v in w["text"].items())
    assert text.tokenizer.vocab == w["vocab"]
    assert not any(p.requires_grad for p in image.model.parameters())
    assert not (tmp_path / "encoders").exists()          # nothing pretrained, nothing cached


def test_a_changed_or_missing_weights_file_is_refused_with_the_command_that_remakes_it(tmp_path):
    bad = tmp_path / "w.pt"
    shutil.copy(se.SHIPPED, bad)
    raw = bytearray(bad.read_bytes())
    raw[-100] ^= 1
    bad.write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match="--remake"):
        se.load_shipped(bad)
    with pytest.raises(SystemExit, match="missing"):
        se.load_shipped(tmp_path / "none.pt")


@pytest.mark.slow
def test_remaking_the_weights_reaches_the_shipped_held_out_accuracy(tmp_path):
    """Pretraining again (any CPU) gives weights in the same bands: the image gate (>= 95% held-out
    patch shape accuracy) and the text encoder's held-out masked-word accuracy within 3 points."""
    out = tmp_path / "remade.pt"
    se.remake(out=out, log=lambda *a: None)
    got, shipped = torch.load(out, weights_only=True)["acc"], se.load_shipped()["acc"]
    assert got["image"] >= 0.95 and abs(got["text"] - shipped["text"]) <= 0.03, (got, shipped)
    assert Path(out).stat().st_size < 5 * MB


ENCODE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import shapes, shapes_encoders as se
torch.set_num_threads(1)
w = shapes.shapes_world(0, n_train=96, n_test=2, n_cls=2, n_seg=2, n_bind=2)["train"]
image, text = se.load_shapes_encoders(sys.argv[2], log=lambda *a: None)
fi, ft = image.encode(w.images), text.encode(w.captions)
torch.save({"image": fi.tokens.half(), "text": ft.tokens.half(), "pooled": ft.pooled.half()}, sys.argv[3])
"""


@pytest.mark.slow
def test_the_float16_features_are_the_same_under_other_cpu_kernels(tmp_path):
    """ATEN_CPU_CAPABILITY=default (no vector kernels) sums in another order than AVX2 / AVX-512: the
    float64 forward rounds to the same float16 features (a float32 one flipped ~1 value in 1,300)."""
    import os
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parent.parent)
    out = {}
    for cap in ("native", "default"):
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
        if cap != "native":
            env.update(ATEN_CPU_CAPABILITY=cap, MKL_ENABLE_INSTRUCTIONS="SSE4_2")
        subprocess.run([sys.executable, "-c", ENCODE, root, str(tmp_path), str(tmp_path / f"{cap}.pt")],
                       env=env, check=True)
        out[cap] = torch.load(tmp_path / f"{cap}.pt", weights_only=True)
    for k in out["native"]:
        assert torch.equal(out["native"][k], out["default"][k]), \
            (k, (out["native"][k] != out["default"][k]).sum().item())


def test_encode_is_the_float64_forward_rounded(tmp_path):
    w = shapes.shapes_world(0, n_train=8, n_test=2, n_cls=2, n_seg=2, n_bind=2)["train"]
    image, text = se.load_shapes_encoders(tmp_path, log=lambda *a: None)
    with torch.no_grad():
        x = se.shapes_pixels(w.images).double()
        want = image.model.double()(x).float().flatten(2).transpose(1, 2)       # (B, 64, D)
    assert torch.equal(image.encode(w.images).tokens[:, 1:], want)
    assert "float64" in image.preprocess and "float64" in text.preprocess     # its own feature cache keys
