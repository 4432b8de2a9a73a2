"""The token-layout contract (features.py) the encoders keep, one family at a time, against the Hugging Face
(or torchvision) model's OWN outputs computed here, independently of the encoder code.

Tiny random-init models built from configs, saved with save_pretrained and loaded back by
path through the project's loaders. For each image family: the patch at grid position
(r, c) is Features token 1 + r*W + c (read from the model's hidden states with the layout
written below, and by perturbing one image patch at layer 0); pooled is the model's own
pooled vector (the head applied to it reproduces the ...ForImageClassification logits);
every token of the last layer went through the final norm pooled went through (one space).
For each text family: the tokens are the word tokens (no CLS / SEP / BOS / EOS), pooled is
the family's own pooling over the whole sequence. Then the rule as the methods see it."""
import numpy as np
import pytest
import torch
from PIL import Image

import cnn_encoders
import encoders
import model_files
import shapes_encoders
from features import Features, word_positions, word_tokens

VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8)
TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
LABELS = dict(id2label={0: "cat", 1: "dog", 2: "car"}, label2id={"cat": 0, "dog": 1, "car": 2})
WORDS = "a an the dog cat man red blue on of in photo sits rides is".split()


class Squares(list):
    """Images marked as a segmentation set's square crops (data.LazyImages square=True): resized straight to the
    crop, so each 8 x 8 block of pixels is one patch (a photo is resized, then centre-cropped, as its processor)."""
    square = True


def images(n, seed=0, size=32):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


# ----------------------------------------------------------------------------- image families
# family -> (how to build it, the tokens Hugging Face puts before the patches, the final norm
# pooled went through, the reference model class). Written from the models' code, not encoders.py.
def build_image(family, path):
    import transformers as tf
    torch.manual_seed(0)
    if family == "dinov2":
        model = tf.Dinov2ForImageClassification(tf.Dinov2Config(**VISION, **LABELS))
    elif family == "dinov2_with_registers":
        model = tf.Dinov2WithRegistersModel(tf.Dinov2WithRegistersConfig(**VISION, num_register_tokens=4))
    elif family == "vit":
        model = tf.ViTForImageClassification(tf.ViTConfig(**VISION, **LABELS))
    elif family == "deit":
        model = tf.DeiTForImageClassification(tf.DeiTConfig(**VISION, **LABELS))
    elif family == "beit_mean":
        model = tf.BeitForImageClassification(tf.BeitConfig(**VISION, use_mean_pooling=True, **LABELS))
    elif family == "beit_cls":
        model = tf.BeitForImageClassification(tf.BeitConfig(**VISION, use_mean_pooling=False, **LABELS))
    elif family == "clip":
        model = tf.CLIPVisionModel(tf.CLIPVisionConfig(**VISION))
    for m in model.modules():          # non-trivial norms, so a missing or extra norm shows
        if isinstance(m, torch.nn.LayerNorm):
            torch.nn.init.normal_(m.weight, 1.0, 0.3)
            torch.nn.init.normal_(m.bias, 0.0, 0.3)
    model.save_pretrained(path)
    return model.eval()


def reference(family, model, x):
    """(prefix tokens, raw last-layer tokens, normed last-layer tokens, pooled, logits or None, hidden states)."""
    with torch.no_grad():
        if family == "clip":
            out = model(pixel_values=x, output_hidden_states=True)
            norm, prefix, logits = getattr(model, "vision_model", model).post_layernorm, 1, None  # transformers 4 / 5
            return (prefix, out.last_hidden_state, norm(out.last_hidden_state), out.pooler_output, None,
                    out.hidden_states)
        base = model.base_model
        out = base(pixel_values=x, output_hidden_states=True)
        logits = model(pixel_values=x).logits if hasattr(model, "classifier") else None
        h = out.last_hidden_state                                   # HF's layernorm applied (Identity for BEiT mean)
        prefix = {"dinov2_with_registers": 5, "deit": 2}.get(family, 1)  # [CLS, 4 registers] / [CLS, DIST]
        if family == "beit_mean":
            normed = base.pooler.layernorm(h)                           # the norm of BEiT's pooler, on every token
            pooled = base.pooler.layernorm(h[:, 1:].mean(1))             # BEiT: layernorm of the mean patch
        else:
            normed, pooled = h, h[:, 0]                                   # CLS after the final layernorm
        return prefix, h, normed, pooled, logits, out.hidden_states


