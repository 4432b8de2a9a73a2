"""Which layer of each frozen encoder to read: --image-layer / --text-layer checked, and
--select-layers, the most similar pair of layers on the training pairs.

The layer selection protocol PAL adopts from STRUCTURE (Gröger et al., "With Limited Data for
Multimodal Alignment, Let the STRUCTURE Guide You", NeurIPS 2025; PAL §5.1): every layer's pooled
vectors of n training pairs, compared by linear CKA or mutual kNN (similarity.py), the most similar
pair chosen and cached.
"""
import math
from pathlib import Path

import torch


# ---------------------------------------------------------------------------
# Layer selection (the STRUCTURE paper's protocol): the most similar layer pair
# ---------------------------------------------------------------------------
def select_layers(image_enc, text_enc, pairs, metric="mknn", n=5000, batch_size=64, device="cpu", seed=0, log=print,
                  cache_dir=None):
    """Score every (image layer, text layer) on n random training pairs; set both encoders to the best.

    Pooled features of every layer from one forward pass per batch, kept on the device (no token
    is copied to the host); metric "cka" (linear CKA) or "mknn" (mutual kNN, k = ceil(2 n^(1/3))),
    from similarity.py, with each layer's kNN sets computed once (similarity.mutual_knn_table).
    With cache_dir the table is kept in cache_dir/layers/<key>.json, keyed by both encoders'
    names, weights fingerprints and preprocessing, the pairs scored (their captions; the image
    files' paths, sizes and mtimes, or the pixels of in-memory images), n, seed and the metric:
    a rerun reads it instead of running the encoders.
    Returns (image_layer, text_layer, {(li, lt): score}).
    """
    import hashlib
    import json

    import data
    import similarity
    from infra.storage import atomic_write_text

    def pooled_by_layer(enc, items, kind):  # {layer: (n, D_layer)} on device; progress on stderr past 2 s
        from infra.folder import Progress
        out, progress = {}, Progress(f"[layers] {metric}: {kind} of every layer:", len(items), kind)
        for i in range(0, len(items), batch_size):
            for layer, v in enc.pooled_layers(items[i:i + batch_size], device).items():
                out.setdefault(layer, []).append(v)
            progress.update(len(items[i:i + batch_size]))
        progress.close()
        return {layer: torch.cat(v).float() for layer, v in out.items()}

    pick = torch.randperm(len(pairs.images), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    first_caption = {}
    for j, i in enumerate(pairs.txt_to_img.tolist()):
        first_caption.setdefault(i, j)
    captions = [pairs.captions[first_caption[i]] for i in pick.tolist()]
    k = math.ceil(2 * len(pick) ** (1 / 3))
    path = None
    if cache_dir is not None:
        h = hashlib.sha1(repr([(e.name, getattr(e, "fingerprint", None), e.preprocess) for e in (image_enc, text_enc)]
                              + [metric, len(pick), seed, captions]).encode())
        h.update(pairs.images[pick].numpy().tobytes() if isinstance(pairs.images, torch.Tensor)
                 else data.identity(pairs.images).encode())       # files: path, size, mtime, ctime (data.identity)
        path = Path(cache_dir) / "layers" / f"{metric}-{h.hexdigest()[:16]}.json"
    saved = None
    if path is not None and path.exists():
        try:
            saved = {(li, lt): v for li, lt, v in json.loads(path.read_text())["table"]}
        except (OSError, ValueError, KeyError, TypeError):
            saved = None                                                        # unreadable: scored again
    if saved is not None:
        table, where = saved, f" (cached: {path})"
    else:
        images = pairs.images[pick] if isinstance(pairs.images, torch.Tensor) else \
            [pairs.images[i] for i in pick.tolist()]                            # real images: opened here only
        X = pooled_by_layer(image_enc, images, "images")                        # {li: (n, D_i)}
        Y = pooled_by_layer(text_enc, captions, "captions")                     # {lt: (n, D_t)}
        table = similarity.cka_table(X, Y) if metric == "cka" else similarity.mutual_knn_table(X, Y, k)
        where = ""
        if path is not None:
            atomic_write_text(json.dumps({"metric": metric, "n": len(pick), "k": k,
                                          "table": [[li, lt, v] for (li, lt), v in table.items()]}), path)
    rows, cols = sorted({li for li, _ in table}), sorted({lt for _, lt in table})
    best = max(table, key=table.get)
    log(f"[layers] {metric} on {len(pick)} training pairs" + (f" (k = {k})" if metric == "mknn" else "")
        + f": rows = image layer, columns = text layer{where}")
    log("          " + "".join(f"{lt:>8}" for lt in cols))
    for li in rows:
        log(f"    {li:>6}" + "".join(f"{table[li, lt]:8.3f}" for lt in cols) + ("   <- best" if li == best[0] else ""))
    log(f"[layers] best: image layer {best[0]}, text layer {best[1]} ({metric} {table[best]:.3f})")
    image_enc.layer, text_enc.layer = best
    return best[0], best[1], table
