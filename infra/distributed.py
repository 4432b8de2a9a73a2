"""Scaling out with torchrun: ranks, and exact data-parallel training of the trained methods.

    torchrun --nproc_per_node 4 align.py --method pal ...      # torchrun = python -m torch.distributed.run

PyTorch's own engine, nothing home-made: torchrun starts the processes (ranks) and sets
RANK / WORLD_SIZE / LOCAL_RANK; torch.distributed connects them (NCCL on GPUs, gloo on
CPUs); DistributedDataParallel (DDP) averages the gradients. Without torchrun nothing here is
called: align.py calls setup() only when WORLD_SIZE is set (torchrun's, or one left in a shell:
refused), and align.py, train.py and cache.py read WORLD and RANK and call in only when JOINED or
WORLD > 1; align.py runs as one process.

What each stage does under N ranks (docs/scaling.md):
1. Extraction (cache.extract): the ranks write disjoint cache shards (shard s by rank
   s mod N); a set small enough for one file is extracted by rank 0 while the others wait.
2. Training (Training below): every rank draws the same seeded permutation, so the global
   batch of --batch-size B is the one a single process draws; rank r takes its slice
   (B/N rows). The method's loss must still see the WHOLE batch: a contrastive loss over
   B/N pairs has fewer negatives and a different value. So during the step the method's
   embed_image / embed_text return the embeddings of all ranks (gather_rows: the other
   ranks' rows are copies, this rank's rows keep their gradient: open_clip's
   gather_with_grad with local_loss=False), and every rank evaluates the same global loss.
   In backward, each rank's rows get the gradient of all N (identical) losses, N times
   their single-process gradient, and so do parameters the loss uses directly (a learned
   temperature): DDP's average over the ranks is the single-process gradient (up to float
   summation order), every rank holds it and takes the same step.
3. Closed-form fits (CSA, ASIF: rank 0 fits on the full pooled matrices, after the group has
   ended), evaluation, figures, checkpoints and metrics: rank 0 (align.py); after training
   the group ends (finish) and rank 0 goes on as a single process.
   --resume: every rank loads rank 0's checkpoint.

Deviations / choices:
1. --batch-size is the GLOBAL batch: the same command gives the same run on 1 or N ranks.
2. Only methods whose loss reads the batch through embed_image / embed_text alone are split
   (their class attribute split_loss = True; tests/test_distributed.py checks each against
   its single-process loss and gradients). The others (CoV: its loss reads regions();
   STRUCTURE: R_S reads the raw features; T2C: map_text), a method with active dropout (its
   masks are drawn per row: a split batch draws other masks, so the result would match only
   in distribution) and --hard-negatives train on rank 0 alone, exactly as one process
   would, with a one-line message; the other ranks then have nothing left to do. Measured
   exact on the Shapes world (asif, mlp, cov: the same metrics and parameters, bit for bit,
   as one process).
3. A gather that gloo can run: torch.distributed.nn.all_gather's backward is a reduce_scatter,
   which gloo lacks; AllGather's backward is an all_reduce.
4. Ranks > 0 print only lines about their own work (their shards), prefixed [rank r];
   rank 0 prints what a single run prints. Errors go to stderr from every rank.
5. Every rank must run the same settings: same_everywhere compares them (a hash, then the
   differing values) before any work and before training; a mismatch stops every rank with
   one line, where it would otherwise deadlock in a collective. A collective waits at most
   TIMEOUT (30 min: longer than rank 0's longest lone step, a one-file extraction or a fit). A
   method that trains on rank 0 alone ends the group before its training: a fit of any length
   never runs into the timeout of the ranks that wait (NCCL would end the job after TIMEOUT).
6. A split method needs at least one pair of every global batch on every rank: a global
   batch smaller than the number of ranks is refused (check_batch), not run with empty slices.
"""
import builtins
import hashlib
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from infra.errors import RunError

TIMEOUT = timedelta(minutes=30)   # the longest a collective waits (choice 5)
_print = builtins.print
_ended = None                     # after end_group(): True on rank 0 (it goes on alone), False elsewhere
JOINED = False                    # setup() joined the ranks torchrun started
WORLD, RANK = 1, 0                # the group's size and this process's rank: set by setup(), 1 and 0 after end_group()


def say(msg):
    """A line about this rank's own work: prefixed with the rank when there are several."""
    _print(f"[rank {RANK}] {msg}" if WORLD > 1 else msg, flush=True)


