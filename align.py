"""The one entry point: data -> frozen features -> method -> evaluation -> results.

    python align.py                          # PAL on the built-in Shapes world (CPU, no network)
    python align.py --method cov --data coco --data-root /data/coco --device cuda

Writes <out>/config.json (resolved arguments), <out>/metrics.json, <out>/method.pt
(the method's state_dict), <out>/checkpoint.pt (each epoch, for --resume) and
figures (PNG) of methods that draw them.
"""
import argparse
import ast
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
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the method's init and batch order")
    p.add_argument("--image-encoder", default="shapes-cnn",
                   help="image encoder name or local path (built in: shapes-cnn; shapes-cnn-pos, its tokens with a 2D position code)")
    p.add_argument("--text-encoder", default="shapes-text", help="text encoder name or local path")
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


def parse_hp(method_cls, items):
    """--hp NAME=VALUE pairs -> kwargs, checked against the method's __init__ signature."""
    allowed = [n for n in inspect.signature(method_cls.__init__).parameters if n not in ("self", "d_image", "d_text")]
    hp = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in allowed:
            sys.exit(f"error: --hp {item!r}: {method_cls.__name__} takes NAME=VALUE with NAME one of {allowed}")
        try:
            hp[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            hp[name] = value  # a bare word, e.g. pooling=mean
    return hp


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
    sets = data.DATASETS[args.data](**({"root": args.data_root} if args.data != "shapes" else {}))
    image_enc, text_enc = encoders.load_encoders(args.image_encoder, args.text_encoder, args.cache_dir,
                                                 args.image_layer, args.text_layer)
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


def loss_and_embeddings(method, img, txt):
    """method.loss(img, txt), plus the embeddings it made through embed_image / embed_text (None where it
    did not call each exactly once, e.g. CoV): the hard-negative term reuses them instead of recomputing."""
    seen = {"embed_image": [], "embed_text": []}

    def spy(name, fn):
        def call(x):
            seen[name].append(fn(x))
            return seen[name][-1]
        return call
    method.embed_image, method.embed_text = spy("embed_image", method.embed_image), spy("embed_text", method.embed_text)
    try:
        loss, logs = method.loss(img, txt)
    finally:
        del method.embed_image, method.embed_text         # the class's own methods again
    one = lambda xs: xs[0] if len(xs) == 1 else None
    return loss, logs, one(seen["embed_image"]), one(seen["embed_text"])


def hard_negative_loss(method, img, txt, neg, has_neg, scale, v=None, t=None):
    """NegCLIP's image -> text term, computed only through the method's interface:

        L_hn = -1/B sum_i log softmax_j( scale * [s(i, t_1), ..., s(i, t_B), s(i, n_i1), ..., s(i, n_iM)] )_i

    s = method.score, t_j the batch's captions, n_im caption i's swaps. img, txt: B pairs;
    neg: Features (B*M,), row i*M + m = swap m of caption i; has_neg: (B, M) bool (False = no swap).
    v, t: the batch's image / text embeddings when already computed (loss_and_embeddings)."""
    score = inspect.unwrap(type(method).score)  # CoV marks score() no_grad (inference); the same function, with gradients
    B, M = has_neg.shape
    v = method.embed_image(img) if v is None else v
    S = score(method, v, method.embed_text(txt) if t is None else t)                # (B, B)
    real = has_neg.flatten().nonzero().squeeze(1)                                   # (N_real,) only real swaps are encoded
    S_neg = score(method, v, method.embed_text(neg[real])) if len(real) else S[:, :0]  # (B, N_real)
    own = S.new_full((B * M,), float("-inf"))                                       # -inf: no swap
    own[real] = S_neg[real // M, torch.arange(len(real), device=S.device)]          # s(i, n_im), i = row // M
    logits = torch.cat([S, own.view(B, M)], 1) * scale                              # (B, B + M)
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
def train(method, img, txt, args, out, device, negatives=None):
    """Mini-batch training of method.loss with the method's optimiser, a cosine schedule,
    a checkpoint each epoch, --resume, and a clear stop on a non-finite loss.
    negatives: (Features, index (N, M)) of --hard-negatives: adds hard_negative_loss to each step."""
    d = dict(method.defaults)
    epochs = args.epochs if args.epochs is not None else d["epochs"]
    batch_size = min(args.batch_size or d["batch_size"], len(img))
    lr = args.lr if args.lr is not None else d["lr"]
    wd = args.weight_decay if args.weight_decay is not None else d.get("weight_decay", 0.0)
    opt_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[d.get("optimizer", "adamw")]
    params = [p for p in method.parameters() if p.requires_grad]
    opt = opt_cls(params, lr=lr, weight_decay=wd, betas=d.get("betas", (0.9, 0.999)))
    steps_per_epoch = len(img) // batch_size  # drop the last partial batch: InfoNCE wants full batches
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * steps_per_epoch))
    start, ckpt = 0, out / "checkpoint.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        method.load_state_dict(state["method"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
        print(f"[train] resumed from {ckpt} after epoch {start}")
    print(f"[train] {epochs} epochs x {steps_per_epoch} steps, batch {batch_size}, {opt_cls.__name__} lr {lr:g} wd {wd:g}")
    t0, loss = time.time(), torch.tensor(float("nan"))
    for epoch in range(start, epochs):
        method.train()
        g = torch.Generator().manual_seed(args.seed * 100003 + epoch)  # batch order depends only on (seed, epoch)
        order = torch.randperm(len(img), generator=g)
        t_epoch, total = time.time(), 0.0
        for step in range(steps_per_epoch):
            idx = order[step * batch_size:(step + 1) * batch_size]
            if negatives is None:
                loss, logs = method.loss(img[idx].to(device), txt[idx].to(device))
            else:                                         # --hard-negatives: L = L_method + L_hn
                img_b, txt_b = img[idx].to(device), txt[idx].to(device)
                loss, logs, v, t = loss_and_embeddings(method, img_b, txt_b)
                j = negatives[1][idx]                                                   # (B, M), -1 = none
                loss = loss + hard_negative_loss(method, img_b, txt_b, negatives[0][j.clamp(min=0).flatten()].to(device),
                                                 (j >= 0).to(device), contrastive_scale(method), v, t)
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
        features.atomic_save({"method": method.state_dict(), "opt": opt.state_dict(),
                              "sched": sched.state_dict(), "epoch": epoch}, ckpt)
    return {"seconds": round(time.time() - t0, 2), "final_loss": float(loss.item()) if epochs > start else None}


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
            metrics["binding"] = evaluate.binding(method, img[:n], txt[:n], {k: F[split, k][:n] for k in s.distractors},
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


def main(argv=None):
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch sees no CUDA GPU here; use --device cpu (or auto)")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or f"results/{args.method}-{args.data}-seed{args.seed}")
    out.mkdir(parents=True, exist_ok=True)
    method_cls = METHODS[args.method]
    hp = parse_hp(method_cls, args.hp)
    config = dict(vars(args), device=device, hp=hp, out=str(out), method_defaults=method_cls.defaults)
    print("[config] " + json.dumps(config, default=str))
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))

    if args.hard_negatives and (args.align_data != "pairs" or not hasattr(method_cls, "loss")
                                or not any(hasattr(method_cls(4, 4), a) for a in ("tau", "tau_g", "log_t"))):
        sys.exit(f"error: --hard-negatives needs a contrastive trained method (one with a temperature) and "
                 f"--align-data pairs; {args.method} with --align-data {args.align_data} is not one")
    F = load_features(args, device)
    img, txt = alignment_data(args, F)
    seed_everything(args.seed)
    method = method_cls(F["train", "image"].pooled.shape[-1], F["train", "text"].pooled.shape[-1], **hp).to(device)
    print(f"[method] {args.method}: {sum(p.numel() for p in method.parameters() if p.requires_grad):,} trainable parameters, "
          f"{len(img)} alignment pairs ({args.align_data})")
    metrics = {"train": {"seconds": 0.0, "final_loss": None}}
    t0 = time.time()
    if hasattr(method, "fit"):  # closed-form methods are global: pass pooled vectors, never a whole token cache
        method.fit(Features.from_vectors(img.pooled).to(device), Features.from_vectors(txt.pooled).to(device))
        metrics["train"] = {"seconds": round(time.time() - t0, 2), "final_loss": None}
    if hasattr(method, "loss"):
        try:
            metrics["train"] = train(method, img, txt, args, out, device, F.get(("train", "negatives")))
        except FloatingPointError as e:
            sys.exit(f"error: {e}")
    torch.save(method.state_dict(), out / "method.pt")
    metrics.update(evaluate_all(method, F, args, out, device))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))  # saved before anything else can fail
    print(evaluate.results_table(metrics))
    if args.analyses:
        metrics["recycling"] = recycling_analyses(F, args, device)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"[done] results in {out}/")
    return metrics


