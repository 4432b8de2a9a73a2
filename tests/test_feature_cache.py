"""The feature cache (infra/cache.py, infra/shards.py) on real data folders: features of one data
folder are never read for another, a changed or broken cache file is rebuilt, never read."""
import os

import pytest
import torch
from faults_common import (  # noqa: F401  (fixtures)
    bit_flip,
    delete,
    entries_of,
    extract,
    flip_sign_bits,
    models,
    object_dtype,
    one_line,
    rewrite,
    run_align,
    sharded,
    truncate,
)
from PIL import Image
from test_real import write_karpathy

import data
import encoders
import shapes
from features import Features
from infra import shards, storage


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
    st = f.stat()
    b = bytearray(f.read_bytes())
    b[-10] ^= 1
    f.write_bytes(b)                                                              # other bytes, same size...
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))                              # ...and the old mtime set back
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert ident() != touched                                                     # the ctime tells it
    touched = ident()
    split = entries_of(tmp_path / "a")
    split["images"][1]["sentences"][0]["raw"] += " edited"
    rewrite(tmp_path / "a", split)
    assert ident() not in (first, touched)
    assert data.identity(["a", "b"]) != data.identity(["a", "c"]) and data.identity(["a"]) == data.identity(["a"])
    x = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    y = x.clone()
    y[1, 2, 3, 3] = 1
    assert data.identity(x) != data.identity(y)


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
    fresh = run_align(tmp_path, tmp_path / "d_edit", tmp_path / "fresh_cache", "fresh", models)
    assert edit["retrieval"] == fresh["retrieval"]
    assert edit["retrieval"] != ok["retrieval"]


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
