"""The image index and the commands' pipeline (aligned.py): `align.py index` keeps a folder's embeddings keyed
by path, size, mtime and ctime, a second call encodes only what changed, classify and search read it and agree with a
call without it; the threaded pipeline gives encode_image's values; --top's probabilities are the softmax at
the method's own logit scale; --json writes one record per image through the write gate."""
import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import aligned
from infra import folder
from methods import METHODS

CLASSES = ["red circle", "blue square", "green triangle"]


@pytest.fixture(scope="module")
def tiny_run(cache_dir, tmp_path_factory):
    """A finished run folder written by hand (no training): linear heads at their seeded init on the Shapes
    encoders, config.json's "model" and a metrics.json, as align.py writes them."""
    import encoders
    image_enc, text_enc = encoders.load_encoders("shapes-cnn", "shapes-text", cache_dir)
    torch.manual_seed(0)
    method = METHODS["linear"](image_enc.dim, text_enc.dim)
    run = tmp_path_factory.mktemp("run") / "linear-shapes-seed0"
    run.mkdir()
    folder.save_weights(method, run / "model.safetensors")
    model = dict(method="linear", hp={}, dims=[image_enc.dim, text_enc.dim], image_encoder="shapes-cnn",
                 text_encoder="shapes-text", image_layer=-1, text_layer=-1, cache_dir=str(cache_dir),
                 templates=folder.templates_of("shapes"))
    (run / "config.json").write_text(json.dumps({"identity": {"method": "linear"}, "model": model}))
    (run / "metrics.json").write_text("{}")
    return run


@pytest.fixture
def photos(cache_dir, tmp_path):
    """9 Shapes images as PNG files in a folder with a nested subfolder."""
    import shapes
    s = shapes.cached_world(cache_dir)["cls"]
    root = tmp_path / "photos"
    for i in range(9):
        sub = root / ("" if i < 4 else "trip/day2")
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(s.images[i].permute(1, 2, 0).numpy()).save(sub / f"{i}.png")
    return root


@pytest.fixture
def encoded(monkeypatch):
    """The files each encode_files call was given (the images a command actually encoded)."""
    calls = []
    real = aligned.Aligned.encode_files

    def counting(self, files, **kw):
        calls.append([str(f) for f in files])
        return real(self, files, **kw)
    monkeypatch.setattr(aligned.Aligned, "encode_files", counting)
    return calls


def test_the_pipeline_gives_encode_images_values_and_an_eta(tiny_run, cache_dir, photos, monkeypatch, capsys):
    """Worker threads decoding batches ahead of the forward: encode_image's embeddings in the files' order, to
    float rounding, whatever the batch size and workers; the progress line on stderr has a rate and an ETA."""
    model = aligned.load(tiny_run, cache_dir=cache_dir)
    files = aligned.image_files([photos])
    want = model.encode_image(files)
    monkeypatch.setattr(folder, "FIRST", 0.0)
    for batch_size, workers in ((1, 1), (2, 3), (32, 2)):
        got = model.encode_files(files, batch_size=batch_size, workers=workers)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    err = capsys.readouterr().err
    assert "[images]" in err and "images/s" in err and "ETA" in err


