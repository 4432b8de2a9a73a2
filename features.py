"""Frozen encoder outputs as one data structure, and how batches of it reach the device.

Features is what every stage passes around (tokens, mask, pooled, grid); batch_loader
hands the training loop its batches. How features are computed once and cached on
disk (extract, memory-mapped shards read back as StoredFeatures) is in cache.py.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
import collections
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch

@dataclass
class Features:
    """Frozen token features of B samples of one modality.

    tokens: (B, T, D) float, by the token-layout contract below. Images:
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
# The token-layout contract: what every encoder hands on, whatever its family emits
# ---------------------------------------------------------------------------
# Features of an IMAGE: tokens = [global, H*W patches row-major], global = pooled =
#   the vector the checkpoint's own head / projection reads. Every other token a
#   model emits (DINOv2's registers, DeiT's distillation token, BEiT's CLS when it
#   mean-pools) is dropped: no method reads it.
# Features of a TEXT: tokens = the caption's WORD tokens only, in order, padded at the
#   end. The tokenizer's special tokens (CLS / SEP, <s> / </s>, BOS / EOS) are dropped
#   by word_positions() below, the one place this rule lives, so every token-level
#   method (CoV, FILIP, text_guided, PAL's CAP, FA) matches words, as the papers do
#   (PAL: "Z are the patch and word tokens"). pooled is computed before that, over the
#   whole sequence, as the family defines it (sentence-transformers' masked mean
#   includes CLS / SEP).
# One space: at the last layer every token has gone through the final norm the pooled
#   vector went through, so a head fitted on pooled applies to each patch (the MaskCLIP
#   trick of dense_image). Where Hugging Face leaves that norm off the tokens (BEiT's
#   mean-pooling layernorm, CLIP's post_layernorm) it is applied here. Intermediate
#   layers: the raw block outputs, pooled read the same way (CLS, or BEiT's mean patch).
#
# family                 the model emits            global token 0 = pooled        final norm on every token
# dinov2                 [CLS, patches]             CLS                            layernorm (HF)
# dinov2_with_registers  [CLS, registers, patches]  CLS                            layernorm (HF)
# vit                    [CLS, patches]             CLS                            layernorm (HF)
# deit                   [CLS, DIST, patches]       CLS (...ForImageClassification) layernorm (HF)
# beit, use_mean_pooling [CLS, patches]             layernorm(mean patch) (pooler) pooler.layernorm (here)
# beit, otherwise        [CLS, patches]             CLS                            layernorm (HF)
# clip vision            [CLS, patches]             post_layernorm(CLS) (pooler)   post_layernorm (here)
# torchvision ResNets    feature map (D, H, W)      mean of the map (what fc reads) none
# shapes-cnn             feature map (D, 8, 8)      mean of the map                none
#
# family                 the model emits            pooled                         tokens kept
# bert, MiniLM, distilbert [CLS, words, SEP]        masked mean of all tokens      the words
# roberta, xlm-r, mpnet  [<s>, words, </s>]         masked mean of all tokens      the words
# clip text              [BOS, words, EOS]          EOS after final_layer_norm     the words (after final_layer_norm)
# shapes-text            [CLS, words]               masked mean of all tokens      the words
#
# tests/test_token_contract.py checks each row against the Hugging Face model's own outputs.

# The special-token rule of the text rows above, written once
TOKEN_RULE = "tokens: image [pooled, patches], text words only; last layer normed as pooled"  # in the cache key


def word_positions(real, special):
    """THE special-token rule, written once: which of a text's tokens are its words.

    real (B, L) bool, the attention mask; special (B, L) bool, the tokenizer's special
    tokens (CLS / SEP, <s> / </s>, BOS / EOS). Returns idx (B, L') the positions of the
    word tokens, in order, padded with other positions, and mask (B, L') True for a word.
    A text with no word token at all keeps its real tokens, so no row is ever empty.
    """
    word = real & ~special                                                   # (B, L)
    word = torch.where(word.any(1, keepdim=True), word, real)
    idx = torch.sort((~word).to(torch.uint8), dim=1, stable=True).indices   # words first, in order
    idx = idx[:, :max(int(word.sum(1).max()), 1)]                            # (B, L')
    return idx, word.gather(1, idx)


def word_tokens(h, real, special):
    """(B, L, D) encoder tokens -> the word tokens (B, L', D) (padding exactly 0) and their mask (B, L')."""
    idx, mask = word_positions(real, special)
    tokens = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))         # (B, L', D)
    return tokens * mask[..., None], mask



# ---------------------------------------------------------------------------
# Moving batches to the device, and reading them ahead
# ---------------------------------------------------------------------------
def autocast_dtype(device):
    """The encoders' autocast dtype on device: bf16 where the GPU computes it natively (Ampere and
    later), fp16 on older GPUs (V100, T4 emulate bf16, slowly), None (fp32) on the CPU."""
    if not str(device).startswith("cuda"):
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def precision(device):
    """How features are computed on device, for the cache key: "fp32" or e.g. "cuda autocast bfloat16"."""
    dtype = autocast_dtype(device)
    return "fp32" if dtype is None else f"cuda autocast {str(dtype).removeprefix('torch.')}"


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


