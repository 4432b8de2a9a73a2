"""Training: the one training loop every method trains in, and the --resume checkpoint it continues.

fit_or_train runs a method's closed-form fit or train, the mini-batch loop with the method's
optimiser, a cosine schedule, a checkpoint each epoch, --resume, and a clear stop on a non-finite
loss. The loop's settings (epochs, batch, lr, ...) come resolved from infra/run.py.
"""
import copy
import json
import math
import os
import time
from pathlib import Path

# MKL's strict conditional numerical reproducibility: its matrix products add in the same order at any thread
# count (2 threads split the K of a weight gradient's (D, B*N) x (B*N, K) product otherwise, and a CPU run's
# metrics moved with --threads: tests/test_threads.py). Read at MKL's first call, so set before any work.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402

import evaluate  # noqa: E402
from features import Features, Feed, batch_to  # noqa: E402
from infra import distributed, storage  # noqa: E402
from infra.errors import RunError  # noqa: E402
from infra.folder import Progress  # noqa: E402
from infra.run import refuse_batch  # noqa: E402
from methods.csa import image_ids  # noqa: E402
from negatives import contrastive_scale, hard_negative_loss


def resume_state(settings):
    """The checkpoint --resume continues, loaded here once, before the features, and compared on the
    run's identity (settings.identity: settings, code, encoders, data) and --epochs / --batch-size when given
    (train compares the rest: the loop as resolved, the weights' shapes); else False, or True for --resume
    before a first checkpoint."""
    ckpt = settings.out / "checkpoint.pt"
    if not (settings.args.resume and ckpt.exists()):
        return settings.args.resume
    given = {k: v for k in ("epochs", "batch_size") if (v := getattr(settings.args, k)) is not None}
    return load_checkpoint(ckpt, {**settings.identity, **given})   # the loop's flags as given: compared now too


def load_checkpoint(ckpt, settings):
    """A --resume checkpoint, refused with one line when it is truncated, holds code, or was
    written under other settings (same_settings)."""
    try:
        state = storage.load_plain(ckpt)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise RunError(f"--resume: {ckpt} is truncated or corrupt ({type(e).__name__}); delete it "
                       f"to start over, or run without --resume") from None
    return same_settings(ckpt, state, settings)


def same_settings(ckpt, state, settings):
    """state, refused when it was written under other settings (listing what differs); only the keys
    of `settings` count."""
    old = state.get("settings", {}) if isinstance(state, dict) else {}
    diff = [f"{k} {old.get(k)!r} there, {v!r} now" for k, v in settings.items() if old.get(k) != v]
    if diff:
        raise RunError(f"--resume: {ckpt} was written under other settings: {'; '.join(diff)}. "
                       f"Rerun with its settings, or without --resume (or with another --out) to "
                       f"start over")
    bad = [k for k, v in state.get("method", {}).items() if torch.is_tensor(v) and v.is_floating_point()
           and not torch.isfinite(v).all()]
    if bad:
        raise RunError(f"--resume: {ckpt} holds NaN or inf in {', '.join(bad[:3])}; delete it to start over "
                       f"(a lower --lr), or run without --resume")
    return state


# ---------------------------------------------------------------------------
# The loop's settings: the method's own, on a CPU within a FLOP budget
# ---------------------------------------------------------------------------
# A method declares the paper's training settings once (`defaults`, methods/__init__.py). On a GPU, and
# whenever --epochs is given, they stand. On a CPU with no --epochs, cpu_default keeps a run within
# CPU_BUDGET_TFLOP of training matrix products, counted from the shapes (forward_gflop), so the choice
# is the same on every machine; cpu_threads picks the training threads from the same count. Both are
# printed ("[cpu default]", "[threads]") and config.json holds what they chose.
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


