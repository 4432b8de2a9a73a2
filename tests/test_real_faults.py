"""Faults on real data folders, real model folders and the feature cache: tiny files in the real
layouts (COCO + Karpathy JSON, VOC masks, Hugging Face folders saved with save_pretrained), each
fault planted by hand. Every user fault must end in ONE `error:` line naming the file and what to
do, before any long work; every cache fault must be rebuilt, never read as valid; features of one
data folder must never be read for another. docs/faults.md lists each row with its test."""
import json
import os
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import align
import cache
import data
import encoders
from features import Features
from test_real import write_ade, write_karpathy, write_models, write_voc
import layers
import shards
import storage
import shapes
import checks
import eval_sets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("models"))


def one_line(e):
    """The text of a SystemExit, checked to be one `error:` line."""
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text, text
    return text


def entries_of(root):
    return json.loads((root / "coco" / "dataset_coco.json").read_text())


def rewrite(root, split_file):
    (root / "coco" / "dataset_coco.json").write_text(json.dumps(split_file))


def extract(enc, inputs, cache_dir, split="test", modality="text"):
    return cache.extract(enc, inputs, cache_dir, batch_size=4, dataset="coco", split=split, modality=modality)


# ----------------------------------------------------------------------------- features never mix across folders
def test_two_data_folders_sharing_a_cache_each_get_their_own_features(tmp_path, models):
    """d_edit differs from d_ok only in caption text, d_black only in image pixels: with one shared
    cache each folder's features equal those of a fresh cache of its own."""
    for name in ("d_ok", "d_edit", "d_black"):
        write_karpathy(tmp_path / name / "coco")
    split = entries_of(tmp_path / "d_edit")
    for e in split["images"]:
        for s in e["sentences"]:
            s["raw"] = s["raw"].replace("caption", "sentence").upper()
    rewrite(tmp_path / "d_edit", split)
    for f in (tmp_path / "d_black" / "coco" / "val2014").iterdir():
        Image.new("RGB", (40, 30)).save(f)
    img_enc = encoders.load_hf_image(str(models / "dinov2"))
    txt_enc = encoders.load_hf_text(str(models / "bert"))
    shared = tmp_path / "shared"
    got = {}
    for name in ("d_ok", "d_edit", "d_black"):
        test = data.coco(tmp_path / name)["test"]
        got[name] = (extract(img_enc, test.images, shared, modality="image"), extract(txt_enc, test.captions, shared))
        fresh = (extract(img_enc, test.images, tmp_path / f"fresh_{name}", modality="image"),
                 extract(txt_enc, test.captions, tmp_path / f"fresh_{name}"))
        for a, b in zip(got[name], fresh):
            assert torch.equal(a.pooled, b.pooled) and torch.equal(a.tokens, b.tokens)
    assert not torch.equal(got["d_ok"][1].pooled, got["d_edit"][1].pooled)       # other captions
    assert torch.equal(got["d_ok"][0].pooled, got["d_edit"][0].pooled)           # the same pixels
    assert not torch.equal(got["d_ok"][0].pooled, got["d_black"][0].pooled)      # other pixels
    assert len(list((shared / "features").glob("coco-test-text-*.pt"))) == 2      # d_black shares d_ok's texts


def test_data_identity_follows_the_files_and_the_texts(tmp_path):
    """data.identity(set): what --resume's checkpoint records; equal for the same files, different for any edit."""
    write_karpathy(tmp_path / "a" / "coco")
    ident = lambda: data.identity(data.coco(tmp_path / "a")["train"])
    first = ident()
    assert ident() == first                                                       # stable across loads
    f = tmp_path / "a" / "coco" / "train2014" / "train_3.jpg"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))          # an image rewritten
    touched = ident()
    assert touched != first
    split = entries_of(tmp_path / "a")
    split["images"][1]["sentences"][0]["raw"] += " edited"
    rewrite(tmp_path / "a", split)
    assert ident() not in (first, touched)
    assert data.identity(["a", "b"]) != data.identity(["a", "c"]) and data.identity(["a"]) == data.identity(["a"])
    x = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    y = x.clone()
    y[1, 2, 3, 3] = 1
    assert data.identity(x) != data.identity(y)


def run_align(tmp_path, root, cache_dir, out, models, *extra, check=True):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "align.py"), "--data", "coco", "--data-root", str(root), "--cache-dir",
           str(cache_dir), "--out", str(tmp_path / out), "--threads", "1", "--epochs", "1", "--method", "linear",
           "--no-figures", "--image-encoder", str(models / "dinov2"), "--text-encoder", str(models / "bert"), *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not check:
        return r
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((tmp_path / out / "metrics.json").read_text())


@pytest.mark.slow
def test_align_over_two_folders_differing_only_in_captions_gives_each_its_own_numbers(tmp_path, models):
    """The two-folder check: d_edit's captions are d_ok's, moved one image on (every pair changes);
    run on d_ok, then on d_edit with the same --cache-dir: d_edit's numbers are those of a fresh cache."""
    for name in ("d_ok", "d_edit"):
        write_karpathy(tmp_path / name / "coco", n_train=12, n_test=6)
    split = entries_of(tmp_path / "d_edit")
    sentences = [e["sentences"] for e in split["images"]]
    for e, s in zip(split["images"], sentences[1:] + sentences[:1]):
        e["sentences"] = s
    rewrite(tmp_path / "d_edit", split)
    ok = run_align(tmp_path, tmp_path / "d_ok", tmp_path / "shared", "ok", models)
    edit = run_align(tmp_path, tmp_path / "d_edit", tmp_path / "shared", "edit", models)
    fresh = run_align(tmp_path, tmp_path / "d_edit", tmp_path / "fresh", "fresh", models)
    assert edit["retrieval"] == fresh["retrieval"]
    assert edit["retrieval"] != ok["retrieval"]


# ----------------------------------------------------------------------------- pairs follow txt_to_img
def caption_index_features(sets):
    """Planted features: image row i holds the number of its file (train_<k>.jpg -> k), caption j the
    number its text names ("train <k> caption 0"): a pair is right iff the two rows are equal."""
    train = sets["train"]
    k_img = torch.tensor([float(p.stem.split("_")[1]) for p in train.images.keys])
    k_txt = torch.tensor([float(c.split()[1]) for c in train.captions])
    F = lambda v: Features.from_vectors(v[:, None].repeat(1, 4))
    return align.Run(None, None, sets, features={("train", "image"): F(k_img), ("train", "text"): F(k_txt)})