def final_layernorm(family, model):
    base = model if family == "clip" else model.base_model
    return {"clip": lambda: getattr(base, "vision_model", base).post_layernorm,
            "beit_mean": lambda: base.pooler.layernorm}.get(family, lambda: base.layernorm)()


IMAGE_FAMILIES = ["dinov2", "dinov2_with_registers", "vit", "deit", "beit_mean", "beit_cls", "clip"]


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_image_family_layout_pooled_and_one_space(family, tmp_path):
    model = build_image(family, tmp_path)
    enc = encoders.load_hf_image(str(tmp_path))
    imgs = images(3)
    x = enc.transform(imgs)                                            # (3, 3, 32, 32)
    prefix, raw, normed, pooled, logits, hidden = reference(family, model, x)
    f = enc.encode(imgs)
    H, W = f.grid
    assert (H, W) == (4, 4) and f.tokens.shape == (3, 1 + H * W, 32) and f.mask.all()
    for r in range(H):                                                 # the grid: (r, c) -> token 1 + r*W + c
        for c in range(W):
            torch.testing.assert_close(f.tokens[:, 1 + r * W + c], normed[:, prefix + r * W + c], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f.pooled, pooled, atol=1e-5, rtol=1e-5)  # the model's own pooled vector
    torch.testing.assert_close(f.tokens[:, 0], f.pooled)                # token 0 = pooled
    if logits is not None and family != "dinov2":                       # the head reads pooled
        W_, b, names = enc.head()
        assert names == ["cat", "dog", "car"]
        torch.testing.assert_close(f.pooled @ W_.T + b, logits, atol=1e-5, rtol=1e-5)
    ln = final_layernorm(family, model)                                 # one space: each token normed as pooled
    for t in (f.patches(), f.pooled[:, None]):
        z = ((t - ln.bias) / ln.weight).detach()                        # undo the affine part: (B, T, D)
        torch.testing.assert_close(z.mean(-1), torch.zeros(z.shape[:2]), atol=1e-4, rtol=0)
        torch.testing.assert_close(z.var(-1, unbiased=False), torch.ones(z.shape[:2]), atol=1e-3, rtol=0)
    mid = encoders.load_hf_image(str(tmp_path), layer=1).encode(imgs)  # an intermediate layer: raw block output
    h1 = hidden[1]
    torch.testing.assert_close(mid.patches(), h1[:, prefix:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mid.pooled, h1[:, 1:].mean(1) if family == "beit_mean" else h1[:, 0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_image_patch_r_c_is_token_1_plus_r_W_plus_c(family, tmp_path):
    """Behavioural, no layout assumed: at layer 0 a token sees only its own patch; change the
    pixels of the patch at row 1, column 2 and exactly patch token 1 + 1*4 + 2 moves."""
    build_image(family, tmp_path)
    enc = encoders.load_hf_image(str(tmp_path), layer=0)
    a = images(1)[0]
    b = np.asarray(a).copy()
    b[8:16, 16:24] = 255 - b[8:16, 16:24]
    f = enc.encode(Squares([a, Image.fromarray(b)]))    # as a segmentation set's squares: 32 -> 32, as drawn
    changed = (f.tokens[0, 1:] - f.tokens[1, 1:]).abs().sum(-1) > 1e-5    # (H*W,) which patch tokens moved
    assert changed.nonzero().flatten().tolist() == [1 * 4 + 2]


def test_dinov2_head_reads_cls_and_mean_patch_so_it_is_refused(tmp_path):
    build_image("dinov2", tmp_path / "cls")
    with pytest.raises(SystemExit, match="reads 64 features"):
        encoders.load_hf_image(str(tmp_path / "cls")).head()
    build_image("dinov2_with_registers", tmp_path / "plain")            # a plain backbone: no head at all
    with pytest.raises(SystemExit, match="no linear classification head"):
        encoders.load_hf_image(str(tmp_path / "plain")).head()


def test_torchvision_resnet_grid_pooled_and_head():
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    enc = cnn_encoders.TorchvisionEncoder("resnet18", model, transform=model_files.ImagePreprocess(64, 64),
                                      class_names=[str(i) for i in range(1000)])
    imgs = images(2, size=64)
    x = enc.transform(imgs)
    fmaps = []
    hook = model.layer4.register_forward_hook(lambda m, i, o: fmaps.append(o))
    with torch.no_grad():
        logits = model(x)                                              # torchvision's own forward
    hook.remove()
    fmap = fmaps[0]                                                    # (2, 512, 2, 2)
    f = enc.encode(imgs)
    assert f.grid == (2, 2) and f.tokens.shape == (2, 5, 512)
    for r in range(2):
        for c in range(2):
            torch.testing.assert_close(f.tokens[:, 1 + 2 * r + c], fmap[:, :, r, c], atol=1e-5, rtol=1e-5)
    W, b, _ = enc.head()
    torch.testing.assert_close(f.pooled @ W.T + b, logits, atol=1e-4, rtol=1e-4)  # fc reads the mean (pooled)
    torch.testing.assert_close(f.tokens[:, 0], f.pooled)


# ----------------------------------------------------------------------------- text families
def build_text(family, path):
    import transformers as tf
    torch.manual_seed(0)
    wp = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS
    chars = sorted(set("".join(WORDS) + ".,"))
    if family in ("bert", "mpnet"):
        if family == "bert":
            vocab = {w: i for i, w in enumerate(wp)}
            tok = tf.BertTokenizer(vocab=vocab, model_max_length=32)
            config = tf.BertConfig(vocab_size=len(vocab), max_position_embeddings=40, **TEXT)
        else:
            vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + wp[5:])}
            tok = tf.MPNetTokenizer(vocab=vocab, model_max_length=32, unk_token="<unk>")  # unk inside the table
            config = tf.MPNetConfig(vocab_size=len(vocab), max_position_embeddings=40, **TEXT)
    elif family == "roberta":
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
        for c in chars + ["Ġ" + c for c in chars] + ["Ġ"]:
            vocab.setdefault(c, len(vocab))
        tok = tf.RobertaTokenizer(vocab=vocab, merges=[("Ġ", c) for c in chars], model_max_length=32)
        config = tf.RobertaConfig(vocab_size=len(vocab), max_position_embeddings=42, pad_token_id=1, **TEXT)
    elif family == "clip":
        vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
        for c in chars + [c + "</w>" for c in chars]:
            vocab.setdefault(c, len(vocab))
        tok = tf.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=32)
        config = tf.CLIPTextConfig(vocab_size=len(vocab), max_position_embeddings=32, eos_token_id=1,
                                   bos_token_id=0, pad_token_id=1, **TEXT)
    model = tf.CLIPTextModel(config) if family == "clip" else tf.AutoModel.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval(), tok


