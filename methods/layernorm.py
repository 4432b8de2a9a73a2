"""A LayerNorm whose gradients add in the same order at any CPU thread count (cov, fa, mlp, sail read it)."""
import torch.nn as nn
import torch.nn.functional as F


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with its affine step written out (normalise, then * weight + bias): the same function and
    state_dict, but the gradients of weight and bias come from autograd's sums, which add in the same order
    at any CPU thread count; the fused CPU kernel's gamma / beta gradients do not (tests/test_threads.py)."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, eps=self.eps) * self.weight + self.bias
