"""A model's files, checked before it loads, and the image preprocessing its checkpoint expects.

Before a Hugging Face model runs: a readable config.json, a weights file that matches it
(load_weights: no weight left at random, none ignored), a text encoder's tokenizer files, a hub
name that can be reached; each fault is one error line (docs/faults.md). ImagePreprocess is the
resize, centre crop and normalisation every image encoder applies (hf_preprocess reads a
checkpoint's own preprocessor_config.json). encoders.py builds the encoders from these.
"""
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from infra.errors import RunError, first_line
from infra.run import check_path

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


IMAGE_THREADS = min(32, os.cpu_count() or 1)   # JPEG decode + resize threads (PIL releases the GIL)


STRIP = 64  # an image whose resize would exceed this many crops (an aspect beyond ~50:1, an 8000 x 2 strip) is
            # resized from its crop's box alone; every photo below it is resize-then-crop, as the processors do


class ImagePreprocess:
    """PIL images (or uint8 (3, S, S) tensors) -> (B, 3, crop, crop) normalised floats.

    Resize the shorter side to `resize` (the longer side int(resize * long / short), truncated, as
    transformers' get_resize_output_image_size and torchvision's resize compute it), centre-crop `crop` x
    `crop` (top-left offset floor((size - crop) / 2), as transformers' center_crop; crop_round="round":
    int(round(...)), as torchvision's center_crop), scale to [0, 1], subtract mean, divide by std: the
    processor's own pipeline, PIL's resize included, for every size and aspect. Resized straight to
    crop x crop: every image when resize is None (processors that resize to a fixed height x width: resize
    (H, W) resizes to that, then centre-crops: DeiT's 256 x 256 then 224), and
    the segmentation sets' square crops (images with .square, data.LazyImages), whose masks cover the
    whole square (a resize-then-crop would cut their border off the image but not off the mask).
    An image whose whole resize would exceed STRIP crops (an 8000 x 2 strip) is resized from its
    crop's box alone (PIL's resize(box=...)), within a few grey levels of resize-then-crop.
    Images are decoded in IMAGE_THREADS threads (PIL releases the GIL); a file that
    cannot be read raises its error here, in the main process, naming the file.
    """

    def __init__(self, resize=256, crop=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, resample=3, crop_round="floor"):
        # crop: a side, or (height, width) as a processor's crop_size {"height", "width"} gives it
        self.crop_hw = tuple(crop) if isinstance(crop, (tuple, list)) else (crop, crop)
        self.crop = crop if not isinstance(crop, (tuple, list)) or crop[0] != crop[1] else crop[0]
        if isinstance(self.crop, list):
            self.crop = tuple(self.crop)
        self.resize, self.resample, self.crop_round = resize, resample, crop_round
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def __repr__(self):  # goes into the cache key
        r = lambda t: [round(v, 4) for v in t.flatten().tolist()]
        return (f"resize {self.resize} crop {self.crop} resample {self.resample} mean {r(self.mean)} std {r(self.std)}"
                f"; long side truncated, crop offset {self.crop_round}, whole square only for segmentation crops"
                f"; EXIF upright, alpha on white, strips by box")

    def one(self, img, whole=False):
        """One image -> uint8 (3, crop_h, crop_w); whole: resized straight to the crop (a segmentation square)."""
        from PIL import Image
        if isinstance(img, torch.Tensor):
            img = Image.fromarray(img.permute(1, 2, 0).numpy())
        img = img.convert("RGB")
        w, h = img.size
        ch, cw = self.crop_hw
        if self.resize is None or whole and w == h:
            img = img.resize((cw, ch), self.resample)
        elif isinstance(self.resize, tuple):                                     # (H, W): squashed, then cropped
            (H, W), offset = self.resize, (lambda d: d // 2)
            left, top = offset(W - cw), offset(H - ch)
            img = img.resize((W, H), self.resample).crop((left, top, left + cw, top + ch))
        else:
            short, long = min(w, h), max(w, h)
            new_long = int(self.resize * long / short)                           # truncated, as the processors
            W, H = (self.resize, new_long) if w <= h else (new_long, self.resize)
            W, H = max(cw, W), max(ch, H)                                        # the whole image resized
            offset = (lambda d: d // 2) if self.crop_round == "floor" else (lambda d: int(round(d / 2.0)))
            left, top = offset(W - cw), offset(H - ch)
            if W * H <= STRIP * ch * cw:
                img = img.resize((W, H), self.resample).crop((left, top, left + cw, top + ch))
            else:       # a strip (8000 x 2): only the crop's box is resized, never the 1,024,000 x 256 whole
                sx, sy = w / W, h / H
                img = img.resize((cw, ch), self.resample, box=(left * sx, top * sy, (left + cw) * sx, (top + ch) * sy))
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)   # (3, crop_h, crop_w) uint8

    def uint8(self, images):
        """(B, 3, crop, crop) uint8: decoded, resized and cropped in IMAGE_THREADS threads, not normalised."""
        whole = bool(getattr(images, "square", False))       # a segmentation set's square crops
        if IMAGE_THREADS <= 1 or len(images) == 1:
            return torch.stack([self.one(images[i], whole) for i in range(len(images))])
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(IMAGE_THREADS) as pool:  # images[i] opens the file inside the thread
            return torch.stack(list(pool.map(lambda i: self.one(images[i], whole), range(len(images)))))

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
    if Path(source).is_dir() and not file.is_file():         # the ViT default, scaled to the model: said
        print(f"[encoders] {flag} {source}: no preprocessor_config.json; ViT's default preprocessing (resize "
              f"{round(size * 256 / 224)}, crop {size}, ImageNet mean / std)")
        return ImagePreprocess(round(size * 256 / 224), size)
    if file.is_file():
        read_json(file, flag, source)
    try:
        p = AutoImageProcessor.from_pretrained(source, **HF_SAFE)
    except (OSError, ValueError) as e:
        if file.is_file():
            raise RunError(f"{flag} {source}: its preprocessor_config.json cannot be read "
                             f"({type(e).__name__}: {first_line(e)}); "
                             f"copy it again from the model's download") from None
        return ImagePreprocess(round(size * 256 / 224), size)  # a hub model without one: the ViT default
    check_sizes(p, f"{flag} {source}: its preprocessor_config.json")
    crop = p.crop_size if getattr(p, "do_center_crop", False) else p.size
    crop = (crop["height"], crop["width"]) if crop.get("height") else crop["shortest_edge"]   # (h, w): not squared
    resize = p.size["shortest_edge"] if p.size.get("shortest_edge") else None  # None: fixed height x width
    fixed = (p.size["height"], p.size["width"]) if p.size.get("height") else None
    if resize is None and fixed != (crop if isinstance(crop, tuple) else (crop, crop)):
        resize = fixed                   # DeiT: a fixed height x width (256 x 256), then the centre crop (224)
    per_channel = lambda v: (float(v),) * 3 if isinstance(v, (int, float)) else tuple(v)  # one number: every channel
    mean, std = per_channel(p.image_mean), per_channel(p.image_std)
    if getattr(p, "do_normalize", True) is False:            # the model reads pixels in [0, 1], as its processor
        mean, std = (0.0,) * 3, (1.0,) * 3
    # the processor's pixels are x * rescale_factor (x in 0..255; do_rescale false: x itself); ours are x / 255,
    # so (x * f - mean) / std = (x / 255 - m') / s' with m' = mean / (255 f), s' = std / (255 f)
    f = float(getattr(p, "rescale_factor", 1 / 255)) if getattr(p, "do_rescale", True) is not False else 1.0
    if f <= 0:
        raise RunError(f"{flag} {source}: its preprocessor_config.json gives rescale_factor {f}; "
                         f"give a positive factor (1/255 for pixels in [0, 1])")
    if abs(f * 255 - 1) > 1e-6:
        mean, std = tuple(v / (255 * f) for v in mean), tuple(v / (255 * f) for v in std)
    if len(mean) != 3 or len(std) != 3:
        raise RunError(f"{flag} {source}: its preprocessor_config.json gives {len(mean)} image_mean and "
                         f"{len(std)} image_std values, but images are read as RGB (3 channels): give 3 of each, "
                         f"or one number for all")
    return ImagePreprocess(resize, crop, mean, std, int(getattr(p, "resample", 3) or 3))


def check_sizes(p, where):
    """A processor this pipeline reproduces: positive whole sizes (transformers refuses the rest as it
    runs), a resize (do_resize false keeps each image's own size: cropped or padded raw, or not batchable),
    and, after a resize of the shorter side, a centre crop (without one the sizes differ by aspect)."""
    if not getattr(p, "do_resize", True):
        raise RunError(f"{where} sets do_resize false (each image kept at its own size), which this project does "
                       f"not reproduce; set do_resize to true there, with size the model's input size")
    crop = getattr(p, "do_center_crop", False)
    for key, sizes in (("size", p.size), ("crop_size", p.crop_size if crop else None)):
        for k in ("height", "width", "shortest_edge", "longest_edge"):
            v = sizes.get(k) if sizes is not None else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise RunError(f"{where} gives {key} {k} {v!r}; give a positive whole number of pixels")
    if not crop and p.size.get("shortest_edge"):
        side = p.size["shortest_edge"]
        raise RunError(f"{where} resizes the shorter side to {side} with do_center_crop false, so every image keeps "
                       f"its aspect and images differ in size; set do_center_crop to true and crop_size to "
                       f'{{"height": {side}, "width": {side}}} there')


def read_json(file, flag, folder):
    """A model folder's JSON file, or one error line saying it is truncated or not JSON."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise RunError(f"{flag} {folder}: {Path(file).name} is truncated or not JSON ({e}); "
                         f"copy it again from the model's download") from None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


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
        raise RunError(f"{flag} {folder}: no config.json, so not a Hugging Face model folder; {again}")
    config = read_json(folder / "config.json", flag, folder)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise RunError(f"{flag} {folder}: config.json has no model_type, so it is not a Hugging Face "
                         f"model's config; {again}")
    if "auto_map" in config or "/" in str(config.get("attn_implementation") or ""):   # code from the hub
        raise RunError(f"{flag} {folder}: this checkpoint needs Python code from outside the folder to load "
                       f"(auto_map, or an attn_implementation kernel, in its config.json); this project never "
                       f"runs a model's own code: remove that entry, or use another model")
    families = TEXT_FAMILIES if text else IMAGE_FAMILIES            # before transformers meets an unknown type
    if config["model_type"] not in families:
        raise RunError(f"{flag} {folder} is a {config['model_type']!r} model; "
                         f"{'text' if text else 'image'} encoders: {sorted(families)}")
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise RunError(f"{flag} {folder}: no weights file ({' / '.join(WEIGHT_FILES[::2])}); {again}")
    if text and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise RunError(f"{flag} {folder}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}), so every "
                         f"word would be unknown; copy them from the model's download")
    for f in JSON_FILES:                 # a truncated one: transformers' bare JSONDecodeError names no file
        if (folder / f).is_file():
            read_json(folder / f, flag, folder)


def not_available(name, flag):
    parent = Path(name).expanduser().parent
    if parent != Path(".") and parent.is_dir():                          # models/dinov2-larg: a mistyped folder
        import difflib
        near = difflib.get_close_matches(Path(name).name, [p.name for p in parent.iterdir() if p.is_dir()], n=1)
        hint = f"did you mean {parent / near[0]}?" if near else f"no such folder in {parent}"
        return RunError(f"{flag} {name} is neither a folder nor a downloaded hub model ({hint})")
    local = f"models/{Path(name).name}"
    return RunError(
        f"encoder {name!r} is not available offline: it is neither a local directory nor in the Hugging Face "
        f"cache. On a machine with network run\n    hf download {name} --local-dir {local}\n"
        f"(huggingface_hub < 1.0: huggingface-cli download ...), copy {local} here and pass {flag} {local}.")


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
    # a mistyped folder (models/dinov2-larg), or offline
    if (parent != Path(".") and parent.is_dir()) or hub_unreachable():
        raise not_available(name, flag)
    return name


AGAIN = ("compare its config.json, tokenizer files and weights with the model's own download, or download "
         "the folder again (hf download <name> --local-dir <folder>)")
HF_SAFE = dict(trust_remote_code=False)  # never run a checkpoint's own Python code; weights: safetensors first


def load_weights(cls, source, flag, reads_pooler=False):
    """cls.from_pretrained(source), refused when config.json does not describe the weights file: weights
    the model has but the file lacks (transformers would initialise them at random, e.g. config.json
    asking for more layers than were saved), or weights of the model's own modules the config has no
    place for (fewer layers). A missing pooler is allowed where its output is never read (RoBERTa and
    DeiT checkpoints ship without one); a checkpoint's other heads (BERT's cls, CLIP's other tower) are not ours."""
    from transformers.utils import logging
    stored = stored_dtypes(source, flag)                # a .bin without a state_dict: said before transformers
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()       # its load report (a table of every missing key) is said below, in one line
    logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(source, output_loading_info=True, ignore_mismatched_sizes=True,
                                          dtype=torch.float32, **HF_SAFE)   # fp32, as the cache key says
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
    check_float(model, stored, flag, source)
    ours = {name for name, _ in model.named_children()}
    other = sorted((k, list(a), list(b)) for k, a, b in info.get("mismatched_keys", []))  # (name, file, config)
    if other:
        k, there, here = other[0]
        hint = "id2label / num_labels?" if k.startswith("classifier") else \
            "image_size / patch_size?" if "patch_embeddings" in k or "position_embeddings" in k and "image" in flag \
            else "hidden_size?"
        raise RunError(f"{flag} {source}: its config.json does not describe its weights: tensors of other "
                         f"shapes ({len(other)}; e.g. {k} is {there} in the file, {here} by config.json); config.json "
                         f"belongs to another model ({hint}): copy it again from the model's download")
    missing = sorted(k for k in info["missing_keys"] if reads_pooler or not k.startswith("pooler."))
    extra = sorted(k for k in info["unexpected_keys"] if k.split(".")[0] in ours)
    wrapped = next((u[:-len(missing[0])] for u in info["unexpected_keys"] if missing and u.endswith("." + missing[0])),
                   None)
    if wrapped:                                          # saved from a wrapper's state_dict: every key prefixed
        raise RunError(f"{flag} {source}: its weights file names every weight with the prefix {wrapped!r} "
                         f"({wrapped}{missing[0]} for {missing[0]}): it was saved from a wrapper's state_dict, not "
                         f"with save_pretrained; save the model itself with save_pretrained, or strip {wrapped!r} "
                         f"from the keys")
    if missing or extra:
        what = f"{len(missing)} of its weights are not in the file (e.g. {missing[0]}; they would be random)" \
            if missing else f"the file holds {len(extra)} weights it has no place for (e.g. {extra[0]})"
        if any(re.search(r"\.layers?\.\d+\.", k) for k in missing + extra):     # whole blocks: the depth differs
            raise RunError(f"{flag} {source}: its config.json does not describe its weights: {what}; "
                             f"config.json belongs to another model (num_hidden_layers?): copy it again from the "
                             f"model's download (to read an earlier block, keep the config and pass the layer flag)")
        raise RunError(f"{flag} {source}: its config.json does not describe its weights: {what}; the "
                         f"weights file is incomplete or belongs to another model: copy the folder again from the "
                         f"model's download")
    return model


def stored_dtypes(source, flag):
    """{file: {tensor name: dtype}} of a local folder's weights, as transformers picks them (safetensors first):
    read from the safetensors headers (no tensor loaded), or from the .bin's state_dict (memory-mapped, no
    code run); a .bin holding no state_dict of tensors (a list, a dict of strings) is refused naming it."""
    import safetensors
    folder, found = Path(source), {}
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        files = [folder / single] if (folder / single).is_file() else []
        if not files and (folder / index).is_file():                       # shards: each file once
            shards = read_json(folder / index, flag, source).get("weight_map", {}).values()
            files = [folder / f for f in dict.fromkeys(shards)]
        for f in files:
            if f.suffix == ".safetensors":
                with safetensors.safe_open(str(f), "pt") as st:
                    found[f.name] = {k: st.get_slice(k).get_dtype() for k in st.keys()}
                continue
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:                                    # the legacy (pre-zip) format maps no memory
                sd = torch.load(f, map_location="cpu", weights_only=True)
            if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise RunError(f"{flag} {source}: {f.name} holds no state_dict of tensors (a {type(sd).__name__}"
                               f"{f' of {len(sd)}' if hasattr(sd, '__len__') else ''}); copy it again from the "
                               f"model's download (or save the model with save_pretrained)")
            found[f.name] = {k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()}
        if files:                                                   # safetensors found: the .bin is not read
            break
    return found


def check_float(model, stored, flag, source):
    """Refuse weights stored as integers (or bool) for the model's floating-point parameters: cast to
    float32 on load they were other numbers, with no error. A tensor's name may carry a prefix (bert.)."""
    floats = {k for k, v in model.state_dict().items() if v.is_floating_point()}
    for file, dtypes in stored.items():
        bad = [(k, d) for k, d in dtypes.items() if not d.upper().startswith(("F", "BF"))
               and any(k.split(".", i)[-1] in floats for i in range(k.count(".") + 1))]
        if bad:
            raise RunError(f"{flag} {source}: {file} stores {len(bad)} floating-point weights as other numbers "
                           f"(e.g. {bad[0][0]} as {bad[0][1]}), so they would be cast, not read; copy the file "
                           f"again from the model's download, or save the model in float32 / float16 / bfloat16")


POSITIONS_AFTER_PAD = {"roberta", "xlm-roberta", "mpnet"}  # position ids count from pad_token_id + 1


def text_max_length(tokenizer, config, flag):
    """The tokens a caption is cut to: min(tokenizer_config.json's model_max_length, the model's positions,
    512); refused when it is not a whole number, or leaves no room for a word beside the special tokens
    the tokenizer adds (with 0 or 1 it does not cut at all: a long caption overflowed the positions; with 2
    every caption was [CLS] [SEP])."""
    said = tokenizer.model_max_length
    if isinstance(said, bool) or not isinstance(said, int):
        raise RunError(f"{flag}: its tokenizer_config.json gives model_max_length {said!r}, not a whole number; "
                       f"write it as a number (at most config.json's max_position_embeddings)")
    offset = config.pad_token_id + 1 if config.model_type in POSITIONS_AFTER_PAD else 0   # RoBERTa: 514 - 2
    positions = getattr(config, "max_position_embeddings", 512)
    cut, special = min(said, positions - offset, 512), tokenizer.num_special_tokens_to_add()
    if cut <= special:
        fix = f"set model_max_length to {positions - offset} there" if said <= positions - offset else \
            "config.json belongs to another model: copy it again from the model's download"
        raise RunError(f"{flag}: captions would be cut to {cut} tokens (tokenizer_config.json model_max_length "
                       f"{said}, config.json max_position_embeddings {positions}), no room for a word beside the "
                       f"{special} special tokens its tokenizer adds; {fix}")
    return cut


def check_cut(enc, captions, where, chunk=256):
    """Captions that all tokenize to the same ids once cut to enc.max_length (model_max_length 3: [CLS]
    "a" [SEP] for every caption) but differ uncut would all get the same features: refused, naming the
    cut, before any feature is extracted. Read a chunk at a time: the first caption that differs ends it."""
    tok, first = enc.tokenizer, None
    for i in range(0, len(captions), chunk):
        ids = tok(list(captions[i:i + chunk]), truncation=True, max_length=enc.max_length)["input_ids"]
        first = first or ids[0]
        if any(x != first for x in ids):
            return
    whole = tok(list(captions), verbose=False)["input_ids"]
    if first is None or all(x == whole[0] for x in whole):   # the same caption throughout: not the cut's doing
        return
    positions = getattr(enc.model.config, "max_position_embeddings", 512)
    raise RunError(f"every caption of {where} tokenizes to the same {len(first)} tokens "
                   f"({' '.join(tok.convert_ids_to_tokens(first))}) once cut to {enc.max_length} (--text-encoder "
                   f"{enc.name}: tokenizer_config.json model_max_length {tok.model_max_length}, config.json "
                   f"max_position_embeddings {positions}), so every caption would get the same features; raise "
                   f"model_max_length there (the model takes {positions} positions)")


IMAGE_FAMILIES = {"dinov2", "dinov2_with_registers", "vit", "deit", "beit", "clip", "clip_vision_model"}


TEXT_FAMILIES = {"bert", "roberta", "xlm-roberta", "mpnet", "distilbert", "clip", "clip_text_model"}
