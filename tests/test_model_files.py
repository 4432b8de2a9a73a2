"""Real model folders (model_files.py, encoders.py): Hugging Face folders saved with
save_pretrained, each fault planted by hand; every fault is ONE `error:` line naming the folder
and what to do, when the model loads."""
import json

import numpy as np
import pytest
import torch
from faults_common import (  # noqa: F401  (fixtures)
    PAYLOAD,
    config_only,
    copy_folder,
    crop_too_large,
    edit_config,
    empty_vocab,
    entry,
    models,
    more_labels_than_rows,
    no_head_bias,
    no_pad_token,
    one_line,
    planted_pickle,
    prefixed_keys,
    truncated_config,
    truncated_shard_index,
    truncated_weights,
)
from test_boundaries import coco_argv, copy_of, edit_json, fixtures, one_line_before_work  # noqa: F401

import encoders


def test_a_text_model_folder_without_tokenizer_files_is_refused(tmp_path, models):
    folder = tmp_path / "bert"
    folder.mkdir()
    for f in ("config.json", "model.safetensors"):
        (folder / f).write_bytes((models / "bert" / f).read_bytes())
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "no tokenizer files" in one_line(e)


def test_a_truncated_preprocessor_config_is_refused_not_replaced_by_the_default(tmp_path, models):
    folder = tmp_path / "clip"
    folder.mkdir()
    for f in (models / "clip").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    text = (folder / "preprocessor_config.json").read_text()
    (folder / "preprocessor_config.json").write_text(text[:len(text) // 2])
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert "preprocessor_config.json is truncated or not JSON" in one_line(e)


@pytest.mark.parametrize("fault, says", [
    (truncated_weights, ": SafetensorError: "),
    (config_only, "no weights file"),
    (truncated_config, "config.json is truncated or not JSON"),
    (planted_pickle, ": UnpicklingError: "),
    (crop_too_large, "crops 64 x 64 but the model takes 32 x 32 images")])
def test_image_model_folder_faults_are_one_line(tmp_path, models, fault, says):
    folder = copy_folder(models / "dinov2", tmp_path / "model")
    fault(folder)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert says in one_line(e) and str(folder) in str(e.value)
    assert not PAYLOAD.exists()                                                  # nothing in the pickle ran


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path, models):
    from test_real import TEXT
    from transformers import AutoModel, BertConfig
    folder = tmp_path / "bert"
    AutoModel.from_config(BertConfig(vocab_size=10, max_position_embeddings=40, **TEXT)).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((models / "bert" / f).read_bytes())
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "tokenizer has 36 tokens but the model's embedding table only 10 rows" in one_line(e)


def test_a_mistyped_local_path_is_neither_a_folder_nor_a_hub_model(tmp_path, models, monkeypatch):
    copy_folder(models / "dinov2", tmp_path / "models" / "dinov2-large")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image("models/dinov2-larg")
    assert "neither a folder nor a downloaded hub model (did you mean models/dinov2-large?)" in one_line(e)


@pytest.mark.parametrize("change, says", [
    (lambda c: dict(c, num_hidden_layers=c["num_hidden_layers"] + 2), "32 of its weights are not in the file"),
    (lambda c: dict(c, num_hidden_layers=1), "the file holds 16 weights it has no place for"),
    (lambda c: dict(c, hidden_size=2 * c["hidden_size"]), "tensors of other shapes")])
def test_a_config_that_does_not_describe_the_weights_is_refused(tmp_path, models, change, says):
    """config.json of another model: more layers than were saved (transformers would leave them at
    random and run), fewer (it would drop the rest), another width (its size-mismatch report). The
    one line comes alone: transformers' load report (a table of every missing key) is not printed."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    (folder / "config.json").write_text(json.dumps(change(json.loads((folder / "config.json").read_text()))))
    import logging

    from transformers.utils.logging import get_logger
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    get_logger("transformers").addHandler(handler)
    try:
        with pytest.raises(SystemExit) as e:
            encoders.load_hf_text(str(folder))
    finally:
        get_logger("transformers").removeHandler(handler)
    assert says in one_line(e) and "its config.json does not describe its weights" in str(e.value)
    assert not any("LOAD REPORT" in m for m in heard), heard


@pytest.mark.parametrize("tower, delta", [("vision_config", 1), ("vision_config", -1), ("text_config", 1),
                                          ("text_config", -1)])
def test_a_clip_config_that_does_not_describe_either_tower_is_refused(tmp_path, models, tower, delta):
    """CLIP keeps each tower's depth in a nested config (vision_config, text_config): a layer more or
    fewer than saved is refused for the tower read, as for a one-tower model."""
    folder = copy_folder(models / "clip", tmp_path / "clip")
    config = json.loads((folder / "config.json").read_text())
    config[tower]["num_hidden_layers"] += delta
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        (encoders.load_hf_image if tower == "vision_config" else encoders.load_hf_text)(str(folder))
    assert "its config.json does not describe its weights" in one_line(e)


@pytest.mark.parametrize("fault, says", [
    (no_pad_token, "Asking to pad but the tokenizer does not have a padding token"),
    (empty_vocab, "Missing [UNK] token from the vocabulary")])
def test_a_tokenizer_that_cannot_encode_a_caption_is_refused_when_it_loads(tmp_path, models, fault, says):
    """A tokenizer that loads but cannot pad (no pad token) or tokenize (an empty vocab.txt) failed
    with a traceback mid-extraction; it is now one line when the encoder loads."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    fault(folder)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "its tokenizer cannot encode a caption" in one_line(e) and says in str(e.value)


def test_a_vocabulary_of_special_tokens_only_is_refused_when_it_loads(tmp_path, models):
    """A vocab.txt holding only the special tokens (a truncated copy) encodes every word as [UNK]:
    every caption gets the same features and the run goes on, with no error. Now one line at load."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_text(str(folder))
    assert "reads every word of" in one_line(e) and "as unknown ([UNK])" in str(e.value)


def test_an_image_model_that_is_not_rgb_is_refused_and_a_one_number_mean_applies_to_every_channel(tmp_path, models):
    """A 1-channel model and a 1-value image_mean list were tracebacks (a view of (3, 1, 1));
    image_mean / image_std as one number (transformers' own meaning: every channel) loaded as a TypeError."""
    from test_real import VISION
    from transformers import AutoModel, Dinov2Config
    grey = tmp_path / "grey"
    AutoModel.from_config(Dinov2Config(**VISION, num_channels=1)).save_pretrained(grey)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(grey))
    assert "num_channels 1, but images are read as RGB" in one_line(e)
    for mean, says in ((0.5, None), ([0.5], "gives 1 image_mean and 1 image_std values")):
        folder = copy_folder(models / "dinov2", tmp_path / f"dinov2-{len(str(mean))}")
        config = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps(dict(config, image_mean=mean, image_std=mean)))
        if says is None:
            t = encoders.load_hf_image(str(folder)).transform
            assert t.mean.flatten().tolist() == [0.5] * 3 and t.std.flatten().tolist() == [0.5] * 3
            continue
        with pytest.raises(SystemExit) as e:
            encoders.load_hf_image(str(folder))
        assert says in one_line(e)