@pytest.mark.parametrize("num_pairs", [None, 4])
def test_a_train_image_without_captions_never_shifts_the_pairs(tmp_path, num_pairs):
    write_karpathy(tmp_path / "coco", n_train=6)
    split = entries_of(tmp_path)
    split["images"][0]["sentences"] = []                                        # train_0.jpg: no caption
    rewrite(tmp_path, split)
    sets = data.coco(tmp_path)
    assert len(sets["train"].captions) == 5
    img, txt, _ = align.alignment_data(Namespace(num_pairs=num_pairs, align_data="pairs"),
                                       caption_index_features(sets))
    assert len(img) == len(txt) == (num_pairs or 5)
    # every pair is an image and its caption
    assert torch.equal(img.pooled, txt.pooled)


def test_pairs_come_from_txt_to_img_when_an_image_has_several_captions():
    images_ = torch.arange(4.0)                                                  # image i holds i
    links = torch.tensor([0, 1, 1, 3, 2, 3])
    sets = {"train": data.PairSet(torch.zeros(4, 3, 2, 2, dtype=torch.uint8), ["c"] * 6, links)}
    run = align.Run(None, None, sets, features={("train", "image"): Features.from_vectors(images_[:, None]),
                                                ("train", "text"): Features.from_vectors(links.float()[:, None])})
    for n in (None, 3):
        img, txt, _ = align.alignment_data(Namespace(num_pairs=n, align_data="pairs"), run)
        assert len(txt) == (n or 6) and torch.equal(img.pooled, txt.pooled)


# ----------------------------------------------------------------------------- cache files: checksums
def flip_sign_bits(path, n=20):
    """Flip the sign bit of the first n fp16 / fp32 values of every tensor stored in a torch file, in place
    (the zip container and its pickle stay intact: what a disk or a careless script does)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i.header_offset, i.filename, i.file_size) for i in z.infolist() if "/data/" in i.filename]
    with open(path, "r+b") as f:
        for offset, name, size in entries:
            f.seek(offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            start = offset + 30 + name_len + extra_len
            for k in range(1, min(n, size // 2) * 2, 2):                          # the high byte of each fp16
                f.seek(start + k)
                b = f.read(1)[0]
                f.seek(start + k)
                f.write(bytes([b ^ 0x80]))


def test_a_bit_flipped_cache_file_is_rebuilt_not_read(tmp_path, models, capsys):
    txt_enc = encoders.load_hf_text(str(models / "bert"))
    texts = ["a dog sits on the cat.", "the man rides a red dog.", "a photo of a cat."] * 3
    want = extract(txt_enc, texts, tmp_path)
    (path,) = (tmp_path / "features").glob("*.pt")
    flip_sign_bits(path)
    assert not torch.equal(torch.load(path, weights_only=True)["pooled"], want.pooled)   # the file did change
    got = extract(txt_enc, texts, tmp_path)
    assert "fails its checksum; rebuilding it" in capsys.readouterr().out
    assert torch.equal(got.pooled, want.pooled) and torch.equal(got.tokens, want.tokens)


def test_a_folder_where_a_cache_file_or_a_result_goes_is_one_line_before_the_work(tmp_path, models, monkeypatch):
    """A folder under a cache file's name was "rebuilding it", then a traceback from the rename once the
    features were computed (lost); one under --out's metrics.json ended the run after training. Both are
    one line before any encoder runs; the folder is left as it was (a user's folder is never deleted)."""
    txt_enc = encoders.load_hf_text(str(models / "bert"))
    texts = ["a dog sits on the cat.", "the man rides a red dog."]
    extract(txt_enc, texts, tmp_path)
    (path,) = (tmp_path / "features").glob("*.pt")
    path.unlink()
    (path / "notes.txt").parent.mkdir()
    (path / "notes.txt").write_text("mine")
    monkeypatch.setattr(txt_enc, "encode", lambda *a: pytest.fail("encoded before the fault was said"))
    with pytest.raises(SystemExit) as e:
        extract(txt_enc, texts, tmp_path)
    assert f"{path} is a folder where the cache keeps a file; move it away" in one_line(e)
    assert (path / "notes.txt").read_text() == "mine"
    out = tmp_path / "out"
    (out / "metrics.json").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        checks.check_out_data(Namespace(resume=False, data="shapes", data_root="data"), out)
    assert f"--out {out} holds a folder metrics.json, where this run writes a file" in one_line(e)


@pytest.fixture
def sharded(monkeypatch):
    monkeypatch.setattr(shards, "MEMMAP_BYTES", 0)                # every set goes to shards
    monkeypatch.setattr(shards, "SHARD_BYTES", 1)                 # one batch (4 rows) per shard


def truncate(f):
    f.write_bytes(f.read_bytes()[:-64])


def delete(f):
    f.unlink()


def object_dtype(f):
    np.save(f, np.array([{"x": 1}] * 3, dtype=object), allow_pickle=True)


def bit_flip(f):
    time.sleep(0.05)                                        # a later write: file times tick in jiffies (ms)
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0x80
    f.write_bytes(bytes(raw))


@pytest.mark.parametrize("fault", [truncate, delete, object_dtype, bit_flip])
def test_a_broken_token_shard_is_written_again_never_read(tmp_path, models, sharded, fault, capsys):
    txt_enc = encoders.load_hf_text(str(models / "bert"))
    texts = [f"a dog {w} the cat." for w in ("sits on", "rides", "is in", "photo of", "on", "of", "in")] * 2
    want = extract(txt_enc, texts, tmp_path)[:]
    (folder,) = [p for p in (tmp_path / "features").iterdir() if p.is_dir()]
    fault(folder / "00001.tokens.npy")
    got = extract(txt_enc, texts, tmp_path)
    assert "writing shard 1 again" in capsys.readouterr().out
    got = got[:]
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pooled, want.pooled)
    extract(txt_enc, texts, tmp_path)
    assert "again" not in capsys.readouterr().out                                # mended: nothing redone


