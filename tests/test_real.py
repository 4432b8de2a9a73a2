"""Real datasets and real encoders, offline: tiny files in the real on-disk layouts, tiny
random-init Hugging Face models saved with save_pretrained and loaded back by path,
and one subprocess run of align.py on them end to end. No test touches the network
(conftest sets HF_HUB_OFFLINE=1)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data
import encoders

ROOT = Path(__file__).resolve().parents[1]
WORDS = "a an the dog cat man red blue on of in photo sits rides is".split()


# ----------------------------------------------------------------------------- tiny layouts
def write_image(path, seed, size=(40, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def caption(rng):
    return " ".join(rng.choice(WORDS, size=int(rng.integers(3, 8)))) + "."


def write_karpathy(root, n_train=6, n_test=3, flickr=False):
    """A Karpathy split file and its images; test image 0 has 6 captions (only 5 are kept)."""
    rng = np.random.default_rng(0)
    entries = []
    for split, n in (("train", n_train), ("test", n_test), ("val", 1)):
        for i in range(n):
            folder = "" if flickr else ("train2014" if split == "train" else "val2014")
            name = f"{split}_{i}.jpg"
            n_caps = 6 if (split == "test" and i == 0) else 5
            entry = dict(filename=name, split=split, sentences=[{"raw": f"{split} {i} caption {k} " + caption(rng)}
                                                                for k in range(n_caps)])
            if not flickr:
                entry["filepath"] = folder
            entries.append(entry)
            write_image(root / ("flickr30k-images" if flickr else folder) / name, seed=len(entries))
    root.mkdir(parents=True, exist_ok=True)
    (root / ("dataset_flickr30k.json" if flickr else "dataset_coco.json")).write_text(json.dumps({"images": entries}))


def write_voc(root):
    """Two VOC2012 val images with palette masks: a 28 x 36 mask whose centre square holds the
    quadrant labels 0 (background), 1, 15 and 255 (border); the cropped-off margins hold label 20."""
    base = root / "VOCdevkit" / "VOC2012"
    (base / "ImageSets" / "Segmentation").mkdir(parents=True)
    (base / "SegmentationClass").mkdir(parents=True)
    (base / "ImageSets" / "Segmentation" / "val.txt").write_text("2007_000001\n2007_000002\n")
    m = np.full((28, 36), 20, dtype=np.uint8)
    m[:14, 4:18], m[:14, 18:32], m[14:, 4:18], m[14:, 18:32] = 0, 1, 15, 255
    for i, name in enumerate(["2007_000001", "2007_000002"]):
        write_image(base / "JPEGImages" / f"{name}.jpg", seed=100 + i, size=(36, 28))
        png = Image.fromarray(m, mode="P")
        png.putpalette([v for c in range(256) for v in (c, c, c)])
        png.save(base / "SegmentationClass" / f"{name}.png")


def write_ade(root):
    base = root / "ADEChallengeData2016"
    for i in range(2):
        write_image(base / "images" / "validation" / f"ADE_val_{i:08d}.jpg", seed=200 + i, size=(32, 32))
        m = np.zeros((32, 32), dtype=np.uint8)
        m[:, 16:] = 150
        (base / "annotations" / "validation").mkdir(parents=True, exist_ok=True)
        Image.fromarray(m).save(base / "annotations" / "validation" / f"ADE_val_{i:08d}.png")


def write_eurosat(root):
    for c, cls in enumerate(["AnnualCrop", "Forest", "SeaLake"]):
        for i in range(2):
            write_image(root / "eurosat" / "eurosat" / "2750" / cls / f"{cls}_{i}.jpg", seed=300 + 2 * c + i, size=(16, 16))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    write_karpathy(root / "coco")
    write_karpathy(root / "flickr30k", flickr=True)
    write_voc(root)
    write_ade(root)
    write_eurosat(root)
    return root


# ----------------------------------------------------------------------------- datasets
def test_coco_karpathy_splits(data_root, capsys):
    sets = data.coco(data_root)
    train, test = sets["train"], sets["test"]
    assert len(train.images) == 6 and torch.equal(train.txt_to_img, torch.arange(6))
    assert all(c.startswith(f"train {i} caption 0 ") for i, c in enumerate(train.captions))   # the first caption
    assert len(test.images) == 3 and len(test.captions) == 15                                   # 6 captions -> 5
    assert test.txt_to_img.tolist() == [i // 5 for i in range(15)]
    assert test.captions[5].startswith("test 1 caption 0 ")
    img = test.images[0]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (40, 30)
    assert isinstance(test.images[1:], data.LazyImages) and len(test.images[1:]) == 2
    assert "flickr" in sets and len(sets["flickr"].images) == 3                               # Flickr test, zero-shot
    assert {"eurosat", "voc20", "ade20k"} <= set(sets) and "cifar100" not in sets
    out = capsys.readouterr().out
    assert "cifar100: not found" in out and "context: not found" in out                      # one line per optional set
    assert data.pixels(img).shape == (3, 224, 224) and data.pixels(img).dtype == torch.uint8


def test_flickr_loader(data_root):
    sets = data.flickr(data_root)
    assert len(sets["train"].captions) == 6 and len(sets["test"].captions) == 15
    assert sets["test"].images.keys[0].parent.name == "flickr30k-images"


def test_missing_required_files_give_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="dataset_coco.json") as e:
        data.coco(tmp_path)
    assert "Expected layout" in str(e.value) and "caption_datasets.zip" in str(e.value)
    write_karpathy(tmp_path / "coco")
    for f in (tmp_path / "coco" / "train2014").iterdir():
        f.unlink()
    with pytest.raises(SystemExit, match="COCO train images"):
        data.coco(tmp_path)


def test_segmentation_masks_map_labels_and_follow_the_centre_crop(data_root):
    voc = data.segmentation_set("voc20", data_root)
    S = data.SEG_SIZE
    assert voc.masks.shape == (2, S, S) and voc.masks.dtype == torch.uint8 and len(voc.class_names) == 20
    m = voc.masks[0]
    assert m[:S // 2, :S // 2].eq(data.IGNORE).all()        # background 0 -> ignored
    assert m[:S // 2, S // 2:].eq(0).all()                   # label 1 (aeroplane) -> class 0
    assert m[S // 2:, :S // 2].eq(14).all()                  # label 15 (person) -> class 14
    assert m[S // 2:, S // 2:].eq(data.IGNORE).all()         # border 255 -> ignored
    assert not m.eq(19).any()                                # the cropped-off margins (label 20) are gone
    assert voc.images[0].size == (28, 28)                    # the image is cropped the same way
    ade = data.segmentation_set("ade20k", data_root)
    assert ade.masks[:, :, :S // 2].eq(data.IGNORE).all() and ade.masks[:, :, S // 2:].eq(149).all()
    assert data.segmentation_set("context", data_root) is None


def test_torchvision_classification_set(data_root):
    s = data.torchvision_set("eurosat", data_root)
    assert s.class_names == ["annual crop", "forest", "sea lake"]
    assert s.labels.tolist() == [0, 0, 1, 1, 2, 2] and s.images[5].mode == "RGB"


def test_a_corrupt_image_is_an_error_naming_the_file(tmp_path):
    write_karpathy(tmp_path / "coco")
    bad = tmp_path / "coco" / "train2014" / "train_2.jpg"
    bad.write_bytes(bad.read_bytes()[:60])
    train = data.coco(tmp_path)["train"]
    train.images[1]                                          # the others still read
    with pytest.raises(OSError, match="train_2.jpg"):
        train.images[2]
