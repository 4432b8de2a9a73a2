"""The one data structure every stage passes around: frozen encoder outputs.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
from dataclasses import dataclass, replace

import torch


@dataclass
class Features:
    """Frozen token features of B samples of one modality.

    tokens: (B, T, D) float. Images: token 0 is the global token (CLS, or the
            mean patch for the CNN), tokens 1..H*W are the patches in row-major
            order, any further tokens (registers) come last. Texts: the
            encoder's tokens, CLS/BOS first, padded at the end.
    mask:   (B, T) bool, True for a real token, False for padding.
    pooled: (B, D) float, what global methods use (CLS or masked mean).
    grid:   (H, W) of the image patch grid, None for text / for global vectors.
    """
    tokens: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor
    grid: tuple | None = None

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, idx):
        """Rows idx (slice, index tensor or list); trims padding columns no row uses."""
        mask = self.mask[idx]
        t = int(mask.sum(1).max()) if len(mask) else 0
        # real tokens are never after padding, so the first t columns hold them all
        t = max(t, 1) if self.grid is None else self.tokens.shape[1]
        return replace(self, tokens=self.tokens[idx, :t], mask=mask[:, :t], pooled=self.pooled[idx])

    def to(self, device, dtype=torch.float32):
        """Move to device, floats to dtype (caches hold fp16; methods compute in fp32)."""
        return replace(self, tokens=torch.as_tensor(self.tokens).to(device, dtype),
                       mask=torch.as_tensor(self.mask).to(device),
                       pooled=torch.as_tensor(self.pooled).to(device, dtype))

    def patches(self):
        """(B, H*W, D) the patch tokens only, in grid order (images only)."""
        H, W = self.grid
        return self.tokens[:, 1:1 + H * W]

    @staticmethod
    def from_vectors(x):
        """Global vectors (B, D) as one-token sequences (e.g. classifier-head rows)."""
        return Features(tokens=x[:, None], mask=torch.ones(len(x), 1, dtype=torch.bool), pooled=x)

    @staticmethod
    def cat(parts):
        """Concatenate along the batch, padding tokens to the longest."""
        T = max(p.tokens.shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]), value=v)
        return Features(tokens=torch.cat([pad(p.tokens, 0) for p in parts]),
                        mask=torch.cat([pad(p.mask, False) for p in parts]),
                        pooled=torch.cat([p.pooled for p in parts]), grid=parts[0].grid)


# ---------------------------------------------------------------------------
# Built-in tiny encoders for the Shapes world, pretrained UNIMODALLY by the project
# ---------------------------------------------------------------------------
import hashlib
import math
import os
import time
from pathlib import Path

import torch.nn as nn
import torch.nn.functional as F

SPECIALS = ["[PAD]", "[CLS]", "[MASK]", "[UNK]"]
PAD, CLS, MASK, UNK = range(4)


class WordTokenizer:
    """Whitespace word tokenizer over a fixed vocabulary; [CLS] first, padded to the batch maximum."""

    def __init__(self, vocab):
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}

    @staticmethod
    def split(text):
        return text.lower().replace(".", " ").replace(",", " , ").split()

    def words(self, text):
        """The token strings, position-aligned with the encoder's tokens."""
        return ["[CLS]"] + self.split(text)

    def __call__(self, texts):
        ids = [[CLS] + [self.index.get(w, UNK) for w in self.split(t)] for t in texts]
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


class TinyImageEncoder(nn.Module):
    """A 4-layer CNN, stride 8: its 8x8 output grid is the patch tokens (DESIGN.md trial).

    Pretrained as a supervised classifier: the head (a 1x1 conv = a linear layer per
    patch) predicts the colour-shape class of each patch, plus background. Its rows
    W (C, D) are what the weight-recycling paper recycles.
    """

    def __init__(self, n_classes, D=96):
        super().__init__()
        chans = [3, 32, 64, D, D]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(chans[i], chans[i + 1], 3, stride=2 if i < 3 else 1, padding=1),
                                                  nn.BatchNorm2d(chans[i + 1]), nn.ReLU()) for i in range(4))
        self.head = nn.Linear(D, n_classes + 1)  # last row: background

    def forward(self, x, layer=-1):
        """(B, 3, S, S) normalised pixels -> (B, D, H, W) feature map after block `layer` (3 or 4 = -1)."""
        for block in self.blocks[:len(self.blocks) if layer == -1 else layer]:
            x = block(x)
        return x