def test_a_cached_encoder_checkpoint_of_other_shapes_is_rebuilt(tmp_path, monkeypatch, capsys):
    """A checkpoint with the right key and checksum but weights of other shapes (another version of
    the tiny CNN): pretrained again (here a stand-in for the minute of pretraining), not a traceback."""
    import shapes_encoders as se
    torch.manual_seed(0)
    small = se.TinyImageEncoder(len(shapes.CLASS_NAMES), D=16)
    storage.atomic_save({"key": "shapes-cnn-1", "state": small.state_dict(), "acc": 0.9},   # seed 1 (seed 0 ships)
                      tmp_path / "encoders" / "shapes-cnn-seed1.pt")
    calls = []
    fresh_image = se.TinyImageEncoder(len(shapes.CLASS_NAMES))
    monkeypatch.setattr(se, "pretrain_image_encoder", lambda *a, **k: calls.append("image") or (fresh_image, 0.5))
    vocab = se.SPECIALS + ["a", "dog"]
    monkeypatch.setattr(se, "pretrain_text_encoder", lambda *a, **k: calls.append("text") or
                        (se.TinyTextEncoder(len(vocab)), se.WordTokenizer(vocab), 0.5))
    image, _ = se.load_shapes_encoders(tmp_path, seed=1, log=lambda s: None)
    assert "holds weights of other shapes" in capsys.readouterr().out and calls == ["image", "text"]
    assert image.dim == 96
    saved = storage.safe_load(tmp_path / "encoders" / "shapes-cnn-seed1.pt", expect_key="shapes-cnn-1")
    assert saved["state"]["head.weight"].shape == fresh_image.head.weight.shape   # the rebuilt one replaced it


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A folder on a full disk: a real 256 KB tmpfs when this runs as root, else torch's own writer
    on a file that takes only part of what is written (what a disk filling mid-file does)."""
    folder = tmp_path / "small"
    folder.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if r.returncode == 0:
        yield folder
        subprocess.run(["umount", str(folder)], check=True)
        return

    class Short:                                           # writes 100 bytes, then the disk is full
        def __init__(self, f):
            self.f, self.left = f, 100

        def write(self, b):
            n = min(len(b), self.left)
            self.left -= n
            return self.f.write(bytes(b[:n])) if n else 0

        def __getattr__(self, name):
            return getattr(self.f, name)
    save = torch.save
    monkeypatch.setattr(cache.torch, "save", lambda obj, f: save(obj, Short(f)))
    monkeypatch.setattr(storage, "free_bytes", lambda folder: 0)
    yield folder


def test_a_full_disk_during_torch_save_is_one_line_and_leaves_no_file(full_disk):
    with pytest.raises(RuntimeError, match="inline_container|PytorchStreamWriter"):     # torch's own exception
        with open(full_disk / "raw.pt", "wb") as f:
            torch.save({"x": torch.zeros(2**17)}, f)
    (full_disk / "raw.pt").unlink()
    with pytest.raises(SystemExit) as e:
        storage.atomic_save({"key": "k", "x": torch.zeros(2**17)}, full_disk / "features" / "x.pt")
    assert "no space left in" in one_line(e) and str(full_disk / "features") in str(e.value)
    assert list((full_disk / "features").iterdir()) == []                         # no half file


# ----------------------------------------------------------------------------- text, preprocessing, 16-bit images
def test_a_text_model_folder_without_tokenizer_files_is_refused(tmp_path, models):
    folder = tmp_path / "bert"
    folder.mkdir()
    for f in ("config.json", "model.safetensors"):
        (folder / f).write_bytes((models / "bert" / f).read_bytes())
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "no tokenizer files" in one_line(e)


def test_a_truncated_preprocessor_config_is_refused_not_replaced_by_the_default(tmp_path, models):
    folder = tmp_path / "clip"
    folder.mkdir()
    for f in (models / "clip").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    text = (folder / "preprocessor_config.json").read_text()
    (folder / "preprocessor_config.json").write_text(text[:len(text) // 2])
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert "preprocessor_config.json is truncated or not JSON" in one_line(e)


def test_a_16_bit_png_is_scaled_not_clipped(tmp_path):
    grey = (np.arange(30 * 40, dtype=np.uint32).reshape(30, 40) * 54).astype(np.uint16)   # 0 .. 64746
    Image.fromarray(grey).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    got = np.asarray(data.LazyImages([tmp_path / "deep.png"])[0])
    want = np.round(grey / 257).astype(np.uint8)
    assert got.shape == (30, 40, 3) and (got == want[..., None]).all()
    assert (got == 255).mean() < 0.01


@pytest.mark.parametrize("top", [1.0, 255.0])
def test_a_float_tiff_is_scaled_not_clipped(tmp_path, top):
    """A 32-bit float grey TIFF (PIL mode F) in [0, 1] became all 0 or 1 (convert clips, never scales);
    one in 0..255 is read as it is."""
    grey = (np.arange(30 * 40, dtype=np.float32).reshape(30, 40) / (30 * 40 - 1) * top)
    Image.fromarray(grey).save(tmp_path / "float.tif")
    assert Image.open(tmp_path / "float.tif").mode == "F"
    got = np.asarray(data.LazyImages([tmp_path / "float.tif"])[0])
    want = np.round(grey.astype(np.float64) * 255 / top).astype(np.uint8)
    assert got.shape == (30, 40, 3) and (got == want[..., None]).all()


# ----------------------------------------------------------------------------- layers of the built-in encoders
@pytest.mark.parametrize("layers, flag", [((5, -1), "--image-layer 5"), ((0, -1), "--image-layer 0"),
                                          ((-1, 7), "--text-layer 7"), ((-1, -3), "--text-layer -3")])
def test_built_in_encoder_layers_out_of_range_are_refused_before_pretraining(tmp_path, layers, flag):
    with pytest.raises(SystemExit) as e:
        encoders.load_encoders("shapes-cnn", "shapes-text", tmp_path, *layers)
    assert one_line(e).startswith(f"error: {flag}: ") and "has layers" in str(e.value)
    assert not (tmp_path / "encoders").exists()                                 # nothing pretrained


# ----------------------------------------------------------------------------- annotation faults
def truncated_json(root):
    f = root / "coco" / "dataset_coco.json"
    f.write_text(f.read_text()[:300])


def non_utf8_byte(root):
    f = root / "coco" / "dataset_coco.json"
    f.write_bytes(f.read_bytes().replace(b"train 2 caption 0", b"train 2 caf\xe9 0"))


def no_images_key(root):
    rewrite(root, {"imgs": entries_of(root)["images"]})


def entry_without_split(root):
    split = entries_of(root)
    del split["images"][3]["split"]
    rewrite(root, split)


def sentence_without_raw(root):
    split = entries_of(root)
    del split["images"][7]["sentences"][2]["raw"]
    rewrite(root, split)


def entry(root, split, i, **fields):
    """Set fields of the i-th entry of a split."""
    split_file = entries_of(root)
    [e for e in split_file["images"] if e["split"] == split][i].update(fields)
    rewrite(root, split_file)


def listed_twice(root):
    entry(root, "test", 1, filename="test_0.jpg")                          # two right answers for its captions


def also_in_train(root):
    entry(root, "test", 2, filepath="train2014", filename="train_5.jpg")   # a training pair scored as a test one


def only_restval(root):
    split_file = entries_of(root)
    for e in split_file["images"]:
        e["split"] = "restval" if e["split"] == "train" else e["split"]
    rewrite(root, split_file)


@pytest.mark.parametrize("fault, says", [
    (listed_twice, "images[6] (test) and images[7] (test) are the same image"),
    (also_in_train, "images[5] (train) and images[8] (test) are the same image"),
    (only_restval, "no images in split 'train' (its splits: restval 6, test 3, val 1)"),
    (lambda root: entry(root, "train", 2, filepath=None), "images[2] (train_2.jpg): its 'filepath' is not"),
    (lambda root: entry(root, "train", 1, filename=""), "images[1] has no 'filename'"),
    (lambda root: entry(root, "test", 1, sentences=[{"raw": "a dog"}, {"raw": "  "}]),
     "test image test_1.jpg: sentences[1] is empty"),
    (truncated_json, "is not valid JSON"), (non_utf8_byte, "byte 0xe9 at offset"),
    (no_images_key, 'has no "images" list'), (entry_without_split, "images[3] (train_3.jpg) has no 'split'"),
    (sentence_without_raw, "images[7] (test_1.jpg): sentences[2] has no 'raw'")])
def test_annotation_faults_are_one_line_naming_the_file(tmp_path, fault, says):
    write_karpathy(tmp_path / "coco")
    fault(tmp_path)
    with pytest.raises(SystemExit) as e:
        data.coco(tmp_path)
    assert says in one_line(e) and "dataset_coco.json" in str(e.value)


# ----------------------------------------------------------------------------- image and mask faults
@pytest.mark.parametrize("split, name, fault, says", [
    ("val2014", "test_2.jpg", "missing", "1 of 3 COCO test images are missing"),
    ("train2014", "train_4.jpg", "empty", "1 of 6 COCO train images are empty (0 bytes)"),
    ("val2014", "test_1.jpg", "a folder", "1 of 3 COCO test images are missing")])
def test_a_missing_or_empty_image_anywhere_is_one_line_before_any_encoder_runs(tmp_path, split, name, fault, says):
    write_karpathy(tmp_path / "coco")
    f = tmp_path / "coco" / split / name
    f.unlink() if fault != "empty" else f.write_bytes(b"")
    if fault == "a folder":
        f.mkdir()
    with pytest.raises(SystemExit) as e:
        data.coco(tmp_path)
    assert says in one_line(e) and str(f) in str(e.value) and "dataset_coco.json" in str(e.value)


def bomb_png(path, side=14000):
    """A PNG whose header says side x side (196 megapixels) with almost no data: a decompression bomb."""
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


@pytest.mark.parametrize("fault, says", [("truncated", "cannot read image"), ("bomb", "downscale it")])
def test_an_undecodable_image_is_one_line_naming_it(tmp_path, models, fault, says):
    write_karpathy(tmp_path / "coco")
    f = tmp_path / "coco" / "val2014" / "test_2.jpg"
    f.write_bytes(f.read_bytes()[:200]) if fault == "truncated" else bomb_png(f)
    test = data.coco(tmp_path)["test"]
    enc = encoders.load_hf_image(str(models / "dinov2"))
    with pytest.raises(SystemExit) as e:                                          # from the decoding threads
        extract(enc, test.images, tmp_path / "cache", modality="image")
    assert says in one_line(e) and str(f) in str(e.value) and "dataset_coco.json" in str(e.value)


@pytest.mark.slow
def test_align_reports_an_unreadable_test_image_in_one_line_without_a_traceback(tmp_path, models):
    write_karpathy(tmp_path / "coco")
    f = tmp_path / "coco" / "val2014" / "test_1.jpg"
    f.write_bytes(f.read_bytes()[:200])
    r = run_align(tmp_path, tmp_path, tmp_path / "cache", "out", models, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: cannot read image {f}")


def test_a_split_file_saved_with_a_utf8_byte_order_mark_loads(tmp_path):
    """An editor that saves UTF-8 with a BOM: the file is valid UTF-8, not "invalid JSON"."""
    write_karpathy(tmp_path / "coco")
    f = tmp_path / "coco" / "dataset_coco.json"
    want = data.coco(tmp_path)["test"].captions
    f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    assert data.coco(tmp_path)["test"].captions == want


def test_a_voc_mask_of_another_size_than_its_image_is_one_line(tmp_path):
    """The image and its mask are centre-cropped apart: of other sizes, the mask's labels would
    fall on other pixels (a mask of another image), with no error."""
    write_voc(tmp_path)
    image = tmp_path / "VOCdevkit" / "VOC2012" / "JPEGImages" / "2007_000002.jpg"
    Image.new("RGB", (36, 36)).save(image)                                      # its mask is 36 x 28
    with pytest.raises(SystemExit) as e:
        eval_sets.segmentation_set("voc20", tmp_path)
    assert "2007_000002.png is 36 x 28 pixels but its image" in one_line(e) and str(image) in str(e.value)


def test_a_missing_voc_mask_is_one_line_before_any_encoder_runs(tmp_path):
    write_voc(tmp_path)
    mask = tmp_path / "VOCdevkit" / "VOC2012" / "SegmentationClass" / "2007_000002.png"
    mask.unlink()
    with pytest.raises(SystemExit) as e:
        eval_sets.segmentation_set("voc20", tmp_path)
    assert "1 of 2 voc20 masks are missing" in one_line(e) and str(mask) in str(e.value)


VOC_BASE = ("VOCdevkit", "VOC2012")


def voc_mask_fault(root, fault):
    """One fault planted in write_voc's layout: the first mask re-saved another way, or the ids file changed."""
    base = root.joinpath(*VOC_BASE)
    mask, ids = base / "SegmentationClass" / "2007_000001.png", base / "ImageSets" / "Segmentation" / "val.txt"
    m = Image.open(mask)
    if fault == "rgb":                                      # the palette's colours, as an image viewer saves it
        m.putpalette([v for c in range(256) for v in ((c * 37) % 256, (c * 91) % 256, (c * 13) % 256)])
        m.convert("RGB").save(mask)
    elif fault == "grey":                                   # the same colours, as luminance: labels 0..255 at random
        m.putpalette([v for c in range(256) for v in ((c * 37) % 256, (c * 91) % 256, (c * 13) % 256)])
        m.convert("L").save(mask)
    elif fault == "jpeg":                                   # a JPEG under the .png name
        m.convert("L").save(mask, format="JPEG", quality=90)
    elif fault == "16-bit":                                 # label 300: a uint8 cast would wrap it to 44
        a = np.asarray(m).astype(np.uint16)
        a[a == 15] = 300
        Image.fromarray(a).save(mask)
    elif fault == "listed twice":
        ids.write_text(ids.read_text() + "2007_000001\n")
    return mask, ids


