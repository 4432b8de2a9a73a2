"""A run as a whole: the settings it resolves (config.json), and its faults as one `error:` line.

Every refused run is refused before any long work (no "[features]" line) and leaves the
folder it was given as it found it. Runs go through align.main in this process where they
can (fast: no new interpreter), on the session's shared cache (conftest.cache_dir) or on
a tiny COCO layout with tiny random-init Hugging Face models (tests/test_real.py's builders);
torchrun faults start real ranks.
"""
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_features
from test_real import models, write_karpathy  # noqa: F401  (the tiny Hugging Face models fixture)

import align
import recycling
import shapes
import train
from features import Features
from infra import folder
from infra import run as settings
from infra.run import Settings
from methods import METHODS
from methods.mlp import MLP

ROOT = Path(__file__).resolve().parents[1]
QUICK = ("--eval-images", "20", "--no-figures", "--threads", "1")


SHAPES = functools.cache(shapes.shapes_world)              # the Shapes world, rendered once here


@pytest.fixture(autouse=True)
def shapes_once(monkeypatch):
    monkeypatch.setattr(shapes, "shapes_world", SHAPES)


def run(cache_dir, out, *extra):
    return align.main(["--cache-dir", str(cache_dir), "--out", str(out), *QUICK, *extra])


def refused(capsys, cache_dir, out, *extra):
    """The one error line of a run that must stop before any long work."""
    with pytest.raises(SystemExit) as e:
        run(cache_dir, out, *extra)
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text, text
    assert "[features]" not in capsys.readouterr().out
    return text


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    write_karpathy(root / "coco", n_train=16, n_test=6)
    return root


def coco_run(models, root, tmp, *extra):
    return ("--data", "coco", "--data-root", str(root), "--image-encoder", str(models / "dinov2"),
            "--text-encoder", str(models / "bert"), "--cache-dir", str(tmp / "cache"), *extra)


# ----------------------------------------------------------------------------- config.json: resolved values
@pytest.mark.slow
def test_config_holds_the_resolved_loop_settings_of_a_run_without_epochs(cache_dir, tmp_path):
    """No --epochs, --batch-size, --lr: config.json holds what ran (Linear's own 20 epochs at batch
    256, within the CPU budget), not the flags' nulls, and the pairs it aligned on; a step budget
    resolves to its epochs."""
    run(cache_dir, tmp_path, "--method", "linear", "--num-pairs", "300", "--keep-checkpoint")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["epochs"], config["batch_size"], config["lr"], config["weight_decay"]) == (20, 256, 1e-3, 1e-4)
    assert config["train_threads"] == config["encode_threads"] == 1 and config["seed"] == 0
    assert config["image_layer"] == config["text_layer"] == -1 and config["alignment_pairs"] == 300
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 19 and ckpt["settings"]["epochs"] == 20 and ckpt["settings"]["batch_size"] == 256
    # MLP declares 400 steps at batch 512: on 300 pairs, batch 300, 1 step an epoch, 400 epochs
    args = align.parse_args(["--method", "mlp"])
    mlp = MLP(8, 6)
    assert train.plan_loop(Settings(args, MLP, {}, "cpu", None).loop_given(mlp.defaults), mlp, 300) == dict(
        epochs=400, batch_size=300, lr=5e-3, weight_decay=0.0, seed=0)


@pytest.mark.slow
def test_config_and_metrics_hold_the_layers_select_layers_chose(models, coco, tmp_path, capsys):
    m = align.main([*coco_run(models, coco, tmp_path, "--out", str(tmp_path / "out")), *QUICK, "--method", "linear",
                    "--epochs", "1", "--select-layers", "cka", "--select-pairs", "10"])
    said = capsys.readouterr().out.split("[layers] best: image layer ")[1].split(" (")[0]   # "1, text layer 2"
    chosen = [int(said.split(",")[0]), int(said.split("text layer ")[1])]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert [config["image_layer"], config["text_layer"]] == chosen
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["layers"] == m["layers"] \
        == {"image": chosen[0], "text": chosen[1]}


