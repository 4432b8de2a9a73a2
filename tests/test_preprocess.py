"""Image preprocessing equal to the model's own: model_files.ImagePreprocess against transformers'
AutoImageProcessor (ViT, DINOv2, CLIP processors as their checkpoints configure them) and torchvision's
weights.transforms() (ResNet-50), on square, landscape and portrait images of several sizes.

Against transformers' default (fast, torchvision-backed) processor, the difference may be no larger than
transformers' own between its slow (PIL) and fast processors on the same image; against the slow one and
against torchvision, equal to 1e-6. The segmentation sets' square crops alone are resized straight."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import model_files

SIZES = [(500, 500), (512, 512), (224, 224), (640, 480), (480, 640), (333, 517), (517, 333), (800, 301)]


def photo(w, h, seed=0):
    """A smooth random image (blocks upsampled): resampling filters differ on it as on a photo."""
    rng = np.random.default_rng(seed + w * 7 + h)
    return Image.fromarray(rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)).resize((w, h), 2)


def processors():
    from transformers import BitImageProcessor, CLIPImageProcessor, DeiTImageProcessor, ViTImageProcessor
    return {"deit": (DeiTImageProcessor(), 224),                         # facebook/deit-*: 256 x 256, then 224
            "vit": (ViTImageProcessor(), 224),                           # google/vit-base-patch16-224: 224 x 224
            "dinov2": (BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                                         image_mean=list(model_files.IMAGENET_MEAN),
                                         image_std=list(model_files.IMAGENET_STD)), 224),   # facebook/dinov2-*
            "clip": (CLIPImageProcessor(), 224)}                         # openai/clip-vit-*: 224, bicubic, CLIP mean


@pytest.mark.parametrize("family", ["vit", "dinov2", "clip", "deit"])
def test_hf_preprocessing_is_the_processors_own_at_every_size_and_aspect(family, tmp_path):
    from transformers import AutoImageProcessor
    processor, size = processors()[family]
    processor.save_pretrained(tmp_path)
    ours = model_files.hf_preprocess(tmp_path, SimpleNamespace(image_size=size))
    default = AutoImageProcessor.from_pretrained(tmp_path)                           # as transformers returns it
    slow = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    for w, h in SIZES:
        img = photo(w, h)
        x = ours([img])
        a = default(img, return_tensors="pt")["pixel_values"]
        b = slow(img, return_tensors="pt")["pixel_values"]
        assert x.shape == a.shape == b.shape
        torch.testing.assert_close(x, b, rtol=0, atol=1e-5, msg=f"{family} {w}x{h} against the slow processor")
        assert (x - a).abs().max() <= (a - b).abs().max() + 1e-5, (family, w, h)


@pytest.mark.parametrize("weights", ["IMAGENET1K_V1", "IMAGENET1K_V2"])
def test_torchvision_preprocessing_is_weights_transforms(weights):
    """ResNet-50's V1 (resize 256) and V2 (resize 232) transforms, bilinear, torchvision's rounded crop offset."""
    import torchvision

    import cnn_encoders
    t = torchvision.models.ResNet50_Weights[weights].transforms()
    ours = cnn_encoders.torchvision_preprocess(t)
    for w, h in SIZES + [(259, 300), (300, 259)]:                         # odd margins: the offset's rounding
        img = photo(w, h)
        torch.testing.assert_close(ours([img])[0], t(img), rtol=0, atol=1e-6, msg=f"{weights} {w}x{h}")


class Squares(list):
    """A segmentation set's images (data.LazyImages with square=True)."""
    square = True


def test_only_segmentation_squares_are_resized_straight(tmp_path):
    """A square photo is resized and centre-cropped as the processor does; a segmentation set's square crop is
    resized straight to the crop, so its mask (the same square) covers the pixels the model sees."""
    processors()["dinov2"][0].save_pretrained(tmp_path)
    ours = model_files.hf_preprocess(tmp_path, SimpleNamespace(image_size=224))
    img = photo(500, 500)
    cropped = img.resize((256, 256), ours.resample).crop((16, 16, 240, 240))
    straight = img.resize((224, 224), ours.resample)
    pixels = lambda im: torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)
    assert torch.equal(ours.uint8([img])[0], pixels(cropped))
    assert torch.equal(ours.uint8(Squares([img]))[0], pixels(straight))


def test_the_cache_key_names_the_fixed_pipeline():
    """Features cached under the old rule (square straight, long side rounded) are not read back."""
    key = repr(model_files.ImagePreprocess(256, 224))
    assert "long side truncated" in key and "whole square only for segmentation crops" in key
    assert "crop offset floor" in key and "crop offset round" in repr(model_files.ImagePreprocess(crop_round="round"))
