"""Efficiency of text-free regions (CoV-Align) vs text-guided aggregation (LAPS/SPARC style).

On random frozen features (no training needed: cost does not depend on the weights):
1. retrieval evaluation time = embed every image and caption + the full
   (images x captions) score matrix, through each method's own score();
2. peak memory and time of ONE training step (loss + backward) at a given batch.

CoV computes its Q regions once per image, so score() is a small region-word
max-sum; TextGuided re-aggregates all patches for every (image, caption) pair.

Memory: on CUDA, torch.cuda.max_memory_allocated minus the memory allocated
before the step. On CPU, each method runs in its own subprocess and we report the
growth of the process's peak resident set over the step, after a tiny warm-up step
at batch 2 (tracemalloc cannot see torch's C++ allocations). The peak is Linux's
VmHWM from /proc/self/status, not resource.getrusage's ru_maxrss: ru_maxrss
survives fork + exec, so a child would inherit the parent's (larger) peak. RSS
counts pages actually touched: read it as the step's peak working set, comparable
between methods, not an exact allocator figure.

The text-guided score is slow by design; with --slow-images N (default 25) it is
timed on the first N images against ALL captions and scaled by images / N (the cost
is exactly linear in the number of images); --slow-images 0 times it in full.

    python benchmarks/bench_cov.py                  # ~1-2 min on 2 CPU cores (5 min when busy)
    python benchmarks/bench_cov.py --images 200 --captions 1000 --batch 32   # quick
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from features import Features  # noqa: E402
from methods.cov import CoV  # noqa: E402
from methods.filip import FILIP  # noqa: E402
from methods.text_guided import TextGuided  # noqa: E402

METHODS = {"cov": CoV, "text_guided": TextGuided, "filip": FILIP}
SLOW = {"text_guided", "filip"}   # per-pair cost over all patches: time on a subset of images


def random_features(args, n_images, n_captions, seed=0):
    g = torch.Generator().manual_seed(seed)
    H = W = args.grid
    img_tok = torch.randn(n_images, 1 + H * W, args.d_image, generator=g)
    img = Features(tokens=img_tok, mask=torch.ones(n_images, 1 + H * W, dtype=torch.bool),
                   pooled=img_tok[:, 0], grid=(H, W))
    lengths = torch.randint(args.max_words // 2, args.max_words + 1, (n_captions,), generator=g)
    mask = torch.arange(args.max_words)[None] < lengths[:, None]          # (N, L) real words first
    txt_tok = torch.randn(n_captions, args.max_words, args.d_text, generator=g) * mask[..., None]
    txt = Features(tokens=txt_tok, mask=mask, pooled=txt_tok.sum(1) / lengths[:, None])
    return img.to(args.device), txt.to(args.device)


def build(name, args):
    dim = dict(dim=args.dim) if name == "cov" else dict(K=args.dim)
    torch.manual_seed(0)
    return METHODS[name](args.d_image, args.d_text, **dim).to(args.device)


def sync(args):
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def eval_time(name, img, txt, args):
    """Seconds to embed all images and captions and fill the full score matrix."""
    m = build(name, args).eval()
    n_img = len(img)
    if name in SLOW and 0 < args.slow_images < n_img:
        img = img[:args.slow_images]
    sync(args)
    t0 = time.perf_counter()
    e_img = torch.cat([m.embed_image(img[i:i + 256]) for i in range(0, len(img), 256)])
    e_txt = torch.cat([m.embed_text(txt[i:i + 256]) for i in range(0, len(txt), 256)])
    S = m.score(e_img, e_txt)                                  # (N_img, N_txt)
    sync(args)
    seconds = time.perf_counter() - t0
    assert S.shape == (len(img), len(txt))
    return seconds * n_img / len(img), len(img) < n_img


def peak_rss():
    """Peak resident set (bytes) of this process image, Linux VmHWM."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024                 # reported in kB


def train_step_memory(name, args):
    """Run in a fresh process: peak extra memory (MB) and time (s) of one training step."""
    m = build(name, args).train()
    img, txt = random_features(args, args.batch, args.batch, seed=1)
    loss, _ = m.loss(img[:2], txt[:2])                         # warm-up: kernels, thread pools
    loss.backward()
    m.zero_grad(set_to_none=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = peak_rss()
    t0 = time.perf_counter()
    loss, _ = m.loss(img, txt)
    loss.backward()
    sync(args)
    seconds = time.perf_counter() - t0
    if args.device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss() - base
    return peak / 2 ** 20, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=1000, help="gallery images")
    p.add_argument("--captions", type=int, default=5000, help="query captions")
    p.add_argument("--grid", type=int, default=8, help="patch grid side (grid x grid patches)")
    p.add_argument("--d-image", type=int, default=384, help="frozen image feature dim")
    p.add_argument("--d-text", type=int, default=256, help="frozen text feature dim")
    p.add_argument("--max-words", type=int, default=16, help="caption length L (real words L/2..L)")
    p.add_argument("--dim", type=int, default=512, help="shared dim of the methods (CoV-Align, training strategy: 512)")
    p.add_argument("--batch", type=int, default=128,
                   help="training batch for the memory step (CoV-Align, efficiency experiments: 128)")
    p.add_argument("--slow-images", type=int, default=25,
                   help="time per-pair methods on this many images and scale up (0 = all)")
    p.add_argument("--methods", default="cov,text_guided", help="comma list of: " + ",".join(METHODS))
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)   # internal: subprocess mode
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    if args.memory_of:                                         # child process: one training step
        print(json.dumps(train_step_memory(args.memory_of, args)))
        return

    names = args.methods.split(",")
    print(f"images {args.images} x captions {args.captions}, grid {args.grid}x{args.grid}, "
          f"d_image {args.d_image}, d_text {args.d_text}, L {args.max_words}, dim {args.dim}, "
          f"batch {args.batch}, device {args.device}, threads {args.threads}")
    img, txt = random_features(args, args.images, args.captions)
    rows = {}
    for name in names:
        seconds, scaled = eval_time(name, img, txt, args)
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--memory-of", name],
                               capture_output=True, text=True, check=True)
        mem, step = json.loads(child.stdout.strip().splitlines()[-1])
        rows[name] = (seconds, scaled, mem, step)

    print("\n| method | eval time (s) | us / pair | train-step peak mem (MB) | train step (s) |")
    print("|---|---|---|---|---|")
    pairs = args.images * args.captions
    for name, (seconds, scaled, mem, step) in rows.items():
        note = f" (x{args.images // args.slow_images} from {args.slow_images} images)" if scaled else ""
        print(f"| {name} | {seconds:.1f}{note} | {1e6 * seconds / pairs:.2f} | {mem:.0f} | {step:.2f} |")
    if "cov" in rows:
        for name in names:
            if name != "cov":
                c, o = rows["cov"], rows[name]
                print(f"\n{name} / cov: eval time x{o[0] / c[0]:.1f}, train memory x{o[2] / max(c[2], 1e-9):.1f}")


if __name__ == "__main__":
    main()
