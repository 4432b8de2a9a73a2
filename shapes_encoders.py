"""The built-in tiny encoders of the Shapes world, pretrained UNIMODALLY by the project.

A 4-layer CNN trained as a supervised per-patch classifier on labelled Shapes
images (its head rows are what weight recycling reuses) and a 2-layer word
transformer trained by masked-word prediction on captions alone: no image-text
pair is seen before alignment (the post-hoc setting). The default pair (seed 0)
ships in weights/ (SHIPPED); other seeds are pretrained on first use and cached;
load_shapes_encoders returns them frozen, as encoders with the same interface as
the real ones in encoders.py.
"""
import copy
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import shapes
from features import TOKEN_RULE, Features, word_positions, word_tokens
from infra.errors import RunError
from infra.storage import atomic_save, file_lock, fits, load_plain, safe_load, state_fingerprint

SPECIALS = ["[PAD]", "[CLS]", "[MASK]", "[UNK]"]
PAD, CLS, MASK, UNK = range(4)


class WordTokenizer:
    """Whitespace word tokenizer over a fixed vocabulary; [CLS] first, padded to the batch maximum."""

    def __init__(self, vocab, max_len=48):  # max_len: TinyTextEncoder's position table, [CLS] + 47 words
        self.vocab, self.max_len, self.cut = list(vocab), max_len, False
        self.index = {w: i for i, w in enumerate(self.vocab)}

    @staticmethod
    def split(text):
        return text.lower().replace(".", " ").replace(",", " , ").split()

    def words(self, text):
        """The token strings, position-aligned with the encoder's tokens."""
        return ["[CLS]"] + self.split(text)

    def __call__(self, texts):
        ids = [[CLS] + [self.index.get(w, UNK) for w in self.split(t)] for t in texts]
        if not self.cut and max(map(len, ids)) > self.max_len:     # cut as a Hugging Face tokenizer truncates
            self.cut = print(f"[text] captions longer than {self.max_len - 1} words are cut to their first "
                             f"{self.max_len - 1} (shapes-text's length, as a tokenizer truncates)") or True
        ids = [i[:self.max_len] for i in ids]
        L = max(len(i) for i in ids)
        out = torch.full((len(ids), L), PAD, dtype=torch.long)
        for b, i in enumerate(ids):
            out[b, :len(i)] = torch.tensor(i)
        return out, out != PAD  # (B, L) ids, (B, L) mask


