"""python align.py calibrate (calibration.py, aligned.py choice 9): calibrated stacking's gamma chosen on a finished
run's own training pairs, its seen names held out as if novel; the same gamma as benchmarks/gzsl.py's procedure
for the same method, seed and folds (one implementation); written to RUN/calibration.json, which classify
--calibrate auto reads; each refusal one line, with nothing written."""
import csv
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_aligned import finished_run  # noqa: F401  (a fixture: a finished PAL run, --num-pairs 512, one epoch)
from test_index import photos, tiny_run  # noqa: F401  (fixtures: a hand-written run folder, 9 Shapes PNGs)

import align
import aligned
import calibration
import shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gzsl  # noqa: E402  (benchmarks/gzsl.py)

NAMES = list(shapes.CLASS_NAMES)


@pytest.fixture(scope="module")
def linear_run(cache_dir, tmp_path_factory):
    """A finished linear run on every Shapes training pair, one epoch (every one of the 24 names is seen)."""
    out = tmp_path_factory.mktemp("run") / "linear-shapes-seed0"
    align.main(["--method", "linear", "--epochs", "1", "--eval-images", "20", "--cache-dir", str(cache_dir),
                "--out", str(out), "--no-figures", "--threads", "1", "--quiet"])
    return out


@pytest.fixture(scope="module")
def calibrated(linear_run, tmp_path_factory):
    """linear_run copied, calibrated on the 24 names; (run, stdout, stderr, its files' bytes before)."""
    run = tmp_path_factory.mktemp("calibrated") / "run"
    shutil.copytree(linear_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    out, err = io.StringIO(), io.StringIO()
    real = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        align.calibrate([str(run), "--classes", ",".join(NAMES), "--threads", "1"])
    finally:
        sys.stdout, sys.stderr = real
    return run, out.getvalue(), err.getvalue(), before


def test_a_caption_names_a_name_when_its_words_occur_in_it_in_order():
    """choice 1: lower-cased words, one after the other; on the Shapes world, classes_of's colour-shape phrases."""
    names = ["red circle", "circle", "circle red", "Blue Square", "square blue"]
    got = calibration.named_in(["A red circle, and a blue  square.", "a red big circle", ""], names)
    assert got == [{0, 1, 3}, {1}, set()]


def test_on_the_shapes_world_the_names_a_caption_names_are_the_benchmarks_classes(cache_dir):
    captions = shapes.cached_world(cache_dir)["train"].captions
    assert calibration.named_in(captions, NAMES) == [gzsl.classes_of(c) for c in captions]


def test_calibrate_writes_the_gamma_benchmarks_gzsl_chooses_for_the_same_method_seed_and_folds(calibrated, cache_dir):
    """The command on a run of every training pair (linear, one epoch, seed 0) and the benchmark's choose on the
    same pairs, its seen classes all 24, its loop the method's own (the run's): the same gamma, exactly, and the
    same folds' gammas and H; the command's lines say them; the run's own files are byte for byte as before."""
    run, out, err, before = calibrated
    record = json.loads((run / "calibration.json").read_text())
    F, train_set, _ = gzsl.features("shapes-cnn", "shapes-text", cache_dir)
    labels = [gzsl.classes_of(c) for c in train_set.captions]
    logs = []
    gamma = gzsl.choose("linear", F, train_set.txt_to_img, labels, list(range(24)), 1, 0, logs.append)
    assert record["gamma"] == gamma and record["method"] == "linear" and record["seed"] == 0
    assert len(record["folds"]) == calibration.FOLDS == len(logs)
    assert sum(f["gamma"] for f in record["folds"]) / calibration.FOLDS == gamma
    for f, line in zip(record["folds"], logs):      # the benchmark's fold lines: its gamma and H
        assert f"gamma {f['gamma']:.4f} (H {f['H']:.1f})" in line and f"{f['pairs']} pairs fitted" in line
    assert record["seen"] == record["classes"] == NAMES and "calibrate" in record["command"]
    assert out.startswith(f"gamma {gamma:.4f} (the mean of 3 folds: ") and out.count("\n") == 1
    assert "[classes] 24 seen in the training captions, 0 novel" in err and err.count("[gamma] fold") == 3
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != "calibration.json"} == before


def test_a_fold_fits_none_of_its_pseudo_novel_names_nor_a_held_out_image():
    """calibration.plan on planted labels: 8 names, 200 one-caption images (image i names i % 8; every 10th also
    names (i + 1) % 8: not labelled, never scored), each fold's fitted pairs name none of its pseudo-novel names
    and hold no held-out image; its scored images are the held-out ones of seen' and every labelled one of its
    pseudo-novel names."""
    names = [f"n{k}" for k in range(8)]
    named = [{i % 8} | ({(i + 1) % 8} if i % 10 == 0 else set()) for i in range(200)]
    rows = torch.arange(200)
    folds = calibration.plan(rows, named, torch.ones(200, dtype=torch.bool), names, 3, 0.25, 0)
    held = set()
    for pseudo, fit, val, y in folds:
        assert not any(named[j] & pseudo for j in fit.tolist())
        pseudo_val = {j for j in val.tolist() if named[j] & pseudo}
        assert pseudo_val == {j for j in range(200) if len(named[j]) == 1 and named[j] & pseudo}
        seen_val = set(val.tolist()) - pseudo_val
        assert seen_val and not seen_val & set(fit.tolist())
        assert y.tolist() == [next(iter(named[j])) for j in val.tolist()]
        held |= seen_val
    assert [sorted(p) for p, *_ in folds] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert 0.15 * 180 < len(held) < 0.35 * 180                     # about a quarter of the labelled images


