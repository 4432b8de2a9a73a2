"""The fast form of PAL's cross-attention pooling (CAP), Eqs. (3)-(6) of "Learning Relative
Representations for Fine-Grained Multimodal Alignment with Limited Data" (PAL §4.1-4.2).

chunked_cap(Z, A, mask, tau_p) returns the same p as the paper form that methods/pal.py writes out,
cap(relative(Z, A), mask, tau_p)[0], and, given V (B, T, c), Y = alpha^T V (B, K, c) (what PAL-Rel
reads). It runs one chunk of the batch at a time with the derivative written out by hand: on a CPU
the paper form is bound by memory traffic over (B, T, K) tensors, not by its products; one PAL
training step at the Shapes size took 169 ms of CPU against the paper form's 346 ms
(`python benchmarks/bench_cap.py`, 1 thread).
PAL and PAL-Rel use it when this file is present and `fast=True` (their default then);
tests/test_fast_forms.py checks it equals the paper form, values and gradients.
"""
import math

import torch
import torch.nn.functional as F


class ChunkedCAP(torch.autograd.Function):
    """Eqs. (3)-(6) one chunk of the batch at a time, with the derivative written out.

    The same p as cap(relative(Z, A), mask, tau_p)[0] and, given V (B, T, c), Y = alpha^T V (B, K, c)
    (what PAL-Rel reads). Z (B, T, D) comes in unit-length with padded rows 0, A (K, D) unit-length
    (chunked_cap does both, so autograd carries the normalisations' own derivative).
    Why: on a CPU the naive form is bound by memory traffic, not arithmetic: each of its ~20 elementwise
    passes (masking, softmax, product, sum and their backward) reads and writes a fresh (B, T, K) tensor
    (45 MB at the Shapes size: B 256, T 65, K 512). Here a chunk's (b, T, K) work stays in cache, in
    buffers reused from chunk to chunk, and the backward keeps S alone (alpha is recomputed from it):
      S = R log2(e) / tau_p comes out of the product (the constant is folded into the anchors), so
      alpha = softmax_t(R / tau_p) = 2^(S - m) / sum_t 2^(S - m), m = max_t S (exp2 costs less
      than exp on a CPU);
      padding gets S = 0 (its Z rows are 0) and a -inf bias in the softmax, only in chunks that have some.
    Backward, with g = dL/dp (B, K) and G = dL/dY (B, K, c), from Eq. (5)-(6):
        dp_k / dR_tk = alpha_tk (1 + (R_tk - p_k) / tau_p)
        dY_kc / dR_tk = alpha_tk (V_tc - Y_kc) / tau_p
        dR = alpha * (g (1 + R / tau_p - p / tau_p) + (V G^T - sum_c Y G) / tau_p),
        dZ = dR A,   dA = sum_b dR^T Z,   dV = alpha G
    tests/test_fast_forms.py checks it against the naive form (values and gradients, with padding) and
    with torch.autograd.gradcheck in float64."""

    @staticmethod
    def forward(ctx, Z, A, mask, tau_p, V, chunk, keep, padded):
        (B, T, _), K = Z.shape, len(A)
        log2e = 1 / math.log(2)
        A_s = A * (log2e / tau_p)                                     # (K, D): S = Z A_s^T = R log2(e) / tau_p
        S_all = Z.new_empty(B, T, K) if keep else None                # a training step keeps S for the backward
        work = Z.new_empty(3, min(chunk, B), T, K)                    # reused buffers, (3, b, T, K)
        p, Y, m_all, sum_all = [], [], [], []
        for i in range(0, B, chunk):
            b = min(chunk, B - i)
            S = torch.matmul(Z[i:i + chunk], A_s.T, out=S_all[i:i + b] if keep else work[0, :b])  # Eq. (4), (b, T, K)
            logits = S
            if any(padded[i:i + chunk]):                              # padding: -inf before the softmax
                bias = S.new_zeros(b, T, 1).masked_fill_(~mask[i:i + chunk, :, None], float("-inf"))
                logits = torch.add(S, bias, out=work[1, :b])
            m = logits.amax(dim=1, keepdim=True)                      # (b, 1, K)
            E = torch.sub(logits, m, out=work[1, :b]).exp2_()         # Eq. (5) numerator, (b, T, K)
            E_sum = E.sum(dim=1, keepdim=True)                        # (b, 1, K)
            p.append(torch.mul(E, S, out=work[2, :b]).sum(1) / E_sum[:, 0] * (tau_p / log2e))  # Eq. (6), (b, K)
            if V is not None:
                EV = V[i:i + chunk].transpose(1, 2) @ E                   # (b, c, K): this way round, a wide
                Y.append((EV / E_sum).transpose(1, 2))                    # product (26x faster); alpha^T V (b, K, c)
            m_all.append(m)
            sum_all.append(E_sum)
        p = torch.cat(p)                                              # (B, K)
        Y = torch.cat(Y) if V is not None else p.new_zeros(0)         # (B, K, c)
        if keep:
            ctx.save_for_backward(Z, A, mask, p, Y, S_all, torch.cat(m_all), torch.cat(sum_all),
                                  *([] if V is None else [V]))
        ctx.tau_p, ctx.chunk, ctx.has_V, ctx.padded = tau_p, chunk, V is not None, padded
        return p, Y

    @staticmethod
    def backward(ctx, g, G):
        Z, A, mask, p, Y, S_all, m_all, sum_all, *V = ctx.saved_tensors
        V = V[0] if ctx.has_V else None
        tau_p, chunk, (B, T, _), K = ctx.tau_p, ctx.chunk, Z.shape, len(A)
        ln2 = math.log(2)
        dZ = torch.zeros_like(Z) if ctx.needs_input_grad[0] else None
        dA = torch.zeros_like(A)
        dV = torch.zeros_like(V) if ctx.has_V and ctx.needs_input_grad[4] else None
        work = Z.new_empty(2, min(chunk, B), T, K)                    # reused buffers, (2, b, T, K)
        for i in range(0, B, chunk):
            b = min(chunk, B - i)
            S, logits = S_all[i:i + b], S_all[i:i + b]                # (b, T, K)
            if any(ctx.padded[i:i + chunk]):
                bias = S.new_zeros(b, T, 1).masked_fill_(~mask[i:i + chunk, :, None], float("-inf"))
                logits = torch.add(S, bias, out=work[0, :b])
            alpha = torch.sub(logits, m_all[i:i + b], out=work[0, :b]).exp2_().div_(sum_all[i:i + b])  # Eq. (5)
            g_c = g[i:i + chunk, None]                                # (b, 1, K)
            shift = g_c * (1 - p[i:i + chunk, None] / tau_p)          # (b, 1, K)
            if ctx.has_V:
                G_c = G[i:i + chunk] / tau_p                          # (b, K, c)
                shift = shift - (Y[i:i + chunk] * G_c).sum(-1)[:, None]
            # g (1 + R / tau_p - p / tau_p) [- sum_c Y G / tau_p]
            dR = torch.addcmul(shift, S, g_c * ln2, out=work[1, :b])
            if ctx.has_V:
                dR.baddbmm_(V[i:i + chunk], G_c.transpose(1, 2))      # + V G^T / tau_p
                if dV is not None:
                    dV[i:i + chunk] = (G_c.transpose(1, 2) @ alpha.transpose(1, 2)).transpose(1, 2) * tau_p  # (b, T, c)
            dR.mul_(alpha)                                            # (b, T, K)
            dA.addmm_(dR.flatten(0, 1).T, Z[i:i + chunk].flatten(0, 1))
            if dZ is not None:
                dZ[i:i + chunk] = dR @ A
        return dZ, dA, None, None, dV, None, None, None