@pytest.mark.parametrize("fault, says", [
    ("rgb", "is a colour image (mode RGB): its pixels are colours, not class labels"),
    ("grey", "but this set's labels are 0..20 and 255 (unlabelled)"),
    ("jpeg", "is a JPEG: its lossy compression changes the labels along every edge"),
    ("16-bit", "holds label 300 on 196 pixels, but this set's labels are 0..20 and 255"),
    ("listed twice", "lists 2007_000001 2 times (1 id(s) listed more than once); list each image once"),
])
def test_a_voc_mask_that_holds_no_labels_or_an_image_listed_twice_is_one_line(tmp_path, fault, says):
    """A colour, grey-converted or JPEG mask reads colours or compression noise as class labels (an RGB
    mask would not even stack); an id listed twice counts its pixels twice: each was silently wrong
    numbers (or a traceback), each is one line naming the file before any encoder runs."""
    write_voc(tmp_path)
    mask, ids = voc_mask_fault(tmp_path, fault)
    with pytest.raises(SystemExit) as e:
        eval_sets.segmentation_set("voc20", tmp_path)
    assert says in one_line(e) and str(ids if fault == "listed twice" else mask) in str(e.value)


def test_a_voc_ids_file_saved_with_a_byte_order_mark_loads(tmp_path):
    write_voc(tmp_path)
    want = eval_sets.segmentation_set("voc20", tmp_path).masks
    ids = tmp_path.joinpath(*VOC_BASE, "ImageSets", "Segmentation", "val.txt")
    ids.write_bytes(b"\xef\xbb\xbf" + ids.read_bytes())          # not "image \ufeff2007_000001.jpg is missing"
    assert torch.equal(eval_sets.segmentation_set("voc20", tmp_path).masks, want)