def shapes_pixels(images):
    """uint8 (B, 3, S, S) -> float, normalised (the tiny CNN's preprocessing)."""
    return (images.float() / 255 - 0.5) / 0.25


def atomic_save(obj, path):
    """torch.save to a temporary name, then rename: an interrupted run leaves no half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def safe_load(path, expect_key=None):
    """Load a cache file, or None when missing, unreadable or written for another key (then it is rebuilt)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated / corrupt file
        print(f"[cache] {path} is unreadable ({type(e).__name__}); rebuilding it")
        return None
    if expect_key is not None and (not isinstance(obj, dict) or obj.get("key") != expect_key):
        print(f"[cache] {path} was written for other settings; rebuilding it")
        return None
    return obj


def pretrain_text_encoder(seed=0, steps=800, log=print):
    """Masked-word pretraining on Shapes captions alone (no images): 15% of words masked."""
    import data
    torch.manual_seed(seed)
    corpus = data.text_corpus(20000, seed=seed + 1000)
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
    for step in range(steps):
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


def pretrain_image_encoder(seed=0, max_steps=1500, target_acc=0.95, log=print):
    """Supervised per-patch classification on labelled Shapes images (no text).

    Per-patch soft cross-entropy over the 24 colour-shape classes + background, object
    patches weighted 5x (DESIGN.md trial). Shape is learned after a sudden jump whose
    timing varies, so training stops on a held-out per-object shape accuracy, not a step count.
    """
    import data
    torch.manual_seed(seed)
    C = len(data.CLASS_NAMES)
    images, masks = data.pretrain_images(4000, seed=seed + 2000)
    val_images, val_masks = data.pretrain_images(300, seed=seed + 3000)
    model = TinyImageEncoder(C)
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
        shape = lambda c: c % len(data.SHAPES)
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


class ShapesImageEncoder:
    """The frozen tiny CNN as an encoder: images -> Features (mean token + 8x8 patch tokens).

    head() returns its classifier rows W (C, D), bias b (C,) and class names,
    background row dropped: what the weight-recycling paper recycles.
    """
    name = "shapes-cnn"

    def __init__(self, model, layer=-1):
        self.model, self.layer = model.eval(), layer
        self.dim = model.blocks[layer].__getitem__(0).out_channels
        self.preprocess = "uint8/255, mean 0.5, std 0.25"

    @torch.no_grad()
    def encode(self, images, device="cpu"):
        fmap = self.model.to(device)(shapes_pixels(torch.as_tensor(images).to(device)), self.layer)  # (B, D, H, W)
        B, D, H, W = fmap.shape
        patches = fmap.flatten(2).transpose(1, 2)                            # (B, H*W, D)
        tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)     # (B, 1 + H*W, D)
        return Features(tokens=tokens.cpu(), mask=torch.ones(B, 1 + H * W, dtype=torch.bool),
                        pooled=tokens[:, 0].cpu(), grid=(H, W))

    def head(self):
        import data
        return self.model.head.weight[:-1].detach().clone(), self.model.head.bias[:-1].detach().clone(), list(data.CLASS_NAMES)


class ShapesTextEncoder:
    """The frozen tiny word transformer: texts -> Features ([CLS] + words, pooled = masked mean)."""
    name = "shapes-text"

    def __init__(self, model, tokenizer, layer=-1):
        self.model, self.tokenizer, self.layer = model.eval(), tokenizer, layer
        self.dim = model.embed.embedding_dim
        self.preprocess = "lowercase words"

    @torch.no_grad()
    def encode(self, texts, device="cpu"):
        ids, mask = self.tokenizer(texts)
        tokens = self.model.to(device)(ids.to(device), mask.to(device), self.layer).cpu()  # (B, L, D)
        tokens = tokens * mask[..., None]
        pooled = tokens.sum(1) / mask.sum(1, keepdim=True)
        return Features(tokens=tokens, mask=mask, pooled=pooled)

    def words(self, texts):
        return [self.tokenizer.words(t) for t in texts]


