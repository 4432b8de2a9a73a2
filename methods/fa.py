"""FA: "Harnessing Frozen Unimodal Encoders for Flexible Multimodal Alignment"
(Maniparambil et al., CVPR 2025, arXiv 2409.19425; PAL's baseline [19]).

Projectors on top of frozen encoders, the image side combining a projector of the
global (CLS) token with a projector of the local (patch) tokens. Followed: the public
code github.com/mayug/freeze-align, class CLIP in train/models/clip_adjustable_combined_vis_cls.py
(its Patch_Projection and ProjectionHead), configured by train/configs-v2/dinov2-arl-wds-combined.yaml
(cls_vision_projection = local_vision_projection = local_text_projection = "patch",
text_projection = "mlp", vis_pooling = text_pooling = "mean", local_loss_weight = 0).
The paper gives no equation numbers for the projector; (1)-(5) are numbered here.

    P(x)   = W_a u + W_c GELU(W_b u),  u = Dropout(LayerNorm(x))          (1) token projector, D -> K
    G(p)   = LayerNorm(q + Dropout(W_e GELU(q))),  q = W_d p              (2) text head, K -> K
    z_v    = P_cls(x_0) + 1/(H W) sum_{patches t} P_loc(x_t)               (3) image: CLS + mean local
    z_l    = G( sum_t m_t P_txt(y_t) / sum_t m_t )                         (4) text: masked mean, then head
    h      = z / ||z||;   L = symmetric InfoNCE of h_v,i . h_l,j / tau     (5) tau learned, clamped

Symbols -> variables: P_cls, P_loc, P_txt -> self.P_cls, self.P_loc, self.P_txt (TokenProjector);
G -> self.G (TextHead); x_t -> img.tokens[:, t]; y_t, m_t -> txt.tokens, txt.mask;
z_v, z_l -> z_v, z_l; h -> h_v, h_l; tau -> self.tau; K -> K.

Deviations / choices:
1. K = 512 (the code's config: 1024): with D_v = D_l = 1024 the blocks hold 4,469,249 parameters,
   PAL Table 1's "4.5M" for DINOv2-L + RoBERTa-L (tests/test_fa.py checks the count).
2. The text head G maps K -> K: the code builds it with input width D_l but feeds it the K-dim
   pooled projection, which works there only because D_l = K = 1024.
3. Text has no CLS projector (text_pooling = "mean" never reads the pooler output); the mean (4)
   runs over the word tokens (the token contract), where the code's mean also counts CLS / SEP.
4. The image mean (3) runs over the patches, the code's image_embeds[:, 1:] (DINOv2, no registers).
5. tau is the temperature itself, init 0.07, clamped in place to [0.001, 0.5] before each loss,
   as the code; AdamW decays it too (lr 1e-3 x wd 0.02: negligible).
6. Dropout 0.1 inside every projector, as the code, active in training only.
7. dense_image, dense="local" (default): P_loc per patch, L2-normalised, as the code's
   zero-shot segmentation (its min-max scaling of each class map leaves the per-patch argmax
   as is); dense="sum" adds P_cls(x_0); Shapes mIoU-fg 89.7 against 77.4 at the defaults
   (95.8 against 96.7 at batch 256).
8. AdamW, lr 1e-3, weight decay 0.02, 15 epochs, batch 1800 (the config's per-GPU batch, its
   contrastive batch; 10 warm-up epochs not reproduced); its 15 epochs are over ~17M pairs, so
   raise --epochs on small sets (Shapes, 20 epochs: RSum 459 at batch 1800, 511 at 256).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .layernorm import LayerNorm
from .losses import info_nce

# ---------------------------------------------------------------- blocks


class TokenProjector(nn.Module):
    """Eq. (1): LayerNorm -> Dropout -> a linear branch plus a GELU-MLP branch (the code's
    LayerNorm + Dropout + Patch_Projection). Applied to every token independently."""

    def __init__(self, d_in, K, dropout):
        super().__init__()
        self.norm = LayerNorm(d_in)
        self.drop = nn.Dropout(dropout)
        self.W_a = nn.Linear(d_in, K)        # linear branch
        self.W_b = nn.Linear(d_in, K)        # non-linear branch, first layer
        self.W_c = nn.Linear(K, K)           # non-linear branch, second layer

    def forward(self, x):
        u = self.drop(self.norm(x))                          # (..., D)
        return self.W_a(u) + self.W_c(F.gelu(self.W_b(u)))   # Eq. (1), (..., K)


class TextHead(nn.Module):
    """Eq. (2): the code's ProjectionHead, a residual GELU-MLP with a closing LayerNorm."""

    def __init__(self, d_in, K, dropout):
        super().__init__()
        self.W_d = nn.Linear(d_in, K)
        self.W_e = nn.Linear(K, K)
        self.drop = nn.Dropout(dropout)
        self.norm = LayerNorm(K)

    def forward(self, p):
        q = self.W_d(p)                                              # (B, K)
        return self.norm(q + self.drop(self.W_e(F.gelu(q))))         # Eq. (2), (B, K)


