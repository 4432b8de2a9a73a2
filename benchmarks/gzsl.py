"""Generalized zero-shot classification on the Shapes world: seen top-1, novel top-1 and their harmonic mean H,
plain and with calibrated stacking (Chao, Changpinyo, Gong, Sha, "An empirical study and analysis of generalized
zero-shot learning for object recognition in the wild", ECCV 2016, §3.2), its gamma chosen on the training pairs.

    python benchmarks/gzsl.py --threads 1                          # the tiny encoders, linear, pal and csa
    python benchmarks/gzsl.py --image-encoder efficientnet-lite2 --text-encoder minilm --cache-dir CACHE

The split is benchmarks/novel_classes.py's checkerboard of the 24 colour-shape classes: 12 seen, 12 novel. Each
method aligns on the training pairs whose captions name seen classes only; their vocabulary (written and read
as a run's vocabulary.json) must tell exactly the 12 seen names from the 12 novel ones (aligned.seen_names),
or the benchmark stops. Scored: the `cls` test images (single objects, all 24 classes), each ranked among all
24 names (aligned.gzsl_top1: per-class mean top-1 of each side, H = 2 S U / (S + U)).

Gamma is chosen on the training pairs alone (aligned.choose_gamma), never on the test images:
  1. the 12 seen classes are dealt into FOLDS folds (every FOLDS-th of them); in each, the fold's classes are
     pseudo-novel and the rest seen';
  2. a fixed quarter of the training images whose caption names one seen class is held out of every fit;
  3. the method aligns on the other training pairs whose captions name seen' classes only, at the same
     schedule, and scores the held-out single-class images of seen' and of the pseudo-novel classes (the
     latter were never in the fit) among the 12 seen names; choose_gamma picks the gamma of the best H;
  4. the gamma used is the mean over the folds, applied to the method aligned on every seen training pair.

Deviations / choices: gamma is chosen per method in this benchmark, not at train time in align.py (FOLDS + 1
fits of every run would be the cost); classify takes it as --calibrate GAMMA. Steps 1-4 are calibration.choose,
which `python align.py calibrate RUN --classes ...` runs on a finished run's own training pairs (there every
pair the run aligned on may enter a fold's fit; here those naming seen classes only). The fold models see fewer
classes than the final one, so their scores' scale only approximates its; the gamma is carried over as is.
The loop is calibration.train (align.py's: the method's optimizer, cosine, seeded batch order) without
checkpoints.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from novel_classes import classes_of, is_novel  # noqa: E402

import align  # noqa: E402
import aligned  # noqa: E402
import calibration  # noqa: E402
import shapes  # noqa: E402
from infra import folder  # noqa: E402
from methods import METHODS  # noqa: E402

FOLDS = calibration.FOLDS          # pseudo-novel folds of the seen classes (4 classes each)
HELD_OUT = calibration.HELD_OUT    # share of the single-class seen training images kept out of every fit


class_scores = calibration.class_scores    # (N, C) zero-shot scores (evaluate.py's path)


def prompt_rows(classes, n_templates):
    """The rows of the class-major prompt features of the given classes (their templates in order)."""
    return torch.tensor([c * n_templates + t for c in classes for t in range(n_templates)])


def fitted(name, img, txt, epochs, seed):
    """The method aligned on (img, txt) at align.py's loop, seeded, its own keywords and loop settings."""
    return calibration.fitted(METHODS[name], {}, img, txt, seed, epochs)


def ridge(method):
    """ " (ridge R)" of a method that chose one on its own held-out pairs (CSA's "auto"), else ""."""
    return f" (ridge {method.chosen_ridge:g})" if getattr(method, "chosen_ridge", None) is not None else ""


def choose(name, F, rows, labels, seen_classes, epochs, seed, log):
    """Gamma on the training pairs (the docstring's steps 1-4; calibration.choose, as `align.py calibrate`): the
    mean over the folds of each fold's choice. labels: each pair's classes; the pairs any fit may hold are those
    naming seen classes only."""
    seen = set(seen_classes)
    named = [{seen_classes.index(k) for k in c if k in seen} for c in labels]
    usable = torch.tensor([bool(c) and c <= seen for c in labels])
    n_t = len(shapes.TEMPLATES)
    gamma, _ = calibration.choose(lambda img, txt: fitted(name, img, txt, epochs, seed), F["train", "image"],
                                  F["train", "text"], rows, named, F["cls", "text"][prompt_rows(seen_classes, n_t)],
                                  n_t, [shapes.CLASS_NAMES[k] for k in seen_classes], usable, FOLDS, HELD_OUT, seed,
                                  log, tag=lambda method: f"{name}{ridge(method)} ")
    return gamma


