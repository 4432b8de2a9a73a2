"""PAL-Rel: a RELATION-AWARE VARIANT of PAL (issue 14). Not a method of the papers.

PAL (methods/pal.py, papers/pal_relative_anchors.txt) pools each modality into one
K-vector of anchor activations; a relation ("the circle is LEFT OF the square") is a
property of a PAIR of objects, which one pooled vector cannot compare. The smallest
addition that can: each anchor already attends to a place in the image (Eq. 5), so
it can report WHERE it looked, and on the text side the words it attends to can say
where that thing should be relative to the others. Everything of PAL is kept
(Eqs. 3-8, same anchors); the additions are marked (R1)-(R4):

    h_v, h_l  = PAL's pooled, normalised anchor activations        Eqs. (3)-(7)
    beta[t, k] = softmax over PATCHES t of R_v[t, k] / tau_p         (R1) (B, H*W, K)
    c_k       = sum_t beta[t, k] pos_t,  pos_t in [-1, 1]^2 (x, y)   (R1) where anchor k looks
    o_w       = U^T y_w / ||y_w||  +  G(t) q_w                       (R2) word w's offset "should be here"
                U (D_l, 2); q_w (P,) sin-cos code of w's index in the caption;
                G(t) = reshape(V^T t / ||t||, (2, P)), t the pooled text, V (D_l, 2P)
    d_k       = sum_w alpha_l[w, k] o_w                              (R3) Eq. (5)'s text attention
    s(v, l)   = h_v . h_l + 1/K sum_k (c_k - c_bar) . d_k,  c_bar = mean_k c_k    (R4)

(R4) is a dot product of e_v = [h_v, vec(c - c_bar)] and e_l = [h_l, vec(d) / K], (B, 3K)
each, so retrieval stays one matrix product. For "a red circle left of a blue square"
the words "red circle" should get o = (-, 0), "blue square" o = (+, 0); the anchors
attending to them then score high only where the red circle's patches are left of
the blue square's. Trained with PAL's symmetric InfoNCE, Eq. (8), on s / tau.

Why G(t) q_w in (R2): a relation swap ("... LEFT of ..." vs "... RIGHT of ...")
changes one word; which object goes where is "the phrase BEFORE the relation word
goes to dir(relation), the one after it to -dir(relation)" ("A left of B" and its
paraphrase "B right of A" agree). That is a product of what the sentence says (the
relation, read from the pooled text t) and where the word sits (q_w); a linear
map of the word token alone (the first term) has to find both in one contextual
token, which the frozen text encoders barely give (README, Binding: probes).

Symbols -> variables: A_v, A_l -> self.A_v, self.A_l; R -> R; beta -> beta; pos ->
pos; c -> c; U -> self.U; V -> self.V; q -> q; o -> o; alpha_l -> alpha; d -> d; tau_p -> self.tau_p;
tau -> self.tau.

Deviations / choices:
1. Positions come from the patch grid (Features.grid), not from the tokens: the
   method knows where each patch is, as a ViT's position embedding does.
2. beta (R1) is a softmax over the patches only (the mean token has no place);
   CAP's alpha (Eq. 5) reads PAL's Z for h_v (the patches and words, pal.py choice 2).
3. U and V start at zero, so at initialisation PAL-Rel scores exactly as PAL.
   Word tokens are L2-normalised before U (R2) so the offset's scale is U's alone.
   The 1/K in (R4): Adam moves every entry of U by ~lr per step whatever the
   gradient's size, so without it one step (lr 3e-2) made the relation term ~100
   (logits ~2000 at tau 0.05; measured: loss 14.8 after the first epoch, chance 5.5).
4. Gaussian anchors only (PAL's default, pal.py choice 4); tau, tau_p, lr as PAL.
5. dense_image: PAL's per-patch r_t with zeros in the relation part (a patch has no
   pair to compare).
6. The 1/K sits on the TEXT side of (R4). evaluate.py averages a class's prompt
   embeddings and L2-normalises them (multi-template averaging), so a large
   relation part in e_l would shrink its PAL part unevenly across classes. With
   the 1/K on the image side instead (same s for every pair) the first trained
   model (MiniLM, 10 epochs) scored zero-shot top-1 69.8 and segmentation mIoU
   60.7; the same weights with the 1/K on the text side: 100.0 and 96.1
   (binding and retrieval unchanged: s is the same function).
7. Measured before (R2) had its word-order term (README, Binding; seed 0, MiniLM
   text, 5 epochs): relation swap 68.3 (72.7 with --hard-negatives) against PAL's
   52.3 (53.7): a linear map of one frozen contextual token barely knows whether
   its word is the subject or the object of the relation.
8. The word-order term G(t) q_w of (R2): q_w is a fixed sin-cos code of the word's
   index (P = 32 dims, base 10000, as a Transformer's); G(t) a linear map of the
   L2-normalised pooled text (the relation word is plain in it) to a (2, P) matrix.
   Bilinear, the smallest form that can say "the phrase before the relation word
   goes one way, the one after it the other". It reads word INDICES, so it assumes
   captions name the subject before the object in most paraphrases (4 of the 5
   Shapes styles do; "a picture of B and A , the ..." does not). With it (5 epochs,
   README, Binding): attribute / relation swap 100.0 / 100.0, RSum 516.2 (MiniLM,
   --hard-negatives, median of 3 seeds) and 100.0 / 100.0, RSum 513.3 with the tiny
   masked-word text encoder (no hard negatives, 3 seeds); 100.0 / 100.0, RSum 512.6
   with the default encoders (seed 0): the image side needs no position-aware tokens.
9. beta (R1) is read off CAP's own alpha (Eq. 5): PAL's Z masks the global token, so its softmax over
   the real tokens IS the softmax over the patches; e_v and e_l come out of one chunked pass
   (pal.py choice 9) instead of a second softmax over (B, H*W, K). tests/test_fast_forms.py checks
   the embeddings and their gradients against the form with a separate beta. (A sample that is one
   vector, a head row with no patches, gets c = 0: it has no place.)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .pal import PAL, chunked_cap, info_nce, relative


def sincos(x, P=32):
    """(..., P) sin-cos code of real positions x (...,) (Transformer-style, base 10000)."""
    freq = 10000.0 ** (-torch.arange(0, P, 2, device=x.device, dtype=torch.float32) / P)  # (P/2,)
    return torch.cat([torch.sin(x[..., None] * freq), torch.cos(x[..., None] * freq)], dim=-1)


def word_positions_code(L, P=32, device=None):
    """(L, P) sin-cos code of word index 0..L-1: q_w of (R2) with order="index"."""
    return sincos(torch.arange(L, device=device, dtype=torch.float32), P)


def grid_positions(H, W, device=None):
    """(H*W, 2) patch centres (x, y) in [-1, 1], row-major like the patch tokens."""
    y, x = torch.meshgrid((torch.arange(H, device=device) + 0.5) / H * 2 - 1,
                          (torch.arange(W, device=device) + 0.5) / W * 2 - 1, indexing="ij")
    return torch.stack([x.flatten(), y.flatten()], dim=1)


class PALRel(nn.Module):
    defaults = dict(lr=3e-2, epochs=20, batch_size=256, weight_decay=0.0, optimizer="adamw")  # PAL's (choice 4)
    ranges = dict(K="[1, inf)", tau_p="(0, inf)", tau="(0, inf)", P=(2, 4, 8, 16, 32, 64),
                  order=("local", "relation", "index"), W="[0, inf)")  # valid --hp; P: sin + cos halves

    def __init__(self, d_image, d_text,
                 K=512,            # PAL §5.1
                 tau_p=0.03,       # PAL §5.1, Table 7
                 tau=0.05,         # pal.py choice 1
                 P=32,             # (R2) word-position code size, choice 8
                 order="local",    # (R2) how a word's place in the caption is coded, choice 10
                 W=5):             # (R2) order="local": the window, words j - W .. j + W around word j
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

    def embed_image(self, img):
        Z, mask = PAL.Z(img, "image")                                      # [global (masked), patches]: PAL's Z
        H, W = img.grid
        pos = torch.cat([Z.new_zeros(1, 2), grid_positions(H, W, Z.device)])  # (1 + H*W, 2), the global slot at 0
        # Eqs. (3)-(6) and (R1) in one chunked pass (pal.py choice 9): p (B, K) and c = beta^T pos (B, K, 2)
        p, c = chunked_cap(Z, self.A_v, mask, self.tau_p, V=pos.expand(len(Z), -1, -1))
        c = c - c.mean(dim=1, keepdim=True)                                # c_k - c_bar (R4)
        return torch.cat([F.normalize(p, dim=-1), c.flatten(1)], dim=1)    # e_v, (B, 3K)

    def embed_text(self, txt):
        B, L, _ = txt.tokens.shape
        y = F.normalize(txt.tokens, dim=-1)                                # y_w / ||y_w||, (B, L, D_l)
        w = torch.arange(L, device=y.device, dtype=torch.float32)          # word indices, (L,)
        if self.order == "local":                                          # (R2) each word j places its neighbours
            rho = (y @ self.u).masked_fill(~txt.mask, float("-inf")).softmax(dim=1)  # (B, L) which words relate
            M = (y @ self.V).view(B, L, 2, self.C)                         # M(y_j), (B, L, 2, C)
            delta = (w[:, None] - w[None, :]).long() + self.W              # w - j + W, (L, L)
            E = F.one_hot(delta.clamp(0, 2 * self.W), self.C) * ((delta >= 0) & (delta <= 2 * self.W))[..., None]
            o = y @ self.U + torch.einsum("bj,bjcp,wjp->bwc", rho, M, E.to(y.dtype))  # (R2), (B, L, 2)
        else:
            G = (F.normalize(txt.pooled, dim=-1) @ self.V).view(B, 2, self.C)  # (R2) G(t), (B, 2, P)
            if self.order == "relation":                                   # (R2) r: where the relation word is
                rho = (y @ self.u).masked_fill(~txt.mask, float("-inf")).softmax(dim=1)  # (B, L)
                w = w - (rho * w).sum(dim=1, keepdim=True)                 # w - r, (B, L)
            q = sincos(w, self.P)                                          # (R2) q_w, (L, P) or (B, L, P)
            o = y @ self.U + q @ G.transpose(1, 2)                         # (R2), (B, L, 2)
        # Eqs. (3)-(6) and (R3) in one chunked pass: p (B, K) and d = alpha^T o (B, K, 2); padding has alpha 0
        p, d = chunked_cap(txt.tokens, self.A_l, txt.mask, self.tau_p, V=o)
        return torch.cat([F.normalize(p, dim=-1), d.flatten(1) / self.K], dim=1)  # e_l, (B, 3K); 1/K: choice 6

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                         # (R4), (N_img, N_txt)

    def dense_image(self, img):
        r = F.normalize(relative(img.patches(), self.A_v), dim=-1)         # Eq. (4) per patch, (B, H*W, K)
        return torch.cat([r, r.new_zeros(*r.shape[:2], 2 * self.K)], dim=-1)  # choice 5, (B, H*W, 3K)

    def loss(self, img, txt):
        loss = info_nce(self.embed_image(img), self.embed_text(txt), self.tau)  # Eq. (8) on s / tau
        return loss, {"nce": loss.item(), "U_norm": self.U.norm().item(), "V_norm": self.V.norm().item(),
                      **({"u_norm": self.u.norm().item()} if self.u is not None else {})}
