"""The run's boundaries, one guard each (infra/run.py: guard, the checks before any work): what the user hands in
(data folders, evaluation sets, model folders, preprocessors, the environment), what the run writes
(the run folder: never replaced, an unfinished run's checkpoint never removed), and what a result depends on (the
identity: settings, code, weights, data). Each fault is one `error:` line before any long work
(no "[features]" line), and the folders are left as they were.

Rows are faults nobody listed in the code: the guard must turn any of them into its line. Runs go
through align.main in this process, on the tiny COCO layout and tiny random-init Hugging Face
models of tests/test_real.py, or on the Shapes world with the session's cache.
"""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_real import write_image, write_karpathy, write_models

import align
import layers
from infra import cache, folder
from infra import run as runs
from methods import METHODS

QUICK = ("--eval-images", "20", "--no-figures", "--threads", "1")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("fx")
    write_models(root / "models")
    write_karpathy(root / "coco" / "coco", n_train=16, n_test=6)
    return root


def copy_of(fixtures, tmp_path):
    shutil.copytree(fixtures / "models", tmp_path / "models")
    shutil.copytree(fixtures / "coco", tmp_path / "coco")
    return tmp_path


def coco_argv(d, *extra):
    return ["--data", "coco", "--data-root", str(d / "coco"), "--cache-dir", str(d / "cache"), "--out", str(d / "out"),
            "--method", "linear", "--epochs", "1", *QUICK, "--image-encoder", str(d / "models" / "dinov2"),
            "--text-encoder", str(d / "models" / "bert"), *extra]


