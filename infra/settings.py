"""The one settings object of a run: built once, before any work, from the flags; completed as the
run learns the rest (the inputs, then the loop); read by everything that records or compares them.

    settings = Settings(args, method_cls, hp, device, out)   # checks.before_any_work builds it
    settings.read_inputs(image_enc, text_enc, sets)          # the layers used, the weights, the data
    settings.resolve_loop(method, img, txt, cores)           # epochs, batch, lr, threads as they run

    settings.flags()        the flags as given: the --out rule compares them before any work
    settings.depends_on()   what a checkpoint is compared on (--resume); the loop adds its own
    settings.loop           what the training loop reads (epochs, batch_size, lr, weight_decay, seed)
    settings.config(method) config.json: all of the above, as resolved
"""
import argparse
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch

import data
from infra import budget, distributed
from infra.errors import RunError

# config.json's fields that say where and how a run writes, or what ran it: recorded, never compared
OUTPUT_ONLY = ("out", "resume", "threads", "cache_dir", "figures", "encode_threads", "train_threads",
               "given", "software", "files")

# Valid ranges: an interval string ("[1, inf)", "(0, 1]") or a tuple of choices. infra/checks.py
# checks the training loop's settings against these; a method declares its hyperparameters' ranges
# ONCE, next to its defaults, as the class attribute `ranges` (methods/__init__.py), and may
# override these.
LOOP_RANGES = dict(epochs="[0, inf)", lr="(0, 3.4028234663852886e+38]", weight_decay="[0, inf)",  # lr: float32's max
                   batch_size="[2, inf)")  # contrastive: another pair in the batch is the negative


@dataclass
class Settings:
    args: argparse.Namespace      # the flags as parsed
    method_cls: type
    hp: dict                      # --hp, checked; plus head_rows when the run aligns on head rows alone
    device: str                   # "cpu" or "cuda"
    out: Path
    inputs: dict = field(default_factory=dict)   # read_inputs: layers used, weights, the data's identity
    loop: dict = field(default_factory=dict)     # resolve_loop: LOOP as it runs
    threads: dict = field(default_factory=dict)  # resolve_loop: encode_threads, train_threads

    # -- as given --------------------------------------------------------------------------------
    def flags(self):
        return flags(self.args)

    def loop_given(self, defaults):
        """The loop's settings as given: the flags, else the method's defaults."""
        a = self.args
        pick = lambda flag, name, fallback=None: flag if flag is not None else defaults.get(name, fallback)
        return dict(epochs=pick(a.epochs, "epochs"), batch_size=a.batch_size or defaults.get("batch_size"),
                    lr=pick(a.lr, "lr"), weight_decay=pick(a.weight_decay, "weight_decay", 0.0), seed=a.seed)

    # -- the inputs ------------------------------------------------------------------------------
    def read_inputs(self, image_enc, text_enc, sets):
        """The layers the encoders use, their weights' fingerprints, the data folder by its real path
        and data.identity of the training set (its files by path, size and time, its captions, their
        image links); and the head_rows keyword when the method reads it (head_row_hp)."""
        a = self.args
        self.hp = head_row_hp(a, self.method_cls, self.hp, image_enc)
        self.inputs = dict(image_layer=image_enc.layer, text_layer=text_enc.layer,
                           image_weights=getattr(image_enc, "fingerprint", None),
                           text_weights=getattr(text_enc, "fingerprint", None),
                           data_root=data.data_folder(a.data, a.data_root), data_hash=data.identity(sets["train"]))

    def depends_on(self, loop=None):
        """What a checkpoint depends on (compared on --resume): the method and every hyperparameter,
        the data and its identity, the encoders, their layers and weights; plus `loop`'s items."""
        a, inputs = self.args, self.inputs
        params = inspect.signature(self.method_cls.__init__).parameters
        full_hp = {n: params[n].default for n in hp_names(self.method_cls)} | self.hp
        return dict(method=a.method, data=a.data, image_encoder=a.image_encoder, text_encoder=a.text_encoder,
                    image_layer=a.image_layer, text_layer=a.text_layer, select_layers=a.select_layers,
                    align_data=a.align_data, num_pairs=a.num_pairs, hard_negatives=a.hard_negatives,
                    **{f"hp.{k}": v for k, v in full_hp.items()},
                    image_layer_used=inputs["image_layer"], text_layer_used=inputs["text_layer"],
                    image_weights=inputs["image_weights"], text_weights=inputs["text_weights"],
                    data_root=inputs["data_root"], data_hash=inputs["data_hash"], **(loop or {}))

    # -- the loop --------------------------------------------------------------------------------
    def resolve_loop(self, method, img, txt, cores):
        """The loop's settings as the run will use them: the flags, else the method's defaults, on a
        CPU with no --epochs within the FLOP budget of infra/budget.py; and the thread counts."""
        a = self.args
        self.threads = dict(encode_threads=torch.get_num_threads(), train_threads=torch.get_num_threads())
        given = self.loop_given(method.defaults)
        if method.loss is None:
            self.loop = given
        else:
            self.loop = plan_loop(given, method, len(img))       # a batch it cannot train on stops here
            distributed.check_batch(method, self.loop["batch_size"], a.hard_negatives)
            if self.device == "cpu":
                gflop, budgeted, line = budget.cpu_default(a.epochs, a.batch_size, method, img, txt)
                if line:
                    print(f"[cpu default] {a.method}: {line}")
                    self.loop = plan_loop({**given, **budgeted}, method, len(img))
                    distributed.check_batch(method, self.loop["batch_size"], a.hard_negatives)
                torch.set_num_threads(a.threads or budget.cpu_threads(gflop, cores))
                self.threads["train_threads"] = torch.get_num_threads()
                print(f"[threads] training on {self.threads['train_threads']} (a step's forward: {gflop:.2f} "
                      f"GFLOP of matrix products)")
        distributed.same_everywhere("settings", {**self.depends_on(), **self.loop, **self.threads})

    # -- config.json -----------------------------------------------------------------------------
    def config(self, method, alignment_pairs):
        """config.json: every flag as resolved, the loop's settings, every hyperparameter as the method
        runs it, what the inputs are, and what ran the run (recorded, not compared)."""
        a, inputs = self.args, self.inputs
        return dict(vars(a), **self.loop, **self.threads, hp=hp_as_run(method, self.depends_on()),
                    device=self.device, out=str(self.out), alignment_pairs=alignment_pairs,
                    image_layer=inputs["image_layer"], text_layer=inputs["text_layer"],
                    image_weights=inputs["image_weights"], text_weights=inputs["text_weights"],
                    data_root=inputs["data_root"] or a.data_root, data_hash=inputs["data_hash"],
                    methods_sha256=methods_sha256(), method_defaults=method.defaults, given=self.flags(),
                    software=software())


