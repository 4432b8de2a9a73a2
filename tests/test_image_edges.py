"""Images at their edges: a degenerate strip, transparency, EXIF orientation. Each is read as the
models' own processors read it (transformers' convert_to_rgb and load_image), within the memory of
the crop it becomes."""
import numpy as np
import pytest
import torch
from PIL import Image

import data
import model_files


def loaded(path):
    """An image file as the sets read it (LazyImages: data.rgb of the opened file)."""
    return data.LazyImages([path])[0]


# ----------------------------------------------------------------------------- case 6: a degenerate strip
def test_a_degenerate_strip_is_cropped_to_the_aspect_before_it_is_resized(tmp_path, monkeypatch):
    """An 8000 x 2 PNG of 16 KB was resized whole to 1,024,000 x 256 (857 MB, 6 s) before its crop; a
    30000 x 1 one needed ~5 GB. The crop's box is resized alone: no image larger than a few crops is
    ever made, and an ordinary photo's pixels are those of resize-then-crop, exactly."""
    made = []
    resize = Image.Image.resize

    def spy(self, size, *a, **k):
        made.append(size[0] * size[1])
        return resize(self, size, *a, **k)
    monkeypatch.setattr(Image.Image, "resize", spy)
    pre = model_files.ImagePreprocess(resize=256, crop=224)
    rng = np.random.default_rng(0)
    for w, h in ((8000, 2), (1, 30000)):
        path = tmp_path / f"strip{w}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
        x = pre.one(loaded(path))
        assert tuple(x.shape) == (3, 224, 224) and x.dtype == torch.uint8
    assert max(made) <= 4 * 256 * 256, max(made)
    photo = Image.fromarray(rng.integers(0, 255, (200, 300, 3), dtype=np.uint8))
    full = photo.resize((384, 256), 3).crop((80, 16, 304, 240))                 # resize whole, then crop
    assert torch.equal(pre.one(photo), torch.from_numpy(np.asarray(full).copy()).permute(2, 0, 1))


# ----------------------------------------------------------------------------- case 7: transparency
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_are_composited_onto_white_as_the_processors_do(tmp_path, mode):
    """convert("RGB") kept the hidden colour under transparent pixels (a fully transparent PNG: mean
    RGB [74, 55, 55]); transformers' convert_to_rgb, which the CLIP and DINOv2 processors run,
    composites onto white. The sets now read it so, half-transparent pixels blended."""
    from transformers.image_transforms import convert_to_rgb
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 255, (16, 16, 4), dtype=np.uint8)
    rgba[:8, :, 3] = 0                                                          # the top half transparent
    img = Image.fromarray(rgba, "RGBA")
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "P":
        img = Image.fromarray(rgba[..., :3]).convert("P", palette=Image.ADAPTIVE, colors=8)
        img.info["transparency"] = 0
    path = tmp_path / f"t-{mode}.png"
    img.save(path)
    got = np.asarray(loaded(path))
    want = np.asarray(convert_to_rgb(Image.open(path)))
    assert np.array_equal(got, want)
    if mode != "P":
        assert (got[:8] == 255).all()                                           # white where nothing is drawn


# ----------------------------------------------------------------------------- case 8: EXIF orientation
def test_an_exif_orientation_is_applied_as_load_image_does(tmp_path):
    """A phone photo stored landscape with EXIF orientation 6 (rotate 90 degrees): the sets read its
    stored pixels sideways; transformers' load_image applies exif_transpose. Now read upright."""
    from PIL import ImageOps
    from transformers.image_utils import load_image
    rng = np.random.default_rng(2)
    img = Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8))
    exif = img.getexif()
    exif[0x0112] = 6
    path = tmp_path / "phone.jpg"
    img.save(path, exif=exif, quality=95)
    got = loaded(path)
    assert got.size == (20, 30)
    assert np.array_equal(np.asarray(got), np.asarray(load_image(str(path))))
    assert np.array_equal(np.asarray(got), np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB")))
