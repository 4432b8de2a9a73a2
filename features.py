"""Frozen encoder outputs as one data structure, the token contract every encoder keeps, and the
precision encoders compute in.

Features is what every stage passes around (tokens, mask, pooled, grid). How features are computed
once and cached on disk (extract, memory-mapped shards read back as StoredFeatures) is in infra/cache.py.

How batches of features reach the device (the second half of this file): Feed hands the training loop
its batches, deciding once from the sets' sizes where they live: on the GPU when they fit in
RESIDENT_SHARE of its memory (each step indexes them there: no host work, no host sync), else streamed
by batch_loader. There, on a CPU a batch is indexed and cast to fp32; a set read from disk batch by
batch is read ahead by threads (read_ahead); on CUDA each batch is read once into a pinned buffer, and
batch n + 1 is copied on a side stream while the step on batch n runs. Choices: RESIDENT_SHARE 0.7
leaves 30% of the GPU for the model, the step and the allocator's slack (COCO at DINOv2-L, ~54 GB,
fits an 80 GB H100); a resident batch keeps the set's padded width.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
import collections
import contextlib
import queue
import threading
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
# The precision encoders run in on the device, and the host side of a batch
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


def autocast(device):
    """bf16 (or fp16) autocast on CUDA, nothing on the CPU."""
    dtype = autocast_dtype(device)
    return contextlib.nullcontext() if dtype is None else torch.autocast("cuda", dtype=dtype)


def host_batch(x, device):
    """A host batch ready to cross: pinned on CUDA (its copy then runs without blocking), as is elsewhere."""
    return x.pin_memory() if str(device).startswith("cuda") else x


# ---------------------------------------------------------------------------
# Batches to the device: the copy, pinned memory, reading ahead, the training Feed
# ---------------------------------------------------------------------------
def batch_to(f, device, dtype=torch.float32):
    """A batch of Features on device, floats as dtype (None: as they are). On CUDA the host tensors are pinned
    (page-locked) and copied with non_blocking=True, so the copy overlaps the GPU's work; fp16
    cache tensors cross as fp16 (half the bytes) and become dtype on the GPU. Elsewhere: f.to."""
    if not str(device).startswith("cuda"):
        return f.to(device, dtype) if dtype is not None else f.to(device, f.tokens.dtype)
    f = pin(f)
    move = lambda x: x.to(device, non_blocking=True)
    cast = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    return replace(f, tokens=cast(move(f.tokens)), mask=move(f.mask), pooled=cast(move(f.pooled)))


def pin(f):
    """f with its host tensors in pinned memory (a no-op for tensors already pinned); CUDA only."""
    pinned = lambda x: torch.as_tensor(x).pin_memory()
    return replace(f, tokens=pinned(f.tokens), mask=pinned(f.mask), pooled=pinned(f.pooled))


def is_stored(f):
    """True for a set read from disk batch by batch (shards.StoredFeatures, shards.ConcatFeatures):
    anything indexable that is not a dense Features."""
    return not isinstance(f, Features)


READ_AHEAD = 4        # batches read ahead of the one in use


READ_WORKERS = 2      # threads reading them


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


RESIDENT_SHARE = 0.7   # of the GPU's memory the training set's features may take there (the rest: model, step)


RESIDENT_CHUNK_BYTES = 256 * 2**20   # tokens per host -> device copy while a set is loaded onto the device


def dense_shape(f):
    """(N, T, D, dtype, pooled dtype) of f held densely (padded to its longest row), known before any read:
    a Features' own; a memory-mapped set's fp16 rows at its longest length; ConcatFeatures' fp32 rows."""
    if isinstance(f, Features):
        return (*f.tokens.shape, f.tokens.dtype, f.pooled.dtype)
    if hasattr(f, "lengths"):                                               # shards.StoredFeatures
        return len(f), int(f.lengths.max()), f.dim, torch.float16, f.pooled.dtype
    T = max(dense_shape(p)[1] for p in f.parts)                             # shards.ConcatFeatures
    return len(f), max(T, f.T_image or 0), f.pooled.shape[-1], torch.float32, torch.float32


def dense_bytes(f):
    """Bytes of f held densely: tokens, mask and pooled."""
    N, T, D, dtype, pooled = dense_shape(f)
    return N * T * D * dtype.itemsize + N * T + N * D * pooled.itemsize