def plan_loop(given, method, n):
    """The loop's settings as they run on n pairs: the batch at most n, a step budget ("steps",
    methods/__init__.py) as ceil(steps / steps per epoch) epochs. A batch the method cannot train on is
    refused."""
    batch = min(given["batch_size"], n)
    refuse_batch(type(method), batch, n)
    steps = n // batch                  # the last partial batch is dropped: InfoNCE wants full ones
    epochs = given["epochs"] if given["epochs"] is not None else -(-method.defaults["steps"] // steps)
    return dict(given, epochs=epochs, batch_size=batch)


def resolve_loop(settings, method, img, txt, cores):
    """The loop's settings as the run will use them: the flags, else the method's defaults, on a
    CPU with no --epochs within the FLOP budget (cpu_default); and the thread counts. Into settings.loop
    and settings.threads."""
    a = settings.args
    settings.threads = dict(encode_threads=torch.get_num_threads(), train_threads=torch.get_num_threads())
    given = settings.loop_given(method.defaults)
    if method.loss is None:
        settings.loop = given
    else:
        settings.loop = plan_loop(given, method, len(img))       # a batch it cannot train on stops here
        if distributed.WORLD > 1:
            distributed.check_batch(method, settings.loop["batch_size"], a.hard_negatives)
        if settings.device == "cpu":
            gflop, budgeted, line = cpu_default(a.epochs, a.batch_size, method, img, txt)
            if line:
                print(f"[cpu default] {a.method}: {line}")
                settings.loop = plan_loop({**given, **budgeted}, method, len(img))
            torch.set_num_threads(a.threads or cpu_threads(gflop, cores))
            settings.threads["train_threads"] = torch.get_num_threads()
            print(f"[threads] training on {settings.threads['train_threads']} (a step's forward: {gflop:.2f} "
                  f"GFLOP of matrix products)")
    if distributed.WORLD > 1:
        distributed.same_everywhere("settings", {**settings.identity, **settings.loop, **settings.threads})


# ---------------------------------------------------------------------------
# The one training loop
# ---------------------------------------------------------------------------
def fit_or_train(method, img, txt, loop, out, device, resume=False, settings=None, negatives=None):
    """A closed-form fit, or the training loop; {"seconds", "final_loss", "history"}: the last epoch's mean loss, as
    printed, and one dict per epoch (epoch, loss, the method's logs, lr, seconds; a closed form: one row, epoch 0,
    the fit's seconds), which align.py writes to history.csv."""
    t0, result = time.time(), {"seconds": 0.0, "final_loss": None, "history": []}
    if method.fit is not None:  # closed forms are global: pooled vectors, never a whole token cache
        if distributed.WORLD > 1 and method.loss is None and not distributed.end_group():
            return result                   # torchrun: rank 0 fits alone, the others leave before the fit
        if distributed.RANK == 0:
            vectors = lambda f: Features.from_vectors(f.pooled).to(device)
            reads = {"patches": img} if method.fit_reads_patches else {}  # held-out images only
            method.fit(vectors(img), vectors(txt), **reads)
        if distributed.WORLD > 1:
            distributed.broadcast_state(method)
        seconds = round(time.time() - t0, 2)
        result = {"seconds": seconds, "final_loss": None, "history": [{"epoch": 0, "seconds": seconds}]}
        if getattr(method, "choice", None):               # a setting chosen on held-out pairs: said, and kept
            keep_choice(method.choice, out, result)
    if method.loss is not None:
        val = None
        if method.holds_out and negatives is None:   # SAIL: stops on held-out pairs
            val_idx, fit_idx = held_out_pairs(img.pooled, method.holds_out)
            val = validation_set(img, txt, val_idx)
            print(f"[validation] {len(val_idx)} of {len(img)} alignment pairs held out ({len(val[0])} images), "
                  f"the rest trained on; no test pair is read")
            img, txt = img[fit_idx], txt[fit_idx]
        try:
            result = train(method, img, txt, loop, out, device, resume, settings, negatives, val)
        except FloatingPointError as e:
            raise RunError(str(e)) from None
        except torch.OutOfMemoryError:      # the device's memory is the boundary: said once, the checkpoint kept
            raise RunError(f"out of memory on {device} in a step of {loop['batch_size']} pairs; pass --batch-size "
                           f"{max(2, loop['batch_size'] // 2)} (or smaller --hp values), then rerun with --resume "
                           f"(the cached features and every finished epoch are kept)") from None
    return result


def keep_choice(choice, out, result):
    """The setting a method chose on its held-out alignment pairs: printed with the validation figures that
    chose it, the figures written to <out>/validation.json, the value into result["chosen"] (metrics.json)."""
    print_choice(choice)
    table = {"setting": choice["setting"], "chosen": choice["chosen"],
             "table": [{choice["setting"]: v, **row} for v, row in choice["table"].items()]}
    if distributed.RANK == 0:
        storage.atomic_write_text(json.dumps(table, indent=1), Path(out) / "validation.json")
    result["chosen"] = {choice["setting"]: choice["chosen"]}


def print_choice(choice):
    """The choice's lines: the chosen value, then each candidate's validation figures."""
    keys = list(next(iter(choice["table"].values())))
    print(f"[choice] {choice['setting']} chosen on held-out alignment pairs (no test pair read): "
          f"{choice['chosen']:g}, the best validation score")
    print(f"[choice] {choice['setting']:>8s}  " + "  ".join(f"{k:>9s}" for k in keys))
    for v, row in choice["table"].items():
        mark = "  <- chosen" if v == choice["chosen"] else ""
        print(f"[choice] {v:8g}  " + "  ".join(f"{row[k]:9.4f}" for k in keys) + mark)


# ---------------------------------------------------------------------------
# Validation on held-out alignment pairs
# ---------------------------------------------------------------------------
def held_out_pairs(pooled, share=0.2, max_images=1000, seed=0):
    """(val, fit) pair indices: a seeded `share` of the distinct images (distinct pooled rows; at most
    max_images) held out with all their pairs, so no image is on both sides."""
    image = image_ids(pooled)                                                   # (N,) image id of each pair
    n_img = int(image.max()) + 1
    perm = torch.randperm(n_img, generator=torch.Generator().manual_seed(seed))
    is_val = torch.zeros(n_img, dtype=torch.bool)
    is_val[perm[:min(max(2, int(share * n_img)), max_images)]] = True
    return is_val[image].nonzero().squeeze(1), (~is_val[image]).nonzero().squeeze(1)


def validation_set(img, txt, val_idx):
    """(images, captions, txt_to_img) of the held-out pairs: each distinct image once."""
    _, image = torch.unique(img.pooled[val_idx], dim=0, return_inverse=True)
    first = torch.full((int(image.max()) + 1,), len(val_idx)).scatter_reduce(0, image, torch.arange(len(val_idx)),
                                                                             "amin")
    return img[val_idx[first]], txt[val_idx], image


class PatchMean(torch.nn.Module):
    """A method whose image embedding is the mean of its dense_image rows (the patches segmentation reads)."""

    def __init__(self, method):
        super().__init__()
        self.method = method

    def embed_image(self, img):
        return torch.nn.functional.normalize(self.method.dense_image(img).mean(1), dim=-1)

    def embed_text(self, txt):
        return self.method.embed_text(txt)

    def score(self, img_emb, txt_emb):
        return self.method.score(img_emb, txt_emb)


def validate(method, val, device):
    """Validation figures on held-out pairs: val_rsum (retrieval RSum), val_dense_rsum (RSum with each image
    the mean of its patch embeddings), and val_score, their mean, what a stop on validation reads."""
    img, txt, txt_to_img = val
    rsum = evaluate.retrieval(method, img, txt, txt_to_img, device=device)["rsum"]
    dense = evaluate.retrieval(PatchMean(method), img, txt, txt_to_img, device=device)["rsum"]
    return {"val_rsum": round(rsum, 4), "val_dense_rsum": round(dense, 4), "val_score": round((rsum + dense) / 2, 4)}


FINITE_EVERY = 50  # steps between the host's looks at the loss (on a GPU each is a sync), and each epoch's end


def stop_if_not_finite(losses, epoch, first, ckpt, saved, lr, params=()):
    """Raise FloatingPointError at the first non-finite loss of losses (steps first + 1, first + 2, ...),
    or, when every loss is finite, at a non-finite trained parameter (a finite loss whose gradient was
    not: the step wrote NaN into the weights), with where it happened and what to do; one host sync.
    Steps after it have run, on NaN weights, but no checkpoint was written since: the run stops before
    its epoch's checkpoint, metrics or model.safetensors."""
    if not losses and not params:
        return
    loss_ok = torch.isfinite(torch.stack(losses)) if losses else torch.ones(0, dtype=torch.bool)  # (n,)
    param_ok = torch.stack([torch.isfinite(p).all() for p in params]) if params else loss_ok.new_ones(0)
    finite, weights_finite = torch.cat([loss_ok, param_ok.to(loss_ok.device)]).split(
        [len(loss_ok), len(param_ok)])
    finite, weights_finite = finite.tolist(), bool(weights_finite.all())     # the one copy to the host
    again = "then rerun with --resume" if saved else "then rerun (no checkpoint was written yet)"
    if not all(finite):
        i = finite.index(False)
        at = f"at epoch {epoch + 1}, step {first + i + 1}"
        if epoch == 0 and first + i == 0:     # before any update: the settings, not the step size
            raise FloatingPointError(
                f"loss is {losses[i].item()} {at}, before any update: the method's settings (--hp) or the "
                f"features give a non-finite loss, not --lr; check the --hp values (a temperature near 0 "
                f"overflows), {again}.")
        raise FloatingPointError(
            f"loss is {losses[i].item()} {at}. The last good checkpoint is "
            f"{ckpt if saved else 'not written yet'}. Try a lower --lr (now {lr:g}), {again}.")
    if not weights_finite:
        raise FloatingPointError(
            f"a trained parameter holds NaN or inf after epoch {epoch + 1} (every loss was finite: a "
            f"gradient was not). The last good checkpoint is {ckpt if saved else 'not written yet'}. "
            f"Try a lower --lr (now {lr:g}) or --hp values further from their limits, {again}.")


def optimiser(method, lr, weight_decay, total_steps):
    """(params, opt, sched): the method's trained parameters, its optimizer (Adam or AdamW, its betas) and a
    cosine schedule over total_steps: the one setup of every loop (train below, calibration.train)."""
    d = method.defaults
    params = [p for p in method.parameters() if p.requires_grad]
    opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[d.get("optimizer", "adamw")](
        params, lr=lr, weight_decay=weight_decay, betas=d.get("betas", (0.9, 0.999)))
    return params, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total_steps))


