"""Faults on the use surfaces (classify, search, table, aligned.load) and their writers, as a user meets them.

Each case plants one fault in a copy of a finished run, an image folder or a flag, runs the command in-process
and asserts one of two outcomes: a correct result ("ok"), or ONE `error:` line naming what is wrong (the
expected words) before any work. Every case also checks that nothing was lost: the run folder's files and
every file of the user's keep their bytes."""
import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import aligned

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(cache_dir, tmp_path_factory):
    """A finished default run (PAL on the Shapes world, one quick epoch) and three Shapes PNGs."""
    import align
    import shapes
    out = tmp_path_factory.mktemp("run") / "pal-shapes-seed0"
    align.main(["--epochs", "1", "--num-pairs", "512", "--eval-images", "20", "--cache-dir", str(cache_dir),
                "--out", str(out), "--no-figures", "--threads", "1", "--quiet"])
    images = tmp_path_factory.mktemp("images")
    s = shapes.cached_world(cache_dir)["cls"]
    for i in range(3):
        Image.fromarray(s.images[i].permute(1, 2, 0).numpy()).save(images / f"{'abc'[i]}.png")
    return out, images


def snapshot(*folders):
    """{path: bytes} of every file under folders (links as their own target's name)."""
    got = {}
    for f in folders:
        for p in Path(f).rglob("*"):
            if p.is_symlink():
                got[str(p)] = ("link", os.readlink(p))
            elif p.is_file():
                got[str(p)] = p.read_bytes()
    return got


def png(path, size=(64, 64)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, "red").save(path)
    return path


# --------------------------------------------------------------------------- the cases
# Each: (id, setup(r, imgs, t) -> argv, expected): r a writable copy of the run, imgs a copy of its images, t a
# scratch folder; expected "ok" or words of the error line.
def edit_config(r, **change):
    c = json.loads((r / "config.json").read_text())
    for key, value in change.items():
        *path, last = key.split("__")
        node = c
        for k in path:
            node = node[k]
        node[last] = value
    (r / "config.json").write_text(json.dumps(c))


def resealed(r):
    """r's model.safetensors sealed with its config.json's identity as it is now (an encoder found with other
    weights than the run's, as config.json's identity says, and not a config.json edited after the run)."""
    from safetensors.torch import load_file, save_file

    from infra.folder import identity_hash
    identity = json.loads((r / "config.json").read_text())["identity"]
    save_file(load_file(r / "model.safetensors"), r / "model.safetensors",
              metadata={"format": "pt", "identity": identity_hash(identity)})


def model_edit(key, value):
    def setup(r, imgs, t):
        c = json.loads((r / "config.json").read_text())
        c["model"][key] = value
        (r / "config.json").write_text(json.dumps(c))
        return cls(r, imgs)
    return setup


def cls(r, imgs, *more):
    return ["classify", str(r), str(imgs), "--classes", "red circle,blue square", *more]


def srch(r, imgs, *more):
    return ["search", str(r), str(imgs), "a red circle", *more]


def then(change, argv=cls):
    def setup(r, imgs, t):
        change(r, imgs, t)
        return argv(r, imgs)
    return setup


def write(path, data):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    (Path(path).write_bytes if isinstance(data, bytes) else Path(path).write_text)(data)


def truncate(path, n):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:n])


