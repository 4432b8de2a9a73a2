"""PAL: "Learning Relative Representations for Fine-Grained Multimodal Alignment with Limited
Data" (projection-free anchor learning), §4.1-4.3.

Each modality m in {v, l} gets K learnable anchors A_m (K, D_m), the ONLY trainable parameters.
A token is described by its cosines to its modality's anchors (a relative representation);
cross-attention pooling (CAP) lets every anchor pick the tokens most similar to it; the pooled
K-vectors of image and text are compared directly, with no projection head:

    R[t, k]     = cos(z_t, a_k)                                      Eq. (3)-(4)
    alpha[t, k] = softmax_t(R[t, k] / tau_p)   (padding masked)      Eq. (5)
    p[k]        = sum_t alpha[t, k] R[t, k]                          Eq. (6)
    h           = p / ||p||                                          Eq. (7)
    L           = symmetric InfoNCE of h_v . h_l / tau               Eq. (8)

| symbol            | variable            | shape      |
|-------------------|---------------------|------------|
| A_v, A_l          | self.A_v, self.A_l  | (K, D_m)   |
| Z_m (tokens)      | Z, its mask `mask`  | (B, T, D_m), (B, T) |
| R_m               | R = relative(Z, A)  | (B, T, K)  |
| alpha_m           | alpha               | (B, T, K)  |
| p_m, h_m          | p, h_v / h_l        | (B, K)     |
| tau_p, tau, K     | self.tau_p, self.tau, self.K | |
The file follows the paper: Eq. (2) anchors, Eqs. (3)-(4) relative, Eqs. (5)-(6) cap, the method
(Eq. 7 in embed_*, Eq. 8 in loss), then the anchor analysis: Table 4 (anchor_overlap), Fig. 3
(draw_anchor_figure).

Deviations / choices:
1. tau = 0.05, fixed (the paper does not give it): STRUCTURE's value, shared with the Linear head.
2. CAP reads the patch and word tokens only (no global, CLS or EOS token, features.py's token
   contract): the paper pools the encoder's tokens; the global token only repeats their mean.
3. pooling, Table 5's ablation: "cap" = Eqs. (5)-(6); "mean" = masked mean of R ("+ full tokens");
   "global" = the relative representation of the pooled vector ("global only").
4. Anchors start as N(0, I) draws (the paper does not say how they start).
5. AdamW at lr 3e-2, no weight decay (it only shrinks the anchors' norms); 20 epochs, batch 256
   (the paper states no optimiser, lr, epochs or batch; docs/results.md, "PAL's choices").
6. Table 4's Dice weighs the top-5 anchors by their p (clamped >= 0, normalised to sum 1):
   sum_k min(u_k, w_k); the set Dice of two top-5 sets equals the hard overlap |A∩B| / 5 exactly.
7. dense_image returns each patch's r_t (Eq. 4), L2-normalised, for zero-shot segmentation.
8. Aligned on classifier-head rows alone (--align-data weights, not in the paper): test images are
   pooled as the head read them ("global" for a pooled head, CAP for the Shapes CNN's per-patch
   head); align.py passes head_rows. A head row among image tokens is one vector (with_head_rows).
9. fast=True (the default): pool() runs Eqs. (3)-(6) through fast_cap.chunked_cap, the same p in
   chunks with a hand-written backward, about twice as fast (`python benchmarks/bench_cap.py`;
   tests/test_fast_forms.py checks values and gradients); fast=False trains the paper form,
   cap(relative(Z, A), mask, tau_p), written out beside it in pool().
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .fast_cap import chunked_cap  # choice 9: Eqs. (3)-(6) in chunks, the same p
from .losses import info_nce


# ---------------------------------------------------------------- helpers
def with_head_rows(x, Z, mask):
    """The patches Z (B, H*W, D) and mask (B, H*W) of images x with slot 0 in front: masked for an
    image, the row's one vector for a classifier-head row among them (--align-data weights+pairs,
    choice 8: a head row has no patch, so CAP reads its vector as its only token)."""
    vector = ~mask.any(1)                                  # (B,) True for a head row: no real patch
    return torch.cat([x.tokens[:, :1], Z], 1), torch.cat([vector[:, None], mask], 1)


def masked_mean(R, mask):
    """Uniform pooling over the real tokens (Table 5, '+ full tokens'), (B, K)."""
    m = mask[..., None].to(R.dtype)                  # (B, T, 1)
    return (R * m).sum(dim=1) / m.sum(dim=1)


# ---------------------------------------------------------------- blocks, in the paper's order
def anchors(K, D):
    """K learnable anchors of one modality, the method's only parameters: N(0, I) draws (choice 4).
    Eq. (2), (K, D)"""
    return nn.Parameter(torch.randn(K, D))


def relative(Z, A):
    """Token-to-anchor cosines R[b, t, k] = cos(z_bt, a_k).  Eq. (3)-(4), (B, T, K)"""
    # EXERCISE 3 (PAL Eq. 3-4): R[b, t, k] = cos(z_bt, a_k); Z (B, T, D), A (K, D) -> R (B, T, K)
    return F.normalize(Z, dim=-1) @ F.normalize(A, dim=-1).T
    # END EXERCISE 3


def cap(R, mask, tau_p):
    """Cross-attention pooling: each anchor attends over the real tokens.  Eq. (5)-(6)"""
    # EXERCISE 3 (PAL Eq. 5-6): alpha[b, t, k] = softmax over the REAL tokens t of R / tau_p (padding masked),
    #   p = sum_t alpha R; R (B, T, K), mask (B, T) -> p (B, K), alpha (B, T, K)
    R = R.masked_fill(~mask[..., None], 0.0)                                   # padding -> 0
    logits = (R / tau_p).masked_fill(~mask[..., None], float("-inf"))
    alpha = logits.softmax(dim=1)                    # Eq. (5), (B, T, K), sums to 1 over t
    p = (alpha * R).sum(dim=1)                       # Eq. (6), (B, K)
    return p, alpha
    # END EXERCISE 3


# ---------------------------------------------------------------- the method: Eqs. (2)-(8)
class PAL(Method):
    defaults = dict(lr=3e-2, epochs=20, batch_size=256, weight_decay=0.0, optimizer="adamw")  # choice 5
    ranges = dict(K="[5, inf)",  # analyse() reads each pair's top-5 anchors (Table 4)
                  tau_p="(0, inf)", tau="(0, inf)", pooling=("cap", "mean", "global"),
                  fast=(True, False))  # choice 9

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)
    reads_head_rows = True  # align.py passes head_rows: what the image encoder's head reads (choice 8)

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text,
                 K=512,            # PAL §5.1
                 tau_p=0.03,       # PAL §5.1, Table 7
                 tau=0.05,         # not in the paper: choice 1
                 pooling=None,     # "cap" PAL §4.2; "mean" / "global": Table 5 ablation; None: choice 8
                 head_rows=None,   # set by align.py when aligning on head rows alone: what the head reads (choice 8)
                 fast=True):       # choice 9: CAP through methods/fast_cap.py (the same p), else the paper form
        super().__init__()
        assert head_rows in (None, "pooled", "patches"), head_rows
        if pooling is None:                                # choice 8: read test images as the head rows were
            pooling = "global" if head_rows == "pooled" else "cap"
        assert pooling in ("cap", "mean", "global"), pooling
        self.A_v = anchors(K, d_image)                     # Eq. (2), (K, D_v)
        self.A_l = anchors(K, d_text)                      # Eq. (2), (K, D_l)
        self.K, self.tau_p, self.tau, self.pooling, self.fast = K, tau_p, tau, pooling, fast

    @staticmethod
    def Z(x, modality):
        """The tokens CAP reads (choice 2): Z (B, T, D) and its mask (B, T): an image's H*W patches
        (not its global token), a caption's words."""
        if modality == "image" and x.grid is not None:
            H, W = x.grid
            return with_head_rows(x, x.tokens[:, 1:1 + H * W], x.mask[:, 1:1 + H * W])
        return x.tokens, x.mask                            # words (the contract); head rows alone: their one vector

    def tokens(self, x, modality):
        """The token sequence the pooling reads: Z (B, T, D) and its mask (B, T)."""
        if self.pooling == "global":                       # one vector per sample (choice 3)
            g = x.pooled                                   # (B, D) what a classifier head reads
            return g[:, None], torch.ones(len(g), 1, dtype=torch.bool, device=g.device)
        return self.Z(x, modality)

    def pool(self, x, modality):
        """p (B, K): the pooled relative representation (before Eq. 7's normalisation)."""
        Z, mask = self.tokens(x, modality)
        A = self.A_v if modality == "image" else self.A_l
        if self.pooling != "cap":
            return masked_mean(relative(Z, A), mask)       # Eq. (4); "mean"; "global" has T = 1
        if self.fast:                                      # the same p, in chunks (choice 9)
            return chunked_cap(Z, A, mask, self.tau_p)[0]  # Eq. (3)-(6), (B, K)
        else:                                              # the paper form
            p, alpha = cap(relative(Z, A), mask, self.tau_p)   # Eq. (3)-(6), (B, K), (B, T, K)
            return p

    def embed_image(self, img):
        return F.normalize(self.pool(img, "image"), dim=-1)   # Eq. (7), (B, K)

    def embed_text(self, txt):
        return F.normalize(self.pool(txt, "text"), dim=-1)    # Eq. (7), (B, K)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                            # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(relative(img.patches(), self.A_v), dim=-1)  # Eq. (4) per patch, (B, H*W, K)

    def loss(self, img, txt):
        loss = info_nce(self.embed_image(img), self.embed_text(txt), self.tau)  # Eq. (8)
        return loss, {"nce": loss.detach()}

    @torch.no_grad()
    def analyse(self, img, txt, images, words, figure, n_figures=4, n_anchors=3):
        """Table 4 anchor overlap on all pairs, and Fig. 3 for the first n_figures pairs:
        the n_anchors anchors contributing most to the pair's score h_v[k] h_l[k]. figure(image, name): the run's
        figure writer (align.py's: into the run folder)."""
        chunks = [torch.arange(len(img))[b:b + 256] for b in range(0, len(img), 256)]  # bound memory
        p_v = torch.cat([self.pool(img[c], "image") for c in chunks])           # (N, K)
        p_l = torch.cat([self.pool(txt[c], "text") for c in chunks])            # (N, K)
        metrics = anchor_overlap(p_v, p_l)
        if img.grid is None:                                # no patch grid to draw on
            return metrics
        H, W = img.grid
        n = min(n_figures, len(img))
        # CAP attention over the patches / words (drawn whatever `pooling` is), (n, T, K)
        Z_v, mask_v = self.Z(img[:n], "image")                                 # (n, 1 + H*W, D): slot 0 off for images
        alpha_v = cap(relative(Z_v, self.A_v), mask_v, self.tau_p)[1][:, 1:]    # (n, H*W, K)
        alpha_l = cap(relative(txt.tokens[:n], self.A_l), txt.mask[:n], self.tau_p)[1]
        contribution = F.normalize(p_v[:n], dim=-1) * F.normalize(p_l[:n], dim=-1)  # (n, K)
        # the figures are drawn on the host (PIL, next to the pixels): one crossing here
        alpha_v, alpha_l, contribution = alpha_v.cpu(), alpha_l.cpu(), contribution.cpu()
        txt_mask = txt.mask[:n].cpu()
        for i in range(n):
            ks = contribution[i].topk(n_anchors).indices.tolist()
            heatmaps, word_lists = [], []
            for k in ks:
                a = alpha_v[i, :, k].reshape(H, W)                             # over the patch grid
                heatmaps.append(a / a.max().clamp_min(1e-12))                  # scaled to its maximum
                word_lists.append([words[i][t] for t in range(alpha_l.shape[1])
                                   if txt_mask[i, t] and alpha_l[i, t, k] > 0.5])
            caption = " ".join(w for w, m in zip(words[i], txt_mask[i].tolist()) if m)
            figure(draw_anchor_figure(images[i], heatmaps, ks, word_lists, caption), f"pal_anchors_{i}.png")
        return metrics