def load_shapes_encoders(cache_dir, seed=0, image_layer=-1, text_layer=-1, log=print):
    """The two tiny encoders, pretrained unimodally on first use and cached in cache_dir/encoders."""
    path_i = Path(cache_dir) / "encoders" / f"shapes-cnn-seed{seed}.pt"
    path_t = Path(cache_dir) / "encoders" / f"shapes-text-seed{seed}.pt"
    import data
    saved = safe_load(path_i, expect_key=f"shapes-cnn-{seed}")
    image_model = TinyImageEncoder(len(data.CLASS_NAMES))
    if saved is None:
        log("[image encoder] not cached: pretraining it on labelled Shapes images (about a minute)")
        image_model, acc = pretrain_image_encoder(seed, log=log)
        atomic_save({"key": f"shapes-cnn-{seed}", "state": image_model.state_dict(), "acc": acc}, path_i)
    else:
        image_model.load_state_dict(saved["state"])
    saved = safe_load(path_t, expect_key=f"shapes-text-{seed}")
    if saved is None:
        log("[text encoder] not cached: pretraining it on Shapes captions alone (about a minute)")
        text_model, tok, acc = pretrain_text_encoder(seed, log=log)
        atomic_save({"key": f"shapes-text-{seed}", "state": text_model.state_dict(), "vocab": tok.vocab, "acc": acc}, path_t)
    else:
        tok = WordTokenizer(saved["vocab"])
        text_model = TinyTextEncoder(len(tok.vocab))
        text_model.load_state_dict(saved["state"])
    for p in list(image_model.parameters()) + list(text_model.parameters()):
        p.requires_grad_(False)  # frozen: the post-hoc setting
    return ShapesImageEncoder(image_model, image_layer), ShapesTextEncoder(text_model, tok, text_layer)


# ---------------------------------------------------------------------------
# Feature extraction, run once and cached
# ---------------------------------------------------------------------------
def cache_key(**parts):
    """A readable file stem plus a hash of every setting, so a changed setting never reads stale features."""
    text = repr(sorted(parts.items()))
    return f"{parts.get('dataset')}-{parts.get('split')}-{parts.get('modality')}-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def extract(encoder, inputs, cache_dir, batch_size=256, device="cpu", **key_parts):
    """Features of all inputs (images or texts), from the cache when present.

    Stored fp16 (tokens, pooled) with the mask and grid; written atomically; a file
    that is unreadable or was written for other settings is rebuilt, never read.
    """
    key = cache_key(encoder=encoder.name, layer=encoder.layer, preprocess=encoder.preprocess, n=len(inputs), **key_parts)
    path = Path(cache_dir) / "features" / f"{key}.pt"
    saved = safe_load(path, expect_key=key)
    if saved is not None:
        return Features(saved["tokens"], saved["mask"], saved["pooled"], saved["grid"])
    parts = [encoder.encode(inputs[i:i + batch_size], device) for i in range(0, len(inputs), batch_size)]
    feats = Features.cat(parts)
    atomic_save({"key": key, "tokens": feats.tokens.half(), "mask": feats.mask, "pooled": feats.pooled.half(),
                 "grid": feats.grid}, path)
    return Features(feats.tokens.half(), feats.mask, feats.pooled.half(), feats.grid)


def load_encoders(image_name, text_name, cache_dir, image_layer=-1, text_layer=-1):
    """The frozen (image, text) encoders by name. Built in: shapes-cnn, shapes-text."""
    known = {"shapes-cnn", "shapes-text"}
    for name in (image_name, text_name):
        if name not in known:
            raise SystemExit(f"error: unknown encoder {name!r}. Built-in encoders: {sorted(known)}.")
    return load_shapes_encoders(cache_dir, 0, image_layer, text_layer)
