"""Text-guided patch aggregation (the LAPS / SPARC family), the baseline CoV-Align
argues against, as a post-hoc head on FROZEN encoders.

SPARC (Bica et al., "Improving fine-grained understanding in image-text pre-training",
ICML 2024) groups patches per word: each word attends over the image patches and gets
its own word-specific visual feature; LAPS (Fu et al., CVPR 2024) does likewise after
patch selection. The aggregation depends on the caption, so in retrieval it is redone
for EVERY (image, caption) pair: this is what makes it slow (CoV-Align's regions are
computed once per image).

Equations implemented (per pair I, T; numbered here):
  (1) a_jp  = softmax_p( cos(w_j, v_p) / tau_a )            word j attends over patches
  (2) vhat_j = sum_p a_jp v_p                               word-specific visual feature
  (3) S(I,T) = 1/L sum_j cos(w_j, vhat_j)                   over the real words only
  loss: symmetric InfoNCE over S / tau within the batch.

Symbols -> variables: v_p -> img_emb[:, p] (projected, normalised patches),
w_j -> txt_emb[:, j] (projected, normalised words), a -> a, vhat -> v_hat,
tau_a -> self.tau_a, tau -> self.tau.

Deviations / choices:
1. Encoders frozen; two linear projections to K = 512 train (as CoV here).
2. Score: the word-aggregated form (3), not a patch-word max-sum (with a max the aggregation
   is a plain max over patches, which is FILIP, methods/filip.py); SPARC's sparsified
   similarity (min-max + threshold) is replaced by a softmax with tau_a = 0.1.
3. embed_image returns the projected patches (B, H*W, K); score() aggregates per pair in chunks
   of at most score_chunk elements of the (I, N, T*L) tensors, all-zero rows being padding;
   score_chunk 2^20 on a CPU (256 x 256 pairs scored in 2.65 s against 3.25 s at 2^24, 1 thread),
   2^28 on a GPU (few large kernels).
4. Fixed InfoNCE temperature tau = 0.05 (S lies in [-1, 1]).
5. dense_image: each patch alone as a one-patch image, (B, H*W, 1, K).
   Optimiser as CoV here (Adam, lr 3e-3, weight decay 1e-4, 30 epochs, batch 128).
6. The words w_j exclude CLS / SEP / BOS / EOS (the token contract), so 1/L in Eq. (3) counts
   words only.
7. fast=True (the default) trains and scores Eqs. (2)-(3) without forming v_hat (I, T, L, K):
   w_j . vhat_j = sum_p a_jp s_jp and ||vhat_j||^2 = a_j^T G a_j with the patch Gram matrix
   G = v v^T (N, N), so a pair costs L N (K + N) multiply-adds instead of 2 L N K (a training step
   at batch 128: 2.0 s against 12.6 s). fast=False runs the equations as written
   (text_guided_score_paper); tests/test_fast_forms.py checks the two equal, values and gradients.
"""
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .losses import info_nce_of_logits, score_in_chunks
from .pal import cap


def attend(s, v_ok, tau_a):
    """Eq. (1)-(2) on the scores: a_jp = softmax over the real patches p of s_jp / tau_a, and
    sum_p a_jp s_jp; s (I, N, T*L), 0 at padded patches; v_ok (I, N) -> (I, T*L), a (I, N, T*L).
    The same masked attention pooling as PAL's CAP (Eq. 5-6 there, exercise 3 of the course), so it is that."""
    return cap(s, v_ok, tau_a)


def real_word_mean(x, w):
    """Eq. (3)'s mean: x (I, T, L) over the real words of w (T, L, K), all-zero rows being padding -> (I, T)."""
    # EXERCISE 6 (the mean over real words): x (I, T, L), w (T, L, K); padded (all-zero) words of w count neither
    #   in the sum nor in the number divided by -> (I, T)
    w_ok = w.abs().sum(-1) > 0                                          # (T, L)
    return (x * w_ok[None]).sum(-1) / w_ok.sum(-1)[None].clamp_min(1)
    # END EXERCISE 6


def text_guided_score_paper(v, w, tau_a):
    """Eq. (1)-(3) as written, for all pairs: v (I, N, K) patches, w (T, L, K) words -> S (I, T),
    with Eq. (2)'s v_hat (I, T, L, K) formed (fast=False)."""
    v_ok = v.abs().sum(-1) > 0                                          # (I, N)
    (I, N, K), (T, L, _) = v.shape, w.shape
    s = (v.reshape(I * N, K) @ w.reshape(T * L, K).T).view(I, N, T * L)  # cos(w_j, v_p), (I, N, T*L); 0 at padding
    _, a = attend(s, v_ok, tau_a)                                       # Eq. (1): a_jp over the real p, (I, N, T*L)
    v_hat = a.transpose(1, 2) @ v                                       # Eq. (2): sum_p a_jp v_p, (I, T*L, K)
    cos = F.cosine_similarity(v_hat.view(I, T, L, K), w[None], dim=-1)  # cos(w_j, v_hat_j), (I, T, L)
    return real_word_mean(cos, w)                                       # Eq. (3), (I, T)