# ----------------------------------------------------------------------------- model folder faults
def copy_folder(src, dst):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def truncated_weights(folder):
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[:3000])


def config_only(folder):
    for f in folder.iterdir():
        if f.name != "config.json":
            f.unlink()


def truncated_config(folder):
    c = folder / "config.json"
    c.write_text(c.read_text()[:40])


PAYLOAD = Path("/tmp") / f"align-pickle-payload-{os.getpid()}"


class Payload:
    def __reduce__(self):
        return exec, (f"open({str(PAYLOAD)!r}, 'w').write('ran')",)


def planted_pickle(folder):
    from safetensors.torch import load_file
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, "boom": Payload()}, folder / "pytorch_model.bin")


def crop_too_large(folder):
    from transformers import BitImageProcessor, ViTConfig, ViTModel
    from test_real import VISION
    for f in folder.iterdir():
        f.unlink()
    ViTModel(ViTConfig(**VISION)).save_pretrained(folder)                          # takes 32 x 32 images
    BitImageProcessor(size={"shortest_edge": 72}, crop_size={"height": 64, "width": 64}).save_pretrained(folder)


@pytest.mark.parametrize("fault, says", [
    (truncated_weights, "its weights cannot be read (SafetensorError"),
    (config_only, "no weights file"),
    (truncated_config, "config.json is truncated or not JSON"),
    (planted_pickle, "refusing to load the weights"),
    (crop_too_large, "crops 64 x 64 but the model takes 32 x 32 images")])
def test_image_model_folder_faults_are_one_line(tmp_path, models, fault, says):
    folder = copy_folder(models / "dinov2", tmp_path / "model")
    fault(folder)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert says in one_line(e) and str(folder) in str(e.value)
    assert not PAYLOAD.exists()                                                  # nothing in the pickle ran


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path, models):
    from transformers import AutoModel, BertConfig
    from test_real import TEXT
    folder = tmp_path / "bert"
    AutoModel.from_config(BertConfig(vocab_size=10, max_position_embeddings=40, **TEXT)).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((models / "bert" / f).read_bytes())
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "tokenizer has 36 tokens but the model's embedding table only 10 rows" in one_line(e)


def test_a_mistyped_local_path_is_neither_a_folder_nor_a_hub_model(tmp_path, models, monkeypatch):
    copy_folder(models / "dinov2", tmp_path / "models" / "dinov2-large")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image("models/dinov2-larg")
    assert "neither a folder nor a downloaded hub model (did you mean models/dinov2-large?)" in one_line(e)


@pytest.mark.parametrize("change, says", [
    (lambda c: dict(c, num_hidden_layers=c["num_hidden_layers"] + 2), "32 of its weights are not in the file"),
    (lambda c: dict(c, num_hidden_layers=1), "the file holds 16 weights it has no place for"),
    (lambda c: dict(c, hidden_size=2 * c["hidden_size"]), "tensors of other shapes")])
def test_a_config_that_does_not_describe_the_weights_is_refused(tmp_path, models, change, says):
    """config.json of another model: more layers than were saved (transformers would leave them at
    random and run), fewer (it would drop the rest), another width (its size-mismatch report). The
    one line comes alone: transformers' load report (a table of every missing key) is not printed."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    (folder / "config.json").write_text(json.dumps(change(json.loads((folder / "config.json").read_text()))))
    import logging
    from transformers.utils.logging import get_logger
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    get_logger("transformers").addHandler(handler)
    try:
        with pytest.raises(SystemExit) as e:
            encoders.load_hf_text(str(folder))
    finally:
        get_logger("transformers").removeHandler(handler)
    assert says in one_line(e) and "its config.json does not describe its weights" in str(e.value)
    assert not any("LOAD REPORT" in m for m in heard), heard


@pytest.mark.parametrize("tower, delta", [("vision_config", 1), ("vision_config", -1), ("text_config", 1),
                                          ("text_config", -1)])
def test_a_clip_config_that_does_not_describe_either_tower_is_refused(tmp_path, models, tower, delta):
    """CLIP keeps each tower's depth in a nested config (vision_config, text_config): a layer more or
    fewer than saved is refused for the tower read, as for a one-tower model."""
    folder = copy_folder(models / "clip", tmp_path / "clip")
    config = json.loads((folder / "config.json").read_text())
    config[tower]["num_hidden_layers"] += delta
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        (encoders.load_hf_image if tower == "vision_config" else encoders.load_hf_text)(str(folder))
    assert "its config.json does not describe its weights" in one_line(e)


def no_pad_token(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, pad_token=None)))


def empty_vocab(folder):
    (folder / "vocab.txt").write_text("")
    (folder / "tokenizer.json").unlink()


@pytest.mark.parametrize("fault, says", [
    (no_pad_token, "Asking to pad but the tokenizer does not have a padding token"),
    (empty_vocab, "Missing [UNK] token from the vocabulary")])
def test_a_tokenizer_that_cannot_encode_a_caption_is_refused_when_it_loads(tmp_path, models, fault, says):
    """A tokenizer that loads but cannot pad (no pad token) or tokenize (an empty vocab.txt) failed
    with a traceback mid-extraction; it is now one line when the encoder loads."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    fault(folder)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "its tokenizer cannot encode a caption" in one_line(e) and says in str(e.value)


