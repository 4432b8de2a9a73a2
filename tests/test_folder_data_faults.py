"""A researcher's own data folders with the flags they would try first: the Shapes encoders on folder
data, split-file entries that point outside --data-root or name no Karpathy split, image files that
are no image, and evaluation sets present but incomplete. Each is one `error:` line before any
encoder loads (and so before any "[features]" line)."""
import json
import os
from pathlib import Path

import pytest
from faults_common import bomb_png
from test_real import write_ade, write_eurosat, write_karpathy, write_voc

import align

QUICK = ("--eval-images", "20", "--no-figures", "--threads", "1")


@pytest.fixture
def coco(tmp_path):
    write_karpathy(tmp_path / "data" / "coco")
    return tmp_path / "data"


@pytest.fixture
def folders(coco):
    """coco's data root with an evaluation set of each kind beside it: EuroSAT, VOC20 and ADE20K."""
    write_eurosat(coco), write_voc(coco), write_ade(coco)
    return coco


def refused(tmp_path, *flags, capsys=None):
    if capsys:
        capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        align.main(["--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), *QUICK, *flags])
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text, text
    assert not (tmp_path / "cache" / "shapes-encoders").exists()      # nothing pretrained or extracted
    assert not capsys or "[features]" not in capsys.readouterr().out, text
    return text


def refused_data(tmp_path, root, capsys):
    """The one line of a run on a data root that holds a fault, before any feature is extracted."""
    return refused(tmp_path, "--data", "coco", "--data-root", str(root), "--image-encoder", "efficientnet-lite1",
                   "--text-encoder", "minilm", capsys=capsys)


# ------------------------------------------------ case 4: the Shapes encoders on folder data
def test_the_shapes_encoders_on_folder_data_are_refused_naming_an_encoder_to_use(tmp_path, coco):
    """`python align.py --data coco --data-root D` with the default encoders (the Shapes world's tiny
    ones): one line naming an encoder to use, before anything loads (was: 'Could not infer dtype of
    Image' after the data and encoders had loaded)."""
    msg = refused(tmp_path, "--data", "coco", "--data-root", str(coco))
    assert "--image-encoder shapes-cnn" in msg and "efficientnet-lite1" in msg, msg
    msg = refused(tmp_path, "--data", "coco", "--data-root", str(coco), "--image-encoder", "efficientnet-lite1")
    assert "--text-encoder shapes-text" in msg and "minilm" in msg, msg


# ----------------------------------------------------------------------------- case 11: entries outside --data-root
@pytest.mark.parametrize("field, value", [("filename", "../../secret.jpg"), ("filename", "/etc/secret.jpg"),
                                          ("filepath", "../elsewhere")])
def test_a_split_file_entry_outside_the_data_root_is_refused_naming_it(tmp_path, coco, field, value):
    """A Karpathy entry whose filename (or filepath) climbs out with ../ or is absolute was read from
    outside --data-root without a word: refused naming the entry."""
    split = coco / "coco" / "dataset_coco.json"
    entries = json.loads(split.read_text())
    entries["images"][2][field] = value
    split.write_text(json.dumps(entries))
    msg = refused(tmp_path, "--data", "coco", "--data-root", str(coco), "--image-encoder", "efficientnet-lite1",
                  "--text-encoder", "minilm")
    assert f"{split}: images[2]" in msg and f"{field} {value!r} points outside" in msg, msg
    assert not Path(tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a Karpathy split file
@pytest.mark.parametrize("i, name, split", [(7, "test_1.jpg", "Test"), (2, "train_2.jpg", "train ")],
                         ids=["Test", "train-space"])
def test_an_entry_of_no_karpathy_split_is_refused_naming_it(tmp_path, coco, capsys, i, name, split):
    """An entry whose split is none of Karpathy's (a capital, a trailing space) was left out without a
    word: the test or train set shrank."""
    path = coco / "coco" / "dataset_coco.json"
    entries = json.loads(path.read_text())
    entries["images"][i]["split"] = split
    path.write_text(json.dumps(entries))
    assert refused_data(tmp_path, coco, capsys).startswith(
        f"error: {path}: images[{i}] ({name}): its split {split!r} is not one of Karpathy's (train, val, test, "
        f"restval); fix that entry")


# ----------------------------------------------------------------------------- image files
def not_an_image(f):
    f.write_text("this is not an image\n" * 20)


EUROSAT = Path("eurosat", "eurosat", "2750", "Forest", "Forest_1.jpg")


@pytest.mark.parametrize("file, plant, says", [
    (Path("coco", "train2014", "train_5.jpg"), not_an_image,
     "1 of 6 COCO train images cannot be read as images, e.g. {} (UnidentifiedImageError: "),
    (Path("coco", "val2014", "test_1.jpg"), bomb_png,
     "1 of 3 COCO test images cannot be read as images, e.g. {} (DecompressionBombError: "),
    (EUROSAT, not_an_image, "1 of 13 eurosat images cannot be read as images, e.g. {} (UnidentifiedImageError: "),
    (EUROSAT, lambda f: f.write_bytes(b""), "1 of 13 eurosat images are empty (0 bytes), e.g. {}; download it again"),
], ids=["coco-text", "coco-bomb", "eurosat-text", "eurosat-0-bytes"])
def test_an_image_file_that_is_no_image_is_refused_naming_it(tmp_path, folders, capsys, file, plant, says):
    """A text file named .jpg, a decompression bomb, a 0-byte EuroSAT image: found by the first image
    decoded, after the features of other sets had been extracted ("cannot read image 3" for an
    evaluation set). Every image's header is read when the data loads."""
    plant(folders / file)
    text = refused_data(tmp_path, folders, capsys)
    assert text.startswith("error: " + says.format(os.path.realpath(folders / file))), text


# ----------------------------------------------------------------------------- segmentation sets
ADE = Path("ADEChallengeData2016")
VOC_IDS = Path("VOCdevkit", "VOC2012", "ImageSets", "Segmentation", "val.txt")


@pytest.mark.parametrize("file, plant, says", [
    (ADE / "annotations" / "validation" / "ADE_val_00000001.png", Path.unlink,
     "1 of 2 ade20k masks are missing, e.g. {}; "),
    (ADE / "images" / "validation" / "ADE_val_00000001.jpg", Path.unlink,
     "1 of 2 ade20k images are missing, e.g. {}; "),
    (VOC_IDS, lambda f: f.write_text(""), "{} lists no images; "),
    (VOC_IDS, lambda f: f.write_text("\n  \n"), "{} lists no images; "),
    (VOC_IDS, lambda f: f.unlink() or f.mkdir(), "voc20 in {}: IsADirectoryError: "),   # no check lists it: the guard
], ids=["ade-mask-missing", "ade-image-missing", "voc-ids-empty", "voc-ids-blank", "voc-ids-a-folder"])
def test_a_segmentation_set_present_but_incomplete_is_refused_naming_the_file(tmp_path, folders, capsys, file, plant,
                                                                               says):
    """An ADE20K image without its annotation PNG dropped out of the score (mIoU over 1 image of 2); a
    VOC ids file that lists no image read as "voc20: not found ... skipped". Present but broken is an
    error, as a VOC mask missing is."""
    plant(folders / file)
    text = refused_data(tmp_path, folders, capsys)
    path = folders if says.startswith("voc20 in") else folders / file if file == VOC_IDS else \
        os.path.realpath(folders / file)                                  # the guard names the set's root
    assert text.startswith(f"error: {says.format(path)}"), text