# ---------------------------------------------------------------- the anchor analysis: Table 4, Fig. 3
def anchor_overlap(p_v, p_l, top=5, seed=0):
    """Table 4: overlap of the top-`top` anchors of p_v[i] and p_l[j], (N, K) each.

    Matched pairs (i, i); mismatched pairs (i, j) with j != i drawn with a fixed seed.
    hard = |A∩B| / top; dice = weighted Dice sum_k min(u_k, w_k) (choice 6)."""
    def top_weights(p):
        val, idx = p.topk(top, dim=1)                                          # (N, top)
        onehot = torch.zeros_like(p).scatter(1, idx, 1.0)                      # set indicator
        w = torch.zeros_like(p).scatter(1, idx, val.clamp_min(1e-8))
        return onehot, w / w.sum(dim=1, keepdim=True)                          # (N, K) each

    (a, u), (b, w) = top_weights(p_v), top_weights(p_l)
    N = len(p_v)
    g = torch.Generator().manual_seed(seed)
    j = (torch.arange(N) + torch.randint(1, max(N, 2), (N,), generator=g)) % N  # j != i
    out = {}
    for name, jj in (("matched", torch.arange(N)), ("mismatched", j)):
        out[f"anchor_overlap_{name}"] = ((a * b[jj]).sum(1) / top).mean().item()
        out[f"anchor_dice_{name}"] = torch.minimum(u, w[jj]).sum(1).mean().item()
    return out


