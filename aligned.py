"""Use a trained aligner: load a finished run folder, encode images and texts, classify, search.

    import aligned
    model = aligned.load("results/pal-shapes-seed0")             # any method, on "cpu" or "cuda"
    scores = model.zero_shot(["a.png", "b.png"], ["red circle", "blue square"])   # (2, 2)
    order = model.search(["a.png", "b.png"], "a red circle").argsort(descending=True)
    files = aligned.image_files(["photos/"])                     # a folder, walked recursively
    index = model.index(files)                  # .paths, .emb (N, K); index.write(folder), aligned.Index.load(folder)
    scores = model.class_scores(model.embed_files(files, index), model.classes(["red circle", "blue square"]))

A run folder holds what rebuilds its method (infra/folder.py writes both, rank 0, before metrics.json):
    model.safetensors   the method's state_dict (safetensors: tensors only, nothing to unpickle)
    config.json "model" {method, hp (the __init__ keywords), dims [D_v, D_l], image_encoder, text_encoder,
                         image_layer, text_layer, cache_dir, templates}
load() builds the frozen encoders by name and layer (encoders.load_encoders), the method on its dims and
keywords, gives every tensor of the state_dict the saved shape (ASIF's anchors, CSA's bases: buffers that
fit() sizes, created empty by __init__), and loads it strictly. Images go through the encoder's own
preprocessing (encoder.transform: the checkpoint's processor; shapes-cnn: 64 x 64 RGB pixels); scores are
method.score of the method's embeddings, and zero_shot averages the templates as evaluate.py does
(template_average, class_logits), so its scores are evaluate.py's for the same images and prompts.

Image files are encoded by a pipeline (encode_files): batches of BATCH files decoded and resized by
DECODE_WORKERS threads ahead of the forward (features.read_ahead), progress with an ETA on stderr. The
index (`python align.py index RUN IMAGES...`) keeps their embeddings in RUN/index/images.safetensors (or
--index FOLDER): the tensor "emb" and, in the file's metadata, each row's key (absolute path, size,
mtime_ns, ctime_ns) and the run's key (its weights, its "model" and its image encoder's fingerprint), written through
the write gate; classify and search read the rows whose keys match and encode only the other files.

Deviations / choices:
1. A run folder of an older version (method.pt, no "model" in config.json) loads too: the method and
   encoders from config.json's identity, the weights from method.pt (tensors only).
2. An image given as a tensor is uint8 (3, H, W) RGB, as the data sets hold images; a path is read with
   data.rgb (EXIF upright, alpha on white). shapes-cnn reads other sizes than 64 x 64 resized (bicubic).
3. cache_dir: the run's own --cache-dir when it still exists, else ~/.cache/posthoc-align (only the tiny
   encoders of a non-default seed are pretrained into it).
4. --top's probabilities: softmax at the method's contrastive_scale (1 / its temperature); the methods
   without one (csa, asif, mlp, t2c) at 100, CLIP's logit scale, on their cosine-like scores.
5. The index lives in the run folder by default (a run and the embeddings it made travel together); a
   classify or search reads it and never writes it: only `index` does.
6. Seen and novel class names (generalized zero-shot): a name is seen when each of its words and each pair of
   adjacent words occurs in the training captions (the run's vocabulary.json), so "purple circle" is novel
   when no caption held it, though both its words were; a run without vocabulary.json (an older version)
   classifies as before, saying it cannot tell seen from novel.
7. --calibrate GAMMA is calibrated stacking (Chao, Changpinyo, Gong, Sha, "An empirical study and analysis of
   generalized zero-shot learning for object recognition in the wild", ECCV 2016, §3.2): GAMMA is subtracted
   from every seen name's score, and the printed scores and --top's probabilities are the calibrated ones.
   GAMMA is the user's, not guessed here: choose_gamma picks it on held-out training pairs, names held out as
   if novel (choice 9: python align.py calibrate; benchmarks/gzsl.py), never on a test set. The search is
   exact rather than a grid: a prediction changes only where GAMMA crosses an image's margin (best seen
   score - best novel score), so every midpoint between sorted margins (and one past either end) is tried;
   of equal best H, the median GAMMA (the middle of the best range, not its edge).
8. Seen / novel top-1 are per-class means over each side's classes (as Xian, Schiele, Akata, "Zero-shot
   learning - the good, the bad and the ugly", CVPR 2017, which defines H, the harmonic mean of the two),
   each image ranked among all the names, seen and novel.
9. `python align.py calibrate RUN --classes ...` chooses GAMMA on the run's own training pairs (calibration.py,
   benchmarks/gzsl.py's procedure, one implementation): the given names the captions held are dealt into 3
   folds, each refits the run's method (its class, keywords, epochs, batch, lr, seed; on the cached features
   of the pairs it aligned on) without its pseudo-novel names' pairs and a held-out quarter of the images that
   one name labels; GAMMA is the folds' mean, written to RUN/calibration.json (the run's own files untouched),
   which classify --calibrate auto (or --calibrate alone) reads and names on stderr. Refused in one line: fewer
   than 4 seen names, a fold with no held-out image of its seen' or pseudo-novel names, no vocabulary.json, a
   run aligned on head rows, training features not in the cache (--extract encodes them).
"""
import errno
import json
import os
import sys
from pathlib import Path

import torch

ENV_CACHE = Path.home() / ".cache" / "posthoc-align"


def check_own_modules(names=("data", "train", "layers", "features", "encoders", "evaluate", "methods", "infra")):
    """The flat modules are installed under their own generic names (pyproject.toml): one of another package
    found first (a `data` package in the same environment) is named here, not met as a strange AttributeError."""
    import importlib.util
    here = Path(__file__).resolve().parent
    for name in names:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is None or here not in origin.parents:
            raise ImportError(f"the module {name!r} found first is {origin or 'none'}, not this project's "
                              f"{here / name}: another package of that name is installed; install this project in "
                              f"a virtual environment of its own (python -m venv)")


check_own_modules()
from infra.errors import RunError, first_line  # noqa: E402  (after the check: infra is one of those)
from infra.run import guard  # noqa: E402


def read_weights(folder, identity=None):
    """The method's state_dict from model.safetensors, else an older run's method.pt (tensors only); a file
    sealed with identity's hash where the file carries one (weights copied from another run are refused)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        from safetensors import safe_open
        from safetensors.torch import load_file

        from infra.folder import identity_hash
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            sealed = (f.metadata() or {}).get("identity")
        if identity is not None and sealed is not None and sealed != identity_hash(identity):
            raise ValueError("these weights were trained by another run (their identity is not config.json's)")
        return load_file(str(folder / "model.safetensors"))
    if (folder / "method.pt").is_file():
        return torch.load(folder / "method.pt", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} holds neither model.safetensors nor method.pt: not a finished run of align.py")


def shaped_like(method, state):
    """method with every buffer / parameter re-made at the saved tensor's shape where it differs (a buffer
    fit() sizes, e.g. ASIF's anchors (N_a, D) created as (0, D)), so load_state_dict(strict=True) fits."""
    own = method.state_dict(keep_vars=True)
    for key, saved in state.items():
        if key in own and own[key].is_floating_point() and not saved.is_floating_point():
            raise ValueError(f"its {key} is {saved.dtype}, not floating point: changed since the run?")
        if key in own and own[key].shape != saved.shape:
            *path, name = key.split(".")
            module = method.get_submodule(".".join(path))
            fresh = torch.zeros(saved.shape, dtype=saved.dtype, device=own[key].device)
            if isinstance(own[key], torch.nn.Parameter):
                setattr(module, name, torch.nn.Parameter(fresh, requires_grad=own[key].requires_grad))
            else:
                module.register_buffer(name, fresh, persistent=name not in module._non_persistent_buffers_set)
    return method


