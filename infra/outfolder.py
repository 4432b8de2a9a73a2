"""The results folder (--out): one rule, one mechanism.

    A finished --out is replaced only by a rerun of the same settings (all of config.json but its
    output-only fields); any other run is refused before any work, naming what differs and an --out
    to use; nothing is written into --out until every check has passed, and a run that fails leaves
    the previous results exactly as they were.

How: a run writes into a sibling folder, partial(out) = <parent>/.<name>.partial (config.json,
its checkpoint each epoch, method.pt, metrics.json, figures); only when it has finished are its
files moved into --out, one rename each, and the previous run's files that this one did not write
(a figure of a run with figures, rerun with --no-figures) are removed: config.json lists a finished
run's files ("files"), so a user's own files in --out stay. --resume continues the checkpoint
there (or a finished run's own checkpoint.pt). The settings compared are config.json's "given"
field (the flags as given, the data folder by its real path) before any work, then, before anything
is written, every resolved field (data_hash, the layers used, the loop's settings).
"""
import contextlib
import json
import os
import re
import shutil
from pathlib import Path

from infra import distributed, storage
from infra.errors import RunError
from infra.settings import compared

OUT_FILES = ("config.json", "metrics.json", "method.pt", "checkpoint.pt")   # what a run writes into --out
HALF = re.compile(r".*\.tmp\d+$|\.checkpoint\.pt\.copy$|\.config\.json\.files$")   # a killed write


def partial(out):
    """Where a run writes until it has finished: a hidden sibling of --out."""
    out = Path(out).resolve()
    return out.parent / f".{out.name}.partial"


def old_config(folder):
    """config.json of a run of this program in folder, or None."""
    try:
        old = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) and "data" in old and "method" in old else None


def foreign_files(folder):
    """The result files (OUT_FILES) in folder that no run of this program wrote: all of them when its
    config.json is not one of ours (a user's, a Hugging Face model's), else those its list of files
    ("files") does not name. A run would replace them, so --out holding one is refused."""
    folder = Path(folder)
    present = [n for n in OUT_FILES if (folder / n).is_file() or (folder / n).is_symlink()]
    old = old_config(folder) if present else None
    if old is None:
        return present
    listed = old.get("files")
    return [n for n in present if n not in listed] if isinstance(listed, list) else []