# ----------------------------------------------------------------------------- --resume on other data
@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_data_root_or_other_captions(models, coco, tmp_path, capsys,
                                                                          monkeypatch):
    out = tmp_path / "out"
    loss, calls = METHODS["linear"].loss, []
    monkeypatch.setattr(METHODS["linear"], "loss", lambda self, i, t: (_ for _ in ()).throw(KeyboardInterrupt)
                        if calls.append(1) or len(calls) == 3 else loss(self, i, t))  # 1: the FLOP count; 3: epoch 2
    with pytest.raises(KeyboardInterrupt):
        align.main([*coco_run(models, coco, tmp_path, "--out", str(out)), *QUICK, "--method", "linear",
                    "--epochs", "2", "--batch-size", "16"])
    monkeypatch.undo()
    assert (out / "checkpoint.pt").exists() and not (out / "metrics.json").exists()
    other = tmp_path / "other"
    shutil.copytree(coco, other)
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"other settings: data_root '.*coco\d*' there, '.*other' now"):
        align.main([*coco_run(models, other, tmp_path, "--out", str(out)), *QUICK, "--method", "linear",
                    "--epochs", "2", "--batch-size", "16", "--resume"])
    assert "[features]" not in capsys.readouterr().out
    ann = other / "coco" / "dataset_coco.json"                       # same root, one training caption edited
    entries = json.loads(ann.read_text())
    entries["images"][0]["sentences"][0]["raw"] = "a red cat sits on the man."
    ann.write_text(json.dumps(entries))
    shutil.copy(ann, coco / "coco" / "dataset_coco.json")
    try:
        with pytest.raises(SystemExit, match=r"other settings: data_hash '\w+' there, '\w+' now"):
            align.main([*coco_run(models, coco, tmp_path, "--out", str(out)), *QUICK, "--method", "linear",
                        "--epochs", "2", "--batch-size", "16", "--resume"])
    finally:
        write_karpathy(coco / "coco", n_train=16, n_test=6)          # the module's layout back
    assert "[features]" not in capsys.readouterr().out


def test_too_few_pairs_and_head_rows_alone_for_pal_rel_are_refused_before_any_work(cache_dir, tmp_path, capsys):
    """--num-pairs 1 with PAL was refused after all four feature sets were extracted; pal_rel on the
    head rows alone (weights+pairs --num-pairs 0) extracted them, then a TypeError (no patch grid)."""
    text = refused(capsys, cache_dir, tmp_path / "o", "--method", "pal", "--num-pairs", "1")
    assert "--num-pairs 1: a batch of 1 pair(s) (1 alignment pairs): PAL takes batch_size in [2, inf)" in text
    text = refused(capsys, cache_dir, tmp_path / "o", "--method", "pal_rel", "--align-data", "weights+pairs",
                   "--num-pairs", "0")
    assert text.startswith("error: --method pal_rel --align-data weights+pairs --num-pairs 0 (the head rows alone): "
                           "its relation term (R1) reads the patch grid's positions")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "csa"])
def test_a_layer_whose_pooled_vector_ignores_the_image_is_refused(models, coco, tmp_path, method):
    """--image-layer 0 on DINOv2: the CLS token before any block is the same for every image, so
    linear ran at chance with rc 0 (t2i_r1 0.0) and CSA stopped in linalg.cholesky. One line."""
    with pytest.raises(SystemExit) as e:
        align.main([*coco_run(models, coco, tmp_path, "--out", str(tmp_path / "o")), *QUICK, "--epochs", "1",
                    "--method", method, "--image-layer", "0"])
    assert str(e.value).startswith(f"error: --image-layer 0: the pooled vectors of {models / 'dinov2'} at layer 0 "
                                   f"are the same for every training image (spread 0)")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["config.json", "log.txt"]   # a rerun takes it


