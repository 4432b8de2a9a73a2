"""SAIL: star-MLP alignment heads trained with the sigmoid (SigLIP) loss.

Zhang et al., "Assessing and Learning Alignment of Unimodal Vision and Language
Models" (CVPR 2025), a baseline of the weight-recycling paper. Each modality gets
a head on its frozen pooled feature:

    g(x) = W_g (ReLU6(W_1 x_n) * W_2 x_n),   x_n = LayerNorm(x)         (star MLP, * elementwise)
    h_v = normalise(g_v(x)),  h_l = normalise(g_l(y))                    (B, K)
    logits_ij = t h_v,i . h_l,j + b,   z_ij = +1 if i = j else -1
    L = -1/B sum_ij log sigmoid(z_ij logits_ij)   (SigLIP: Zhai et al., "Sigmoid Loss for
                                                   Language Image Pre-Training", ICCV 2023, Eq. 1)

Symbols -> variables: W_1, W_2, W_g -> .f1, .f2, .g of each StarMLP; t -> log_t.exp();
b -> self.b; K -> K; width -> hidden = width * D_in.

Deviations / choices:
1. "width x8" is read as hidden = 8 x the INPUT dimension of each side (as in a public star-MLP
   head); the output dimension is K = 512 on both sides (SAIL's released script uses 1024; 512 is the
   shared dimension of the other heads here).
2. The scale t is learned through log t (init log 20 -> t = 20) so it stays positive; the bias b
   starts at -10, SigLIP's init. Neither is clipped.
3. AdamW, wd 1e-4, batch 256, up to 40 epochs (SAIL's own recipe, Lion, lr 1e-5, batch 32768, 10% warm-up,
   xavier init, is not reproduced), and the schedule is chosen per run by a stop on validation: the best
   schedule depends on the encoders (on the tiny ones validation mIoU-fg falls from 89.1 at 40 epochs to
   81.3 at 60; on EfficientNet-Lite2 + MiniLM segmentation is 96.8 at 20 epochs and 83.7 at 40), so 20% of
   the alignment images, at most 1,000 (holds_out; train.held_out_pairs: 1,000 of the 6,000 Shapes images), are
   held out with their pairs, the rest trained on, and the epoch of
   the best validation score, the mean of the held-out RSum and the RSum with each image the mean of its
   patch embeddings (what segmentation reads), is the one kept (train.py; --epochs is the most it runs).
4. lr = 0.1 / max(d_image, d_text), set per instance in self.defaults (--lr overrides): Adam
   moves each weight by about lr a step, and the star product compounds it with the fan-in, so a
   fixed lr 1e-3 that suits 96-d features leaves real 1280-d features at chance (RSum 18, where
   1e-4 reaches 562).
5. The loss divides the sum over the B x B pairs by B (SigLIP's form); Adam is nearly invariant
   to that factor.
6. score() is the cosine h_v . h_l: t and b are monotone, so rankings are the same.
7. dense_image applies the image head to every patch token (the MaskCLIP trick).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .layernorm import LayerNorm


class StarMLP(nn.Module):
    """LayerNorm -> W_g (ReLU6(W_1 x) * W_2 x)."""

    def __init__(self, d_in, K, width):
        super().__init__()
        self.norm = LayerNorm(d_in)
        self.f1 = nn.Linear(d_in, width * d_in)
        self.f2 = nn.Linear(d_in, width * d_in)
        self.g = nn.Linear(width * d_in, K)

    def forward(self, x):
        x = self.norm(x)
        return self.g(F.relu6(self.f1(x)) * self.f2(x))          # star: elementwise product


def siglip_loss(h_v, h_l, t, b):
    """Pairwise sigmoid loss over all B x B pairs, normalised by B."""
    logits = t * h_v @ h_l.T + b                                # (B, B)
    z = 2 * torch.eye(len(h_v), device=h_v.device) - 1          # +1 on the diagonal, -1 elsewhere
    return -F.logsigmoid(z * logits).sum() / len(h_v)


class SAIL(Method):
    # our choice (choice 3); lr is set per instance from the input dimensions (choice 4)
    defaults = dict(lr="0.1 / max(d_image, d_text)", epochs=40, batch_size=256, weight_decay=1e-4, optimizer="adamw")
    ranges = dict(K="[1, inf)", width="[1, inf)", t_init="(0, inf)", b_init="(-inf, inf)")  # valid --hp

    holds_out = 0.2    # choice 3: 20% of the alignment images (at most 1,000) held out, the epoch chosen on them
    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)

    def contrastive_scale(self):  # its logit scale (--hard-negatives): SigLIP's learned t
        return self.log_t.exp()

    def __init__(self, d_image, d_text, K=512, width=8, t_init=20.0, b_init=-10.0):  # SAIL (Zhang et al., CVPR 2025)
        super().__init__()
        self.defaults = dict(SAIL.defaults, lr=0.1 / max(d_image, d_text))  # choice 4: lr x d_in = 0.1
        self.g_v = StarMLP(d_image, K, width)
        self.g_l = StarMLP(d_text, K, width)
        self.log_t = nn.Parameter(torch.tensor(math.log(t_init)))
        self.b = nn.Parameter(torch.tensor(float(b_init)))

    def embed_image(self, img):
        return F.normalize(self.g_v(img.pooled), dim=-1)        # (B, K)

    def embed_text(self, txt):
        return F.normalize(self.g_l(txt.pooled), dim=-1)        # (B, K)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                              # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(self.g_v(img.patches()), dim=-1)     # (B, H*W, K)

    def loss(self, img, txt):
        t = self.log_t.exp()
        loss = siglip_loss(self.embed_image(img), self.embed_text(txt), t, self.b)
        return loss, {"siglip": loss.detach(), "t": t.detach(), "b": self.b.detach()}