CHUNK_ELEMENTS = {"cpu": 2 ** 18,   # 1 MB of float32: a core's L2 cache here
                  "gpu": 2 ** 26}   # 256 MiB: a COCO batch (256 x 256 patches x K 512 = 2^25) in one chunk


def chunked_cap(Z, A, mask, tau_p, V=None, chunk_elements=None):
    """p (B, K) = cap(relative(Z, A), mask, tau_p)[0], and Y = alpha^T V (B, K, c) if V is given, in chunks
    of about chunk_elements (b, T, K) entries (None: CHUNK_ELEMENTS of Z's device: a CPU's cache, or on a GPU
    the whole batch, whose time goes to launching kernels, not to memory traffic). Tokens padded in every
    row of the batch (the image's global slot, choice 2) are dropped first: they weigh 0 anyway.
    On a CPU what the chunks need to know of the mask is read from it (free there); on a GPU that would be a
    host sync a call, so there no column is dropped and every chunk masks its padding (a bias of 0 where there
    is none: the same values)."""
    T = Z.shape[1]
    if Z.device.type == "cpu":
        real = mask.any(dim=0)                                        # (T,) a token some row has
        padded = (~mask & real).any(dim=1)                            # (B,) a row with padding among those
        flags = torch.cat([real, padded]).tolist()                    # read on the host (a CPU tensor: no sync)
        real, padded = flags[:T], tuple(flags[T:])
    else:                                                             # GPU (or meta): no look at the values
        real, padded = [True] * T, (not Z.is_meta,) * len(Z)
    if not all(real):
        t = [j for j, r in enumerate(real) if r]
        # a view where it can be
        t = slice(t[0], t[-1] + 1) if t[-1] - t[0] + 1 == len(t) else torch.tensor(t, device=Z.device)
        Z, mask, V = Z[:, t], mask[:, t], V if V is None else V[:, t]
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS["cpu" if Z.device.type == "cpu" else "gpu"]
    chunk = max(1, chunk_elements // (Z.shape[1] * A.shape[0]))
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (Z, A, V))
    Z = F.normalize(Z, dim=-1)                                        # unit rows
    if any(padded):
        Z = Z * mask[..., None]                                       # padding exactly 0
    return ChunkedCAP.apply(Z, F.normalize(A, dim=-1), mask, tau_p, V, chunk, keep, padded)
