"""MLP alignment: a two-layer MLP maps text features into the frozen image space.

"Supervised Classification Heads as Semantic Prototypes: Unlocking Vision-Language
Alignment via Weight Recycling" (§4 "MLP-alignment", App. E). Eq. (2),
g(f_I(x)) ~ g_bar(f_T(t)), with g = identity (the image space IS the shared space)
and g_bar a two-layer MLP trained with the cosine loss:

    g_bar(y) = LayerNorm(W_2 Dropout(GELU(W_1 y_hat)))     y_hat = y / ||y||
    L = 1/B sum_i [1 - cos(g_bar(y_i), x_i)]

Symbols -> variables: f_I(x) -> img.pooled, f_T(t) -> txt.pooled, g_bar -> self.g_bar,
W_1 (d_t -> 4 d_i), W_2 (4 d_i -> d_i) -> self.g_bar[0], self.g_bar[3].

Deviations / choices:
1. Text inputs are L2-normalised before the MLP both in training and at inference
   (the reference code normalises in training only).
2. Image embeddings are the L2-normalised frozen features; since the loss is a
   cosine, normalising the target does not change training.
3. Optimiser: the reference code's Adam, lr 5e-3, no weight decay, 500 epochs,
   batch 512 (App. E says AdamW); its cosine annealing to 0 is up to the training
   loop. Its random input-feature dropout (an undocumented extra) is left out.
4. On a few thousand pairs 500 epochs is ~5K steps of a small MLP (cheap); the
   dropout 0.5 is what keeps it from over-fitting; lower --epochs for quick runs.
5. dense_image returns the normalised patch tokens (the image side is identity).
"""
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    # weight-recycling reference code: Adam, lr 5e-3, no weight decay, 500 epochs, batch 512
    defaults = dict(lr=5e-3, epochs=500, batch_size=512, weight_decay=0.0, optimizer="adam")
    ranges = dict(hidden_mult="[1, inf)", dropout="[0, 1)",  # valid --hp values (align.py)
                  batch_size="[1, inf)")  # loss 1 - cos is per pair, no negatives: a batch of one still learns

    def __init__(self, d_image, d_text, hidden_mult=4, dropout=0.5):  # App. E: hidden 4 d_i; ref. code: dropout 0.5
        super().__init__()
        self.g_bar = nn.Sequential(
            nn.Linear(d_text, hidden_mult * d_image),      # W_1
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_mult * d_image, d_image),     # W_2
            nn.LayerNorm(d_image),
        )

    def embed_image(self, img):
        return F.normalize(img.pooled, dim=-1)                           # (B, D_v), g = identity

    def embed_text(self, txt):
        y_hat = F.normalize(txt.pooled, dim=-1)                          # (B, D_l) same as in training
        return F.normalize(self.g_bar(y_hat), dim=-1)                    # (B, D_v)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                       # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(img.patches(), dim=-1)                        # (B, H*W, D_v)

    def loss(self, img, txt):
        cos = (self.embed_text(txt) * self.embed_image(img)).sum(-1)     # (B,) cos(g_bar(y_i), x_i)
        loss = (1 - cos).mean()
        return loss, {"cos": cos.mean().item()}