def text_guided_score(v, w, tau_a):
    """Eq. (1)-(3) for all pairs: v (I, N, K) patches, w (T, L, K) words -> S (I, T).

    Eq. (2)'s v_hat (I, T, L, K) is never formed (choice 7):
        cos(w_j, v_hat_j) = w_j . v_hat_j / (||v_hat_j|| ||w_j||) = sum_p a_jp s_jp / sqrt(a_j^T G a_j ||w_j||^2),
    with G = v v^T (N, N) the patch Gram matrix
    the same value (tests/test_fast_forms.py checks it, and its gradients, against v_hat formed)."""
    v_ok = v.abs().sum(-1) > 0                                          # (I, N)
    (I, N, K), (T, L, _) = v.shape, w.shape
    # every pair at once, laid out (I, N, T*L) so that both products below are plain (batched) matmuls
    s = (v.reshape(I * N, K) @ w.reshape(T * L, K).T).view(I, N, T * L)  # cos(w_j, v_p), (I, N, T*L); 0 at padding
    # Eq. (1)-(2): a softmax over the real patches p, then the a-weighted sum of s
    dot, a = attend(s, v_ok, tau_a)                                       # w_j . v_hat_j (I, T*L), a (I, N, T*L)
    G = v @ v.transpose(1, 2)                                           # (I, N, N) patch Gram matrix
    sq = ((G @ a) * a).sum(1)                                           # ||v_hat_j||^2 = a_j^T G a_j, (I, T*L)
    cos = dot / (sq * w.square().sum(-1).view(1, T * L)).clamp_min(1e-16).sqrt()  # cos(w_j, v_hat_j), eps as
    cos = cos.view(I, T, L)                                             # F.cosine_similarity's, (I, T, L)
    return real_word_mean(cos, w)                                       # Eq. (3), (I, T)


class TextGuided(Method):
    defaults = dict(lr=3e-3, epochs=30, batch_size=128, weight_decay=1e-4, optimizer="adam")  # as CoV here
    ranges = dict(K="[1, inf)", tau_a="(0, inf)", tau="(0, inf)", score_chunk="[1, inf)",
                  fast=(True, False))  # valid --hp

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)
    refuses_align_data = dict.fromkeys(("weights", "weights+pairs"),  # head rows: one vector each
                                        "its image embedding reads only the patch tokens, and a head row is one "
                                        "vector with no patches")

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text,
                 K=512,              # shared dim, as CoV
                 tau_a=0.1,          # word-to-patch attention, choice 2
                 tau=0.05,           # InfoNCE, choice 4
                 # max elements of one per-pair chunk in score(); None: 2^20 CPU, 2^28 GPU (choice 3)
                 score_chunk=None,
                 fast=True):         # Eqs. (2)-(3) without v_hat formed (choice 7); False: as written
        super().__init__()
        self.P_v = nn.Linear(d_image, K)
        self.P_t = nn.Linear(d_text, K)
        self.tau_a, self.tau, self.score_chunk, self.fast = tau_a, tau, score_chunk, fast

    def pair_scores(self, v, w):
        """S (I, T) of Eq. (3) for every pair of v (I, N, K) and w (T, L, K)."""
        if self.fast:
            return text_guided_score(v, w, self.tau_a)
        return text_guided_score_paper(v, w, self.tau_a)

    def embed_image(self, img):
        return F.normalize(self.P_v(img.patches()), dim=-1)       # (B, H*W, K), no aggregation yet

    def embed_text(self, txt):
        w = F.normalize(self.P_t(txt.tokens), dim=-1)             # (B, L, K)
        return w * txt.mask[..., None]                            # padded words exactly 0

    def dense_image(self, img):
        return self.embed_image(img)[:, :, None]                  # (B, H*W, 1, K)

    def score(self, img_emb, txt_emb):
        limit = self.score_chunk or (2 ** 20 if img_emb.device.type == "cpu" else 2 ** 28)  # GPU: few large kernels
        return score_in_chunks(self.pair_scores, img_emb, txt_emb, limit)

    def loss(self, img, txt):
        S = self.pair_scores(self.embed_image(img), self.embed_text(txt))  # (B, B)
        logits = S / self.tau
        loss = info_nce_of_logits(logits)                                # symmetric InfoNCE (losses.py)
        return loss, {"nce": loss.detach()}
