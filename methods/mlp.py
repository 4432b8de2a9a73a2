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
1. Text input scaling: text_input="raw" (default) feeds f_T(t) as the encoder gives
   it, in training and at inference, as the paper writes D_weights = {(w_i, f_T(t_i))}
   (§4.1, App. E: no normalisation of the text side; only the image features x are
   assumed unit, in the neural-collapse argument).
   The authors' code L2-normalises the text in training (get_text_embeddings) but
   feeds raw text at inference (MLPAlignedTextModel), a mismatch we do not copy;
   text_input="l2" normalises at both. Measured (seed 0, 1 thread, 500 epochs for
   weights, 20 for pairs; `python align.py --method mlp [--align-data weights]
   --hp text_input=T`, RSum / zero-shot top-1):
     Shapes, tiny text (norm 6.4):   weights raw 70.1 / 62.9, l2 56.6 / 62.9,
                                     authors' mix 51.6 / 53.3; pairs raw 364.1 / 80.4,
                                     l2 360.3 / 77.3
     Shapes, all-MiniLM-L6-v2 (masked-mean, norm 5.5; --text-encoder <its folder>):
                                     weights raw 116.8 / 65.8, l2 121.6 / 66.0,
                                     authors' mix 125.2 / 64.6; pairs raw 379.7 / 85.6,
                                     l2 371.0 / 85.0, authors' mix 320.3 / 82.5
     real features (issue 11: a 1280-d ImageNet CNN + MiniLM, 1,000 ImageNet head rows,
     seen / novel objects): raw 134.2 / 128.1 (zero-shot 25.8 / 45.1), l2 64.2 / 73.2
     (16.0 / 38.5); an independent implementation of the paper gets the raw figures.
   raw is never worse than l2 by more than 5 RSum here and twice as good on real
   features, hence the default.
2. Image embeddings are the L2-normalised frozen features; since the loss is a
   cosine, normalising the target does not change training.
3. Optimiser: the reference code's Adam, lr 5e-3, no weight decay, batch 512
   (App. E says AdamW); cosine annealing to 0 over the run. Its random input-feature
   dropout (an undocumented extra) is left out.
4. Budget: 400 optimizer steps whatever the data size (defaults["steps"]; align.py
   runs ceil(400 / steps per epoch) epochs), where the paper fixes 500 epochs. An
   epoch is one step on 1,000 head rows (batch 512, last partial batch dropped) but 5
   on 3,000 pairs, so a fixed epoch count was either long (500 epochs on the head
   rows, ~40 min on a CPU in issue 11; here one step of the 1280-d aligner took
   ~7 s under load 20 on 2 cores) or short (20 epochs on 3,000 real pairs: RSum 428
   against 544 at 80 epochs = 400 steps, issue 11). Measured, RSum / zero-shot:
     Shapes pairs (6,000, 11 steps per epoch), tiny text: 20 ep 364.1, 40 ep 376.2,
     80 ep 384.3; MiniLM: 379.7, 394.0, 402.2 (400 steps = 37 epochs);
     Shapes head rows (24, 1 step per epoch), tiny text: 50 / 100 / 200 / 500 ep
     56.1 / 62.6 / 66.3 / 70.1 (zero-shot 52.9 / 62.5 / 65.4 / 62.9); MiniLM:
     153.3 / 147.4 / 129.1 / 116.8 (zero-shot 70.4 / 72.1 / 67.1 / 65.8).
   --epochs still overrides. The dropout 0.5 is what keeps it from over-fitting.
5. dense_image returns the normalised patch tokens (the image side is identity).
"""
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    # weight-recycling reference code: Adam, lr 5e-3, no weight decay, batch 512; a 400-step budget (choice 4)
    defaults = dict(lr=5e-3, steps=400, batch_size=512, weight_decay=0.0, optimizer="adam")
    ranges = dict(hidden_mult="[1, inf)", dropout="[0, 1)", text_input=("raw", "l2"),  # valid --hp values (align.py)
                  batch_size="[1, inf)")  # loss 1 - cos is per pair, no negatives: a batch of one still learns

    split_loss = True  # its loss reads the batch only through embed_image / embed_text (distributed.py)

    def __init__(self, d_image, d_text, hidden_mult=4, dropout=0.5,  # App. E: hidden 4 d_i; ref. code: dropout 0.5
                 text_input="raw"):  # choice 1: "raw" f_T(t) (§4.1) or "l2" (y / ||y||), same in training and inference
        super().__init__()
        assert text_input in ("raw", "l2"), text_input
        self.text_input = text_input
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
        return loss, {"cos": cos.mean().item()}