def clock(seconds):
    """Seconds as 42s, 3m07s or 1h02m."""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Progress lines of a long loop, in the style of [train]'s: done / total, rate, elapsed, ETA.

    t0: when the work began (the rate counts everything done since, the first batch included).
    A line at most every `every` seconds and one at the end, only when the loop ran that long."""

    def __init__(self, tag, total, unit="rows", every=10.0, log=print, t0=None):
        self.tag, self.total, self.unit, self.every, self.log = tag, total, unit, every, log
        self.t0 = time.time() if t0 is None else t0
        self.done, self.last = 0, self.t0

    def line(self):
        dt = max(time.time() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.tag} {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
                f"{rate:,.0f} {self.unit}/s, {clock(dt)} elapsed, ETA {clock(eta) if eta < 1e7 else '?'}")

    def update(self, n, force=False):
        self.done += n
        now = time.time()
        if force or (now - self.last >= self.every and self.done < self.total):
            self.last = now
            self.log(self.line())

    def close(self):
        if time.time() - self.t0 >= self.every:
            self.log(self.line())


READ_AHEAD = int(os.environ.get("ALIGN_READ_AHEAD", "4"))        # batches read ahead of the one in use
READ_WORKERS = int(os.environ.get("ALIGN_READ_WORKERS", "2"))    # threads reading them


def read_ahead(make, items, depth=READ_AHEAD, workers=READ_WORKERS):
    """make(item) for each item, in order, computed by a small pool of `workers` threads up to `depth`
    items ahead: reading batches n + 1 .. n + depth from a memory map overlaps the work on batch n
    (numpy's copies release the GIL, so the threads' page faults and copies run side by side).

    The same values in the same order as (make(i) for i in items); items is consumed in this
    thread. An exception in a reader is raised here, in the caller's thread, at its item; leaving
    the loop early (break, an exception in the caller) cancels the pending reads and waits for the
    running ones before this generator returns."""
    tasks, stop, pending = queue.Queue(), threading.Event(), collections.deque()

    def work():
        while (slot := tasks.get()) is not None:
            if not stop.is_set():
                try:
                    slot.value = make(slot.item)
                except BaseException as e:                   # handed to the caller's thread
                    slot.error = e
            slot.done.set()

    def take(slot):
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.value

    threads = [threading.Thread(target=work, name="read-ahead", daemon=True) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    try:
        for item in items:
            pending.append(SimpleNamespace(item=item, value=None, error=None, done=threading.Event()))
            tasks.put(pending[-1])
            if len(pending) > max(1, depth):
                yield take(pending.popleft())
        while pending:
            yield take(pending.popleft())
    finally:
        stop.set()                                           # pending reads are skipped, running ones finish
        for _ in threads:
            tasks.put(None)
        for t in threads:
            t.join()


def batch_loader(img, txt, index_batches, device):
    """(idx, img[idx], txt[idx]) on device for each idx of index_batches, in order.

    Memory-mapped sets (is_stored) are read READ_AHEAD batches ahead by READ_WORKERS threads
    (read_ahead), so the disk reads of the next batches (and, on a CPU, their cast to fp32) overlap
    the step on this one. On CUDA
    the batches are pinned in the reader threads, and batch n + 1 is copied to the GPU (and
    cast to fp32 there) on a side stream while the step on batch n runs: the step waits only
    for its own batch's copy. The batches are the same either way."""
    cuda = str(device).startswith("cuda")
    fetch = lambda idx: (idx, *((pin(img[idx]), pin(txt[idx])) if cuda else                # CPU: fp32 in the readers
                                (batch_to(img[idx], device), batch_to(txt[idx], device))))
    stored = is_stored(img) or is_stored(txt)
    batches = read_ahead(fetch, index_batches) if stored else map(fetch, index_batches)
    if not cuda:
        yield from batches
        return
    copy = torch.cuda.Stream(device)

    def send(item):                                          # batch n + 1's copy, queued on the side stream
        idx, img_b, txt_b = item
        with torch.cuda.stream(copy):
            img_b, txt_b = batch_to(img_b, device), batch_to(txt_b, device)
        done = torch.cuda.Event()
        done.record(copy)
        return idx, img_b, txt_b, done

    def ready(sent):                                         # the step's stream waits for that copy only
        idx, img_b, txt_b, done = sent
        main = torch.cuda.current_stream(device)
        main.wait_event(done)
        for f in (img_b, txt_b):
            for x in (f.tokens, f.mask, f.pooled):
                x.record_stream(main)                        # made on the side stream, used on this one
        return idx, img_b, txt_b

    ahead = None
    for item in batches:
        sent = send(item)
        if ahead is not None:
            yield ready(ahead)
        ahead = sent
    if ahead is not None:
        yield ready(ahead)
