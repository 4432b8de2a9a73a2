"""How batches of features reach the device: the copy, pinned memory, reading ahead, progress lines.

batch_loader hands the training loop its batches (features.py holds what a batch is; cache.py
how the sets are stored on disk). On a CPU a batch is indexed and cast to fp32; a set read from
disk batch by batch is read ahead by threads (read_ahead); on CUDA batch n + 1 is pinned and
copied on a side stream while the step on batch n runs.
"""
import collections
import queue
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from features import Features


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
    """True for a set read from disk batch by batch (shards.StoredFeatures, shards.ConcatFeatures):
    anything indexable that is not a dense Features."""
    return not isinstance(f, Features)


def clock(seconds):
    """Seconds as 42s, 3m07s or 1h02m."""
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


QUIET = False    # align.py --quiet: no progress lines


FIRST = 2.0      # seconds before a loop's first progress line


ANNOUNCE = 10000  # a loop over at least this many items says when it starts (COCO's sets; not the Shapes world's)


def to_stderr(line):
    print(line, file=sys.stderr, flush=True)


class Progress:
    """Progress lines of a long loop, in the style of [train]'s: done / total, rate, elapsed, ETA.

    t0: when the work began (the rate counts everything done since, the first batch included).
    The first line after FIRST seconds, then at most one every `every` seconds and one at the end, only
    when the loop ran that long; on stderr, flushed (log=print), so a redirected stdout keeps the results.
    None under --quiet (QUIET)."""

    def __init__(self, tag, total, unit="rows", every=10.0, log=print, t0=None, first=None):
        self.tag, self.total, self.unit, self.every = tag, total, unit, every
        self.first = FIRST if first is None else first
        self.log = to_stderr if log is print else log
        self.t0 = time.time() if t0 is None else t0
        self.done, self.last, self.said = 0, self.t0, False
        if total >= ANNOUNCE and not QUIET:         # a first batch of a large set can take a minute: say it began
            self.log(f"{tag} 0/{total} {unit}, started")

    def line(self):
        dt = max(time.time() - self.t0, 1e-9)
        rate = self.done / dt
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.tag} {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
                f"{rate:,.0f} {self.unit}/s, {clock(dt)} elapsed, ETA {clock(eta) if eta < 1e7 else '?'}")

    def update(self, n, force=False):
        self.done += n
        now = time.time()
        wait = self.every if self.said else self.first
        if not QUIET and (force or (now - self.last >= wait and self.done < self.total)):
            self.last, self.said = now, True
            self.log(self.line())

    def close(self):
        if not QUIET and (self.said or time.time() - self.t0 >= self.every):
            self.log(self.line())


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