def test_a_failed_check_leaves_no_out_folder(models, coco, tmp_path):
    """A check that fails after the folders are checked (here: --analyses with a backbone) creates
    nothing: no <out>/, no .lock in it."""
    with pytest.raises(SystemExit, match="--analyses"):
        align.main([*coco_run(models, coco, tmp_path, "--out", str(tmp_path / "new" / "o")), *QUICK, "--analyses"])
    assert not (tmp_path / "new" / "o").exists()


@pytest.mark.slow
def test_a_second_run_on_the_same_out_refuses_naming_the_running_one(cache_dir, tmp_path, capsys):
    out = tmp_path / "o"
    with folder.held(out):                            # the first run, still going
        text = refused(capsys, cache_dir, out, "--method", "linear", "--epochs", "1")
    assert f"--out {out} is in use by a run still going; wait for it to finish, or pass another --out" in text
    run(cache_dir, out, "--method", "linear", "--epochs", "1", "--num-pairs", "300")   # free again


@pytest.mark.slow
def test_a_refused_run_writes_nothing_into_a_finished_runs_folder(cache_dir, tmp_path, capsys):
    files = {"notes.json": "{}", "mine.json": "{}", "model.pt": "x"}   # a config.json of theirs: refused at once
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    refused(capsys, cache_dir, tmp_path, "--method", "csa", "--hard-negatives")
    with pytest.raises(SystemExit, match="--num-pairs 0 leaves no alignment data"):   # known after the features
        run(cache_dir, tmp_path, "--method", "linear", "--num-pairs", "0")
    with pytest.raises(SystemExit, match=r"a batch of 1 pair\(s\)"):
        run(cache_dir, tmp_path, "--method", "linear", "--num-pairs", "1")
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.name != ".lock"} == files


# ----------------------------------------------------------------------------- head rows
HEAD_ROWS = {"pal": None, "pal_rel": {"weights"}, "cov": {"weights", "weights+pairs"},
             "filip": {"weights", "weights+pairs"}, "text_guided": {"weights", "weights+pairs"},
             "fa": {"weights", "weights+pairs"}}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_reads_a_head_row_as_its_one_vector_or_refuses_it(name):
    """Head rows (weight recycling §4) are one vector each: every method that trains on them gives
    different head rows different image embeddings (a token-level method reading only the empty
    patch slots gives them all the same one), alone and beside pairs; the others are refused."""
    W, names = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)), random_features(12, 3, 6, seed=3)
    w_img, w_txt = recycling.weight_pairs(W, names)
    img, txt = random_features(16, 5, 8, grid=(2, 2), seed=1), random_features(16, 4, 6, seed=2)
    pairs = {"weights": (w_img, w_txt), "weights+pairs": recycling.augment(img, txt, w_img, w_txt)}
    for mode, (I, T) in pairs.items():
        args = align.parse_args(["--method", name, "--align-data", mode])
        if mode in (HEAD_ROWS.get(name) or ()):
            with pytest.raises(SystemExit, match=re.escape(f"--method {name} --align-data {mode}: ") + ".*head row"):
                settings.check_flags(args, METHODS[name])
            continue
        settings.check_flags(args, METHODS[name])
        torch.manual_seed(0)
        m = METHODS[name](8, 6, **({"K": 8} if name in ("pal", "pal_rel") else {}))
        if m.fit is not None:
            m.fit(Features.from_vectors(I.pooled), Features.from_vectors(T.pooled))
        if m.loss is not None:
            assert torch.isfinite(m.loss(I, T)[0])
        m.eval()
        with torch.no_grad():
            e = m.embed_image(I)[-12:].flatten(1)                              # the head rows' embeddings
        assert torch.isfinite(e).all()
        assert torch.cdist(e, e)[~torch.eye(12, dtype=torch.bool)].min() > 1e-4, (name, mode)


