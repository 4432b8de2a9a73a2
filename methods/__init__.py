"""Every alignment method, found by name. One file per method; each subclasses `Method` below,
which declares the interface and its defaults and holds no logic.

The interface (align.py and evaluate.py use only this):

    method = METHODS[name](d_image, d_text, **hp)      # hp: keyword hyperparameters (--hp NAME=VALUE); one
                                                       # __init__ resolves (PAL's pooling None -> "cap") it keeps
                                                       # under its own name: config.json's "hp" records that value
    method.defaults -> dict                            # the paper's lr / epochs / batch_size / weight_decay /
                                                       # optimizer ("adam" | "adamw"), optional betas, grad_clip;
                                                       # "steps" instead of "epochs": a step budget whatever the
                                                       # data size, epochs = ceil(steps / steps per epoch)
    method.embed_image(img) -> emb  # (B, K) global, or (B, Q, K) token-level (CoV)
    method.embed_text(txt)  -> emb  # (B, K) global, or (B, L, K) token-level; padded words exactly 0
    method.score(img_emb, txt_emb) -> (N_img, N_txt)   # higher = more similar
    method.dense_image(img) -> (B, H*W, ...)  # per patch, each slice [:, p] a valid image emb for score()

Each method defines those five. What it may define besides, with the default `Method` gives:

    ranges = {}                     # valid values, declared once next to the defaults:
                                    # {hp name or loop setting: "[lo, hi)" interval | (choices)};
                                    # align.py checks every --hp (type of the __init__ default,
                                    # then range) and --batch-size / --lr / ... before anything
                                    # runs. Loop default: batch_size "[2, inf)" (contrastive).
    fit = None                      # closed-form methods (CSA, ASIF): fit(img, txt), img, txt = Features
                                    # of all train pairs. None: nothing to fit.
    loss = None                     # trained methods: loss(img, txt) -> (loss, logs); img, txt = Features
                                    # of a batch of pairs; logs {name: 0-dim detached tensor or float},
                                    # no host sync: align.py prints their epoch means. None: no training loop.
    analyse = None                  # analyse(img, txt, images, words, figure) -> dict; figure(PIL image, name)
    contrastive_scale = None        # contrastive methods: contrastive_scale() -> float | tensor, 1 / temperature
                                    # of the logits; --hard-negatives adds terms at this scale. None: not
                                    # contrastive.
    contrastive_score(img_emb, txt_emb) -> (N_img, N_txt)   # the score its contrastive loss scales: score()
                                    # (FILIP: its image -> text half). Keeps its gradient (evaluate.py runs
                                    # inference under no_grad).
    split_loss = False              # True: loss reads the batch only through embed_image / embed_text, so
                                    # torchrun can split the batch across ranks (infra/distributed.py). False: rank 0.
    refuses_align_data = {}         # {--align-data mode: why} the method cannot train on. A classifier-head
                                    # row (weight recycling) is one vector: Features with one token
                                    # (pooled = token 0) and, beside pairs, empty patch slots.
    holds_out = 0.0                 # trained methods: the share of the alignment images held out (train.py);
                                    # > 0: validation each epoch, and the best epoch's weights kept (SAIL)
    fit_reads_patches = False       # closed forms: True, fit(img, txt, patches) also gets the images' patch
                                    # tokens (CSA's held-out dense score); a fit that chose a setting sets
                                    # self.choice = {"setting", "chosen", "table"}, which the run prints
    reads_head_rows = False         # True: __init__ takes head_rows=None, and align.py passes what the image
                                    # encoder's head reads ("pooled" | "patches") when the alignment data is
                                    # head rows alone (PAL).

Features (features.py) holds tokens (B, T, D), mask (B, T), pooled (B, D), grid (H, W).
Token-level embeddings are padded with zeros when evaluate.py concatenates batches,
so score() of a token-level method treats all-zero rows as padding.
"""
import torch.nn as nn


class Method(nn.Module):
    """The interface's defaults (the docstring above); no logic."""
    ranges = {}
    hp_words = {}
    fit = None
    loss = None
    analyse = None
    contrastive_scale = None
    split_loss = False
    refuses_align_data = {}
    reads_head_rows = False
    holds_out = 0.0
    fit_reads_patches = False

    def contrastive_score(self, img_emb, txt_emb):
        return self.score(img_emb, txt_emb)


from .asif import ASIF
from .cov import CoV
from .csa import CSA
from .fa import FA
from .filip import FILIP
from .linear import Linear
from .mlp import MLP
from .pal import PAL
from .pal_rel import PALRel
from .sail import SAIL
from .structure import MLPRS, LinearRS
from .t2c import T2C
from .text_guided import TextGuided

METHODS = {
    "pal": PAL,                # PAL: learnable anchors + cross-attention pooling
    "pal_rel": PALRel,         # a variant, not a paper's: PAL + where each anchor looks
    "cov": CoV,                # CoV-Align: text-free regions, region-word max-sum
    "text_guided": TextGuided, # LAPS/SPARC-style baseline CoV beats
    "filip": FILIP,            # FILIP late interaction, all patches x words
    "fa": FA,                  # FA (freeze-align): CLS + local token projectors
    "linear": Linear,          # linear heads + InfoNCE (CLIP-style)
    "linear_rs": LinearRS,     # STRUCTURE, linear head
    "mlp_rs": MLPRS,           # STRUCTURE, residual low-rank head
    "csa": CSA,                # CCA, closed form
    "asif": ASIF,              # training-free relative representations
    "mlp": MLP,                # weight recycling's MLP aligner (text -> image)
    "t2c": T2C,                # text-to-concepts (linear text -> image)
    "sail": SAIL,              # SAIL: StarMLP + SigLIP
}
