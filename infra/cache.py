"""The feature cache on disk: encoders run once over a set, their outputs are kept.

extract() runs an encoder over a set and caches its outputs (features.Features), as one
fp16 torch file or, for COCO-scale sets, memory-mapped shards read back as
StoredFeatures (infra/shards.py). Every file is written atomically under a per-key lock, read with
torch.load(weights_only=True), and keyed by every setting plus the encoder's weights
fingerprint, so a changed setting or new weights never read stale features.
"""
import contextlib
import hashlib
import time
from pathlib import Path

import data
from features import Features, precision
from infra import distributed, shards
from infra.loader import Progress
from infra.storage import atomic_save, file_lock, safe_load

# ---------------------------------------------------------------------------
# Feature extraction, run once and cached
# ---------------------------------------------------------------------------

def cache_key(**parts):
    """A readable file stem plus a hash of every setting, so a changed setting never reads stale features.

    extract() puts in it what the features are computed from: data.identity() of the inputs (image
    files by path, size and modification time; texts and in-memory images by content), so two
    data folders sharing a cache never read each other's features, and the encoder's weights
    fingerprint (infra/storage.py: the tiny encoders'
    content hash, a Hugging Face snapshot's commit or its files' hashes, torchvision's weights
    enum), so new weights under the same name never read the old weights' features."""
    text = repr(sorted(parts.items()))
    return (f"{parts.get('dataset')}-{parts.get('split')}-{parts.get('modality')}-"
            + hashlib.sha1(text.encode()).hexdigest()[:12])


def feature_key(encoder, inputs, device="cpu", **key_parts):
    """The cache key of encoder's features of inputs: its name, weights fingerprint, layer and
    preprocessing, the precision it runs in on device (fp32 on a CPU, bf16 / fp16 autocast on a GPU:
    features that differ in their last bits are not the same features), what the inputs are
    (data.identity) and the caller's parts (dataset, split, modality)."""
    n = getattr(encoder, "n_layers", None)
    layer = n if encoder.layer == -1 and isinstance(n, int) else encoder.layer     # -1 and L: one layer, one key
    return cache_key(encoder=encoder.name, weights=getattr(encoder, "fingerprint", None), layer=layer,
                     code=getattr(encoder, "code", None),
                     preprocess=encoder.preprocess, precision=precision(device), n=len(inputs),
                     data=data.identity(inputs), **key_parts)


EXTRACT_BATCH = 256   # extraction batch size (cache keys ignore it)


def extract(encoder, inputs, cache_dir, batch_size=None, device="cpu", **key_parts):
    """Features of all inputs (images or texts), from the cache when present.

    Stored fp16 (tokens, pooled) with the mask and grid; written atomically under a
    per-key lock (concurrent runs sharing cache_dir wait for one writer); a file that is
    unreadable or was written for other settings is rebuilt, never read.
    Sets larger than shards.MEMMAP_BYTES come back as StoredFeatures (memory-mapped shards, shards.py).
    batch_size: None = EXTRACT_BATCH.
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
            return shards.extract_shards(encoder, inputs, folder, key, batch_size, device)
        t0 = time.time()
        first = shards.half(encoder.encode(inputs[:batch_size], device))   # fp16 as the later batches: no fp32 peak
        if len(inputs) * 2 * first.tokens.shape[1] * first.tokens.shape[2] > shards.MEMMAP_BYTES:
            return shards.extract_shards(encoder, inputs, folder, key, batch_size, device, first, t0=t0)
        feats = extract_file(encoder, inputs, path, key, batch_size, device, first, t0=t0)
    return Features(feats.tokens.half(), feats.mask, feats.pooled.half(), feats.grid)


def extract_file(encoder, inputs, path, key, batch_size, device, first, t0=None, log=print):
    """Encode a set that fits one file (first: its first batch, encoded already since t0) and save it atomically."""
    progress = Progress(f"[features] {key}:", len(inputs), log=log, t0=t0)
    progress.update(len(first))
    parts = [shards.half(first)]                                   # fp16 at once, every batch: the cat stays fp16
    for f in shards.encoded_batches(encoder, inputs, range(batch_size, len(inputs), batch_size), len(inputs),
                                    batch_size, device):
        parts.append(shards.half(f))
        progress.update(len(f))
    progress.close()
    feats = Features.cat(parts)
    shards.check_fp16(feats, encoder)
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
                kind = ("shards" if len(inputs) * 2 * first.tokens.shape[1] * first.tokens.shape[2]
                        > shards.MEMMAP_BYTES else "file")
                if kind == "file":                          # rank 0 alone, as one process would
                    extract_file(encoder, inputs, path, key, batch_size, device, first)
            if kind == "shards":
                plan = shards.shard_plan(encoder, inputs, folder, key, batch_size, device, first)
        kind, plan = distributed.broadcast((kind, plan))        # the others wait here for rank 0
        if kind == "shards":
            shards.write_shards(encoder, inputs, folder, key, plan, range(r, plan["n_shards"], n), batch_size, device,
                         first, distributed.say)
            distributed.barrier()                               # every shard written
    if kind == "shards":
        return shards.StoredFeatures(folder, key)
    saved = safe_load(path, expect_key=key)
    return Features(saved["tokens"], saved["mask"], saved["pooled"], saved["grid"])