@pytest.mark.slow
def test_weights_mode_checks_the_head_first_and_never_extracts_the_training_pairs(models, coco, tmp_path, capsys):
    with pytest.raises(SystemExit, match="has no linear classification head"):
        align.main([*coco_run(models, coco, tmp_path, "--out", str(tmp_path / "a")), *QUICK, "--method", "linear",
                    "--align-data", "weights"])
    assert "[features]" not in capsys.readouterr().out and not (tmp_path / "cache" / "features").exists()
    base = list(coco_run(models, coco, tmp_path, "--out", str(tmp_path / "b")))
    base[base.index("--image-encoder") + 1] = str(models / "beit")
    m = align.main([*base, *QUICK, "--method", "linear", "--align-data", "weights", "--epochs", "1"])
    assert m["retrieval"]["rsum"] >= 0
    made = [p.name for p in (tmp_path / "cache" / "features").iterdir()]
    assert any(n.startswith("coco-test-image") for n in made) and not any(n.startswith("coco-train") for n in made)


# ----------------------------------------------------------------------------- the command line
CLI = {"threads": (["--threads", "-2"], "--threads -2: give a positive count"),
       "seed": (["--seed", "-1"], "--seed -1: give a seed in [0, 2^32)"),
       "select pairs 0": (["--select-layers", "cka", "--select-pairs", "0"], "--select-pairs 0: score the layers"),
       "select pairs < 0": (["--select-pairs", "-5990"], "--select-pairs -5990: score the layers on at least"),
       "cov on head rows": (["--method", "cov", "--align-data", "weights"],
                            "--method cov --align-data weights: its regions attend over the patch tokens")}


@pytest.mark.slow
@pytest.mark.parametrize("row", list(CLI))
def test_bad_command_lines_stop_with_one_line_before_any_work(row, cache_dir, tmp_path, capsys):
    threads = torch.get_num_threads()
    text = refused(capsys, cache_dir, tmp_path / "out", *CLI[row][0])
    assert CLI[row][1] in text and torch.get_num_threads() == threads
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


# ----------------------------------------------------------------------------- torchrun
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(cache_dir, out, per_rank, timeout=240):
    """Start len(per_rank) ranks by hand with torchrun's environment (as torchrun on several nodes would),
    rank r with per_rank[r]'s extra arguments; (exit codes, stderr texts)."""
    env = dict(os.environ, WORLD_SIZE=str(len(per_rank)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               TORCHELASTIC_RUN_ID="by-hand",
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(ROOT / "align.py"), "--cache-dir", str(cache_dir), "--out",
                               str(out), *QUICK, "--device", "cpu", *extra], cwd=ROOT, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for r, extra in enumerate(per_rank)]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], errs


@pytest.mark.slow
def test_ranks_started_with_different_arguments_stop_at_once_naming_the_difference(cache_dir, tmp_path):
    codes, errs = ranks(cache_dir, tmp_path, [["--epochs", "3"], ["--epochs", "6"]], timeout=120)
    assert codes == [1, 1], errs
    for err in errs:
        assert "error: the 2 ranks were started with different arguments (epochs: 3 on rank 0, 6 on rank 1)" in err
        assert "Traceback" not in err
    assert not (tmp_path / "config.json").exists()


@pytest.mark.slow
def test_a_global_batch_smaller_than_the_ranks_is_refused_on_every_rank(models, coco, tmp_path):
    """MLP's per-pair loss trains on a batch of one, split across 2 ranks (no dropout) it cannot."""
    extra = [*coco_run(models, coco, tmp_path), "--method", "mlp", "--hp", "dropout=0.0", "--batch-size", "1",
             "--epochs", "1"]
    codes, errs = ranks(tmp_path / "cache", tmp_path / "out", [extra] * 2)
    assert codes == [1, 1], errs
    for err in errs:
        assert "error: a global batch of 1 pair(s) on 2 ranks" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "checkpoint.pt").exists()
