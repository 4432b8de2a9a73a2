"""CPU time of one PAL training step (loss + backward + AdamW step) with CAP in its fast form
(methods/fast_cap.py) and in its paper form (cap(relative(Z, A))), on random features of the
Shapes world's size (batch 256, 1 + 8 x 8 image tokens, up to 24 words, 96-d, K = 512), 1 thread.

    python benchmarks/bench_cap.py
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from features import Features  # noqa: E402
from methods.pal import PAL  # noqa: E402

torch.set_num_threads(1)
B, H, W, L, Dv, Dl = 256, 8, 8, 24, 96, 96
g = torch.Generator().manual_seed(0)
tok = torch.randn(B, 1 + H * W, Dv, generator=g)
img = Features(tok, torch.ones(B, 1 + H * W, dtype=torch.bool), tok[:, 0], (H, W))
t = torch.randn(B, L, Dl, generator=g)
mask = torch.arange(L)[None] < torch.randint(8, L + 1, (B,), generator=g)[:, None]
txt = Features(t * mask[..., None], mask, t.mean(1))
for fast in (True, False):
    torch.manual_seed(0)
    m = PAL(Dv, Dl, fast=fast)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-2, weight_decay=0.0)
    times = []
    for _i in range(6):
        t0 = time.process_time()
        loss, _ = m.loss(img, txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.process_time() - t0)
    print(f"fast={fast}: {1000 * statistics.median(times[1:]):.0f} ms CPU a step (median of 5 after a warm-up)")
