"""ASIF: training-free relative representations over a set of anchor pairs.

Norelli et al., "ASIF: Coupled Data Turns Unimodal Models to Multimodal Without Training"
(NeurIPS 2023), §3; a baseline of "Supervised Classification Heads as Semantic Prototypes:
Unlocking Vision-Language Alignment via Weight Recycling" (§4: g maps an image to its
similarities with the image side of the pairs, g_bar likewise for text).

Anchor j is one training pair (a_v,j, a_l,j), so the two modalities' relative
representations share coordinates (ASIF §3 writes the steps in prose; numbered here):

    (1) r_v(x) = [cos(x, a_v,j)]_j,   r_l(y) = [cos(y, a_l,j)]_j         (B, N_a)
    (2) keep the k largest entries of each row, set the rest to 0        sparsify
    (3) r <- r^p, then L2-normalise                                      sharpen
    (4) s(x, y) = r_v(x) . r_l(y)

Symbols -> variables:
    a_v, a_l -> self.anchors_v, self.anchors_l      k -> self.k      p -> self.p
    N_a -> the number of anchors (n_anchors caps it)

Deviations / choices:
1. Negative cosines are clamped to 0 before (3): with an even p a dissimilar anchor would count
   as a strong match (it matters once k nears N_a).
2. n_anchors=None keeps every training pair; an int keeps a fixed random subset (seed 0), to
   bound the (B, N_a) embeddings on large sets.
3. Embeddings are dense (B, N_a) tensors with at most k non-zeros per row.
4. The anchors are buffers set by fit(), so a saved state_dict holds them.
5. dense_image represents every patch token against the pooled image anchors (the MaskCLIP
   trick, Zhou et al., ECCV 2022).
6. Anchors and queries are L2-normalised rows at fit and at test, so unit head rows and raw
   image features (BEiT pooled: norm ~28) share one space.
7. top-k unsorted (scatter() puts each value back at its anchor): 2.9 ms against 16.5 ms sorted
   (torch.topk, 800 of 1,024 per row, 256 rows, 1 thread).
"""
import torch
import torch.nn.functional as F

from . import Method


class ASIF(Method):
    defaults = dict(epochs=0)  # training-free: fit() only stores the anchors
    ranges = dict(k="[1, inf)", p="(0, inf)", n_anchors="[1, inf)")  # valid --hp values (align.py)

    def __init__(self, d_image, d_text, k=800, p=8, n_anchors=None):  # k, p: ASIF §3
        super().__init__()
        self.k, self.p, self.n_anchors = k, p, n_anchors
        self.register_buffer("anchors_v", torch.zeros(0, d_image))
        self.register_buffer("anchors_l", torch.zeros(0, d_text))

    @torch.no_grad()
    def fit(self, img, txt):
        idx = torch.arange(len(img), device=img.pooled.device)
        if self.n_anchors is not None and self.n_anchors < len(img):
            idx = torch.randperm(len(img), generator=torch.Generator().manual_seed(0))[:self.n_anchors].to(idx.device)
        self.anchors_v = F.normalize(img.pooled[idx].float(), dim=-1)     # (N_a, D_v)
        self.anchors_l = F.normalize(txt.pooled[idx].float(), dim=-1)     # (N_a, D_l)
        return self

    def relative(self, x, anchors):
        """Sparse, sharpened relative representation of x (..., D) against anchors (N_a, D)."""
        # EXERCISE 12 (ASIF): cosines of x (..., D) to anchors (N_a, D); keep the k = min(self.k, N_a) largest per
        #   row (the rest 0), clamp at 0, THEN raise to the power p, L2-normalise -> (..., N_a)
        r = F.normalize(x, dim=-1) @ anchors.T                            # (..., N_a) cosine similarities
        k = min(self.k, anchors.shape[0])
        top = r.topk(k, dim=-1, sorted=False)                             # k largest per row, in any order
        r = torch.zeros_like(r).scatter(-1, top.indices, top.values)      # (..., N_a), k non-zeros
        return F.normalize(r.clamp_min(0) ** self.p, dim=-1)              # (..., N_a)
        # END EXERCISE 12

    def embed_image(self, img):
        return self.relative(img.pooled, self.anchors_v)                  # (B, N_a)

    def embed_text(self, txt):
        return self.relative(txt.pooled, self.anchors_l)                  # (B, N_a)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                        # (N_img, N_txt)

    def dense_image(self, img, chunk=2 ** 26):
        """(B, H*W, N_a), at most `chunk` elements of it computed at a time (a batch under it: one call, as
        relative(patches); chunked rows agree to float rounding, ~1e-7): relative() makes two
        tensors of its input's size (cosines, scattered top-k), so with COCO's 82,783 anchors a
        64-image batch peaks at the output plus one 256 MB chunk, not three 5.4 GB tensors."""
        p = img.patches()                                                 # (B, H*W, D)
        N_a = self.anchors_v.shape[0]
        step = max(1, chunk // N_a)                                       # patch rows per chunk
        rows = p.reshape(-1, p.shape[-1])                                 # (B*H*W, D)
        if len(rows) <= step:
            return self.relative(p, self.anchors_v)                       # (B, H*W, N_a)
        out = rows.new_empty(len(rows), N_a)
        for i in range(0, len(rows), step):
            out[i:i + step] = self.relative(rows[i:i + step], self.anchors_v)
        return out.view(*p.shape[:2], N_a)                                # (B, H*W, N_a)
