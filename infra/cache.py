"""The feature cache on disk: encoders run once over a set, their outputs are kept.

extract() runs an encoder over a set and caches its outputs (features.Features), as one
fp16 torch file or, for COCO-scale sets, memory-mapped shards read back as
StoredFeatures (infra/shards.py). Every file is written atomically under a per-key lock, read with
torch.load(weights_only=True), and keyed by every setting plus the encoder's weights
fingerprint, so a changed setting or new weights never read stale features. No finished batch is
lost: a one-file set keeps each batch until its file replaces them, a sharded set each shard, and
a rerun says how many it kept. planned_bytes / check_disk say the cache's size on disk before any
extraction and refuse a disk too small for it.
"""
import concurrent.futures
import contextlib
import hashlib
import shutil
import time
from pathlib import Path

import data
from features import Features, precision
from infra import distributed, shards
from infra.errors import RunError
from infra.folder import Progress
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


CPU_IMAGE_BATCH = 8   # ... of a real image encoder (one with prepare) on a CPU: fewer page faults, a lower peak
#   and no fewer images/s than 32-256 (benchmarks/bench_cpu_extract.py, docs/pipeline.md). The Shapes encoders
#   keep EXTRACT_BATCH: the default run's features are those of every earlier version.


def extract(encoder, inputs, cache_dir, batch_size=None, device="cpu", **key_parts):
    """Features of all inputs (images or texts), from the cache when present.

    Stored fp16 (tokens, pooled) with the mask and grid; written atomically under a
    per-key lock (concurrent runs sharing cache_dir wait for one writer); a file that is
    unreadable or was written for other settings is rebuilt, never read.
    Sets larger than shards.MEMMAP_BYTES come back as StoredFeatures (memory-mapped shards, shards.py).
    batch_size: None = EXTRACT_BATCH (CPU_IMAGE_BATCH for a real image encoder on a CPU).
    """
    cpu_images = str(device) == "cpu" and hasattr(encoder, "prepare")
    batch_size = batch_size or (CPU_IMAGE_BATCH if cpu_images else EXTRACT_BATCH)
    key = feature_key(encoder, inputs, device, **key_parts)
    path = Path(cache_dir) / "features" / f"{key}.pt"
    folder = Path(cache_dir) / "features" / key
    if distributed.WORLD > 1:                               # torchrun: every rank calls extract() in the same order
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
        t0, batches = time.time(), Path(cache_dir) / "features" / f"{key}.batches"
        kept = kept_batches(batches, key, batch_size, len(inputs))               # an interrupted one-file set
        first = kept[0] if kept else shards.half(encoder.encode(inputs[:batch_size], device))   # fp16: no fp32 peak
        if len(inputs) * 2 * first.tokens.shape[1] * first.tokens.shape[2] > shards.MEMMAP_BYTES:
            return shards.extract_shards(encoder, inputs, folder, key, batch_size, device, first, t0=t0)
        feats = extract_file(encoder, inputs, path, key, batch_size, device, kept or [first], batches, t0=t0,
                             fresh=not kept)
    return Features(feats.tokens.half(), feats.mask, feats.pooled.half(), feats.grid)


