"""What is refused before any work (infra/run.py): path flags, a wrong data root, analyses that
cannot run, a missing image; each one `error:` line before anything long runs."""

import pytest
from faults_common import models, one_line  # noqa: F401  (fixtures)
from test_real import write_karpathy

import align
import data


@pytest.mark.slow
@pytest.mark.parametrize("encoder, says", [
    ("dinov2", "has no linear classification head"),             # a backbone without a head
    ("beit", "--data coco has no classification set (put one of stl10")])   # a head, but no labelled images
def test_analyses_that_cannot_run_are_refused_before_the_features(tmp_path, models, capsys, encoder, says):
    """--analyses with a model that has no head, or data without a classification set: it trained and
    evaluated, then printed "[analyses] skipped"; now one line before any features are extracted."""
    write_karpathy(tmp_path / "coco")
    with pytest.raises(SystemExit) as e:
        align.main(["--data", "coco", "--data-root", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                    "--out", str(tmp_path / "out"), "--threads", "1", "--method", "linear", "--analyses",
                    "--image-encoder", str(models / encoder), "--text-encoder", str(models / "bert")])
    text = one_line(e)
    assert text.startswith("error: --analyses: ") and says in text and text.endswith("; or run without --analyses")
    assert "[features]" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_wrong_data_root_is_said_before_the_built_in_encoders_pretrain(tmp_path, monkeypatch):
    """--data coco with the built-in encoders: a --data-root without the split file (one level too
    deep) stopped only after a minute of encoder pretraining; it is now said at start."""
    write_karpathy(tmp_path / "coco")
    monkeypatch.setattr(align.encoders, "load_encoders", lambda *a, **k: pytest.fail("encoders loaded"))
    with pytest.raises(SystemExit) as e:
        align.main(["--data", "coco", "--data-root", str(tmp_path / "coco" / "train2014"), "--cache-dir",
                    str(tmp_path / "cache"), "--out", str(tmp_path / "out"), "--threads", "1"])
    assert f"COCO Karpathy split file dataset_coco.json not found at {tmp_path / 'coco' / 'train2014'}" in str(e.value)


@pytest.mark.slow
def test_a_missing_image_is_said_before_the_built_in_encoders_load_or_pretrain(tmp_path, monkeypatch):
    """--data coco with the built-in encoders on a fresh cache: the data folder is read and checked
    before any encoder loads, so a missing image is not said after a minute of pretraining."""
    write_karpathy(tmp_path / "coco")
    (tmp_path / "coco" / "val2014" / "test_1.jpg").unlink()
    monkeypatch.setattr(align.encoders, "load_encoders", lambda *a, **k: pytest.fail("encoders loaded"))
    with pytest.raises(SystemExit) as e:
        align.main(["--data", "coco", "--data-root", str(tmp_path / "coco"), "--cache-dir",
                    str(tmp_path / "cache"), "--out", str(tmp_path / "out"), "--threads", "1",
                    "--image-encoder", "efficientnet-lite1", "--text-encoder", "minilm"])   # not the Shapes ones
    assert "1 of 3 COCO test images are missing" in str(e.value) and "test_1.jpg" in str(e.value)


@pytest.mark.slow
def test_a_quoted_tilde_in_a_path_flag_is_the_home_folder(tmp_path, monkeypatch):
    """--data-root "~/mydata" (quoted, so the shell leaves the ~): read as a folder named "~" in
    the working directory, the data was not found. The path flags expand ~ as the shell would."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_karpathy(tmp_path / "mydata" / "coco")
    args = align.parse_args(["--data", "coco", "--data-root", "~/mydata", "--out", "~/r", "--cache-dir", "~/c"])
    assert (args.data_root, args.out, args.cache_dir) == tuple(str(tmp_path / n) for n in ("mydata", "r", "c"))
    data.check_root("coco", args.data_root)                                   # found: no error
    with pytest.raises(SystemExit, match="error: "):
        data.check_root("coco", "~/mydata")                                   # the loader takes a path as given


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--out", "--cache-dir"])
def test_a_path_flag_naming_a_file_says_it_is_a_file(tmp_path, monkeypatch, flag):
    """--out results.txt (an existing file), or a folder below one: "cannot be written (File exists)"
    did not say which part was a file. Now one line naming it, before anything loads."""
    (tmp_path / "results.txt").write_text("notes")
    monkeypatch.setattr(align.encoders, "load_encoders", lambda *a, **k: pytest.fail("encoders loaded"))
    paths = {"--out": str(tmp_path / "o"), "--cache-dir": str(tmp_path / "c")}
    for given in (tmp_path / "results.txt", tmp_path / "results.txt" / "run1"):
        with pytest.raises(SystemExit) as e:
            align.main([*(x for k, v in {**paths, flag: str(given)}.items() for x in (k, v)), "--threads", "1"])
        assert f"{flag} {given}: {tmp_path / 'results.txt'} is a file, not a folder" in one_line(e)
    assert (tmp_path / "results.txt").read_text() == "notes"
