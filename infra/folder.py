"""The run folder (--out): its one rule, results never replaced; the files a run writes there; its log.txt.

    with held(out), run_log(out, quiet):   # one run at a time in --out; all it prints also into log.txt
        begin(settings)                     # config.json with the identity, before the features
        ...                                 # align.py: model.safetensors, history.csv, results.csv, metrics.json

The rule is kept by the folder's layout rather than by checks. A run writes straight into --out (each
file written beside its target and renamed onto it, so a rename never leaves the folder's file system).
metrics.json, written last, marks a finished run:
  - a new or empty --out is taken;
  - a finished run in --out is never replaced: the run is refused, naming a free --out;
  - an unfinished run (a checkpoint.pt, kept after a Ctrl-C or a failure) is continued by --resume
    when the identity matches, and otherwise refused: no command but deleting it removes a checkpoint;
  - anything else in --out (a file of your own, a data or model folder) is refused.
With no --out, a run goes into results/<method>-<data>-seed<seed>, or -2, -3, ... when that holds a
finished run (version folders: a rerun never collides with an earlier one).

The files (aligned.load reads a finished run back): config.json (every setting, the identity, and "model":
what rebuilds the method), checkpoint.pt (train.py, each epoch; removed once metrics.json is written, unless
--keep-checkpoint: 3x the model's size, and nothing is left to resume), model.safetensors (the method's state_dict),
history.csv (per epoch), results.csv (a flat view in percent, rounded), log.txt, metrics.json (every
evaluation figure in percent), vocabulary.json (the training captions' words and adjacent word pairs with their
counts: classify tells the class names the captions held from novel ones; a run without it still loads).

log.txt: everything the run prints (stdout and stderr, the progress lines of long loops too) also goes
there (LogFile: written whole through the write gate). Nothing is written before config.json exists (begin
writes it), so a run refused before it takes --out leaves nothing there. A --resume continues the same log.
--quiet keeps the console to the results and the error line (no progress lines); the log still gets every
line. The console streams are line-flushed, so a redirected stdout is never minutes behind.
"""
import contextlib
import csv
import hashlib
import io
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

from infra import distributed, storage
from infra.errors import RunError

FINISHED = "metrics.json"   # written last: its presence marks a finished run
WORDS = re.compile(r"\w+")    # a caption's words (lower-cased first): vocabulary.json's and classify's one rule


# ---------------------------------------------------------------------------
# The rule: a finished run is never replaced
# ---------------------------------------------------------------------------
def out_folder(args):
    """--out, else results/<method>-<data>-seed<seed>, or its first version (-2, -3, ...) that holds no
    finished run."""
    if args.out:
        return Path(args.out)
    base, n = Path(f"results/{args.method}-{args.data}-seed{args.seed}"), 1
    while is_ours(folder := base if n == 1 else Path(f"{base}-{n}")) and (folder / FINISHED).exists():
        n += 1
    return folder


def is_ours(folder):
    """folder holds a run of this program (its config.json carries an identity)."""
    try:
        return "identity" in json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def free_name(out):
    n = 2
    while Path(f"{out}-{n}").exists():
        n += 1
    return f"{out}-{n}"