def model_of(folder):
    """config.json's "model" of a run folder (an older run's: from its identity)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return config.get("model") or legacy_model(config)


def rebuild(folder, model=None, state=None):
    """The method of a run folder, built on its dims and keywords, its weights loaded, in eval mode."""
    from methods import METHODS
    model = model or model_of(folder)
    method = METHODS[model["method"]](*model["dims"], **hp_of(model))
    state = read_weights(folder) if state is None else state
    shaped_like(method, state).load_state_dict(state)
    return method.eval()


def hp_of(model):
    """The __init__ keywords of a run's method from config.json's "model" (lists as the tuples they were)."""
    from infra.run import hp_names
    from methods import METHODS
    allowed = set(hp_names(METHODS[model["method"]]))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in model["hp"].items() if k in allowed}


def legacy_model(config):
    """config.json's "model" for a run written before it had one: from the identity (hp as given)."""
    from infra.folder import templates_of
    ident = config["identity"]
    hp = {k[3:]: v for k, v in ident.items() if k.startswith("hp.")}
    return dict(method=ident["method"], hp=hp, dims=config.get("dims"), image_encoder=ident["image_encoder"],
                text_encoder=ident["text_encoder"], image_layer=config["image_layer"],
                text_layer=config["text_layer"], cache_dir=config.get("cache_dir", ".cache"),
                templates=templates_of(config["data"]))


# ---------------------------------------------------------------------------
# The load API
# ---------------------------------------------------------------------------
def read_run(folder):
    """A finished run folder read whole and checked, before any encoder loads (the read gate of a run):
    its config.json, metrics.json (a finished run), the method it names, and its weights, every fault one
    line naming the file and what to do. Returns (config, model, state)."""
    from methods import METHODS
    folder = Path(folder)
    if not folder.is_dir():
        raise RunError(f"{folder} is not a folder; pass a run folder of align.py (results/<method>-<data>-seed<N>)")
    with guard(f"{folder / 'config.json'}", "pass a run folder that align.py wrote (results/...)"):
        if (folder / "config.json").exists() and not (folder / "config.json").is_file():   # a fifo: read forever
            raise ValueError("it is not a regular file")
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict) or not isinstance(config.get("identity"), dict):
            raise ValueError("it is not the config.json of a run of align.py (no identity)")
    if not (folder / "metrics.json").is_file():
        raise RunError(f"{folder} is an unfinished run (no metrics.json); finish it with python align.py --resume "
                       f"--out {folder} ..., or pass a finished run")
    with guard(f"{folder / 'config.json'}", "pass a run folder that align.py wrote, or run it again"):
        model = config.get("model") or legacy_model(config)
        if model["method"] not in METHODS:
            raise ValueError(f"its method {model['method']!r} is not one of this code's ({', '.join(sorted(METHODS))}"
                             f"): renamed since?")
        ident = config["identity"]
        changed = [k for k, v in (model.get("hp") or {}).items() if f"hp.{k}" in ident and ident[f"hp.{k}"] != v]
        if changed:
            raise ValueError(f"its model.hp {changed[0]} is {model['hp'][changed[0]]!r}, its identity's "
                             f"{ident['hp.' + changed[0]]!r}: edited since the run?")
        if not all(type(model.get(k)) is int for k in ("image_layer", "text_layer")):
            raise ValueError("its model.image_layer and model.text_layer are not whole numbers")
        templates = model.get("templates") or []
        if not isinstance(templates, list) or not all(isinstance(t, str) and one_slot(t) for t in templates):
            raise ValueError(f"its templates {templates!r} are not a list of prompts that each hold {{}} once and "
                             f"no other brace")
    name = "model.safetensors" if (folder / "model.safetensors").exists() else "method.pt"
    with guard(f"{folder / name}", "copy the run folder again from where it was made, or rerun the run"):
        state = read_weights(folder, config["identity"])
    return config, model, state


def check_same_encoder(kind, enc, config):
    """The encoder load() found is the one the run was trained with: its weights' fingerprint against the run's
    identity (a same-sized model at the recorded path, or another download, would give other scores); an
    encoder recorded by a pip package's release (minilm) is that release, whatever its files' mtimes in this
    environment (a large weight file's fingerprint holds its mtime)."""
    release = (config.get("model") or {}).get(f"{kind}_release")
    if release is not None and release == getattr(enc, "release", None):
        return
    want = config.get("identity", {}).get(f"{kind}_weights")
    got = getattr(enc, "fingerprint", None)
    if want is not None and got is not None and want != got:
        raise RunError(f"the {kind} encoder {enc.name} found now has other weights than the run was trained with "
                       f"(fingerprint {got}, the run's {want}); put the run's model back at {enc.name}, or train "
                       f"a new run on this one")


def notices_to_stderr():
    """The encoders' notices ("[cache] another run is writing ...; waiting", "[text] captions longer than ...
    are cut") printed on stderr: stdout holds the results alone (--json -, --csv -, a pipe)."""
    import contextlib
    return contextlib.redirect_stdout(sys.stderr)


def load(run_folder, device="cpu", cache_dir=None):
    """The trained aligner of a finished run folder, with its frozen encoders, on device ("cpu", "cuda")."""
    import encoders
    from infra.run import check_device
    if not isinstance(run_folder, (str, os.PathLike)) or isinstance(run_folder, bytes):
        raise RunError(f"run_folder {run_folder!r}: pass the path of a finished run folder (a str or a Path), e.g. "
                       f"\"results/pal-shapes-seed0\"")
    device = check_device(device)
    if cache_dir is not None and not Path(cache_dir).is_dir():
        raise RunError(f"cache_dir {cache_dir} is not a folder; pass the folder the run's encoders are cached in "
                       f"(its --cache-dir), or leave it out")
    config, model, state = read_run(run_folder)
    cache = cache_dir or model.get("cache_dir")
    cache = Path(cache) if cache and Path(cache).is_dir() else ENV_CACHE
    try:
        with notices_to_stderr():
            image_enc, text_enc = encoders.load_encoders(model["image_encoder"], model["text_encoder"], cache,
                                                         model["image_layer"], model["text_layer"])
    except RunError as e:          # the names come from config.json here, not from the flags the message names
        said = " ".join(line.strip() for line in str(e.code).removeprefix("error: ").splitlines())   # one line
        for kind in ("image", "text"):
            said = said.replace(f"pass --{kind}-encoder", f"set model.{kind}_encoder to").replace(
                f"--{kind}-encoder", f"model.{kind}_encoder")
        raise RunError(f"{Path(run_folder) / 'config.json'}: its encoders do not load here: {said}") from None
    for kind, enc in (("image", image_enc), ("text", text_enc)):
        check_same_encoder(kind, enc, config)
    from infra.run import resolved_layer
    for kind, enc in (("image", image_enc), ("text", text_enc)):
        trained = config["identity"].get(f"{kind}_layer")
        if trained is not None and resolved_layer(enc) != trained:
            raise RunError(f"{Path(run_folder) / 'config.json'}: its model.{kind}_layer reads layer "
                           f"{resolved_layer(enc)} of {enc.name}, the run was trained on layer {trained}: config.json "
                           f"was edited since the run; copy the run folder again, or rerun the run")
    model["dims"] = model.get("dims") or [image_enc.dim, text_enc.dim]     # an older run: its encoders' dims
    with guard(f"{Path(run_folder) / 'model.safetensors'}", "its weights do not fit the method config.json names; "
               "copy the run folder again, or rerun the run"):
        method = rebuild(run_folder, model, state)
    from infra.storage import state_fingerprint
    run_key = state_fingerprint(state, json.dumps(model, sort_keys=True, default=str),
                                getattr(image_enc, "fingerprint", None))  # what an index's embeddings depend on
    return Aligned(method.to(device), image_enc, text_enc, device, model.get("templates") or ["a photo of a {}."],
                   run_key)


