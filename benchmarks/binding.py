"""The binding table: every method x the harder binding test, with retrieval alongside.

    python benchmarks/binding.py --cache-dir .cache --texts shapes-text --hard-negatives off   # every method, seed 0
    python benchmarks/binding.py --methods pal pal_rel --seeds 0 1 2 --texts shapes-text --hard-negatives off
    python benchmarks/binding.py --jobs 2                            # two runs at a time
    python benchmarks/binding.py --paraphrases                       # the text encoders alone

Runs align.py once per (method, text encoder, hard negatives, seed) in a subprocess
(--threads 1, the budget below, the default image encoder shapes-cnn unless --image-encoder,
features from the shared cache), skips a run whose metrics.json already exists (so an interrupted
grid resumes), and prints a markdown table of the medians over seeds: the harder binding test
(shapes.binding_sets; each a %, chance 50) on {canonical style, all five training styles, held-out
templates, held-out object pairs} x {attribute swap, relation-word swap, object-order swap}, then
retrieval RSum and zero-shot top-1.
Text encoders: "shapes-text" (the tiny masked-word transformer) and MiniLM
(all-MiniLM-L6-v2; --minilm names it: "minilm", or its folder).

Budget (one rule, CPU-sized): every method trained for --epochs epochs (5), except
the CoV trio at the results table's CPU setting (benchmarks/results_table.py: 128-d,
batch 64, 5 epochs), MLP and T2C at their own (fast) defaults, CSA and ASIF closed
form. Hard negatives only for contrastive methods (CSA, ASIF, MLP and T2C have no
InfoNCE denominator to put them in: align.py refuses the flag for them).
"""
import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SPLITS = [("canonical", "canonical"), ("styles", "all styles"), ("templates", "held-out templates"),
          ("combos", "held-out pairs")]
SWAPS = [("attribute_swap", "attr"), ("relation_swap", "rel"), ("object_swap", "order")]
COLUMNS = [(f"binding_{g}", f"binding_{k}", f"{name}: {short}") for g, name in SPLITS for k, short in SWAPS] + [
           ("retrieval", "rsum", "RSum"), ("classification", "cls", "zero-shot top-1"), ("train", "seconds", "train s")]


CPU_SETTING = {"cov": ["--hp", "dim=128", "--batch-size", "64"],          # as results_table.py
               "text_guided": ["--hp", "K=128", "--batch-size", "64"],
               "filip": ["--hp", "K=128", "--batch-size", "64"]}
OWN_DEFAULTS = {"mlp", "t2c", "csa", "asif"}     # fast defaults (mlp, t2c) or no training (csa, asif)


def contrastive(method):
    """Does the method train with a contrastive loss (so --hard-negatives applies)?"""
    from methods import METHODS
    from negatives import contrastive_scale
    return contrastive_scale(METHODS[method](16, 12)) is not None


def budget(method, epochs):
    return CPU_SETTING.get(method, []) + ([] if method in OWN_DEFAULTS else ["--epochs", str(epochs)])


