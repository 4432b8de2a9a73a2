"""PAL: "Learning Relative Representations for Fine-Grained Multimodal Alignment
with Limited Data" (projection-free anchor learning, papers/pal_relative_anchors.txt).

Each modality m in {v, l} gets K learnable anchors A_m (K, D_m), the ONLY trainable
parameters. A token z is described by its cosines to the anchors of its own modality
(a relative representation); cross-attention pooling (CAP) lets every anchor pick
the tokens most similar to it; the pooled K-vectors of image and text are then
compared directly, with no projection head:

    R[t, k]  = cos(z_t, a_k)                                   Eq. (3)-(4)
    alpha[t, k] = softmax_t(R[t, k] / tau_p)   (padding masked) Eq. (5)
    p[k]     = sum_t alpha[t, k] R[t, k]                        Eq. (6)
    h        = p / ||p||                                        Eq. (7)
    L        = symmetric InfoNCE of h_v . h_l / tau             Eq. (8)

Symbols -> variables: A_v, A_l -> self.A_v, self.A_l; Z -> Z (tokens); R -> R;
alpha -> alpha; p -> p; h -> h_v / h_l; tau_p -> self.tau_p; tau -> self.tau;
K -> K. Anchor analysis: Table 4 (anchor_overlap), Fig. 3 (draw_anchor_figure).

Deviations / choices:
1. tau = 0.05, fixed (the paper does not give it): the anchors stay the only
   trainable tensors, and 0.05 is STRUCTURE's value, so PAL and the Linear head
   share one temperature.
2. CAP reads the patch tokens and the word tokens, as the paper's Z: not the
   image's global token, and (by encoders.py's token contract, which drops them
   for every method) no register, distillation token or CLS / SEP / BOS / EOS.
   Shapes world (default PAL, --epochs 10, --threads 1, seed 0), CAP over all tokens
   (global token and the tiny text encoder's [CLS] included) -> patches and words only:
   retrieval RSum 507.9 -> 508.2, segmentation mIoU-fg 97.6 -> 97.4, classification
   100 -> 100, binding 49.5 -> 49.3: no measurable cost for following the paper.
3. pooling (Table 5 ablation): "cap" = Eqs. (5)-(6); "mean" = masked mean of R
   over tokens ("+ full tokens"); "global" = the relative representation of one
   vector ("global only"): each side's pooled vector, what a classifier head reads
   (the CLS token for DINOv2 / ViT, the mean token for CNNs; BEiT's pooler).
4. Anchor init (the paper does not say): init="gaussian" (default) draws
   N(0, I) anchors; init="tokens" copies K random real tokens of the FIRST
   training batch. The constructor sees no data, so the copy happens lazily in
   the first call of loss(), guarded by the buffer `initialised` (saved in the
   state_dict, so a loaded model is never re-initialised). Token anchors are
   rescaled to norm sqrt(D_m), the norm of a N(0, I) vector: only an anchor's
   direction enters the cosine, but Adam's step is per coordinate, so equal
   norms give the same angular step (and the same good lr) for both inits.
   On planted data whose tokens share a common mean direction (as real encoder
   features do; 2048 pairs, K=64, batch 256, lr 3e-2) token anchors all start
   near that direction: after 40 steps the loss was still 5.2 (chance 5.5),
   against 0.35 with Gaussian anchors. On the Shapes world (tiny encoders, 3000
   pairs, 15 epochs, batch 256): retrieval RSum 556 (Gaussian) vs 535 (tokens)
   at lr 3e-2, both ~560 at lr 1e-1; hence the default.
5. The anchors need a LARGE learning rate (REFERENCE.md: 1e-2..1e-1 with AdamW
   on real features; Shapes world RSum 534 / 556 / 559 at lr 1e-2 / 3e-2 / 1e-1);
   default 3e-2, no weight decay (it only shrinks the anchors' norms).
6. Anchor analysis, "Dice": with two top-5 SETS, 2|A∩B|/(|A|+|B|) equals the
   hard overlap |A∩B|/5 exactly, yet the paper reports different numbers, so
   its Dice must weigh anchors. We use the weighted Dice of the top-5
   activations (each set's p values, clamped >= 0, normalised to sum 1):
   sum_k min(u_k, w_k), which reduces to the set Dice for equal weights.
7. dense_image returns each patch's r_t (Eq. 4), L2-normalised, for segmentation.
8. Aligned on classifier-head rows alone (--align-data weights; the paper does not
   do this): a head row is a prototype of what its head reads, so test images are
   pooled the same way. align.py passes head_rows = the image encoder's
   `head_reads`: "pooled" for real classifiers (ImageNet heads read the pooled
   vector) -> pooling "global"; "patches" for the Shapes CNN, whose head classifies
   each patch -> CAP, which picks the patches most like each anchor. With pairs in
   the data (pairs, weights+pairs) head_rows is None and CAP stays: the pairs show
   PAL real images with all their tokens, at training as at test (Shapes,
   weights+pairs: cap 512.9 / 100.0, global 462.3 / 96.9 with the tiny text
   encoder; cap 522.4 / 100.0, global 484.2 / 98.3 with MiniLM). --hp pooling=... wins.
   Measured, RSum / zero-shot top-1, weights only (seed 0, 1 thread, 20 epochs,
   `python align.py --method pal --align-data weights --hp pooling=P`):
     real features (issue 11: a 1280-d ImageNet CNN + MiniLM, 1,000 head rows, seen /
     novel objects): cap 22 / 26 (zero-shot 1.2 / 3.3), global 53.9 / 56.5 (9.8 / 27.9);
     Shapes, tiny text: cap 56.2 / 64.2, global 70.6 / 53.8;
     Shapes, all-MiniLM-L6-v2 text: cap 209.9 / 66.7, global 145.4 / 67.5,
     mean 116.6 / 47.7.
   On a pooled head, global wins everything, by 2-8x. On the Shapes per-patch head
   CAP wins zero-shot with both text encoders and retrieval with MiniLM (global
   wins retrieval with the tiny text encoder, 70.6 vs 56.2), so CAP stays there.
9. Speed (issue 15): pool() runs Eqs. (3)-(6) through chunked_cap(), which computes the same p as
   cap(relative(Z, A), mask, tau_p)[0] (the exercise's functions, still used by analyse() and the tests)
   in cache-sized chunks of the batch with a hand-written backward (ChunkedCAP). The naive form spends
   its time on ~20 memory-bound passes over (B, T, K) tensors, not on its products: one training step
   (`python benchmarks/bench_steps.py --methods pal`, Shapes size, 1 thread) went from 410 ms to 145 ms.
   tests/test_fast_forms.py checks values and gradients against the naive form, and gradcheck.
"""
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------- helpers