def check_out(out, args):
    """--out is a new or empty folder, or an unfinished run of this program that --resume continues;
    anything else is refused here, before any work, and nothing in it is ever removed."""
    out = Path(out)
    if os.path.lexists(out) and not out.is_dir():
        what = "a link to nowhere" if out.is_symlink() else "a file"
        raise RunError(f"--out {out} is {what}, not a folder; pass --out a new folder")
    cache = getattr(args, "cache_dir", None)
    if cache is not None and out.resolve() in (Path(cache).resolve(), *Path(cache).resolve().parents):
        raise RunError(f"--out {out} is or holds --cache-dir {cache}: a run folder is kept or moved as a whole, "
                       f"and the feature cache would go with it; pass --out a folder outside it")
    if cache is not None and Path(cache).resolve() in out.resolve().parents:
        raise RunError(f"--out {out} is inside --cache-dir {cache}, which backup tools skip (its CACHEDIR.TAG) "
                       f"and which can be deleted as a whole; pass --out a folder outside it")
    run = next((p for p in out.resolve().parents if (p / "config.json").is_file() and is_ours(p)), None)
    if run is not None:
        raise RunError(f"--out {out} is inside the run folder {run}, whose files are that run's; pass --out a "
                       f"folder beside it (e.g. --out {free_name(run)})")
    if not out.exists() or not any(out.iterdir()):
        if args.resume:
            print(f"[run] --resume: {out} holds no run yet; starting one")
        return
    if not is_ours(out):
        first = sorted(p.name for p in out.iterdir())[0]
        raise RunError(f"--out {out} holds files this program did not write ({first}, ...: a folder of your own, "
                       f"data or a model?); pass --out a new or empty folder, e.g. --out {free_name(out)}")
    if (out / FINISHED).exists():
        raise RunError(f"--out {out} holds a finished run; results are never replaced: pass another --out "
                       f"(e.g. --out {free_name(out)}), or delete {out} yourself")
    if (out / "checkpoint.pt").exists() and not args.resume:
        raise RunError(f"--out {out} holds an unfinished run and its checkpoint (kept); add --resume to continue "
                       f"it, or pass another --out (e.g. --out {free_name(out)})")


def begin(settings):
    """Take --out for this run, before the features: config.json with the identity (the folder is
    written once here, so a folder that cannot be written stops the run now, not after the work). An
    unfinished run's checkpoint stays: --resume compares it (train.resume_state); a run that never
    wrote one is simply restarted."""
    if distributed.RANK != 0:
        return
    config = dict(vars(settings.args), identity=settings.identity, device=settings.device)
    for half in settings.out.glob(".*.tmp"):       # a write killed before its rename (the gate's name)
        half.unlink()
    storage.atomic_write_text(json.dumps(config, indent=2, default=str), settings.out / "config.json")


@contextlib.contextmanager
def held(out):
    """--out held for this run (by rank 0): a second run given the same folder stops at once with one line,
    instead of mixing its files with this one's. The lock file (<parent>/.<name>.lock, beside the folder:
    nothing is written into it) is storage.file_lock's: the kernel releases it when a process dies, so a
    killed run never blocks the next."""
    if distributed.RANK != 0:
        yield
        return
    real = Path(out).resolve()
    with storage.file_lock(real.parent / f".{real.name[:240]}.lock", wait=False,
                           busy=f"--out {out} is in use by a run still going; wait for it to finish, or pass "
                                f"another --out"):
        yield


# ---------------------------------------------------------------------------
# The files (align.py writes them, aligned.load reads them back)
# ---------------------------------------------------------------------------
def model_config(args, identity, image_enc, text_enc, dims):
    """config.json's "model": what rebuilds the method and its encoders from the run folder alone (hp: the
    __init__ keywords as the run passed them, the identity's hp.*). An encoder is recorded by the name that
    resolves it in any environment (minilm: the pip package's folder), with that package's release."""
    hp = {k[3:]: v for k, v in identity.items() if k.startswith("hp.")}
    name = lambda enc: getattr(enc, "by_name", enc.name)        # "minilm", not the path it resolved to here
    releases = {f"{kind}_release": enc.release for kind, enc in (("image", image_enc), ("text", text_enc))
                if getattr(enc, "release", None)}                # a pip package's name and version
    return dict(method=args.method, hp=hp, dims=list(dims), image_encoder=name(image_enc), text_encoder=name(text_enc),
                image_layer=image_enc.layer, text_layer=text_enc.layer,
                cache_dir=str(Path(args.cache_dir).resolve()), templates=templates_of(args.data), **releases)


def templates_of(data_name):
    """The zero-shot templates of the run's data: the Shapes world's own, else CLIP's one prompt."""
    if data_name == "shapes":
        import shapes
        return list(shapes.TEMPLATES)
    return ["a photo of a {}."]


