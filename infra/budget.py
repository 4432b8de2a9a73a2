"""How long a method trains on a CPU: its own defaults, within a FLOP budget; on how many threads.

A method declares the paper's training settings once (`defaults`, methods/__init__.py). On
a GPU, and whenever --epochs is given, they stand. On a CPU with no --epochs, cpu_default
keeps a run within CPU_BUDGET_TFLOP of training matrix products, counted from the shapes
(forward_gflop), so the choice is the same on every machine; cpu_threads picks the training
threads from the same count. Settings.resolve_loop (infra/run.py) prints what either rule
chose; config.json holds it.
"""
import copy
import math

import torch

# Measured on the 2-core VM (docs/benchmarks.md, "CPU defaults"): the tiny encoders' pretraining and
# feature extraction (small convolutions, a 2-layer transformer) and the global methods'
# steps (a few ms) run as fast or faster on 1 thread, and many times slower on 2 when
# anything else holds a core; PAL's step (batch 256 x 65 tokens x K 512) gains from 2.
BIG_STEP_GFLOP = 1.0     # a step whose forward has this many GFLOP of matrix products trains on all cores
CPU_BUDGET_TFLOP = 2.5   # training FLOPs (3 x forward, matrix products) a default CPU run may spend: PAL's
                         # 15 Shapes epochs = 2.46 TFLOP, seed 0's RSum within 0.2 of 20
                         # (docs/benchmarks.md, "CPU defaults")
MIN_STEPS = 200          # ... in at least this many optimizer steps, where halving the batch gives them


def forward_gflop(method, img, txt, batch_size):
    """GFLOP of the matrix products in one forward of method.loss on the first batch_size pairs,
    counted from the shapes by torch's FlopCounterMode: nothing is timed, so the count (and every
    choice made from it) is the same on every machine and run. On a copy of the method, with the
    RNG state restored: the run itself is unchanged."""
    from torch.utils.flop_counter import FlopCounterMode
    rng, probe = torch.get_rng_state(), copy.deepcopy(method).cpu()
    with FlopCounterMode(display=False) as counter:
        probe.loss(img[:batch_size].to("cpu"), txt[:batch_size].to("cpu"))
    torch.set_rng_state(rng)
    return counter.get_total_flops() / 1e9


def cpu_threads(gflop, cores):
    """The training threads of --threads 0 on a CPU: all cores for a large step, else 1."""
    return cores if gflop is not None and gflop >= BIG_STEP_GFLOP else 1


def cpu_default(epochs, batch_size, method, img, txt):
    """On a CPU with no --epochs (epochs, batch_size: the flags as given, None when not): the method's
    own loop settings, unless its training would spend more than CPU_BUDGET_TFLOP; then its batch is
    halved (not below 32, and only when --batch-size is not given) while one epoch alone is over the
    budget or the budget holds fewer than MIN_STEPS steps, and it trains for as many epochs as the
    budget holds (at least 1). Returns (the forward GFLOP of a step at the batch used, the settings
    that change: {} or {"epochs", "batch_size"}, the words that say what changed, or None). On a GPU,
    and whenever --epochs is given, the method's own (paper) settings stand."""
    d = method.defaults
    own_batch = min(batch_size or d["batch_size"], len(img))
    gflop = forward_gflop(method, img, txt, own_batch)
    if epochs is not None:
        return gflop, {}, None
    cost = lambda epochs, gf, b: 3 * gf * (len(img) // b) * epochs / 1000          # TFLOP: forward + backward ~ 3x
    own_epochs = d["epochs"] if d.get("epochs") is not None else math.ceil(d["steps"] / (len(img) // own_batch))
    own_cost, batch = cost(own_epochs, gflop, own_batch), own_batch
    if own_cost <= CPU_BUDGET_TFLOP:
        return gflop, {}, None
    steps_held = lambda gf, b: int(CPU_BUDGET_TFLOP // cost(1, gf, b)) * (len(img) // b)
    while batch_size is None and batch >= 64 and (cost(1, gflop, batch) > CPU_BUDGET_TFLOP
                                                   or steps_held(gflop, batch) < MIN_STEPS):
        batch //= 2
        gflop = forward_gflop(method, img, txt, batch)
    epochs = max(1, min(own_epochs, int(CPU_BUDGET_TFLOP // cost(1, gflop, batch))))
    line = (f"epochs {epochs}, batch {batch} (the method's own: epochs "
            f"{own_epochs}, batch {own_batch}: {own_cost:.1f} TFLOP of training, over the CPU budget of "
            f"{CPU_BUDGET_TFLOP:g}); pass --epochs/--batch-size/--hp to override")
    return gflop, {"epochs": epochs, "batch_size": batch}, line