def recycling_analyses(F, args, device):
    """The weight-recycling paper's analyses of the image encoder's head (Table 1, Fig. 1, App. I, Table 2).

    The Shapes head classifies PATCHES, so its features are the object patches of the
    classification set (more than half covered by the object) with the image's label;
    even images give the train half, odd images the held-out half. The few-shot
    "ours" column is methods/mlp.py aligned on the head rows alone, then fine-tuned.
    """
    import recycling
    from methods.mlp import MLP
    W, b, names = F["image_encoder"].head()
    s, img = F["sets"]["cls"], F["cls", "image"]
    H, Wg = img.grid
    cover = torch.nn.functional.adaptive_avg_pool2d((s.masks != data.IGNORE).float()[:, None], (H, Wg))
    is_obj = cover.flatten(1) > 0.5                                       # (N, H*W)
    patches = img.patches().float()                                       # (N, H*W, D)
    even = torch.arange(len(s.labels))[:, None].expand_as(is_obj) % 2 == 0
    labels = s.labels[:, None].expand_as(is_obj)
    pick = lambda sel: (patches[is_obj & sel], labels[is_obj & sel])
    (f_train, y_train), (f_test, y_test) = pick(even), pick(~even)
    names_txt = class_name_features(F, names, args)
    w_img, w_txt = recycling.weight_pairs(W, names_txt)
    mlp = MLP(W.shape[1], names_txt.tokens.shape[-1])
    opt = torch.optim.Adam(mlp.parameters(), lr=MLP.defaults["lr"])
    for _ in range(MLP.defaults["epochs"]):                               # one full batch = one epoch
        loss, _ = mlp.loss(w_img, w_txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    mlp.eval()
    aligned = lambda sf, sl: recycling.finetune_mlp_classifier(mlp, names_txt, sf, sl)
    result = recycling.run_analyses(W, b, names, f_train, y_train, f_test, y_test, names_txt.pooled.float(),
                                    aligned_classifier=aligned)
    print(recycling.analyses_table(result))
    return result


if __name__ == "__main__":
    main()