def info_nce(h_v, h_l, tau):
    """Symmetric InfoNCE over a batch of L2-normalised pairs (B, K), (B, K).  Eq. (8)"""
    # EXERCISE 2 (PAL Eq. 8): symmetric InfoNCE of h_v (B, K), h_l (B, K) at temperature tau: the mean of the
    #   image->text and text->image cross-entropies with targets on the diagonal -> scalar
    logits = h_v @ h_l.T / tau                      # (B, B) cosine similarity as logits
    target = torch.arange(len(h_v), device=h_v.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    # END EXERCISE 2


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


class ChunkedCAP(torch.autograd.Function):
    """Eqs. (3)-(6) one chunk of the batch at a time, with the derivative written out (choice 9).

    The same p as cap(relative(Z, A), mask, tau_p)[0] and, given V (B, T, c), Y = alpha^T V (B, K, c)
    (what PAL-Rel reads). Z (B, T, D) comes in unit-length with padded rows 0, A (K, D) unit-length
    (chunked_cap does both, so autograd carries the normalisations' own derivative).
    Why: on a CPU the naive form is bound by memory traffic, not arithmetic: each of its ~20 elementwise
    passes (masking, softmax, product, sum and their backward) reads and writes a fresh (B, T, K) tensor
    (45 MB at the Shapes size: B 256, T 65, K 512). Here a chunk's (b, T, K) work stays in cache, in
    buffers reused from chunk to chunk, and the backward keeps S alone (alpha is recomputed from it):
      S = R log2(e) / tau_p comes out of the product (the constant is folded into the anchors), so
      alpha = softmax_t(R / tau_p) = 2^(S - m) / sum_t 2^(S - m), m = max_t S; exp2 runs several times
      faster than exp in this torch build on this CPU (measured 0.3 vs 2.4 ns an entry);
      padding gets S = 0 (its Z rows are 0) and a -inf bias in the softmax, only in chunks that have some.
    Backward, with g = dL/dp (B, K) and G = dL/dY (B, K, c), from Eq. (5)-(6):
        dp_k / dR_tk = alpha_tk (1 + (R_tk - p_k) / tau_p)
        dY_kc / dR_tk = alpha_tk (V_tc - Y_kc) / tau_p
        dR = alpha * (g (1 + R / tau_p - p / tau_p) + (V G^T - sum_c Y G) / tau_p),
        dZ = dR A,   dA = sum_b dR^T Z,   dV = alpha G
    tests/test_fast_forms.py checks it against the naive form (values and gradients, with padding) and
    with torch.autograd.gradcheck in float64."""

    @staticmethod
    def forward(ctx, Z, A, mask, tau_p, V, chunk, keep):
        (B, T, _), K = Z.shape, len(A)
        log2e = 1 / math.log(2)
        A_s = A * (log2e / tau_p)                                     # (K, D): S = Z A_s^T = R log2(e) / tau_p
        S_all = Z.new_empty(B, T, K) if keep else None                # a training step keeps S for the backward
        work = Z.new_empty(3, min(chunk, B), T, K)                    # reused buffers, (3, b, T, K)
        p, Y, m_all, sum_all = [], [], [], []
        for i in range(0, B, chunk):
            b = min(chunk, B - i)
            S = torch.matmul(Z[i:i + chunk], A_s.T, out=S_all[i:i + b] if keep else work[0, :b])  # Eq. (4), (b, T, K)
            logits = S
            if not mask[i:i + chunk].all():                           # padding: -inf before the softmax
                bias = S.new_zeros(b, T, 1).masked_fill_(~mask[i:i + chunk, :, None], float("-inf"))
                logits = torch.add(S, bias, out=work[1, :b])
            m = logits.amax(dim=1, keepdim=True)                      # (b, 1, K)
            E = torch.sub(logits, m, out=work[1, :b]).exp2_()         # Eq. (5) numerator, (b, T, K)
            E_sum = E.sum(dim=1, keepdim=True)                        # (b, 1, K)
            p.append(torch.mul(E, S, out=work[2, :b]).sum(1) / E_sum[:, 0] * (tau_p / log2e))  # Eq. (6), (b, K)
            if V is not None:
                EV = V[i:i + chunk].transpose(1, 2) @ E                   # (b, c, K): this way round, a wide
                Y.append((EV / E_sum).transpose(1, 2))                    # product (26x faster); alpha^T V (b, K, c)
            m_all.append(m)
            sum_all.append(E_sum)
        p = torch.cat(p)                                              # (B, K)
        Y = torch.cat(Y) if V is not None else p.new_zeros(0)         # (B, K, c)
        if keep:
            ctx.save_for_backward(Z, A, mask, p, Y, S_all, torch.cat(m_all), torch.cat(sum_all),
                                  *([] if V is None else [V]))
        ctx.tau_p, ctx.chunk, ctx.has_V = tau_p, chunk, V is not None
        return p, Y

    @staticmethod
    def backward(ctx, g, G):
        Z, A, mask, p, Y, S_all, m_all, sum_all, *V = ctx.saved_tensors
        V = V[0] if ctx.has_V else None
        tau_p, chunk, (B, T, _), K = ctx.tau_p, ctx.chunk, Z.shape, len(A)
        ln2 = math.log(2)
        dZ = torch.zeros_like(Z) if ctx.needs_input_grad[0] else None
        dA = torch.zeros_like(A)
        dV = torch.zeros_like(V) if ctx.has_V and ctx.needs_input_grad[4] else None
        work = Z.new_empty(2, min(chunk, B), T, K)                    # reused buffers, (2, b, T, K)
        for i in range(0, B, chunk):
            b = min(chunk, B - i)
            S, logits = S_all[i:i + b], S_all[i:i + b]                # (b, T, K)
            if not mask[i:i + chunk].all():
                bias = S.new_zeros(b, T, 1).masked_fill_(~mask[i:i + chunk, :, None], float("-inf"))
                logits = torch.add(S, bias, out=work[0, :b])
            alpha = torch.sub(logits, m_all[i:i + b], out=work[0, :b]).exp2_().div_(sum_all[i:i + b])  # Eq. (5)
            g_c = g[i:i + chunk, None]                                # (b, 1, K)
            shift = g_c * (1 - p[i:i + chunk, None] / tau_p)          # (b, 1, K)
            if ctx.has_V:
                G_c = G[i:i + chunk] / tau_p                          # (b, K, c)
                shift = shift - (Y[i:i + chunk] * G_c).sum(-1)[:, None]
            dR = torch.addcmul(shift, S, g_c * ln2, out=work[1, :b])  # g (1 + R / tau_p - p / tau_p) [- sum_c Y G / tau_p]
            if ctx.has_V:
                dR.baddbmm_(V[i:i + chunk], G_c.transpose(1, 2))      # + V G^T / tau_p
                if dV is not None:
                    dV[i:i + chunk] = (G_c.transpose(1, 2) @ alpha.transpose(1, 2)).transpose(1, 2) * tau_p  # (b, T, c)
            dR.mul_(alpha)                                            # (b, T, K)
            dA.addmm_(dR.flatten(0, 1).T, Z[i:i + chunk].flatten(0, 1))
            if dZ is not None:
                dZ[i:i + chunk] = dR @ A
        return dZ, dA, None, None, dV, None, None


def chunked_cap(Z, A, mask, tau_p, V=None, chunk_elements=2 ** 18):
    """p (B, K) = cap(relative(Z, A), mask, tau_p)[0], and Y = alpha^T V (B, K, c) if V is given, in chunks
    of about chunk_elements (b, T, K) entries (1 MB of float32, a core's L2 cache here). Tokens padded in
    every row of the batch (the image's global slot, choice 2) are dropped first: they weigh 0 anyway."""
    real = mask.any(dim=0)                                            # (T,)
    if not real.all():
        t = real.nonzero()[:, 0]
        t = slice(t[0], t[-1] + 1) if real[t[0]:t[-1] + 1].all() else t  # a view where it can be
        Z, mask, V = Z[:, t], mask[:, t], V if V is None else V[:, t]
    chunk = max(1, chunk_elements // (Z.shape[1] * A.shape[0]))
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (Z, A, V))
    Z = F.normalize(Z, dim=-1)                                        # unit rows
    if not mask.all():
        Z = Z * mask[..., None]                                       # padding exactly 0
    return ChunkedCAP.apply(Z, F.normalize(A, dim=-1), mask, tau_p, V, chunk, keep)


def masked_mean(R, mask):
    """Uniform pooling over the real tokens (Table 5, '+ full tokens'), (B, K)."""
    m = mask[..., None].to(R.dtype)                  # (B, T, 1)
    return (R * m).sum(dim=1) / m.sum(dim=1)


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


def draw_anchor_figure(image, heatmaps, anchor_ids, word_lists, caption, path, size=160):
    """Fig. 3, one row: the image, then per anchor its patch attention blended over
    the image with the caption words it attends to (alpha > 0.5) written under it.
    image: uint8 (3, S, S); heatmaps: list of (H, W) in [0, 1]."""
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
    canvas.save(path)


# ---------------------------------------------------------------- the method


class PAL(nn.Module):
    defaults = dict(lr=3e-2, epochs=20, batch_size=256, weight_decay=0.0, optimizer="adamw")  # choice 5
    ranges = dict(K="[5, inf)",  # analyse() reads each pair's top-5 anchors (Table 4)
                  tau_p="(0, inf)", tau="(0, inf)", pooling=("cap", "mean", "global"), init=("gaussian", "tokens"))

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (distributed.py)

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text,
                 K=512,            # PAL §5.1
                 tau_p=0.03,       # PAL §5.1, Table 7
                 tau=0.05,         # not in the paper: choice 1
                 pooling=None,     # "cap" PAL §4.2; "mean" / "global": Table 5 ablation; None: choice 8
                 init="gaussian",  # choice 4; or "tokens"
                 head_rows=None):  # set by align.py when aligning on head rows alone: what the head reads (choice 8)
        super().__init__()
        assert head_rows in (None, "pooled", "patches"), head_rows
        if pooling is None:                                # choice 8: read test images as the head rows were
            pooling = "global" if head_rows == "pooled" else "cap"
        assert pooling in ("cap", "mean", "global"), pooling
        assert init in ("tokens", "gaussian"), init
        self.A_v = nn.Parameter(torch.randn(K, d_image))   # Eq. (2), (K, D_v)
        self.A_l = nn.Parameter(torch.randn(K, d_text))    # Eq. (2), (K, D_l)
        self.K, self.tau_p, self.tau, self.pooling, self.init = K, tau_p, tau, pooling, init
        self.register_buffer("initialised", torch.tensor(init == "gaussian"))

    @staticmethod
    def Z(x, modality):
        """The patch or word tokens CAP reads (choice 2): Z (B, T, D) and its mask (B, T)."""
        if modality == "image" and x.grid is not None:
            H, W = x.grid
            Z, mask = x.tokens[:, 1:1 + H * W], x.mask[:, 1:1 + H * W]   # patches, no global token (token contract)
            vector = ~mask.any(1)                          # (B,) a sample that is ONE vector (a head row in D_aug)
            Z = torch.cat([x.tokens[:, :1], Z], 1)         # ... reads that vector as its only token
            return Z, torch.cat([vector[:, None], mask], 1)
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
        if self.pooling == "cap":                          # = cap(relative(Z, A), mask, tau_p)[0], in chunks (choice 9)
            return chunked_cap(Z, A, mask, self.tau_p)[0]                  # Eq. (3)-(6), (B, K)
        return masked_mean(relative(Z, A), mask)           # Eq. (4); "mean"; "global" has T = 1

    @torch.no_grad()
    def init_from_tokens(self, img, txt):
        """Choice 4: anchors <- K random real tokens of this batch, rescaled to norm sqrt(D)."""
        for A, x, modality in ((self.A_v, img, "image"), (self.A_l, txt, "text")):
            Z, mask = self.tokens(x, modality)
            z = Z[mask]                                                        # (N_real, D)
            K, D = A.shape
            # without replacement when there are enough tokens; tiny noise breaks ties
            idx = torch.randperm(len(z))[:K] if len(z) >= K else torch.randint(len(z), (K,))
            a = F.normalize(z[idx].float(), dim=-1)
            a = a + 1e-2 * torch.randn_like(a) / D ** 0.5
            A.copy_(F.normalize(a, dim=-1) * D ** 0.5)
        self.initialised.fill_(True)

    def embed_image(self, img):
        return F.normalize(self.pool(img, "image"), dim=-1)   # Eq. (7), (B, K)

    def embed_text(self, txt):
        return F.normalize(self.pool(txt, "text"), dim=-1)    # Eq. (7), (B, K)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                            # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(relative(img.patches(), self.A_v), dim=-1)  # Eq. (4) per patch, (B, H*W, K)

    def loss(self, img, txt):
        if not self.initialised:                              # first batch only (choice 4)
            self.init_from_tokens(img, txt)
        loss = info_nce(self.embed_image(img), self.embed_text(txt), self.tau)  # Eq. (8)
        return loss, {"nce": loss.item()}

    @torch.no_grad()
    def analyse(self, img, txt, images, words, out_dir, n_figures=4, n_anchors=3):
        """Table 4 anchor overlap on all pairs, and Fig. 3 for the first n_figures pairs:
        the n_anchors anchors contributing most to the pair's score h_v[k] h_l[k]."""
        chunks = [torch.arange(len(img))[b:b + 256] for b in range(0, len(img), 256)]  # bound memory
        p_v = torch.cat([self.pool(img[c], "image") for c in chunks])           # (N, K)
        p_l = torch.cat([self.pool(txt[c], "text") for c in chunks])            # (N, K)
        metrics = anchor_overlap(p_v, p_l)
        if img.grid is None:                                # no patch grid to draw on
            return metrics
        H, W = img.grid
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        n = min(n_figures, len(img))
        # CAP attention over the patches / words (drawn whatever `pooling` is), (n, T, K)
        Z_v, mask_v = self.Z(img[:n], "image")                                 # (n, 1 + H*W, D): slot 0 off for images
        alpha_v = cap(relative(Z_v, self.A_v), mask_v, self.tau_p)[1][:, 1:]    # (n, H*W, K)
        alpha_l = cap(relative(txt.tokens[:n], self.A_l), txt.mask[:n], self.tau_p)[1]
        contribution = F.normalize(p_v[:n], dim=-1) * F.normalize(p_l[:n], dim=-1)  # (n, K)
        for i in range(n):
            ks = contribution[i].topk(n_anchors).indices.tolist()
            heatmaps, word_lists = [], []
            for k in ks:
                a = alpha_v[i, :, k].reshape(H, W)                             # over the patch grid
                heatmaps.append(a / a.max().clamp_min(1e-12))                  # scaled to its maximum
                word_lists.append([words[i][t] for t in range(alpha_l.shape[1])
                                   if txt.mask[i, t] and alpha_l[i, t, k] > 0.5])
            caption = " ".join(w for w, m in zip(words[i], txt.mask[i].tolist()) if m)
            draw_anchor_figure(images[i], heatmaps, ks, word_lists, caption,
                               out_dir / f"pal_anchors_{i}.png")
        return metrics