@pytest.mark.parametrize("family", ["bert", "roberta", "mpnet", "clip"])
def test_text_family_words_and_pooled(family, tmp_path):
    model, tok = build_text(family, tmp_path)
    enc = encoders.load_hf_text(str(tmp_path))
    texts = ["a red dog sits on the cat.", "the man", "a photo of a blue cat"]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch)
    specials = {tok.cls_token_id, tok.sep_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} - {None}
    f = enc.encode(texts)
    words = enc.words(texts)
    real = batch["attention_mask"].bool()
    for b in range(len(texts)):
        ids = batch["input_ids"][b]
        keep = [t for t in range(len(ids)) if real[b, t] and int(ids[t]) not in specials]   # the word positions
        n = len(keep)
        assert f.mask[b].tolist() == [True] * n + [False] * (f.mask.shape[1] - n)
        torch.testing.assert_close(f.tokens[b, :n], out.last_hidden_state[b, keep], atol=1e-5, rtol=1e-5)
        assert (f.tokens[b, n:] == 0).all()
        assert words[b] == tok.convert_ids_to_tokens(ids[keep].tolist())
        assert not set(words[b]) & set(tok.all_special_tokens)
    m = real[..., None].float()
    if family == "clip":
        torch.testing.assert_close(f.pooled, out.pooler_output, atol=1e-5, rtol=1e-5)          # CLIP's EOS token
    else:                                                              # sentence-transformers: mean over all tokens
        torch.testing.assert_close(f.pooled, (out.last_hidden_state * m).sum(1) / m.sum(1), atol=1e-5, rtol=1e-5)
    alone = enc.encode(texts[1:2])                                     # padding does not change a row
    torch.testing.assert_close(alone.tokens[0], f.tokens[1, :alone.tokens.shape[1]], atol=1e-5, rtol=1e-5)


