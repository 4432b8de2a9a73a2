"""The symmetric InfoNCE loss every contrastive method here trains with (CLIP's, Radford et al.,
ICML 2021; PAL Eq. (8), §4.3), written once.

    L = 1/(2B) sum_i [ -log softmax_j(s_ij / tau)_i - log softmax_j(s_ji / tau)_i ]

info_nce(h_v, h_l, tau): s = h_v h_l^T, a dot product of L2-normalised embeddings (B, K) each.
info_nce_of_logits(logits): the same from a (B, B) logit matrix s / tau whose diagonal holds the pairs,
for methods whose score is not a dot product (CoV's max-sum, the text-guided score).
score_in_chunks: the (images, texts) score matrix of the token-level methods (CoV, FILIP, text-guided),
whose per-pair tensors do not fit at once, in chunks of pairs.
LayerNorm: nn.LayerNorm whose gradients do not depend on the CPU thread count.
"""
import torch
import torch.nn.functional as F


def info_nce(h_v, h_l, tau):
    """Symmetric InfoNCE over a batch of L2-normalised pairs (B, K), (B, K).  PAL Eq. (8)"""
    # EXERCISE 2 (PAL Eq. 8): symmetric InfoNCE of h_v (B, K), h_l (B, K) at temperature tau: the mean of the
    #   image->text and text->image cross-entropies with targets on the diagonal -> scalar
    logits = h_v @ h_l.T / tau                      # (B, B) cosine similarity as logits
    target = torch.arange(len(h_v), device=h_v.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    # END EXERCISE 2


def info_nce_of_logits(logits, logits_t2i=None):
    """Symmetric InfoNCE over a (B, B) logit matrix whose diagonal holds the pairs; logits_t2i (B, B), when
    given, supplies the text -> image direction (FILIP: its two token-wise similarities differ)."""
    # EXERCISE 2 (the same loss from logits): the mean of the cross-entropies of the rows (image -> text) of
    #   logits (B, B) and of the columns (text -> image) of logits_t2i (default: logits), targets on the
    #   diagonal -> scalar
    target = torch.arange(len(logits), device=logits.device)
    cols = logits if logits_t2i is None else logits_t2i                          # (B, B)
    return (F.cross_entropy(logits, target) + F.cross_entropy(cols.T, target)) / 2
    # END EXERCISE 2


def score_in_chunks(pair_score, img_emb, txt_emb, limit):
    """S (I, T) = pair_score(img_emb, txt_emb) of img_emb (I, N, K) and txt_emb (T, L, K), computed on
    chunks of images x texts whose per-pair (N, L) entries hold at most `limit` elements in all."""
    (I, N, _), (T, L, _) = img_emb.shape, txt_emb.shape
    ct = max(1, min(T, limit // (N * L)))                     # texts per chunk
    ci = max(1, limit // (ct * N * L))                        # images per chunk
    S = img_emb.new_empty(I, T)
    for i in range(0, I, ci):
        for t in range(0, T, ct):
            S[i:i + ci, t:t + ct] = pair_score(img_emb[i:i + ci], txt_emb[t:t + ct])
    return S