BATCH = 32            # images per forward of the commands (benchmarks/bench_index.py measures the encoder at it)
DECODE_WORKERS = 2    # threads decoding and resizing batches ahead of the forward


def decoded(path):
    """An image file as an upright 8-bit RGB PIL image, its pixels read (a file cut short is one line here)."""
    from PIL import Image

    import data
    with guard(f"{path}", "remove it (or copy it again), then rerun"):
        image = data.rgb(Image.open(path))
        image.load()
        return image


def no_word(text):
    """A text of ASCII punctuation and spaces alone ("???", "!!!"): no word in any language (an emoji or a CJK
    character is one)."""
    import string
    return all(c in string.punctuation or c.isspace() for c in text)


def file_key(path):
    """(absolute path, size, mtime_ns, ctime_ns) of a file: what an index entry is keyed by. The ctime is the
    inode's change time, which no program can set back: a file rewritten with its old size and mtime restored
    (os.utime, cp --preserve) still gets a new one, and is encoded again."""
    st = os.stat(path)
    return str(Path(path).absolute()), st.st_size, st.st_mtime_ns, st.st_ctime_ns


def file_key_or_none(path):
    try:
        return file_key(path)
    except OSError:
        return None


class Index:
    """Image files' embeddings under one run: keys [(absolute path, size, mtime_ns, ctime_ns)], emb (N, K)
    (token-level methods: (N, Q, K)), run_key (load's fingerprint of the method's weights, its config and the image
    encoder's weights: another run's index is never read). One safetensors file: the tensor "emb", and in its
    metadata the keys and run_key as JSON (written through the write gate, storage.save_tensors)."""
    FILE = "images.safetensors"

    def __init__(self, keys, emb, run_key):
        self.keys, self.emb, self.run_key = [tuple(k) for k in keys], emb, run_key
        self.at = {k: i for i, k in enumerate(self.keys)}

    def __len__(self):
        return len(self.keys)

    @property
    def paths(self):
        return [Path(k[0]) for k in self.keys]

    def rows(self, files):
        """Each file's row in emb, or None when the index does not hold it as it is now (new or changed)."""
        return [self.at.get(file_key_or_none(f)) for f in files]

    def write(self, folder):
        from infra.storage import save_tensors
        meta = {"keys": json.dumps(self.keys), "run_key": json.dumps(self.run_key)}
        save_tensors({"emb": self.emb}, Path(folder) / self.FILE, metadata=meta)

    @classmethod
    def load(cls, folder):
        """The index in folder, or None when it has none; a file that cannot be read is one line."""
        path = Path(folder) / cls.FILE
        if not path.is_file():
            return None
        from safetensors import safe_open
        with guard(f"{path}", f"delete it (rm {path}) and run python align.py index again"):
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if "keys" not in meta or "run_key" not in meta or "emb" not in f.keys():
                    raise RunError(f"{path} is no image index of this project (it has no keys, run_key or emb), "
                                   f"left as it is; pass --index a folder of its own")
                emb = f.get_tensor("emb")
            keys = json.loads(meta["keys"])
            if len(keys) != len(emb):
                raise ValueError(f"{len(keys)} keys for {len(emb)} embeddings")
            if not torch.isfinite(emb).all():
                raise ValueError("it holds NaN or inf embeddings")
            index = cls(keys, emb, json.loads(meta["run_key"]))
            index.path = path
            return index