def run(method, text, minilm, hard, seed, args):
    tag = f"{method}-{text}-{'hn' if hard else 'nohn'}-seed{seed}"
    out = Path(args.out) / tag
    claim = Path(args.out) / f"{tag}.claimed"
    if not (out / "metrics.json").exists():
        if claim.exists():                        # another runner of this grid has it
            print(f"  {tag}: running elsewhere (remove {claim} if it is not)", flush=True)
            return None
        claim.touch()
        cmd = [sys.executable, str(ROOT / "align.py"), "--method", method, "--seed", str(seed), "--out", str(out),
               "--cache-dir", str(args.cache_dir), "--threads", "1", "--no-figures", *budget(method, args.epochs),
               "--image-encoder", args.image_encoder, *args.extra.split(),
               "--text-encoder", minilm if text == "minilm" else "shapes-text", *(["--hard-negatives"] if hard else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (Path(args.out) / f"{tag}.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            print(f"  {tag} FAILED:\n{r.stderr[-2000:]}", flush=True)
            claim.unlink()
            return None
    m = json.loads((out / "metrics.json").read_text())
    print(f"  {tag}: " + "  ".join(f"{c} {cell(m, g, k):.1f}" for g, k, c in COLUMNS), flush=True)
    return m


def cell(m, group, key):
    v = m[group][key]
    return v["top1"] if group == "classification" else v


# ---------------------------------------------------------------- --probes: where is relation binding lost?
def ridge_probe(X, y, n_classes, seed=0):
    """Held-out accuracy of a ridge probe (one-hot targets, standardised inputs): first half trains
    (its lambda picked on its last third), second half tests."""
    import torch
    X = X.float().flatten(1)
    n = len(X) // 2
    def fit(A, Y, lam):  # ridge; in its dual form when there are more features than samples
        if A.shape[1] > A.shape[0]:
            return A.T @ torch.linalg.solve(A @ A.T + lam * torch.eye(len(A)), Y)
        return torch.linalg.solve(A.T @ A + lam * torch.eye(A.shape[1]), A.T @ Y)
    def design(Z, mu, sd):
        return torch.cat([(Z - mu) / sd, torch.ones(len(Z), 1)], 1)
    Y = torch.nn.functional.one_hot(y, n_classes).float()
    acc = lambda W, A, yy: ((A @ W).argmax(1) == yy).float().mean().item()
    tr, va = slice(0, 2 * n // 3), slice(2 * n // 3, n)
    mu, sd = X[tr].mean(0), X[tr].std(0) + 1e-6
    lam = max([1e-1, 1e0, 1e1, 1e2, 1e3, 1e4],
              key=lambda l: acc(fit(design(X[tr], mu, sd), Y[tr], l), design(X[va], mu, sd), y[va]))
    mu, sd = X[:n].mean(0), X[:n].std(0) + 1e-6
    return 100 * acc(fit(design(X[:n], mu, sd), Y[:n], lam), design(X[n:], mu, sd), y[n:])


def probes(args):
    """Linear probes of the relation between two objects, named by their colours, on 1200 fresh
    two-object scenes: target = where the object whose colour comes first in shapes.COLOUR_NAMES is
    relative to the other (left / right / above / below; chance ~25%). A bag of words cannot
    read it from a caption; one pooled vector can only if it binds colour to place."""
    import numpy as np
    import torch

    import aligned
    import encoders
    import shapes
    import shapes_encoders
    from features import Features
    from methods import METHODS
    torch.set_num_threads(1)
    rng = np.random.default_rng(4242)
    scenes = []
    while len(scenes) < 1200:
        s = shapes.sample_scene(rng, 2)
        if s["objects"][0]["colour"] != s["objects"][1]["colour"]:
            scenes.append(s)
    def target(s):
        a, b = sorted(s["objects"], key=lambda o: shapes.COLOUR_NAMES.index(o["colour"]))
        return ["left", "right", "above", "below"].index(shapes.relation(a, b))
    y = torch.tensor([target(s) for s in scenes])
    captions = [shapes.caption(s, int(rng.integers(4))) for s in scenes]     # styles 0-3 name the relation
    images = shapes.render_all(scenes)[0]
    enc = lambda e, xs: Features.cat([e.encode(xs[i:i + 200]) for i in range(0, len(xs), 200)])
    rows = [("majority class", 100 * y.bincount().max().item() / len(y))]
    for pos in (False, True):
        img_enc, _ = shapes_encoders.load_shapes_encoders(args.cache_dir, image_pos=pos)
        f = enc(img_enc, images)
        tag = "position-aware CNN" if pos else "CNN without position code"
        rows += [(f"image, {tag}: pooled (mean token)", ridge_probe(f.pooled, y, 4)),
                 (f"image, {tag}: all 64 patch tokens", ridge_probe(f.patches(), y, 4))]
    img_f = f
    for text in ("shapes-text", "minilm"):
        _, txt_enc = encoders.load_encoders("shapes-cnn-pos", args.minilm if text == "minilm" else "shapes-text",
                                            args.cache_dir)
        t = enc(txt_enc, captions)
        rows += [(f"text, {text}: pooled", ridge_probe(t.pooled, y, 4)),
                 (f"text, {text}: all tokens (padded)", ridge_probe(t.tokens, y, 4))]
        for method in ("pal", "pal_rel"):
            for hard in ("nohn", "hn"):
                run = Path(args.out) / f"{method}-{text}-{hard}-seed0"
                if not (run / "model.safetensors").exists() and not (run / "method.pt").exists():
                    continue
                m = METHODS[method](img_f.pooled.shape[-1], t.pooled.shape[-1])
                m.load_state_dict(aligned.read_weights(run))
                with torch.no_grad():
                    e_v, e_l = m.embed_image(img_f), m.embed_text(t)
                K = m.K
                rows += [(f"{run.name}: image embedding h_v", ridge_probe(e_v[:, :K], y, 4)),
                         (f"{run.name}: text embedding h_l", ridge_probe(e_l[:, :K], y, 4))]
                if method == "pal_rel":
                    rows += [(f"{run.name}: relation part of e_v (c - c_bar)", ridge_probe(e_v[:, K:], y, 4)),
                             (f"{run.name}: relation part of e_l (d)", ridge_probe(e_l[:, K:], y, 4))]
    print("\n| features | relation probe accuracy % |\n|---|---|")
    for name, a in rows:
        print(f"| {name} | {a:.1f} |")


# ---------------------------------------------------------------- --paraphrases: does the text encoder know?
def paraphrases(args):
    """The frozen text encoders alone, no image and no training: on 200 fresh two-object scenes per
    caption form, the % whose caption's pooled vector has a higher cosine with the canonical
    (style 0) caption of the same scene than with the canonical caption of each minimal pair
    (chance 50). A form the encoder itself reads as its swap gives an aligner nothing to read."""
    import numpy as np
    import torch

    import encoders
    import shapes
    torch.set_num_threads(1)
    forms = list(range(1, 5)) + [f"h{k}" for k in range(len(shapes.HELD_OUT_TEMPLATES))]
    rng = np.random.default_rng(4243)
    scenes = []
    while len(scenes) < 200:
        s = shapes.sample_scene(rng, 2)
        a, b = s["objects"]
        if a["colour"] != b["colour"] and a["shape"] != b["shape"]:
            scenes.append(s)
    print("\n| text encoder | form | example | attribute | relation word | object order |\n|---|---|---|---|---|---|")
    for text in args.texts:
        _, enc = encoders.load_encoders("shapes-cnn", args.minilm if text == "minilm" else "shapes-text",
                                        args.cache_dir)
        vec = lambda captions: torch.nn.functional.normalize(enc.encode(captions).pooled.float(), dim=-1)  # noqa: B023 (called in this iteration)
        canonical = [shapes.minimal_pairs(s, 0) for s in scenes]
        true0 = vec([t for t, _ in canonical])
        swaps0 = {k: vec([d[k] for _, d in canonical]) for k, _ in SWAPS}
        for form in forms:
            captions = [shapes.minimal_pairs(s, form)[0] for s in scenes]
            v = vec(captions)
            near = [100 * ((v * true0).sum(-1) > (v * swaps0[k]).sum(-1)).float().mean().item() for k, _ in SWAPS]
            print(f"| {text} | {form} | {captions[0]} | " + " | ".join(f"{x:.1f}" for x in near) + " |")


# ---------------------------------------------------------------- --breakdown: which phrasing fails?
def breakdown(args):
    """Each trained run's harder binding test per caption form: the all-styles set by training style,
    the held-out set by template (shapes.HELD_OUT_TEMPLATES), from the run's model.safetensors."""
    import torch

    import aligned
    import encoders
    import evaluate
    import shapes
    from methods import METHODS
    torch.set_num_threads(1)
    world = shapes.shapes_world()
    for run in args.breakdown:
        config = json.loads((Path(run) / "config.json").read_text())
        img_enc, txt_enc = encoders.load_encoders(config["image_encoder"], config["text_encoder"], args.cache_dir)
        rows = []
        for split, forms in (("binding_styles", [str(k) for k in range(5)]),
                             ("binding_templates", [f"h{k}" for k in range(len(shapes.HELD_OUT_TEMPLATES))])):
            s = world[split]
            img = img_enc.encode(s.images)
            txt = {k: txt_enc.encode(c) for k, c in [("true", s.captions), *s.distractors.items()]}
            m = METHODS[config["method"]](img.pooled.shape[-1], txt["true"].pooled.shape[-1], **config["hp"])
            m.load_state_dict(aligned.read_weights(run))
            for f, form in enumerate(forms):
                idx = torch.arange(f, len(s.captions), len(forms))
                r = evaluate.binding(m, img[idx], txt["true"][idx], {k: txt[k][idx] for k in s.distractors})
                rows.append((form, s.captions[f], *(r[f"binding_{k}"] for k, _ in SWAPS)))
        print(f"\n{run}\n| form | example | attribute | relation word | object order |\n|---|---|---|---|---|")
        for form, example, *v in rows:
            print(f"| {form} | {example} | " + " | ".join(f"{x:.1f}" for x in v) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=None, help="methods to run (default: all of methods.METHODS)")
    p.add_argument("--texts", nargs="+", default=["shapes-text", "minilm"], choices=["shapes-text", "minilm"])
    p.add_argument("--hard-negatives", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds (the table shows the median)")
    p.add_argument("--epochs", type=int, default=5, help="training epochs of every epoch-trained run (see Budget)")
    p.add_argument("--image-encoder", default="shapes-cnn", help="the --image-encoder of every run")
    p.add_argument("--extra", default="", help='more align.py arguments for every run, one string '
                   '(e.g. "--hp order=index"; give such a variant its own --out)')
    p.add_argument("--minilm", default="minilm", help="the MiniLM --text-encoder value (alias or folder)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses one thread)")
    p.add_argument("--out", default="results/binding", help="where each run's folder goes")
    p.add_argument("--cache-dir", default=".cache", help="shared encoder/feature cache")
    p.add_argument("--probes", action="store_true",
                   help="instead of the grid: linear probes of the relation on frozen tokens, pooled features and "
                        "the grid's trained PAL / PAL-Rel embeddings (reads <out>/<run>/model.safetensors)")
    p.add_argument("--breakdown", nargs="+", default=None, metavar="RUN",
                   help="instead of the grid: the binding test per caption form of trained runs (their folders)")
    p.add_argument("--paraphrases", action="store_true",
                   help="instead of the grid: does each --texts encoder alone put a caption nearer the canonical "
                        "caption of its facts than that of its swaps?")
    args = p.parse_args()
    if args.paraphrases:
        return paraphrases(args)
    if args.breakdown:
        return breakdown(args)
    if args.probes:
        return probes(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.methods is None:
        from methods import METHODS
        args.methods = list(METHODS)
    grid = [(m, t, h == "on") for m in args.methods for t in args.texts for h in args.hard_negatives
            if h == "off" or contrastive(m)]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = {g: pool.submit(lambda g: [run(*g[:2], args.minilm, g[2], s, args) for s in args.seeds], g)
                for g in grid}
        runs = {g: [r for r in f.result() if r is not None] for g, f in runs.items()}
    print("\n| method | text | hard negatives | " + " | ".join(c for _, _, c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    for (method, text, hard), rs in runs.items():
        if rs:
            med = [statistics.median(cell(r, g, k) for r in rs) for g, k, _ in COLUMNS]
            print(f"| {method} | {text} | {'yes' if hard else 'no'} | " + " | ".join(f"{v:.1f}" for v in med) + " |")
    print(f"\nmedian of seeds {args.seeds}, {args.epochs} epochs (see Budget in the docstring), --threads 1")


if __name__ == "__main__":
    main()
