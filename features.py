"""Frozen encoder outputs and their cache on disk.

Read next to DESIGN.md's data flow: Features is the one data structure every
stage passes around (tokens, mask, pooled, grid); extract() runs an encoder
once over a set and caches its outputs, as one fp16 torch file or, for
COCO-scale sets, memory-mapped shards read back as StoredFeatures.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
import hashlib
import json
import math
import mmap
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

@dataclass
class Features:
    """Frozen token features of B samples of one modality.

    tokens: (B, T, D) float, by encoders.py's token-layout contract. Images:
            token 0 is the global token (= pooled), tokens 1..H*W the patches
            in row-major order, nothing else (no registers). Texts: the word
            tokens only (no CLS / SEP / BOS / EOS), padded at the end.
    mask:   (B, T) bool, True for a real token, False for padding.
    pooled: (B, D) float, what global methods use (CLS or masked mean).
    grid:   (H, W) of the image patch grid, None for text / for global vectors.
    """
    tokens: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor
    grid: tuple | None = None

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, idx):
        """Rows idx (slice, index tensor or list); trims padding columns no row uses."""
        mask = self.mask[idx]
        t = int(mask.sum(1).max()) if len(mask) else 0
        # real tokens are never after padding, so the first t columns hold them all
        t = max(t, 1) if self.grid is None else self.tokens.shape[1]
        return replace(self, tokens=self.tokens[idx, :t], mask=mask[:, :t], pooled=self.pooled[idx])

    def to(self, device, dtype=torch.float32):
        """Move to device, floats to dtype (caches hold fp16; methods compute in fp32)."""
        return replace(self, tokens=torch.as_tensor(self.tokens).to(device, dtype),
                       mask=torch.as_tensor(self.mask).to(device),
                       pooled=torch.as_tensor(self.pooled).to(device, dtype))

    def patches(self):
        """(B, H*W, D) the patch tokens only, in grid order (images only)."""
        H, W = self.grid
        return self.tokens[:, 1:1 + H * W]

    @staticmethod
    def from_vectors(x):
        """Global vectors (B, D) as one-token sequences (e.g. classifier-head rows)."""
        return Features(tokens=x[:, None], mask=torch.ones(len(x), 1, dtype=torch.bool), pooled=x)

    @staticmethod
    def cat(parts):
        """Concatenate along the batch, padding tokens to the longest."""
        T = max(p.tokens.shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]), value=v)
        return Features(tokens=torch.cat([pad(p.tokens, 0) for p in parts]),
                        mask=torch.cat([pad(p.mask, False) for p in parts]),
                        pooled=torch.cat([p.pooled for p in parts]), grid=parts[0].grid)


# ---------------------------------------------------------------------------
# Built-in tiny encoders for the Shapes world, pretrained UNIMODALLY by the project


# ---------------------------------------------------------------------------
# Writing and reading cache files
# ---------------------------------------------------------------------------
def atomic_save(obj, path):
    """torch.save to a temporary name, then rename: an interrupted run leaves no half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def safe_load(path, expect_key=None):
    """Load a cache file, or None when missing, unreadable or written for another key (then it is rebuilt)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated / corrupt file
        print(f"[cache] {path} is unreadable ({type(e).__name__}); rebuilding it")
        return None
    if expect_key is not None and (not isinstance(obj, dict) or obj.get("key") != expect_key):
        print(f"[cache] {path} was written for other settings; rebuilding it")
        return None
    return obj


# ---------------------------------------------------------------------------
# Feature extraction, run once and cached
# ---------------------------------------------------------------------------
#   memory map as StoredFeatures. Tokens are stored RAGGED: row after row, no
#   padding (captions), so a batch is padded only to its own longest row. An
#   interrupted extraction resumes at the first unfinished shard.
MEMMAP_BYTES = int(float(os.environ.get("ALIGN_MEMMAP_GB", "2")) * 2**30)  # larger token caches go to shards
SHARD_BYTES = 256 * 2**20                                                    # about 256 MB of tokens per shard


def cache_key(**parts):
    """A readable file stem plus a hash of every setting, so a changed setting never reads stale features."""
    text = repr(sorted(parts.items()))
    return f"{parts.get('dataset')}-{parts.get('split')}-{parts.get('modality')}-" + hashlib.sha1(text.encode()).hexdigest()[:12]


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
            metas.append(torch.load(Path(folder) / f"{s:05d}.pt", weights_only=False))
            self.offsets.append([0] + metas[-1]["lengths"].cumsum(0).tolist())                  # row r: [off[r], off[r+1])
        self.starts = torch.tensor([0] + [len(m["lengths"]) for m in metas]).cumsum(0)          # (S + 1,) first row of shard
        self.pooled = torch.cat([m["pooled"] for m in metas])                                   # (N, D) fp16
        self.lengths = torch.cat([m["lengths"] for m in metas])                                 # (N,) real tokens
        self.grid, self.dim = metas[0]["grid"], self.tokens_files[0].shape[1]

    def __len__(self):
        return len(self.pooled)

    @property
    def mask(self):
        """(N, T_max) bool, True for a real token."""
        return torch.arange(int(self.lengths.max()))[None] < self.lengths[:, None]

    def __getitem__(self, idx):
        rows = torch.arange(len(self))[idx].reshape(-1)                                        # (B,)
        T = int(self.lengths[rows].max())
        tokens = torch.zeros(len(rows), T, self.dim, dtype=torch.float16)                      # (B, T, D)
        out = tokens.numpy()                                                                     # the same memory
        shard = torch.searchsorted(self.starts, rows, right=True) - 1                            # (B,) shard of each row
        for s in shard.unique().tolist():
            at = (shard == s).nonzero().squeeze(1)
            local = rows[at] - self.starts[s]
            order = local.argsort()                                                              # read in file order
            flat, off = self.tokens_files[s], self.offsets[s]
            for b, r in zip(at[order].tolist(), local[order].tolist()):
                out[b, :off[r + 1] - off[r]] = flat[off[r]:off[r + 1]]                          # one contiguous read
            release(flat)
        mask = torch.arange(T)[None] < self.lengths[rows][:, None]
        return Features(tokens=tokens, mask=mask, pooled=self.pooled[rows], grid=self.grid)

    def to(self, device, dtype=torch.float32):
        return self[:].to(device, dtype)


def release(array):
    """Unmap the pages of a memory-mapped array that were read: they stay in the kernel's page cache
    (a re-read is cheap) but no longer count in this process's resident memory."""
    m = getattr(array, "_mmap", None)
    if m is not None and hasattr(m, "madvise"):
        m.madvise(mmap.MADV_DONTNEED)