def test_shapes_text_encoder_keeps_the_words_and_pools_over_cls_and_words():
    vocab = shapes_encoders.SPECIALS + WORDS
    torch.manual_seed(0)
    model = shapes_encoders.TinyTextEncoder(len(vocab))
    tok = shapes_encoders.WordTokenizer(vocab)
    enc = shapes_encoders.ShapesTextEncoder(model, tok)
    texts = ["a red dog", "the cat sits on a man"]
    ids, real = tok(texts)
    with torch.no_grad():
        h = model(ids, real)                                           # (2, 7, 96): [CLS] + words
    f = enc.encode(texts)
    assert enc.words(texts) == [t.split() for t in texts]
    for b, t in enumerate(texts):
        n = len(t.split())
        torch.testing.assert_close(f.tokens[b, :n], h[b, 1:1 + n])     # [CLS] (position 0) dropped
        m = real[b]
        torch.testing.assert_close(f.pooled[b], h[b, m].mean(0))      # pooled unchanged: [CLS] + words


def test_word_positions_on_a_planted_batch():
    real = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    special = torch.tensor([[1, 0, 0, 1, 1], [1, 0, 1, 0, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    idx, mask = word_positions(real, special)
    assert [i[m].tolist() for i, m in zip(idx, mask)] == [[1, 2], [1, 3], [0, 1]]   # row 3: no word, keeps its tokens
    h = torch.arange(15.0).view(3, 5, 1)
    tokens, m = word_tokens(h, real, special)
    assert tokens[..., 0].tolist() == [[1, 2], [6, 8], [10, 11]] and m.all()


# ----------------------------------------------------------------------------- the rule, as methods see it
def test_pal_cap_reads_patches_not_the_global_token():
    """PAL's Z are the patch tokens (and the word tokens): changing the global token 0 of an
    image changes nothing in CAP's pooled vector."""
    from methods.pal import PAL, cap, relative
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, 1 + 6, 5, generator=g)
    img = Features(tokens, torch.ones(2, 7, dtype=torch.bool), tokens[:, 0], (2, 3))
    moved = Features(torch.cat([100 * torch.randn(2, 1, 5, generator=g), tokens[:, 1:]], 1), img.mask, img.pooled,
                     (2, 3))
    m = PAL(5, 4, K=6)
    with torch.no_grad():
        p = m.pool(img, "image")
        torch.testing.assert_close(m.pool(moved, "image"), p)
        ref = cap(relative(tokens[:, 1:], m.A_v), torch.ones(2, 6, dtype=torch.bool), m.tau_p)[0]  # patches only
        torch.testing.assert_close(p, ref)


def test_token_level_methods_score_the_words_of_real_encoder_features(tmp_path):
    """The Features every token-level method reads hold no special token: each method's text
    embedding of a caption equals its embedding of the caption's word tokens, computed here
    from the Hugging Face model alone."""
    from methods import METHODS
    model, tok = build_text("bert", tmp_path)
    enc = encoders.load_hf_text(str(tmp_path))
    texts = ["a red dog sits on the cat.", "the man"]
    f = enc.encode(texts)
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    for name in ("cov", "filip", "text_guided", "pal", "fa"):
        torch.manual_seed(0)
        method = METHODS[name](8, 32).eval()
        for b, _t in enumerate(texts):
            ids = batch["input_ids"][b]
            keep = [i for i in range(len(ids))
                    if int(ids[i]) not in (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)]
            words = Features(h[b:b + 1, keep], torch.ones(1, len(keep), dtype=torch.bool), f.pooled[b:b + 1])
            with torch.no_grad():
                ours, ref = method.embed_text(f[b:b + 1]), method.embed_text(words)
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=name)


def test_the_contract_lives_beside_features_and_the_tiny_encoders_do_not_import_encoders():
    """No import circle: encoders.py loads shapes_encoders.py, which takes the rule from features.py."""
    import ast
    from pathlib import Path

    import features
    root = Path(__file__).resolve().parent.parent
    tree = ast.parse((root / "shapes_encoders.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "encoders" not in imported and "features" in imported
    assert shapes_encoders.word_positions is features.word_positions is encoders.word_positions
    assert shapes_encoders.TOKEN_RULE == features.TOKEN_RULE
