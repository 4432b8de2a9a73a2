"""Large feature sets as memory-mapped shards: written shard by shard, read back batch by batch.

A set whose tokens would take more than MEMMAP_BYTES is written as shards of about SHARD_BYTES
(whole batches), each an .npy file of RAGGED tokens (row after row, no padding: captions), with a
plan.json and per-shard metadata; an interrupted extraction resumes at the first unfinished shard.
StoredFeatures reads them back through a memory map, so a batch is padded only to its own longest
row; ConcatFeatures joins two sets (pairs and head rows) without copying either.
"""
import concurrent.futures
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from features import Features, read_ahead
from infra.errors import RunError, first_line
from infra.folder import Progress
from infra.storage import atomic_save, atomic_write_text, file_crc, load_plain, safe_load, save_npy

MEMMAP_BYTES = 2 * 2**30      # larger token caches go to shards (benchmarks/align_sharded.py sets it for a run)
SHARD_BYTES = 256 * 2**20     # tokens per shard (whole batches, >= 1)


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
            # (sum_len_s, D) fp16
            self.tokens_files.append(np.load(Path(folder) / f"{s:05d}.tokens.npy", mmap_mode="r"))
            metas.append(load_plain(Path(folder) / f"{s:05d}.pt"))
            # row r: [off[r], off[r+1])
            self.offsets.append(np.concatenate([[0], metas[-1]["lengths"].cumsum(0).numpy()]))
        # (S + 1,) first row of shard
        self.starts = torch.tensor([0] + [len(m["lengths"]) for m in metas]).cumsum(0)
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
        return self.rows(idx)

    def rows(self, idx, pinned=False):
        """self[idx], read into a pinned buffer when pinned (CUDA: copied from there without another copy)."""
        rows = torch.arange(len(self))[idx].reshape(-1)                                        # (B,)
        lengths = self.lengths[rows]
        T = int(lengths.max())
        full = bool((lengths == T).all())                                                        # no padding to zero
        buffer = (torch.empty if full else torch.zeros)((len(rows), T, self.dim), dtype=torch.float16,
                                                        pin_memory=pinned)                     # (B, T, D)
        out = buffer.numpy()
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
        if pinned:
            mask, pooled = mask.pin_memory(), self.pooled[rows].pin_memory()
        else:
            pooled = self.pooled[rows]
        return Features(tokens=buffer, mask=mask, pooled=pooled, grid=self.grid)

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
        atomic_write_text(json.dumps(plan), plan_file)
    for f in folder.glob(".*.tmp"):                 # a killed writer's half files: the caller holds the key's lock
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


def check_fp16(f, encoder):
    """Features f as they go into the cache: a value beyond fp16's range (already inf once cast) is
    one line naming the encoder and its layer, never an inf in the cache and a NaN loss later.
    Wherever f is (the real encoders call it on the device, before the copy back), its four counts reach
    the host in one copy; padding is not looked at."""
    counts = []
    for name in ("tokens", "pooled"):
        x = getattr(f, name)
        if name == "tokens" and f.mask is not None:
            x = x.masked_fill(~f.mask.to(x.device)[..., None], 0)           # padding: 0, whatever it held
        counts += [(x != x).sum(), (x.abs() > FP16_MAX).sum()]            # NaN; inf or beyond fp16 (NaN: not)
    counts = torch.stack(counts).tolist()                                   # the one copy to the host
    who = f"{getattr(encoder, 'name', type(encoder).__name__)} (layer {getattr(encoder, 'layer', '?')})"
    for name, nan, big in (("tokens", *counts[:2]), ("pooled", *counts[2:])):
        if nan:     # not a range: the model computes NaN (NaN weights: a broken or half-copied file)
            raise RunError(f"{who} gives {nan} {name} value(s) that are NaN: the model's outputs are NaN, "
                           f"so its weights are (a broken or half-copied file?); copy the model folder again "
                           f"from its download")
        if big:
            raise RunError(f"{who} gives {big} {name} value(s) beyond {FP16_MAX:g}, the largest fp16 value the "
                           f"feature cache stores (they would be inf); pick another --image-layer / --text-layer, "
                           f"or a model whose activations stay in fp16's range")


def checked(f, encoder, device):
    """check_fp16(f) unless the encoder checked its features on the GPU already (checks_on_device)."""
    if not (getattr(encoder, "checks_on_device", False) and str(device).startswith("cuda")):
        check_fp16(f, encoder)


def write_shard(folder, s, parts, key):
    """Shard s of folder from its encoded batches (fp16 Features): the real tokens, ragged (sum of lengths, D),
    as .npy with its checksum, then the metadata, whose atomic rename marks the shard done."""
    f = Features.cat(parts)
    tokens = folder / f"{s:05d}.tokens.npy"
    written = save_npy(f.tokens[f.mask].numpy(), tokens)                         # (sum of lengths, D), ragged
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
    shards = list(shards)
    todo = [s for s in shards if not shard_done(folder, s, key, log)]           # resume: intact ones kept
    if len(todo) < len(shards):
        log(f"[features] {folder.name}: {len(shards) - len(todo)} of {len(shards)} shards kept from before; "
            f"writing the other {len(todo)}")
    total = sum(min((s + 1) * rows, len(inputs)) - s * rows for s in todo)
    finished = [len(shards) - len(todo)]
    progress = Progress(f"[features] {folder.name}:", total, log=log, t0=t0)

    def encoded(s):                                                               # shard s's batches, fp16
        start, stop = s * rows, min((s + 1) * rows, len(inputs))
        rest = range(start + batch_size if (start == 0 and first is not None) else start, stop, batch_size)
        parts = [half(first)] if (start == 0 and first is not None) else []
        parts += [half(f) for f in encoded_batches(encoder, inputs, rest, stop, batch_size, device)]
        for f in parts:
            checked(f, encoder, device)                                                 # before the writer takes it
        return s, parts

    def written(s):
        finished[0] += 1
        progress.tag = f"[features] {folder.name}: shard {s + 1}/{plan['n_shards']},"
        progress.update(min((s + 1) * rows, len(inputs)) - s * rows, force=True)

    try:
        write_all(folder, key, todo, encoded, written, writer)
    except KeyboardInterrupt:
        log(f"[features] interrupted: {finished[0]} of {len(shards)} shards of {folder.name} kept in {folder}; "
            f"the rerun writes the other {len(shards) - finished[0]}")
        raise


def write_all(folder, key, todo, encoded, written, writer):
    """write_shard for each shard of todo, from encoded(s); each one whole (written(s) called) or not at all."""
    if not writer:
        for s in todo:
            written(write_shard(folder, *encoded(s), key))
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-writer") as pool:
        pending = None                                     # the shard being written (its future)
        try:
            for s in todo:
                s, parts = encoded(s)                      # the forward of shard s, while shard s - 1 is written
                if pending is not None:
                    done, pending = pending, None
                    written(done.result())                 # a writer's error is raised here
                pending = pool.submit(write_shard, folder, s, parts, key)
        finally:
            if pending is not None:                        # (on an error or a Ctrl-C above, the shard handed
                written(pending.result())                  # over is still finished: it is whole, and counted)


FP16_MAX = 65504.0   # the largest finite float16: the cache stores tokens and pooled vectors as fp16