def test_an_image_of_several_captions_leaves_the_fit_with_all_of_them_and_is_scored_once():
    """choice 3: 120 images of 2 captions each (pairs 2i, 2i + 1), the first naming i % 6, the second nothing:
    no fitted pair belongs to an image of a pseudo-novel name or a held-out image, though its own caption names
    none; each scored image is scored once, at its first pair."""
    names = [f"n{k}" for k in range(6)]
    rows = torch.arange(120).repeat_interleave(2)
    named = [{i // 2 % 6} if i % 2 == 0 else set() for i in range(240)]
    for pseudo, fit, val, y in calibration.plan(rows, named, torch.ones(240, dtype=torch.bool), names, 3, 0.25, 0):
        scored = rows[val].tolist()
        assert len(scored) == len(set(scored)) and all(j % 2 == 0 for j in val.tolist())
        assert not set(rows[fit].tolist()) & set(scored)
        assert not any(r % 6 in pseudo for r in rows[fit].tolist())
        assert y.tolist() == [r % 6 for r in scored] and {r % 6 for r in scored} - pseudo


def test_a_fold_without_held_out_images_of_its_pseudo_novel_names_is_one_line():
    names = [f"n{k}" for k in range(4)]
    named = [{0} if i % 2 else {1} for i in range(100)]      # n2 and n3 label no image
    with pytest.raises(calibration.TooFew, match=r"fold 3/3 \(pseudo-novel n2\) has \d+ held-out image\(s\) of its "
                       r"seen names, 0 of its pseudo-novel ones"):
        calibration.plan(torch.arange(100), named, torch.ones(100, dtype=torch.bool), names, 3, 0.25, 0)


def scores_csv(text):
    rows = list(csv.reader(io.StringIO(text)))
    return rows[0], [[float(v) for v in r[3:]] for r in rows[1:]]


def test_classify_calibrate_auto_subtracts_the_calibrations_gamma_from_the_seen_names(calibrated, photos, capsys):  # noqa: F811
    """--calibrate with no value, or auto: every seen name's score less calibration.json's gamma, the novel name's
    as it was; the [calibrate] line names the gamma; --calibrate GAMMA still takes a number."""
    run = str(calibrated[0])
    gamma = json.loads((calibrated[0] / "calibration.json").read_text())["gamma"]
    assert gamma != 0
    names = "red circle,blue square,pink circle"                              # pink: never captioned
    aligned.main(["classify", run, str(photos), "--classes", names, "--csv", "-", "--threads", "1"])
    header, plain = scores_csv(capsys.readouterr().out)
    for flag in (["--calibrate"], ["--calibrate", "auto"]):
        aligned.main(["classify", run, str(photos), "--classes", names, "--csv", "-", "--threads", "1", *flag])
        out = capsys.readouterr()
        assert f"[calibrate] gamma {gamma:.4f} from {run}/calibration.json" in out.err
        assert "1 novel: pink circle" in out.err
        _, auto = scores_csv(out.out)
        want = torch.tensor(plain) - gamma * torch.tensor([1.0, 1.0, 0.0])
        torch.testing.assert_close(torch.tensor(auto), want, rtol=0, atol=1e-6)
        assert len(auto) == 9
    aligned.main(["classify", run, str(photos), "--classes", names, "--csv", "-", "--calibrate", "0.25"])
    _, fixed = scores_csv(capsys.readouterr().out)
    torch.testing.assert_close(torch.tensor(fixed), torch.tensor(plain) - torch.tensor([0.25, 0.25, 0.0]), rtol=0,
                               atol=1e-6)


def one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_the_refusals_are_one_line_each_and_write_nothing(linear_run, tiny_run, photos, cache_dir, tmp_path):  # noqa: F811
    """Too few seen names (none; three), a run without vocabulary.json, training features not in the cache, a run
    without calibration.json asked for --calibrate auto: each one line; no calibration.json is written."""
    run = tmp_path / "run"
    shutil.copytree(linear_run, run)
    (run / "calibration.json").unlink(missing_ok=True)
    base = [str(run), "--threads", "1"]
    with pytest.raises(SystemExit) as e:
        align.calibrate([*base, "--classes", "pink hexagon,teal star"])
    assert "calibrate: 0 seen name(s); calibrating needs at least 4" in one_line(e)
    with pytest.raises(SystemExit) as e:
        align.calibrate([*base, "--classes", "red circle,blue square,green cross,pink hexagon"])
    assert "3 seen name(s): red circle, blue square, green cross; calibrating needs at least 4" in one_line(e)
    with pytest.raises(SystemExit) as e:
        align.calibrate([str(tiny_run), "--classes", ",".join(NAMES)])
    assert f"calibrate: {tiny_run} holds no vocabulary.json" in one_line(e)
    empty = tmp_path / "cache"                                 # the world, no features: another cache
    shutil.copytree(cache_dir / "world", empty / "world")
    with pytest.raises(SystemExit) as e:
        align.calibrate([*base, "--classes", ",".join(NAMES), "--cache-dir", str(empty)])
    assert f"the run's training images and texts (6000 pairs) have no features in the cache {empty}" in one_line(e)
    assert "--extract" in str(e.value) and not (empty / "features").exists()
    with pytest.raises(SystemExit) as e:
        align.calibrate([*base, "--classes", ",".join(NAMES), "--cache-dir", str(tmp_path / "gone")])
    assert f"the run's feature cache {tmp_path / 'gone'} is not a folder" in one_line(e)
    with pytest.raises(SystemExit) as e:
        aligned.main(["classify", str(run), str(photos), "--classes", "red circle", "--calibrate"])
    assert f"--calibrate auto: {run} holds no calibration.json" in one_line(e)
    (run / "calibration.json").write_text('{"gamma": "high"}')
    with pytest.raises(SystemExit) as e:
        aligned.main(["classify", str(run), str(photos), "--classes", "red circle", "--calibrate", "auto"])
    assert "calibration.json: ValueError: it holds no finite gamma" in one_line(e)
    (run / "calibration.json").unlink()
    assert not (run / "calibration.json").exists()


def test_the_pairs_calibrate_refits_on_are_the_pairs_the_run_aligned_on(finished_run, cache_dir):  # noqa: F811
    """A run of --num-pairs 512: align.calibration_pairs's (image rows, captions) are align.alignment_data's pairs."""
    config, model, _ = aligned.read_run(finished_run)
    args = align.calibration_args(config, model, cache_dir, 1)
    inputs = align.load_inputs(args, "cpu")
    F = align.training_features(args, inputs, extract=False)
    img, txt, rows, captions = align.calibration_pairs(args, inputs.sets["train"], F)
    want_img, want_txt, _ = align.alignment_data(args, inputs)
    assert len(captions) == len(rows) == 512 == config["alignment_pairs"]
    torch.testing.assert_close(img[rows].pooled, want_img.pooled.float(), rtol=0, atol=0)
    torch.testing.assert_close(txt.pooled, want_txt.pooled.float(), rtol=0, atol=0)
    train = inputs.sets["train"]
    assert [train.captions[int(i)] for i in align.pair_subset(args, len(train.captions))[1]] == captions


def test_the_command_line_runs_calibrate_and_a_fault_is_one_error_line(tmp_path):
    """python align.py calibrate ARGS (its own arguments after the command's name): -h says what it writes; a
    run folder that is not there is one line, exit status 1."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    run = lambda *args: subprocess.run([sys.executable, str(root / "align.py"), "calibrate", *args], cwd=tmp_path,
                                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    help_ = run("-h")
    assert help_.returncode == 0 and "RUN/calibration.json" in help_.stdout and "--classes-file" in help_.stdout
    gone = run(str(tmp_path / "gone"), "--classes", "red circle")
    assert gone.returncode == 1 and gone.stdout == ""
    assert gone.stderr.strip().splitlines() == [f"error: {tmp_path / 'gone'} is not a folder; pass a run folder of "
                                                f"align.py (results/<method>-<data>-seed<N>)"]


def test_the_refit_on_every_pair_the_run_aligned_on_is_the_run_bit_for_bit(cache_dir, tmp_path):
    """calibration.fitted at the run's config.json (class, keywords, epochs, batch, lr, weight decay, seed) on the
    pairs it aligned on (align.calibration_pairs, --num-pairs 1000) gives model.safetensors exactly: the folds
    refit with the run's own loop (linear_rs: its betas (0.9, 0.95) and grad_clip 1.0 included)."""
    from methods import METHODS
    out = tmp_path / "linear_rs"
    align.main(["--method", "linear_rs", "--epochs", "1", "--num-pairs", "1000", "--eval-images", "20", "--cache-dir",
                str(cache_dir), "--out", str(out), "--no-figures", "--threads", "1", "--quiet"])
    config, model, state = aligned.read_run(out)
    args = align.calibration_args(config, model, cache_dir, 1)
    inputs = align.load_inputs(args, "cpu")
    img, txt, rows, _ = align.calibration_pairs(args, inputs.sets["train"], align.training_features(args, inputs,
                                                                                                    False))
    loop = {k: config[k] for k in ("epochs", "batch_size", "lr", "weight_decay")}
    refit = calibration.fitted(METHODS["linear_rs"], aligned.hp_of(model), img[rows], txt, config["seed"], **loop)
    mine = refit.state_dict()
    assert set(mine) == set(state) and all(torch.equal(mine[k], state[k]) for k in state)
