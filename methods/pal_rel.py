"""PAL-Rel: a relation-aware VARIANT of PAL, not a method of the papers.

PAL: "Learning Relative Representations for Fine-Grained Multimodal Alignment with
Limited Data" (methods/pal.py). PAL pools each modality into one K-vector of anchor
activations; a relation ("the circle is LEFT OF the square") is a property of a PAIR
of objects, which one pooled vector cannot compare. The smallest addition that can:
each anchor already attends to a place in the image (PAL Eq. 5), so it can report
WHERE it looked; on the text side, the words it attends to say where that thing
should be, read off the word that states the relation and how far from it each word
sits. PAL's Eqs. (3)-(8) and anchors are kept; the additions are (R1)-(R4):

    h_v, h_l  = PAL's pooled, normalised anchor activations          PAL Eqs. (3)-(7)
    beta[t, k] = softmax over patches t of R_v[t, k] / tau_p           (R1) (B, H*W, K)
    c_k       = sum_t beta[t, k] pos_t,  pos_t in [-1, 1]^2 (x, y)     (R1) where anchor k looks, (B, K, 2)
    rho_j     = softmax over words j of  y_j . u                       (R2) which word states the relation, (B, L)
    M(y_j)    = reshape(V^T y_j, (2, 2W + 1))                          (R2) how word j places its neighbours
    o_w       = U^T y_w + sum_{|w - j| <= W} rho_j M(y_j)[:, w - j + W]  (R2) where word w's thing is, (B, L, 2)
    d_k       = sum_w alpha_l[w, k] o_w                                (R3) PAL Eq. (5)'s text attention, (B, K, 2)
    s(v, l)   = h_v . h_l + 1/K sum_k (c_k - c_bar) . d_k,  c_bar = mean_k c_k   (R4)

y_w = token w / ||token w||. (R4) is a dot product of e_v = [h_v, vec(c - c_bar)] and
e_l = [h_l, vec(d) / K], (B, 3K) each, so retrieval stays one matrix product. In
"a small red circle to the left of a large blue square", where rho picks out "left"
and its M sends the words before it to (-, 0) and those after it to (+, 0), the anchors
attending to "red circle" and "blue square" then score high only where the red
circle's patches are left of the blue square's. The offset w - j is counted from
the relation word, not from the caption's start, and M reads the relation word
itself, so "to the left of B is A", "B has A on its left" and "B is below and A is
above" (two relation words) are read by the same weights. Trained with PAL's
symmetric InfoNCE, Eq. (8), on s / tau.

Symbols -> variables: A_v, A_l -> self.A_v, self.A_l; R -> R; beta -> beta (CAP's
alpha, choice 2); pos -> pos; c -> c; u -> self.u; rho -> rho; V -> self.V; M -> M;
W -> self.W; U -> self.U; o -> o; alpha_l -> alpha; d -> d; tau_p -> self.tau_p;
tau -> self.tau.

Deviations / choices (each measured in docs/binding.md, "PAL-Rel's choices, measured"):
1. Positions come from the patch grid (Features.grid), as a ViT's position embedding: no position
   code is needed in the tokens.
2. beta (R1) is CAP's alpha over the patches (PAL's Z masks the global token): one chunked pass with
   fast=True (pal.py choice 9).
3. U, V and u start at zero, so PAL-Rel starts as PAL exactly (tests/test_binding.py: scores equal
   to 1e-6).
4. The 1/K in (R4) keeps the relation term on the scale of h_v . h_l: without it one Adam step made
   it dominate the loss.
5. The 1/K sits on the TEXT side (evaluate.py's prompt averaging renormalises e_l, which the image
   side would distort).
6. Gaussian anchors; tau, tau_p and lr as PAL (pal.py choices 1 and 4).
7. dense_image: PAL's per-patch r_t with zeros in the relation part (a patch has no pair to
   compare).
8. order="local" ((R2) as above), the default: offsets from the relation word generalise to held-out
   wordings; "relation" and "index" are the alternatives.
9. W = 8 words either side: W = 5 misses the object phrases of the longest training style, W = 16
   reaches past the nearer object phrase (worse on held-out templates).
10. rho's softmax is written out (softmax_rows): torch's CPU softmax backward on short rows gave weights 1e-12
   apart at 1 and 2 threads on an AMD EPYC (tests/test_threads.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .fast_cap import chunked_cap
from .losses import info_nce
from .pal import PAL, cap, relative


def sincos(x, P=32):
    """(..., P) sin-cos code of real positions x (...,) (Transformer-style, base 10000)."""
    freq = 10000.0 ** (-torch.arange(0, P, 2, device=x.device, dtype=torch.float32) / P)  # (P/2,)
    return torch.cat([torch.sin(x[..., None] * freq), torch.cos(x[..., None] * freq)], dim=-1)


def softmax_rows(x):
    """softmax over dim 1 written out (choice 10): torch's CPU softmax backward for short rows sums in an order
    that depends on the thread count (1e-13 apart at 1 and 2 threads), these elementwise ops do not."""
    e = (x - x.amax(dim=1, keepdim=True)).exp()
    return e / e.sum(dim=1, keepdim=True)


def grid_positions(H, W, device=None):
    """(H*W, 2) patch centres (x, y) in [-1, 1], row-major like the patch tokens."""
    y, x = torch.meshgrid((torch.arange(H, device=device) + 0.5) / H * 2 - 1,
                          (torch.arange(W, device=device) + 0.5) / W * 2 - 1, indexing="ij")
    return torch.stack([x.flatten(), y.flatten()], dim=1)


class PALRel(Method):
    defaults = dict(lr=3e-2, epochs=20, batch_size=256, weight_decay=0.0, optimizer="adamw")  # PAL's (choice 6)
    # valid --hp; P: sin + cos halves
    ranges = dict(K="[1, inf)", tau_p="(0, inf)", tau="(0, inf)", P=(2, 4, 8, 16, 32, 64),
                  order=("local", "relation", "index"), W="[0, inf)",
                  fast=(True, False))  # pal.py choice 9

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)
    refuses_align_data = {"weights": "its relation term (R1) reads the patch grid's positions, and head rows "
                                     "alone have no grid (weights+pairs reads each head row as its one token)"}

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text,
                 K=512,            # PAL §5.1
                 tau_p=0.03,       # PAL §5.1, Table 7
                 tau=0.05,         # pal.py choice 1
                 P=32,             # (R2) order="relation" / "index": sin-cos code size, choice 8
                 order="local",    # (R2) how a word's place is coded, choice 8
                 W=8,              # (R2) order="local": words j - W .. j + W around word j, choice 9
                 fast=True):       # CAP through methods/fast_cap.py (pal.py choice 9), else the paper form
        super().__init__()
        if order not in ("local", "relation", "index"):
            raise ValueError(f"order must be 'local', 'relation' or 'index', not {order!r}")
        self.A_v = nn.Parameter(torch.randn(K, d_image))   # Eq. (2), (K, D_v)
        self.A_l = nn.Parameter(torch.randn(K, d_text))    # Eq. (2), (K, D_l)
        self.U = nn.Parameter(torch.zeros(d_text, 2))      # (R2), (D_l, 2), choice 3
        self.C = 2 * W + 1 if order == "local" else P      # (R2) the code size
        self.V = nn.Parameter(torch.zeros(d_text, 2 * self.C))  # (R2), (D_l, 2C), choice 3
        self.u = nn.Parameter(torch.zeros(d_text)) if order != "index" else None  # (R2) rho's weights, (D_l,)
        self.K, self.P, self.W, self.tau_p, self.tau, self.order = K, P, W, tau_p, tau, order
        self.fast = fast

    def embed_image(self, img):
        Z, mask = PAL.Z(img, "image")                                      # [global (masked), patches]: PAL's Z
        H, W = img.grid
        pos = torch.cat([Z.new_zeros(1, 2), grid_positions(H, W, Z.device)])  # (1 + H*W, 2), the global slot at 0
        # Eqs. (3)-(6) and (R1) in one chunked pass (pal.py choice 9): p (B, K) and c = beta^T pos (B, K, 2)
        if self.fast:
            p, c = chunked_cap(Z, self.A_v, mask, self.tau_p, V=pos.expand(len(Z), -1, -1))
        else:
            p, alpha = cap(relative(Z, self.A_v), mask, self.tau_p)        # Eq. (3)-(6)
            c = alpha.transpose(1, 2) @ pos                                # (R1) beta = alpha, (B, K, 2)
        c = c - c.mean(dim=1, keepdim=True)                                # c_k - c_bar (R4)
        return torch.cat([F.normalize(p, dim=-1), c.flatten(1)], dim=1)    # e_v, (B, 3K)

    def embed_text(self, txt):
        B, L, _ = txt.tokens.shape
        y = F.normalize(txt.tokens, dim=-1)                                # y_w / ||y_w||, (B, L, D_l)
        w = torch.arange(L, device=y.device, dtype=torch.float32)          # word indices, (L,)
        if self.order == "local":                                          # (R2) each word j places its neighbours
            rho = softmax_rows((y @ self.u).masked_fill(~txt.mask, float("-inf")))  # (B, L) which words relate
            M = (y @ self.V).view(B, L, 2, self.C)                         # M(y_j), (B, L, 2, C)
            delta = (w[:, None] - w[None, :]).long() + self.W              # w - j + W, (L, L)
            E = F.one_hot(delta.clamp(0, 2 * self.W), self.C) * ((delta >= 0) & (delta <= 2 * self.W))[..., None]
            o = y @ self.U + torch.einsum("bj,bjcp,wjp->bwc", rho, M, E.to(y.dtype))  # (R2), (B, L, 2)
        else:
            G = (F.normalize(txt.pooled, dim=-1) @ self.V).view(B, 2, self.C)  # (R2) G(t), (B, 2, P)
            if self.order == "relation":                                   # (R2) r: where the relation word is
                rho = softmax_rows((y @ self.u).masked_fill(~txt.mask, float("-inf")))  # (B, L)
                w = w - (rho * w).sum(dim=1, keepdim=True)                 # w - r, (B, L)
            q = sincos(w, self.P)                                          # (R2) q_w, (L, P) or (B, L, P)
            o = y @ self.U + q @ G.transpose(1, 2)                         # (R2), (B, L, 2)
        # Eqs. (3)-(6) and (R3) in one chunked pass: p (B, K) and d = alpha^T o (B, K, 2); padding has alpha 0
        if self.fast:
            p, d = chunked_cap(txt.tokens, self.A_l, txt.mask, self.tau_p, V=o)
        else:
            p, alpha = cap(relative(txt.tokens, self.A_l), txt.mask, self.tau_p)  # Eq. (3)-(6)
            d = alpha.transpose(1, 2) @ o                                  # (R3), (B, K, 2)
        return torch.cat([F.normalize(p, dim=-1), d.flatten(1) / self.K], dim=1)  # e_l, (B, 3K); 1/K: choice 5

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                         # (R4), (N_img, N_txt)

    def dense_image(self, img):
        r = F.normalize(relative(img.patches(), self.A_v), dim=-1)         # Eq. (4) per patch, (B, H*W, K)
        return torch.cat([r, r.new_zeros(*r.shape[:2], 2 * self.K)], dim=-1)  # choice 7, (B, H*W, 3K)

    def loss(self, img, txt):
        loss = info_nce(self.embed_image(img), self.embed_text(txt), self.tau)  # Eq. (8) on s / tau
        return loss, {"nce": loss.detach(), "U_norm": self.U.detach().norm(), "V_norm": self.V.detach().norm(),
                      **({"u_norm": self.u.detach().norm()} if self.u is not None else {})}
