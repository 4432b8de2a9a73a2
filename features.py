"""Frozen encoder outputs as one data structure, the token contract every encoder keeps, and the
precision encoders compute in.

Features is what every stage passes around (tokens, mask, pooled, grid). How batches of it reach
the device is in infra/loader.py; how features are computed once and cached on disk (extract,
memory-mapped shards read back as StoredFeatures) in infra/cache.py.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
import contextlib
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass
class Features:
    """Frozen token features of B samples of one modality.

    tokens: (B, T, D) float, by the token-layout contract below. Images:
            token 0 is the global token (= pooled), tokens 1..H*W the patches
            in row-major order, nothing else (no registers). Texts: the word
            tokens only (no CLS / SEP / BOS / EOS), padded at the end.
    mask:   (B, T) bool, True for a real token, False for padding.
    pooled: (B, D) float, what global methods use (CLS or masked mean).
    grid:   (H, W) of the image patch grid, None for text / for global vectors.
    """
    tokens: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor
    grid: tuple | None = None

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, idx):
        """Rows idx (slice, index tensor or list); trims padding columns no row uses."""
        mask = self.mask[idx]
        t = int(mask.sum(1).max()) if len(mask) else 0
        # real tokens are never after padding, so the first t columns hold them all
        t = max(t, 1) if self.grid is None else self.tokens.shape[1]
        return replace(self, tokens=self.tokens[idx, :t], mask=mask[:, :t], pooled=self.pooled[idx])

    def to(self, device, dtype=torch.float32):
        """Move to device, floats to dtype (caches hold fp16; methods compute in fp32)."""
        tensor = lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))  # where it is
        return replace(self, tokens=tensor(self.tokens).to(device, dtype), mask=tensor(self.mask).to(device),
                       pooled=tensor(self.pooled).to(device, dtype))

    def patches(self):
        """(B, H*W, D) the patch tokens only, in grid order (images only)."""
        H, W = self.grid
        return self.tokens[:, 1:1 + H * W]

    @staticmethod
    def from_vectors(x):
        """Global vectors (B, D) as one-token sequences (e.g. classifier-head rows)."""
        return Features(tokens=x[:, None], mask=torch.ones(len(x), 1, dtype=torch.bool, device=x.device), pooled=x)

    @staticmethod
    def cat(parts):
        """Concatenate along the batch, padding tokens to the longest."""
        T = max(p.tokens.shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]), value=v)
        return Features(tokens=torch.cat([pad(p.tokens, 0) for p in parts]),
                        mask=torch.cat([pad(p.mask, False) for p in parts]),
                        pooled=torch.cat([p.pooled for p in parts]), grid=parts[0].grid)


# ---------------------------------------------------------------------------
# The token-layout contract: what every encoder hands on, whatever its family emits
# ---------------------------------------------------------------------------
# Features of an IMAGE: tokens = [global, H*W patches row-major], global = pooled =
#   the vector the checkpoint's own head / projection reads. Every other token a
#   model emits (DINOv2's registers, DeiT's distillation token, BEiT's CLS when it
#   mean-pools) is dropped: no method reads it.
# Features of a TEXT: tokens = the caption's WORD tokens only, in order, padded at the
#   end. The tokenizer's special tokens (CLS / SEP, <s> / </s>, BOS / EOS) are dropped
#   by word_positions() below, the one place this rule lives, so every token-level
#   method (CoV, FILIP, text_guided, PAL's CAP, FA) matches words, as the papers do
#   (PAL: "Z are the patch and word tokens"). pooled is computed before that, over the
#   whole sequence, as the family defines it (sentence-transformers' masked mean
#   includes CLS / SEP).
# One space: at the last layer every token has gone through the final norm the pooled
#   vector went through, so a head fitted on pooled applies to each patch (the MaskCLIP
#   trick of dense_image). Where Hugging Face leaves that norm off the tokens (BEiT's
#   mean-pooling layernorm, CLIP's post_layernorm) it is applied here. Intermediate
#   layers: the raw block outputs, pooled read the same way (CLS, or BEiT's mean patch).
#
# family                 the model emits            global token 0 = pooled        final norm on every token
# dinov2                 [CLS, patches]             CLS                            layernorm (HF)
# dinov2_with_registers  [CLS, registers, patches]  CLS                            layernorm (HF)
# vit                    [CLS, patches]             CLS                            layernorm (HF)
# deit                   [CLS, DIST, patches]       CLS (...ForImageClassification) layernorm (HF)
# beit, use_mean_pooling [CLS, patches]             layernorm(mean patch) (pooler) pooler.layernorm (here)
# beit, otherwise        [CLS, patches]             CLS                            layernorm (HF)
# clip vision            [CLS, patches]             post_layernorm(CLS) (pooler)   post_layernorm (here)
# torchvision ResNets    feature map (D, H, W)      mean of the map (what fc reads) none
# shapes-cnn             feature map (D, 8, 8)      mean of the map                none
#
# family                 the model emits            pooled                         tokens kept
# bert, MiniLM, distilbert [CLS, words, SEP]        masked mean of all tokens      the words
# roberta, xlm-r, mpnet  [<s>, words, </s>]         masked mean of all tokens      the words
# clip text              [BOS, words, EOS]          EOS after final_layer_norm     the words (after final_layer_norm)
# shapes-text            [CLS, words]               masked mean of all tokens      the words
#
# tests/test_token_contract.py checks each row against the Hugging Face model's own outputs.

# The special-token rule of the text rows above, written once
TOKEN_RULE = "tokens: image [pooled, patches], text words only; last layer normed as pooled"  # in the cache key


def word_positions(real, special):
    """THE special-token rule, written once: which of a text's tokens are its words.

    real (B, L) bool, the attention mask; special (B, L) bool, the tokenizer's special
    tokens (CLS / SEP, <s> / </s>, BOS / EOS). Returns idx (B, L') the positions of the
    word tokens, in order, padded with other positions, and mask (B, L') True for a word.
    A text with no word token at all keeps its real tokens, so no row is ever empty.
    """
    word = real & ~special                                                   # (B, L)
    word = torch.where(word.any(1, keepdim=True), word, real)
    idx = torch.sort((~word).to(torch.uint8), dim=1, stable=True).indices   # words first, in order
    idx = idx[:, :max(int(word.sum(1).max()), 1)]                            # (B, L')
    return idx, word.gather(1, idx)


def word_tokens(h, real, special):
    """(B, L, D) encoder tokens -> the word tokens (B, L', D) (padding exactly 0) and their mask (B, L')."""
    idx, mask = word_positions(real, special)
    tokens = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))         # (B, L', D)
    return tokens * mask[..., None], mask


# ---------------------------------------------------------------------------
# The precision encoders run in on the device, and the host side of a batch
# ---------------------------------------------------------------------------
def autocast_dtype(device):
    """The encoders' autocast dtype on device: bf16 where the GPU computes it natively (Ampere and
    later), fp16 on older GPUs (V100, T4 emulate bf16, slowly), None (fp32) on the CPU."""
    if not str(device).startswith("cuda"):
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def precision(device):
    """How features are computed on device, for the cache key: "fp32" or e.g. "cuda autocast bfloat16"."""
    dtype = autocast_dtype(device)
    return "fp32" if dtype is None else f"cuda autocast {str(dtype).removeprefix('torch.')}"


def autocast(device):
    """bf16 (or fp16) autocast on CUDA, nothing on the CPU."""
    dtype = autocast_dtype(device)
    return contextlib.nullcontext() if dtype is None else torch.autocast("cuda", dtype=dtype)


def host_batch(x, device):
    """A host batch ready to cross: pinned on CUDA (its copy then runs without blocking), as is elsewhere."""
    return x.pin_memory() if str(device).startswith("cuda") else x
