"""The one data structure every stage passes around: frozen encoder outputs.

Shape alphabet (used in every file): B batch, T tokens, D features,
K anchors / output dim, Q regions, L words, C classes, H x W patch grid.
"""
from dataclasses import dataclass, replace

import torch


@dataclass
class Features:
    """Frozen token features of B samples of one modality.

    tokens: (B, T, D) float. Images: token 0 is the global token (CLS, or the
            mean patch for the CNN), tokens 1..H*W are the patches in row-major
            order, any further tokens (registers) come last. Texts: the
            encoder's tokens, CLS/BOS first, padded at the end.
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
        return replace(self, tokens=torch.as_tensor(self.tokens).to(device, dtype),
                       mask=torch.as_tensor(self.mask).to(device),
                       pooled=torch.as_tensor(self.pooled).to(device, dtype))

    def patches(self):
        """(B, H*W, D) the patch tokens only, in grid order (images only)."""
        H, W = self.grid
        return self.tokens[:, 1:1 + H * W]

    @staticmethod
    def from_vectors(x):
        """Global vectors (B, D) as one-token sequences (e.g. classifier-head rows)."""
        return Features(tokens=x[:, None], mask=torch.ones(len(x), 1, dtype=torch.bool), pooled=x)

    @staticmethod
    def cat(parts):
        """Concatenate along the batch, padding tokens to the longest."""
        T = max(p.tokens.shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, T - x.shape[1]), value=v)
        return Features(tokens=torch.cat([pad(p.tokens, 0) for p in parts]),
                        mask=torch.cat([pad(p.mask, False) for p in parts]),
                        pooled=torch.cat([p.pooled for p in parts]), grid=parts[0].grid)