@pytest.mark.parametrize("family", ["bert", "clip"])
def test_a_tokenizer_that_pads_on_the_left_gives_the_features_of_right_padding(tmp_path, models, family):
    """padding_side "left" in tokenizer_config.json moved BERT's position embeddings and CLIP's EOS
    (pooled = the last real token) under the padding: other features, with no error."""
    folder = copy_folder(models / family, tmp_path / family)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, padding_side="left")))
    texts = ["a dog", "a red cat sits on the man ."]                       # two lengths: one is padded
    want, got = (encoders.load_hf_text(str(models / family)).encode(texts),
                 encoders.load_hf_text(str(folder)).encode(texts))
    torch.testing.assert_close(got.pooled, want.pooled)
    torch.testing.assert_close(got.tokens, want.tokens)
    assert torch.equal(got.mask, want.mask)


def test_a_preprocessor_that_does_not_normalise_is_followed(tmp_path, models):
    """"do_normalize": false: the model was trained on pixels in [0, 1]; subtracting the stated mean
    anyway gave other inputs, with no error. The model gets the pixels / 255."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(dict(config, do_normalize=False)))
    pixels = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = encoders.load_hf_image(str(folder)).transform
    assert torch.equal(t([pixels]), t.uint8([pixels]).float() / 255)          # resized and cropped, not normalised
    assert encoders.load_hf_image(str(models / "dinov2")).transform([pixels]).min() < 0   # normalised: below 0


@pytest.mark.parametrize("change", [dict(do_rescale=False), dict(rescale_factor=1 / 127.5, image_mean=[1.0] * 3,
                                                                   image_std=[1.0] * 3)])
def test_a_preprocessor_that_rescales_otherwise_is_followed(tmp_path, models, change):
    """"do_rescale": false (the model reads 0..255) or another rescale_factor (here 1/127.5 minus 1:
    pixels in [-1, 1]) were read as / 255: other inputs, with no error. The model gets the
    processor's own pixels."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(dict(config, **change)))
    pixels = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    c = dict(config, **change)
    f = c.get("rescale_factor", 1 / 255) if c.get("do_rescale", True) else 1.0
    mean, std = torch.tensor(c["image_mean"]).view(3, 1, 1), torch.tensor(c["image_std"]).view(3, 1, 1)
    t = encoders.load_hf_image(str(folder)).transform
    x = t.uint8([pixels]).double()                                                 # resized and cropped, 0..255
    want = (x * f - mean.double()) / std.double()                                  # the processor's arithmetic
    got = t([pixels])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("config, says", [({"model_type": "foo"}, "is a 'foo' model; image encoders: ['beit'"),
                                          ({}, "config.json has no model_type, so it is not"),
                                          ([1, 2], "config.json has no model_type, so it is not")])
