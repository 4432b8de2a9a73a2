"""config.json holds what a reader needs to reproduce a run: every hyperparameter as the method ran
it, the encoders' weights fingerprints, and (recorded, not compared) the software and the commit."""
import importlib.metadata
import json
import subprocess
from pathlib import Path

import pytest
import torch

import align
import encoders
from infra import run as settings

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--num-pairs", "300", "--epochs", "1", "--batch-size", "64", "--eval-images", "20", "--no-figures",
        "--threads", "1"]


@pytest.mark.slow
def test_config_of_a_default_run_holds_every_resolved_setting(cache_dir, tmp_path):
    out = tmp_path / "run"
    align.main(TINY + ["--cache-dir", str(cache_dir), "--out", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["hp"] == {"K": 512, "tau_p": 0.03, "tau": 0.05, "pooling": "cap", "head_rows": None,
                            "fast": True}                    # pooling None resolved by PAL's __init__
    image_enc, text_enc = encoders.load_encoders("shapes-cnn", "shapes-text", cache_dir)
    assert config["identity"]["image_weights"] == image_enc.fingerprint and len(image_enc.fingerprint) == 16
    assert config["identity"]["text_weights"] == text_enc.fingerprint and len(text_enc.fingerprint) == 16
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert config["software"] == {
        "python": config["software"]["python"], "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "commit": git.stdout.strip() if git.returncode == 0 else None}
    # a finished run is never replaced, not even by the same settings
    with pytest.raises(SystemExit, match="holds a finished run; results are never replaced"):
        align.main(TINY + ["--cache-dir", str(cache_dir), "--out", str(out)])
    assert json.loads((out / "config.json").read_text()) == config


def test_software_names_this_checkout_or_none(tmp_path, monkeypatch):
    s = settings.software()
    assert s["torch"] == torch.__version__ and s["transformers"] == importlib.metadata.version("transformers")
    assert s["commit"] is None or (len(s["commit"]) == 40 and int(s["commit"], 16) >= 0)
    monkeypatch.setattr(settings, "__file__", str(tmp_path / "run.py"))     # a copy outside any checkout
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert settings.software()["commit"] is None
