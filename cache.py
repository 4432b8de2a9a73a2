"""The feature cache on disk: encoders run once over a set, their outputs are kept.

extract() runs an encoder over a set and caches its outputs (features.Features), as one
fp16 torch file or, for COCO-scale sets, memory-mapped shards read back as
StoredFeatures. Every file is written atomically under a per-key lock, read with
torch.load(weights_only=True), and keyed by every setting plus the encoder's weights
fingerprint, so a changed setting or new weights never read stale features.
"""
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

import data
import distributed
from errors import RunError, first_line
from features import Features, precision
from loader import Progress, read_ahead


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
    return SystemExit(f"error: no space left in {folder}: free some space there, or point "
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
        return SystemExit(f"error: writing {path} failed ({first_line(e)}): a full disk or quota? free some space "
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
        raise SystemExit(f"error: refusing to load {path}: it holds pickled Python objects besides tensors and "
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
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[cache] another run is writing {path.stem}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def hold_folder(folder, flag):
    """Hold `folder` (an output folder) for this run: a second run given the same folder stops at
    once with one line naming the run that holds it, instead of mixing its files with this one's.
    The lock file (<parent>/.<name>.lock, beside the folder: nothing is written into it) says who
    holds it; the kernel releases the lock when a process dies, so a killed run never blocks the
    next. A no-op where fcntl is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder, real = Path(folder), Path(folder).resolve()
    real.parent.mkdir(parents=True, exist_ok=True)
    with open(real.parent / f".{real.name}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise RunError(f"{flag} {folder} is in use by a run still going ({holder}); wait for it to "
                           f"finish, or pass another {flag}") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_writable(folder, flag, create=True):
    """Stop with one line naming the folder when it cannot be written (read-only, full, not a
    folder), before any long work: a probe file of 1 MB is written, synced and removed.
    create=False (--out): nothing is made; the probe goes into the nearest folder that exists."""
    folder = Path(folder)
    taken = next((p for p in [folder, *folder.parents] if p.exists()), None)  # the nearest part that exists
    if taken is not None and not taken.is_dir():
        raise SystemExit(f"error: {flag} {folder}: {taken} is a file, not a folder; pass {flag} a folder "
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
            raise SystemExit(f"error: {flag} {folder} is full (no space left on its disk); free some space "
                             f"or pass {flag} on another disk") from None
        why = "is on a read-only file system" if e.errno == errno.EROFS else f"cannot be written ({e.strerror})"
        raise SystemExit(f"error: {flag} {folder} {why}; pass {flag} a folder you can write to") from None


# ---------------------------------------------------------------------------
# Feature extraction, run once and cached
# ---------------------------------------------------------------------------
# A set larger than MEMMAP_BYTES is written as shards of SHARD_BYTES, read back through a
#   memory map as StoredFeatures. Tokens are stored RAGGED: row after row, no
#   padding (captions), so a batch is padded only to its own longest row. An
#   interrupted extraction resumes at the first unfinished shard.
MEMMAP_BYTES = int(float(os.environ.get("ALIGN_MEMMAP_GB", "2")) * 2**30)  # larger token caches go to shards
SHARD_BYTES = int(float(os.environ.get("ALIGN_SHARD_MB", "256")) * 2**20)   # tokens per shard (whole batches, >= 1)


def cache_key(**parts):
    """A readable file stem plus a hash of every setting, so a changed setting never reads stale features.

    extract() puts in it what the features are computed from: data.identity() of the inputs (image
    files by path, size and modification time; texts and in-memory images by content), so two
    data folders sharing a cache never read each other's features, and the encoder's weights fingerprint (see "Weights fingerprints" below: the tiny encoders'
    content hash, a Hugging Face snapshot's commit or its files' hashes, torchvision's weights
    enum), so new weights under the same name never read the old weights' features."""
    text = repr(sorted(parts.items()))
    return f"{parts.get('dataset')}-{parts.get('split')}-{parts.get('modality')}-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def feature_key(encoder, inputs, device="cpu", **key_parts):
    """The cache key of encoder's features of inputs: its name, weights fingerprint, layer and
    preprocessing, the precision it runs in on device (fp32 on a CPU, bf16 / fp16 autocast on a GPU:
    features that differ in their last bits are not the same features), what the inputs are
    (data.identity) and the caller's parts (dataset, split, modality)."""
    return cache_key(encoder=encoder.name, weights=getattr(encoder, "fingerprint", None), layer=encoder.layer,
                     preprocess=encoder.preprocess, precision=precision(device), n=len(inputs),
                     data=data.identity(inputs), **key_parts)


class StoredFeatures:
    """Features of a large set on disk: ragged fp16 token shards read through a memory map.

    The part of the Features interface that training and evaluation use:
    len(f); f[idx] -> dense Features of those rows only (padded to their longest
    row); f.pooled (N, D) and f.lengths (N,) in RAM; f.grid; f.mask; f.dim;
    f.to(device) loads everything (only for closed-form fit() on sets that fit).
    """

    def __init__(self, folder, key):
        plan = json.loads((Path(folder) / "plan.json").read_text())
        self.tokens_files, self.offsets, metas = [], [], []
        for s in range(plan["n_shards"]):
            self.tokens_files.append(np.load(Path(folder) / f"{s:05d}.tokens.npy", mmap_mode="r"))  # (sum_len_s, D) fp16
            metas.append(load_plain(Path(folder) / f"{s:05d}.pt"))
            self.offsets.append(np.concatenate([[0], metas[-1]["lengths"].cumsum(0).numpy()]))   # row r: [off[r], off[r+1])
        self.starts = torch.tensor([0] + [len(m["lengths"]) for m in metas]).cumsum(0)          # (S + 1,) first row of shard
        self.pooled = torch.cat([m["pooled"] for m in metas])                                   # (N, D) fp16
        self.lengths = torch.cat([m["lengths"] for m in metas])                                 # (N,) real tokens
        self.grid, self.dim = metas[0]["grid"], self.tokens_files[0].shape[1]
        self.starts_np = self.starts.numpy()

    def __len__(self):
        return len(self.pooled)

    @property
    def mask(self):
        """(N, T_max) bool, True for a real token."""
        return torch.arange(int(self.lengths.max()))[None] < self.lengths[:, None]

    def __getitem__(self, idx):
        """Rows idx in the order asked, each row copied once from its shard straight to its place in
        the batch, shard by shard in file order (rows sorted within a shard); no padding is zeroed
        where every row has the batch's length, and the mapped pages are left to the OS (its page
        cache keeps them for the next epoch)."""
        rows = torch.arange(len(self))[idx].reshape(-1)                                        # (B,)
        lengths = self.lengths[rows]
        T = int(lengths.max())
        full = bool((lengths == T).all())                                                        # no padding to zero
        out = (np.empty if full else np.zeros)((len(rows), T, self.dim), dtype=np.float16)     # (B, T, D)
        rows_np = rows.numpy()
        shard = np.searchsorted(self.starts_np, rows_np, side="right") - 1                      # (B,) shard of each row
        for s in np.unique(shard).tolist():
            at = np.flatnonzero(shard == s)                                                      # batch positions
            local = rows_np[at] - self.starts_np[s]
            order = np.argsort(local, kind="stable")                                             # file order
            flat, off = self.tokens_files[s], self.offsets[s]
            for b, r in zip(at[order].tolist(), local[order].tolist()):
                out[b, :off[r + 1] - off[r]] = flat[off[r]:off[r + 1]]                          # one contiguous copy
        mask = torch.arange(T)[None] < lengths[:, None]
        return Features(tokens=torch.from_numpy(out), mask=mask, pooled=self.pooled[rows], grid=self.grid)

    def to(self, device, dtype=torch.float32):
        return self[:].to(device, dtype)


class ConcatFeatures:
    """Several Features / StoredFeatures one after another, read only when indexed.

    What D_aug = D_pairs ∪ D_weights (weight recycling Eq. 3) is on a memory-mapped
    training set: Features.cat would load the whole token cache into RAM; this keeps
    the parts and reads only the rows a batch asks for. len(f); f[idx] -> dense
    Features of those rows, in the order asked; f.pooled (N, D) in RAM; f.grid;
    f.to(device) loads everything (only for closed-form fit() on sets that fit).
    Image parts keep every token column (patches() reads 1..H*W), so one-token rows
    (classifier-head rows) are padded to the image token count.
    """

    def __init__(self, parts):
        self.parts = parts
        self.starts = torch.tensor([0] + [len(p) for p in parts]).cumsum(0)          # (P + 1,) first row of part
        self.pooled = torch.cat([torch.as_tensor(p.pooled).float() for p in parts])   # (N, D)
        self.grid = next((p.grid for p in parts if p.grid is not None), None)
        tokens_of = lambda p: int(p.lengths.max()) if isinstance(p, StoredFeatures) else p.tokens.shape[1]
        self.T_image = max(tokens_of(p) for p in parts if p.grid is not None) if self.grid else None

    def __len__(self):
        return len(self.pooled)

    def __getitem__(self, idx):
        rows = torch.arange(len(self))[idx].reshape(-1)                                # (B,)
        part = torch.searchsorted(self.starts, rows, right=True) - 1                   # (B,) part of each row
        pieces, at = [], []
        for s in part.unique().tolist():
            a = (part == s).nonzero().squeeze(1)
            pieces.append(self.parts[s][rows[a] - self.starts[s]])
            at.append(a)
        f = Features.cat([replace(p, tokens=p.tokens.float(), pooled=p.pooled.float()) for p in pieces])
        back = torch.cat(at).argsort()                                                 # back to the order asked
        tokens, mask = f.tokens[back], f.mask[back]
        if self.grid is not None and tokens.shape[1] < self.T_image:                   # e.g. head rows only
            pad = self.T_image - tokens.shape[1]
            tokens = torch.nn.functional.pad(tokens, (0, 0, 0, pad))
            mask = torch.nn.functional.pad(mask, (0, pad), value=False)
        return Features(tokens=tokens, mask=mask, pooled=f.pooled[back], grid=self.grid)

    def to(self, device, dtype=torch.float32):
        return self[:].to(device, dtype)


def extract_shards(encoder, inputs, folder, key, batch_size, device, first=None, log=print, t0=None):
    """Encode inputs shard by shard into folder, skipping shards already done (resume)."""
    plan = shard_plan(encoder, inputs, folder, key, batch_size, device, first)
    write_shards(encoder, inputs, folder, key, plan, range(plan["n_shards"]), batch_size, device, first, log, t0)
    return StoredFeatures(folder, key)


def shard_plan(encoder, inputs, folder, key, batch_size, device, first=None):
    """folder's plan.json (rows per shard, shard count), made anew (and old shards removed) when missing or stale."""
    folder.mkdir(parents=True, exist_ok=True)
    plan_file = folder / "plan.json"
    try:
        plan = json.loads(plan_file.read_text())
    except (OSError, ValueError):
        plan = None
    if plan is None or plan.get("key") != key or plan.get("n") != len(inputs):
        first = first if first is not None else encoder.encode(inputs[:batch_size], device)
        row_bytes = 2 * first.tokens.shape[1] * first.tokens.shape[2]
        rows = batch_size * max(1, SHARD_BYTES // (row_bytes * batch_size))  # whole batches per shard
        plan = {"key": key, "n": len(inputs), "rows_per_shard": rows, "n_shards": math.ceil(len(inputs) / rows)}
        for f in folder.iterdir():                                               # another plan's shards
            f.unlink()
        tmp = folder / "plan.json.tmp"
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, plan_file)
    for f in folder.glob("*.tmp*"):                 # a killed writer's half files: the caller holds the key's lock
        f.unlink(missing_ok=True)
    return plan


def shard_done(folder, s, key, log=print):
    """True when shard s is complete and intact: its metadata passes its checksum, and its tokens file
    exists, is a 2-D float16 array of sum(lengths) rows with the size recorded at writing, and, when
    its modification time differs from the recorded one, passes its checksum (then it is re-stamped).
    Anything else: its metadata is removed, so the shard is written again."""
    meta_file, tokens = folder / f"{s:05d}.pt", folder / f"{s:05d}.tokens.npy"
    meta = safe_load(meta_file, expect_key=key)
    if meta is None:
        return False
    want, fault = meta.get("tokens_file"), None
    try:
        st = tokens.stat()
        with open(tokens, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(fh)
    except (OSError, ValueError) as e:
        fault = "is missing" if isinstance(e, FileNotFoundError) else f"has no valid .npy header ({first_line(e)})"
    else:
        if want is None or st.st_size != want["bytes"]:
            fault = f"has {st.st_size} bytes, {want and want['bytes']} were written (truncated?)"
        elif dtype != np.float16 or len(shape) != 2 or shape[0] != int(meta["lengths"].sum()):
            fault = f"holds a {dtype} array of shape {shape}, not the float16 tokens its metadata describes"
        elif st.st_mtime_ns != want["mtime_ns"]:
            if file_crc(tokens) != want["crc"]:
                fault = "fails its checksum (changed after it was written)"
            else:                                                                 # copied: same bytes, new mtime
                atomic_save({**meta, "tokens_file": {**want, "mtime_ns": st.st_mtime_ns}}, meta_file)
    if fault is None:
        return True
    log(f"[cache] {tokens} {fault}; writing shard {s} again")
    meta_file.unlink(missing_ok=True)
    return False


EXTRACT_BATCH = int(os.environ.get("ALIGN_EXTRACT_BATCH", "256"))   # extraction batch size (cache keys ignore it)


def encoded_batches(encoder, inputs, starts, stop, batch_size, device):
    """encoder.encode(inputs[i:i + batch_size]) for i in starts (cut at stop), in order.

    An encoder with prepare / encode_prepared (the real image encoders) splits the work: prepare
    (decode + resize in threads, uint8, pinned on CUDA) runs for the next two batches in a
    read-ahead thread while this thread runs the forward of the current one."""
    cut = lambda i: inputs[i:min(i + batch_size, stop)]
    if not hasattr(encoder, "prepare"):
        for i in starts:
            yield encoder.encode(cut(i), device)
        return
    for x in read_ahead(lambda i: encoder.prepare(cut(i), device), starts, depth=2, workers=1):
        yield encoder.encode_prepared(x, device)


FP16_MAX = 65504.0   # the largest finite float16: the cache stores tokens and pooled vectors as fp16


def check_fp16(f, encoder):
    """Features f as they go into the cache: a value beyond fp16's range (already inf once cast) is
    one line naming the encoder and its layer, never an inf in the cache and a NaN loss later."""
    for name in ("tokens", "pooled"):
        x = getattr(f, name)
        x = x[f.mask] if name == "tokens" and f.mask is not None else x
        big = ~torch.isfinite(x) | (x.abs() > FP16_MAX) if x.dtype != torch.float16 else ~torch.isfinite(x)
        if big.any():
            raise RunError(f"{getattr(encoder, 'name', type(encoder).__name__)} (layer {getattr(encoder, 'layer', '?')}) "
                           f"gives {int(big.sum())} {name} value(s) beyond {FP16_MAX:g}, the largest fp16 value the "
                           f"feature cache stores (they would be inf); pick another --image-layer / --text-layer, "
                           f"or a model whose activations stay in fp16's range")


def write_shard(folder, s, parts, key):
    """Shard s of folder from its encoded batches (fp16 Features): the real tokens, ragged (sum of lengths, D),
    as .npy with its checksum, then the metadata, whose atomic rename marks the shard done."""
    f = Features.cat(parts)
    tokens = folder / f"{s:05d}.tokens.npy"
    with atomic_target(tokens) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, f.tokens[f.mask].numpy())                                # (sum of lengths, D), ragged
        st, crc = tmp.stat(), file_crc(tmp)                                       # read back from the page cache
    written = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "crc": crc}
    atomic_save({"key": key, "lengths": f.mask.sum(1), "pooled": f.pooled, "grid": f.grid,
                 "tokens_file": written}, folder / f"{s:05d}.pt")
    return s


def half(f):
    """f with fp16 tokens and pooled, what the cache stores (cast at once: the host holds no fp32 copy)."""
    return replace(f, tokens=f.tokens.half(), pooled=f.pooled.half())


def write_shards(encoder, inputs, folder, key, plan, shards, batch_size, device, first=None, log=print, t0=None,
                 writer=True):
    """Encode and write the given shards of plan (those not done before: resume). first: shard 0's first batch,
    encoded since t0 (the rate counts it).
    writer: shard n is written (gathered, saved, checksummed: write_shard) in a writer thread while this thread
    encodes shard n + 1, so the device is not idle through the host's work (on the CPU too: np.save and
    the checksum release the GIL); peak RAM ~ 2 shards. writer=False: one after the other, the same files."""
    rows = plan["rows_per_shard"]
    todo = [s for s in shards if not shard_done(folder, s, key, log)]           # resume: intact ones kept
    total = sum(min((s + 1) * rows, len(inputs)) - s * rows for s in todo)
    progress = Progress(f"[features] {folder.name}:", total, log=log, t0=t0)

    def encoded(s):                                                               # shard s's batches, fp16
        start, stop = s * rows, min((s + 1) * rows, len(inputs))
        rest = range(start + batch_size if (start == 0 and first is not None) else start, stop, batch_size)
        parts = [half(first)] if (start == 0 and first is not None) else []
        parts += [half(f) for f in encoded_batches(encoder, inputs, rest, stop, batch_size, device)]
        for f in parts:
            check_fp16(f, encoder)                                                # before the writer takes it
        return s, parts

    def written(s):
        progress.tag = f"[features] {folder.name}: shard {s + 1}/{plan['n_shards']},"
        progress.update(min((s + 1) * rows, len(inputs)) - s * rows, force=True)

    if not writer:
        for s in todo:
            written(write_shard(folder, *encoded(s), key))
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-writer") as pool:
        pending = None                                     # the shard being written (its future)
        for s in todo:
            s, parts = encoded(s)                          # the forward of shard s, while shard s - 1 is written
            if pending is not None:
                written(pending.result())                  # a writer's error is raised here
            pending = pool.submit(write_shard, folder, s, parts, key)
        if pending is not None:                            # (on an error above, leaving the pool still
            written(pending.result())                      # finishes the shard handed over: it is whole)


def extract(encoder, inputs, cache_dir, batch_size=None, device="cpu", **key_parts):
    """Features of all inputs (images or texts), from the cache when present.

    Stored fp16 (tokens, pooled) with the mask and grid; written atomically under a
    per-key lock (concurrent runs sharing cache_dir wait for one writer); a file that is
    unreadable or was written for other settings is rebuilt, never read.
    Sets larger than MEMMAP_BYTES come back as StoredFeatures (memory-mapped shards).
    batch_size: None = EXTRACT_BATCH (ALIGN_EXTRACT_BATCH, default 256).
    """
    batch_size = batch_size or EXTRACT_BATCH
    key = feature_key(encoder, inputs, device, **key_parts)
    path = Path(cache_dir) / "features" / f"{key}.pt"
    folder = Path(cache_dir) / "features" / key
    if distributed.world() > 1:                             # torchrun: every rank calls extract() in the same order
        return extract_ranks(encoder, inputs, path, folder, key, batch_size, device, cache_dir)
    saved = safe_load(path, expect_key=key)                 # a renamed file is complete: no lock to read it
    if saved is not None:
        return Features(saved["tokens"], saved["mask"], saved["pooled"], saved["grid"])
    with file_lock(Path(cache_dir) / "locks" / f"{key}.lock"):   # one writer per key; others wait, then read
        saved = safe_load(path, expect_key=key)             # another run may have written it meanwhile
        if saved is not None:
            return Features(saved["tokens"], saved["mask"], saved["pooled"], saved["grid"])
        if (folder / "plan.json").exists():                                      # a large set: done or interrupted
            return extract_shards(encoder, inputs, folder, key, batch_size, device)
        t0 = time.time()
        first = half(encoder.encode(inputs[:batch_size], device))   # fp16 as the later batches: no fp32 peak
        if len(inputs) * 2 * first.tokens.shape[1] * first.tokens.shape[2] > MEMMAP_BYTES:
            return extract_shards(encoder, inputs, folder, key, batch_size, device, first, t0=t0)
        feats = extract_file(encoder, inputs, path, key, batch_size, device, first, t0=t0)
    return Features(feats.tokens.half(), feats.mask, feats.pooled.half(), feats.grid)


def extract_file(encoder, inputs, path, key, batch_size, device, first, t0=None, log=print):
    """Encode a set that fits one file (first: its first batch, encoded already since t0) and save it atomically."""
    progress = Progress(f"[features] {key}:", len(inputs), log=log, t0=t0)
    progress.update(len(first))
    parts = [half(first)]                                   # fp16 at once, every batch: the cat stays fp16
    for f in encoded_batches(encoder, inputs, range(batch_size, len(inputs), batch_size), len(inputs), batch_size,
                             device):
        parts.append(half(f))
        progress.update(len(f))
    progress.close()
    feats = Features.cat(parts)
    check_fp16(feats, encoder)
    atomic_save({"key": key, "tokens": feats.tokens.half(), "mask": feats.mask, "pooled": feats.pooled.half(),
                 "grid": feats.grid}, path)
    return feats


def extract_ranks(encoder, inputs, path, folder, key, batch_size, device, cache_dir):
    """extract() under torchrun (distributed.py). Rank 0 decides for all and holds the key's lock for
    the group (another run waits as for one writer): a set already cached is read by every rank; a set
    small enough for one file is extracted by rank 0 while the others wait; a large set is planned
    by rank 0, then rank r writes shards r, r + N, r + 2N, ... (each written once, atomically, and
    skipped when done before: a rerun resumes), and every rank maps the finished shards."""
    r, n = distributed.rank(), distributed.world()
    lock = file_lock(Path(cache_dir) / "locks" / f"{key}.lock") if r == 0 else contextlib.nullcontext()
    with lock:
        kind, plan, first = None, None, None
        if r == 0:
            if safe_load(path, expect_key=key) is not None:
                kind = "file"
            elif (folder / "plan.json").exists():
                kind = "shards"
            else:
                first = encoder.encode(inputs[:batch_size], device)
                kind = "shards" if len(inputs) * 2 * first.tokens.shape[1] * first.tokens.shape[2] > MEMMAP_BYTES \
                    else "file"
                if kind == "file":                          # rank 0 alone, as one process would
                    extract_file(encoder, inputs, path, key, batch_size, device, first)
            if kind == "shards":
                plan = shard_plan(encoder, inputs, folder, key, batch_size, device, first)
        kind, plan = distributed.broadcast((kind, plan))        # the others wait here for rank 0
        if kind == "shards":
            write_shards(encoder, inputs, folder, key, plan, range(r, plan["n_shards"], n), batch_size, device,
                         first, distributed.say)
            distributed.barrier()                               # every shard written
    if kind == "shards":
        return StoredFeatures(folder, key)
    saved = safe_load(path, expect_key=key)
    return Features(saved["tokens"], saved["mask"], saved["pooled"], saved["grid"])


# ---------------------------------------------------------------------------
# The Shapes world, cached like the features
# ---------------------------------------------------------------------------
# data.shapes_world renders 8,480 images (about 5 s of one core); the first run writes
# its sets to <cache-dir>/world/, keyed by the sizes, the seed and the bytes of data.py
# (the code that draws and renders it), so an edit to the world never reads a stale one.
def world_key(seed, sizes):
    source = hashlib.sha1(Path(data.__file__).read_bytes()).hexdigest()[:12]
    return cache_key(dataset="shapes", split="world", modality="all", seed=seed, data_py=source, **sizes)


def shapes_world(cache_dir, seed=0, **sizes):
    """data.shapes_world(seed, **sizes), read from cache_dir/world when built before (same sets, same
    tensors), else built and written there (atomic, checksummed)."""
    key = world_key(seed, sizes)
    path = Path(cache_dir) / "world" / f"{key}.pt"
    if path in _WORLDS:
        return _WORLDS[path]
    saved = safe_load(path, expect_key=key)
    if saved is None:
        sets = data.shapes_world(seed, **sizes)
        atomic_save({"key": key, "sets": {name: (type(s).__name__, vars(s)) for name, s in sets.items()}}, path)
    else:
        kinds = {k.__name__: k for k in (data.PairSet, data.LabelSet, data.MaskSet, data.BindingSet)}
        sets = {name: kinds[kind](**fields) for name, (kind, fields) in saved["sets"].items()}
    _WORLDS[path] = sets
    return sets


_WORLDS = {}  # built or read once per process (tests run align.main many times); read-only

# ---------------------------------------------------------------------------
# Weights fingerprints: what the feature cache is keyed by, besides the name
# ---------------------------------------------------------------------------
# The same name can hold other weights (a re-pretrained tiny encoder, another
# revision downloaded into the same folder), so features are keyed by the weights:
# - the tiny encoders: a hash of their state_dict (and vocabulary), exact;
# - a Hugging Face snapshot folder (hub cache) or a model loaded by hub name: its
#   commit hash, as the Hugging Face cache itself keys files by revision;
# - any other model folder: every file's name and size, plus its content hash
#   (files up to 16 MB: config, tokenizer, small weights) or, for larger weight
#   files, its modification time and a hash of its first and last MB: reading a
#   1.2 GB checkpoint in full on every run would cost seconds, while another
#   revision written into the folder changes the mtime (and nearly always the size
#   or the first tensors);
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


def folder_fingerprint(folder):
    """The weights fingerprint of a model folder (module comment above)."""
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
