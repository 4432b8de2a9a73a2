"""Faults found by a sweep of cases no code listed (each failed before its fix): file names that are not
UTF-8, linked and unreadable folders in an image walk, a closed pipe (`| head`), a --calibrate gamma beyond
float32, --csv / --json into a folder that cannot be written or onto one file through a link, another run's
index or a user's own file where an index goes, an index holding NaN, runs deep in a results folder or of
one name, a '|' in a run's name, --out inside a finished run or the cache, and a run folder edited by hand
(model.hp, its layers, integer weights, weights of another run); and the load API's images and texts (a PIL
image read unlike its file, float or (H, W, 3) pixels, empty lists, a query of no word, a template without {},
class names that read the same). A second sweep: image suffixes and other files in a folder, a file named twice, a
newline in a name, punctuation for a class or a query, a query naming a file, an empty --csv, stdout full, closed
or ASCII-only, a long list of novel names, a library's warning, and the API given None, numpy pixels, a folder, a
list for one query or one template string. Each: a correct result, or one `error:` line before the work, nothing
lost."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_command_faults import run, snapshot  # noqa: F401  (the module's finished run and its three PNGs)
from test_command_faults2 import copy, fails  # noqa: F401

import aligned

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["--classes", "red circle,blue square", "--threads", "1"]


def test_a_file_name_that_is_not_utf8_is_one_line(copy):
    r, imgs, t = copy
    os.rename(imgs / "a.png", os.fsencode(str(imgs)) + b"/bad\xffname.png")
    fails(["classify", str(r), str(imgs), *CLASSES], "bad\\udcffname.png", "not valid UTF-8", "rename it")


def test_a_linked_folder_is_walked_and_a_link_loop_ends(copy, capsys):
    r, imgs, t = copy
    (t / "2023").mkdir()
    shutil.move(imgs / "c.png", t / "2023" / "c.png")
    (imgs / "2023").symlink_to(t / "2023")                     # a folder of photos kept elsewhere
    (t / "2023" / "loop").symlink_to(imgs)                      # and a link back up
    aligned.main(["classify", str(r), str(imgs), *CLASSES])
    out = capsys.readouterr().out.splitlines()
    assert sorted(Path(line.split()[0]).name for line in out) == ["a.png", "b.png", "c.png"]


def test_a_folder_that_cannot_be_read_is_one_line_not_left_out(copy, monkeypatch):
    r, imgs, t = copy
    (imgs / "sub").mkdir()
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(PermissionError(13, "Permission denied", p))
                        if str(p).endswith("sub") else scandir(p))     # root reads any folder: a user could not
    fails(["classify", str(r), str(imgs), *CLASSES], f"{imgs / 'sub'} cannot be read", "chmod")


def test_a_closed_pipe_ends_quietly():
    code = ("import aligned; aligned.table = lambda a: (_ for _ in ()).throw(BrokenPipeError(32, 'Broken pipe')); "
            "aligned.main(['table', '.'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (0, "")


@pytest.mark.parametrize("gamma", ["1e39", "-1e39", "2000"])
def test_a_gamma_beyond_the_scores_is_one_line(copy, gamma):
    r, imgs, t = copy
    fails(["classify", str(r), str(imgs), *CLASSES, f"--calibrate={gamma}"], f"--calibrate {float(gamma)}",
          "finite number, at most 1000")


def test_csv_into_a_folder_that_cannot_be_written_is_refused_before_the_work(copy, monkeypatch):
    r, imgs, t = copy
    monkeypatch.setattr(aligned, "load", lambda *a, **k: pytest.fail("the work began before the refusal"))
    monkeypatch.setattr(aligned.os, "access", lambda p, mode: Path(p) != t)   # as root, every folder is writable
    fails(["classify", str(r), str(imgs), *CLASSES, "--csv", str(t / "o.csv")], f"its folder {t} cannot be written")


def test_csv_and_json_naming_one_file_through_a_link_are_refused(copy):
    r, imgs, t = copy
    (t / "real").mkdir()
    (t / "alias").symlink_to(t / "real")
    fails(["classify", str(r), str(imgs), *CLASSES, "--csv", str(t / "real/o"), "--json", str(t / "alias/o")],
          "both name")


def reweighted(folder):
    """folder's weights moved a little (another training of the same run), its seal kept."""
    path = folder / "model.safetensors"
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    state = load_file(str(path))
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key] = state[key] + 1e-2
    save_file(state, str(path), metadata=meta)