def seen_by_vocabulary(captions):
    """aligned.seen_names of the 24 class names under the vocabulary of captions, as a run writes and reads it."""
    with tempfile.TemporaryDirectory() as tmp:
        folder.write_vocabulary(captions, Path(tmp) / aligned.VOCABULARY)
        return aligned.seen_names(shapes.CLASS_NAMES, aligned.read_vocabulary(tmp))


def features(image_encoder, text_encoder, cache_dir, threads=1):
    """({(split, kind): fp32 Features} of the training pairs and the cls set (its images and prompts), the
    training PairSet, the cls LabelSet): align.py's features, read from cache_dir (extracted there when missing)."""
    run = align.parse_args(["--image-encoder", image_encoder, "--text-encoder", text_encoder, "--cache-dir",
                            str(cache_dir), "--threads", str(threads)])
    inputs = align.load_inputs(run, "cpu")
    sets = {k: inputs.sets[k] for k in ("train", "cls")}
    align.extract_features(run, inputs, "cpu", sets)
    return {k: v.to("cpu") for k, v in inputs.features.items() if k[0] in sets}, sets["train"], sets["cls"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-encoder", default="shapes-cnn", help="as align.py's")
    p.add_argument("--text-encoder", default="shapes-text", help="as align.py's")
    p.add_argument("--cache-dir", default=".cache", help="align.py's encoder and feature cache")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the methods' init, batch order and held-out images")
    p.add_argument("--methods", nargs="+", default=["linear", "pal", "csa"], choices=sorted(METHODS))
    p.add_argument("--epochs", type=int, default=None, help="epochs of every fit, the folds' and the final one "
                   "(default: each method's own, methods/)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    F, train_set, cls = features(args.image_encoder, args.text_encoder, args.cache_dir, args.threads)
    labels = [classes_of(c) for c in train_set.captions]                        # each caption's classes
    seen_classes = [k for k in range(len(shapes.CLASS_NAMES)) if not is_novel(k)]
    seen = torch.tensor([not is_novel(k) for k in range(len(shapes.CLASS_NAMES))])
    only_seen = torch.tensor([bool(c) and all(not is_novel(k) for k in c) for c in labels])
    by_words = seen_by_vocabulary([c for c, s in zip(train_set.captions, only_seen.tolist()) if s])
    if not torch.equal(by_words, seen):
        raise SystemExit(f"the seen captions' vocabulary tells {by_words.tolist()} from novel, not the split")
    rows = train_set.txt_to_img
    fit = only_seen.nonzero().squeeze(1)
    n_t = len(cls.templates)
    print(f"[split] 12 seen / 12 novel classes (the seen captions' vocabulary agrees); {len(fit)} training pairs "
          f"of seen classes (of {len(rows)}); {len(cls.labels)} test images ({int(seen[cls.labels].sum())} seen); "
          f"{args.epochs or 'default'} epochs; {args.image_encoder} + {args.text_encoder}", flush=True)
    table = []
    for name in args.methods:
        t0 = time.time()
        gamma = choose(name, F, rows, labels, seen_classes, args.epochs, args.seed, print)
        method = fitted(name, F["train", "image"][rows[fit]], F["train", "text"][fit], args.epochs, args.seed)
        S = class_scores(method, F["cls", "image"], F["cls", "text"], n_t)
        plain = aligned.gzsl_top1(S, cls.labels, seen)
        calibrated = aligned.gzsl_top1(aligned.calibrated_stacking(S, seen, gamma), cls.labels, seen)
        table.append(dict(method=name, gamma=gamma, plain=plain, calibrated=calibrated,
                          seconds=round(time.time() - t0)))
        print(f"  [{name}{ridge(method)}] plain S/U/H {plain[0]:.1f}/{plain[1]:.1f}/{plain[2]:.1f}, gamma {gamma:.4f}: "
              f"{calibrated[0]:.1f}/{calibrated[1]:.1f}/{calibrated[2]:.1f} ({time.time() - t0:.0f}s)", flush=True)
    print("\n| method | seen top-1 | novel top-1 | H | gamma | calibrated seen | calibrated novel | calibrated H |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        (s, u, h), (cs, cu, ch) = r["plain"], r["calibrated"]
        print(f"| {r['method']} | {s:.1f} | {u:.1f} | {h:.1f} | {r['gamma']:.4f} | {cs:.1f} | {cu:.1f} | {ch:.1f} |")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
