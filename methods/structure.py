"""STRUCTURE baselines: Linear_RS and MLP_RS (InfoNCE + a neighbourhood-preserving regulariser).

Gröger, Wen, Le, Brbić, "With Limited Data for Multimodal Alignment, Let the
STRUCTURE Guide You" (NeurIPS 2025). Two heads h_v = g_v(x), h_l = g_l(y) on the
frozen pooled features, trained with the symmetric InfoNCE of CLIP plus R_S, which
keeps each modality's within-batch similarity structure:

    L_NCE = 1/(2B) sum_i [-log softmax_j(h_v,i . h_l,j / tau)_i - log softmax_j(h_l,i . h_v,j / tau)_i]
    x_bar = normalise(x) - mean_batch(normalise(x))               (same for z)
    P = softmax_row(X_bar X_bar^T / tau),  Q = softmax_row(Z_bar Z_bar^T / tau)     (B, B)
    R_S(X, Z) = JS(P || Q) = 1/2 KL(P || M) + 1/2 KL(Q || M),  M = (P + Q) / 2   (batch-mean KL)
    L = L_NCE + lambda_t * [R_S(X_v, H_v) + R_S(X_l, H_l)] / 2,  lambda_t = lambda * min(1, t / T_warm)

Heads: Linear_RS  g(x) = P x
       MLP_RS     g(x) = P x + sigmoid(alpha) W_2 Dropout(GELU(W_1 x))   (rank r residual)

Symbols -> variables: tau -> tau, lambda -> lam, T_warm -> warmup, t -> self.step,
P, Q (distributions) -> neighbour_distribution(); P (skip matrix), W_1, W_2, alpha ->
.P, .W1, .W2, .alpha of each side's head (Linear_RS: the head itself); r -> rank.

Deviations / choices:
1. R_S uses the true JS divergence, KL(P || M) and KL(Q || M); the public code
   passes the arguments of F.kl_div the other way round (KL(M || .)). Computed in
   fp32; the single-level version (the code also offers powers of P, Q).
2. The R_S temperature is the InfoNCE tau (as in the code); the diagonal (a sample
   with itself) stays in the softmax.
3. Heads are bias-free with orthogonal initialisation of P and W_1 (as in the
   public MLP_RS head); W_2 is zero-initialised.
4. The gate logit alpha starts at -4 (sigmoid = 0.018, nearly closed): the public
   code starts at -inf, where sigmoid has zero gradient so the gate never opens.
5. The step counter t is a buffer advanced by every loss() call in training mode
   (one call per optimiser step), so lambda_t resumes correctly from a checkpoint.
6. betas=(0.9, 0.95) and grad_clip=1.0 are in `defaults` for the training loop;
   epochs and batch_size, which the paper leaves to its data, are our choice (100, 256).
7. dense_image applies the image head to every patch token (the MaskCLIP trick).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .losses import info_nce


def neighbour_distribution(H, tau):
    """P = softmax_row(H_bar H_bar^T / tau) with H_bar the normalised, batch-centred rows of H (B, D)."""
    # EXERCISE 11 (STRUCTURE R_S): L2-normalise the rows of H (B, D), THEN centre over the batch;
    #   P = softmax_row(H H^T / tau) (B, B)
    H = F.normalize(H.float(), dim=-1)
    H = H - H.mean(0, keepdim=True)                             # (B, D) centred
    return (H @ H.T / tau).softmax(dim=1)                       # (B, B), rows sum to 1
    # END EXERCISE 11


def js_divergence(P, Q, eps=1e-12):
    """JS(P || Q) between row distributions, averaged over rows (batch-mean KL)."""
    # EXERCISE 11 (STRUCTURE R_S): JS(P || Q) = (KL(P || M) + KL(Q || M)) / 2 with M = (P + Q) / 2,
    #   KL summed over each row, mean over rows
    M = (P + Q) / 2
    kl = lambda A, B: (A * ((A + eps).log() - (B + eps).log())).sum(1).mean()
    return (kl(P, M) + kl(Q, M)) / 2
    # END EXERCISE 11


def structure_reg(X, Z, tau):
    """R_S(X, Z): how much the aligned features Z change the neighbourhoods of the originals X."""
    return js_divergence(neighbour_distribution(X, tau), neighbour_distribution(Z, tau))


def orthogonal_linear(d_in, d_out):
    """A bias-free linear layer with an orthogonal init, drawn at one thread: the init's QR (LAPACK) rounds
    differently at other thread counts, and the run's numbers would follow --threads (tests/test_threads.py)."""
    layer = nn.Linear(d_in, d_out, bias=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nn.init.orthogonal_(layer.weight)
    finally:
        torch.set_num_threads(threads)
    return layer


class ResidualLowRankHead(nn.Module):
    """g(x) = P x + sigmoid(alpha) W_2 Dropout(GELU(W_1 x)), W_2 = 0 at init."""

    def __init__(self, d, K, rank, dropout, alpha_init):
        super().__init__()
        self.P = orthogonal_linear(d, K)
        self.W1 = orthogonal_linear(d, rank)
        self.W2 = nn.Linear(rank, K, bias=False)
        nn.init.zeros_(self.W2.weight)                          # residual starts at 0
        self.drop = nn.Dropout(dropout)
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))

    def forward(self, x):
        return self.P(x) + torch.sigmoid(self.alpha) * self.W2(self.drop(F.gelu(self.W1(x))))