def test_another_runs_index_is_never_written_over(copy, capsys):
    r0, imgs, t = copy
    r1 = t / "r1"
    shutil.copytree(r0, r1)
    reweighted(r1)
    aligned.main(["index", str(r1), str(imgs), "--threads", "1"])
    before = snapshot(r1)
    fails(["index", str(r0), str(imgs), "--threads", "1", "--index", str(r1 / "index")], "another run",
          "not written over", "--index a new folder")
    assert snapshot(r1) == before


def test_a_users_own_file_where_the_index_goes_is_left_as_it_is(copy):
    r, imgs, t = copy
    save_file({"w": torch.ones(2)}, str(t / "images.safetensors"))
    before = snapshot(t)
    text = fails(["index", str(r), str(imgs), "--threads", "1", "--index", str(t)], "no image index of this project",
                 "--index a folder of its own")
    assert "rm " not in text and snapshot(t) == before


def test_an_index_holding_nan_names_the_index(copy):
    r, imgs, t = copy
    aligned.main(["index", str(r), str(imgs), "--threads", "1"])
    path = r / "index" / "images.safetensors"
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta, emb = f.metadata(), f.get_tensor("emb")
    emb[1] = float("nan")
    save_file({"emb": emb}, str(path), metadata=meta)
    fails(["classify", str(r), str(imgs), *CLASSES], str(path), "NaN")


def fake_run(folder, rsum):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"identity": {"method": "pal"}, "method": "pal", "data": "shapes",
                                                    "seed": 0, "epochs": 1}))
    (folder / "metrics.json").write_text(json.dumps({"retrieval": {"rsum": rsum}}))


def test_table_finds_deep_runs_tells_runs_of_one_name_apart_and_escapes_bars(tmp_path, capsys):
    fake_run(tmp_path / "a" / "pal-shapes-seed0", 1.0)
    fake_run(tmp_path / "b" / "pal-shapes-seed0", 2.0)
    fake_run(tmp_path / "1" / "2" / "3" / "4" / "5" / "deep", 3.0)
    fake_run(tmp_path / "pal|k=64", 4.0)
    aligned.main(["table", str(tmp_path)])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 4 and all(row.replace("\\|", "").count("|") == 7 for row in rows), rows
    assert any("deep" in row for row in rows) and any("pal\\|k=64" in row for row in rows)
    assert sum(f"{tmp_path / 'a' / 'pal-shapes-seed0'} |" in row or f"{tmp_path / 'b' / 'pal-shapes-seed0'} |" in row
               for row in rows) == 2


def test_table_says_a_folder_it_cannot_read(tmp_path, capsys, monkeypatch):
    fake_run(tmp_path / "ok", 1.0)
    (tmp_path / "locked").mkdir()
    iterdir = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda p: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                        if p.name == "locked" else iterdir(p))
    aligned.main(["table", str(tmp_path)])
    out = capsys.readouterr()
    assert "| ok |" in out.out and "left out 1 folder" in out.err and "locked" in out.err


def test_out_inside_a_finished_run_or_the_cache_is_refused_before_any_work(run, cache_dir):  # noqa: F811
    import align
    r, _ = run
    for out, says in ((r / "sub", "inside the run folder"), (cache_dir / "a-run", "inside --cache-dir")):
        with pytest.raises(SystemExit, match=f"^error: --out {out} is {says}"):
            align.main(["--epochs", "1", "--cache-dir", str(cache_dir), "--out", str(out), "--threads", "1"])
        assert not out.exists()


@pytest.mark.parametrize("key, value, says", [
    (("hp", "tau_p"), 3.0, "model.hp tau_p is 3.0, its identity's 0.03"),
    (("image_layer",), "last", "not whole numbers"),
    (("image_layer",), 2, "model.image_layer reads layer 2 of shapes-cnn, the run was trained on layer 4")])
def test_a_config_json_edited_by_hand_is_one_line_naming_it(copy, key, value, says):
    r, imgs, t = copy
    config = json.loads((r / "config.json").read_text())
    config["model"][key[0]] = value if len(key) == 1 else {**config["model"][key[0]], key[1]: value}
    (r / "config.json").write_text(json.dumps(config))
    fails(["classify", str(r), str(imgs), *CLASSES], "config.json", says)


