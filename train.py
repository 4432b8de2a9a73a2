"""Training: the one training loop every method trains in, and the --resume checkpoint it continues.

fit_or_train runs a method's closed-form fit or train, the mini-batch loop with the method's
optimiser, a cosine schedule, a checkpoint each epoch, --resume, and a clear stop on a non-finite
loss. The loop's settings (epochs, batch, lr, ...) come resolved from infra/run.py.
"""
import json
import os
import time
from pathlib import Path

# MKL's strict conditional numerical reproducibility: its matrix products add in the same order at any thread
# count (2 threads split the K of a weight gradient's (D, B*N) x (B*N, K) product otherwise, and a CPU run's
# metrics moved with --threads: tests/test_threads.py). Read at MKL's first call, so set before any work.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402

import evaluate  # noqa: E402
from features import Features  # noqa: E402
from infra import distributed, loader, storage  # noqa: E402
from infra.errors import RunError  # noqa: E402
from methods.csa import image_ids  # noqa: E402
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
            reads = {"patches": img} if method.fit_reads_patches else {}  # held-out images only
            method.fit(vectors(img), vectors(txt), **reads)
        distributed.broadcast_state(method)
        result = {"seconds": round(time.time() - t0, 2), "final_loss": None}
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
    if distributed.rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
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
        history, best = state.get("history", []), state.get("best")
        print(f"[train] resumed from {ckpt} after epoch {start}")
    elif resume:
        print(f"[train] --resume: no checkpoint at {ckpt} yet; starting at epoch 1")
    dd = distributed.Training(method, batch_size, negatives is not None)  # torchrun: rows, the loss
    if not dd.active:
        return {"seconds": 0.0, "final_loss": None, "history": []}      # rank 0 trains alone
    print(f"[train] {epochs} epochs x {steps_per_epoch} steps, batch {batch_size}, {opt_cls.__name__} "
          f"lr {lr:g} wd {wd:g}")
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
        batches = loader.batch_loader(img, txt, index_batches, device)
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
        row = {"epoch": epoch + 1, "loss": last, "lr": opt.param_groups[0]["lr"], "seconds": round(dt, 2)}
        if val is not None:
            row |= validate(method, val, device)
            print(f"[validation] epoch {epoch + 1:3d}  " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()
                                                                    if k.startswith("val_")))
            if best is None or row["val_score"] > best[1]:
                best = (epoch + 1, row["val_score"], {k: v.detach().clone() for k, v in method.state_dict().items()})
        history.append(row)
        if distributed.rank() == 0:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
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