def to_device(f, device):
    """All of f on device, densely, floats in the dtype they are stored in (fp16 stays fp16: the step casts its
    batch there). Read about RESIDENT_CHUNK_BYTES at a time: no second copy of the set on the host."""
    N, T, D, dtype, pooled_dtype = dense_shape(f)
    chunk = max(1, RESIDENT_CHUNK_BYTES // (T * D * dtype.itemsize))
    tokens = torch.zeros(N, T, D, dtype=dtype, device=device)               # (N, T, D) padding exactly 0
    mask = torch.zeros(N, T, dtype=torch.bool, device=device)               # (N, T)
    pooled = torch.empty(N, D, dtype=pooled_dtype, device=device)           # (N, D)
    for i in range(0, N, chunk):
        c = batch_to(f[i:i + chunk], device, None)                 # its own longest row
        j, t = i + len(c), c.tokens.shape[1]
        tokens[i:j, :t], mask[i:j, :t], pooled[i:j] = c.tokens, c.mask, c.pooled
    return Features(tokens=tokens, mask=mask, pooled=pooled, grid=f.grid)


class Feed:
    """Where the training set's features live while the loop runs, decided once from their sizes (before any
    read) and said in one line; batches(index_batches) yields (idx, img[idx], txt[idx]) on device, fp32.

    - CUDA, when both sets fit in RESIDENT_SHARE of the GPU's memory: copied there once (fp16 as cached),
      each step indexes them on the GPU and casts its batch there: no host work, no host sync, per step.
      The rows keep the set's full padded width (cutting a batch to its longest row would need a sync);
      every method masks padding, so the values agree with the streamed batches to float rounding.
    - otherwise streamed (batch_loader): each batch read once from the memory map (or the host tensor)
      into a pinned buffer by READ_WORKERS threads, READ_AHEAD batches ahead, copied on a side stream.
    - CPU: a set in RAM is indexed per step (the step's own memory); a memory-mapped one is streamed."""

    def __init__(self, img, txt, device, log=print):
        self.img, self.txt, self.device = img, txt, device
        need = dense_bytes(img) + dense_bytes(txt)
        cuda = str(device).startswith("cuda")
        if cuda:
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            room = int(total * RESIDENT_SHARE) - torch.cuda.memory_allocated(device)
            self.resident = need <= room
            why = (f"{need / 2**30:.2f} GiB of features {'fit' if self.resident else 'exceed'} "
                   f"{room / 2**30:.1f} GiB ({RESIDENT_SHARE:.0%} of the GPU's {total / 2**30:.0f} GiB, less what "
                   f"is allocated)")
        else:
            self.resident = False
            why = f"{need / 2**30:.2f} GiB of features"
        if self.resident:
            self.on_device = to_device(img, device), to_device(txt, device)
            how = "on the GPU, loaded once; each step indexes them there (no host work per step)"
        elif is_stored(img) or is_stored(txt):
            how = (f"streamed from the memory map: each batch read once into a {'pinned ' if cuda else ''}buffer by "
                   f"{READ_WORKERS} threads, {READ_AHEAD} batches ahead")
        else:
            how = "in RAM; each step indexes its batch" + (" into a pinned buffer, copied on a side stream" if cuda
                                                           else "")
        log(f"[features] training set: {how}; {why}")

    def batches(self, index_batches):
        if not self.resident:
            yield from batch_loader(self.img, self.txt, index_batches, self.device)
            return
        img, txt = self.on_device
        cuda = str(self.device).startswith("cuda")
        for idx in index_batches:
            at = (idx.pin_memory() if cuda else idx).to(self.device, non_blocking=True)   # (B,) no wait for the GPU
            yield idx, *(Features(tokens=f.tokens[at].float(), mask=f.mask[at], pooled=f.pooled[at].float(),
                                  grid=f.grid) for f in (img, txt))


def host_rows(f, idx, pinned):
    """f[idx] on the host, read once into a buffer (pinned for a CUDA copy when pinned): a memory-mapped
    set copies each row from its shard straight into it; a host tensor is gathered into it."""
    if is_stored(f):
        return f[idx] if not pinned or not hasattr(f, "lengths") else f.rows(idx, pinned=True)
    if not pinned:
        return f[idx]
    mask = f.mask[idx]
    t = f.tokens.shape[1] if f.grid is not None else max(int(mask.sum(1).max()) if len(mask) else 0, 1)
    tokens = torch.empty((len(mask), t, f.tokens.shape[2]), dtype=f.tokens.dtype, pin_memory=True)
    torch.index_select(f.tokens[:, :t], 0, torch.as_tensor(idx).reshape(-1), out=tokens)
    return Features(tokens=tokens, mask=mask[:, :t].pin_memory(), pooled=f.pooled[idx].pin_memory(), grid=f.grid)


def batch_loader(img, txt, index_batches, device):
    """(idx, img[idx], txt[idx]) on device for each idx of index_batches, in order.

    Memory-mapped sets (is_stored) are read READ_AHEAD batches ahead by READ_WORKERS threads
    (read_ahead), so the disk reads of the next batches (and, on a CPU, their cast to fp32) overlap
    the step on this one. On CUDA
    the batches are pinned in the reader threads, and batch n + 1 is copied to the GPU (and
    cast to fp32 there) on a side stream while the step on batch n runs: the step waits only
    for its own batch's copy. The batches are the same either way."""
    cuda = str(device).startswith("cuda")
    fetch = lambda idx: (idx, *((host_rows(img, idx, True), host_rows(txt, idx, True)) if cuda else  # one copy
                                (batch_to(img[idx], device), batch_to(txt[idx], device))))  # CPU: fp32 in the readers
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