def test_an_encoder_name_edited_in_config_json_is_one_line_naming_config_json_not_a_flag(copy):
    r, imgs, t = copy
    config = json.loads((r / "config.json").read_text())
    config["model"]["text_encoder"] = "shapes-cnn"                 # the image encoder's name: no text encoder
    (r / "config.json").write_text(json.dumps(config))
    said = fails(["classify", str(r), str(imgs), *CLASSES], "config.json: its encoders do not load here",
                 "model.text_encoder")
    assert "--text-encoder" not in said


@pytest.mark.parametrize("fault", ["integer", "another run"])
def test_weights_changed_by_hand_or_of_another_run_are_one_line(copy, fault):
    r, imgs, t = copy
    path = r / "model.safetensors"
    state = load_file(str(path))
    if fault == "integer":
        state = {k: v.to(torch.int32) if v.is_floating_point() else v for k, v in state.items()}
        save_file(state, str(path), metadata={"format": "pt"})
        fails(["classify", str(r), str(imgs), *CLASSES], "model.safetensors", "not floating point")
    else:                                               # another run's weights: sealed with its own identity
        save_file(state, str(path), metadata={"format": "pt", "identity": "0" * 16})
        fails(["classify", str(r), str(imgs), *CLASSES], "model.safetensors", "trained by another run")


@pytest.fixture(scope="module")
def model(run):  # noqa: F811
    return aligned.load(run[0])


def test_a_pil_image_is_read_as_its_file_is(model, tmp_path):
    from PIL import Image
    rgba = Image.new("RGBA", (64, 64), (0, 0, 255, 0))
    rgba.paste((255, 0, 0, 255), (16, 16, 48, 48))
    rgba.save(tmp_path / "t.png")
    exif = Image.Exif()
    exif[0x0112] = 6                                            # rotated 90 degrees
    tall = Image.new("RGB", (48, 64), "white")
    tall.paste((0, 128, 0), (0, 0, 48, 20))
    tall.save(tmp_path / "r.jpg", exif=exif.tobytes(), quality=95)
    for name in ("t.png", "r.jpg"):
        with Image.open(tmp_path / name) as im:
            im.load()
            assert torch.equal(model.encode_image(im), model.encode_image(tmp_path / name)), name


@pytest.mark.parametrize("images, says", [
    (torch.rand(3, 64, 64), "torch.float32 (3, 64, 64): pass uint8 pixels"),
    (torch.zeros(64, 64, 3, dtype=torch.uint8), "x.permute(2, 0, 1)"),
    ([], "no image given")])
def test_an_image_the_api_cannot_read_as_pixels_is_one_line(model, images, says):
    with pytest.raises(SystemExit, match=r"^error: .*" + __import__("re").escape(says)):
        model.encode_image(images)


@pytest.mark.parametrize("call, says", [
    (lambda m: m.search(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), ""), "is empty or missing"),
    (lambda m: m.encode_text([]), "is empty or missing"),
    (lambda m: m.search(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), "..."), "holds no word"),
    (lambda m: m.classes(["red circle"], ["a photo"]), "holds {} once"),
    (lambda m: m.classes(["red circle"], ["{0} and {1}"]), "holds {} once"),
    (lambda m: m.classes(["zebra", "giraffe"]), "read the same to the text encoder"),
    (lambda m: m.classes(["Red circle", "red  circle"]), "read the same to the text encoder")])
def test_a_text_the_api_cannot_score_is_one_line(model, call, says):
    with pytest.raises(SystemExit, match=r"^error: .*" + __import__("re").escape(says)):
        call(model)


def test_calibrate_into_a_run_folder_that_cannot_be_written_is_refused_before_the_refits(copy, monkeypatch):
    import align
    r, imgs, t = copy
    monkeypatch.setattr(align.os, "access", lambda p, mode: Path(p) != r)     # as root, every folder is writable
    monkeypatch.setattr(align, "load_inputs", lambda *a, **k: pytest.fail("the refits began before the refusal"))
    with pytest.raises(SystemExit, match=f"^error: calibrate: {r} cannot be written"):
        align.calibrate([str(r), "--classes", "red circle,blue square,green circle,yellow square,purple triangle"])


# --------------------------------------------------------------- a second outside sweep (each failed before its fix)
def test_images_of_other_suffixes_are_read_and_other_files_are_said(copy, capsys):
    r, imgs, t = copy
    from PIL import Image
    Image.open(imgs / "a.png").convert("RGB").save(imgs / "a.jfif", format="JPEG")    # a browser's JPEG
    Image.open(imgs / "b.png").convert("RGB").save(imgs / "b.ppm")
    (imgs / "IMG_0001.heic").write_bytes(b"\0" * 64)                                 # a format not read here
    aligned.main(["classify", str(r), str(imgs), *CLASSES])
    out, err = capsys.readouterr()
    assert sorted(Path(line.split()[0]).name for line in out.splitlines()) == \
        ["a.jfif", "a.png", "b.png", "b.ppm", "c.png"]
    assert "1 file(s) under" in err and "IMG_0001.heic" in err


