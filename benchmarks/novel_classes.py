"""Retrieval on object classes the alignment never saw: CSA's ridge and SAIL's schedule, scored on the TEST
images of each half (a report; the defaults are chosen on held-out training pairs by
benchmarks/select_defaults.py, never here).

    python benchmarks/novel_classes.py --image-encoder efficientnet-lite2 --text-encoder minilm
    python benchmarks/novel_classes.py --sail-epochs 5 20 100      # the tiny encoders, other schedules

The Shapes world's 24 object classes (colour x shape, shapes.CLASS_NAMES) are split in two halves
by a checkerboard, (colour index + shape index) even = seen, odd = novel, so every colour and every
shape is in both halves and only the combinations are new. A caption's classes are the colour-shape
phrases it names (every caption names all objects of its scene). The methods align on the training
pairs whose objects are all of seen classes; retrieval is scored on the test images (5 captions each)
whose objects are all seen, and on those whose objects are all novel. The features are align.py's
(read from --cache-dir, extracted there when missing); the loop is align.py's (calibration.train: the
method's optimizer, a cosine schedule over all steps, the batch order seeded by (seed, epoch), the last
partial batch dropped), without its checkpoints. Prints one row per setting: the chosen ridge or the steps, seen and novel RSum.
"""
import argparse
import inspect
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import align  # noqa: E402
import evaluate  # noqa: E402
import shapes  # noqa: E402
from calibration import train  # noqa: E402,F401  (align.py's loop, shared with calibrate)
from features import Features  # noqa: E402
from methods import METHODS  # noqa: E402

PHRASE = re.compile(r"\b(" + "|".join(shapes.COLOUR_NAMES) + r") (" + "|".join(shapes.SHAPES) + r")\b")


def classes_of(caption):
    """The colour-shape classes (indices into shapes.CLASS_NAMES) a caption names."""
    return {shapes.CLASS_NAMES.index(f"{c} {s}") for c, s in PHRASE.findall(caption)}


def is_novel(k):
    """The checkerboard split of the 24 classes: (colour index + shape index) odd."""
    return (k // len(shapes.SHAPES) + k % len(shapes.SHAPES)) % 2 == 1


def side(caption):
    """'seen' / 'novel' when every class the caption names is on that side, else None (mixed)."""
    novel = {is_novel(k) for k in classes_of(caption)}
    return {frozenset([False]): "seen", frozenset([True]): "novel"}.get(frozenset(novel))


def retrieval_subset(method, img, txt, test, which):
    """RSum on the test images of one side (each image's side from its first caption) and their captions."""
    first = [int((test.txt_to_img == i).nonzero()[0]) for i in range(len(img))]
    keep = torch.tensor([side(test.captions[j]) == which for j in first])           # (N_img,) images kept
    new_index = torch.cumsum(keep.long(), 0) - 1                                    # old image -> new image
    caps = keep[test.txt_to_img]                                                    # (N_txt,) captions kept
    m = evaluate.retrieval(method, img[keep.nonzero().squeeze(1)], txt[caps.nonzero().squeeze(1)],
                           new_index[test.txt_to_img[caps]])
    return m["rsum"], int(keep.sum())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-encoder", default="shapes-cnn", help="as align.py's")
    p.add_argument("--text-encoder", default="shapes-text", help="as align.py's")
    p.add_argument("--cache-dir", default=".cache", help="align.py's encoder and feature cache")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0, help="seed of SAIL's init and batch order")
    p.add_argument("--csa-ridges", nargs="*", type=float, default=[1e-2, 1.0, 10.0],
                   help="fixed ridges to show next to ridge='auto'")
    p.add_argument("--sail-epochs", nargs="*", type=int, default=[100, 20, 10, 5],
                   help="SAIL schedules to run (epochs at its batch and lr)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    run = align.parse_args(["--image-encoder", args.image_encoder, "--text-encoder", args.text_encoder,
                            "--cache-dir", args.cache_dir, "--threads", str(args.threads)])
    inputs = align.load_inputs(run, "cpu")
    align.extract_features(run, inputs, "cpu", inputs.sets)
    F = inputs.features
    train_set, test = inputs.sets["train"], inputs.sets["test"]
    seen_rows = torch.tensor([j for j, c in enumerate(train_set.captions) if side(c) == "seen"])
    vec = lambda f, rows=None: Features.from_vectors((f.pooled if rows is None else f.pooled[rows]).float())
    img, txt = vec(F["train", "image"], train_set.txt_to_img[seen_rows]), vec(F["train", "text"], seen_rows)
    test_img, test_txt = vec(F["test", "image"]), vec(F["test", "text"])
    print(f"[split] 12 seen / 12 novel classes; {len(seen_rows)} training pairs of seen classes "
          f"(of {len(train_set.captions)})")
    print(f"{'method':<8}{'setting':<28}{'seen RSum':>10}{'novel RSum':>11}{'seconds':>9}")

    def row(name, setting, method, t0):
        (s, n_s), (n, n_n) = (retrieval_subset(method, test_img, test_txt, test, w) for w in ("seen", "novel"))
        print(f"{name:<8}{setting:<28}{s:10.1f}{n:11.1f}{time.time() - t0:9.0f}   "
              f"({n_s} seen / {n_n} novel test images)", flush=True)

    D_v, D_l = img.pooled.shape[1], txt.pooled.shape[1]
    default_ridge = inspect.signature(METHODS["csa"]).parameters["ridge"].default
    for ridge in ("auto", default_ridge):
        t0 = time.time()
        csa = METHODS["csa"](D_v, D_l, ridge=ridge).fit(img, txt)
        row("csa", f"{ridge} ({csa.chosen_ridge:g}{', the default' if ridge == default_ridge else ''})", csa, t0)
    for r in args.csa_ridges:
        t0 = time.time()
        row("csa", f"ridge={r:g}", METHODS["csa"](D_v, D_l, ridge=r).fit(img, txt), t0)
    for epochs in args.sail_epochs:
        t0 = time.time()
        torch.manual_seed(args.seed)
        sail = METHODS["sail"](D_v, D_l)
        steps = train(sail, img, txt, epochs, min(sail.defaults["batch_size"], len(img)), args.seed)
        row("sail", f"{epochs} epochs ({steps} steps)", sail, t0)


if __name__ == "__main__":
    main()