def test_a_vocabulary_of_special_tokens_only_is_refused_when_it_loads(tmp_path, models):
    """A vocab.txt holding only the special tokens (a truncated copy) encodes every word as [UNK]:
    every caption gets the same features and the run goes on, with no error. Now one line at load."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "reads every word of" in one_line(e) and "as unknown ([UNK])" in str(e.value)


def test_an_image_model_that_is_not_rgb_is_refused_and_a_one_number_mean_applies_to_every_channel(tmp_path, models):
    """A 1-channel model and a 1-value image_mean list were tracebacks (a view of (3, 1, 1));
    image_mean / image_std as one number (transformers' own meaning: every channel) loaded as a TypeError."""
    from transformers import AutoModel, Dinov2Config
    from test_real import VISION
    grey = tmp_path / "grey"
    AutoModel.from_config(Dinov2Config(**VISION, num_channels=1)).save_pretrained(grey)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(grey))
    assert "num_channels 1, but images are read as RGB" in one_line(e)
    for mean, says in ((0.5, None), ([0.5], "gives 1 image_mean and 1 image_std values")):
        folder = copy_folder(models / "dinov2", tmp_path / f"dinov2-{len(str(mean))}")
        config = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps(dict(config, image_mean=mean, image_std=mean)))
        if says is None:
            t = encoders.load_hf_image(str(folder)).transform
            assert t.mean.flatten().tolist() == [0.5] * 3 and t.std.flatten().tolist() == [0.5] * 3
            continue
        with pytest.raises(SystemExit) as e:
            encoders.load_hf_image(str(folder))
        assert says in one_line(e)


@pytest.mark.slow
def test_a_run_on_other_data_never_overwrites_the_results_in_its_out(tmp_path, models, capsys):
    """Two runs with one --out (the default names the method, the set and the seed, not the folder):
    the second, on another --data-root, stops before any work and the first one's results stay."""
    for name in ("a", "b"):
        write_karpathy(tmp_path / name / "coco")
    out = tmp_path / "out"
    run = lambda root, *extra: align.main([
        "--data", "coco", "--data-root", str(root), "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
        "--threads", "1", "--epochs", "1", "--method", "linear", "--no-figures", "--image-encoder",
        str(models / "dinov2"), "--text-encoder", str(models / "bert"), *extra])
    run(tmp_path / "a")
    first = (out / "metrics.json").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(tmp_path / "b")
    assert f"--out {out} holds the results of a run on other data (coco in {tmp_path / 'a'}; this run: coco in " \
           f"{tmp_path / 'b'})" in one_line(e)
    assert (out / "metrics.json").read_bytes() == first and "[data]" not in capsys.readouterr().out
    same = ["--data", "coco", "--data-root", str(tmp_path / "a"), "--threads", "1", "--epochs", "1", "--method",
            "linear", "--image-encoder", str(models / "dinov2"), "--text-encoder", str(models / "bert")]
    checks.check_out_data(align.parse_args(same + ["--no-figures"]), out)   # the same settings: a rerun replaces them
    checks.check_out_data(align.parse_args([*same[:3], str(tmp_path / "a" / "coco"), *same[4:]]), out)  # <root>/coco
    with pytest.raises(SystemExit, match="holds the results of a run on other data"):   # --resume: the same rule
        checks.check_out_data(align.parse_args([*same[:3], str(tmp_path / "b"), *same[4:], "--resume"]), out)


def test_a_run_of_another_method_never_overwrites_the_results_in_its_out(tmp_path):
    """--out of a PAL run given to a linear run: it replaced PAL's config, metrics and method.pt and
    left PAL's figures and checkpoint beside them. Refused, with --resume too; a rerun of PAL with
    other hyperparameters is refused the same way (other settings); the same settings replace them."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(dict(vars(align.parse_args([])), out=str(out))))   # a PAL run's
    for extra in ([], ["--resume"]):
        with pytest.raises(SystemExit) as e:
            checks.check_out_data(align.parse_args(["--method", "linear", *extra]), out)
        assert f"--out {out} holds the results of a pal run (this run: linear); pass another --out" in one_line(e)
    with pytest.raises(SystemExit) as e:
        checks.check_out_data(align.parse_args(["--hp", "K=64"]), out)
    assert "holds the results of a run with other settings (hp.K 512 there, 64 now); pass another --out " \
           f"(e.g. --out {out}-2)" in one_line(e)
    checks.check_out_data(align.parse_args(["--threads", "1", "--no-figures", "--out", "x"]), out)   # a rerun


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


@pytest.mark.parametrize("family", ["bert", "clip"])
def test_a_tokenizer_that_pads_on_the_left_gives_the_features_of_right_padding(tmp_path, models, family):
    """padding_side "left" in tokenizer_config.json moved BERT's position embeddings and CLIP's EOS
    (pooled = the last real token) under the padding: other features, with no error."""
    folder = copy_folder(models / family, tmp_path / family)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, padding_side="left")))
    texts = ["a dog", "a red cat sits on the man ."]                       # two lengths: one is padded
    want, got = (encoders.load_hf_text(str(models / family)).encode(texts),
                 encoders.load_hf_text(str(folder)).encode(texts))
    torch.testing.assert_close(got.pooled, want.pooled)
    torch.testing.assert_close(got.tokens, want.tokens)
    assert torch.equal(got.mask, want.mask)


def test_a_preprocessor_that_does_not_normalise_is_followed(tmp_path, models):
    """"do_normalize": false: the model was trained on pixels in [0, 1]; subtracting the stated mean
    anyway gave other inputs, with no error. The model gets the pixels / 255."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(dict(config, do_normalize=False)))
    pixels = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = encoders.load_hf_image(str(folder)).transform
    assert torch.equal(t([pixels]), pixels[None].float() / 255)               # 32 x 32: the crop, no resize
    assert encoders.load_hf_image(str(models / "dinov2")).transform([pixels]).min() < 0   # normalised: below 0


@pytest.mark.parametrize("change", [dict(do_rescale=False), dict(rescale_factor=1 / 127.5, image_mean=[1.0] * 3,
                                                                   image_std=[1.0] * 3)])