def epoch_order(n, seed, epoch):
    """An epoch's order of the n pairs: a permutation seeded by (seed, epoch) alone."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))


def update(method, loss, params, opt, sched):
    """One step: the gradient of loss, clipped to the method's grad_clip, then the optimizer's and schedule's."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if method.defaults.get("grad_clip"):
        torch.nn.utils.clip_grad_norm_(params, method.defaults["grad_clip"])
    opt.step()
    sched.step()


def train(method, img, txt, loop, out, device, resume=False, settings=None, negatives=None, val=None):
    """Mini-batch training of method.loss with the method's optimiser, a cosine schedule,
    a checkpoint each epoch, --resume, and a clear stop on a non-finite loss.

    loop: the loop's settings as they run (epochs, batch_size, lr, weight_decay, seed: the
    Settings' loop, infra/run.py); resume: go on from out's checkpoint when there is one
    (--resume): True, or the checkpoint resume_state has loaded.
    settings: what the run depends on besides the loop's own settings (method, hp, data,
    encoders' weights, ...); stored in the checkpoint, and a --resume under other settings
    is refused with what differs (load_checkpoint).
    negatives: (Features, index (N, M)) of --hard-negatives: hard_negative_loss joins each step.
    val: (images, captions, txt_to_img) of held-out pairs: validation figures each epoch into the history,
    and the epoch of the best val_score is the one kept (a stop on validation: the later epochs run, the
    schedule is the full --epochs', and the weights of the best epoch are restored at the end)."""
    loop = {k: loop[k] for k in ("epochs", "batch_size", "lr", "weight_decay", "seed")}   # not the threads
    epochs, batch_size, lr, wd = loop["epochs"], loop["batch_size"], loop["lr"], loop["weight_decay"]
    steps_per_epoch = len(img) // batch_size      # the last partial batch is dropped: InfoNCE wants full ones
    shapes = {f"shape.{k}": list(v.shape) for k, v in method.state_dict().items()}
    settings = {**(settings or {}), **loop, **shapes}
    params, opt, sched = optimiser(method, lr, wd, epochs * steps_per_epoch)
    start, ckpt, last = 0, Path(out) / "checkpoint.pt", None   # written each epoch
    history, best = [], None          # per-epoch figures; best: (epoch, val_score, state) of a stop on validation
    if resume is True and ckpt.exists():
        resume = load_checkpoint(ckpt, settings)
    if isinstance(resume, dict):
        state = same_settings(ckpt, resume, settings)
        method.load_state_dict(state["method"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])           # dropout continues as in an uninterrupted run
        if str(device).startswith("cuda") and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"])  # dropout of the method's device tensors draws here
        start, last = state["epoch"] + 1, state.get("loss")
        history, best = list(state.get("history", [])), state.get("best")
        print(f"[train] resumed from {ckpt} after epoch {start}")
    elif resume:
        print(f"[train] --resume: no checkpoint at {ckpt} yet; starting at epoch 1")
    step_loss, rows = method.loss, (lambda idx: idx)       # one process: the method's loss on the whole batch
    if distributed.WORLD > 1:                               # torchrun: this rank's rows, the loss over all ranks'
        dd = distributed.Training(method, batch_size, negatives is not None)
        if not dd.active:
            return {"seconds": 0.0, "final_loss": None, "history": []}  # rank 0 trains alone
        step_loss, rows = dd.loss, dd.rows
    print(f"[train] {epochs} epochs x {steps_per_epoch} steps, batch {batch_size}, {type(opt).__name__} "
          f"lr {lr:g} wd {wd:g}")
    feed = Feed(img, txt, device)                   # on the device once, or streamed: said in one line
    t0, loss = time.time(), torch.tensor(float("nan"))
    for epoch in range(start, epochs):
        method.train()
        order = epoch_order(len(img), loop["seed"], epoch)
        t_epoch = time.time()
        total = torch.zeros((), dtype=torch.float64, device=device)  # the epoch's loss, summed on the device
        sums, pending, first = {}, [], 0                             # logs' sums; losses not yet checked
        index_batches = (rows(order[step * batch_size:(step + 1) * batch_size])  # this rank's slice
                         for step in range(steps_per_epoch))
        batches = feed.batches(index_batches)
        progress = Progress(f"[train] epoch {epoch + 1}:", steps_per_epoch, "steps", every=30, first=10)
        for step, (idx, img_b, txt_b) in enumerate(batches):
            loss, logs = step_loss(img_b, txt_b)          # method.loss unless split by torchrun
            if negatives is not None:             # --hard-negatives: L = L_method + L_hn (never split)
                j = negatives[1][idx]                                           # (B, M), -1 = none
                neg = batch_to(negatives[0][j.clamp(min=0).flatten()], device)
                loss = loss + hard_negative_loss(method, img_b, txt_b, neg, (j >= 0).to(device),
                                                 contrastive_scale(method))
            update(method, loss, params, opt, sched)
            total += loss.detach()                        # queued on the device: no host sync a step
            pending.append(loss.detach())
            for k, v in logs.items():
                sums[k] = sums.get(k, 0) + v
            progress.update(1)                            # a line past 10 s into a long epoch (stderr)
            if len(pending) == FINITE_EVERY:              # the host looks every FINITE_EVERY steps ...
                stop_if_not_finite(pending, epoch, first, ckpt, epoch > start or start > 0, lr)
                pending, first = [], step + 1
        stop_if_not_finite(pending, epoch, first, ckpt, epoch > start or start > 0, lr, params)  # ... and at the
        # end, with every trained parameter: nothing non-finite is saved
        dt, n = time.time() - t_epoch, max(1, steps_per_epoch)
        terms = {k: float(v) / n for k, v in sums.items()}          # the method's logs: one host read each
        means = "".join(f"  {k} {v:.4f}" for k, v in terms.items())
        mean = total.item() / n
        print(f"[train] epoch {epoch + 1:3d}/{epochs}  loss {mean:.4f}{means}  "
              f"{steps_per_epoch / max(dt, 1e-9):.1f} steps/s  {time.time() - t0:.0f}s")
        last = round(mean, 4)  # final_loss: the epoch's mean as printed (float32 sums part below 1e-4 across CPUs)
        row = {"epoch": epoch + 1, "loss": mean, **terms,
               "lr": sched.get_last_lr()[0], "seconds": round(dt, 3)}        # lr: at the epoch's end
        if val is not None:
            row |= validate(method, val, device)
            print(f"[validation] epoch {epoch + 1:3d}  " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                                    if k.startswith("val_")))
            if best is None or row["val_score"] > best[1]:
                best = (epoch + 1, row["val_score"], {k: v.detach().clone() for k, v in method.state_dict().items()})
        history.append(row)
        if distributed.RANK == 0:
            storage.atomic_save({"method": method.state_dict(), "opt": opt.state_dict(),
                               "sched": sched.state_dict(), "epoch": epoch,
                               "rng": torch.get_rng_state(), "loss": last, "settings": settings,
                               "history": history, "best": best,
                               "cuda_rng": torch.cuda.get_rng_state() if str(device).startswith("cuda") else None},
                              ckpt)
    result = {"seconds": round(time.time() - t0, 2), "final_loss": last, "history": history}  # resumed: as saved
    if best is not None:                  # the stop on validation: the best epoch's weights, said with its figures
        method.load_state_dict(best[2])
        print(f"[choice] epochs chosen on held-out alignment pairs (no test pair read): {best[0]} of {epochs}, "
              f"the best val_score {best[1]:.2f} (val_score per epoch above)")
        result["chosen"] = {"epochs": best[0]}
    return result