class LinearRS(Method):
    # STRUCTURE code: AdamW (0.9, 0.95), lr 1e-3, wd 1e-4, grad clip 1.0; epochs / batch: our choice
    defaults = dict(lr=1e-3, epochs=100, batch_size=256, weight_decay=1e-4, optimizer="adamw",
                    betas=(0.9, 0.95), grad_clip=1.0)
    ranges = dict(K="[1, inf)", tau="(0, inf)", lam="[0, inf)", warmup="[1, inf)")  # valid --hp

    def contrastive_scale(self):  # 1 / temperature of its contrastive logits (--hard-negatives)
        return 1 / self.tau

    def __init__(self, d_image, d_text, K=512, tau=0.05, lam=10.0, warmup=1000):  # STRUCTURE §4 / code
        super().__init__()
        self.g_v, self.g_l = orthogonal_linear(d_image, K), orthogonal_linear(d_text, K)
        self.tau, self.lam, self.warmup = tau, lam, warmup
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def embed_image(self, img):
        return F.normalize(self.g_v(img.pooled), dim=-1)        # (B, K)

    def embed_text(self, txt):
        return F.normalize(self.g_l(txt.pooled), dim=-1)        # (B, K)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                              # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(self.g_v(img.patches()), dim=-1)     # (B, H*W, K)

    def loss(self, img, txt):
        h_v, h_l = self.embed_image(img), self.embed_text(txt)
        nce = info_nce(h_v, h_l, self.tau)
        r_s = (structure_reg(img.pooled, h_v, self.tau) + structure_reg(txt.pooled, h_l, self.tau)) / 2
        lam_t = (self.lam * (self.step.double() / self.warmup).clamp(max=1.0)).float()  # linear warm-up, on the device
        if self.training:
            self.step += 1
        return nce + lam_t * r_s, {"nce": nce.detach(), "r_s": r_s.detach(), "lambda": lam_t}


class MLPRS(LinearRS):
    """Linear_RS with the residual low-rank head on each side; everything else is Linear_RS's."""
    ranges = dict(LinearRS.ranges, rank="[1, inf)", dropout="[0, 1)", alpha_init="(-inf, inf)")  # valid --hp

    def __init__(self, d_image, d_text, K=512, rank=64, dropout=0.1, alpha_init=-4.0,  # rank: STRUCTURE;
                 tau=0.05, lam=10.0, warmup=1000):           # dropout: STRUCTURE code; alpha_init: ours
        super().__init__(d_image, d_text, K, tau, lam, warmup)
        self.g_v = ResidualLowRankHead(d_image, K, rank, dropout, alpha_init)
        self.g_l = ResidualLowRankHead(d_text, K, rank, dropout, alpha_init)

    def loss(self, img, txt):
        loss, logs = super().loss(img, txt)
        return loss, {**logs, "gate": torch.sigmoid(self.g_v.alpha).detach()}