def test_a_model_type_transformers_does_not_know_is_one_line(tmp_path, models, config, says):
    """An unknown or missing model_type (a config.json from another library, a newer transformers)
    was transformers' ValueError with its traceback."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    old = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in old.items() if k != "model_type"} | config
                                                   if isinstance(config, dict) else config))
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert says in one_line(e)


def test_a_caption_longer_than_a_roberta_takes_is_truncated_to_its_positions(tmp_path, models):
    """RoBERTa counts positions from pad_token_id + 1 (514 rows, 512 tokens): with a tokenizer whose
    model_max_length is unset (1e30), a long caption was an IndexError mid-extraction."""
    folder = copy_folder(models / "roberta", tmp_path / "roberta")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=int(1e30))))
    enc = encoders.load_hf_text(str(folder))
    rows = enc.model.config.max_position_embeddings                    # 42
    assert enc.max_length == rows - 2
    f = enc.encode(["dog " * 100, "a dog"])
    assert f.mask[0].sum() == rows - 4                                 # <s> and </s> dropped


def test_a_classifier_head_without_class_names_is_refused_for_weight_recycling(tmp_path):
    """A classifier saved without id2label gets transformers' LABEL_0, LABEL_1, ...: weight
    recycling aligned each head row with "a photo of a LABEL_0.", with no error."""
    from test_real import VISION
    from transformers import BeitConfig, BeitForImageClassification
    BeitForImageClassification(BeitConfig(**VISION, use_mean_pooling=True, num_labels=3)).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(tmp_path)).head()
    assert "has no class names (its config.json id2label says LABEL_0 .. LABEL_2)" in one_line(e)


@pytest.mark.parametrize("id2label, says", [
    ({"0": "cat", "1": "dog", "5": "car"}, "has no class name for row 2 (1 of its 3 rows; config.json id2label gives "
                                           "no entry there)"),
    ({"0": "cat", "1": "dog", "2": " "}, "has no class name for row 2 (1 of its 3 rows; config.json id2label gives "
                                         "an empty name there)")])
def test_a_head_row_without_a_class_name_is_refused_for_weight_recycling(tmp_path, models, id2label, says):
    """id2label with a gap (a hand-edited config) was a KeyError traceback as the model loaded, even for a
    run on pairs; an empty name aligned its row with "a photo of a .". The model loads; its head is refused."""
    folder = copy_folder(models / "beit", tmp_path / "beit")
    edit_config(folder, lambda c: dict(c, id2label=id2label, label2id={v: int(k) for k, v in id2label.items()}))
    enc = encoders.load_hf_image(str(folder))                      # a run on pairs never reads the head
    with pytest.raises(SystemExit) as e:
        enc.head()
    assert says in one_line(e)


@pytest.mark.parametrize("model, fault, says", [
    ("beit", no_head_bias, "1 of its weights are not in the file (e.g. classifier.bias; they would be random); the "
                           "weights file is incomplete or belongs to another model"),
    ("beit", more_labels_than_rows, "tensors of other shapes (2; e.g. classifier.bias is [3] in the file, [5] by "
                                    "config.json); config.json belongs to another model (id2label / num_labels?)"),
    ("dinov2", prefixed_keys, "names every weight with the prefix 'model.' (model.embeddings.cls_token for "
                              "embeddings.cls_token): it was saved from a wrapper's state_dict"),
    ("dinov2", truncated_shard_index, "model.safetensors.index.json is truncated or not JSON")])
def test_model_folder_faults_name_their_cause(tmp_path, models, model, fault, says):
    """A head without its bias blamed config.json's depth (num_hidden_layers?);
    a config asking for more classes than the head has said "(the report above)" of a report kept quiet;
    keys saved with a wrapper's prefix blamed config.json; a truncated shard index was a JSONDecodeError
    traceback. Each is one line naming the cause, when the encoder loads."""
    folder = copy_folder(models / model, tmp_path / model)
    fault(folder)
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert says in one_line(e) and str(folder) in str(e.value)


def test_a_config_without_image_size_names_image_size_and_patch_size(tmp_path, models):
    """A DINOv2 config.json without image_size (transformers' default 518 -> more position rows
    than saved): the hint named hidden_size, which is right; the cause is the image / patch size."""
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    config = json.loads((folder / "config.json").read_text())
    del config["image_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        encoders.load_hf_image(str(folder))
    assert "position_embeddings" in one_line(e) and "(image_size / patch_size?)" in str(e.value)


def test_the_tokenizer_self_check_truncates_to_the_models_length(tmp_path, models, capfd):
    """A tokenizer of max length 8: its self-check caption (9 tokens) printed transformers' "Token
    indices sequence length is longer than ..." on every correct run."""
    folder = copy_folder(models / "bert", tmp_path / "bert")
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(tc, model_max_length=8)))
    import logging

    from transformers.utils.logging import get_logger
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    get_logger("transformers").addHandler(handler)
    try:
        enc = encoders.load_hf_text(str(folder))
    finally:
        get_logger("transformers").removeHandler(handler)
    assert enc.max_length == 8
    assert not any("longer than the specified maximum" in m for m in heard), heard
    assert "longer than the specified maximum" not in capfd.readouterr().err