def one_line_before_work(capsys, argv):
    """The one error line of a run that must stop before any feature is extracted."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        align.main(argv)
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text, text
    assert "[features]" not in capsys.readouterr().out, text
    return text


def edit_json(path, **values):
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **values)))


# ----------------------------------------------------------------------------- what the user hands in
def split_file_of(d):
    return d / "coco" / "coco" / "dataset_coco.json"


INPUT_FAULTS = {   # name: (plant the fault in folder d, what the line must name)
    "heads not dividing hidden": (lambda d: edit_json(d / "models/bert/config.json", num_attention_heads=3),
                                  "models/bert: ValueError: The hidden size (32) is not a multiple"),
    "unknown activation": (lambda d: edit_json(d / "models/bert/config.json", hidden_act="swishy"),
                           "models/bert: KeyError: 'swishy'"),
    "layer_norm_eps a string": (lambda d: edit_json(d / "models/bert/config.json", layer_norm_eps="1e-6"),
                                "models/bert: "),
    "negative depth": (lambda d: edit_json(d / "models/dinov2/config.json", num_hidden_layers=-1),
                       "models/dinov2: "),
    "tokenizer.json holding {}": (lambda d: (d / "models/bert/tokenizer.json").write_text("{}"), "models/bert: "),
    "crop below the patch": (lambda d: edit_json(d / "models/dinov2/preprocessor_config.json",
                                                 crop_size={"height": 2, "width": 2}, size={"shortest_edge": 2}),
                             "models/dinov2 on the first image of train: RuntimeError"),
    "image_mean as strings": (lambda d: edit_json(d / "models/dinov2/preprocessor_config.json",
                                                  image_mean=["a", "b", "c"]),
                              "models/dinov2: its preprocessor_config.json: ValueError"),
    "image_std 0": (lambda d: edit_json(d / "models/dinov2/preprocessor_config.json", image_std=[0, 0, 0]),
                    "models/dinov2 on the first image of train: ValueError: its features hold NaN or inf"),
    "a kernel from the hub": (lambda d: edit_json(d / "models/bert/config.json",
                                                  attn_implementation="kernels-community/flash-attn"),
                              "needs Python code from outside the folder"),
    "no captions in a split": (lambda d: split_file_of(d).write_text(json.dumps({"images": [
        dict(e, sentences=[]) if e["split"] == "test" else e
        for e in json.loads(split_file_of(d).read_text())["images"]]})), "--data coco in "),
    "split file a folder": (lambda d: (split_file_of(d).unlink(), split_file_of(d).mkdir()),
                            "IsADirectoryError"),
    "half a CIFAR-10 batch": (lambda d: (d / "coco/cifar10/cifar-10-batches-py").mkdir(parents=True) or
                              (d / "coco/cifar10/cifar-10-batches-py/test_batch").write_bytes(b"\x80\x04broken"),
                              "cifar10 in "),
    "an empty EuroSAT class": (lambda d: (d / "coco/eurosat/2750/AnnualCrop").mkdir(parents=True), "eurosat in "),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(INPUT_FAULTS))
def test_any_fault_of_an_input_is_one_line_naming_it_before_any_work(fault, fixtures, tmp_path, capsys):
    d = copy_of(fixtures, tmp_path)
    plant, says = INPUT_FAULTS[fault]
    plant(d)
    text = one_line_before_work(capsys, coco_argv(d))
    assert says in text, text
    assert not (d / "out").exists() or not (d / "out" / "checkpoint.pt").exists()


def test_an_evaluation_set_with_a_missing_image_is_refused_before_any_work(tmp_path, monkeypatch):
    """A torchvision set's listed image missing was found only after COCO's sets were extracted."""
    import eval_sets

    class Food:                                        # what torchvision's Food101 lists, one file gone
        def __init__(self, root, download, split):
            self._image_files = [Path(root) / "a.jpg", Path(root) / "b.jpg"]
            self._labels, self.classes = [0, 1], ["apple pie", "bibimbap"]

        def __len__(self):
            return 2
    write_image(tmp_path / "food101" / "a.jpg", seed=0)
    import torchvision.datasets as tvd
    monkeypatch.setattr(tvd, "Food101", Food)
    with pytest.raises(SystemExit, match=r"^error: 1 of 2 food101 images are missing, e\.g\. .*b\.jpg; download it "
                                         r"again"):
        eval_sets.torchvision_set("food101", tmp_path)
    assert eval_sets.torchvision_set("cifar10", tmp_path) is None    # absent: skipped, said in one line


@pytest.mark.parametrize("size", ["2", "abc"])
def test_a_stray_world_size_is_refused_before_any_work(size, tmp_path, monkeypatch, capsys):
    """WORLD_SIZE=2 left in a shell (not a torchrun launch) waited 30 minutes for ranks that never come."""
    monkeypatch.setenv("WORLD_SIZE", size)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    text = one_line_before_work(capsys, ["--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c"), *QUICK])
    assert text.startswith(f"error: WORLD_SIZE={size}") and "unset" in text, text
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- what the run writes
def ctrl_c_at(monkeypatch, method_cls, at_call):
    """method_cls.loss raises KeyboardInterrupt (a Ctrl-C) at its at_call-th call: the class itself, so that
    its code (the identity's method_code) is the method's own."""
    loss, calls = method_cls.loss, []

    def stopping(self, img, txt):
        calls.append(1)
        if len(calls) == at_call:
            raise KeyboardInterrupt
        return loss(self, img, txt)
    monkeypatch.setattr(method_cls, "loss", stopping)


def finished(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"method": "pal", "identity": {"method": "pal"}}))
    (folder / "metrics.json").write_text("{}")


OUT_FAULTS = {   # name: (make --out in tmp, what the line says)
    "a link to nowhere": (lambda t: (t / "out").symlink_to(t / "gone"), "is a link to nowhere, not a folder"),
    "a file": (lambda t: (t / "out").write_text("mine"), "is a file, not a folder"),
    "a folder of one's own": (lambda t: (t / "out").mkdir() or (t / "out" / "notes.txt").write_text("mine"),
                              "holds files this program did not write (notes.txt, ..."),
    "the cache": (lambda t: (t / "c" / "features").mkdir(parents=True) or (t / "out").symlink_to(t / "c"),
                  "is or holds --cache-dir"),
    "a finished run": (lambda t: finished(t / "out"), "holds a finished run; results are never replaced"),
}


@pytest.mark.parametrize("fault", sorted(OUT_FAULTS))
def test_an_out_that_is_not_new_empty_or_unfinished_is_refused_and_left_as_it_was(fault, tmp_path, capsys):
    make, says = OUT_FAULTS[fault]
    make(tmp_path)
    (tmp_path / "c").mkdir(exist_ok=True)                                 # the cache: made before --out is read
    files = lambda: sorted(str(p) for p in tmp_path.rglob("*") if "/c/" not in str(p))
    before = files()
    text = one_line_before_work(capsys, ["--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"), *QUICK])
    assert says in text and "delete" not in text.split(";")[0], text
    assert files() == before


@pytest.mark.parametrize("out", ["c", "."], ids=["is the cache", "holds the cache"])
def test_an_out_that_is_or_holds_the_cache_is_refused(out, tmp_path, capsys):
    """--out equal to a new --cache-dir ran and wrote its results among the features: deleting or moving the
    run folder took the cache with it."""
    text = one_line_before_work(capsys, ["--out", str(tmp_path / out), "--cache-dir", str(tmp_path / "c"), *QUICK])
    assert "is or holds --cache-dir" in text, text
    assert not (tmp_path / "c" / "config.json").exists()


def test_a_link_where_a_lock_or_a_temporary_file_goes_is_never_written_through(tmp_path, capsys):
    """`ln -s ~/victim.txt shared/.run1.lock` (or a results folder copied with tar / rsync -a): the run is
    refused naming the link, the target keeps its bytes; the cache's per-key locks and the temporary file of
    every atomic write never write through a link either."""
    from infra import storage
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(victim, shared / ".run1.lock")
    text = one_line_before_work(capsys, ["--out", str(shared / "run1"), "--cache-dir", str(tmp_path / "c"), *QUICK])
    assert f"{shared / '.run1.lock'} is a link" in text, text
    assert victim.read_text() == "precious" and not (shared / "run1").exists()
    dangling = tmp_path / "locks" / "key.lock"
    dangling.parent.mkdir()
    os.symlink(tmp_path / "created-through-the-link", dangling)
    with pytest.raises(SystemExit, match="is a link"):
        with storage.file_lock(dangling):
            pass
    assert not (tmp_path / "created-through-the-link").exists()
    target = tmp_path / "metrics.json"
    os.symlink(victim, target.with_name(f"metrics.json.tmp{os.getpid()}"))   # a copied leftover of this pid
    storage.atomic_write_text("{}", target)
    assert victim.read_text() == "precious" and target.read_text() == "{}" and not target.is_symlink()


def test_a_killed_writes_temporary_file_is_removed_when_the_run_goes_on(tmp_path):
    """kill -9 between a checkpoint's temporary write and its rename leaves .checkpoint.pt.<random>.tmp in --out:
    the run that takes the folder again (--resume) removes it; a finished run never holds one."""
    import argparse
    out = tmp_path / "r"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"identity": {}}))
    (out / ".checkpoint.pt.x1y2z3.tmp").write_bytes(b"half")
    settings = runs.Settings(argparse.Namespace(out=str(out)), METHODS["pal"], {}, "cpu", out, identity={})
    folder.begin(settings)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


@pytest.mark.slow
def test_ctrl_c_then_any_command_leaves_the_checkpoint_and_resume_finishes(cache_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C in epoch 2; then the same command, another --seed into the same --out: each refused in one
    line, the checkpoint byte for byte as it was; then --resume goes on from it and finishes."""
    out = tmp_path / "o"
    argv = ["--cache-dir", str(cache_dir), "--out", str(out), "--method", "linear", "--epochs", "2",
            "--num-pairs", "300", *QUICK]
    ctrl_c_at(monkeypatch, METHODS["linear"], at_call=3)                      # 2 steps an epoch: in epoch 2
    with pytest.raises(KeyboardInterrupt):
        align.main(argv)
    monkeypatch.undo()
    saved = (out / "checkpoint.pt").read_bytes()
    assert not (out / "metrics.json").exists()
    for extra in ([], ["--seed", "1"], ["--method", "pal"]):
        text = one_line_before_work(capsys, argv + extra)
        assert "holds an unfinished run and its checkpoint (kept); add --resume" in text, text
        assert (out / "checkpoint.pt").read_bytes() == saved
    text = one_line_before_work(capsys, argv + ["--resume", "--epochs", "3"])   # refused before the features too
    assert "was written under other settings: epochs 2 there, 3 now" in text, text
    assert (out / "checkpoint.pt").read_bytes() == saved
    align.main(argv + ["--resume"])
    assert "resumed from" in capsys.readouterr().out and (out / "metrics.json").exists()
    assert not (out / "checkpoint.pt").exists()                  # finished: nothing left to resume


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(Path.cwd()).st_dev,
                    reason="needs a second file system (a tmpfs at /dev/shm)")