def check_environment():
    """The environment's say in the run, read before any work: WORLD_SIZE above 1 means torchrun started
    this process (it also sets TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); one left
    in a shell would wait 30 minutes for ranks that never come."""
    size = os.environ.get("WORLD_SIZE", "1")
    if not size.isdigit():
        raise RunError(f"WORLD_SIZE={size} in the environment is not a count of ranks; unset it (torchrun sets it)")
    if int(size) > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise RunError(f"WORLD_SIZE={size} is set, but this process was not started by torchrun; unset "
                       f"WORLD_SIZE (and RANK, MASTER_ADDR, MASTER_PORT), or launch with torchrun "
                       f"--nproc-per-node {size} align.py")


def setup(device):
    """Join the ranks torchrun started (no-op without torchrun), after check_environment. device: "cuda" or "cpu"."""
    global WORLD, RANK, JOINED
    check_environment()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # "cuda" is now this rank's GPU
    # a rank waits at a barrier while rank 0 extracts a small set or fits (choice 5)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=TIMEOUT)
    WORLD, RANK, JOINED = dist.get_world_size(), dist.get_rank(), True
    if RANK > 0:
        builtins.print = lambda *a, **k: None                  # rank 0 speaks for the run (choice 4)
    print(f"[distributed] {WORLD} ranks ({dist.get_backend()}); rank 0 evaluates and writes the results")


def finish():
    """End the group after training: True on rank 0, which goes on alone (evaluation, results)."""
    if WORLD == 1:
        return _ended is not False                              # a rank > 0 that left before training: False
    return end_group()


def end_group():
    """All ranks leave the group now; True on rank 0. Rank 0 then runs as one process."""
    global _ended, WORLD, RANK
    r = RANK
    # a barrier first: a rank that tears the group down while another still has gloo work in flight
    # aborts at exit ("terminate called without an active exception", seen once in CI under load);
    # a rank that did not train waits here for rank 0 (within TIMEOUT)
    dist.barrier()
    dist.destroy_process_group()
    builtins.print = _print
    WORLD, RANK, _ended = 1, 0, r == 0
    return _ended


def leave(stop):
    """End this rank at once on a SystemExit (a RunError's one line, said here): a process that
    exits with its gloo group alive runs the group's destructors at shutdown, and those abort
    (SIGABRT) when another rank has already closed its side (a race: whichever rank ends first)."""
    code = stop.code
    if isinstance(code, str):
        _print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if isinstance(code, str) else int(code or 0))