class Aligned:
    """A method with its frozen encoders: raw images and texts in, the method's embeddings and scores out."""

    def __init__(self, method, image_encoder, text_encoder, device="cpu", templates=("a photo of a {}.",),
                 run_key=None):
        self.method, self.image_encoder, self.text_encoder = method, image_encoder, text_encoder
        self.device, self.templates, self.run_key = device, list(templates), run_key

    def image_inputs(self, images):
        """Paths, PIL images, uint8 (3, H, W) tensors or uint8 (H, W, 3) numpy arrays -> what the image encoder's
        encode() reads; a PIL image read as a path's is (upright by its EXIF orientation, transparency onto
        white: data.rgb)."""
        import numpy as np
        from PIL import Image

        import data
        what = "pass a path, a PIL image or a uint8 (3, H, W) tensor, or a list of them"
        def tensor(x):      # numpy: uint8 (H, W, 3) pixels (numpy's, PIL's layout) as a PIL image, else as torch's
            if isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 3 and x.shape[-1] == 3:
                return Image.fromarray(x)
            return torch.from_numpy(x) if isinstance(x, np.ndarray) else x
        if isinstance(images, np.ndarray) and images.ndim == 4 and images.shape[-1] == 3:
            images = list(images)                             # (B, H, W, 3)
        images = tensor(images)
        if isinstance(images, (str, Path, Image.Image)) or torch.is_tensor(images) and images.dim() == 3:
            images = [images]
        if images is None or isinstance(images, (bytes, int, float)):
            raise RunError(f"images {images!r}: {what}")
        images = [tensor(x) for x in images]
        if not images:
            raise RunError(f"no image given; {what}")
        for x in images:
            if not isinstance(x, (str, Path, Image.Image)) and not torch.is_tensor(x):
                raise RunError(f"an image of type {type(x).__name__}: {what}")
            if isinstance(x, (str, Path)) and Path(x).is_dir():
                raise RunError(f"{x} is a folder; pass its image files (aligned.image_files([folder]) lists them)")
            if torch.is_tensor(x) and (x.dtype != torch.uint8 or x.dim() != 3 or x.shape[0] != 3):
                raise RunError(f"an image tensor of {x.dtype} {tuple(x.shape)}: pass uint8 pixels (3, H, W), e.g. "
                               f"(x * 255).round().to(torch.uint8) of a [0, 1] float tensor, x.permute(2, 0, 1) of "
                               f"an (H, W, 3) one")
        read = [decoded(x) if isinstance(x, (str, Path)) else data.rgb(x) if isinstance(x, Image.Image) else x
                for x in images]
        if hasattr(self.image_encoder, "transform"):          # Hugging Face / torchvision: the model's processor
            return read
        S = 64                                                # shapes-cnn: uint8 (B, 3, 64, 64) pixels
        def pixels(x):
            if torch.is_tensor(x):
                return x if x.shape[-2:] == (S, S) else pixels(Image.fromarray(x.permute(1, 2, 0).numpy()))
            x = x.convert("RGB")
            x = x if x.size == (S, S) else x.resize((S, S), Image.BICUBIC)
            return torch.from_numpy(np.asarray(x, dtype=np.uint8).copy()).permute(2, 0, 1)
        return torch.stack([pixels(x) for x in read])

    @torch.no_grad()
    def encode_image(self, images, batch_size=64):
        """(N, K) image embeddings (token-level methods: (N, Q, K)) of paths, PIL images or uint8 tensors."""
        import evaluate
        x = self.image_inputs(images)
        feats = [self.image_encoder.encode(x[i:i + batch_size], self.device) for i in range(0, len(x), batch_size)]
        with evaluate.inference(self.method):
            return evaluate.pad_cat([self.method.embed_image(f.to(self.device)).float().cpu() for f in feats])

    @torch.no_grad()
    def encode_text(self, texts, batch_size=256):
        """(N, K) text embeddings (token-level methods: (N, L, K), padded words 0) of a list of strings."""
        import evaluate
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise RunError("a text (a query, a prompt) is empty or missing; pass a string of words, or a list of "
                           "them, e.g. [\"a red circle\"]")
        import encoders
        counted = encoders.word_counts(self.text_encoder)
        with notices_to_stderr():                       # the tokenizer's notices (a cut) are not results
            none = [t for t, n in zip(texts, counted(texts).tolist()) if n == 0] if counted else []
        none += [t for t in texts if no_word(t)]          # "???": an unknown word to some tokenizers, still none
        if none:
            raise RunError(f"the text {none[0]!r} holds no word {self.text_encoder.name}'s tokenizer reads, so "
                           f"any score of it would be noise; give it words")
        with evaluate.inference(self.method), notices_to_stderr():
            return evaluate.pad_cat([self.method.embed_text(self.text_encoder.encode(texts[i:i + batch_size],
                                                                                      self.device).to(self.device))
                                     .float().cpu() for i in range(0, len(texts), batch_size)])

    @torch.no_grad()
    def score(self, image_emb, text_emb):
        """(N_img, N_txt) method.score of embeddings from encode_image and encode_text (higher = more similar)."""
        import evaluate
        with evaluate.inference(self.method):
            return evaluate.score_matrix(self.method, image_emb, text_emb, device=self.device, log=lambda *a: None)

    # ------------------------------------------------------------------ image files -> embeddings, the index
    def prepared(self, files):
        """The host half of encoding a batch of files (run in a reader thread): decoded, resized to uint8
        pixels (the encoder's prepare where it has one: its resize and crop; shapes-cnn: 64 x 64)."""
        images = [decoded(f) for f in files]
        return self.image_encoder.prepare(images, self.device) if hasattr(self.image_encoder, "prepare") else \
            self.image_inputs(images)

    @torch.no_grad()
    def forward(self, x):
        """The device half: prepared pixels -> the encoder's features -> the method's embeddings, (B, K)."""
        import evaluate
        enc = self.image_encoder
        f = enc.encode_prepared(x, self.device) if hasattr(enc, "prepare") else enc.encode(x, self.device)
        with evaluate.inference(self.method):
            return self.method.embed_image(f.to(self.device)).float().cpu()

    def encode_files(self, files, batch_size=BATCH, workers=DECODE_WORKERS, tag="[images]"):
        """(N, K) embeddings of image files (token-level methods: (N, Q, K)): batches decoded and resized by
        `workers` threads, up to workers + 1 batches ahead (features.read_ahead), while this thread runs the
        forward of the current one; progress (done, rate, ETA) on stderr. encode_image's values (to float
        rounding: the batches differ)."""
        import evaluate
        from features import read_ahead
        from infra.folder import Progress
        files = list(files)
        if not files:
            return torch.zeros(0)
        progress, parts = Progress(tag, len(files), unit="images", every=5.0), []
        batches = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
        for x in read_ahead(self.prepared, batches, depth=workers + 1, workers=workers):
            parts.append(self.forward(x))
            progress.update(len(parts[-1]))
        progress.close()
        return evaluate.pad_cat(parts)

    def embed_files(self, files, index=None, **pipeline):
        """(N, K) embeddings of image files: each file an index holds (same absolute path, size, mtime and ctime,
        the same run) read from it, the rest encoded (encode_files)."""
        files = list(files)
        rows = index.rows(files) if index is not None and index.run_key == self.run_key else [None] * len(files)
        todo = [f for f, r in zip(files, rows) if r is None]
        if len(todo) < len(files):
            print(f"[index] {len(files) - len(todo)} of {len(files)} images read from the index, {len(todo)} to "
                  f"encode", file=sys.stderr, flush=True)
        fresh = self.encode_files(todo, **pipeline) if todo else None
        if len(todo) < len(files):                 # the index's rows are embeddings this method scores, shaped so
            where = getattr(index, "path", None) or "the image index"
            row = index.emb[[r for r in rows if r is not None][:1]]
            with guard(f"{where}", f"not this run's embeddings; delete it (rm {where}) and run python align.py "
                                   f"index again"):
                if fresh is not None and (row.dim() != fresh.dim() or row.shape[-1] != fresh.shape[-1]):
                    raise ValueError(f"embeddings of shape {tuple(row.shape[1:])}, this run's are "
                                     f"{tuple(fresh.shape[1:])}")
                self.score(row, self.encode_text(["a"]))      # no image encoded: one text, one score
        new = iter(fresh) if fresh is not None else None
        return torch.stack([index.emb[r] if r is not None else next(new) for r in rows]) if files else torch.zeros(0)

    def index(self, files, index=None, **pipeline):
        """An Index of image files: what index (an earlier Index of this run) holds of them unchanged is
        kept, new and changed files are encoded; index's other files that still exist unchanged stay in it
        (a second folder), removed or changed ones drop out."""
        files = [Path(f).absolute() for f in files]
        emb = self.embed_files(files, index, **pipeline)
        keys = [file_key(f) for f in files]
        if index is not None and index.run_key == self.run_key:
            taken = {k[0] for k in keys}
            others = [i for i, k in enumerate(index.keys) if k[0] not in taken and file_key_or_none(k[0]) == k]
            keys += [index.keys[i] for i in others]
            emb = torch.cat([emb, index.emb[others]]) if others else emb
        return Index(keys, emb, self.run_key)

    def similarity(self, images, texts):
        """(N_img, N_txt) scores of raw images (paths, PIL, uint8 tensors) against a list of strings."""
        return self.score(self.encode_image(images), self.encode_text(texts))

    def search(self, images, query):
        """(N_img,) scores of images for one text query (rank them with .argsort(descending=True))."""
        if not isinstance(query, str):
            raise RunError(f"search takes one query (a string), not {type(query).__name__}; for several, "
                           f"similarity(images, queries) gives (N_img, N_queries) scores")
        return self.similarity(images, [query])[:, 0]

    @torch.no_grad()
    def classes(self, class_names, templates=None):
        """The classes' text side, encoded once: (each class's prompts averaged as template_average does,
        the number of templates). Pass it to zero_shot for many batches of images."""
        import evaluate
        if isinstance(class_names, str) or not len(class_names):
            raise RunError(f"class_names {class_names!r}: pass a list of at least one class name, e.g. "
                           f"[\"red circle\", \"blue square\"]")
        bare = next((c for c in class_names if isinstance(c, str) and no_word(c)), None)
        if bare is not None:
            raise RunError(f"the class name {bare!r} holds no word, so its score would be the template's alone; "
                           f"give it words")
        templates = check_templates([templates] if isinstance(templates, str) else list(templates or self.templates))
        prompts = [t.format(c) for c in class_names for t in templates]           # class-major, as align.py
        emb = self.encode_text(prompts)
        _, same = torch.unique(emb.reshape(len(class_names), -1), dim=0, return_inverse=True)   # (C,) row ids
        first = {}
        for j, row in enumerate(same.tolist()):
            i = first.setdefault(row, j)
            if i != j:
                raise RunError(f"the classes {class_names[i]!r} and {class_names[j]!r} read the same to the text "
                               f"encoder (words it does not know, or case and spacing), so their scores would "
                               f"tie; name them apart")
        return evaluate.template_average(emb, len(templates)), len(templates)

    @torch.no_grad()
    def zero_shot(self, images, class_names, templates=None, classes=None):
        """(N, C) zero-shot scores, evaluate.py's: each class's prompts (templates, default the run's data's)
        averaged, scored by class_logits. classes: self.classes(...) computed once. Predicted class: .argmax(1)."""
        return self.class_scores(self.encode_image(images), classes or self.classes(class_names, templates))

    @torch.no_grad()
    def class_scores(self, img_emb, classes):
        """(N, C) zero-shot scores of image embeddings (encode_image, embed_files, an Index's emb) against
        self.classes(...)."""
        import evaluate
        txt, n_templates = classes
        with evaluate.inference(self.method):
            return evaluate.class_logits(self.method, img_emb, txt, n_templates, device=self.device)

    def logit_scale(self):
        """The scale the method's own softmax puts on its scores: 1 / temperature of a contrastive method
        (methods/__init__.py's contrastive_scale; SAIL: its logit scale t); for the others (csa, asif, mlp,
        t2c: no softmax of their own) CLIP's 100 on their cosine-like scores."""
        scale = self.method.contrastive_scale
        return 100.0 if scale is None else float(scale())

    def probabilities(self, scores):
        """(N, C) softmax over the classes of scores at logit_scale: each row sums to 1."""
        return (self.logit_scale() * scores.float()).softmax(dim=-1)


