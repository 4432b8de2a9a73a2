"""Text-guided patch aggregation (the LAPS / SPARC family), the baseline CoV-Align
argues against, as a post-hoc head on FROZEN encoders.

SPARC (Bica et al., 2024, "Improving fine-grained understanding in image-text
pre-training") groups patches per word: each word attends over the image patches
and gets its own word-specific visual feature; LAPS (Fu et al., CVPR 2024) does
likewise after patch selection. The aggregation depends on the caption, so in
retrieval it is redone for EVERY (image, caption) pair: this is what makes it slow
(CoV-Align's regions are computed once per image).

Equations implemented (per pair I, T):
  (1) a_jp  = softmax_p( cos(w_j, v_p) / tau_a )            word j attends over patches
  (2) vhat_j = sum_p a_jp v_p                               word-specific visual feature
  (3) S(I,T) = 1/L sum_j cos(w_j, vhat_j)                   over the real words only
  loss: symmetric InfoNCE over S / tau within the batch.

Symbols -> variables: v_p -> img_emb[:, p] (projected, normalised patches),
w_j -> txt_emb[:, j] (projected, normalised words), a -> a, vhat -> v_hat,
tau_a -> self.tau_a, tau -> self.tau.

Deviations / choices:
1. Encoders frozen; two linear projections to K = 512 train (as CoV here).
2. Score: the word-aggregated variant (3) rather than REFERENCE.md's patch-word
   max-sum: with a max the "aggregation" is a plain max over patches (that is FILIP,
   methods/filip.py); (3) is the text-guided aggregation proper. SPARC's sparsified
   similarity (min-max + threshold) is replaced by a softmax with tau_a = 0.1.
3. embed_image returns the projected patches (B, H*W, K); score() does the per-pair
   aggregation, in chunks of at most score_chunk elements of the (I, T, L, max(N, K))
   tensors, treating all-zero rows as padding on both sides.
4. Fixed InfoNCE temperature tau = 0.05 (S lies in [-1, 1]).
5. dense_image: each patch alone as a one-patch image, (B, H*W, 1, K).
6. The words w_j are the caption's word tokens (encoders.py's token contract drops
   CLS / SEP / BOS / EOS for every method), so 1/L in Eq. (3) counts words only.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def text_guided_score(v, w, tau_a):
    """Eq. (1)-(3) for all pairs: v (I, N, K) patches, w (T, L, K) words -> S (I, T)."""
    v_ok = v.abs().sum(-1) > 0                                          # (I, N)
    w_ok = w.abs().sum(-1) > 0                                          # (T, L)
    s = torch.einsum("ink,tlk->itln", v, w)                             # cos(w_j, v_p), (I, T, L, N)
    s = s.masked_fill(~v_ok[:, None, None, :], float("-inf"))
    a = (s / tau_a).softmax(-1)                                         # Eq. (1), (I, T, L, N)
    v_hat = torch.einsum("itln,ink->itlk", a, v)                        # Eq. (2), (I, T, L, K)
    cos = F.cosine_similarity(v_hat, w[None], dim=-1)                   # (I, T, L)
    return (cos * w_ok[None]).sum(-1) / w_ok.sum(-1)[None].clamp_min(1)  # Eq. (3), (I, T)


class TextGuided(nn.Module):
    defaults = dict(lr=3e-3, epochs=30, batch_size=128, weight_decay=1e-4, optimizer="adam")  # as CoV here
    ranges = dict(K="[1, inf)", tau_a="(0, inf)", tau="(0, inf)", score_chunk="[1, inf)")  # valid --hp

    def __init__(self, d_image, d_text,
                 K=512,              # shared dim, as CoV
                 tau_a=0.1,          # word-to-patch attention, choice 2
                 tau=0.05,           # InfoNCE, choice 4
                 score_chunk=2 ** 24):  # max elements of one per-pair chunk in score()
        super().__init__()
        self.P_v = nn.Linear(d_image, K)
        self.P_t = nn.Linear(d_text, K)
        self.tau_a, self.tau, self.score_chunk = tau_a, tau, score_chunk

    def embed_image(self, img):
        return F.normalize(self.P_v(img.patches()), dim=-1)       # (B, H*W, K), no aggregation yet

    def embed_text(self, txt):
        w = F.normalize(self.P_t(txt.tokens), dim=-1)             # (B, L, K)
        return w * txt.mask[..., None]                            # padded words exactly 0

    def dense_image(self, img):
        return self.embed_image(img)[:, :, None]                  # (B, H*W, 1, K)

    @torch.no_grad()
    def score(self, img_emb, txt_emb):
        (I, N, K), (T, L, _) = img_emb.shape, txt_emb.shape
        per_pair = L * max(N, K)
        ct = max(1, min(T, self.score_chunk // per_pair))         # texts per chunk
        ci = max(1, self.score_chunk // (ct * per_pair))          # images per chunk
        S = img_emb.new_empty(I, T)
        for i in range(0, I, ci):
            for t in range(0, T, ct):
                S[i:i + ci, t:t + ct] = text_guided_score(img_emb[i:i + ci], txt_emb[t:t + ct], self.tau_a)
        return S

    def loss(self, img, txt):
        S = text_guided_score(self.embed_image(img), self.embed_text(txt), self.tau_a)  # (B, B)
        logits = S / self.tau
        target = torch.arange(len(S), device=S.device)
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        return loss, {"nce": loss.item()}
