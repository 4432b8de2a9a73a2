"""Shared test setup: CPU only, one thread (small ops run faster so on 2 shared cores), no network."""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state (torch's global generator at seed 0), so that a test run
    alone, in its file or under exercises/grade.py draws the same anchors and inputs and reports the same numbers."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One encoder/feature cache for the whole session: the tiny encoders are pretrained once.

    ALIGN_TEST_CACHE=<dir> reuses a cache across sessions (a developer's quick loop); CI leaves it unset."""
    shared = os.environ.get("ALIGN_TEST_CACHE")
    return Path(shared) if shared else tmp_path_factory.mktemp("cache")


def random_features(B, T, D, grid=None, lengths=None, seed=0):
    """Random Features for tests. lengths: per-row real-token counts (text padding)."""
    from features import Features
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(B, T, D, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    if lengths is not None:
        for b, n in enumerate(lengths):
            mask[b, n:] = False
            tokens[b, n:] = 0
    pooled = (tokens * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return Features(tokens=tokens, mask=mask, pooled=pooled, grid=grid)


def interrupted(method_cls, at_call):
    """method_cls whose loss raises KeyboardInterrupt (a Ctrl-C) at its at_call-th call, counting across instances."""
    class Stop(method_cls):
        calls = 0

        def loss(self, i, t):
            Stop.calls += 1
            if Stop.calls == at_call:
                raise KeyboardInterrupt
            return super().loss(i, t)
    return Stop


def assert_same(got, want, what, atol=None, rtol=None):
    """torch.testing.assert_close's check (same shape, dtype and tolerances; NaN never equal) with a one-line
    message for exercises/grade.py: what differs, how many entries, by how much and where."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    precise = got.dtype == torch.float64
    atol = (1e-7 if precise else 1e-5) if atol is None else atol
    rtol = (1e-7 if precise else 1.3e-6) if rtol is None else rtol
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (g - w).abs().nan_to_num(nan=float("inf"))
    bad = ~(diff <= atol + rtol * w.abs())
    if bad.any():
        worst = diff.flatten().argmax().item()
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(g.shape))) if g.dim() else ()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} entries differ, by up to "
                             f"{diff.flatten()[worst].item():.3g} (at {list(at)}: {g.flatten()[worst].item():.4g} "
                             f"instead of {w.flatten()[worst].item():.4g})")