class TinyTextEncoder(nn.Module):
    """A 2-layer transformer over words, pretrained by masked-word prediction on captions alone."""

    def __init__(self, vocab_size, D=96, n_layers=2, n_heads=4, max_len=48):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, D)
        self.pos = nn.Parameter(torch.randn(max_len, D) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(D, n_heads, 2 * D, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(n_layers))
        self.norm = nn.LayerNorm(D)
        self.mlm_head = nn.Linear(D, vocab_size)

    def forward(self, ids, mask, layer=-1):
        """(B, L) ids -> (B, L, D) tokens after `layer` (-1: the last, normalised)."""
        x = self.embed(ids) + self.pos[:ids.shape[1]]
        n = len(self.layers) if layer == -1 else layer
        for block in self.layers[:n]:
            x = block(x, src_key_padding_mask=~mask)
        return self.norm(x) if n == len(self.layers) else x


def sincos_2d(D, H, W):
    """Fixed 2D sin-cos position code (MAE / ViT style), (D, H, W): D/2 channels for x, D/2 for y,
    each half sin and cos at D/4 frequencies 1 / 10000^(i / (D/4)), i = 0..D/4-1."""
    assert D % 4 == 0, D
    n = D // 4
    omega = 1.0 / 10000 ** (torch.arange(n) / n)                               # (D/4,)
    def axis(size):                                                            # (D/2, size)
        a = torch.arange(size, dtype=torch.float32)[None] * omega[:, None]
        return torch.cat([a.sin(), a.cos()])
    x, y = axis(W), axis(H)
    return torch.cat([x[:, None, :].expand(-1, H, -1), y[:, :, None].expand(-1, -1, W)])  # (D, H, W)


class TinyImageEncoder(nn.Module):
    """A 4-layer CNN, stride 8: its 8x8 output grid is the patch tokens.

    Pretrained as a supervised classifier: the head (a 1x1 conv = a linear layer per
    patch) predicts the colour-shape class of each patch, plus background. Its rows
    W (C, D) are what the weight-recycling paper recycles.

    pos=True ("shapes-cnn-pos"): a fixed 2D sin-cos position code (sincos_2d)
    is added to the feature map before the last block, the way a ViT adds its position
    embedding before its blocks, so the tokens carry where they are. pos=False (the
    default "shapes-cnn"): only zero padding at the border tells a token where it is.
    Not the default: with PAL (10 epochs, seed 0) retrieval RSum is 503.5 with it
    against 507.9 without, and binding is the same (docs/binding.md).
    """

    def __init__(self, n_classes, D=96, pos=False):
        super().__init__()
        chans = [3, 32, 64, D, D]
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(chans[i], chans[i + 1], 3, stride=2 if i < 3 else 1, padding=1),
                          nn.BatchNorm2d(chans[i + 1]), nn.ReLU()) for i in range(4))
        self.head = nn.Linear(D, n_classes + 1)  # last row: background
        self.pos = pos

    def forward(self, x, layer=-1):
        """(B, 3, S, S) normalised pixels -> (B, D, H, W) feature map after block `layer` (3 or 4 = -1)."""
        n = len(self.blocks) if layer == -1 else layer
        for l, block in enumerate(self.blocks[:n], start=1):
            if self.pos and l == len(self.blocks):             # before the last block
                x = x + sincos_2d(x.shape[1], x.shape[2], x.shape[3]).to(x)  # (B, D, H, W) + (D, H, W)
            x = block(x)
        return x


def shapes_pixels(images):
    """uint8 (B, 3, S, S) -> float, normalised (the tiny CNN's preprocessing)."""
    return (images.float() / 255 - 0.5) / 0.25