def save_weights(method, path, identity=None):
    """method.state_dict() as safetensors (tied tensors are stored twice); its metadata holds the run's
    identity hash (identity_hash), so weights copied from another run are told apart at load."""
    storage.save_tensors(method.state_dict(), path, metadata=identity and {"identity": identity_hash(identity)})


def identity_hash(identity):
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_history(history, path):
    """history.csv: one row per epoch, the columns every key of the rows in their first order (epoch, loss, the
    method's logs, lr, seconds, and whatever a later row adds); floats to 6 significant digits."""
    columns = list(dict.fromkeys(k for row in history for k in row))
    text = io.StringIO()
    w = csv.DictWriter(text, columns, lineterminator="\n")
    w.writeheader()
    for row in history:
        w.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
    storage.atomic_write_text(text.getvalue(), path)


def write_vocabulary(captions, path):
    """vocabulary.json: each word and each pair of adjacent words ("red circle") of the training captions,
    lower-cased, -> how many times it occurs, sorted; aligned.seen_names reads it (a class name the captions
    never held, e.g. a colour-shape pair never captioned though both its words were, is novel)."""
    grams = Counter(g for c in captions for w in [WORDS.findall(c.lower())] for g in w+ [*map(" ".join, zip(w, w[1:]))])
    storage.atomic_write_text(json.dumps(dict(sorted(grams.items()))), path)


PERCENT_GROUPS = ("retrieval", "classification", "segmentation", "binding")   # evaluate.py: percent or fractions
FRACTIONS = ("i2t_map", "i2t_p1", "i2t_p5", "t2i_p1")                        # in [0, 1]: x 100 here


def in_percent(metrics):
    """metrics.json's form of evaluate.py's metrics: every evaluation figure in percent, as results.csv (the
    weight-recycling fractions FRACTIONS x 100, unrounded), marked "unit": "percent" (a metrics.json without
    that mark, an older run's, holds those four as fractions)."""
    def walk(prefix, v):
        if isinstance(v, dict):
            return {k: walk(f"{prefix}/{k}" if prefix else str(k), x) for k, x in v.items()}
        fraction = prefix.startswith(PERCENT_GROUPS) and prefix.rsplit("/", 1)[-1] in FRACTIONS
        return 100 * v if fraction and isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return {**walk("", metrics), "unit": "percent"}


def flat_metrics(metrics):
    """[(name, value, unit)] of a metrics.json dict, one row per number, names joined by "/": every evaluation
    figure in percent (an older run's weight-recycling fractions x 100), rounded to 2 decimals; the rest as it
    is (4 decimals)."""
    rows, scale = [], 1 if metrics.get("unit") == "percent" else 100

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}" if prefix else str(k), x)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            name = prefix.rsplit("/", 1)[-1]
            if prefix.startswith(PERCENT_GROUPS):
                rows.append((prefix, round(scale * v if name in FRACTIONS else v, 2), "%"))
            else:
                rows.append((prefix, round(v, 4) if isinstance(v, float) else v,
                             "s" if name == "seconds" else ""))
    walk("", metrics)
    return rows


def write_flat(metrics, path):
    """results.csv: flat_metrics as metric,value,unit rows."""
    lines = ["metric,value,unit"] + [f"{n},{v},{u}" for n, v, u in flat_metrics(metrics)]
    storage.atomic_write_text("\n".join(lines) + "\n", path)


# ---------------------------------------------------------------------------
# log.txt (the module docstring)
# ---------------------------------------------------------------------------
_LOUD = [0]


class Tee(io.TextIOBase):
    """A console stream that also writes into the run's log.txt (see the module docstring)."""

    def __init__(self, console, quiet, buffer):
        self.console, self.quiet, self.buffer_ = console, quiet, buffer

    def write(self, s):
        if not self.quiet or _LOUD[0]:
            self.console.write(s)
            if "\n" in s:
                self.console.flush()
        self.buffer_.write(s)
        return len(s)

    def flush(self):
        self.console.flush()
        self.buffer_.flush()

    def isatty(self):
        return self.console.isatty()

    @property
    def encoding(self):
        return getattr(self.console, "encoding", "utf-8")


