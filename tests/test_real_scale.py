"""Defaults that must hold on features shaped like a real encoder's, not only on the
Shapes world's tiny 96-d ones: SAIL's learning rate, the MLP
aligner's text-input scaling, PAL's pooling when aligned on classifier-head rows.

The planted world: a shared latent z (32-d) drives both views. The image view is a
1280-d non-negative vector with a large common mean and norm ~25 (like a CNN's or
BEiT's pooled feature); the text view is 384-d (MiniLM's width) with its own common
mean. Everything here runs in seconds on one CPU core."""
import math

import pytest
import torch
from conftest import train_with

import train
from features import Features
from methods.sail import SAIL

D_IMG, D_TXT, K_LATENT = 1280, 384, 32


def real_scale_pairs(n, seed=0, img_norm=25.0):
    """(image (n, 1280), text (n, 384)) sharing a planted 32-d latent."""
    maps = torch.Generator().manual_seed(1234)
    A = torch.randn(K_LATENT, D_IMG, generator=maps) / K_LATENT ** 0.5
    B = torch.randn(K_LATENT, D_TXT, generator=maps) / K_LATENT ** 0.5
    mu_img = 2 * torch.rand(D_IMG, generator=maps) - 0.5                  # common mean: all images alike at first sight
    mu_txt = 1.5 * torch.randn(D_TXT, generator=maps)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, K_LATENT, generator=g)
    img = torch.relu(z @ A + mu_img + 0.5 * torch.randn(n, D_IMG, generator=g))   # (n, 1280) >= 0
    txt = z @ B + mu_txt + 0.5 * torch.randn(n, D_TXT, generator=g)               # (n, 384)
    return img * img_norm / img.norm(dim=-1).mean(), txt


def siglip_chance(B):
    """SigLIP loss (sum over B x B pairs / B) when every pair gets the same logit, at its best
    bias: sigma(c) = 1/B, so L = log B + (B - 1) log(B / (B - 1))."""
    return math.log(B) + (B - 1) * math.log(B / (B - 1))


# ----------------------------------------------------------------------------- SAIL (item 7)

def test_sail_default_lr_trains_on_real_scale_features():
    """At the old lr 1e-3 the star MLP on a 1280-d input moved too far per Adam step and
    the loss climbed above chance (methods/sail.py choice 3); the default lr,
    0.1 / max(d_image, d_text), brings it well below chance in 12 steps."""
    img, txt = real_scale_pairs(512)
    B = 64
    torch.manual_seed(0)
    m = SAIL(D_IMG, D_TXT, K=64, width=2)              # width 8 behaves the same, 4x slower (choice 3)
    d = m.defaults
    opt = torch.optim.AdamW(m.parameters(), lr=d["lr"], weight_decay=d["weight_decay"])
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        idx = torch.randperm(len(img), generator=g)[:B]
        loss, _ = m.loss(Features.from_vectors(img[idx]), Features.from_vectors(txt[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * siglip_chance(B), loss.item()            # chance 5.15 at B = 64


# ----------------------------------------------------------------------------- PAL on head rows (item 9)

def test_pal_on_head_rows_tests_images_as_it_trained_on_them():
    """A head row is a prototype of what its head reads. A real head reads ONE pooled
    vector: with head_rows="pooled" (set by align.py when aligning on head rows
    alone) PAL pools every input to its pooled vector, so a test image is
    described exactly like the head row sharing its pooled feature, where CAP reads
    its 49 tokens and lands elsewhere. The Shapes head reads each patch
    (head_rows="patches"): CAP over the patches stays (methods/pal.py choice 8)."""
    from methods.pal import PAL
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(3, 1 + 49, 64, generator=g)                      # [global, 7x7 patches]
    image = Features(tokens=tokens, mask=torch.ones(3, 50, dtype=torch.bool), pooled=tokens[:, 0], grid=(7, 7))
    head_row = Features.from_vectors(tokens[:, 0])                        # what training sees: one vector
    torch.manual_seed(0)
    m = PAL(64, 32, K=16, head_rows="pooled")
    assert m.pooling == "global"
    torch.testing.assert_close(m.embed_image(image), m.embed_image(head_row))
    for head_rows in (None, "patches"):                                    # pairs, or a per-patch head: CAP
        torch.manual_seed(0)
        cap = PAL(64, 32, K=16, head_rows=head_rows)
        assert cap.pooling == "cap"
        assert (cap.embed_image(image) - cap.embed_image(head_row)).abs().max() > 0.1


@pytest.mark.slow
def test_align_tells_pal_what_the_head_rows_are(cache_dir, tmp_path):
    import json

    import align
    align.main(["--method", "pal", "--align-data", "weights", "--hp", "K=16", "--epochs", "1", "--eval-images", "20",
                "--cache-dir", str(cache_dir), "--out", str(tmp_path), "--no-figures", "--threads", "1"])
    assert json.loads((tmp_path / "config.json").read_text())["hp"] == {   # Shapes: a per-patch head, so CAP
        "K": 16, "tau_p": 0.03, "tau": 0.05, "pooling": "cap", "head_rows": "patches", "fast": True}


# ----------------------------------------------------------------------------- MLP aligner budget (item 8)

def test_mlp_budget_is_400_steps_whatever_the_data_size(tmp_path, monkeypatch):
    """methods/mlp.py choice 4: 24 head rows (one step per epoch) and 3,000 pairs
    (5 steps per epoch at batch 512) both get ~400 optimizer steps: 400 and 80 epochs."""
    import argparse

    from methods.mlp import MLP
    monkeypatch.setattr(train.storage, "atomic_save", lambda *a, **k: None)   # no checkpoint per epoch here
    for n, epochs in ((24, 400), (3000, 80)):
        m = MLP(12, 16)
        calls = []                                     # count the steps; a zero loss keeps each one cheap
        m.loss = lambda img, txt: calls.append(1) or (0 * m.g_bar[0].bias.sum(), {})  # noqa: B023 (called in this iteration)
        img, txt = Features.from_vectors(torch.randn(n, 12)), Features.from_vectors(torch.randn(n, 16))
        args = argparse.Namespace(epochs=None, batch_size=None, lr=None, weight_decay=None, seed=0, resume=False)
        train_with(m, img, txt, args, tmp_path, "cpu")
        assert len(calls) == 400 and len(calls) == epochs * (n // min(512, n))
