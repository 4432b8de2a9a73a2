"""FILIP: Fine-grained Interactive Language-Image Pre-Training (Yao et al., ICLR 2022),
as a post-hoc head on FROZEN encoders: late interaction over all patches x words.

Equations implemented (FILIP §3.1.1, token-wise maximum similarity):
  (4)  s_i2t(I, T) = 1/n_1 sum_k max_r  [x_k . y_r]   (each patch finds its best word)
  (5)  s_t2i(I, T) = 1/n_2 sum_r max_k  [x_k . y_r]   (each word finds its best patch)
  loss: InfoNCE image->text over s_i2t and text->image over s_t2i (Eq. 1-3), averaged.

Symbols -> variables: x_k (patch k) -> patch embeddings img_emb[:, k],
y_r (word r) -> txt_emb[:, r], n_1 / n_2 -> numbers of real patches / words,
tau -> self.tau.

Deviations / choices:
1. Encoders frozen; only two linear projections (patches, words) to K = 512 train.
2. The words y_r exclude CLS / SEP / BOS / EOS (the token contract) and padding, as FILIP drops
   padding; the image side uses every patch, not the global token (the tiny encoder's [CLS]
   counted as a word: RSum 274.8 against 279.4, one seed).
3. Fixed temperature tau = 0.05 instead of FILIP's learned one: fewer moving parts.
4. Retrieval score = s_i2t + s_t2i (the two directions summed, as CoV's max-sum); training
   uses each direction for its own InfoNCE term, as FILIP does.
5. score() runs in chunks of at most score_chunk elements of the (I, T, N, L) tensor and treats
   all-zero rows (padding added by batch concatenation) as padding.
6. dense_image: each patch alone as a one-patch image, (B, H*W, 1, K).
7. Optimiser as CoV here (Adam, lr 3e-3, weight decay 1e-4, 30 epochs, batch 128): FILIP pre-trains
   from scratch and gives no post-hoc schedule.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .losses import info_nce_of_logits, score_in_chunks


def token_max(r, w):
    """FILIP's token-wise maximum similarity, Eq. (4)-(5), for all pairs: r (I, Q, K) patches (CoV: its
    regions), w (T, L, K) words, unit or all-zero rows -> s_i2t, s_t2i (I, T) each.

    All-zero rows are padding: excluded from the max and from the mean.
    """
    # EXERCISE 6 (the token-wise max-sum, CoV's region-word score): i2t = mean over real regions of max over real
    #   words of s_ij, t2i = mean over real words of max over real regions; r (I, Q, K), w (T, L, K), all-zero
    #   rows are padding -> i2t, t2i (I, T)
    r_ok = r.abs().sum(-1) > 0                                          # (I, Q)
    w_ok = w.abs().sum(-1) > 0                                          # (T, L)
    s = torch.einsum("iqk,tlk->itql", r, w)                             # s_ij, (I, T, Q, L)
    neg = torch.finfo(s.dtype).min
    best_word = s.masked_fill(~w_ok[None, :, None, :], neg).amax(-1)    # max_j s_ij, (I, T, Q)
    best_region = s.masked_fill(~r_ok[:, None, :, None], neg).amax(-2)  # max_i s_ij, (I, T, L)
    i2t = (best_word * r_ok[:, None]).sum(-1) / r_ok.sum(-1, keepdim=True).clamp_min(1)
    t2i = (best_region * w_ok[None]).sum(-1) / w_ok.sum(-1)[None].clamp_min(1)
    return i2t, t2i                                                     # (I, T) each
    # END EXERCISE 6



class FILIP(Method):
    defaults = dict(lr=3e-3, epochs=30, batch_size=128, weight_decay=1e-4, optimizer="adam")  # as CoV here
    ranges = dict(K="[1, inf)", tau="(0, inf)", score_chunk="[1, inf)")  # valid --hp values (align.py)

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)
    refuses_align_data = dict.fromkeys(("weights", "weights+pairs"),  # head rows: one vector each
                                        "its image embedding reads only the patch tokens, and a head row is one "
                                        "vector with no patches")

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text,
                 K=512,              # shared dim, as CoV
                 tau=0.05,           # fixed, choice 3
                 score_chunk=2 ** 24):  # max elements of one (I, T, N, L) chunk in score()
        super().__init__()
        self.P_v = nn.Linear(d_image, K)
        self.P_t = nn.Linear(d_text, K)
        self.tau, self.score_chunk = tau, score_chunk

    def embed_image(self, img):
        return F.normalize(self.P_v(img.patches()), dim=-1)       # (B, H*W, K)

    def embed_text(self, txt):
        y = F.normalize(self.P_t(txt.tokens), dim=-1)             # (B, L, K)
        return y * txt.mask[..., None]                            # padded words exactly 0

    def dense_image(self, img):
        return self.embed_image(img)[:, :, None]                  # (B, H*W, 1, K)

    def score(self, img_emb, txt_emb):
        return score_in_chunks(lambda v, w: sum(token_max(v, w)), img_emb, txt_emb, self.score_chunk)  # i2t + t2i

    def contrastive_score(self, img_emb, txt_emb):  # what loss() scales by 1 / tau for image -> text
        return token_max(img_emb, txt_emb)[0]                     # s_i2t, (N_img, N_txt)

    def loss(self, img, txt):
        s_i2t, s_t2i = token_max(self.embed_image(img), self.embed_text(txt))  # (B, B) each
        loss = info_nce_of_logits(s_i2t / self.tau, s_t2i / self.tau)   # image -> its caption, caption -> its image
        return loss, {"nce": loss.detach()}