def extract_shards(encoder, inputs, folder, key, batch_size, device, first=None, log=print):
    """Encode inputs shard by shard into folder, skipping shards already done (resume)."""
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
    rows, t0, done = plan["rows_per_shard"], time.time(), 0
    for s in range(plan["n_shards"]):
        meta = folder / f"{s:05d}.pt"
        if safe_load(meta, expect_key=key) is not None:
            continue                                                             # finished before: not redone
        start, stop = s * rows, min((s + 1) * rows, len(inputs))
        half = lambda f: replace(f, tokens=f.tokens.half(), pooled=f.pooled.half())  # fp16 at once: peak RAM ~ 2 shards
        batch = lambda i: encoder.encode(inputs[i:min(i + batch_size, stop)], device)
        parts = [half(first if (i == 0 and first is not None) else batch(i)) for i in range(start, stop, batch_size)]
        f = Features.cat(parts)
        tmp = folder / f"{s:05d}.tokens.tmp{os.getpid()}.npy"
        np.save(tmp, f.tokens[f.mask].numpy())                                   # (sum of lengths, D), ragged
        os.replace(tmp, folder / f"{s:05d}.tokens.npy")
        atomic_save({"key": key, "lengths": f.mask.sum(1), "pooled": f.pooled, "grid": f.grid}, meta)  # marks it done
        done += stop - start
        log(f"[features] {folder.name}: shard {s + 1}/{plan['n_shards']} ({stop}/{len(inputs)} rows, "
            f"{done / max(time.time() - t0, 1e-9):.0f} rows/s)")
    return StoredFeatures(folder, key)


def extract(encoder, inputs, cache_dir, batch_size=256, device="cpu", **key_parts):
    """Features of all inputs (images or texts), from the cache when present.

    Stored fp16 (tokens, pooled) with the mask and grid; written atomically; a file
    that is unreadable or was written for other settings is rebuilt, never read.
    Sets larger than MEMMAP_BYTES come back as StoredFeatures (memory-mapped shards).
    """
    key = cache_key(encoder=encoder.name, layer=encoder.layer, preprocess=encoder.preprocess, n=len(inputs), **key_parts)
    path = Path(cache_dir) / "features" / f"{key}.pt"
    folder = Path(cache_dir) / "features" / key
    saved = safe_load(path, expect_key=key)
    if saved is not None:
        return Features(saved["tokens"], saved["mask"], saved["pooled"], saved["grid"])
    if (folder / "plan.json").exists():                                          # a large set: done or interrupted
        return extract_shards(encoder, inputs, folder, key, batch_size, device)
    first = encoder.encode(inputs[:batch_size], device)
    if len(inputs) * 2 * first.tokens.shape[1] * first.tokens.shape[2] > MEMMAP_BYTES:
        return extract_shards(encoder, inputs, folder, key, batch_size, device, first)
    parts = [first] + [encoder.encode(inputs[i:i + batch_size], device) for i in range(batch_size, len(inputs), batch_size)]
    feats = Features.cat(parts)
    atomic_save({"key": key, "tokens": feats.tokens.half(), "mask": feats.mask, "pooled": feats.pooled.half(),
                 "grid": feats.grid}, path)
    return Features(feats.tokens.half(), feats.mask, feats.pooled.half(), feats.grid)
