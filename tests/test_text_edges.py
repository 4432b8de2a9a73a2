"""Captions at their edges: longer than the Shapes text encoder's position table, or tokenizing to no
word at all. Each is handled as a Hugging Face tokenizer would (truncated, said once) or refused in
one line naming the first few, before any feature is extracted."""
import json

import pytest
from test_real import models, write_karpathy  # noqa: F401  (the tiny Hugging Face models fixture)

import align
import data
import encoders
from shapes_encoders import SPECIALS, ShapesTextEncoder, TinyTextEncoder, WordTokenizer

VOCAB = SPECIALS + ["a", "red", "circle", "left", "of", "blue", "square"]


def tiny_shapes_text():
    tokenizer = WordTokenizer(VOCAB)
    return ShapesTextEncoder(TinyTextEncoder(len(VOCAB)), tokenizer)


# ----------------------------------------------------------------------------- case 5: longer than max_len
def test_a_caption_longer_than_the_shapes_text_position_table_is_truncated_and_said_once(capsys):
    """61 words with shapes-text (position table 48 = [CLS] + 47 words): 'The size of tensor a (61) must
    match ... (48)' mid-extraction; now cut to its first 47 words as a Hugging Face tokenizer cuts to
    its model's length, said once, and its features those of its first 47 words."""
    enc = tiny_shapes_text()
    long = " ".join(["a red circle left of a blue square"] * 8)                     # 64 words
    cut = " ".join(long.split()[:47])
    f = enc.encode(["a red circle", long, long])
    g = enc.encode(["a red circle", cut, cut])
    assert f.tokens.shape == g.tokens.shape == (3, 47, enc.dim)
    assert (f.tokens - g.tokens).abs().max() < 1e-6 and (f.pooled - g.pooled).abs().max() < 1e-6
    assert [len(w) for w in enc.words(["a red circle", long])] == [3, 47]
    said = capsys.readouterr().out
    assert said.count("cut to their first 47") == 1, said


# ----------------------------------------------------------------------------- case 10: no token at all
def test_captions_that_tokenize_to_nothing_are_refused_naming_the_first_few(models):
    """'\\ufffd\\ufffd' with BERT (its tokenizer drops U+FFFD), '...' with shapes-text: they trained on
    [CLS] / [SEP] alone, while zero-width captions were refused as empty. Refused the same way."""
    bert = encoders.load_hf_text(str(models / "bert"))
    sets = {"train": data.PairSet(images=[None] * 3, captions=["a dog .", "\ufffd\ufffd", "caption 1"],
                                  txt_to_img=[0, 1, 2])}
    with pytest.raises(SystemExit) as e:
        encoders.check_caption_tokens(bert, sets, "coco")
    msg = str(e.value)
    assert msg.startswith("error: 1 caption(s) in coco/train tokenize to no word") and "index 1" in msg, msg
    assert "'\\ufffd\\ufffd'" in msg and "\n" not in msg, msg
    shapes_sets = {"train": data.PairSet(images=[None] * 3, captions=["a red circle", "...", ". ."],
                                         txt_to_img=[0, 1, 2])}
    with pytest.raises(SystemExit, match=r"2 caption\(s\) in shapes/train tokenize to no word .*index 1"):
        encoders.check_caption_tokens(tiny_shapes_text(), shapes_sets, "shapes")
    encoders.check_caption_tokens(bert, {"train": data.PairSet(images=[None], captions=["a dog ."], txt_to_img=[0])},
                                "coco")


@pytest.mark.slow
def test_a_run_with_a_caption_that_tokenizes_to_nothing_stops_before_the_features(tmp_path, models, capsys):
    write_karpathy(tmp_path / "coco")
    split = tmp_path / "coco" / "dataset_coco.json"
    entries = json.loads(split.read_text())
    entries["images"][1]["sentences"][0]["raw"] = "\ufffd\ufffd"
    split.write_text(json.dumps(entries))
    with pytest.raises(SystemExit, match="tokenize to no word"):
        align.main(["--data", "coco", "--data-root", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
                    "--out", str(tmp_path / "out"), "--threads", "1", "--image-encoder", str(models / "dinov2"),
                    "--text-encoder", str(models / "bert")])
    assert "[features]" not in capsys.readouterr().out
