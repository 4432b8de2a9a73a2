"""Choose calibrated stacking's gamma on training pairs, names held out as if novel: the one implementation that
`python align.py calibrate RUN --classes ...` and benchmarks/gzsl.py share.

    import calibration
    named = calibration.named_in(captions, names)          # each caption's names (indices into names)
    gamma, folds = calibration.choose(fit, img, txt, rows, named, prompts, n_templates, names)

Calibrated stacking (Chao, Changpinyo, Gong, Sha, "An empirical study and analysis of generalized zero-shot
learning for object recognition in the wild", ECCV 2016, §3.2) subtracts gamma from the scores of the names the
training captions held (aligned.calibrated_stacking). Gamma is chosen on the training pairs alone, never on a
test set (choose):
  1. the K seen names are dealt into FOLDS folds (every FOLDS-th of them); in each, the fold's names are
     pseudo-novel and the rest seen';
  2. an image is labelled when its captions name exactly one of the K names (an image naming none or several is
     not scored); a fixed share HELD_OUT of the labelled images is held out of every fit (drawn once, seeded);
  3. the method is fitted again (fit(img, txt): the run's class, keywords and loop) on the pairs whose image
     is not held out and whose captions name none of the fold's pseudo-novel names, and scores the held-out
     labelled images of seen' and every labelled image of the pseudo-novel names (never in the fit) among the
     K names; aligned.choose_gamma picks the gamma of the best H;
  4. gamma is the mean over the folds.

Deviations / choices:
1. A caption names a name when the name's words (lower-cased, infra/folder.WORDS) occur in it one after the
   other: vocabulary.json's rule (aligned.seen_names), so a name the captions never held labels no image. On
   the Shapes world this is benchmarks/novel_classes.classes_of's colour-shape phrase (tests/test_calibrate.py).
2. The loop of a trained method is align.py's on its features (the method's optimizer, betas and grad_clip, a
   cosine schedule over all steps, the batch order seeded by (seed, epoch), the last partial batch dropped), at
   the run's epochs, batch, lr and weight decay, without checkpoints, hard negatives or a stop on validation; a
   closed-form method fits on pooled vectors (train.fit_or_train's rule). The fold models see fewer names than
   the run's, so their scores' scale only approximates the run's; the gamma is carried over as is.
3. Pairs and images: held-out images and pseudo-novel images leave the fit with every one of their captions;
   an image is scored once (its first pair), so several captions of one image weigh as one.
"""
import torch

from features import Features
from infra.folder import WORDS
from train import epoch_order, optimiser, update

FOLDS = 3          # pseudo-novel folds of the seen names
HELD_OUT = 0.25    # share of the labelled training images kept out of every fit
MIN_NAMES = 4      # seen names below which no fold has both seen' and pseudo-novel names to weigh


class TooFew(ValueError):
    """Too few seen names, or labelled images, for the folds: one line (a command's refusal)."""


def words(text):
    return tuple(WORDS.findall(text.lower()))


def named_in(captions, names):
    """[set of indices into names] of each caption: the names whose words occur in it one after the other
    (choice 1)."""
    grams = [words(n) for n in names]
    def named(caption):
        w = words(caption)
        return {k for k, g in enumerate(grams) if g and any(w[i:i + len(g)] == g for i in range(len(w) - len(g) + 1))}
    return [named(c) for c in captions]


def train(method, img, txt, epochs, batch_size, seed, lr=None, weight_decay=None):
    """align.py's loop on features (choice 2; train.py's optimiser, epoch_order and update); lr and weight_decay
    default to the method's own. Returns the steps taken."""
    d = method.defaults
    steps = len(img) // batch_size
    params, opt, sched = optimiser(method, d["lr"] if lr is None else lr,
                                   d["weight_decay"] if weight_decay is None else weight_decay, epochs * steps)
    method.train()
    for epoch in range(epochs):
        order = epoch_order(len(img), seed, epoch)
        for s in range(steps):
            idx = order[s * batch_size:(s + 1) * batch_size]
            update(method, method.loss(img[idx], txt[idx])[0], params, opt, sched)
    return epochs * steps


def fitted(cls, hp, img, txt, seed, epochs=None, batch_size=None, lr=None, weight_decay=None):
    """cls(D_v, D_l, **hp) fitted on (img, txt), its init drawn from seed: closed form on pooled vectors, else
    train() at epochs / batch_size / lr / weight_decay (None: the method's own)."""
    torch.manual_seed(seed)
    method = cls(img.pooled.shape[-1], txt.pooled.shape[-1], **hp)
    if method.fit is not None:
        vectors = lambda f: Features.from_vectors(f.pooled)
        method.fit(vectors(img), vectors(txt))
        return method.eval()
    d = method.defaults
    train(method, img, txt, epochs or d["epochs"], min(batch_size or d["batch_size"], len(img)), seed, lr,
          weight_decay)
    return method.eval()


