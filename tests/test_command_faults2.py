"""More faults on the use surfaces, found by benchmarks/fault_sweep.py (each failed before its fix): a run's
config.json with a malformed identity or templates, --classes with --classes-file, a --classes-file with a
byte-order mark or that is a fifo, --csv and --json on one file or on a folder's name, an encoder's notice
on stdout, an index of another width, two index calls at once, a --device torch has no backend for, runs
nested in a results folder. Each: a correct result, or one `error:` line before any work, nothing lost."""
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_command_faults import run, snapshot  # noqa: F401  (the module's finished run and its three PNGs)

import aligned

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def copy(run, tmp_path):  # noqa: F811
    """A writable copy of the run and its images, a scratch folder, and what they held before."""
    src, images = run
    r, imgs, t = tmp_path / "runs" / src.name, tmp_path / "imgs", tmp_path / "t"
    shutil.copytree(src, r)
    shutil.copytree(images, imgs)
    t.mkdir()
    return r, imgs, t


def fails(argv, *words, before=None, capsys=None):
    """argv ends in one error line holding words."""
    with pytest.raises(SystemExit) as stop:
        aligned.main(argv)
    text = str(stop.value.code)
    assert text.startswith("error: ") and "\n" not in text and all(w in text for w in words), text
    return text


def no_work(monkeypatch):
    """load() must not be reached: the fault is said before any encoder loads."""
    monkeypatch.setattr(aligned, "load", lambda *a, **k: pytest.fail("the work began before the refusal"))


def edit_model(r, key, value):
    c = json.loads((r / "config.json").read_text())
    c["model"][key] = value
    (r / "config.json").write_text(json.dumps(c))


@pytest.mark.slow
@pytest.mark.parametrize("templates", [["a photo of a {x}."], ["a photo"], "a photo of a {}.", [3]])
def test_a_runs_malformed_templates_are_one_line_naming_config_json(copy, templates):
    r, imgs, t = copy
    edit_model(r, "templates", templates)
    before = snapshot(r, imgs)
    fails(["classify", str(r), str(imgs), "--classes", "a,b"], "config.json", "templates")
    assert snapshot(r, imgs) == before


def test_a_config_whose_identity_is_not_a_dict_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"identity": [1]}))
    with pytest.raises(SystemExit, match=r"^error: .*config.json.*no identity"):
        aligned.load(tmp_path)


@pytest.mark.slow
def test_classes_with_classes_file_is_refused(copy, monkeypatch):
    r, imgs, t = copy
    (t / "c.txt").write_text("cat\ndog\n")
    no_work(monkeypatch)
    fails(["classify", str(r), str(imgs), "--classes", "a,b", "--classes-file", str(t / "c.txt")],
          "--classes and --classes-file")


@pytest.mark.slow
def test_a_classes_file_with_a_byte_order_mark_names_its_classes_without_it(copy, capsys):
    r, imgs, t = copy
    (t / "c.txt").write_bytes("\ufeffred circle\r\nblue square\n".encode("utf-8"))
    aligned.main(["classify", str(r), str(imgs), "--classes-file", str(t / "c.txt"), "--json", "-"])
    records = json.loads(capsys.readouterr().out)
    assert set(records[0]["scores"]) == {"red circle", "blue square"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no fifos here")
def test_a_classes_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "c.txt")
    a = aligned.parse_args(["classify", "run", "imgs", "--classes-file", str(tmp_path / "c.txt")])
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(SystemExit, aligned.class_names, a)),
                              daemon=True)
    reader.start()
    reader.join(10)
    if not done:                                  # it waits for a writer: let it go, and fail
        with open(tmp_path / "c.txt", "w") as f:
            f.write("x\n")
        pytest.fail("--classes-file a fifo: read, waiting for a writer")
    assert "not a regular file" in str(done[0].value)


def test_csv_and_json_on_one_file_or_a_folders_name_are_refused_before_any_work(tmp_path, monkeypatch):
    no_work(monkeypatch)
    same = str(tmp_path / "out")
    fails(["classify", "run", "imgs", "--classes", "a", "--csv", same, "--json", same], "--csv and --json", same)
    fails(["search", "run", "imgs", "q", "--csv", str(tmp_path / "out.csv"), "--json",
           str(tmp_path / "." / "out.csv")], "--csv and --json")
    fails(["classify", "run", "imgs", "--classes", "a", "--csv", str(tmp_path / "out") + "/"], "names a folder")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_an_encoders_notice_goes_to_stderr_not_into_the_results(copy, capsys):
    """A query longer than the text encoder reads: its "[text] ... cut" notice on stderr; --csv - is CSV."""
    r, imgs, t = copy
    aligned.main(["search", str(r), str(imgs), "red circle " * 100, "--csv", "-"])
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 4 and captured.out.startswith("rank,score,image"), captured.out
    assert "[text]" in captured.err