def pretrain_text_encoder(seed=0, steps=800, log=print):
    """Masked-word pretraining on Shapes captions alone (no images): 15% of words masked."""
    torch.manual_seed(seed)
    corpus = shapes.text_corpus(20000, seed=seed + 1000)
    vocab = SPECIALS + sorted({w for t in corpus for w in WordTokenizer.split(t)})
    tok = WordTokenizer(vocab)
    model = TinyTextEncoder(len(vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    held_out, train_corpus = corpus[:1000], corpus[1000:]

    def masked_batch(texts):
        ids, mask = tok(texts)
        target = ids.clone()
        pick = (torch.rand(ids.shape, generator=g) < 0.15) & mask & (ids != CLS)
        ids = ids.masked_fill(pick, MASK)
        return ids, mask, target, pick

    t0 = time.time()
    for _step in range(steps):
        idx = torch.randint(len(train_corpus), (64,), generator=g)
        ids, mask, target, pick = masked_batch([train_corpus[i] for i in idx])
        logits = model.mlm_head(model(ids, mask))
        loss = F.cross_entropy(logits[pick], target[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        ids, mask, target, pick = masked_batch(held_out)
        acc = (model.mlm_head(model(ids, mask))[pick].argmax(-1) == target[pick]).float().mean().item()
    log(f"[text encoder] masked-word pretraining: {steps} steps in {time.time() - t0:.0f}s, "
        f"held-out masked-word accuracy {100 * acc:.1f}%")
    return model, tok, acc


def pretrain_image_encoder(seed=0, max_steps=1500, target_acc=0.95, log=print, pos=False):
    """Supervised per-patch classification on labelled Shapes images (no text).

    Per-patch soft cross-entropy over the 24 colour-shape classes + background, object
    patches weighted 5x. Shape is learned after a sudden jump whose
    timing varies, so training stops on a held-out per-object shape accuracy, not a step count.
    """
    torch.manual_seed(seed)
    C = len(shapes.CLASS_NAMES)
    images, masks = shapes.pretrain_images(4000, seed=seed + 2000)
    val_images, val_masks = shapes.pretrain_images(300, seed=seed + 3000)
    model = TinyImageEncoder(C, pos=pos)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max_steps)
    g = torch.Generator().manual_seed(seed)

    def soft_targets(m):  # (B, S, S) -> (B, 8, 8, C + 1) fraction of each class in each patch
        onehot = F.one_hot(m.clamp(max=C), C + 1).permute(0, 3, 1, 2).float()
        return F.avg_pool2d(onehot, 8).permute(0, 2, 3, 1)

    def shape_accuracy():
        model.eval()
        with torch.no_grad():
            logits = model.head(model(shapes_pixels(val_images)).permute(0, 2, 3, 1))  # (N, 8, 8, C + 1)
        model.train()
        y = soft_targets(val_masks)
        obj = y[..., :C].sum(-1) > 0.5       # patches mostly covered by an object
        shape = lambda c: c % len(shapes.SHAPES)
        return (shape(logits[..., :C].argmax(-1)) == shape(y[..., :C].argmax(-1)))[obj].float().mean().item()

    t0, acc = time.time(), 0.0
    for step in range(1, max_steps + 1):
        idx = torch.randint(len(images), (64,), generator=g)
        x = shapes_pixels(images[idx])
        flip = torch.rand(()) < 0.5      # a horizontal flip keeps every class
        x, m = (x.flip(-1), masks[idx].flip(-1)) if flip else (x, masks[idx])
        y = soft_targets(m)
        logp = model.head(model(x).permute(0, 2, 3, 1)).log_softmax(-1)
        weight = 1 + 4 * (y[..., :C].sum(-1) > 0.1)
        loss = (-(y * logp).sum(-1) * weight).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            acc = shape_accuracy()
            if acc >= target_acc and step >= 300:
                break
    model.eval()
    log(f"[image encoder] supervised pretraining: {step} steps in {time.time() - t0:.0f}s, "
        f"held-out patch shape accuracy {100 * acc:.1f}%")
    return model, acc


# EXACT_FORWARD: the features are computed in float64 and stored in float16. Another CPU's kernels
# (AVX-512, AVX2, none) sum in another order: in float32 that flipped the float16 rounding of about
# 1 value in 1,300 (up to 2 ulp of float16), in float64 the difference is 2^-29 times smaller, below
# any float16 rounding step, so every machine caches the same features.
class ShapesImageEncoder:
    """The frozen tiny CNN as an encoder: images -> Features (mean token + 8x8 patch tokens).

    head() returns its classifier rows W (C, D), bias b (C,) and class names,
    background row dropped: what the weight-recycling paper recycles.
    """
    head_reads = "patches"  # its head classifies each patch token; real heads read `pooled` (note 3)

    n_layers = 4  # layer l = the feature map after block l (3 and 4 keep the 8x8 grid); -1 = 4

    def __init__(self, model, layer=-1):
        self.model, self.layer = model.eval(), layer
        self.model64 = copy.deepcopy(self.model).double()   # encode's forward (EXACT_FORWARD)
        # the feature cache key holds the name: the position-aware CNN gets its own
        self.name = SHAPES_CNN_VERSION if model.pos else "shapes-cnn"
        self.preprocess = "uint8/255, mean 0.5, std 0.25; float64 forward"
        self.fingerprint = state_fingerprint(model.state_dict())

    @property
    def dim(self):
        # after block `layer`
        return self.model.blocks[(self.n_layers if self.layer == -1 else self.layer) - 1][0].out_channels

    @torch.no_grad()
    def encode(self, images, device="cpu"):
        pixels = shapes_pixels(torch.as_tensor(images).to(device)).double()
        fmap = self.model64.to(device)(pixels, self.layer).float()          # (B, D, H, W), EXACT_FORWARD
        B, D, H, W = fmap.shape
        patches = fmap.flatten(2).transpose(1, 2)                            # (B, H*W, D)
        tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)     # (B, 1 + H*W, D)
        return Features(tokens=tokens.cpu(), mask=torch.ones(B, 1 + H * W, dtype=torch.bool),
                        pooled=tokens[:, 0].cpu(), grid=(H, W))

    def head(self):
        head = self.model.head                           # host rows, wherever the encoder ran (Module.to is in place)
        return head.weight[:-1].detach().cpu().clone(), head.bias[:-1].detach().cpu().clone(), list(shapes.CLASS_NAMES)

    @torch.no_grad()
    def pooled_layers(self, images, device="cpu"):
        """{layer: (B, D_l) mean feature after block l} for l = 1..4 (layer selection)."""
        x, m = shapes_pixels(torch.as_tensor(images).to(device)), self.model.to(device)
        out = {}
        for l, block in enumerate(m.blocks, start=1):          # forward()'s blocks, each output kept once
            if m.pos and l == len(m.blocks):
                x = x + sincos_2d(x.shape[1], x.shape[2], x.shape[3]).to(x)
            x = block(x)
            out[l] = x.mean((2, 3))                             # (B, D_l) on device
        return out


class ShapesTextEncoder:
    """The frozen tiny word transformer: texts -> Features (the words; pooled = masked mean over [CLS] + words)."""
    name = "shapes-text"

    def __init__(self, model, tokenizer, layer=-1):
        self.model, self.tokenizer, self.layer = model.eval(), tokenizer, layer
        self.model64 = copy.deepcopy(self.model).double()   # encode's forward (EXACT_FORWARD)
        self.dim = model.embed.embedding_dim
        self.preprocess = f"lowercase words; {TOKEN_RULE}; float64 forward"
        self.fingerprint = state_fingerprint(model.state_dict(), tokenizer.vocab)

    @torch.no_grad()
    def encode(self, texts, device="cpu"):
        ids, real = self.tokenizer(texts)
        h = self.model64.to(device)(ids.to(device), real.to(device), self.layer).cpu() * real[..., None]  # (B, L, D)
        pooled = (h.sum(1) / real.sum(1, keepdim=True)).float()      # over [CLS] + words
        h = h.float()
        tokens, mask = word_tokens(h, real, ids == CLS)              # the words (token contract)
        return Features(tokens=tokens, mask=mask, pooled=pooled)

    def words(self, texts):
        """Word strings, position-aligned with encode()'s tokens."""
        ids, real = self.tokenizer(texts)
        idx, mask = word_positions(real, ids == CLS)
        return [[self.tokenizer.words(t)[j] for j in idx[b][mask[b]].tolist()] for b, t in enumerate(texts)]

    @torch.no_grad()
    def pooled_layers(self, texts, device="cpu"):
        """{layer: (B, D) masked mean after block l} for l = 1..n_layers (the last normalised)."""
        ids, mask = self.tokenizer(texts)
        model, ids, mask = self.model.to(device), ids.to(device), mask.to(device)
        m = mask[..., None].float()
        x, out = model.embed(ids) + model.pos[:ids.shape[1]], {}
        for l, block in enumerate(model.layers, start=1):      # forward()'s blocks, each output kept once
            x = block(x, src_key_padding_mask=~mask)
            h = model.norm(x) if l == len(model.layers) else x
            out[l] = (h * m).sum(1) / m.sum(1)                  # (B, D) on device
        return out

    @property
    def n_layers(self):
        return len(self.model.layers)


PRETRAIN_PROCESSES = 2   # a cold start pretrains the two tiny encoders at once, one process each

SHAPES_CNN_VERSION = "shapes-cnn-pos1"  # the position-aware tiny CNN: its checkpoint and feature keys


def load_shapes_encoders(cache_dir, seed=0, image_layer=-1, text_layer=-1, log=print, image_pos=False):
    """The two tiny encoders, pretrained unimodally on first use and cached in cache_dir/encoders.
    image_pos: the position-aware CNN ("shapes-cnn-pos", its own cache keys) instead of the default one."""
    # concurrent runs pretrain once
    with file_lock(Path(cache_dir) / "locks" / f"shapes-encoders-seed{seed}.lock", log):
        return _load_shapes_encoders(cache_dir, seed, image_layer, text_layer, log, image_pos)


def _pretrain(which, seed, pos, out):
    """One tiny encoder pretrained on one torch thread, as the main process would on one; written to
    out (a plain torch file: state_dict, vocabulary or None, held-out accuracy). Run by pretrain_both."""
    torch.set_num_threads(1)
    if which == "image":
        model, acc = pretrain_image_encoder(seed, pos=pos)
        vocab = None
    else:
        model, tok, acc = pretrain_text_encoder(seed)
        vocab = tok.vocab
    atomic_save({"state": model.state_dict(), "vocab": vocab, "acc": acc}, out)


def pretrain_both(seed, pos, folder, log=print):
    """Both tiny encoders pretrained at once, one Python process and one torch thread each: they share
    nothing and each seeds its own generators, so the weights are the ones of pretraining them one
    after the other on one thread, bit for bit, in the time of the slower one on two free cores.
    The workers are fresh interpreters (`python -c`), so no caller's script is re-imported.
    Returns {"image": ..., "text": ...} as _pretrain writes them."""
    import subprocess
    import sys
    log("[encoders] not cached: pretraining the image and the text encoder at once, one process and one thread "
        "each (about a minute on an idle machine)")
    here = str(Path(__file__).resolve().parent)
    outs = {w: Path(folder) / f".pretrain-{w}-seed{seed}.tmp{os.getpid()}.pt" for w in ("image", "text")}
    code = "import sys; sys.path.insert(0, sys.argv[1]); import shapes_encoders as s; " \
           "s._pretrain(sys.argv[2], int(sys.argv[3]), sys.argv[4] == 'True', sys.argv[5])"
    procs = {w: subprocess.Popen([sys.executable, "-c", code, here, w, str(seed), str(pos), str(outs[w])],
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}) for w in outs}
    try:
        failed = [w for w, p in procs.items() if p.wait() != 0]
        if failed:
            raise RunError(f"pretraining the tiny {' and '.join(failed)} encoder failed (its error is "
                             f"above); rerun, or remove the cache's encoders/ folder")
        return {w: load_plain(out) for w, out in outs.items()}
    finally:
        for w, p in procs.items():
            if p.poll() is None:                                  # Ctrl-C here: stop the workers too
                p.kill()
                p.wait()
            outs[w].unlink(missing_ok=True)


# The default pair (seed 0, no position code) is shipped in the repository: a float32 state_dict of
# each, made by pretrain_both on one thread each and checked by its sha256, so no run depends on how
# another CPU's kernels round a 1,100-step pretraining (another AVX or MKL code path pretrains other
# weights; alignment from the same weights prints the same figures). `python shapes_encoders.py
# --remake` pretrains them again and prints the line below for the new file.
SHIPPED = Path(__file__).resolve().parent / "weights" / "shapes-encoders-seed0.pt"
SHIPPED_SHA256 = "fd4539c55fd5a89ab49a80158e14634fe35ad106bc175e9eb4d13e8f9f0a0691"


def sha256(path):
    import hashlib
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_shipped(path=SHIPPED, expect=SHIPPED_SHA256):
    """The shipped weights {"image", "text", "vocab", "acc"}, refused unless their sha256 is `expect`."""
    if not Path(path).is_file():
        raise RunError(f"{path} is missing: the tiny encoders' weights are part of the repository "
                         f"(git checkout -- weights/), or remake them: python shapes_encoders.py --remake")
    got = sha256(path)
    if got != expect:
        raise RunError(f"{path} has sha256 {got[:12]}..., not the {expect[:12]}... this code ships; restore "
                         f"it (git checkout -- weights/) or remake it: python shapes_encoders.py --remake")
    return load_plain(path)


def remake(seed=0, out=SHIPPED, log=print):
    """Pretrain the default pair again (pretrain_both) and write it to out; returns its sha256."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        done = pretrain_both(seed, False, tmp, log)
    # a plain file (no run-dependent key or checksum): its bytes are a function of the weights alone
    atomic_save({"image": done["image"]["state"], "text": done["text"]["state"], "vocab": done["text"]["vocab"],
                    "acc": {"image": done["image"]["acc"], "text": done["text"]["acc"]}}, out)
    digest = sha256(out)
    log(f"[encoders] wrote {out}: held-out accuracy image {100 * done['image']['acc']:.1f}%, "
        f"text {100 * done['text']['acc']:.1f}%\nSHIPPED_SHA256 = \"{digest}\"  (shapes_encoders.py)")
    return digest


def _load_shapes_encoders(cache_dir, seed, image_layer, text_layer, log, image_pos):
    if seed == 0 and not image_pos:                       # the shipped pair
        w = load_shipped()
        image_model, tok = TinyImageEncoder(len(shapes.CLASS_NAMES)), WordTokenizer(w["vocab"])
        text_model = TinyTextEncoder(len(tok.vocab))
        image_model.load_state_dict(w["image"])
        text_model.load_state_dict(w["text"])
        for p in list(image_model.parameters()) + list(text_model.parameters()):
            p.requires_grad_(False)  # frozen: the post-hoc setting
        return (ShapesImageEncoder(image_model.eval(), image_layer),
                ShapesTextEncoder(text_model.eval(), tok, text_layer))
    tag = SHAPES_CNN_VERSION if image_pos else "shapes-cnn"
    path_i = Path(cache_dir) / "encoders" / f"{tag}-seed{seed}.pt"
    path_t = Path(cache_dir) / "encoders" / f"shapes-text-seed{seed}.pt"
    saved_i = safe_load(path_i, expect_key=f"{tag}-{seed}")
    saved_t = safe_load(path_t, expect_key=f"shapes-text-{seed}")
    if saved_i is None and saved_t is None and PRETRAIN_PROCESSES > 1:     # a cold start: both at once
        path_i.parent.mkdir(parents=True, exist_ok=True)
        done = pretrain_both(seed, image_pos, path_i.parent, log)
        saved_i = {"key": f"{tag}-{seed}", "state": done["image"]["state"], "acc": done["image"]["acc"]}
        saved_t = {"key": f"shapes-text-{seed}", "state": done["text"]["state"], "vocab": done["text"]["vocab"],
                   "acc": done["text"]["acc"]}
        atomic_save(saved_i, path_i)
        atomic_save(saved_t, path_t)
    image_model = TinyImageEncoder(len(shapes.CLASS_NAMES), pos=image_pos)
    if saved_i is None or not fits(image_model, saved_i["state"], path_i):   # missing, corrupt or of other shapes
        log("[image encoder] not cached: pretraining it on labelled Shapes images (about a minute on an idle machine)")
        image_model, acc = pretrain_image_encoder(seed, log=log, pos=image_pos)
        atomic_save({"key": f"{tag}-{seed}", "state": image_model.state_dict(), "acc": acc}, path_i)
    if saved_t is not None:
        tok = WordTokenizer(saved_t["vocab"])
        text_model = TinyTextEncoder(len(tok.vocab))
    if saved_t is None or not fits(text_model, saved_t["state"], path_t):
        log("[text encoder] not cached: pretraining it on Shapes captions alone (about a minute on an idle machine)")
        text_model, tok, acc = pretrain_text_encoder(seed, log=log)
        atomic_save({"key": f"shapes-text-{seed}", "state": text_model.state_dict(), "vocab": tok.vocab, "acc": acc},
                    path_t)
    for p in list(image_model.parameters()) + list(text_model.parameters()):
        p.requires_grad_(False)  # frozen: the post-hoc setting
    return ShapesImageEncoder(image_model, image_layer), ShapesTextEncoder(text_model, tok, text_layer)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="The tiny Shapes encoders' shipped weights.")
    ap.add_argument("--remake", action="store_true", help=f"pretrain the default pair again and write {SHIPPED.name}")
    ap.add_argument("--out", default=str(SHIPPED), help="where --remake writes them")
    args = ap.parse_args()
    if args.remake:
        remake(out=args.out)
    else:
        print(f"{SHIPPED}: sha256 {sha256(SHIPPED)} (this code ships {SHIPPED_SHA256})")