def masked_mean(z, mask):
    """Mean over tokens of z (B, T, K) where mask (B, T) is True; padding never read."""
    z = z.masked_fill(~mask[..., None], 0.0)                 # garbage in padding -> exactly 0
    return z.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)   # (B, K)


# ---------------------------------------------------------------- the method


class FA(Method):
    # freeze-align train/configs-v2/dinov2-arl-wds-combined.yaml (choice 8)
    defaults = dict(lr=1e-3,            # optimizer: {opt: adamW, lr: 1e-3}
                    epochs=15,          # schedular: epochs 15 (over ~17M pairs)
                    batch_size=1800,    # batch_size_train: 1800 per GPU (x 8 GPUs)
                    weight_decay=0.02,  # optimizer: weight_decay 0.02
                    optimizer="adamw")
    ranges = dict(K="[1, inf)", dropout="[0, 1)", tau_init="(0, inf)", dense=("local", "sum"))  # valid --hp

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)
    refuses_align_data = dict.fromkeys(("weights", "weights+pairs"),  # head rows: one vector each
                                        "its image embedding adds the mean of the patch tokens (Eq. 3), and a "
                                        "head row has no patches")

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text,
                 K=512,            # PAL Table 1 parameter count (choice 1); code config: 1024
                 dropout=0.1,      # code: Dropout(0.1) in every projector
                 tau_init=0.07,    # code config: temp 0.07
                 dense="local"):   # choice 7; or "sum"
        super().__init__()
        assert dense in ("local", "sum"), dense
        self.P_cls = TokenProjector(d_image, K, dropout)     # global image token
        self.P_loc = TokenProjector(d_image, K, dropout)     # local image tokens
        self.P_txt = TokenProjector(d_text, K, dropout)      # every text token
        self.G = TextHead(K, K, dropout)                     # pooled text (choice 2)
        self.tau = nn.Parameter(torch.tensor(float(tau_init)))
        self.dense = dense

    def embed_image(self, img):
        x_0, x_loc = img.tokens[:, 0], img.patches()                        # (B, D), (B, H*W, D)
        z_v = self.P_cls(x_0) + self.P_loc(x_loc).mean(1)                   # Eq. (3), (B, K)
        return F.normalize(z_v, dim=-1)                                     # Eq. (5), (B, K)

    def embed_text(self, txt):
        z_l = self.G(masked_mean(self.P_txt(txt.tokens), txt.mask))         # Eq. (4), (B, K)
        return F.normalize(z_l, dim=-1)                                     # Eq. (5), (B, K)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                          # (N_img, N_txt) cosine

    def dense_image(self, img):
        z = self.P_loc(img.patches())                                       # (B, H*W, K)
        if self.dense == "sum":
            z = z + self.P_cls(img.tokens[:, 0])[:, None]                   # + the image's CLS term
        return F.normalize(z, dim=-1)                                       # (B, H*W, K)

    def loss(self, img, txt):
        with torch.no_grad():
            self.tau.clamp_(0.001, 0.5)                                     # as the code, each step
        loss = info_nce(self.embed_image(img), self.embed_text(txt), self.tau)  # Eq. (5)
        return loss, {"nce": loss.detach(), "tau": self.tau.detach()}