# ---------------------------------------------------------------------------
# Generalized zero-shot: the class names the training captions never held (choices 6-8)
# ---------------------------------------------------------------------------
VOCABULARY = "vocabulary.json"      # infra/folder.write_vocabulary: {word or "word word": count}
CALIBRATION = "calibration.json"    # python align.py calibrate: {gamma, folds, seen, ...} (choice 9)


def read_vocabulary(folder):
    """A run folder's vocabulary.json, or None when it has none (a run of an older version)."""
    path = Path(folder) / VOCABULARY
    if not path.is_file():
        return None
    with guard(f"{path}", "copy the run folder again from where it was made, or delete the file (then classify "
               "cannot tell seen names from novel ones)"):
        vocabulary = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(vocabulary, dict):
            raise ValueError("it is not a {word: count} object")
        return vocabulary


NAMES_SHOWN = 20    # novel class names listed on stderr; the rest counted


def seen_names(names, vocabulary):
    """(C,) bool: each name seen in the training captions: every word and every pair of adjacent words of
    it (lower-cased, infra/folder.WORDS) in vocabulary (choice 6)."""
    from infra.folder import WORDS
    def seen(name):
        w = WORDS.findall(name.lower())
        return bool(w) and all(g in vocabulary for g in [*w, *map(" ".join, zip(w, w[1:]))])
    return torch.tensor([seen(n) for n in names], dtype=torch.bool)


def calibrated_stacking(scores, seen, gamma):
    """(N, C) scores with gamma subtracted from every seen class's column: score(x, c) - gamma * [c is seen]
    (Chao et al., ECCV 2016, §3.2); the prediction is still the argmax."""
    return scores - gamma * seen.to(scores.dtype)


def harmonic_mean(s, u):
    """H = 2 S U / (S + U) of seen and novel top-1 (0 when both are 0)."""
    return 2 * s * u / (s + u) if s + u > 0 else 0.0


def gzsl_top1(scores, labels, seen):
    """(seen top-1, novel top-1, H), percent, of (N, C) scores against labels (N,) in 0..C-1: each side's
    per-class mean top-1 over the classes that have images, the argmax taken over all C classes (choice 8)."""
    hit = (scores.argmax(1) == labels).float()
    def side(on):
        per_class = [hit[labels == c].mean() for c in range(scores.shape[1]) if seen[c] == on and (labels == c).any()]
        return 100 * float(torch.stack(per_class).mean()) if per_class else float("nan")
    s, u = side(True), side(False)
    return s, u, harmonic_mean(s, u)


def choose_gamma(scores, labels, seen):
    """(gamma, H) of the calibrated stacking that maximises H on held-out scores (N, C) with labels (N,), seen
    (C,) bool. Exact, no grid: a prediction flips only where gamma crosses an image's margin (its best seen
    minus its best novel score), so every midpoint between consecutive distinct margins, and one past either
    end, is tried; of equal best H, the median gamma (the middle of the best range; choice 7)."""
    if seen.all() or not seen.any():
        raise ValueError("choose_gamma needs seen and novel classes both")
    margin = (scores[:, seen].max(1).values - scores[:, ~seen].max(1).values).unique()        # sorted
    candidates = torch.cat([margin[:1] - 1, (margin[1:] + margin[:-1]) / 2, margin[-1:] + 1])
    candidates = candidates.unique().tolist()
    H = torch.tensor([gzsl_top1(calibrated_stacking(scores, seen, g), labels, seen)[2] for g in candidates])
    best = [g for g, h in zip(candidates, H.tolist()) if h == H.max()]
    return best[(len(best) - 1) // 2], float(H.max())


# ---------------------------------------------------------------------------
# The commands: python align.py index | classify | search | table
# ---------------------------------------------------------------------------
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm",
                  ".pbm", ".pnm"}
KEY_METRICS = ("retrieval/i2t_r1", "retrieval/t2i_r1", "retrieval/rsum", "top1", "miou_fg", "binding/binding_acc")


def walk_images(folder):
    """The image files under folder: linked folders followed (each real folder once, so a link loop ends),
    hidden files and folders (.DS_Store, macOS's ._x.jpg) left out; a folder that cannot be read is one line."""
    def refuse(e):
        raise RunError(f"{e.filename} cannot be read ({e.strerror}), so its images would be left out; give it "
                       f"read permission (chmod -R u+rX) or pass the other folders")
    files, others, walked = [], [], set()
    for root, dirs, names in os.walk(folder, onerror=refuse, followlinks=True):
        if os.path.realpath(root) in walked:
            dirs[:] = []
            continue
        walked.add(os.path.realpath(root))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        names = [n for n in names if not n.startswith(".") and os.path.isfile(os.path.join(root, n))]
        files += [Path(root, n) for n in names if Path(n).suffix.lower() in IMAGE_SUFFIXES]
        others += [Path(root, n) for n in names if Path(n).suffix.lower() not in IMAGE_SUFFIXES]
    if others:                          # a .heic, a .txt: said, not left out without a word
        print(f"[images] {len(others)} file(s) under {folder} left out, not of an image type read here "
              f"({' '.join(sorted(IMAGE_SUFFIXES))}), e.g. {sorted(others)[0]}", file=sys.stderr, flush=True)
    return sorted(files)


def image_files(paths):
    """The image files of paths (folders, walked recursively, and files), read gate: every file's header is
    read (data.file_scan: no pixel decoded) and a file that is no image is one line naming it, as is a
    name that is not UTF-8 (it could not be printed, nor written to a CSV)."""
    import data
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += walk_images(p)
        elif p.is_file():
            files.append(p)
        else:
            raise RunError(f"{p}: no such file or folder; pass image files or folders of them")
    unique = {}
    for f in files:
        unique.setdefault(os.path.abspath(f), f)        # a file named twice (a folder and its file): once, in order
    files = list(unique.values())
    if not files:
        raise RunError(f"{' '.join(paths)} holds no image file ({', '.join(sorted(IMAGE_SUFFIXES))})")
    for f in files:
        try:
            str(f).encode("utf-8")
        except UnicodeEncodeError:                  # a byte that is no UTF-8, kept by Python as a lone surrogate
            raise RunError(f"{ascii(str(f))}: its name is not valid UTF-8, so it cannot be printed or written to a "
                           f"CSV; rename it (e.g. with convmv) or move it out") from None
    _, faults = data.file_scan(files)
    for fault, found in faults.items():
        path, e = found[0]
        why = f"{fault}: {type(e).__name__}: {first_line(e)}" if e is not None else fault
        raise RunError(f"{path} is {why} ({len(found)} such file(s)); remove it or pass the others")
    return files


