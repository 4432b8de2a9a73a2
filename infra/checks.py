"""The checks align.py runs before any long work: flags, hyperparameters, places, memory, texts.

Each fault of the user's input is one `error:` line saying what to do (errors.RunError), raised
before an encoder loads or a feature is extracted where it can be known then; docs/faults.md
lists them with their tests. align.py calls them in its order; none of them changes a setting.
"""
import argparse
import ast
import inspect
import os
from pathlib import Path

import torch

import data
from infra import model_files, outfolder, storage
from infra.errors import RunError
from infra.settings import LOOP_RANGES, Settings, aligned_on, describe, flags, hp_names, in_range, refuse_batch

# ---------------------------------------------------------------------------
# Checks that run before anything else
# ---------------------------------------------------------------------------
FLAGS = dict(epochs="--epochs", batch_size="--batch-size", lr="--lr", weight_decay="--weight-decay")


MIN_SELECT_PAIRS = 10  # mutual kNN takes k = ceil(2 n^(1/3)) neighbours: 10 pairs, k = 5 of 9


def before_any_work(args, method_cls, out):
    """Every refusal that needs no work, in one call: --hp, a student copy's blank exercises, the
    flags against their ranges and the method's interface, the device, the paths and --out.
    Returns the run's Settings (infra/settings.py), as given."""
    hp = parse_hp(method_cls, args.hp)
    refuse_blank_exercises(args)
    check_flags(args, method_cls)
    return Settings(args, method_cls, hp, check_places(args, out), Path(out))


def refuse_blank_exercises(args):
    """In a student copy (exercises/this_copy.json, written by exercises/make_student_copy.py), a run
    that needs an exercise still blank stops here; the course's table decides. The reference
    checkout loads nothing of the course."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "exercises" / "this_copy.json").is_file():
        return
    import importlib.util
    spec = importlib.util.spec_from_file_location("course_table", root / "exercises" / "table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    table.refuse_blank_exercises(args.method, args.analyses, args.select_layers, root=root)


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
        if value in getattr(method_cls, "hp_words", {}).get(name, ()):   # a word a numeric hp also takes
            hp[name] = value
            continue
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
                       f"infra/budget.py)")
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


def check_pair_count(args, method_cls):
    """--num-pairs that leaves no pairs, or fewer than the smallest batch the method trains on:
    refused before any features are extracted (head rows may add more: weights+pairs is let be)."""
    if args.num_pairs is None or args.align_data != "pairs":
        return
    if args.num_pairs == 0:
        raise RunError("--num-pairs 0 leaves no alignment data; add the head rows with --align-data weights")
    if method_cls.loss is not None:
        refuse_batch(method_cls, args.num_pairs, args.num_pairs, f"--num-pairs {args.num_pairs}: ")


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


def check_out_data(args, out):
    """--out holds no finished run of other settings (outfolder's rule), checked on the flags as given,
    before any work."""
    flags_of = lambda config: flags(argparse.Namespace(**{k: config.get(k) for k in vars(args)}))
    outfolder.check_out(out, flags(args), flags_of)


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


# ---------------------------------------------------------------------------
# The data's checks: captions with text, features that vary
# ---------------------------------------------------------------------------
def check_texts(texts, where):
    """An empty caption (no visible character) has no tokens to align, one that is not valid Unicode
    cannot be tokenized (data.text_fault): stop with where it is, before any encoder runs."""
    bad = [(i, data.text_fault(t or "")) for i, t in enumerate(texts) if data.text_fault(t or "")]
    if bad:
        raise RunError(f"{len(bad)} caption(s) in {where} with no text to align (the first, at index "
                       f"{bad[0][0]}, {bad[0][1]}); give them text or remove them from the annotation file")


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