def class_scores(method, img, prompts, n_templates):
    """(N, C) zero-shot scores of image features against class-major prompt features (evaluate.py's path)."""
    import evaluate
    with evaluate.inference(method):
        e_img = evaluate.embed(method.embed_image, img)
        cls = evaluate.template_average(evaluate.embed(method.embed_text, prompts), n_templates)
        return evaluate.class_logits(method, e_img, cls, n_templates)


def image_labels(rows, named, usable):
    """Per pair, its image's names (the union over the image's pairs) and whether the image is labelled: one
    name, every caption of it usable; and each pair's image's first pair (where it is scored)."""
    union, ok, first = {}, {}, {}
    for j, (r, c, u) in enumerate(zip(rows.tolist(), named, usable.tolist())):
        union.setdefault(r, set()).update(c)
        ok[r] = ok.get(r, True) and u
        first.setdefault(r, j)
    labels = [union[r] for r in rows.tolist()]
    single = torch.tensor([len(union[r]) == 1 and ok[r] for r in rows.tolist()], dtype=torch.bool)
    is_first = torch.tensor([first[r] == j for j, r in enumerate(rows.tolist())], dtype=torch.bool)
    return labels, single, is_first


def check_names(names, folds):
    """One line (TooFew) when the seen names are too few for the folds."""
    least = max(MIN_NAMES, folds + 1)
    if len(names) < least:
        raise TooFew(f"{len(names)} seen name(s){': ' + ', '.join(names) if names else ''}; calibrating needs "
                         f"at least {least}, so that each of the {folds} folds holds some out as if novel and keeps "
                         f"others seen")


def plan(rows, named, usable, names, folds, held_out, seed):
    """Each fold's (pseudo-novel names, pairs fitted, (pair, name) of the images scored): the docstring's steps
    1-3 before any fit; one line (TooFew) when a fold would score no image of its seen' or of its
    pseudo-novel names."""
    check_names(names, folds)
    labels, single, is_first = image_labels(rows, named, usable)
    g = torch.Generator().manual_seed(seed)
    held = single & (torch.rand(len(named), generator=g) < held_out)
    held_images = torch.zeros(int(rows.max()) + 1, dtype=torch.bool)
    held_images[rows[held]] = True
    held = held_images[rows]                                   # every pair of a held-out image
    folds_ = []
    for f in range(folds):
        pseudo = set(range(len(names))[f::folds])
        meets = torch.tensor([bool(c & pseudo) for c in labels], dtype=torch.bool)
        fit_pairs = (usable & ~held & ~meets).nonzero().squeeze(1)
        val = (single & is_first & (held | meets)).nonzero().squeeze(1)
        y = torch.tensor([next(iter(labels[j])) for j in val.tolist()], dtype=torch.long)
        sides = {k in pseudo for k in y.tolist()}
        if sides != {True, False} or not len(fit_pairs):
            raise TooFew(f"fold {f + 1}/{folds} (pseudo-novel {', '.join(names[k] for k in sorted(pseudo))}) "
                             f"has {int((~torch.tensor([k in pseudo for k in y.tolist()], dtype=torch.bool)).sum())} "
                             f"held-out image(s) of its seen names, {sum(k in pseudo for k in y.tolist())} of its "
                             f"pseudo-novel ones and {len(fit_pairs)} pairs to fit: too few training images whose "
                             f"captions name exactly one of the names; give names the training captions use")
        folds_.append((pseudo, fit_pairs, val, y))
    return folds_


def choose(fit, img, txt, rows, named, prompts, n_templates, names, usable=None, folds=FOLDS, held_out=HELD_OUT,
           seed=0, log=print, tag=lambda method: ""):
    """(gamma, [fold records]) of calibrated stacking on training pairs (the docstring's steps 1-4). fit(img, txt):
    a fitted method in eval mode; img: the images' features (I, ...), txt: the pairs' caption features (N, ...),
    rows (N,): each pair's image row in img; named: each pair's set of names (indices into names); prompts:
    class-major prompt features of names (K * n_templates); usable (N,) bool: the pairs any fit may hold
    (default: all); tag(method): words after "[gamma]" in the log. A record: {pseudo_novel, pairs, images,
    gamma, H}."""
    import aligned
    usable = torch.ones(len(named), dtype=torch.bool) if usable is None else usable
    records = []
    for f, (pseudo, fit_pairs, val, y) in enumerate(plan(rows, named, usable, names, folds, held_out, seed)):
        method = fit(img[rows[fit_pairs]], txt[fit_pairs])
        S = class_scores(method, img[rows[val]], prompts, n_templates)
        is_seen = torch.tensor([k not in pseudo for k in range(len(names))])
        gamma, h = aligned.choose_gamma(S, y, is_seen)
        records.append(dict(pseudo_novel=[names[k] for k in sorted(pseudo)], pairs=len(fit_pairs), images=len(y),
                            gamma=gamma, H=h))
        log(f"  [gamma] {tag(method)}fold {f + 1}/{folds}: {len(fit_pairs)} pairs fitted, {len(y)} held-out images, "
            f"pseudo-novel {', '.join(records[-1]['pseudo_novel'])}: gamma {gamma:.4f} (H {h:.1f})")
    return sum(r["gamma"] for r in records) / folds, records