def same_everywhere(what, settings):
    """Stop every rank with one line when the ranks' settings differ (choice 5). settings: a
    dict of plain values; compared by hash first, so equal settings cost one small gather."""
    if WORLD == 1:
        return
    text = json.dumps(settings, sort_keys=True, default=str)
    digests = [None] * WORLD
    dist.all_gather_object(digests, hashlib.sha1(text.encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, settings)
    diff = [f"{k}: " + ", ".join(f"{s.get(k)!r} on rank {r}" for r, s in enumerate(everyone))
            for k in sorted(set().union(*everyone), key=str) if len({repr(s.get(k)) for s in everyone}) > 1]
    raise RunError(f"the {WORLD} ranks were started with different {what} ({'; '.join(diff)}); "
                   f"start every rank with the same command")


def check_batch(method, batch_size, hard_negatives=False):
    """Refuse a global batch smaller than the number of ranks for a method that would be split
    (choice 6): a rank with no rows has nothing to embed."""
    if WORLD > 1 and split_blocker(method, hard_negatives) is None and batch_size < WORLD:
        raise RunError(f"a global batch of {batch_size} pair(s) on {WORLD} ranks: each rank takes a slice of "
                       f"every batch and would get none; use --batch-size {WORLD} or more (and at least as "
                       f"many alignment pairs), or fewer ranks")


def barrier():
    if WORLD > 1:
        dist.barrier()


def broadcast(obj):
    """Rank 0's obj on every rank (a small picklable value)."""
    if WORLD == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_state(module):
    """Rank 0's buffers and parameters on every rank, whatever their shapes (ASIF's anchors are
    set by fit()): the closed-form fit runs on rank 0 only."""
    if WORLD == 1:
        return
    shapes = broadcast({k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()})
    for name, (shape, dtype) in shapes.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        t = getattr(sub, leaf)
        if t.shape != shape:                                   # an empty buffer rank 0 filled
            t = torch.empty(shape, dtype=dtype, device=t.device)
        dist.broadcast(t.data, src=0)
        if isinstance(t, nn.Parameter) or leaf in sub._parameters:
            sub._parameters[leaf].data = t.data
        else:
            sub._buffers[leaf] = t


# ---------------------------------------------------------------------------
# Training: the global batch split across ranks, the loss over the whole batch
# ---------------------------------------------------------------------------
class AllGather(torch.autograd.Function):
    """(B_max, ...) on each rank -> (N, B_max, ...) every rank's tensor. Backward: every rank
    evaluates the SAME global loss, so the gradient of this rank's rows is the sum of the N
    ranks' gradients (all_reduce; torch.distributed.nn.all_gather's reduce_scatter is not in
    gloo): N times the single-process one, which DDP's averaging over the N ranks undoes."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts)                              # (N, B_max, ...)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)                                  # sum over the ranks' (identical) losses
        return grad[RANK]


def gather_rows(x):
    """x (B_r, ...) on each rank -> (B, ...) all ranks' rows in rank order, gradients flowing back
    to each rank's own rows (open_clip's gather_with_grad). Ranks may differ in every dim: rows are
    zero-padded to the largest (token-level embeddings pad words with exact zeros, as evaluate.py
    pads batches), then each rank's real rows are kept."""
    shape = torch.tensor(x.shape, device=x.device)
    shapes = [torch.empty_like(shape) for _ in range(WORLD)]
    dist.all_gather(shapes, shape)
    top = torch.stack(shapes).amax(0).tolist()                 # the largest size of every dim
    pad = [p for d in reversed(range(x.dim())) for p in (0, top[d] - x.shape[d])]
    parts = AllGather.apply(F.pad(x, pad))                     # (N, B_max, ...top) zeros after the real rows
    return torch.cat([p[:int(s[0])] for p, s in zip(parts, shapes)])


class _StepLoss(nn.Module):
    """What DDP wraps: forward = the method's loss on this rank's rows, embeddings gathered."""

    def __init__(self, method):
        super().__init__()
        self.method = method

    def forward(self, img, txt):
        m = self.method
        own = type(m).embed_image, type(m).embed_text
        m.embed_image = lambda x: gather_rows(own[0](m, x))    # instance attributes shadow the class's
        m.embed_text = lambda x: gather_rows(own[1](m, x))     # methods during this call only
        try:
            return m.loss(img, txt)
        finally:
            del m.embed_image, m.embed_text


def split_blocker(method, hard_negatives):
    """Why this method cannot be split across ranks (choice 2), or None."""
    if hard_negatives:
        return "--hard-negatives adds a term over each caption's own swaps"
    if not method.split_loss:
        return "its loss reads more of the batch than its embeddings"
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in method.modules()):
        return "its dropout masks are drawn per row (pass --hp dropout=0 to split it)"
    return None


class Training:
    """The training loop's hooks (train.train): which rows this rank takes, and the step's loss.

    Made under torchrun only (train.py: one process trains method.loss on every row): split (the global
    batch sliced across ranks, DDP summing the gradients), or rank 0 alone."""

    def __init__(self, method, batch_size, hard_negatives=False):
        self.loss, self.n, self.ddp = method.loss, WORLD, None
        self.active = True                                     # does this rank train?
        why = split_blocker(method, hard_negatives)
        if why is None:
            # same init on every rank
            self.ddp = nn.parallel.DistributedDataParallel(_StepLoss(method), forward_sync_buffers=False)
            self.loss = self.ddp
            lo, hi = batch_size // self.n, -(-batch_size // self.n)
            print(f"[distributed] each of {self.n} ranks takes {lo if lo == hi else f'{lo}-{hi}'} rows of every "
                  f"global batch of {batch_size}; the loss sees the whole batch")
        else:
            print(f"[distributed] {type(method).__name__} trains on rank 0 alone: {why}; the other ranks stop here")
            self.active = end_group()                          # no rank waits in a collective meanwhile (choice 5)
            self.n = 1

    def rows(self, idx):
        """This rank's slice of the global batch idx (B,): near-equal parts, in rank order."""
        return idx if self.ddp is None else torch.tensor_split(idx, self.n)[RANK]
