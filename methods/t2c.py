"""Text-to-concepts: one bias-free linear map from text features into the image space.

Moayeri et al., "Text-To-Concept (and Back) via Cross-Model Alignment" (ICML 2023),
in the form used by "Supervised Classification Heads as Semantic Prototypes:
Unlocking Vision-Language Alignment via Weight Recycling" (App. E: "the standard
variant that learns a single linear mapping from text representations into the
image/weight representation space", MSE loss). In Eq. (2) terms g = identity and

    g_bar(y) = W y_hat,    y_hat = y / ||y||,   W: (d_i, d_t), no bias
    L = 1/(B d_i) sum_i ||W y_hat_i - x_hat_i||^2,  x_hat = x / ||x||

Symbols -> variables: W -> self.W, x_hat -> embed_image(img), y_hat -> normalised txt.pooled.

Deviations / choices:
1. Both views are L2-normalised before the MSE (the weight-recycling data are
   normalised head rows and normalised features), in training and at inference.
2. Moayeri et al. map IMAGE features into CLIP's space; following the
   weight-recycling paper we map TEXT into the image space instead.
3. Optimiser as MLP-alignment (reference code: Adam lr 5e-3, no weight decay,
   500 epochs, batch 512; App. E says AdamW); cosine annealing is up to the training loop.
   The reference code's random input-feature dropout is left out, as in methods/mlp.py.
4. The text embedding is W y_hat re-normalised: retrieval compares cosines.
"""
import torch.nn as nn
import torch.nn.functional as F

from . import Method


class T2C(Method):
    # weight-recycling reference code (same optimiser as MLP-alignment)
    defaults = dict(lr=5e-3, epochs=500, batch_size=512, weight_decay=0.0, optimizer="adam")
    ranges = dict(batch_size="[1, inf)")  # MSE per pair, no negatives: a batch of one still learns

    def __init__(self, d_image, d_text):
        super().__init__()
        self.W = nn.Linear(d_text, d_image, bias=False)

    def map_text(self, txt):
        return self.W(F.normalize(txt.pooled, dim=-1))                  # (B, D_v) W y_hat

    def embed_image(self, img):
        return F.normalize(img.pooled, dim=-1)                          # (B, D_v) x_hat, g = identity

    def embed_text(self, txt):
        return F.normalize(self.map_text(txt), dim=-1)                  # (B, D_v)

    def score(self, img_emb, txt_emb):
        return img_emb @ txt_emb.T                                      # (N_img, N_txt) cosine

    def dense_image(self, img):
        return F.normalize(img.patches(), dim=-1)                       # (B, H*W, D_v)

    def loss(self, img, txt):
        loss = F.mse_loss(self.map_text(txt), self.embed_image(img))    # mean over B x D_v entries
        return loss, {"mse": loss.detach()}