def differences(old, new):
    """['name X there, Y now', ...] over the keys of either; a dict in both by its keys ('hp.K 512 there, 64 now')."""
    nested = {k for k in old if isinstance(old[k], dict) and isinstance(new.get(k), dict)}

    def flat(d):
        return {f"{k}.{j}" if k in nested else k: w for k, v in d.items()
                for j, w in (v.items() if k in nested else [(None, v)])}
    old, new = flat(old), flat(new)
    return [f"{k} {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def free_name(out):
    """An --out to suggest: out-2, out-3, ... the first that does not exist."""
    n = 2
    while Path(f"{out}-{n}").exists():
        n += 1
    return f"{out}-{n}"


def refuse_other(out, old, new):
    """Stop when the run in out (its settings `old`) is not a rerun of `new`: one line naming what
    differs (the data and the method in words) and a free --out."""
    diff = differences(compared(old), compared(new))
    if not diff:
        return
    where = lambda s: s.get("data") if s.get("data") == "shapes" else f"{s.get('data')} in {s.get('data_root')}"
    if where(old) != where(new):
        what = f"a run on other data ({where(old)}; this run: {where(new)})"
    elif old.get("method") != new.get("method"):
        what = f"a {old.get('method')} run (this run: {new.get('method')})"
    else:
        what = f"a run with other settings ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''})"
    raise RunError(f"--out {out} holds the results of {what}; pass another --out (e.g. --out "
                   f"{free_name(out)}), or delete {out} to replace them")


def check_out(out, given, given_of, resume=False):
    """Before any work: a folder where a result file goes, a result file this program did not write, or a
    finished run of other settings (compared on `given`, the flags as given) in --out are refused.
    given_of(config): the flags of a config.json (its "given" field, or the config itself when written
    without one), resolved as `given` is. resume: --resume asks for out's checkpoint.pt, which the resume
    check then reads with its own refusals (other settings, truncated, code in it)."""
    out = Path(out)
    for name in OUT_FILES:              # a folder of that name: the final rename would fail
        if (out / name).is_dir():
            raise RunError(f"--out {out} holds a folder {name}, where this run writes a file; move it away, or "
                           f"pass another --out")
    foreign = [n for n in foreign_files(out) if not (resume and n == "checkpoint.pt")]
    if foreign:
        raise RunError(f"--out {out} holds a {foreign[0]} that this program did not write (a file of your own, "
                       f"or a model folder's), which this run would replace; pass another --out (e.g. --out "
                       f"{free_name(out)}), or move {out / foreign[0]} away")
    old = old_config(out)
    if old is None:
        return
    then = given_of(old["given"] if isinstance(old.get("given"), dict) else old)   # resolved as `given` is
    refuse_other(out, then, given)


def begin(out, config, resume):
    """After every check, before the first file: refuse a finished run of other resolved settings,
    then the folder the run writes into (partial(out)), emptied unless --resume continues it."""
    old = old_config(out)
    if old is not None:
        refuse_other(out, old, config)
    work = partial(out)
    if work.exists() and not resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for entry in work.iterdir():                # a write killed before its rename: never a result
        if HALF.match(entry.name):
            remove(entry)
    if resume and not (work / "checkpoint.pt").exists() and (Path(out) / "checkpoint.pt").is_file():
        shutil.copy2(Path(out) / "checkpoint.pt", work / ".checkpoint.pt.copy")   # a finished run's, continued
        os.replace(work / ".checkpoint.pt.copy", work / "checkpoint.pt")            # whole or not at all
    return work


def held(out):
    """--out held for this run (storage.hold_folder) by rank 0: a second run on it stops at once."""
    return storage.hold_folder(out, "--out") if distributed.rank() == 0 else contextlib.nullcontext()


@contextlib.contextmanager
def run_folder(out, config):
    """The folder the run writes into, partial(out), with config.json first (begin: a finished run of
    other settings is refused here); when the block ends without an exception, its files move into
    --out (finish). Under torchrun only rank 0 writes; the others wait until config.json is there."""
    lead = distributed.rank() == 0               # asked now: the group may have ended by the block's end
    work = partial(out)
    if lead:
        begin(out, json.loads(json.dumps(config, default=str)), config["resume"])
        storage.atomic_write_text(json.dumps(config, indent=2, default=str), work / "config.json")
    distributed.barrier()                       # no rank reads the checkpoint before it is there
    yield work
    if lead:
        finish(out)                             # the previous results stay until here


def checkpoint(out):
    """The checkpoint --resume continues: the unfinished run's, else the finished run's own."""
    for folder in (partial(out), Path(out)):
        if (folder / "checkpoint.pt").is_file():
            return folder / "checkpoint.pt"
    return partial(out) / "checkpoint.pt"


def finish(out):
    """Move the finished run's files into --out, each by one rename, then remove the previous run's
    files that this run did not write (those its config.json lists; a user's own files stay) and the
    emptied partial folder. The run's config.json gets its list of files first ("files")."""
    out, work = Path(out), partial(out)
    for entry in work.iterdir():                # a write killed before its rename: never moved, never listed
        if HALF.match(entry.name):
            remove(entry)
    names = sorted(entry.name for entry in work.iterdir())
    config = json.loads((work / "config.json").read_text())
    (work / ".config.json.files").write_text(json.dumps(dict(config, files=names), indent=2))
    os.replace(work / ".config.json.files", work / "config.json")       # whole or not at all
    before = old_config(out) or {}
    listed = before.get("files") if isinstance(before.get("files"), list) else []
    stale = [n for n in listed if isinstance(n, str) and n not in ("", ".", "..", *names)
             and Path(n).name == n]                 # names of entries in out itself, nothing above or below
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        remove(out / name, dirs_only=True)
        os.replace(work / name, out / name)
    for name in stale:                              # the previous run's, not written by this one
        remove(out / name)
    work.rmdir()


def remove(path, dirs_only=False):
    """A folder (not through a symlink) by rmtree; a file or a link unless dirs_only."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif not dirs_only and (path.is_file() or path.is_symlink()):
        path.unlink()
