"""Every alignment method, found by name. One file per method; no base class.

The interface (duck-typed; align.py and evaluate.py use only this):

    method = METHODS[name](d_image, d_text, **hp)      # hp: keyword hyperparameters
    method.defaults -> dict                            # the paper's lr / epochs / batch_size / weight_decay / optimizer
    method.fit(img, txt)            # optional: closed-form methods (CSA, ASIF); img, txt = Features of all train pairs
    method.loss(img, txt) -> (loss, logs)   # optional: trained methods; img, txt = Features of a batch of pairs
    method.embed_image(img) -> emb  # (B, K) global, or (B, Q, K) token-level (CoV)
    method.embed_text(txt)  -> emb  # (B, K) global, or (B, L, K) token-level; padded words exactly 0
    method.score(img_emb, txt_emb) -> (N_img, N_txt)   # higher = more similar
    method.dense_image(img) -> (B, H*W, ...)  # per patch, each slice [:, p] a valid image emb for score()

Features (encoders.py) holds tokens (B, T, D), mask (B, T), pooled (B, D), grid (H, W).
Token-level embeddings are padded with zeros when evaluate.py concatenates batches,
so score() of a token-level method treats all-zero rows as padding.
"""
METHODS = {}

from .linear import Linear

METHODS["linear"] = Linear
