"""The default tiny encoders come from the repository's weights file, checked by its sha256."""
import shutil
from pathlib import Path

import pytest
import torch

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
