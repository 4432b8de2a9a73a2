"""Frozen encoder outputs as one data structure, and how batches of it reach the device.

Features is what every stage passes around (tokens, mask, pooled, grid); batch_loader
hands the training loop its batches. How features are computed once and cached on
disk (extract, memory-mapped shards read back as StoredFeatures) is in cache.py.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
import queue
import threading
from dataclasses import dataclass, replace

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
        tensor = lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))  # where it is
        return replace(self, tokens=tensor(self.tokens).to(device, dtype), mask=tensor(self.mask).to(device),
                       pooled=tensor(self.pooled).to(device, dtype))

    def patches(self):
        """(B, H*W, D) the patch tokens only, in grid order (images only)."""
        H, W = self.grid
        return self.tokens[:, 1:1 + H * W]

    @staticmethod
    def from_vectors(x):
        """Global vectors (B, D) as one-token sequences (e.g. classifier-head rows)."""
        return Features(tokens=x[:, None], mask=torch.ones(len(x), 1, dtype=torch.bool, device=x.device), pooled=x)

    @staticmethod
    def cat(parts):
        """Concatenate along the batch, padding tokens to the longest."""
        T = max(p.tokens.shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]), value=v)
        return Features(tokens=torch.cat([pad(p.tokens, 0) for p in parts]),
                        mask=torch.cat([pad(p.mask, False) for p in parts]),
                        pooled=torch.cat([p.pooled for p in parts]), grid=parts[0].grid)



# ---------------------------------------------------------------------------
# Moving batches to the device, and reading them ahead
# ---------------------------------------------------------------------------
def batch_to(f, device, dtype=torch.float32):
    """A batch of Features on device, floats as dtype. On CUDA the host tensors are pinned
    (page-locked) and copied with non_blocking=True, so the copy overlaps the GPU's work; fp16
    cache tensors cross as fp16 (half the bytes) and become dtype on the GPU. Elsewhere: f.to."""
    if not str(device).startswith("cuda"):
        return f.to(device, dtype)
    f = pin(f)
    move = lambda x: x.to(device, non_blocking=True)
    return replace(f, tokens=move(f.tokens).to(dtype), mask=move(f.mask), pooled=move(f.pooled).to(dtype))


def pin(f):
    """f with its host tensors in pinned memory (a no-op for tensors already pinned); CUDA only."""
    pinned = lambda x: torch.as_tensor(x).pin_memory()
    return replace(f, tokens=pinned(f.tokens), mask=pinned(f.mask), pooled=pinned(f.pooled))


def is_stored(f):
    """True for a set read from disk batch by batch (cache.StoredFeatures, cache.ConcatFeatures):
    anything indexable that is not a dense Features."""
    return not isinstance(f, Features)


_END = object()


def read_ahead(make, items, depth=1):
    """make(item) for each item, in order, computed by a background thread `depth` items ahead
    (a bounded queue): reading batch n + 1 from a memory map overlaps the work on batch n.

    The same values in the same order as (make(i) for i in items). An exception in the reader
    is raised here, in the caller's thread; leaving the loop early (break, an exception in the
    caller) stops the reader before this generator returns."""
    q, stop = queue.Queue(maxsize=depth), threading.Event()

    def put(x):                                          # blocks while the queue is full, unless stopped
        while not stop.is_set():
            try:
                q.put(x, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def reader():
        try:
            for item in items:
                if not put((make(item), None)):
                    return
        except BaseException as e:                       # handed to the caller's thread
            put((None, e))
            return
        put((_END, None))

    thread = threading.Thread(target=reader, name="read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            value, error = q.get()
            if error is not None:
                raise error
            if value is _END:
                return
            yield value
    finally:
        stop.set()
        thread.join()


def batch_loader(img, txt, index_batches, device):
    """(idx, img[idx], txt[idx]) on device for each idx of index_batches, in order.

    Memory-mapped sets (is_stored) are read one batch ahead by a background thread
    (read_ahead), so the disk read of batch n + 1 overlaps the step on batch n; on
    CUDA the batches cross through pinned memory with non_blocking copies (batch_to),
    pinned in the reader thread when there is one. The batches are the same either way."""
    cuda = str(device).startswith("cuda")
    fetch = lambda idx: (idx, *((pin(img[idx]), pin(txt[idx])) if cuda else (img[idx], txt[idx])))
    stored = is_stored(img) or is_stored(txt)
    for idx, img_b, txt_b in (read_ahead(fetch, index_batches) if stored else map(fetch, index_batches)):
        yield idx, batch_to(img_b, device), batch_to(txt_b, device)
