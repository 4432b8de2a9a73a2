"""Writing and reading the files a run keeps: atomically, checksummed, locked, never unpickling code.

Every file this project writes (feature caches, checkpoints, the tiny encoders' weights, config
and metrics) goes through atomic_save / atomic_write_text: written beside its target and renamed
onto it, so a reader sees the old file or the new one, never half of one. safe_load reads one back
with torch.load(weights_only=True) and its checksum verified; file_lock keeps two runs from writing
the same key at once (infra/folder.py holds --out with open_lock); a full disk is said in one line (write_failure).
"""
import contextlib
import errno
import hashlib
import os
import pickle
import re
import shutil
import stat
import tempfile
import zlib
from pathlib import Path

import torch

from infra.errors import RunError, first_line

# ---------------------------------------------------------------------------
# Writing and reading cache files: atomic, locked, and never unpickling code
# ---------------------------------------------------------------------------
# Every file this project writes holds only tensors and plain values (dict, list,
# tuple, str, int, float, bool, None), so every file is read with
# torch.load(weights_only=True): a cache folder or checkpoint someone else made
# cannot run code here. A file that needs more is refused, never loaded.
#
# Every cache file (features, shard metadata, the tiny encoders' checkpoints: dicts
# holding a "key") and every training checkpoint (a dict holding "settings") carries
# a crc32 checksum of its contents, verified on every read: a file changed on disk
# (a flipped bit, a partial copy) is rebuilt, never read as valid. A token shard's
# checksum covers the whole .npy file; it is verified whenever the file's size or
# modification time differs from what was recorded when it was written (a full
# check of every shard on every run would read COCO train's 32 GB of tokens).
SEALED = ("key", "settings")   # a dict holding one of these gets a checksum


def checksum(obj, crc=0):
    """crc32 of every tensor's dtype, shape and bytes and every plain value in obj, in a fixed order."""
    if isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            if k != "checksum":
                crc = checksum(obj[k], zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        for v in obj:
            crc = checksum(v, crc)
        return zlib.crc32(f"{type(obj).__name__} {len(obj)}".encode(), crc)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{t.dtype} {tuple(obj.shape)}".encode(), crc)
        return zlib.crc32(t.view(torch.uint8).numpy().data, crc)
    return zlib.crc32(repr(obj).encode(), crc)


def sealed(obj):
    """obj with its checksum added, when it is a dict of the kinds in SEALED."""
    if isinstance(obj, dict) and any(k in obj for k in SEALED):
        return {**obj, "checksum": checksum(obj)}
    return obj


def file_crc(path, chunk=2**24):
    """crc32 of a file's bytes."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def no_space(folder):
    return RunError(f"no space left in {folder}: free some space there, or point "
                      f"--cache-dir / --out at a disk with room, then rerun (finished work is kept)")


def free_bytes(folder):
    return shutil.disk_usage(folder).free


def write_failure(e, path):
    """The one error line of a write that failed for lack of room, or None for any other exception.

    OSError ENOSPC / EDQUOT; or torch.save's own RuntimeError ("[enforce fail at inline_container.cc]
    ... unexpected pos", "PytorchStreamWriter failed writing"), raised by its C++ writer when the
    disk fills mid-file, which carries no errno: then the folder's free space tells."""
    folder = Path(path).parent
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space(folder)
    if isinstance(e, RuntimeError) and ("inline_container" in str(e) or "PytorchStreamWriter" in str(e)):
        if free_bytes(folder) < 2**20:
            return no_space(folder)
        return RunError(f"writing {path} failed ({first_line(e)}): a full disk or quota? free some space "
                          f"there, or point --cache-dir / --out at another disk, then rerun")
    return None


@contextlib.contextmanager
def atomic_target(path):
    """A temporary name beside path, renamed onto path when the block ends: an interrupted
    run leaves no half file. The temporary file is removed when the write fails (Ctrl-C,
    disk full); a full disk stops the run with one line naming the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    if tmp.is_symlink() or tmp.is_file():   # a copied leftover (a link is never written through)
        tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        failure = write_failure(e, path)                   # before the unlink frees the space again
        tmp.unlink(missing_ok=True)
        if failure is not None:
            raise failure from None
        raise


def atomic_save(obj, path):
    """torch.save through atomic_target, with a checksum added (sealed)."""
    obj = sealed(obj)
    with atomic_target(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


def atomic_write_text(text, path):
    """Path.write_text through atomic_target (config.json, metrics.json)."""
    with atomic_target(path) as tmp:
        tmp.write_text(text)


def load_plain(path):
    """torch.load(weights_only=True); a file holding anything but tensors and plain values is
    refused with one line (unpickling it could run code). Other errors (a truncated file) propagate."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise RunError(f"refusing to load {path}: it holds pickled Python objects besides tensors and "
                         f"plain values, and unpickling them could run code. This project never writes such "
                         f"files; delete it (a cache file is rebuilt) and find out where it came from.") from None
    if isinstance(obj, dict) and "checksum" in obj and obj["checksum"] != checksum(obj):
        raise ValueError(f"{path} fails its checksum: its contents changed after it was written")
    return obj