LOG_EVERY = 2.0   # seconds between two rewrites of log.txt (and one at the end)


class LogFile:
    """log.txt: every line the run prints, kept in memory and written whole through the write gate
    (storage.atomic_target: never appended, never through a link) once config.json exists, then at most
    every LOG_EVERY seconds and at the end. A --resume continues the log its unfinished run left. A write
    that fails is said once at the end (close), so it never stops the run's own work."""

    def __init__(self, out):
        self.out, self.text, self.last, self.failed, self.prior = Path(out), io.StringIO(), 0.0, None, None

    def write(self, s):
        self.text.write(s)
        if "\n" in s:
            self.flush()

    def flush(self, force=False):
        path = self.out / "log.txt"
        if (not force and time.time() - self.last < LOG_EVERY) or self.failed is not None or \
                not (self.out / "config.json").is_file():
            return
        if self.prior is None:          # the log an unfinished run left (--resume), read once
            self.prior = path.read_text(errors="replace") if path.is_file() and not path.is_symlink() else ""
        try:
            storage.atomic_write_text(self.prior + self.text.getvalue(), path)
        except RunError as e:
            self.failed = e
        self.last = time.time()

    def close(self):
        self.flush(force=True)
        if self.failed is not None:
            raise self.failed


@contextlib.contextmanager
def run_log(out, quiet=False):
    log = LogFile(out)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(streams[0], quiet, log), Tee(streams[1], quiet, log)
    global QUIET
    was_quiet, QUIET = QUIET, quiet
    try:
        yield log
    finally:
        sys.stdout, sys.stderr = streams
        QUIET = was_quiet
        log.close()


@contextlib.contextmanager
def shown():
    """What is printed inside reaches the console even under --quiet."""
    _LOUD[0] += 1
    try:
        yield
    finally:
        _LOUD[0] -= 1


# ---------------------------------------------------------------------------
# Progress lines of long loops (stderr; none under --quiet)
# ---------------------------------------------------------------------------
def clock(seconds):
    """Seconds as 42s, 3m07s or 1h02m."""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


QUIET = False    # align.py --quiet: no progress lines


FIRST = 2.0      # seconds before a loop's first progress line


ANNOUNCE = 10000  # a loop over at least this many items says when it starts (COCO's sets; not the Shapes world's)


def to_stderr(line):
    print(line, file=sys.stderr, flush=True)


class Progress:
    """Progress lines of a long loop, in the style of [train]'s: done / total, rate, elapsed, ETA.

    t0: when the work began (the rate counts everything done since, the first batch included).
    The first line after FIRST seconds, then at most one every `every` seconds and one at the end, only
    when the loop ran that long; on stderr, flushed (log=print), so a redirected stdout keeps the results.
    None under --quiet (QUIET)."""

    def __init__(self, tag, total, unit="rows", every=10.0, log=print, t0=None, first=None):
        self.tag, self.total, self.unit, self.every = tag, total, unit, every
        self.first = FIRST if first is None else first
        self.log = to_stderr if log is print else log
        self.t0 = time.time() if t0 is None else t0
        self.done, self.last, self.said = 0, self.t0, False
        if total >= ANNOUNCE and not QUIET:         # a first batch of a large set can take a minute: say it began
            self.log(f"{tag} 0/{total} {unit}, started")

    def line(self):
        dt = max(time.time() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.tag} {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
                f"{rate:,.0f} {self.unit}/s, {clock(dt)} elapsed, ETA {clock(eta) if eta < 1e7 else '?'}")

    def update(self, n, force=False):
        self.done += n
        now = time.time()
        wait = self.every if self.said else self.first
        if not QUIET and (force or (now - self.last >= wait and self.done < self.total)):
            self.last, self.said = now, True
            self.log(self.line())

    def close(self):
        if not QUIET and (self.said or time.time() - self.t0 >= self.every):
            self.log(self.line())