def heat_colours(x):
    """A 'hot' colour map, values in [0, 1] -> (3, ...) RGB in [0, 1]."""
    return torch.stack([(3 * x).clamp(0, 1), (3 * x - 1).clamp(0, 1), (3 * x - 2).clamp(0, 1)])


def draw_anchor_figure(image, heatmaps, anchor_ids, word_lists, caption, size=160):
    """Fig. 3, one row: the image, then per anchor its patch attention blended over
    the image with the caption words it attends to (alpha > 0.5) written under it.
    image: uint8 (3, S, S); heatmaps: list of (H, W) in [0, 1]. Returns the PIL image."""
    from PIL import Image, ImageDraw
    x = F.interpolate(image[None].float() / 255, size=(size, size), mode="bilinear",
                      align_corners=False)[0].clamp(0, 1)                      # (3, size, size)
    tiles = [x]
    for hm in heatmaps:
        a = F.interpolate(hm[None, None], size=(size, size), mode="bilinear", align_corners=False)[0, 0]
        a = a.clamp(0, 1)
        tiles.append((1 - 0.7 * a) * x + 0.7 * a * heat_colours(a))         # hot where attended
    pad, text_h = 8, 44
    canvas = Image.new("RGB", (pad + len(tiles) * (size + pad), 2 * text_h + size), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((pad, 6), caption[:110], fill="black")
    for n, tile in enumerate(tiles):
        left = pad + n * (size + pad)
        canvas.paste(Image.fromarray((tile * 255).byte().permute(1, 2, 0).numpy()), (left, text_h))
        label = "image" if n == 0 else f"anchor {anchor_ids[n - 1]}"
        draw.text((left, text_h - 14), label, fill="black")
        if n > 0:
            words = ", ".join(word_lists[n - 1]) or "-"
            for line in range(2):                                              # crude wrap, 26 chars
                draw.text((left, text_h + size + 4 + 14 * line), words[26 * line:26 * (line + 1)], fill="black")
    return canvas
