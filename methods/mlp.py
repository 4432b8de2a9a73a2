"""MLP alignment: a two-layer MLP maps text features into the frozen image space.

"Supervised Classification Heads as Semantic Prototypes: Unlocking Vision-Language
Alignment via Weight Recycling" (§4 "MLP-alignment", App. E). Eq. (2),
g(f_I(x)) ~ g_bar(f_T(t)), with g = identity (the image space IS the shared space)
and g_bar a two-layer MLP trained with the cosine loss:

    g_bar(y) = LayerNorm(W_2 Dropout(GELU(W_1 y)))        y = f_T(t), as the encoder gives it
    L = 1/B sum_i [1 - cos(g_bar(y_i), x_i)]

Symbols -> variables: f_I(x) -> img.pooled, f_T(t) -> txt.pooled, g_bar -> self.g_bar,
W_1 (d_t -> 4 d_i), W_2 (4 d_i -> d_i) -> self.g_bar[0], self.g_bar[3].

Deviations / choices:
1. text_input="raw" (default) feeds f_T(t) as the encoder gives it, in training and at
   inference, as §4.1 writes D_weights = {(w_i, f_T(t_i))}; the authors' code normalises the text
   in training only, a mismatch not copied; text_input="l2" normalises at both. On real features
   (a 1280-d ImageNet CNN + MiniLM, 1,000 head rows) raw gives RSum 134.2 against 64.2 for l2.
2. Image embeddings are the L2-normalised frozen features; the loss is a cosine, so normalising
   the target does not change training.
3. The reference code's Adam, lr 5e-3, no weight decay, batch 512 (App. E says AdamW), cosine
   annealing to 0; its random input-feature dropout (undocumented in the paper) is left out.
4. A budget of 400 optimizer steps whatever the data size (defaults["steps"]; align.py runs
   ceil(400 / steps per epoch) epochs) in place of the paper's 500 epochs, which are one step
   each on 1,000 head rows but 5 on 3,000 pairs (real pairs: RSum 428 at 20 epochs, 544 at 400
   steps). --epochs still overrides; the dropout 0.5 keeps it from over-fitting.
5. dense_image returns the normalised patch tokens (the image side is identity).
6. Hidden width 4 d_i, dropout 0.5 and the closing LayerNorm are the reference code's; App. E
   says "4 times the input dimension" (4 d_t) and names only the two layers and the GELU.
"""
import torch.nn as nn
import torch.nn.functional as F

from . import Method
from .layernorm import LayerNorm


class MLP(Method):
    # weight-recycling reference code: Adam, lr 5e-3, no weight decay, batch 512; a 400-step budget (choice 4)
    defaults = dict(lr=5e-3, steps=400, batch_size=512, weight_decay=0.0, optimizer="adam")
    ranges = dict(hidden_mult="[1, inf)", dropout="[0, 1)", text_input=("raw", "l2"),  # valid --hp values (align.py)
                  batch_size="[1, inf)")  # loss 1 - cos is per pair, no negatives: a batch of one still learns

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (infra/distributed.py)

    def __init__(self, d_image, d_text, hidden_mult=4, dropout=0.5,  # ref. code: hidden 4 d_i, dropout 0.5 (choice 6)
                 text_input="raw"):  # choice 1: "raw" f_T(t) (§4.1) or "l2" (y / ||y||), same in training and inference
        super().__init__()
        assert text_input in ("raw", "l2"), text_input
        self.text_input = text_input
        self.g_bar = nn.Sequential(
            nn.Linear(d_text, hidden_mult * d_image),      # W_1
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_mult * d_image, d_image),     # W_2
            LayerNorm(d_image),
        )

    def embed_image(self, img):
        return F.normalize(img.pooled, dim=-1)                           # (B, D_v), g = identity

    def embed_text(self, txt):
        y = txt.pooled                                                   # (B, D_l) f_T(t)
        y_hat = F.normalize(y, dim=-1) if self.text_input == "l2" else y  # same in training and inference
        return F.normalize(self.g_bar(y_hat), dim=-1)                    # (B, D_v)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                       # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(img.patches(), dim=-1)                        # (B, H*W, D_v)

    def loss(self, img, txt):
        cos = (self.embed_text(txt) * self.embed_image(img)).sum(-1)     # (B,) cos(g_bar(y_i), x_i)
        loss = (1 - cos).mean()
        return loss, {"cos": cos.mean().detach()}