def test_a_preprocessor_that_rescales_otherwise_is_followed(tmp_path, models, change):
    """"do_rescale": false (the model reads 0..255) or another rescale_factor (here 1/127.5 minus 1:
    pixels in [-1, 1]) were read as / 255: other inputs, with no error. The model gets the
    processor's own pixels."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(dict(config, **change)))
    pixels = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    c = dict(config, **change)
    f = c.get("rescale_factor", 1 / 255) if c.get("do_rescale", True) else 1.0
    mean, std = torch.tensor(c["image_mean"]).view(3, 1, 1), torch.tensor(c["image_std"]).view(3, 1, 1)
    want = (pixels[None].double() * f - mean.double()) / std.double()            # the processor's arithmetic
    got = encoders.load_hf_image(str(folder)).transform([pixels])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_the_layer_table_of_one_data_folder_is_never_read_for_another(tmp_path, models, monkeypatch):
    """--select-layers keeps its score table in the cache, keyed by the images scored: by their
    relative paths only, a second copy of the folder with other images (the same --data-root data
    from another working directory) read the first one's table."""
    img, txt = encoders.load_hf_image(str(models / "dinov2")), encoders.load_hf_text(str(models / "bert"))
    seen = []
    for name in ("one", "two"):
        write_karpathy(tmp_path / name / "data" / "coco")
        if name == "two":
            for f in (tmp_path / name / "data" / "coco" / "train2014").iterdir():
                Image.new("RGB", (40, 30)).save(f)                               # other pixels, same names
        monkeypatch.chdir(tmp_path / name)
        log = []
        _, _, table = layers.select_layers(img, txt, data.coco("data")["train"], "cka", n=6,
                                             cache_dir=tmp_path / "cache", log=log.append)
        assert not any("cached" in line for line in log)
        seen.append(table)
    assert seen[0] != seen[1]


@pytest.mark.parametrize("config, says", [({"model_type": "foo"}, "is a 'foo' model; image encoders: ['beit'"),
                                          ({}, "config.json has no model_type, so it is not"),
                                          ([1, 2], "config.json has no model_type, so it is not")])
