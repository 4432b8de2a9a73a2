"""CoV-Align: Efficient Fine-grained Cross-Modal Alignment with Cohesive Visual
Semantics Priority (CVPR 2026; no official code is public).

Idea: aggregate the image patches into a few semantic REGIONS without looking at
the text (once per image, cacheable), then align regions with words. Here the
encoders stay FROZEN (post-hoc setting): only the projections, the region queries
and the CVSFE / assign-attention layers train.

What it implements, by the parts of the paper's method (CVSFE, CDFO, sparse region-word
alignment, loss function and training strategy; the equations there carry no numbers):
  CVSFE, deformable attention     z_q' = sum_m W_m [ sum_p A_mqp F(p_q + dp_mqp) ]
  CVSFE, consistent assign        Attn = softmax_patches( (z W)(F W)^T / tau )
  CVSFE, threshold mask           hatAttn = minmax(x) per region, r_q = barAttn V F, by --hp mask (choice 6):
                                    "softmax_hat" (default, the summary's): x = Attn, barAttn = hatAttn [hatAttn >= eps]
                                    "scores_renorm": x = scores, barAttn = Attn renormalised over [hatAttn >= eps]
                                    "scores_hat": x = scores, barAttn = hatAttn [hatAttn >= eps]
                                    "softmax_renorm": x = Attn, barAttn = Attn renormalised over [hatAttn >= eps]
                                    "none": barAttn = Attn (no mask, as eps = 0 under the *_renorm readings)
  CDFO, spatial concentration     c_q = sum_ij a_q(i,j) p_ij,  L_conc = sum_ij a_q(i,j) ||p_ij - c_q||
  CDFO, visual contrastive        L_v2v = -1/N_q sum_i log softmax_j(r_i . r_j / tau_1)_i
  sparse region-word alignment    S(I,T) = 1/N_q sum_i max_j s_ij + 1/L sum_j max_i s_ij
  loss function                   L = lambda_g/2 (L_t2v + L_v2t) + lambda_v L_v2v + lambda_c L_conc

Symbols -> variables:
  F_v (patches) -> patches, F (projected) -> F_img;  F_t (words) -> words
  z_q -> self.z (queries), p_q -> self.ref (reference points), dp -> offsets,
  A_mqp -> A, M -> n_heads, P (the paper's K sampling points) -> n_points, W_m -> self.out_proj,
  W -> self.W_assign, V -> self.V, tau -> tau, eps -> eps, N_q -> n_regions,
  the assign scores cos(zW, FW) / tau (before the softmax) -> logits, Attn -> attn, hatAttn -> attn_hat,
  barAttn -> attn_bar, [hatAttn >= eps] -> keep, r_q -> r, c_q -> c, tau_1 -> tau_1,
  s_ij -> s, S(I,T) -> S, lambda_{g,v,c} -> lambda_g, lambda_v, lambda_c.
Shapes: K is the shared output dim (the README's alphabet); the deformable step's sampling
points, K in the paper, are P here; D is the feature dim inside DeformableAttention; N = H*W patches.

Deviations / choices (the paper leaves these open):
1. Encoders frozen; patches and words are projected to dim=512 by linear maps; the global token
   takes no part; the words exclude CLS / SEP (the token contract), so 1/L in S(I,T) counts
   words (with the tiny encoder's [CLS] as a word: RSum 402.0 against 410.9, one seed).
2. ONE deformable layer, z' = LayerNorm(z + DeformAttn(z)), then ONE assign attention with z';
   the offsets depend on z only, the image enters through the sampled values (deformable=False
   skips the deformable step).
3. Heads M = 4, points P = 4 (Deformable DETR's 8 x 4 halved, Zhu et al., ICLR 2021), its init:
   offset weights 0, bias = per-head direction (cos, sin) / max(|cos|, |sin|) times (p+1) patches,
   uniform point weights.
4. Reference points p_q: a FIXED grid of cell centres (e.g. 2 x 4 for 8 regions) in [0, 1]
   image coordinates (x, y); the offsets learn the rest.
5. Assign attention on cosines of zW and FW, so tau = 0.1 does not depend on the feature scale.
6. Threshold mask (--hp mask): the summary min-max normalises each region's attention Attn (the softmax
   output) to hatAttn, keeps the patches with hatAttn >= eps and pools r_q = barAttn V F. Five readings, each
   named "what is min-maxed _ what weights the kept patches": "softmax_hat" (the default), that sentence
   literally (rows do not sum to 1; r is L2-normalised after); "softmax_renorm", the same patches weighted by
   Attn renormalised over them; "scores_hat" and "scores_renorm" min-max the scores (cos / tau, before the
   softmax) instead, so eps keeps the top 1 - eps of each region's cosine range whatever tau is, where the
   min-max of Attn keeps a band of tau ln(1/eps) on the cosine (0.036 at tau 0.1: 1.5 of 64 patches on the
   Shapes validation images, against 10.1 for the scores); "none" keeps every patch (the eps = 0 ablation).
   The arg-max patch always gets hatAttn = 1, so every row keeps a patch (else S = -inf). The default was
   chosen on validation pairs held out from the alignment pairs over 3 seeds, task by task in units of each
   task's seed spread (benchmarks/cov_mask.py): no reading beats the literal one on a task without losing
   another by more than its spread (scores_renorm: RSum +33.7 +- 2.1, mIoU-fg -2.5 +- 2.3). threshold_mask's
   own default reading is scores_renorm, the course's exercise 5.
7. L_conc uses the full softmax attention (before the mask), so its gradient reaches every patch;
   patch centres are ((j+.5)/W, (i+.5)/H).
8. Temperatures: tau_1 = 0.1 (L_v2v), tau_g = 0.05 (InfoNCE over S, which lies in [-2, 2]).
9. score() treats all-zero rows as padding on both sides and runs in chunks of at most
   score_chunk elements of the (images, texts, Q, L) tensor.
10. dense_image: each patch as a one-region image, r = V F_p, shape (B, H*W, 1, K).
11. Adam, weight decay 1e-4, 30 epochs, batch 128 as the paper, but lr 3e-3: the paper's 1e-4
    barely moves the fresh projections (planted data, test R@1 i2t 3 at 1e-4, 45 at 3e-3).
12. eps = 0.7, the paper's, confirmed on held-out training pairs over 3 seeds under mask=scores_renorm
    (benchmarks/select_defaults.py; docs/results.md, "Defaults chosen on held-out pairs");
    eps = 0 (every patch in every region) stays an ablation.
13. The assign softmax runs over the patches (each region a distribution over the patches, as the paper's
    Attn), not over the queries (slot attention's competition for each patch).
14. L_v2v reads the L2-normalised r (cosines / tau_1, like s_ij); the paper writes r_i^T r_j, whose
    diagonal grows with ||r||, so unnormalised regions could lower the loss by scale alone.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .filip import token_max as max_mean  # S(I,T)'s two terms: FILIP's token-wise max, its Eq. (4)-(5)
from .layernorm import LayerNorm
from .losses import info_nce_of_logits, score_in_chunks

# ----------------------------------------------------------------------------- helpers

def deformable_sample(value, loc, A):
    """Bilinear sampling of a value grid at sparse points, weighted sum over the points.

    value (B, M, Dh, H, W); loc (B, Q, M, P, 2) in [0,1] image coords (x, y);
    A (B, Q, M, P) weights.  Returns (B, Q, M, Dh) = sum_p A_mqp value_m(loc_mqp).
    Points outside the grid read zeros; pixel centres sit at (j+.5)/W (align_corners=False).
    """
    # EXERCISE 4 (CoV's CVSFE deformable attention, Deformable-DETR's core): grid_sample value (B, M, Dh, H, W)
    #   bilinearly at loc (B, Q, M, P, 2) in [0,1] (x, y), align_corners=False, zeros outside; sum over the P
    #   points weighted by A (B, Q, M, P)
    #   -> (B, Q, M, Dh)
    B, M, Dh, H, W = value.shape
    Q = loc.shape[1]
    grid = (2 * loc - 1).permute(0, 2, 1, 3, 4).flatten(0, 1)          # (B*M, Q, P, 2) in [-1,1]
    sampled = F.grid_sample(value.flatten(0, 1), grid, mode="bilinear",
                            padding_mode="zeros", align_corners=False)  # (B*M, Dh, Q, P)
    w = A.permute(0, 2, 1, 3).flatten(0, 1)[:, None]                   # (B*M, 1, Q, P)
    out = (sampled * w).sum(-1)                                         # (B*M, Dh, Q)
    return out.view(B, M, Dh, Q).permute(0, 3, 1, 2)                    # (B, Q, M, Dh)
    # END EXERCISE 4


# the readings of the threshold mask (choice 6), each named "what hatAttn min-maxes _ what weights the kept patches"
MASKS = ("scores_renorm", "scores_hat", "softmax_hat", "softmax_renorm", "none")


def threshold_mask(logits, eps, reading="scores_renorm"):
    """CVSFE threshold mask: barAttn over the patches whose score, min-max normalised per row to
    hatAttn in [0, 1], is >= eps; the softmax of the scores renormalised over those kept patches.

    logits (..., N) are the assign scores cos(zW, FW) / tau BEFORE the softmax (choice 6): min-max
    is invariant to the 1/tau scale, so eps cuts the cosines' own range whatever tau is. The arg-max
    patch(es) get hatAttn = 1, so every row keeps at least its top patch, and a constant row (0/0 in
    the min-max, e.g. a blank image whose patches are all alike) keeps every patch. eps = 0 keeps
    every patch: barAttn is then the full softmax (the paper's "all patches in" ablation).
    reading (choice 6): "scores_renorm" as above; the others in other_reading."""
    if reading != "scores_renorm":
        return other_reading(logits, eps, reading)
    # EXERCISE 5 (CoV's CVSFE threshold mask): min-max normalise each row of the scores logits (..., N) over the patches
    #   to hatAttn in [0,1] (the arg-max patch gets hatAttn = 1, even on a constant row); keep the patches with
    #   hatAttn >= eps; barAttn = softmax of logits over the kept patches only (0 elsewhere) -> (..., N)
    lo = logits.amin(-1, keepdim=True)
    hi = logits.amax(-1, keepdim=True)
    attn_hat = (logits - lo) / (hi - lo).clamp_min(1e-12)              # hatAttn, (..., N)
    attn_hat = attn_hat.masked_fill(logits >= hi, 1.0)                 # top patch survives any eps <= 1
    keep = attn_hat >= eps                                             # the mask, (..., N)
    return logits.masked_fill(~keep, float("-inf")).softmax(-1)        # barAttn, (..., N), rows sum to 1
    # END EXERCISE 5


def other_reading(logits, eps, reading):
    """threshold_mask's other readings (choice 6), logits (..., N) -> barAttn (..., N):
    "softmax_hat", the summary's literal form: hatAttn = min-max of Attn = softmax(logits), barAttn = hatAttn
      where hatAttn >= eps (rows do not sum to 1; the arg-max patch weighs 1);
    "scores_hat": hatAttn = min-max of the logits, barAttn = hatAttn where hatAttn >= eps;
    "softmax_renorm": hatAttn = min-max of Attn, barAttn = Attn renormalised over the kept patches;
    "none": barAttn = Attn, every patch (eps unused)."""
    attn = logits.softmax(-1)                                          # Attn, (..., N)
    if reading == "none":
        return attn
    x = attn if reading.startswith("softmax") else logits              # what hatAttn min-maxes
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    attn_hat = ((x - lo) / (hi - lo).clamp_min(1e-12)).masked_fill(x >= hi, 1.0)   # hatAttn, (..., N)
    keep = attn_hat >= eps                                             # the mask, (..., N)
    if reading.endswith("_hat"):
        return attn_hat * keep                                         # barAttn = hatAttn [hatAttn >= eps]
    kept = attn * keep                                                 # Attn on the kept patches
    return kept / kept.sum(-1, keepdim=True)                           # renormalised over them, (..., N)


def kept_and_effective(attn_bar):
    """How many patches a region pools: (kept, effective), each the mean over the regions of attn_bar (..., N):
    kept = #{barAttn > 0}, effective = 1 / sum_p w_p^2 of w = barAttn / sum_p barAttn (the participation
    ratio: n for n equal weights, 1 for one patch)."""
    w = attn_bar / attn_bar.sum(-1, keepdim=True)
    kept = (attn_bar > 0).sum(-1).double()
    return kept.mean().item(), (1 / w.double().pow(2).sum(-1)).mean().item()


def max_sum(r, w):
    """S(I,T) of the sparse region-word alignment for all pairs: r (I, Q, K), w (T, L, K) unit or all-zero rows -> S (I, T)."""
    i2t, t2i = max_mean(r, w)
    return i2t + t2i                                                    # S(I,T), (I, T)


def grid_centres(rows, cols, device=None):
    """(rows*cols, 2) cell centres (x, y) in [0,1], row-major."""
    y = (torch.arange(rows, device=device) + 0.5) / rows
    x = (torch.arange(cols, device=device) + 0.5) / cols
    return torch.stack(torch.meshgrid(x, y, indexing="xy"), -1).reshape(-1, 2)


# ----------------------------------------------------------------------------- CVSFE block

class DeformableAttention(nn.Module):
    """CVSFE deformable attention, single scale, written by hand with grid_sample (Deformable-DETR's PyTorch core)."""

    def __init__(self, dim, n_heads, n_points):
        super().__init__()
        self.M, self.P = n_heads, n_points
        self.offsets = nn.Linear(dim, n_heads * n_points * 2)   # dp_mqp from z_q
        self.weights = nn.Linear(dim, n_heads * n_points)       # A_mqp from z_q (softmax over the points)
        self.value = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)                     # W_m for all heads at once
        # Deformable-DETR init: head m looks along direction theta_m, point p at distance p+1
        nn.init.zeros_(self.offsets.weight)
        theta = torch.arange(n_heads) * 2 * math.pi / n_heads
        direction = torch.stack([theta.cos(), theta.sin()], -1)                    # (M, 2)
        direction = direction / direction.abs().amax(-1, keepdim=True)            # on the unit square, as theirs
        bias = direction[:, None] * torch.arange(1, n_points + 1)[None, :, None]    # (M, P, 2)
        with torch.no_grad():
            self.offsets.bias.copy_(bias.flatten())
        nn.init.zeros_(self.weights.weight)                     # uniform softmax over the points
        nn.init.zeros_(self.weights.bias)

    def forward(self, z, ref, F_img, grid):
        """z (B, Q, D) queries, ref (Q, 2) in [0,1], F_img (B, H*W, D) -> (B, Q, D)."""
        (B, Q, D), (H, W), M, P = z.shape, grid, self.M, self.P
        value = self.value(F_img).view(B, H, W, M, D // M).permute(0, 3, 4, 1, 2)  # (B, M, Dh, H, W)
        dp = self.offsets(z).view(B, Q, M, P, 2)                                  # offsets in patches
        A = self.weights(z).view(B, Q, M, P).softmax(-1)                          # A_mqp, (B, Q, M, P)
        loc = ref[None, :, None, None] + dp / torch.tensor([W, H], device=z.device, dtype=z.dtype)
        out = deformable_sample(value, loc, A)                                    # (B, Q, M, Dh)
        return self.out_proj(out.flatten(2))                                      # z_q', (B, Q, D)


# ----------------------------------------------------------------------------- the method

class CoV(Method):
    defaults = dict(lr=3e-3,           # CoV-Align, training strategy: 1e-4; 3e-3 here (choice 11)
                    epochs=30,         # CoV-Align, training strategy
                    batch_size=128,    # CoV-Align, efficiency experiments
                    weight_decay=1e-4,  # CoV-Align, training strategy
                    optimizer="adam")  # CoV-Align, training strategy (with cosine annealing)
    ranges = dict(dim="[1, inf)", n_regions="[1, inf)", n_heads="[1, inf)", n_points="[1, inf)",
                  eps="[0, 1]", mask=MASKS,  # the threshold mask compares hatAttn in [0, 1]: eps > 1 keeps no patch
                  tau="(0, inf)", tau_1="(0, inf)", tau_g="(0, inf)", lambda_g="[0, inf)", lambda_v="[0, inf)",
                  lambda_c="[0, inf)", score_chunk="[1, inf)")  # valid --hp values (align.py)

    refuses_align_data = dict.fromkeys(("weights", "weights+pairs"),  # head rows: one vector each
                                        "its regions attend over the patch tokens, and a head row is one vector "
                                        "with no patches")

    def contrastive_scale(self):  # 1 / temperature of its InfoNCE logits (--hard-negatives); not tau
        return 1 / self.tau_g

    def __init__(self, d_image, d_text,
                 dim=512,            # CoV-Align, training strategy: a 512-d shared space
                 n_regions=8,        # N_q, CoV-Align, CVSFE
                 eps=0.7,            # CoV-Align, CVSFE (choices 6, 12)
                 mask="softmax_hat",  # the threshold mask's reading: the summary's literal form (choice 6)
                 n_heads=4,          # M, choice 3
                 n_points=4,         # P, choice 3
                 tau=0.1,            # assign attention, choice 5
                 tau_1=0.1,          # L_v2v, choice 8
                 tau_g=0.05,         # InfoNCE, choice 8
                 lambda_g=1.0, lambda_v=1.0, lambda_c=0.5,  # CoV-Align, loss function
                 deformable=True, use_v2v=True, use_conc=True,  # ablation switches
                 score_chunk=2 ** 24):  # max elements of one (I, T, Q, L) chunk in score()
        super().__init__()
        assert dim % n_heads == 0
        self.P_v = nn.Linear(d_image, dim)                       # patch projection
        self.P_t = nn.Linear(d_text, dim)                        # word projection
        self.z = nn.Parameter(torch.randn(n_regions, dim) * 0.02)  # region queries z_q
        rows = int(math.sqrt(n_regions))
        cols = math.ceil(n_regions / rows)
        self.register_buffer("ref", grid_centres(rows, cols)[:n_regions])  # p_q, (Q, 2)
        self.deform = DeformableAttention(dim, n_heads, n_points) if deformable else None
        self.norm = LayerNorm(dim) if deformable else None     # z' = LN(z + DeformAttn(z))
        self.W_assign = nn.Linear(dim, dim, bias=False)          # the ONE shared W (consistent assign)
        self.V = nn.Linear(dim, dim, bias=False)                 # value projection (threshold mask)
        self.mask = mask
        self.eps, self.tau, self.tau_1, self.tau_g = eps, tau, tau_1, tau_g
        self.lambda_g, self.lambda_v, self.lambda_c = lambda_g, lambda_v, lambda_c
        self.use_v2v, self.use_conc, self.score_chunk = use_v2v, use_conc, score_chunk

    # --- CVSFE: text-free regions (deformable attention, consistent assign, threshold mask)
    def regions(self, img):
        """-> r (B, Q, K) unnormalised region features, attn (B, Q, N) softmax, attn_bar (B, Q, N)."""
        F_img = self.P_v(img.patches())                          # F, (B, N=H*W, K)
        z = self.z.expand(len(F_img), -1, -1)                    # z_q, (B, Q, K)
        if self.deform is not None:
            z = self.norm(z + self.deform(z, self.ref, F_img, img.grid))  # deformable attention, (B, Q, K)
        # EXERCISE 5 (CoV's CVSFE assign attention and mask): attn = softmax over the patches of cos(W z, W F) / tau with the ONE shared W
        #   (B, Q, N); attn_bar = threshold_mask(scores before the softmax, eps); r = attn_bar V F (B, Q, K)
        zW = F.normalize(self.W_assign(z), dim=-1)               # (B, Q, K)
        FW = F.normalize(self.W_assign(F_img), dim=-1)           # (B, N, K)
        logits = zW @ FW.transpose(1, 2) / self.tau              # assign scores, (B, Q, N)
        attn = logits.softmax(-1)                                # consistent assign over the patches, (B, Q, N)
        attn_bar = threshold_mask(logits, self.eps, self.mask)   # threshold mask, (B, Q, N)
        r = attn_bar @ self.V(F_img)                             # r_q, (B, Q, K)
        # END EXERCISE 5
        return r, attn, attn_bar

    def embed_image(self, img):
        return F.normalize(self.regions(img)[0], dim=-1)         # (B, Q, K), once per image

    def embed_text(self, txt):
        w = F.normalize(self.P_t(txt.tokens), dim=-1)            # (B, L, K)
        return w * txt.mask[..., None]                           # padded words exactly 0

    def dense_image(self, img):
        r = self.V(self.P_v(img.patches()))                      # each patch a one-region image
        return F.normalize(r, dim=-1)[:, :, None]                # (B, H*W, 1, K)

    def score(self, img_emb, txt_emb):
        """S(I,T) for all pairs, in chunks of <= score_chunk elements -> (N_img, N_txt)."""
        return score_in_chunks(max_sum, img_emb, txt_emb, self.score_chunk)

    # --- CDFO and the loss function
    def loss(self, img, txt):
        r, attn, _ = self.regions(img)
        r = F.normalize(r, dim=-1)                               # (B, Q, K)
        w = self.embed_text(txt)                                 # (B, L, K)
        S = max_sum(r, w)                                        # S(I,T), (B, B)
        l_g = info_nce_of_logits(S / self.tau_g)                 # (L_t2v + L_v2t) / 2
        loss, logs = self.lambda_g * l_g, {"nce": l_g.detach()}
        if self.use_v2v:
            rr = r @ r.transpose(1, 2) / self.tau_1              # r_i . r_j / tau_1, (B, Q, Q)
            target = torch.arange(rr.shape[1], device=rr.device).expand(len(rr), -1)
            l_v = F.cross_entropy(rr.flatten(0, 1), target.flatten())  # L_v2v (CDFO)
            loss, logs["v2v"] = loss + self.lambda_v * l_v, l_v.detach()
        if self.use_conc:
            # EXERCISE 5 (CoV's CDFO spatial concentration): L_conc = the spread of the FULL softmax attention attn (B, Q, N), mean over
            #   queries and batch
            l_c = self.spread(attn, img.grid).mean()             # L_conc, mean over queries and batch
            # END EXERCISE 5
            loss, logs["conc"] = loss + self.lambda_c * l_c, l_c.detach()
        return loss, logs

    @staticmethod
    def spread(a, grid):
        """CDFO spatial concentration: a (B, Q, H*W) weights summing to 1 -> (B, Q) sum_ij a ||p_ij - c_q||."""
        # EXERCISE 5 (CoV's CDFO spatial concentration): c_q = sum_ij a_q(i,j) p_ij with patch centres p_ij in [0,1] (grid_centres),
        #   spread_q = sum_ij a_q(i,j) ||p_ij - c_q||; a (B, Q, H*W) -> (B, Q)
        H, W = grid
        p = grid_centres(H, W, device=a.device).to(a.dtype)      # p_ij in [0,1], (H*W, 2)
        c = a @ p                                                # c_q, (B, Q, 2)
        dist = ((p[None, None] - c[:, :, None]).pow(2).sum(-1) + 1e-12).sqrt()  # (B, Q, H*W)
        return (a * dist).sum(-1)
        # END EXERCISE 5

    # --- optional analysis hook: region maps
    @torch.no_grad()
    def analyse(self, img, txt, images, words, figure):
        """PNG per test image (up to 4): the image, then each region's masked assign
        attention (barAttn) over the patch grid, in red on the dimmed image. figure(image, name): the run's
        figure writer."""
        from PIL import Image
        n = min(4, len(img))
        _, attn, attn_bar = self.regions(img[:n])
        (H, W), Q, S = img.grid, attn_bar.shape[1], 96          # S: tile side in pixels
        for i in range(n):
            canvas = Image.new("RGB", ((Q + 1) * (S + 4), S), "white")
            photo = Image.fromarray(images[i].permute(1, 2, 0).cpu().numpy()).resize((S, S))
            canvas.paste(photo, (0, 0))
            for q in range(Q):
                m = attn_bar[i, q].view(H, W)
                m = (255 * m / m.max().clamp_min(1e-12)).byte().cpu().numpy()
                heat = Image.fromarray(m, "L").resize((S, S), Image.NEAREST)
                black = Image.new("L", (S, S), 0)
                tile = Image.blend(photo, Image.merge("RGB", (heat, black, black)), 0.6)
                canvas.paste(tile, ((q + 1) * (S + 4), 0))
            figure(canvas, f"cov_regions_{i}.png")
        spread_full = self.spread(attn, img.grid).mean().item()
        spread_bar = self.spread(attn_bar, img.grid).mean().item()
        kept = (attn_bar > 0).float().sum(-1).mean().item()
        return {"cov_spread": spread_full, "cov_spread_masked": spread_bar, "cov_patches_per_region": kept}