def kept_batches(batches, key, batch_size, n, log=print):
    """The finished batches of an interrupted one-file extraction (batches/000000.pt, ...), in order from the
    first: each one written atomically under this key, with this batch size and its rows. None kept when the
    batch size changed (the batches would not be those of an uninterrupted run)."""
    kept = []
    for b in range(-(-n // batch_size)):
        part = safe_load(batches / f"{b:06d}.pt", expect_key=key) if batches.is_dir() else None
        if part is None or part["batch_size"] != batch_size or len(part["pooled"]) != min(batch_size,
                                                                                          n - b * batch_size):
            break
        kept.append(Features(part["tokens"], part["mask"], part["pooled"], part["grid"]))
    if kept:
        log(f"[features] {batches.name.removesuffix('.batches')}: {len(kept)} of {-(-n // batch_size)} batches "
            f"({sum(len(f) for f in kept)} rows) kept from an interrupted extraction; encoding the rest")
    return kept


def extract_file(encoder, inputs, path, key, batch_size, device, done, batches, t0=None, log=print, fresh=True):
    """Encode a set that fits one file and save it atomically. done: its first batches, fp16, encoded already
    since t0 (fresh: the first one just now, not yet on disk; else read back from batches/). Each finished
    batch is written to batches/ (atomically, in a writer thread) as it comes, so an interruption keeps it;
    the file replaces them at the end."""
    n_batches = -(-len(inputs) // batch_size)
    progress = Progress(f"[features] {key}:", len(inputs), log=log, t0=t0)
    progress.update(sum(len(f) for f in done))
    parts = list(done)
    batches.mkdir(parents=True, exist_ok=True)
    for f in batches.glob("*.tmp*"):                      # a killed writer's half file: we hold the key's lock
        f.unlink(missing_ok=True)
    save = lambda b, f: atomic_save({"key": key, "batch_size": batch_size, "tokens": f.tokens, "mask": f.mask,
                                     "pooled": f.pooled, "grid": f.grid}, batches / f"{b:06d}.pt")
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-writer") as pool:
        try:
            if fresh:
                shards.checked(done[0], encoder, device)
                pool.submit(save, 0, done[0])
            for f in shards.encoded_batches(encoder, inputs, range(len(parts) * batch_size, len(inputs), batch_size),
                                            len(inputs), batch_size, device):
                f = shards.half(f)                        # fp16 at once, every batch: the cat stays fp16
                shards.checked(f, encoder, device)        # before it is kept
                pool.submit(save, len(parts), f)
                parts.append(f)
                progress.update(len(f))
        except KeyboardInterrupt:
            pool.shutdown(wait=True)                      # the batches handed over are written whole
            log(f"[features] interrupted: {len(parts)} of {n_batches} batches of {key} kept in {batches}; the "
                f"rerun continues from batch {len(parts) + 1}")
            raise
    progress.close()
    feats = Features.cat(parts)
    atomic_save({"key": key, "tokens": feats.tokens.half(), "mask": feats.mask, "pooled": feats.pooled.half(),
                 "grid": feats.grid}, path)
    shutil.rmtree(batches, ignore_errors=True)
    return feats


def extract_ranks(encoder, inputs, path, folder, key, batch_size, device, cache_dir):
    """extract() under torchrun (distributed.py). Rank 0 decides for all and holds the key's lock for
    the group (another run waits as for one writer): a set already cached is read by every rank; a set
    small enough for one file is extracted by rank 0 while the others wait; a large set is planned
    by rank 0, then rank r writes shards r, r + N, r + 2N, ... (each written once, atomically, and
    skipped when done before: a rerun resumes), and every rank maps the finished shards."""
    r, n = distributed.RANK, distributed.WORLD
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
                    extract_file(encoder, inputs, path, key, batch_size, device, [shards.half(first)],
                                 Path(cache_dir) / "features" / f"{key}.batches")
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


# ---------------------------------------------------------------------------
# The space the cache will take, known before any extraction
# ---------------------------------------------------------------------------
def planned_bytes(encoder, inputs, cache_dir, device="cpu", **key_parts):
    """Bytes the cache of encoder's features of inputs will take on disk: 0 when it is there already, else
    an estimate from the first inputs: an image's tokens times the set's size (every image has its
    length); for texts the longest of the first 64 (a one-file set is padded to its longest row; shards are
    ragged: less). Tokens and pooled vectors in fp16, and the mask."""
    key = feature_key(encoder, inputs, device, **key_parts)
    features = Path(cache_dir) / "features"
    if (features / f"{key}.pt").exists() or not len(inputs):
        return 0
    f = encoder.encode(inputs[:1 if key_parts.get("modality") == "image" else 64], device)
    _, T, D = f.tokens.shape
    return len(inputs) * (2 * T * D + 2 * D + T)


def check_disk(need, cache_dir, cached=0, log=print):
    """One line with what the cache will take on disk, before any extraction; a RunError when the disk
    holding cache_dir has less free space than that (the extraction would fail hours in)."""
    where = Path(cache_dir).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    gb = lambda b: f"{b / 1e9:.2f} GB" if b < 1e11 else f"{b / 1e9:.0f} GB"
    log(f"[features] cache on disk: {gb(need)} to write ({cached} sets already cached); {gb(free)} free "
        f"on the disk of {where}")
    if need > free:
        raise RunError(f"the feature cache needs {gb(need)} on disk and the disk of {where} has {gb(free)} "
                       f"free; free some space, or pass a --cache-dir on a larger disk")