def test_a_non_square_crop_is_cropped_as_the_models_processor_crops(tmp_path, models):
    """crop_size {"height": 32, "width": 48} was cropped 32 x 32; the model's own processor gives
    32 x 48. The pixels are the processor's, and the patch grid is 4 x 6."""
    from PIL import Image
    from transformers import AutoImageProcessor
    folder = copy_folder(models / "dinov2", tmp_path / "dinov2")
    pc = json.loads((folder / "preprocessor_config.json").read_text())
    pc["crop_size"], pc["size"] = {"height": 32, "width": 48}, {"shortest_edge": 52}
    (folder / "preprocessor_config.json").write_text(json.dumps(pc))
    enc = encoders.load_hf_image(str(folder))
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8))
    ours = enc.transform([img])
    theirs = AutoImageProcessor.from_pretrained(str(folder))(images=[img], return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape == (1, 3, 32, 48)
    assert (ours - theirs).abs().max() < 0.05                      # resampling rounds (uint8), nothing more
    assert enc.encode([img]).grid == (4, 6)


def weights_as_int32(folder):
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    save_file({k: (v * 100).to(torch.int32) for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})


def bin_holding(obj):
    def plant(folder):
        (folder / "model.safetensors").unlink()
        torch.save(obj, folder / "pytorch_model.bin")
    return plant


def long_train_caption(d):
    f = d / "coco" / "coco" / "dataset_coco.json"
    split = json.loads(f.read_text())
    split["images"][3]["sentences"][0]["raw"] += " dog" * 120                      # a training image's caption
    f.write_text(json.dumps(split))


TOKENIZER, PREPROCESSOR = "models/bert/tokenizer_config.json", "models/dinov2/preprocessor_config.json"
MODEL_FAULTS = {   # name: (plant the fault in run folder d, the line's start after "error: " ({d}: that folder))
    "model_max_length 0": (lambda d: edit_json(d / TOKENIZER, model_max_length=0),
                           "--text-encoder {d}/models/bert: captions would be cut to 0 tokens (tokenizer_config.json "
                           "model_max_length 0, config.json max_position_embeddings 40), no room for a word beside "
                           "the 2 special tokens"),
    "model_max_length 1, a 120-word caption": (
        lambda d: (edit_json(d / TOKENIZER, model_max_length=1), long_train_caption(d)),
        "--text-encoder {d}/models/bert: captions would be cut to 1 tokens"),
    "model_max_length 2": (lambda d: edit_json(d / TOKENIZER, model_max_length=2),
                           "--text-encoder {d}/models/bert: captions would be cut to 2 tokens"),
    "model_max_length 3": (lambda d: edit_json(d / TOKENIZER, model_max_length=3),
                           "every caption of coco/train tokenizes to the same 3 tokens ([CLS] train [SEP]) once cut "
                           "to 3 (--text-encoder {d}/models/bert: tokenizer_config.json model_max_length 3"),
    "model_max_length a string": (lambda d: edit_json(d / TOKENIZER, model_max_length="32"),
                                  "--text-encoder {d}/models/bert: its tokenizer_config.json gives model_max_length "
                                  "'32', not a whole number"),
    "weights stored as int32": (lambda d: weights_as_int32(d / "models/dinov2"),
                                "--image-encoder {d}/models/dinov2: model.safetensors stores 27 floating-point "
                                "weights as other numbers (e.g. embeddings.cls_token as I32)"),
    "a .bin of int32 weights": (lambda d: bin_holding({"embeddings.cls_token": torch.zeros(1, 1, 32).int()})(
        d / "models/dinov2"), "--image-encoder {d}/models/dinov2: pytorch_model.bin stores 1 floating-point weights "
                              "as other numbers (e.g. embeddings.cls_token as int32)"),
    "a .bin holding a list": (lambda d: bin_holding([1, 2, 3])(d / "models/dinov2"),
                              "--image-encoder {d}/models/dinov2: pytorch_model.bin holds no state_dict of tensors "
                              "(a list of 3)"),
    "a .bin holding a dict of strings": (lambda d: bin_holding({"a": "b"})(d / "models/dinov2"),
                                         "--image-encoder {d}/models/dinov2: pytorch_model.bin holds no state_dict"),
    "size -5": (lambda d: edit_json(d / PREPROCESSOR, size={"shortest_edge": -5}),
                "--image-encoder {d}/models/dinov2: its preprocessor_config.json gives size shortest_edge -5; give "
                "a positive whole number"),
    "crop_size 0": (lambda d: edit_json(d / PREPROCESSOR, crop_size={"height": 0, "width": 32}),
                    "--image-encoder {d}/models/dinov2: its preprocessor_config.json gives crop_size height 0;"),
    "do_resize false": (lambda d: edit_json(d / PREPROCESSOR, do_resize=False),
                        "--image-encoder {d}/models/dinov2: its preprocessor_config.json sets do_resize false"),
    "do_resize and do_center_crop false": (
        lambda d: edit_json(d / PREPROCESSOR, do_resize=False, do_center_crop=False),
        "--image-encoder {d}/models/dinov2: its preprocessor_config.json sets do_resize false"),
    "do_center_crop false": (lambda d: edit_json(d / PREPROCESSOR, do_center_crop=False),
                             "--image-encoder {d}/models/dinov2: its preprocessor_config.json resizes the shorter "
                             "side to 36 with do_center_crop false"),
    "hidden_size a string": (lambda d: edit_json(d / "models/dinov2/config.json", hidden_size="32"),
                             "--image-encoder {d}/models/dinov2: StrictDataclassFieldValidationError: Validation "
                             "error for field 'hidden_size': TypeError: Field 'hidden_size' expected int"),
    "RoBERTa without pad_token_id": (lambda d: edit_json(d / "models/roberta/config.json", pad_token_id=None),
                                     "--text-encoder {d}/models/roberta: TypeError: "),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(MODEL_FAULTS))
def test_a_model_file_fault_is_one_line_naming_the_file_before_any_features(fault, fixtures, tmp_path, capsys):
    """Faults of a model folder's files that were tracebacks (model_max_length 0 or 1: no cut, a long caption past
    the positions), blamed another cause (2: the vocabulary; 3: --text-layer, after the extraction), or were
    silently wrong (weights stored as integers, cast; a non-positive size, do_resize false or no centre crop:
    other pixels than the model's processor gives): one line naming the folder, file and field, before any
    feature. A line of a library's whose first line ends with a colon goes on to its next line; a fault no
    reader names says which encoder folder it came from."""
    d = copy_of(fixtures, tmp_path)
    plant, says = MODEL_FAULTS[fault]
    plant(d)
    text = one_line_before_work(capsys, coco_argv(d, *(("--text-encoder", str(d / "models/roberta"))
                                                       if "RoBERTa" in fault else ())))
    assert text.startswith("error: " + says.format(d=d)), text