def test_a_model_type_transformers_does_not_know_is_one_line(tmp_path, models, config, says):
    """An unknown or missing model_type (a config.json from another library, a newer transformers)
    was transformers' ValueError with its traceback."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    old = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in old.items() if k != "model_type"} | config
                                                   if isinstance(config, dict) else config))
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert says in one_line(e)


def test_a_caption_longer_than_a_roberta_takes_is_truncated_to_its_positions(tmp_path, models):
    """RoBERTa counts positions from pad_token_id + 1 (514 rows, 512 tokens): with a tokenizer whose
    model_max_length is unset (1e30), a long caption was an IndexError mid-extraction."""
    folder = copy_folder(models / "roberta", tmp_path / "roberta")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=int(1e30))))
    enc = encoders.load_hf_text(str(folder))
    rows = enc.model.config.max_position_embeddings                    # 42
    assert enc.max_length == rows - 2
    f = enc.encode(["dog " * 100, "a dog"])
    assert f.mask[0].sum() == rows - 4                                 # <s> and </s> dropped


def test_a_classifier_head_without_class_names_is_refused_for_weight_recycling(tmp_path):
    """A classifier saved without id2label gets transformers' LABEL_0, LABEL_1, ...: weight
    recycling aligned each head row with "a photo of a LABEL_0.", with no error."""
    from transformers import BeitConfig, BeitForImageClassification
    from test_real import VISION
    BeitForImageClassification(BeitConfig(**VISION, use_mean_pooling=True, num_labels=3)).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(tmp_path)).head()
    assert "has no class names (its config.json id2label says LABEL_0 .. LABEL_2)" in one_line(e)


def edit_config(folder, change):
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change(c)))


@pytest.mark.parametrize("id2label, says", [
    ({"0": "cat", "1": "dog", "5": "car"}, "has no class name for row 2 (1 of its 3 rows; config.json id2label gives "
                                           "no entry there)"),
    ({"0": "cat", "1": "dog", "2": " "}, "has no class name for row 2 (1 of its 3 rows; config.json id2label gives "
                                         "an empty name there)")])
def test_a_head_row_without_a_class_name_is_refused_for_weight_recycling(tmp_path, models, id2label, says):
    """id2label with a gap (a hand-edited config) was a KeyError traceback as the model loaded, even for a
    run on pairs; an empty name aligned its row with "a photo of a .". The model loads; its head is refused."""
    folder = copy_folder(models / "beit", tmp_path / "beit")
    edit_config(folder, lambda c: dict(c, id2label=id2label, label2id={v: int(k) for k, v in id2label.items()}))
    enc = encoders.load_hf_image(str(folder))                      # a run on pairs never reads the head
    with pytest.raises(SystemExit) as e:
        enc.head()
    assert says in one_line(e)


def more_labels_than_rows(folder):
    edit_config(folder, lambda c: dict(c, id2label={str(i): f"c{i}" for i in range(5)},
                                       label2id={f"c{i}": i for i in range(5)}))


def prefixed_keys(folder):
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    save_file({"model." + k: v for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def truncated_shard_index(folder):
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(state, folder / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    index = json.dumps({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in state}})
    (folder / "model.safetensors.index.json").write_text(index[:30])


def no_head_bias(folder):
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in state.items() if k != "classifier.bias"}, folder / "model.safetensors",
              metadata={"format": "pt"})


@pytest.mark.parametrize("model, fault, says", [
    ("beit", no_head_bias, "1 of its weights are not in the file (e.g. classifier.bias; they would be random); the "
                           "weights file is incomplete or belongs to another model"),
    ("beit", more_labels_than_rows, "tensors of other shapes (2; e.g. classifier.bias is [3] in the file, [5] by "
                                    "config.json); config.json belongs to another model (id2label / num_labels?)"),
    ("dinov2", prefixed_keys, "names every weight with the prefix 'model.' (model.embeddings.cls_token for "
                              "embeddings.cls_token): it was saved from a wrapper's state_dict"),
    ("dinov2", truncated_shard_index, "model.safetensors.index.json is truncated or not JSON")])
def test_model_folder_faults_name_their_cause(tmp_path, models, model, fault, says):
    """A head without its bias blamed config.json's depth (num_hidden_layers?);
    a config asking for more classes than the head has said "(the report above)" of a report kept quiet;
    keys saved with a wrapper's prefix blamed config.json; a truncated shard index was a JSONDecodeError
    traceback. Each is one line naming the cause, when the encoder loads."""
    folder = copy_folder(models / model, tmp_path / model)
    fault(folder)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert says in one_line(e) and str(folder) in str(e.value)


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


def test_macos_metadata_files_in_the_ade_annotations_are_not_taken_for_masks(tmp_path):
    """A folder copied from a Mac holds ._<name>.png beside each mask (AppleDouble metadata); taken as
    ids, they stopped the run with "missing image ._ADE_val_...jpg". They are left out."""
    write_ade(tmp_path)
    folder = tmp_path / "ADEChallengeData2016" / "annotations" / "validation"
    for mask in list(folder.iterdir()):
        (folder / f"._{mask.name}").write_bytes(b"\0\5\26\7 Mac OS X metadata")
    masks = eval_sets.segmentation_set("ade20k", tmp_path)
    assert len(masks.images) == 2


# ----------------------------------------------------------------------- text that is not text, one file two names
@pytest.mark.parametrize("raw, says", [
    ("\u200b", "sentences[1] is empty"), ("\x07", "sentences[1] is empty"), ("\ufeff \u200b", "sentences[1] is empty"),
    ("\ud83d a dog on the grass", "sentences[1] holds a lone surrogate '\\ud83d' at character 0")])
def test_a_caption_of_invisible_characters_or_a_lone_surrogate_is_one_line(tmp_path, raw, says):
    """Zero-width or control characters alone passed the empty-caption check and tokenized to
    nothing (rc 0); a lone surrogate (a JSON "\\ud83d" without its pair) was a TypeError from the
    tokenizer. Both are one line naming the image, when the data loads."""
    write_karpathy(tmp_path / "coco")
    split_file = entries_of(tmp_path)
    [e for e in split_file["images"] if e["split"] == "test"][1]["sentences"][1]["raw"] = raw
    (tmp_path / "coco" / "dataset_coco.json").write_text(json.dumps(split_file))   # ascii escapes, as json writes
    with pytest.raises(SystemExit) as e:
        data.coco(tmp_path)
    assert f"test image test_1.jpg: {says}" in one_line(e)
    with pytest.raises(SystemExit, match=r"1 caption\(s\) in coco/test with no text to align"):
        checks.check_texts(["a dog", raw], "coco/test")


def test_a_test_image_that_is_a_symlink_to_a_training_image_is_overlap(tmp_path):
    """Paths were compared by abspath: a test image linked to a training image was not caught."""
    write_karpathy(tmp_path / "coco")
    link = tmp_path / "coco" / "val2014" / "test_2.jpg"
    link.unlink()
    link.symlink_to(tmp_path / "coco" / "train2014" / "train_5.jpg")
    with pytest.raises(SystemExit) as e:
        data.coco(tmp_path)
    assert "are the same image" in one_line(e) and "a test image that is also a training image" in str(e.value)


def test_a_data_root_is_the_data_however_its_path_is_spelled(tmp_path):
    """<root>/coco for <root>, or a symlink to <root>: the same data folder and the same data_hash
    (the real paths of the files), so no 'other data' refusal and no features extracted again."""
    write_karpathy(tmp_path / "root" / "coco")
    (tmp_path / "link").symlink_to(tmp_path / "root")
    spellings = [tmp_path / "root", tmp_path / "root" / "coco", tmp_path / "link", tmp_path / "link" / "coco"]
    assert {data.data_folder("coco", p) for p in spellings} == {str(tmp_path / "root")}
    assert len({data.identity(data.coco(p)["train"]) for p in spellings}) == 1
    assert data.data_folder("coco", tmp_path / "elsewhere") == str(tmp_path / "elsewhere")


def test_a_config_without_image_size_names_image_size_and_patch_size(tmp_path, models):
    """A DINOv2 config.json without image_size (transformers' default 518 -> more position rows
    than saved): the hint named hidden_size, which is right; the cause is the image / patch size."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    config = json.loads((folder / "config.json").read_text())
    del config["image_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert "position_embeddings" in one_line(e) and "(image_size / patch_size?)" in str(e.value)


def test_the_tokenizer_self_check_truncates_to_the_models_length(tmp_path, models, capfd):
    """A tokenizer of max length 8: its self-check caption (9 tokens) printed transformers' "Token
    indices sequence length is longer than ..." on every correct run."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(tc, model_max_length=8)))
    import logging
    from transformers.utils.logging import get_logger
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    get_logger("transformers").addHandler(handler)
    try:
        enc = encoders.load_hf_text(str(folder))
    finally:
        get_logger("transformers").removeHandler(handler)
    assert enc.max_length == 8
    assert not any("longer than the specified maximum" in m for m in heard), heard
    assert "longer than the specified maximum" not in capfd.readouterr().err


def test_a_non_square_crop_is_cropped_as_the_models_processor_crops(tmp_path, models):
    """crop_size {"height": 32, "width": 48} was cropped 32 x 32; the model's own processor gives
    32 x 48. The pixels are the processor's, and the patch grid is 4 x 6."""
    from PIL import Image
    from transformers import AutoImageProcessor
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    pc = json.loads((folder / "preprocessor_config.json").read_text())
    pc["crop_size"], pc["size"] = {"height": 32, "width": 48}, {"shortest_edge": 52}
    (folder / "preprocessor_config.json").write_text(json.dumps(pc))
    enc = encoders.load_hf_image(str(folder))
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8))
    ours = enc.transform([img])
    theirs = AutoImageProcessor.from_pretrained(str(folder))(images=[img], return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape == (1, 3, 32, 48)
    assert (ours - theirs).abs().max() < 0.05                      # resampling rounds (uint8), nothing more
    assert enc.encode([img]).grid == (4, 6)


@pytest.mark.parametrize("sharded", [False, True])
def test_activations_beyond_fp16_are_one_line_naming_the_layer(tmp_path, models, monkeypatch, sharded):
    """Activations above 65504 became inf in the fp16 cache with no word; token methods then stopped
    with "loss is nan ... Try a lower --lr", the wrong advice. Now one line when the file or shard is
    written, naming the encoder and its layer; nothing is cached."""
    if sharded:
        monkeypatch.setattr(shards, "MEMMAP_BYTES", 0)
        monkeypatch.setattr(shards, "SHARD_BYTES", 4096)
    enc = encoders.load_hf_text(str(models / "bert"))
    encode = enc.encode
    monkeypatch.setattr(enc, "encode", lambda texts, device="cpu": (lambda f: Features(
        tokens=f.tokens * 1e6, mask=f.mask, pooled=f.pooled, grid=f.grid))(encode(texts, device)))
    with pytest.raises(SystemExit) as e:
        extract(enc, ["a dog sits on the cat.", "the man rides a red dog."] * 4, tmp_path)
    assert f"{enc.name} (layer -1) gives" in one_line(e) and "tokens value(s) beyond 65504" in str(e.value)
    assert not list((tmp_path / "features").glob("*.pt"))
