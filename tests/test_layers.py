"""Encoder layers (layers.py): out-of-range layers refused, the layer table keyed by the data."""

import pytest
from faults_common import models, one_line  # noqa: F401  (fixtures)
from PIL import Image
from test_real import write_karpathy

import data
import encoders
import layers


@pytest.mark.parametrize("layers, flag", [((5, -1), "--image-layer 5"), ((0, -1), "--image-layer 0"),
                                          ((-1, 7), "--text-layer 7"), ((-1, -3), "--text-layer -3")])
def test_built_in_encoder_layers_out_of_range_are_refused_before_pretraining(tmp_path, layers, flag):
    with pytest.raises(SystemExit) as e:
        encoders.load_encoders("shapes-cnn", "shapes-text", tmp_path, *layers)
    assert one_line(e).startswith(f"error: {flag}: ") and "has layers" in str(e.value)
    assert not (tmp_path / "encoders").exists()                                 # nothing pretrained


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
