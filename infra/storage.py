"""The one write gate, and reading back what it wrote: atomically, checksummed, locked, never unpickling code.

Every file this project creates goes through atomic_target (the gate; tests/test_write_gate.py fails
when other code opens a file for writing): written beside its target and renamed onto it, never through
a link, never onto a file it did not make, and any failure is one line with the old file kept.
atomic_save / atomic_write_text / save_tensors / save_npy / save_image are its forms for torch, text,
safetensors, numpy and PIL. safe_load reads a file back with torch.load(weights_only=True) and its
checksum verified; file_lock (the filelock library) keeps two runs from writing the same key at once.
"""
import contextlib
import errno
import hashlib
import os
import pickle
import re
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
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


def write_failure(e, path):
    """The one error line of a write that failed (a RunError), for any exception a writer raises: an OSError
    (a full disk, a read-only file system, a name too long, no permission) by its errno's words, a
    library's own error (safetensors' SafetensorError, torch.save's "PytorchStreamWriter failed") by its
    first line; when the disk is nearly full, that is what the line says."""
    folder = Path(path).parent
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or free_bytes(folder) < 2**20:
        why = "no space left on its disk"
    elif isinstance(e, OSError):
        why = e.strerror or errno.errorcode.get(e.errno, str(e))
    else:
        why = f"{type(e).__name__}: {first_line(e)}"
    return RunError(f"cannot write {path} ({why}); free some space, or point --out / --cache-dir / the file "
                    f"at a folder you can write to, then rerun (finished work is kept)")


def free_bytes(folder):
    try:
        return shutil.disk_usage(next(p for p in [Path(folder), *Path(folder).parents] if p.exists())).free
    except (OSError, StopIteration):
        return 2**40


UMASK = os.umask(0)
os.umask(UMASK)


@contextlib.contextmanager
def atomic_target(path, new=False):
    """THE WRITE GATE: every file this project creates is written here. It yields a temporary file
    beside path (created afresh, O_EXCL: never through a link, never a file someone else made) for the
    block to write, then renames it onto path. So a reader sees the old file or the new one, never half
    of one; an interrupted or failed write leaves path as it was; and:
    - path itself is never a link (the rename would leave the link's target alone, but a link where
      this project keeps a file is someone else's doing: refused, naming it);
    - new=True: path must not exist (a file the user named, e.g. --csv: never onto their files);
    - the file gets the permissions of any new file (0666 less the umask), like the rest of a run;
    - ANY exception while writing (a full disk, a read-only folder, a name too long, a library's own
      error) is one line naming path (write_failure); KeyboardInterrupt passes through."""
    path, tmp = Path(path), None
    try:
        check_target(path)
        if new and path.exists():
            raise RunError(f"{path} exists; pass a new file name (this program never writes over a file it did "
                           f"not make), or delete it yourself")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:200]}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        yield tmp
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
        tmp = None
    except KeyboardInterrupt:
        raise
    except RunError:
        raise
    except Exception as e:
        raise write_failure(e, path) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def check_target(path):
    """The write gate's refusal of a path, for a command to say before its work: path is a link, or a folder
    (anything but a regular file) where this program writes a file."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        what = "a link" if path.is_symlink() else "not a regular file"
        raise RunError(f"{path} is {what} where this program writes a file; move it away, then rerun")


def atomic_save(obj, path):
    """torch.save through the gate, with a checksum added (sealed)."""
    obj = sealed(obj)
    with atomic_target(path) as tmp, open(tmp, "wb") as f:     # a file object: the archive's inner name is fixed
        torch.save(obj, f)


def atomic_write_text(text, path, new=False):
    """Text through the gate (config.json, metrics.json, CSV, log.txt)."""
    with atomic_target(path, new) as tmp:
        tmp.write_text(text, encoding="utf-8")


def save_tensors(state, path, metadata=None):
    """A dict of tensors as safetensors through the gate (model.safetensors, an image index): each its own
    contiguous copy; metadata: more {str: str} for the file's header."""
    from safetensors.torch import save_file
    state = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    with atomic_target(path) as tmp:
        save_file(state, str(tmp), metadata={**(metadata or {}), "format": "pt"})


def save_npy(array, path):
    """A numpy array as .npy through the gate; returns the written file's (bytes, mtime_ns, crc32)."""
    with atomic_target(path) as tmp:
        with open(tmp, "wb") as f:                # a file object: np.save would add .npy to a name
            np.save(f, array)
        st, crc = tmp.stat(), file_crc(tmp)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "crc": crc}


def save_image(image, path):
    """A PIL image (a figure) through the gate, its format from path's suffix."""
    with atomic_target(path) as tmp:
        image.save(tmp, format=Path(path).suffix[1:].upper().replace("JPG", "JPEG"))


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
def file_lock(path, log=print, wait=True, busy=None):
    """An exclusive lock on `path` across processes (the filelock library: the kernel's flock, released
    when a process dies, never opened through a link), e.g. two runs sharing a cache: the second waits
    until the first has written what both need, then reads it. wait=False: raise RunError(busy) at once
    when another process holds it. A link there, or a lock that cannot be made (a read-only folder, a
    name too long), is one line naming it."""
    from filelock import FileLock, Timeout
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        what = "a link" if path.is_symlink() else "not a regular file"
        raise RunError(f"{path} is {what} where this run keeps its lock file (a folder copied with tar or "
                       f"rsync -a keeps links); remove it (rm {path}), then rerun")
    lock = FileLock(path, mode=0o666 & ~UMASK)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not wait:
                raise RunError(busy) from None
            log(f"[cache] another run is writing {path.stem}; waiting for it")
            lock.acquire()
    except RunError:
        raise
    except OSError as e:
        raise write_failure(e, path) from None
    try:
        yield
    finally:
        lock.release()


def check_folder(folder, flag, tag=None):
    """--out / --cache-dir before any work: the nearest part of the path that exists is a folder; tag: a
    file written into it now through the gate (--cache-dir's CACHEDIR.TAG, which backup tools read), so a
    folder that cannot be written is one line here, not after the work."""
    folder = Path(folder)
    taken = next((p for p in [folder, *folder.parents] if p.exists()), None)
    if taken is not None and not taken.is_dir():
        raise RunError(f"{flag} {folder}: {taken} is a file, not a folder; pass {flag} a folder "
                       f"(or move the file away)")
    if tag and not (folder / tag[0]).is_file():
        try:
            atomic_write_text(tag[1], folder / tag[0])
        except RunError as e:
            raise RunError(f"{flag} {folder}: {str(e).removeprefix('error: ')}") from None


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