def class_names(a):
    """--classes (comma-separated) or --classes-file (one name per line): at least one, none twice."""
    if a.classes_file and a.classes is not None:
        raise RunError("--classes and --classes-file both name the classes; give one of them")
    if a.classes_file:
        with guard(f"--classes-file {a.classes_file}", "pass a UTF-8 text file with one class name per line"):
            if not Path(a.classes_file).is_file() and Path(a.classes_file).exists():    # a fifo would never end
                raise ValueError("it is not a regular file")
            names = [line.strip() for line in Path(a.classes_file).read_text(encoding="utf-8-sig").splitlines()]
    else:
        names = [c.strip() for c in (a.classes or "").split(",")]
    names = [n for n in names if n]
    if not names:
        raise RunError("--classes / --classes-file names no class; give e.g. --classes \"red circle,blue square\"")
    import collections
    twice = sorted(n for n, k in collections.Counter(names).items() if k > 1)
    if twice:
        raise RunError(f"--classes names {twice[0]!r} twice; give each class once")
    bare = [n for n in names if no_word(n)]
    if bare:
        raise RunError(f"--classes names {bare[0]!r}, which holds no word (its score would be the template's "
                       f"alone); give it words, or leave it out")
    return names


def one_slot(template):
    """A prompt template holds {} once, where the class name goes, and no other brace (str.format's fields)."""
    return template.count("{}") == 1 and "{" not in template.replace("{}", "") and "}" not in template.replace("{}", "")


def check_templates(templates):
    for t in templates:
        if not one_slot(t):
            raise RunError(f"--template {t!r}: a prompt holds {{}} once, where the class name goes, and no other "
                           f"brace, e.g. --template \"a photo of a {{}}.\"")
    return templates


def emit(header, rows, csv_path):
    """rows as CSV into csv_path (a new file, through the write gate; "-": stdout), else one aligned line per row."""
    import csv
    import io
    if csv_path:
        text = io.StringIO()
        w = csv.writer(text, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)
        if csv_path == "-":
            sys.stdout.write(text.getvalue())
        else:
            from infra.storage import atomic_write_text
            atomic_write_text(text.getvalue(), csv_path, new=True)
        return
    shown = lambda v: "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(v))   # a newline in a name: \n
    for row in rows:
        print("  ".join(f"{v:.4f}" if isinstance(v, float) else shown(v) for v in row), flush=True)


def emit_json(records, json_path):
    """--json FILE: a JSON list, one record per row, into a new file through the write gate ("-": stdout)."""
    text = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
    if json_path == "-":
        sys.stdout.write(text)
    else:
        from infra.storage import atomic_write_text
        atomic_write_text(text, json_path, new=True)


def check_new(flag, path):
    """--csv / --json FILE before any work: a new file in a folder that exists (never onto a file: the gate
    refuses too)."""
    if path == "":
        raise RunError(f"{flag} '' names no file (an unset shell variable?); pass a new file name, or - for stdout")
    if path and path != "-":
        if path.endswith(("/", os.sep)):
            raise RunError(f"{flag} {path} names a folder; pass a file name (a new file), e.g. {flag} out.csv")
        if os.path.lexists(path):
            raise RunError(f"{flag} {path} exists; pass a new file name (nothing is ever written over), or delete it")
        if not Path(path).parent.is_dir():
            raise RunError(f"{flag} {path}: its folder {Path(path).parent} does not exist; create it or pass another")
        if not os.access(Path(path).parent, os.W_OK | os.X_OK):
            raise RunError(f"{flag} {path}: its folder {Path(path).parent} cannot be written (permissions); pass a "
                           f"file in a folder you can write")


def check_csv(path):
    check_new("--csv", path)


def check_top(top):
    if top is not None and top < 1:
        raise RunError(f"--top {top}: give a count of at least 1 (leave it out for every image / class)")


def index_folder(a):
    """Where a run's image index lives: --index FOLDER, else <RUN>/index/ (the run's own folder)."""
    return Path(a.index) if getattr(a, "index", None) else Path(a.run) / "index"


def read_index(a):
    """The index of --index / <RUN>/index/ when there is one (else None); a folder there that is no index
    holds no images.safetensors and is read as none."""
    folder = index_folder(a)
    if folder.exists() and not folder.is_dir():
        raise RunError(f"--index {folder} is a file, not a folder; pass --index a folder (or leave it out: "
                       f"{Path(a.run) / 'index'})")
    return Index.load(folder) if folder.is_dir() else None