@pytest.mark.slow
@pytest.mark.parametrize("one_new", [True, False], ids=["beside-a-new-image", "every-row-from-it"])
def test_an_index_of_another_width_is_one_line(copy, one_new):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    r, imgs, t = copy
    aligned.main(["index", str(r), str(imgs)])
    p = r / "index" / "images.safetensors"
    with safe_open(str(p), "pt") as f:
        meta, emb = f.metadata(), f.get_tensor("emb")
    save_file({"emb": torch.zeros(len(emb), 7)}, str(p), metadata=meta)   # the run's key, another width
    if one_new:
        shutil.copy(imgs / "a.png", imgs / "new.png")                       # and one image to encode beside it
    fails(["classify", str(r), str(imgs), "--classes", "a,b"], str(p), "index again")


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["folder", "link"])
def test_an_index_target_that_is_a_link_or_folder_is_refused_before_any_work(copy, monkeypatch, planted):
    r, imgs, t = copy
    target = r / "index" / "images.safetensors"
    target.parent.mkdir()
    if planted == "folder":
        target.mkdir()
    else:
        (t / "mine").write_text("mine")
        os.symlink(t / "mine", target)
    no_work(monkeypatch)
    fails(["index", str(r), str(imgs)], str(target), "a link" if planted == "link" else "not a regular file")
    assert planted == "folder" or (t / "mine").read_text() == "mine"


@pytest.mark.slow
def test_two_index_calls_at_once_keep_both_folders(copy):
    """The second call waits for the first (a lock beside the index) and adds to what it wrote: no update lost."""
    r, imgs, t = copy
    more = t / "more"
    more.mkdir()
    for n, f in enumerate(sorted(imgs.iterdir())):
        shutil.copy(f, more / f"m{n}.png")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    calls = [subprocess.Popen([sys.executable, "align.py", "index", str(r), str(folder), "--threads", "1"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for folder in (imgs, more)]
    for c in calls:
        out, err = c.communicate(timeout=300)
        assert c.returncode == 0, err.decode()[-2000:]
    index = aligned.Index.load(r / "index")
    assert len(index) == 6 and {p.parent for p in index.paths} == {imgs.absolute(), more.absolute()}


def test_a_device_torch_has_no_backend_for_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: --device mps: give cpu, cuda"):
        aligned.load(tmp_path, device="mps")


@pytest.mark.slow
def test_zero_shot_without_class_names_is_one_line(run):  # noqa: F811
    src, images = run
    model = aligned.load(src)
    for names in ([], "cat"):
        with pytest.raises(SystemExit, match="pass a list of at least one class name"):
            model.zero_shot([images / "a.png"], names)


@pytest.mark.slow
def test_table_finds_runs_nested_in_a_results_folder(copy, capsys):
    """results/<group>/<run> as well as results/<run>; a link loop inside is not walked."""
    r, imgs, t = copy
    results = t / "results"
    shutil.copytree(r, results / "top-run")
    shutil.copytree(r, results / "group" / "deep-run")
    os.symlink(results, results / "group" / "loop")
    aligned.main(["table", str(results)])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| deep-run |") and rows[1].startswith("| top-run |"), rows


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no fifos here")
def test_a_run_whose_config_json_is_a_fifo_is_one_line_not_a_wait(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"^error: .*config.json: ValueError: it is not a regular file"):
        aligned.load(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no fifos here")
def test_table_leaves_out_a_folder_whose_metrics_json_is_a_fifo(copy, capsys):
    r, imgs, t = copy
    odd = r.parent / "odd"
    odd.mkdir()
    shutil.copy(r / "config.json", odd / "config.json")
    os.mkfifo(odd / "metrics.json")
    aligned.main(["table", str(r.parent)])
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3 and f"| {r.name} |" in captured.out and "odd" in captured.err


def test_load_with_a_cache_dir_that_is_not_a_folder_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: cache_dir .*no-cache is not a folder"):
        aligned.load(tmp_path, cache_dir=tmp_path / "no-cache")
