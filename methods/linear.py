"""Linear projection per modality with symmetric InfoNCE (the CLIP-style head).

The simplest post-hoc aligner: two linear maps g_v(x) = P_v x, g_l(y) = P_l y on the
frozen POOLED features, trained with the symmetric InfoNCE of CLIP (Radford et al.,
"Learning Transferable Visual Models From Natural Language Supervision", ICML 2021, §2.3):

    L = 1/(2B) sum_i [ -log softmax_j(h_v,i . h_l,j / tau)_i - log softmax_j(h_l,i . h_v,j / tau)_i ]

Symbols -> variables: P_v -> self.P_v, P_l -> self.P_l, h -> h_v / h_l, tau -> self.tau.

Deviations / choices:
1. Fixed temperature tau = 0.05 (STRUCTURE's value), not learned: fewer moving parts.
2. Output dim K = 512, as Linear_RS in STRUCTURE.
3. dense_image applies P_v to every patch token (the MaskCLIP trick).
4. AdamW, lr 1e-3, weight decay 1e-4 (STRUCTURE's, without its betas and clipping), 20 epochs,
   batch 256: ours (CLIP trains from scratch and gives no post-hoc schedule).
"""
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .losses import info_nce


class Linear(Method):
    defaults = dict(lr=1e-3, epochs=20, batch_size=256, weight_decay=1e-4, optimizer="adamw")
    ranges = dict(K="[1, inf)", tau="(0, inf)")  # valid --hp values (align.py)

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text, K=512, tau=0.05):  # K, tau: STRUCTURE §4
        super().__init__()
        self.P_v = nn.Linear(d_image, K, bias=False)
        self.P_l = nn.Linear(d_text, K, bias=False)
        self.tau = tau

    def embed_image(self, img):
        return F.normalize(self.P_v(img.pooled), dim=-1)   # (B, K)

    def embed_text(self, txt):
        return F.normalize(self.P_l(txt.pooled), dim=-1)   # (B, K)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                         # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(self.P_v(img.patches()), dim=-1)  # (B, H*W, K)

    def loss(self, img, txt):
        loss = info_nce(self.embed_image(img), self.embed_text(txt), self.tau)
        return loss, {"nce": loss.detach()}