def safe_load(path, expect_key=None):
    """Load a cache file, or None when missing, unreadable or written for another key (then it is rebuilt).

    A file that would need code to unpickle stops the run (load_plain), it is never rebuilt over silently;
    nor is a folder of that name (a user's folder is never deleted here)."""
    path = Path(path)
    if not path.exists():
        return None
    if path.is_dir():                   # its rebuild could not be renamed onto it: said before the work, not after
        raise RunError(f"{path} is a folder where the cache keeps a file; move it away (or delete it: "
                       f"rm -r {path}), then rerun")
    try:
        obj = load_plain(path)
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated / corrupt file, a failed checksum
        why = "fails its checksum" if "checksum" in str(e) else f"is unreadable ({type(e).__name__})"
        print(f"[cache] {path} {why}; rebuilding it")
        return None
    if expect_key is not None and (not isinstance(obj, dict) or obj.get("key") != expect_key):
        print(f"[cache] {path} was written for other settings; rebuilding it")
        return None
    if expect_key is not None and "checksum" not in obj:
        print(f"[cache] {path} has no checksum (an older version wrote it); rebuilding it")
        return None
    return obj


def fits(model, state, path):
    """Load a cached state_dict into model; False (one printed line, the file is rebuilt) when its shapes differ."""
    try:
        model.load_state_dict(state)
        return True
    except RuntimeError as e:
        print(f"[cache] {path} holds weights of other shapes ({first_line(e)}); rebuilding it")
        return False


@contextlib.contextmanager
def file_lock(path, log=print):
    """Hold an exclusive lock on `path` (a lock file) across processes, e.g. two runs sharing a cache:
    the second waits until the first has written what both need, then reads it. The kernel
    releases the lock when a process dies, so a killed run never blocks the next one.
    A no-op where fcntl is missing (Windows): there, do not share a cache between concurrent runs."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_lock(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[cache] another run is writing {path.stem}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_lock(path):
    """A lock file opened for reading and writing, created when missing, never through a link (a
    results folder copied with tar or rsync -a keeps one, and the lock's text would overwrite its
    target): a link, or anything but a regular file, is refused with one line."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        fd = None
    if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
        return os.fdopen(fd, "r+")
    if fd is not None:
        os.close(fd)
    what = "a link" if Path(path).is_symlink() else "not a regular file"
    raise RunError(f"{path} is {what} where this run keeps its lock file (a folder copied with tar or "
                   f"rsync -a keeps links); remove it (rm {path}), then rerun")


def check_writable(folder, flag, create=True):
    """Stop with one line naming the folder when it cannot be written (read-only, full, not a
    folder), before any long work: a probe file of 1 MB is written, synced and removed.
    create=False (--out): nothing is made; the probe goes into the nearest folder that exists."""
    folder = Path(folder)
    taken = next((p for p in [folder, *folder.parents] if p.exists()), None)  # the nearest part that exists
    if taken is not None and not taken.is_dir():
        raise RunError(f"{flag} {folder}: {taken} is a file, not a folder; pass {flag} a folder "
                         f"(or move the file away)")
    try:
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder if create else taken or ".", prefix=".write-probe-") as f:
            f.write(b"\0" * 2**20)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RunError(f"{flag} {folder} is full (no space left on its disk); free some space "
                             f"or pass {flag} on another disk") from None
        why = "is on a read-only file system" if e.errno == errno.EROFS else f"cannot be written ({e.strerror})"
        raise RunError(f"{flag} {folder} {why}; pass {flag} a folder you can write to") from None


# ---------------------------------------------------------------------------
# Fingerprints: what a cache key holds besides a name
# ---------------------------------------------------------------------------
# Fingerprints: what the feature cache is keyed by besides an encoder's name (its weights, its code).
#
# The same name can hold other weights (a re-pretrained tiny encoder, another revision downloaded into
# the same folder), so features are keyed by the weights:
# - the tiny encoders: a hash of their state_dict (and vocabulary), exact;
# - a Hugging Face snapshot folder (hub cache) or a model loaded by hub name: its commit hash, as the
#   Hugging Face cache itself keys files by revision;
# - any other model folder: every file's name and size, plus its content hash (files up to 16 MB:
#   config, tokenizer, small weights) or, for larger weight files, its modification time and a hash of
#   its first and last MB: reading a 1.2 GB checkpoint in full on every run would cost seconds, while
#   another revision written into the folder changes the mtime (and nearly always the size or the
#   first tensors);
# - torchvision: the weights enum and its URL (whose name carries the file's hash).
FULL_HASH_BYTES = 16 * 2**20


def state_fingerprint(state, *extra):
    """sha1 of a state_dict's names, dtypes, shapes and values (plus extra plain values), exact."""
    h = hashlib.sha1()
    for name, t in sorted(state.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())       # the raw bytes, any dtype
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def code_hash(*files):
    """sha256 (16 hex digits) of source files, by name and bytes: the code a result was computed with."""
    h = hashlib.sha256()
    for f in sorted(map(str, files)):
        h.update(Path(f).name.encode() + b"\0" + Path(f).read_bytes())
    return h.hexdigest()[:16]


def folder_fingerprint(folder):
    """The weights fingerprint of a model folder (the module docstring)."""
    folder = Path(folder).absolute()
    if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return f"commit {folder.name}"                                    # a Hugging Face cache snapshot
    h = hashlib.sha1()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name} {st.st_size}".encode())
        with open(f, "rb") as fh:
            if st.st_size <= FULL_HASH_BYTES:
                h.update(fh.read())
            else:
                h.update(f" {st.st_mtime_ns}".encode() + fh.read(2**20))
                fh.seek(-2**20, os.SEEK_END)
                h.update(fh.read())
    return "files " + h.hexdigest()[:16]
