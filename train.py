"""Training: the one training loop every method trains in, and the --resume checkpoint it continues.

fit_or_train runs a method's closed-form fit or train, the mini-batch loop with the method's
optimiser, a cosine schedule, a checkpoint each epoch, --resume, and a clear stop on a non-finite
loss. The loop's settings (epochs, batch, lr, ...) come resolved from infra/run.py.
"""
import time
from pathlib import Path

import torch

from features import Features
from infra import distributed, loader, storage
from infra.errors import RunError
from negatives import contrastive_scale, hard_negative_loss


def resume_state(settings):
    """The checkpoint --resume continues, loaded here once, before the features, and compared on the
    run's identity (settings.identity: settings, code, encoders, data; train compares the rest: epochs,
    batch, the weights' shapes); else False, or True for --resume before a first checkpoint."""
    ckpt = settings.out / "checkpoint.pt"
    if not (settings.args.resume and ckpt.exists()):
        return settings.args.resume
    return load_checkpoint(ckpt, settings.identity)


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
# The one training loop
# ---------------------------------------------------------------------------
def fit_or_train(method, img, txt, loop, out, device, resume=False, settings=None, negatives=None):
    """A closed-form fit, or the training loop; {"seconds", "final_loss"} (the last epoch's mean loss, as printed)."""
    t0, result = time.time(), {"seconds": 0.0, "final_loss": None}
    if method.fit is not None:  # closed forms are global: pooled vectors, never a whole token cache
        if distributed.world() > 1 and method.loss is None and not distributed.end_group():
            return result                   # torchrun: rank 0 fits alone, the others leave before the fit
        if distributed.rank() == 0:
            vectors = lambda f: Features.from_vectors(f.pooled).to(device)
            method.fit(vectors(img), vectors(txt))
        distributed.broadcast_state(method)
        result = {"seconds": round(time.time() - t0, 2), "final_loss": None}
    if method.loss is not None:
        try:
            result = train(method, img, txt, loop, out, device, resume, settings, negatives)
        except FloatingPointError as e:
            raise RunError(str(e)) from None
        except torch.OutOfMemoryError:      # the device's memory is the boundary: said once, the checkpoint kept
            raise RunError(f"out of memory on {device} in a step of {loop['batch_size']} pairs; pass --batch-size "
                           f"{max(2, loop['batch_size'] // 2)} (or smaller --hp values), then rerun with --resume "
                           f"(the cached features and every finished epoch are kept)") from None
    return result


FINITE_EVERY = 50  # steps between the host's looks at the loss (on a GPU each is a sync), and each epoch's end


def stop_if_not_finite(losses, epoch, first, ckpt, saved, lr, params=()):
    """Raise FloatingPointError at the first non-finite loss of losses (steps first + 1, first + 2, ...),
    or, when every loss is finite, at a non-finite trained parameter (a finite loss whose gradient was
    not: the step wrote NaN into the weights), with where it happened and what to do; one host sync.
    Steps after it have run, on NaN weights, but no checkpoint was written since: the run stops before
    its epoch's checkpoint, metrics or method.pt."""
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