def test_index_then_classify_and_search_read_it(tiny_run, photos, tmp_path, encoded, capsys):
    """`index` writes RUN/index/images.safetensors keyed by each file's absolute path, size, mtime and ctime; classify
    and search then encode no image and print what a call without the index prints."""
    no_index = ["--index", str(tmp_path / "none")]
    aligned.main(["classify", str(tiny_run), str(photos), "--classes", ",".join(CLASSES), "--top", "2", *no_index])
    aligned.main(["search", str(tiny_run), str(photos), "a red circle", "a blue square", *no_index])
    want = capsys.readouterr().out
    assert len(encoded) == 2 and len(encoded[0]) == 9
    encoded.clear()
    aligned.main(["index", str(tiny_run), str(photos)])
    assert len(encoded) == 1 and len(encoded[0]) == 9
    index = aligned.Index.load(tiny_run / "index")
    files = aligned.image_files([photos])
    assert [k[0] for k in index.keys] == [str(f.absolute()) for f in files]
    assert all(k[1:] == (os.stat(f).st_size, os.stat(f).st_mtime_ns, os.stat(f).st_ctime_ns)
               for k, f in zip(index.keys, files))
    model = aligned.load(tiny_run)
    assert index.run_key == model.run_key and len(index.emb) == 9
    torch.testing.assert_close(index.emb, model.encode_image(files), rtol=0, atol=1e-5)
    capsys.readouterr()
    encoded.clear()
    aligned.main(["classify", str(tiny_run), str(photos), "--classes", ",".join(CLASSES), "--top", "2"])
    aligned.main(["search", str(tiny_run), str(photos), "a red circle", "a blue square"])
    captured = capsys.readouterr()
    assert encoded == [] and "9 of 9 images read from the index" in captured.err
    assert captured.out == want


def test_a_second_index_encodes_only_new_or_changed_files_and_drops_removed_ones(tiny_run, photos, tmp_path,
                                                                                  encoded, capsys):
    where = ["--index", str(tmp_path / "ix")]
    aligned.main(["index", str(tiny_run), str(photos), *where])
    first = aligned.Index.load(tmp_path / "ix")
    new = photos / "trip" / "new.png"
    shutil.copy(photos / "0.png", new)
    changed = photos / "1.png"
    Image.open(photos / "2.png").save(changed)                          # other pixels, another size / mtime
    (photos / "3.png").unlink()
    encoded.clear()
    aligned.main(["index", str(tiny_run), str(photos), *where])
    assert sorted(encoded[0]) == sorted([str(changed.absolute()), str(new.absolute())])
    assert "2 encoded now, 7 kept as they were, 2 dropped" in capsys.readouterr().out
    second = aligned.Index.load(tmp_path / "ix")
    assert {k[0] for k in second.keys} == {str(f.absolute()) for f in aligned.image_files([photos])}
    kept = photos / "0.png"
    row = lambda ix: ix.emb[ix.rows([kept])[0]]
    assert torch.equal(row(first), row(second))                            # kept rows: the same bytes
    # another folder indexed into it keeps the first folder's entries (still there, unchanged)
    other = tmp_path / "more"
    other.mkdir()
    shutil.copy(photos / "0.png", other / "x.png")
    aligned.main(["index", str(tiny_run), str(other), *where])
    assert len(aligned.Index.load(tmp_path / "ix")) == len(second) + 1


def test_a_file_rewritten_with_its_old_size_and_mtime_is_encoded_again(tiny_run, photos, tmp_path, encoded):
    """Other pixels of the same byte count, with the old mtime set back (os.utime): the ctime tells it."""
    where = ["--index", str(tmp_path / "ix")]
    aligned.main(["index", str(tiny_run), str(photos), *where])
    f, g = sorted(photos.glob("*.png"), key=lambda p: -p.stat().st_size)[:2]     # g no larger than f
    st = f.stat()
    f.write_bytes(g.read_bytes() + bytes(st.st_size - g.stat().st_size))   # g's picture (PNG ignores the tail)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    encoded.clear()
    aligned.main(["index", str(tiny_run), str(photos), *where])
    assert encoded == [[str(f.absolute())]]
    model = aligned.load(tiny_run)
    index = aligned.Index.load(tmp_path / "ix")
    torch.testing.assert_close(index.emb[index.rows([f])[0]], model.encode_image([f])[0], rtol=0, atol=1e-5)


def test_an_index_of_other_weights_is_not_read(tiny_run, photos, tmp_path, encoded):
    aligned.main(["index", str(tiny_run), str(photos), "--index", str(tmp_path / "ix")])
    ix = aligned.Index.load(tmp_path / "ix")
    aligned.Index(ix.keys, ix.emb + 1, "another run").write(tmp_path / "ix")
    encoded.clear()
    aligned.main(["classify", str(tiny_run), str(photos), "--classes", ",".join(CLASSES), "--index",
                  str(tmp_path / "ix")])
    assert len(encoded) == 1 and len(encoded[0]) == 9