def test_an_out_on_another_file_system_is_written_there(cache_dir, tmp_path):
    """--out on a tmpfs or a bind mount: every file is written beside its target and renamed there, so no
    rename crosses a file system (it died with EXDEV after the whole run)."""
    out = Path("/dev/shm") / f"align-test-{os.getpid()}" / "o"
    try:
        align.main(["--cache-dir", str(cache_dir), "--out", str(out), "--method", "csa", *QUICK])
        assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "metrics.json"}
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def test_without_out_a_finished_run_gets_a_new_version_folder(cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["--cache-dir", str(cache_dir), "--method", "csa", *QUICK]
    first = align.main(argv)
    again = align.main(argv)
    assert (tmp_path / "results" / "csa-shapes-seed0" / "metrics.json").exists()
    assert (tmp_path / "results" / "csa-shapes-seed0-2" / "metrics.json").exists()
    assert first["retrieval"] == again["retrieval"]


# ----------------------------------------------------------------------------- what a result depends on
@pytest.mark.slow
def test_resume_after_editing_the_method_code_is_refused_naming_it(cache_dir, tmp_path, monkeypatch, capsys):
    """--resume went on with the edited code for the remaining epochs, config.json recording the new hash."""
    out = tmp_path / "o"
    argv = ["--cache-dir", str(cache_dir), "--out", str(out), "--method", "linear", "--epochs", "2",
            "--num-pairs", "300", *QUICK]
    ctrl_c_at(monkeypatch, METHODS["linear"], at_call=3)
    with pytest.raises(KeyboardInterrupt):
        align.main(argv)
    monkeypatch.undo()
    import methods.linear as linear
    edited = tmp_path / "linear.py"
    edited.write_text(Path(linear.__file__).read_text() + "\n# an edit\n")
    monkeypatch.setattr(linear, "__file__", str(edited))
    text = one_line_before_work(capsys, argv + ["--resume"])
    assert "was written under other settings: method_code " in text, text


def test_the_feature_cache_key_holds_the_encoder_code_and_one_key_per_layer(cache_dir):
    """Features cached before an edit of the encoder code were read after it; layer -1 and the last layer's
    number (the same tokens) were two keys, extracted twice."""
    import encoders
    image, _ = encoders.load_encoders("shapes-cnn", "shapes-text", cache_dir)
    inputs = torch.zeros(2, 3, 64, 64, dtype=torch.uint8)
    key = lambda: cache.feature_key(image, inputs, dataset="t", split="train", modality="image")
    before = key()
    image.layer = image.n_layers
    assert key() == before
    image.layer = 1
    assert key() != before
    image.layer, image.code = -1, "edited"
    assert key() != before


def test_select_layers_scores_no_more_pairs_than_the_run_aligns_on(cache_dir, tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(layers, "select_layers", lambda *a, n, **k: seen.setdefault("n", n))
    align.main(["--cache-dir", str(cache_dir), "--out", str(tmp_path / "o"), "--method", "csa", "--num-pairs", "40",
                "--select-layers", "cka", *QUICK])
    assert seen["n"] == 40


def test_the_identity_is_computed_once_and_recorded(cache_dir, tmp_path):
    align.main(["--cache-dir", str(cache_dir), "--out", str(tmp_path / "o"), "--method", "csa", *QUICK])
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    identity = config["identity"]
    assert identity["method_code"] == runs.method_code(METHODS["csa"])
    assert {"image_code", "image_weights", "text_code", "text_weights", "data_hash"} <= set(identity)
    assert identity["image_layer"] == 4 and config["image_layer"] == -1        # the number, and the flag as given
