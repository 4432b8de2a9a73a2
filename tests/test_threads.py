"""A CPU run's numbers do not depend on the thread count: each method trained a few steps and scored at 1 and
at 2 torch threads gives the same weights and the same score matrix, bit for bit (README: a CPU run's
metrics.json is the same at --threads 1 and 2). Exceptions are listed in THREAD_EXCEPTIONS with the reason."""
import pytest
import torch
from conftest import random_features

import evaluate
import train  # noqa: F401  (sets MKL_CBWR before any matrix product, as align.py's run does)
from features import Features
from methods import METHODS

THREAD_EXCEPTIONS = {}          # method -> why its CPU numbers depend on the thread count


def tiny(name):
    torch.manual_seed(0)
    small = dict(pal=dict(K=64), pal_rel=dict(K=64), cov=dict(dim=128), text_guided=dict(K=64), filip=dict(K=64),
                 fa=dict(K=64), linear=dict(K=64), linear_rs=dict(K=64), mlp_rs=dict(K=64), sail=dict(K=64, width=2),
                 csa=dict(d=8, ridge=0.1), asif=dict())
    return METHODS[name](96, 64, **small.get(name, {}))


def one_run(name, threads):
    """A few optimiser steps (or the fit), then the score matrix of 12 images x 12 texts, at `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        img = random_features(128, 1 + 64, 96, grid=(8, 8), seed=1)   # the Shapes run's sizes: 8 x 8 patches, 96-d
        txt = random_features(128, 12, 64, lengths=[3 + i % 9 for i in range(128)], seed=2)
        m = tiny(name)
        if m.fit is not None:
            m.fit(Features.from_vectors(img.pooled), Features.from_vectors(txt.pooled))
        if m.loss is not None:
            opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            for step in range(2):
                i = torch.arange(step * 64, step * 64 + 64)     # a batch of 64: a weight gradient sums 4,096 rows
                loss, _ = m.loss(img[i], txt[i])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with evaluate.inference(m):
            emb = evaluate.embed(m.embed_image, img[:12]), evaluate.embed(m.embed_text, txt[:12])
            S = evaluate.score_matrix(m, *emb)
        return {k: v.clone() for k, v in m.state_dict().items()}, S
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_same_numbers_at_one_and_two_threads(name):
    if name in THREAD_EXCEPTIONS:
        pytest.skip(THREAD_EXCEPTIONS[name])
    (w1, S1), (w2, S2) = one_run(name, 1), one_run(name, 2)
    differ = [k for k in w1 if not torch.equal(w1[k], w2[k])]
    assert not differ, f"{name}: weights {differ[:4]} differ between 1 and 2 threads (by up to " \
                       f"{max((w1[k].float() - w2[k].float()).abs().max().item() for k in differ):.3g})"
    assert torch.equal(S1, S2), f"{name}: the score matrix differs between 1 and 2 threads by up to " \
                                f"{(S1 - S2).abs().max().item():.3g}"