def test_a_file_named_twice_is_one_image_and_a_name_with_a_newline_is_one_line(copy, capsys):
    r, imgs, t = copy
    shutil.copy(imgs / "a.png", imgs / "new\nline.png")
    aligned.main(["classify", str(r), str(imgs), str(imgs) + "/", str(imgs / "a.png"), *CLASSES])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and any(line.startswith(str(imgs / "new\\nline.png")) for line in out)


def test_a_query_that_names_a_file_and_an_empty_csv_are_refused(copy):
    r, imgs, t = copy
    fails(["search", str(r), str(imgs / "a.png"), str(imgs / "b.png")], "is a file or folder", "one folder")
    fails(["classify", str(r), str(imgs), *CLASSES, "--csv", ""], "--csv '' names no file")
    fails(["classify", str(r), str(imgs), "--classes", "!!!,red circle"], "'!!!', which holds no word")
    fails(["search", str(r), str(imgs), "???"], "'???' holds no word")


def test_a_long_list_of_novel_names_is_cut(copy, capsys):
    r, imgs, t = copy
    names = ",".join(f"zebra{i}" for i in range(100))
    with pytest.raises(SystemExit):       # tied (unknown words to the tiny text encoder): the notice comes first
        aligned.main(["classify", str(r), str(imgs), "--classes", names, "--threads", "1"])
    notice = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("[classes]"))
    assert "100 novel" in notice and "(80 more)" in notice and len(notice) < 400


def test_stdout_full_closed_or_ascii_is_one_line_or_escaped(run):  # noqa: F811
    argv = [sys.executable, "align.py", "classify", str(run[0]), str(run[1]), *CLASSES]
    with open("/dev/full", "w") as full:
        r = subprocess.run(argv, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: cannot write the results to "
                                                                               "standard output")
    r = subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 1 and "standard output is closed" in r.stderr
    imgs = Path(run[1]).parent / "café"
    imgs.mkdir(exist_ok=True)
    shutil.copy(Path(run[1]) / "a.png", imgs / "é.png")
    r = subprocess.run(argv[:4] + [str(imgs)] + argv[5:], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and "caf\\xe9/\\xe9.png" in r.stdout, r.stderr


@pytest.mark.parametrize("call, says", [
    (lambda m: m.encode_image(None), "images None: pass a path"),
    (lambda m: m.encode_image(["x.png", None]), "an image of type NoneType"),
    (lambda m: m.encode_image(Path(__file__).parent), "is a folder; pass its image files"),
    (lambda m: m.search(torch.zeros(1, 3, 64, 64, dtype=torch.uint8), ["a", "b"]), "one query (a string)"),
    (lambda m: aligned.load(None), "run_folder None"),
    (lambda m: aligned.load(b"results"), "run_folder b'results'"),
    (lambda m: m.classes(["!!!", "red circle"]), "the class name '!!!' holds no word")])
def test_an_api_call_of_the_wrong_type_is_one_line(model, call, says):
    with pytest.raises(SystemExit, match=r"^error: .*" + __import__("re").escape(says)):
        call(model)


def test_numpy_pixels_and_one_template_string_read_as_a_user_means(model, run):  # noqa: F811
    import numpy as np
    from PIL import Image
    png = Path(run[1]) / "a.png"
    hwc = np.asarray(Image.open(png).convert("RGB"))
    want = model.encode_image(png)
    assert torch.equal(model.encode_image(hwc), want) and torch.equal(model.encode_image(hwc[None])[0], want[0])
    names = ["red circle", "blue square"]
    assert torch.equal(model.zero_shot(png, names, templates="a photo of a {}."),
                       model.zero_shot(png, names, templates=["a photo of a {}."]))


def test_a_librarys_warning_is_one_line(copy, capsys, monkeypatch):
    from PIL import Image
    r, imgs, t = copy
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)      # 64 x 64 = 4,096 pixels: PIL's bomb warning, no error
    aligned.main(["classify", str(r), str(imgs / "a.png"), *CLASSES])
    err = capsys.readouterr().err
    assert "warning: Image size (4096 pixels) exceeds limit" in err and "warnings.warn" not in err, err
