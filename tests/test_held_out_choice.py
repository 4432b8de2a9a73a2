"""Settings chosen per run on held-out alignment pairs (CSA's ridge, SAIL's epochs), never on a test pair; and
the loop settings refused in one line before any work."""
import csv
import json

import pytest
import torch
from conftest import random_features

import align
import shapes
import train
from features import Features
from methods.csa import held_out_split
from methods.sail import SAIL

QUICK = ("--eval-images", "20", "--no-figures", "--threads", "1")


def poisoned_world(cache_dir):
    """The Shapes world with every set but the alignment pairs poisoned: test images noise, captions reversed
    (their image links flipped), classification images flipped and labels rolled."""
    world = dict(shapes.cached_world(cache_dir))
    g = torch.Generator().manual_seed(0)
    test = world["test"]
    world["test"] = type(test)(torch.randint(0, 256, test.images.shape, dtype=torch.uint8, generator=g),
                               list(reversed(test.captions)), test.txt_to_img.flip(0))
    world["cls"] = type(world["cls"])(world["cls"].images.flip(0), world["cls"].labels.roll(1),
                                      world["cls"].class_names)
    return world


def test_held_out_pairs_keep_each_image_on_one_side():
    """Pairs that share an image (COCO's 5 captions) are held out together: no image on both sides."""
    pooled = torch.randn(40, 8).repeat_interleave(3, 0)                       # 40 images x 3 captions
    for split in (train.held_out_pairs(pooled, 0.2), held_out_split(pooled, 0.2)):
        val, fit = split
        assert len(val) == 24 and len(fit) == 96, (len(val), len(fit))       # 8 of 40 images, 3 pairs each
        key = lambda idx: {tuple(r) for r in pooled[idx].tolist()}
        assert not key(val) & key(fit), "an image is on both sides of the held-out split"


def test_the_stop_on_validation_keeps_the_best_epoch(tmp_path):
    """train() with held-out pairs: one validation row per epoch, and the weights it returns are the best
    epoch's (validating them again gives that epoch's figures exactly)."""
    img = random_features(120, 1 + 4, 16, grid=(2, 2), seed=1)
    txt = Features.from_vectors(img.pooled @ torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
                                + 0.3 * torch.randn(120, 12, generator=torch.Generator().manual_seed(4)))
    val_idx, fit_idx = train.held_out_pairs(img.pooled, 0.25)
    val = train.validation_set(img, txt, val_idx)
    torch.manual_seed(0)
    m = SAIL(16, 12, K=16, width=2)
    loop = dict(epochs=6, batch_size=30, lr=3e-3, weight_decay=1e-4, seed=0)
    result = train.train(m, img[fit_idx], txt[fit_idx], loop, tmp_path / "run", "cpu", val=val)
    rows = result["history"]
    assert [r["epoch"] for r in rows] == list(range(1, 7)) and all("val_rsum" in r for r in rows)
    best = max(rows, key=lambda r: r["val_score"])
    assert result["chosen"] == {"epochs": best["epoch"]}
    again = train.validate(m, val, "cpu")
    assert again == {k: best[k] for k in again}, f"the returned weights validate at {again}, the best epoch at {best}"


@pytest.mark.slow
@pytest.mark.parametrize("method, extra", [("csa", ()), ("sail", ("--epochs", "2"))])
def test_the_per_run_choice_reads_no_test_pair(cache_dir, tmp_path, monkeypatch, capsys, method, extra):
    """The run's choice (CSA's ridge table, SAIL's per-epoch validation figures) is the same to the last digit
    with every test set poisoned, while the test metrics move (the poison reached them)."""
    run = lambda out: align.main(["--method", method, "--cache-dir", str(cache_dir), "--out", str(tmp_path / out),
                                  *QUICK, *extra])
    clean = run("clean")
    assert "[choice]" in capsys.readouterr().out, "the run does not print the setting it chose"
    world = poisoned_world(cache_dir)
    monkeypatch.setattr(shapes, "cached_world", lambda *a, **k: world)
    poisoned = run("poisoned")
    if method == "csa":
        table = lambda out: json.loads((tmp_path / out / "validation.json").read_text())
        assert table("poisoned") == table("clean"), "CSA's ridge table moved when the test sets were poisoned"
    else:
        val = lambda out: [{k: v for k, v in r.items() if k.startswith("val_")}
                           for r in csv.DictReader(open(tmp_path / out / "history.csv"))]
        assert val("poisoned") == val("clean"), "SAIL's validation figures moved when the test sets were poisoned"
    assert poisoned["train"]["chosen"] == clean["train"]["chosen"]
    assert poisoned["retrieval"]["rsum"] != clean["retrieval"]["rsum"], "(the test's own check) the poison missed"


@pytest.mark.parametrize("flags, says", [(("--lr", "5e37"), "lr in (0, 3.40"),
                                         (("--weight-decay", "1e300"), "--weight-decay 1e+300: with lr 0.001")])
def test_loop_settings_that_overflow_are_refused_in_one_line(tmp_path, capsys, flags, says):
    """--lr 5e37 (Adam's lr / (1 - beta1) overflows float32) and --weight-decay 1e300 (1 - lr x wd < 0) stop
    before any work, each naming its own flag."""
    with pytest.raises(SystemExit) as e:
        align.main(["--method", "linear", "--epochs", "1", "--cache-dir", str(tmp_path / "c"),
                    "--out", str(tmp_path / "o"), *QUICK, *flags])
    text = str(e.value)
    assert text.startswith(f"error: {flags[0]}") and says in text and "\n" not in text, text
    assert "[features]" not in capsys.readouterr().out
    assert not (tmp_path / "c").exists(), "the refused run read or wrote the cache"


def test_a_word_default_takes_a_number_or_its_word():
    """CSA's ridge defaults to the word "auto": --hp ridge=0.1 is a number, ridge=auto the word, anything else
    one line naming both."""
    from infra.errors import RunError
    from infra.run import parse_hp
    from methods.csa import CSA
    assert parse_hp(CSA, ["ridge=0.1"]) == {"ridge": 0.1} and parse_hp(CSA, ["ridge=1"]) == {"ridge": 1.0}
    assert parse_hp(CSA, ["ridge=auto"]) == {"ridge": "auto"}
    with pytest.raises(RunError, match="takes a number or auto"):
        parse_hp(CSA, ["ridge=abc"])