def train(method, img, txt, loop, out, device, resume=False, settings=None, negatives=None):
    """Mini-batch training of method.loss with the method's optimiser, a cosine schedule,
    a checkpoint each epoch, --resume, and a clear stop on a non-finite loss.

    loop: the loop's settings as they run (epochs, batch_size, lr, weight_decay, seed: the
    Settings' loop, infra/run.py); resume: go on from out's checkpoint when there is one
    (--resume): True, or the checkpoint resume_state has loaded.
    settings: what the run depends on besides the loop's own settings (method, hp, data,
    encoders' weights, ...); stored in the checkpoint, and a --resume under other settings
    is refused with what differs (load_checkpoint).
    negatives: (Features, index (N, M)) of --hard-negatives: hard_negative_loss joins each step."""
    d = method.defaults
    loop = {k: loop[k] for k in ("epochs", "batch_size", "lr", "weight_decay", "seed")}   # not the threads
    epochs, batch_size, lr, wd = loop["epochs"], loop["batch_size"], loop["lr"], loop["weight_decay"]
    steps_per_epoch = len(img) // batch_size      # the last partial batch is dropped: InfoNCE wants full ones
    shapes = {f"shape.{k}": list(v.shape) for k, v in method.state_dict().items()}
    settings = {**(settings or {}), **loop, **shapes}
    opt_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[d.get("optimizer", "adamw")]
    params = [p for p in method.parameters() if p.requires_grad]
    opt = opt_cls(params, lr=lr, weight_decay=wd, betas=d.get("betas", (0.9, 0.999)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * steps_per_epoch))
    start, ckpt, last = 0, Path(out) / "checkpoint.pt", None   # written each epoch
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
        print(f"[train] resumed from {ckpt} after epoch {start}")
    elif resume:
        print(f"[train] --resume: no checkpoint at {ckpt} yet; starting at epoch 1")
    dd = distributed.Training(method, batch_size, negatives is not None)  # torchrun: rows, the loss
    if not dd.active:
        return {"seconds": 0.0, "final_loss": None}                     # rank 0 trains alone
    print(f"[train] {epochs} epochs x {steps_per_epoch} steps, batch {batch_size}, {opt_cls.__name__} "
          f"lr {lr:g} wd {wd:g}")
    feed = loader.Feed(img, txt, device)                   # on the device once, or streamed: said in one line
    t0, loss = time.time(), torch.tensor(float("nan"))
    for epoch in range(start, epochs):
        method.train()
        g = torch.Generator().manual_seed(loop["seed"] * 100003 + epoch)  # the order: (seed, epoch) only
        order = torch.randperm(len(img), generator=g)
        t_epoch = time.time()
        total = torch.zeros((), dtype=torch.float64, device=device)  # the epoch's loss, summed on the device
        sums, pending, first = {}, [], 0                             # logs' sums; losses not yet checked
        index_batches = (dd.rows(order[step * batch_size:(step + 1) * batch_size])  # this rank's slice
                         for step in range(steps_per_epoch))
        batches = feed.batches(index_batches)
        for step, (idx, img_b, txt_b) in enumerate(batches):
            loss, logs = dd.loss(img_b, txt_b)            # method.loss unless split by torchrun
            if negatives is not None:             # --hard-negatives: L = L_method + L_hn (never split)
                j = negatives[1][idx]                                           # (B, M), -1 = none
                neg = loader.batch_to(negatives[0][j.clamp(min=0).flatten()], device)
                loss = loss + hard_negative_loss(method, img_b, txt_b, neg, (j >= 0).to(device),
                                                 contrastive_scale(method))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if d.get("grad_clip"):
                torch.nn.utils.clip_grad_norm_(params, d["grad_clip"])
            opt.step()
            sched.step()
            total += loss.detach()                        # queued on the device: no host sync a step
            pending.append(loss.detach())
            for k, v in logs.items():
                sums[k] = sums.get(k, 0) + v
            if len(pending) == FINITE_EVERY:              # the host looks every FINITE_EVERY steps ...
                stop_if_not_finite(pending, epoch, first, ckpt, epoch > start or start > 0, lr)
                pending, first = [], step + 1
        stop_if_not_finite(pending, epoch, first, ckpt, epoch > start or start > 0, lr, params)  # ... and at the
        # end, with every trained parameter: nothing non-finite is saved
        dt, n = time.time() - t_epoch, max(1, steps_per_epoch)
        means = "".join(f"  {k} {float(v) / n:.4f}" for k, v in sums.items())
        mean = total.item() / n
        print(f"[train] epoch {epoch + 1:3d}/{epochs}  loss {mean:.4f}{means}  "
              f"{steps_per_epoch / max(dt, 1e-9):.1f} steps/s  {time.time() - t0:.0f}s")
        last = round(mean, 4)  # final_loss: the epoch's mean as printed (float32 sums part below 1e-4 across CPUs)
        if distributed.rank() == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            storage.atomic_save({"method": method.state_dict(), "opt": opt.state_dict(),
                               "sched": sched.state_dict(), "epoch": epoch,
                               "rng": torch.get_rng_state(), "loss": last, "settings": settings,
                               "cuda_rng": torch.cuda.get_rng_state() if str(device).startswith("cuda") else None},
                              ckpt)
    return {"seconds": round(time.time() - t0, 2), "final_loss": last}  # resumed when done: as saved
