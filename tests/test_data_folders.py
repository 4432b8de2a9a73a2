"""Real data folders (data.py, eval_sets.py): tiny files in the real layouts (COCO + Karpathy JSON,
VOC masks, ADE20K), each fault planted by hand; every user fault is ONE `error:` line naming the file
and what to do, before any long work; pairs follow txt_to_img."""
import json
from argparse import Namespace

import numpy as np
import pytest
import torch
from faults_common import (  # noqa: F401  (fixtures)
    VOC_BASE,
    also_in_train,
    caption_index_features,
    entries_of,
    entry,
    entry_without_split,
    extract,
    listed_twice,
    models,
    no_images_key,
    non_utf8_byte,
    one_line,
    only_restval,
    rewrite,
    run_align,
    sentence_without_raw,
    truncated_json,
    voc_mask_fault,
)
from PIL import Image
from test_real import write_ade, write_eurosat, write_karpathy, write_voc

import align
import data
import encoders
import eval_sets
from features import Features


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


def test_an_undecodable_image_is_one_line_naming_it(tmp_path, models):
    """A JPEG cut short past its header passes the header check when the data loads; decoding it is
    one line naming it (a file that is no image, or a decompression bomb, is refused when the data
    loads: tests/test_folder_data_faults.py)."""
    write_karpathy(tmp_path / "coco")
    f = tmp_path / "coco" / "val2014" / "test_2.jpg"
    f.write_bytes(f.read_bytes()[:700])                       # its header whole, its pixels cut
    test = data.coco(tmp_path)["test"]
    enc = encoders.load_hf_image(str(models / "dinov2"))
    with pytest.raises(SystemExit) as e:                                          # from the decoding threads
        extract(enc, test.images, tmp_path / "cache", modality="image")
    assert "cannot read image" in one_line(e) and str(f) in str(e.value) and "dataset_coco.json" in str(e.value)


def test_an_undecodable_torchvision_image_is_one_line_naming_its_file(tmp_path):
    """The same in an evaluation set read through torchvision: the line named an index ("cannot read image 3")."""
    write_eurosat(tmp_path)
    f = sorted(tmp_path.rglob("*.jpg"))[3]
    f.write_bytes(f.read_bytes()[:700])                       # its header whole, its pixels cut
    images = eval_sets.torchvision_set("eurosat", tmp_path).images
    with pytest.raises(SystemExit) as e:
        [images[2:][i] for i in range(len(images) - 2)]                          # a slice names it too
    assert one_line(e).startswith(f"error: cannot read image {f} (OSError: "), one_line(e)


@pytest.mark.slow
def test_align_reports_an_unreadable_test_image_in_one_line_without_a_traceback(tmp_path, models):
    write_karpathy(tmp_path / "coco")
    f = tmp_path / "coco" / "val2014" / "test_1.jpg"
    f.write_bytes(f.read_bytes()[:700])                       # its header whole, its pixels cut
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


def test_macos_metadata_files_in_the_ade_annotations_are_not_taken_for_masks(tmp_path):
    """A folder copied from a Mac holds ._<name>.png beside each mask (AppleDouble metadata); taken as
    ids, they stopped the run with "missing image ._ADE_val_...jpg". They are left out."""
    write_ade(tmp_path)
    folder = tmp_path / "ADEChallengeData2016" / "annotations" / "validation"
    for mask in list(folder.iterdir()):
        (folder / f"._{mask.name}").write_bytes(b"\0\5\26\7 Mac OS X metadata")
    masks = eval_sets.segmentation_set("ade20k", tmp_path)
    assert len(masks.images) == 2


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