def test_the_api_indexes_writes_and_loads(tiny_run, photos, tmp_path):
    model = aligned.load(tiny_run)
    files = aligned.image_files([photos])
    ix = model.index(files)
    assert ix.paths == [f.absolute() for f in files] and len(ix.emb) == 9
    ix.write(tmp_path / "ix")
    back = aligned.Index.load(tmp_path / "ix")
    assert back.keys == ix.keys and torch.equal(back.emb, ix.emb) and back.run_key == model.run_key
    torch.testing.assert_close(model.embed_files(files, back), ix.emb, rtol=0, atol=0)
    assert aligned.Index.load(tmp_path / "nothing") is None


def test_top_k_probabilities_are_the_softmax_at_the_methods_own_scale_into_json_and_csv(tiny_run, photos, tmp_path):
    model = aligned.load(tiny_run)
    files = aligned.image_files([photos])
    S = model.zero_shot(files, CLASSES)
    P = (float(model.method.contrastive_scale()) * S).softmax(1)
    aligned.main(["classify", str(tiny_run), str(photos), "--classes", ",".join(CLASSES), "--top", "2",
                  "--json", str(tmp_path / "c.json"), "--csv", str(tmp_path / "c.csv"), "--threads", "1"])
    records = json.loads((tmp_path / "c.json").read_text())
    assert [r["image"] for r in records] == [str(f) for f in files]
    for r, s, p in zip(records, S, P):
        best = p.argsort(descending=True)[:2]
        assert [t["class"] for t in r["top"]] == [CLASSES[i] for i in best] and r["class"] == CLASSES[best[0]]
        assert [t["probability"] for t in r["top"]] == pytest.approx(p[best].tolist(), abs=1e-6)
        assert r["score"] == pytest.approx(float(s.max()), abs=1e-6)
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert list(rows[0]) == ["image", "class", "score", "class_1", "probability_1", "class_2", "probability_2"]
    assert float(rows[0]["probability_1"]) == pytest.approx(records[0]["top"][0]["probability"], abs=1e-6)
    # without --top: every class's score; --json is a new file only
    aligned.main(["classify", str(tiny_run), str(photos), "--classes", ",".join(CLASSES), "--json",
                  str(tmp_path / "all.json")])
    assert set(json.loads((tmp_path / "all.json").read_text())[0]["scores"]) == set(CLASSES)
    with pytest.raises(SystemExit, match="--json .*c.json exists"):
        aligned.main(["classify", str(tiny_run), str(photos), "--classes", "a", "--json", str(tmp_path / "c.json")])
    aligned.main(["search", str(tiny_run), str(photos), "a red circle", "a square", "--top", "3", "--json",
                  str(tmp_path / "s.json")])
    hits = json.loads((tmp_path / "s.json").read_text())
    assert [(h["query"], h["rank"]) for h in hits] == [(q, r) for q in ("a red circle", "a square") for r in (1, 2, 3)]


def test_threads_sets_torchs_threads_and_bad_counts_are_one_line(tiny_run, photos):
    before = torch.get_num_threads()
    try:
        aligned.main(["search", str(tiny_run), str(photos), "a red circle", "--threads", "2"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for flag in ("--threads", "--batch-size", "--workers", "--top"):
        value = "-1" if flag == "--threads" else "0"
        with pytest.raises(SystemExit, match=f"{flag} {value}"):
            aligned.main(["classify", str(tiny_run), str(photos), "--classes", "a,b", flag, value])
    with pytest.raises(SystemExit, match="--index .* is a file"):
        (Path(photos) / "notes.txt").write_text("x")
        aligned.main(["classify", str(tiny_run), str(photos), "--classes", "a,b", "--index",
                      str(Path(photos) / "notes.txt")])