def set_threads(a):
    """--threads N: torch's CPU threads for the forward (0: torch's default, all cores)."""
    if a.threads < 0:
        raise RunError(f"--threads {a.threads}: give 0 (torch's default) or a count of at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)


def index(a):
    """python align.py index RUN FOLDER_OR_FILES...: the images' embeddings under this run, kept in
    <RUN>/index/images.safetensors (or --index FOLDER) for classify and search. A second call encodes only
    new or changed files (path, size, mtime, ctime); files removed drop out."""
    files = image_files(a.paths)
    folder = index_folder(a)
    from infra.storage import check_folder, check_target, file_lock
    check_folder(folder, "--index")
    check_target(folder / Index.FILE)                  # a link or a folder there: refused now, not after the work
    read_index(a)
    set_threads(a)
    model = load(a.run, a.device)
    wait = lambda _: print(f"[index] another index call is writing {folder / Index.FILE}; waiting for it",
                           file=sys.stderr, flush=True)
    with file_lock(folder / ".images.lock", log=wait):  # two calls at once: the second adds to the first's index
        old = read_index(a)                              # as it is now, under the lock
        if old is not None and old.run_key != model.run_key:
            if os.path.realpath(folder) != os.path.realpath(Path(a.run) / "index"):     # not this run's own
                raise RunError(f"{folder / Index.FILE} is the index of another run (or of this run's earlier "
                               f"weights), not written over; pass --index a new folder for {a.run}, or delete it "
                               f"(rm {folder / Index.FILE}) to index these images under {a.run}")
            print(f"[index] {folder / Index.FILE} was made for other weights (the run was trained again); "
                  f"encoding every image", file=sys.stderr, flush=True)
            old = None
        new = model.index(files, old, batch_size=a.batch_size, workers=a.workers, tag="[index]")
        new.write(folder)
    kept = sum(r is not None for r in old.rows(files)) if old is not None else 0
    dropped = len(old.at.keys() - new.at.keys()) if old is not None else 0
    print(f"[index] {len(new)} images in {folder / Index.FILE}: {len(files) - kept} encoded now, {kept} kept as they "
          f"were, {dropped} dropped (removed or changed)", flush=True)


GAMMA_MAX = 1e3    # the scores are cosines or logits (|s| <= the logit scale, <= 100): a larger |gamma| changes no
                   # ranking between seen and novel names, and loses the float32 scores' digits (1e39: -inf, NaN)


def gamma_or_auto(text):
    """--calibrate's value: "auto" (RUN/calibration.json's gamma) or a number."""
    return text if text == "auto" else float(text)


def read_calibration(run):
    """RUN/calibration.json (python align.py calibrate), its gamma a finite number; one line when it is missing."""
    import math
    path = Path(run) / CALIBRATION
    if not path.is_file():
        raise RunError(f"--calibrate auto: {run} holds no {CALIBRATION}; choose gamma on the run's training pairs "
                       f"first (python align.py calibrate {run} --classes ...), or give --calibrate GAMMA")
    with guard(f"{path}", f"run python align.py calibrate {run} again, or give --calibrate GAMMA"):
        record = json.loads(path.read_text(encoding="utf-8"))
        gamma = record.get("gamma") if isinstance(record, dict) else None
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or \
                abs(gamma) > GAMMA_MAX:
            raise ValueError(f"it holds no finite gamma of at most {GAMMA_MAX:g} either way")
    return record


def check_calibrate(gamma, vocabulary, run):
    """--calibrate GAMMA: a finite number, and a run that can tell seen names from novel ones. Returns the gamma
    (--calibrate auto: RUN/calibration.json's, said on stderr) or None."""
    import math
    if isinstance(gamma, float) and not (math.isfinite(gamma) and abs(gamma) <= GAMMA_MAX):
        raise RunError(f"--calibrate {gamma}: give a finite number, at most {GAMMA_MAX:g} either way, the score "
                       f"subtracted from the seen names' "
                       f"(e.g. --calibrate 0.1; python align.py calibrate chooses one on the training pairs)")
    if gamma is not None and vocabulary is None and Path(run).is_dir():      # no folder: load() says so
        raise RunError(f"--calibrate: {run} holds no {VOCABULARY} (a run of an older version), so its seen class "
                       f"names cannot be told from novel ones; leave --calibrate out, or train the run again")
    if gamma == "auto" and Path(run).is_dir():
        record = read_calibration(run)
        print(f"[calibrate] gamma {record['gamma']:.4f} from {Path(run) / CALIBRATION} (chosen by python "
              f"align.py calibrate on the run's training pairs, {len(record.get('seen') or [])} seen names)",
              file=sys.stderr, flush=True)
        return float(record["gamma"])
    return gamma


def say_seen(names, vocabulary, run):
    """The [classes] line on stderr: how many names the training captions held (seen) and the novel ones.
    Returns seen (C,) bool, or None when the run has no vocabulary."""
    if vocabulary is None:
        print(f"[classes] {run} holds no {VOCABULARY} (a run of an older version): seen and novel class names "
              f"cannot be told apart", file=sys.stderr, flush=True)
        return None
    seen = seen_names(names, vocabulary)
    novel = [n for n, s in zip(names, seen.tolist()) if not s]
    shown = ", ".join(novel[:NAMES_SHOWN]) + (f", ... ({len(novel) - NAMES_SHOWN} more)" if len(novel) > NAMES_SHOWN
                                             else "")
    print(f"[classes] {int(seen.sum())} seen in the training captions, {len(novel)} novel"
          f"{': ' + shown if novel else ''}", file=sys.stderr, flush=True)
    return seen


def classify(a):
    """Each image's best class (--top K: the K best, with their probabilities), as lines, CSV or JSON; the
    names seen in the training captions and the novel ones said on stderr; --calibrate GAMMA: calibrated
    stacking, every score (and probability) the calibrated one."""
    names, templates = class_names(a), check_templates(a.template)          # every input read before work
    check_top(a.top)
    vocabulary = read_vocabulary(a.run) if Path(a.run).is_dir() else None
    gamma = check_calibrate(a.calibrate, vocabulary, a.run)
    files, index = image_files(a.paths), read_index(a)
    set_threads(a)
    model = load(a.run, a.device)
    seen = say_seen(names, vocabulary, a.run)
    classes = model.classes(names, templates or None)                       # the prompts, encoded once
    S = model.class_scores(model.embed_files(files, index, batch_size=a.batch_size, workers=a.workers,
                                             tag="[classify]"), classes)   # (N, C)
    if gamma is not None:
        S = calibrated_stacking(S, seen, gamma)
    k = min(a.top or 1, len(names))
    P = model.probabilities(S)                                                # (N, C), rows sum to 1
    top = S.topk(k, dim=1, sorted=True).indices                               # (N, k): by score = by probability
    best = [[str(p), names[int(t[0])], float(s[t[0]])] for p, s, t in zip(files, S, top)]
    if a.json:
        emit_json([dict(image=r[0], **{"class": r[1]}, score=r[2],
                        **({"top": [{"class": names[int(c)], "probability": float(p[c]), "score": float(s[c])}
                                    for c in t]} if a.top else {"scores": dict(zip(names, s.tolist()))}))
                   for r, s, p, t in zip(best, S, P, top)], a.json)
    if a.json and not a.csv:                                     # --json alone: the file, no lines
        return
    if a.top:
        header = ["image", "class", "score"] + [f"{w}_{i + 1}" for i in range(k) for w in ("class", "probability")]
        rows = [r + [v for c in t for v in (names[int(c)], float(p[c]))] for r, p, t in zip(best, P, top)]
        emit(header, rows, a.csv)
    else:                                                        # CSV: every class's score besides the best
        emit(["image", "class", "score", *names], [r + [float(v) for v in s] for r, s in zip(best, S)] if a.csv
             else best, a.csv)


def search(a):
    """Each query's ranking of the images (the images are encoded once for all the queries, or read from
    the index)."""
    if any(not q.strip() for q in a.queries):
        raise RunError("a query is empty; give a text, e.g. \"a red circle\"")
    named = [q for q in a.queries if os.path.lexists(q)]
    if named:
        raise RunError(f"the query {named[0]!r} is a file or folder: search reads one folder (or file) of images, "
                       f"then queries; put the images in one folder, or quote a query that is no path")
    check_top(a.top)
    files, index = image_files([a.folder]), read_index(a)
    set_threads(a)
    model = load(a.run, a.device)
    img = model.embed_files(files, index, batch_size=a.batch_size, workers=a.workers, tag="[search]")
    S = model.score(img, model.encode_text(a.queries))                              # (N, queries)
    many, rows = len(a.queries) > 1, []
    for q, query in enumerate(a.queries):
        order = S[:, q].argsort(descending=True, stable=True)[:a.top]
        rows += [[query] * many + [r + 1, float(S[i, q]), str(files[i])] for r, i in enumerate(order.tolist())]
    if a.json:
        emit_json([{"query": a.queries[0], **dict(zip(["query"] * many + ["rank", "score", "image"], r))}
                   for r in rows], a.json)
    if a.csv or not a.json:
        emit(["query"] * many + ["rank", "score", "image"], rows, a.csv)


def run_folders(root):
    """(runs, unreadable): root when it holds metrics.json, else the folders under it that do, at any depth
    (results/<group>/<run>): never below a run folder, never into a link's folder (a link to a run is read;
    a link loop is not walked), nor a hidden folder (.git, .cache); and the folders that could not be read."""
    found, unreadable, level = [], [], [root]
    while level:
        below = []
        for q in level:
            try:
                if (q / "metrics.json").exists():
                    found.append(q)
                elif q == root or not q.is_symlink():
                    below += [s for s in q.iterdir() if s.is_dir() and not s.name.startswith(".")]
            except OSError:                                     # no read permission
                unreadable.append(q)
        level = sorted(below)
    return sorted(found), unreadable


def finished_runs(paths):
    """{run folder: (config, metrics)} of the finished runs (a config.json with an identity and a metrics.json,
    both readable) among paths and their subfolders, by path; and the folders left out (not runs)."""
    runs, other = {}, []
    for p in map(Path, paths):
        if not p.exists():
            raise RunError(f"{p}: no such folder; pass run folders or folders holding them (results/)")
        found, unreadable = run_folders(p)
        other += unreadable
        for folder in found:
            try:
                if not all((folder / f).is_file() for f in ("config.json", "metrics.json")):   # a fifo, a folder
                    raise ValueError
                config = json.loads((folder / "config.json").read_text())
                metrics = json.loads((folder / "metrics.json").read_text())
                if not isinstance(config, dict) or "identity" not in config or not isinstance(metrics, dict):
                    raise ValueError
                runs[folder] = config, metrics
            except (OSError, ValueError, UnicodeDecodeError):
                other.append(folder)
    return dict(sorted(runs.items())), other


def table(a):
    """Finished runs in one table: run, method, data, seed, epochs and the key figures (all: --metrics all)."""
    from infra.folder import flat_metrics
    runs, other = finished_runs(a.paths)
    if other:
        print(f"[table] left out {len(other)} folder(s) that are not finished runs of align.py: "
              f"{', '.join(map(str, other[:3]))}{' ...' if len(other) > 3 else ''}", file=sys.stderr)
    if not runs:
        raise RunError(f"no finished run (a folder with metrics.json) in {' '.join(a.paths)}")
    rows, columns, names = [], [], [run.name for run in runs]
    for run, (config, metrics) in runs.items():
        flat = {n: v for n, v, _ in flat_metrics(metrics)}
        keep = [n for n in flat if a.metrics == "all" or n.endswith(KEY_METRICS)]
        columns += [n for n in keep if n not in columns]
        name = run.name if names.count(run.name) == 1 else str(run)     # two runs of one name: their paths
        rows.append(({"run": name, "method": config.get("method"), "data": config.get("data"),
                      "seed": config.get("seed"), "epochs": config.get("epochs")}, flat))
    header = ["run", "method", "data", "seed", "epochs", *columns]
    cells = [[info[h] for h in header[:5]] + [flat.get(c, "") for c in columns] for info, flat in rows]
    if a.csv:
        return emit(header, cells, a.csv)
    cell = lambda v: " ".join(str(v).split()).replace("|", "\\|")       # one markdown cell: no newline, no bar
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in cells:
        print("| " + " | ".join(map(cell, row)) + " |")


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(prog="align.py", description="Use finished runs: index a folder of images, "
                                "zero-shot classify images, rank them for text queries, or gather runs into one "
                                "table.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("index", help="keep images' embeddings under a run (RUN/index/), for classify and search")
    i.add_argument("run", help="a finished run folder (results/<method>-<data>-seed<seed>)")
    i.add_argument("paths", nargs="+", metavar="IMAGES", help="folders of images (walked recursively), or image "
                   "files")
    c = sub.add_parser("classify", help="zero-shot classify images: one line per image")
    c.add_argument("run", help="a finished run folder (results/<method>-<data>-seed<seed>)")
    c.add_argument("paths", nargs="+", metavar="IMAGES", help="a folder of images (walked recursively), or image "
                   "files")
    c.add_argument("--classes", default=None, help="class names, comma-separated: \"red circle,blue square\"")
    c.add_argument("--classes-file", default=None, help="a text file of class names, one per line (default: none)")
    c.add_argument("--template", action="append", default=[],
                   help="a prompt with {} for the class name, repeatable (default: the run's data's templates)")
    c.add_argument("--top", type=int, default=None, help="the K best classes of each image with their "
                   "probabilities (softmax at the method's own logit scale) (default: the best class and its score)")
    c.add_argument("--calibrate", type=gamma_or_auto, nargs="?", const="auto", default=None, metavar="GAMMA",
                   help="calibrated stacking (Chao et al., ECCV 2016, §3.2): subtract GAMMA from the score of every "
                   "class name the training captions held (seen; said on stderr), so that novel names are not "
                   "crowded out; the scores and probabilities printed are the calibrated ones. Without a value (or "
                   "auto): the GAMMA that python align.py calibrate RUN chose on the run's training pairs "
                   "(RUN/calibration.json); needs the run's vocabulary.json (default: none, the plain scores)")
    s = sub.add_parser("search", help="rank images for text queries: one line per image and query")
    s.add_argument("run", help="a finished run folder")
    s.add_argument("folder", help="a folder of images (walked recursively), or one image file")
    s.add_argument("queries", nargs="+", metavar="QUERY", help="text queries, e.g. \"a red circle\" (each its own "
                   "ranking; the images are encoded once)")
    s.add_argument("--top", type=int, default=None, help="print only the N best (default: every image)")
    for q in (i, c, s):
        q.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="(default: cpu)")
        q.add_argument("--threads", type=int, default=0, help="torch CPU threads of the forward (default: 0, "
                       "torch's own: all cores)")
        q.add_argument("--batch-size", type=int, default=BATCH, help=f"images per forward (default: {BATCH})")
        q.add_argument("--workers", type=int, default=DECODE_WORKERS, help="threads decoding images ahead of the "
                       f"forward (default: {DECODE_WORKERS})")
        q.add_argument("--index", default=None, metavar="FOLDER", help="the image index's folder (default: "
                       "RUN/index)")
    for q in (c, s):
        q.add_argument("--csv", default=None, metavar="FILE",
                       help="write CSV to FILE, a new file (- for stdout; classify adds every class's score, or "
                            "with --top the K best and their probabilities) (default: lines)")
        q.add_argument("--json", default=None, metavar="FILE",
                       help="write JSON to FILE, a new file (- for stdout): one record per image (search: per "
                            "image and query) (default: lines)")
    t = sub.add_parser("table", help="gather finished run folders into one markdown (or CSV) table")
    t.add_argument("paths", nargs="+", help="run folders, or folders holding them (results/)")
    t.add_argument("--metrics", default="key", choices=["key", "all"],
                   help="key: R@1 both ways, RSum, top-1, mIoU, binding; all: every figure (default: key)")
    t.add_argument("--csv", default=None, metavar="FILE", help="write CSV to FILE, a new file (- for stdout) "
                   "(default: markdown)")
    return p.parse_args(argv)


def main(argv=None):
    """python align.py index | classify | search | table ... (the console script posthoc-align takes the same):
    every input read and checked first (the read gate), then the work; a fault is one error line (RunError)."""
    a = parse_args(argv)
    if sys.stdout is None and a.command != "index" and getattr(a, "csv", None) in (None, "-") and \
            getattr(a, "json", None) in (None, "-"):
        raise RunError("standard output is closed (>&-), so the results would go nowhere; pass --csv FILE or "
                       "--json FILE, or leave stdout open")
    if hasattr(sys.stdout, "reconfigure"):          # an ASCII-only terminal: an accented file name as \xe9
        sys.stdout.reconfigure(errors="backslashreplace")
    check_csv(getattr(a, "csv", None))
    check_new("--json", getattr(a, "json", None))
    if getattr(a, "csv", None) == "-" and getattr(a, "json", None) == "-":
        raise RunError("--csv - and --json - would both write to stdout; give one of them a file")
    if getattr(a, "csv", None) and getattr(a, "json", None) and a.csv != "-" and \
            os.path.realpath(a.csv) == os.path.realpath(a.json):
        raise RunError(f"--csv and --json both name {a.csv}; give each its own file")
    for flag in ("batch_size", "workers"):
        if getattr(a, flag, 1) < 1:
            raise RunError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: give a count of at least 1")
    import warnings
    try:
        with warnings.catch_warnings():    # a library's warning (PIL: a 100-megapixel image, corrupt EXIF): one line
            warnings.showwarning = lambda message, *_, **__: print(f"warning: {message}", file=sys.stderr, flush=True)
            {"index": index, "classify": classify, "search": search, "table": table}[a.command](a)
        if sys.stdout is not None:
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise SystemExit("interrupted: nothing was written") from None
    except BrokenPipeError:          # `| head`: the reader has what it wanted and closed the pipe: no traceback,
        sys.stdout = None            # no flush of the closed pipe at exit either, exit status 0
        raise SystemExit(0) from None
    except OSError as e:             # stdout on a full disk (files go through the write gate, which says its own)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        sys.stdout = None
        raise RunError(f"cannot write the results to standard output ({e.strerror}); free space there, or pass "
                       f"--csv FILE or --json FILE on a disk with room") from None
