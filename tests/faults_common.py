"""Helpers of the fault tests on real data folders, model folders and the feature cache (the files
named in tests/README.md): tiny files in the real layouts, faults planted by hand."""
import json
import os
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_real import write_models

import align
from features import Features
from infra import cache, shards, storage

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


def caption_index_features(sets):
    """Planted features: image row i holds the number of its file (train_<k>.jpg -> k), caption j the
    number its text names ("train <k> caption 0"): a pair is right iff the two rows are equal."""
    train = sets["train"]
    k_img = torch.tensor([float(p.stem.split("_")[1]) for p in train.images.keys])
    k_txt = torch.tensor([float(c.split()[1]) for c in train.captions])
    F = lambda v: Features.from_vectors(v[:, None].repeat(1, 4))
    return align.Run(None, None, sets, features={("train", "image"): F(k_img), ("train", "text"): F(k_txt)})


def flip_sign_bits(path, n=20):
    """Flip the sign bit of the first n fp16 / fp32 values of every tensor stored in a torch file, in place
    (the zip container and its pickle stay intact: what a disk or a careless script does)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i.header_offset, i.filename, i.file_size) for i in z.infolist() if "/data/" in i.filename]
    with open(path, "r+b") as f:
        for offset, _name, size in entries:
            f.seek(offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            start = offset + 30 + name_len + extra_len
            for k in range(1, min(n, size // 2) * 2, 2):                          # the high byte of each fp16
                f.seek(start + k)
                b = f.read(1)[0]
                f.seek(start + k)
                f.write(bytes([b ^ 0x80]))


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


def bomb_png(path, side=14000):
    """A PNG whose header says side x side (196 megapixels) with almost no data: a decompression bomb."""
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


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
    from test_real import VISION
    from transformers import BitImageProcessor, ViTConfig, ViTModel
    for f in folder.iterdir():
        f.unlink()
    ViTModel(ViTConfig(**VISION)).save_pretrained(folder)                          # takes 32 x 32 images
    BitImageProcessor(size={"shortest_edge": 72}, crop_size={"height": 64, "width": 64}).save_pretrained(folder)


def no_pad_token(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, pad_token=None)))


def empty_vocab(folder):
    (folder / "vocab.txt").write_text("")
    (folder / "tokenizer.json").unlink()


def edit_config(folder, change):
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(change(c)))


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