CASES = [
    # the run folder
    ("run missing", lambda r, i, t: cls(t / "nowhere", i), "is not a folder"),
    ("run is a file", lambda r, i, t: (write(t / "f", "x"), cls(t / "f", i))[1], "is not a folder"),
    ("run empty folder", lambda r, i, t: ((t / "e").mkdir(), cls(t / "e", i))[1], "config.json"),
    ("no config.json", then(lambda r, i, t: (r / "config.json").unlink()), "config.json"),
    ("config.json not JSON", then(lambda r, i, t: write(r / "config.json", "{oops")), "config.json"),
    ("config.json a list", then(lambda r, i, t: write(r / "config.json", "[1, 2]")), "config.json"),
    ("config.json no identity", then(lambda r, i, t: write(r / "config.json", "{}")), "no identity"),
    ("config.json a folder", then(lambda r, i, t: ((r / "config.json").unlink(), (r / "config.json").mkdir())),
     "config.json"),
    ("config.json not UTF-8", then(lambda r, i, t: write(r / "config.json", b"\xff\xfe\x00{")), "config.json"),
    ("unfinished run", then(lambda r, i, t: (r / "metrics.json").unlink()), "unfinished run"),
    ("no weights", then(lambda r, i, t: (r / "model.safetensors").unlink()), "model"),
    ("weights truncated", then(lambda r, i, t: truncate(r / "model.safetensors", 200)), "model.safetensors"),
    ("weights 0 bytes", then(lambda r, i, t: truncate(r / "model.safetensors", 0)), "model.safetensors"),
    ("weights random", then(lambda r, i, t: write(r / "model.safetensors", os.urandom(4096))), "model.safetensors"),
    ("weights a folder", then(lambda r, i, t: ((r / "model.safetensors").unlink(), (r / "model.safetensors").mkdir())),
     "model.safetensors"),
    ("method renamed", model_edit("method", "pal_v2"), "'pal_v2' is not one of this code's"),
    ("dims wrong", model_edit("dims", [7, 9]), "ok"),          # the saved tensors' shapes rebuild it (shaped_like)
    ("hp of the wrong type", model_edit("hp", {"K": "many"}), "config.json"),   # not its identity's hp
    ("image encoder unknown", model_edit("image_encoder", "no-such-encoder"), "not available offline"),
    ("text encoder a missing folder", model_edit("text_encoder", "/nonexistent/model"), "/nonexistent/model"),
    ("encoder of other weights", then(lambda r, i, t: (edit_config(r, identity__image_weights="0" * 16), resealed(r))),
     "other weights than the run was trained with"),
    ("weights of another identity", then(lambda r, i, t: edit_config(r, identity__seed=1)), "trained by another run"),
    ("run via a link", lambda r, i, t: (os.symlink(r, t / "link"), cls(t / "link", i))[1], "ok"),
    # the images
    ("images missing", lambda r, i, t: cls(r, t / "nowhere"), "no such file or folder"),
    ("images folder empty", lambda r, i, t: ((t / "e").mkdir(), cls(r, t / "e"))[1], "holds no image file"),
    ("only non-images", lambda r, i, t: (write(t / "d" / "notes.txt", "x"), cls(r, t / "d"))[1],
     "holds no image file"),
    ("a ._x.jpg beside", then(lambda r, i, t: write(i / "._a.png", b"\x00\x05\x16\x07junk")), "ok"),
    ("a hidden folder", then(lambda r, i, t: write(i / ".thumbs" / "x.png", "not an image")), "ok"),
    ("text named .png", then(lambda r, i, t: write(i / "z.png", "hello")), "z.png is unreadable"),
    ("0-byte image", then(lambda r, i, t: write(i / "z.png", b"")), "z.png is empty"),
    ("truncated png", then(lambda r, i, t: (png(i / "z.png", (300, 300)), truncate(i / "z.png", 120))), "z.png"),
    ("one image file", lambda r, i, t: cls(r, i / "a.png"), "ok"),
    ("several image files", lambda r, i, t: ["classify", str(r), str(i / "a.png"), str(i / "b.png"), "--classes",
                                            "a,b"], "ok"),
    ("nested folders", then(lambda r, i, t: png(i / "sub" / "deeper" / "d.png")), "ok"),
    ("a folder named x.jpg", then(lambda r, i, t: (i / "x.jpg").mkdir()), "ok"),
    ("a link to an image", then(lambda r, i, t: os.symlink(i / "a.png", i / "l.png")), "ok"),
    ("a dangling link", then(lambda r, i, t: os.symlink(t / "gone.png", i / "d.png")), "ok"),
    ("grayscale image", then(lambda r, i, t: Image.new("L", (40, 30)).save(i / "g.png")), "ok"),
    ("RGBA image", then(lambda r, i, t: Image.new("RGBA", (70, 50)).save(i / "g.png")), "ok"),
    ("palette image", then(lambda r, i, t: Image.new("P", (20, 20)).save(i / "g.png")), "ok"),
    ("CMYK jpeg", then(lambda r, i, t: Image.new("CMYK", (20, 20)).save(i / "g.jpg")), "ok"),
    ("1x1 image", then(lambda r, i, t: png(i / "g.png", (1, 1))), "ok"),
    ("upper-case suffix", then(lambda r, i, t: png(i / "G.PNG")), "ok"),
    # --classes, --classes-file, --template
    ("--classes empty", lambda r, i, t: ["classify", str(r), str(i), "--classes", ""], "names no class"),
    ("--classes commas only", lambda r, i, t: ["classify", str(r), str(i), "--classes", ",, ,"], "names no class"),
    ("no --classes", lambda r, i, t: ["classify", str(r), str(i)], "names no class"),
    ("--classes twice", lambda r, i, t: ["classify", str(r), str(i), "--classes", "a,b,a"], "'a' twice"),
    ("--classes unicode", lambda r, i, t: ["classify", str(r), str(i), "--classes", "café,naïve ✓"], "ok"),
    ("--classes-file", lambda r, i, t: (write(t / "c.txt", "red, dark circle\nblue square\n\n"),
                                        ["classify", str(r), str(i), "--classes-file", str(t / "c.txt")])[1], "ok"),
    ("--classes-file missing", lambda r, i, t: ["classify", str(r), str(i), "--classes-file", str(t / "no.txt")],
     "--classes-file"),
    ("--classes-file a folder", lambda r, i, t: ["classify", str(r), str(i), "--classes-file", str(t)],
     "--classes-file"),
    ("--classes-file binary", lambda r, i, t: (write(t / "c.txt", b"\xff\xfe\xfa"),
                                               ["classify", str(r), str(i), "--classes-file", str(t / "c.txt")])[1],
     "--classes-file"),
    ("--classes-file empty", lambda r, i, t: (write(t / "c.txt", "\n\n"),
                                              ["classify", str(r), str(i), "--classes-file", str(t / "c.txt")])[1],
     "names no class"),
    ("--template without {}", lambda r, i, t: cls(r, i, "--template", "a photo"), "--template 'a photo'"),
    ("--template two {}", lambda r, i, t: cls(r, i, "--template", "{} and {}"), "--template"),
    ("--template {0}", lambda r, i, t: cls(r, i, "--template", "a {0}"), "--template"),
    ("--template {x}", lambda r, i, t: cls(r, i, "--template", "a {x} {}"), "--template"),
    ("--template ok", lambda r, i, t: cls(r, i, "--template", "a photo of a {}."), "ok"),
    # search
    ("empty query", lambda r, i, t: ["search", str(r), str(i), ""], "a query is empty"),
    ("blank query", lambda r, i, t: ["search", str(r), str(i), "   "], "a query is empty"),
    ("--top 0", lambda r, i, t: srch(r, i, "--top", "0"), "--top 0"),
    ("--top -1", lambda r, i, t: srch(r, i, "--top", "-1"), "--top -1"),
    ("--top beyond the images", lambda r, i, t: srch(r, i, "--top", "99"), "ok"),
    ("three queries", lambda r, i, t: ["search", str(r), str(i), "a red circle", "a blue square", "green"], "ok"),
    ("search one file", lambda r, i, t: ["search", str(r), str(i / "a.png"), "a red circle"], "ok"),
    ("search unfinished run", lambda r, i, t: ((r / "metrics.json").unlink(), srch(r, i))[1], "unfinished run"),
    # --device
    ("--device cuda, no GPU", lambda r, i, t: cls(r, i, "--device", "cuda"), "no CUDA GPU"),
    ("--device auto", lambda r, i, t: cls(r, i, "--device", "auto"), "ok"),
    # --csv: the writer
    ("--csv a new file", lambda r, i, t: cls(r, i, "--csv", str(t / "out.csv")), "ok"),
    ("--csv stdout", lambda r, i, t: cls(r, i, "--csv", "-"), "ok"),
    ("--csv onto a file", lambda r, i, t: (write(t / "mine.csv", "mine"), cls(r, i, "--csv", str(t / "mine.csv")))[1],
     "exists; pass a new file name"),
    ("--csv onto the run's metrics", lambda r, i, t: cls(r, i, "--csv", str(r / "metrics.json")), "exists"),
    ("--csv onto the run's config", lambda r, i, t: srch(r, i, "--csv", str(r / "config.json")), "exists"),
    ("--csv a link", lambda r, i, t: (write(t / "victim", "v"), os.symlink(t / "victim", t / "l.csv"),
                                      cls(r, i, "--csv", str(t / "l.csv")))[2], "exists"),
    ("--csv a dangling link", lambda r, i, t: (os.symlink(t / "nothing", t / "l.csv"),
                                               cls(r, i, "--csv", str(t / "l.csv")))[1], "exists"),
    ("--csv a folder", lambda r, i, t: cls(r, i, "--csv", str(t)), "exists"),
    ("--csv in a missing folder", lambda r, i, t: cls(r, i, "--csv", str(t / "no" / "x.csv")), "does not exist"),
    ("--csv a 300-char name", lambda r, i, t: cls(r, i, "--csv", str(t / ("x" * 300))), "cannot write"),
    # table
    ("table missing path", lambda r, i, t: ["table", str(t / "nowhere")], "no such folder"),
    ("table no runs", lambda r, i, t: ["table", str(t)], "no finished run"),
    ("table a run", lambda r, i, t: ["table", str(r)], "ok"),
    ("table a foreign folder beside", lambda r, i, t: (write(r.parent / "theirs" / "metrics.json", "{}"),
                                                       ["table", str(r.parent)])[1], "ok"),
    ("table a corrupt metrics beside", lambda r, i, t: (shutil.copytree(r, r.parent / "broken"),
                                                        write(r.parent / "broken" / "metrics.json", "{x"),
                                                        ["table", str(r.parent)])[2], "ok"),
    ("table an unfinished run", lambda r, i, t: ((r / "metrics.json").unlink(), ["table", str(r)])[1],
     "no finished run"),
    ("table --csv onto a run's file", lambda r, i, t: ["table", str(r), "--csv", str(r / "metrics.json")], "exists"),
    ("table --csv new", lambda r, i, t: ["table", str(r), "--csv", str(t / "t.csv")], "ok"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,setup,expected", CASES, ids=[c[0] for c in CASES])
def test_a_command_fault_is_a_correct_result_or_one_line(run, tmp_path, capsys, name, setup, expected):
    src, images = run
    r, imgs, t = tmp_path / "runs" / src.name, tmp_path / "imgs", tmp_path / "t"
    shutil.copytree(src, r, symlinks=True)
    shutil.copytree(images, imgs)
    t.mkdir()
    argv = setup(r, imgs, t)
    before = snapshot(r.parent, imgs, t)
    try:
        aligned.main(argv)
        outcome = "ok"
    except SystemExit as stop:
        outcome = str(stop.code)
    capsys.readouterr()
    if expected == "ok":
        assert outcome == "ok", outcome
    else:
        one_line = "\n" not in outcome or "hf download" in outcome    # encoders.py's offline hint: a command to run
        assert outcome.startswith("error: ") and one_line and expected in outcome, outcome
    after = snapshot(r.parent, imgs, t)
    lost = {p: "changed" for p, b in before.items() if after.get(p) != b}
    assert not lost, lost                                          # nothing of the run's or the user's touched


def test_load_refuses_a_folder_that_is_not_a_run_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: .* is not a folder"):
        aligned.load(tmp_path / "nowhere")
    with pytest.raises(SystemExit, match="config.json"):
        aligned.load(tmp_path)


@pytest.mark.slow
def test_the_csv_and_the_lines_agree(run, tmp_path, capsys):
    """classify's CSV: a header, one row per image, the class with the best score, every class's score."""
    src, images = run
    aligned.main(["classify", str(src), str(images), "--classes", "red circle,blue square", "--csv",
                  str(tmp_path / "c.csv")])
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert len(rows) == 3 and set(rows[0]) == {"image", "class", "score", "red circle", "blue square"}
    for row in rows:
        best = max(("red circle", "blue square"), key=lambda c: float(row[c]))
        assert row["class"] == best and float(row["score"]) == pytest.approx(float(row[best]))
    assert torch.get_num_threads() >= 1