def flags(args):
    """The flags as given, but those that only say where and how the run writes (OUTPUT_ONLY); the
    data root by the real path of the data it holds (data.data_folder), not by its spelling."""
    given = {k: v for k, v in vars(args).items() if k not in OUTPUT_ONLY}
    if "data_root" in given:
        given["data_root"] = data.data_folder(args.data, args.data_root)
    return given


def compared(config):
    """What a run's results depend on: config.json without its output-only fields."""
    return {k: v for k, v in config.items() if k not in OUTPUT_ONLY}


def head_row_hp(args, method_cls, hp, image_enc):
    """hp, plus the interface's head_rows keyword (methods/__init__.py) when the method reads it
    (reads_head_rows) and aligns on head rows alone: what the image encoder's head reads."""
    if aligned_on(args) == "weights" and method_cls.reads_head_rows:
        return {"head_rows": getattr(image_enc, "head_reads", "pooled"), **hp}
    return hp


def hp_as_run(method, depends_on):
    """Every hyperparameter as the method runs it (config.json's "hp"): the keyword's value (given,
    else the __init__ default), or what __init__ resolved it to when it keeps it under its own name
    (PAL's pooling None -> "cap"; methods/__init__.py)."""
    kept = vars(method)                                   # the instance's plain attributes
    plain = lambda x: x is None or isinstance(x, (bool, int, float, str))
    return {name: kept[name] if plain(kept.get(name, ())) else value
            for name, value in ((k[3:], v) for k, v in depends_on.items() if k.startswith("hp."))}


def plan_loop(given, method, n):
    """The loop's settings as they run on n pairs, from the settings given: the batch at most n, a
    step budget ("steps", methods/__init__.py) as ceil(steps / steps per epoch) epochs. A batch the
    method cannot train on is refused."""
    batch = min(given["batch_size"], n)
    refuse_batch(type(method), batch, n)
    steps = n // batch                  # the last partial batch is dropped: InfoNCE wants full ones
    epochs = given["epochs"] if given["epochs"] is not None else -(-method.defaults["steps"] // steps)
    return dict(given, epochs=epochs, batch_size=batch)


def methods_sha256(folder=None):
    """sha256 over methods/*.py, sorted by name (each file's name, then its bytes): the method code a run
    trained with. config.json records it, and outfolder compares it as a setting, so a run of changed
    method code is refused in the --out of the old one."""
    import hashlib
    h = hashlib.sha256()
    for path in sorted(Path(folder or Path(__file__).resolve().parents[1] / "methods").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def software():
    """What ran the run, recorded but not compared (OUTPUT_ONLY): python, torch, transformers (its
    installed version, without importing it) and the git commit of this code (None outside a checkout)."""
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


# ---------------------------------------------------------------------------
# Valid values: what infra/checks.py refuses by
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
    if isinstance(spec, (tuple, list)):
        return f"one of {', '.join(map(repr, spec))}"
    return f"in {spec}"


def hp_names(method_cls):
    params = inspect.signature(method_cls.__init__).parameters
    return [n for n in params if n not in ("self", "d_image", "d_text")]


def aligned_on(args):
    """What the run aligns on: --align-data, but "weights" for weights+pairs with --num-pairs 0."""
    return "weights" if args.align_data == "weights+pairs" and args.num_pairs == 0 else args.align_data


def refuse_batch(method_cls, batch, n, flag=""):
    """A batch the method cannot train on (below its batch_size range): refused, before the features
    when --num-pairs caps the pairs, else once the pairs are counted."""
    low = method_cls.ranges.get("batch_size", LOOP_RANGES["batch_size"])
    if not in_range(batch, low):
        raise RunError(f"{flag}a batch of {batch} pair(s) ({n} alignment pairs): {method_cls.__name__} "
                       f"takes batch_size {describe(low)}; use more pairs")
