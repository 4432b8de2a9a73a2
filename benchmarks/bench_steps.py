"""Time of one training step and one evaluation pass of every method, against its matmul bound.

For each method of methods.METHODS, on random Features of two sizes:
- step: loss + backward + optimizer step (the method's own optimizer and lr, align.py's rule), trained methods only;
- eval: embed_image + embed_text + score() of a batch of B images against its B captions, under no_grad.

Columns:
  batch       the batch B; smaller than --batch (marked *) only where at --batch the matmul bound of the step or
              the eval exceeds --budget seconds, or 4 copies of its (B, B, ...) per-pair tensors exceed --max-gb
  ms          median time over --repeats runs after one warm-up run; --clock cpu (the default at 1 CPU thread):
              the process's CPU time, which does not count the time other jobs hold the core (on a shared
              machine the wall time of the same row varied 3x within minutes); wall otherwise
  GF          GFLOPs of the method's MATRIX PRODUCTS only, counted from the shapes (FLOPS below); elementwise
              passes (softmax, masking, normalisation, LayerNorm, grid_sample, top-k) are not counted
  mm          the machine's torch.mm throughput in GFLOP/s, measured at the same thread count just before
              and just after the row (the faster of the two, so load that comes and goes during a run
              shifts a row's bound with its time): the faster of (B*T, D) @ (D, 512) (the token
              projection) and (B*T, 512) @ (512, 512)
  bound       GF / mm
  x           ms / bound: 1 would be a step made of nothing but matrix products at that throughput
  MB          peak memory growth over the runs: on CPU Linux's VmHWM (peak resident set, reset through
              /proc/self/clear_refs before the runs) minus the resident set before them, so it counts pages
              touched, not exact allocations (tracemalloc cannot see torch): 0 means the runs fit in memory the
              process already held; on CUDA the growth of max_memory_allocated

Training FLOPs: a product of a frozen feature with a weight costs 2x its forward (the forward + the weight's
gradient; the features need no gradient); a product of two trained tensors costs 3x (both gradients). After a
LayerNorm with affine weights (FA, SAIL) every product counts 3x, since the input gradient is needed.
Hyperparameters: every method's constructor defaults (their paper settings); K = 512 (every default is 512).

    python benchmarks/bench_steps.py                                    # Shapes size, 1 thread, ~1 min
    python benchmarks/bench_steps.py --sizes coco --methods pal linear csa --repeats 3
    python benchmarks/bench_steps.py --threads 2 --device cuda          # runs unchanged on a GPU
    python benchmarks/bench_steps.py --methods pal mlp --profile        # + where each row's time goes
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from features import Features  # noqa: E402
from methods import METHODS  # noqa: E402

# B batch, H x W patch grid (T = 1 + H*W image tokens, the global token first), L words (padded), D_v, D_l
SIZES = {
    "shapes": dict(B=256, H=8, W=8, L=24, D_v=96, D_l=96),        # tiny Shapes encoders, ~20 words a caption
    "coco": dict(B=256, H=16, W=16, L=32, D_v=1024, D_l=1024),    # DINOv2-L (257 x 1024), RoBERTa-L (32 x 1024)
}
K = 512


def mm(m, k, n):
    """FLOPs of an (m, k) @ (k, n) product: one multiply and one add per term."""
    return 2 * m * k * n


def flops(name, B, H, W, L, D_v, D_l, n_fit):
    """(training-step FLOPs, eval-pass FLOPs) of a method's matrix products; see the module docstring."""
    N, T = H * W, 1 + H * W
    sim = mm(B, K, B)                                             # h_v @ h_l.T, (B, B)
    glob = mm(B, D_v, K) + mm(B, D_l, K)                          # pooled features @ a weight, both sides
    tok = mm(B * T, D_v, K) + mm(B * L, D_l, K)                   # every token @ a weight, both sides
    if name in ("linear", "linear_rs", "mlp_rs"):
        extra = 0
        if name != "linear":                                      # R_S: softmax(H H^T / tau) of X (frozen) and Z
            extra = 3 * 2 * mm(B, K, B) + mm(B, D_v, B) + mm(B, D_l, B)
        if name == "mlp_rs":                                      # residual head: W_1 (frozen input), W_2
            r = 64
            extra += 2 * (mm(B, D_v, r) + mm(B, D_l, r)) + 3 * 2 * mm(B, r, K)
        return 2 * glob + 3 * sim + extra, glob + sim
    if name == "pal":                                             # Eq. (4) R = Z A^T for all tokens, Eq. (8) sim
        return 2 * tok + 3 * sim, tok + sim
    if name == "pal_rel":                                         # PAL's + (R1) beta^T pos, (R2) Z U, (R3) alpha^T o
        a = mm(B * K, N, 2) + mm(B * K, L, 2) + mm(B, 3 * K, B)
        return 2 * (tok + mm(B * L, D_l, 2)) + 3 * a, tok + mm(B * L, D_l, 2) + a
    if name == "cov":                                             # P_v, P_t; value, W_assign, V over patches;
        Q = 8                                                     # Eq. (2) attn, Eq. (3) r; Eq. (6) max-sum
        p = mm(B * N, D_v, K) + mm(B * L, D_l, K)
        a = 3 * mm(B * N, K, K) + 2 * mm(B * Q, K, N) + 2 * mm(B * Q, K, K) + mm(B * Q, K, 48) + mm(B * Q, K, B * L)
        return 2 * p + 3 * (a + mm(B * Q, K, Q)), p + a           # + Eq. (5) r r^T in training
    if name == "text_guided":                                     # Eq. (1) s = v w^T for every pair; Eq. (2)-(3)
        p = mm(B * N, D_v, K) + mm(B * L, D_l, K)                 # through the Gram matrix G = v v^T and G a
        a = mm(B * N, K, B * L) + B * mm(N, K, N) + B * mm(N, N, B * L)
        return 2 * p + 3 * a, p + a
    if name == "filip":                                           # every patch . every word, for every pair
        p, a = mm(B * N, D_v, K) + mm(B * L, D_l, K), mm(B * N, K, B * L)
        return 2 * p + 3 * a, p + a
    if name == "fa":                                              # Eq. (1) W_a, W_b, W_c on the global token,
        a = (2 * mm(B, D_v, K) + mm(B, K, K) + 2 * mm(B * N, D_v, K) + mm(B * N, K, K)   # the patches,
             + 2 * mm(B * L, D_l, K) + mm(B * L, K, K) + 2 * mm(B, K, K) + sim)          # the words; Eq. (2) G
        return 3 * a, a
    if name == "sail":                                            # StarMLP: f_1, f_2 (width 8), g, both sides
        a = sum(2 * mm(B, D, 8 * D) + mm(B, 8 * D, K) for D in (D_v, D_l)) + sim
        return 3 * a, a
    if name == "mlp":                                             # W_1 (frozen input), W_2; eval: cosine scores
        return (2 * mm(B, D_l, 4 * D_v) + 3 * mm(B, 4 * D_v, D_v),
                mm(B, D_l, 4 * D_v) + mm(B, 4 * D_v, D_v) + mm(B, D_v, B))
    if name == "t2c":                                             # W y_hat; eval: cosine scores
        return 2 * mm(B, D_l, D_v), mm(B, D_l, D_v) + mm(B, D_v, B)
    if name == "csa":                                             # (x - mu) A, (y - mu) B, scores, d = 200
        d = min(200, D_v, D_l)
        return 0, mm(B, D_v, d) + mm(B, D_l, d) + mm(B, d, B)
    if name == "asif":                                            # cosines to the N_a fitted anchors, scores
        return 0, mm(B, D_v, n_fit) + mm(B, D_l, n_fit) + mm(B, n_fit, B)
    raise KeyError(f"no FLOP formula for {name}: add one")


def pairwise_bytes(name, B, H, W, L, **_):
    """Bytes of the largest (B, B, ...) tensor a method builds per pair of batch rows (fp32), 0 for the others."""
    per_pair = {"text_guided": L * H * W, "filip": H * W * L, "cov": 8 * L}.get(name, 0)
    return 4 * B * B * per_pair


def random_features(B, H, W, L, D_v, D_l, device, seed=0):
    """Images: global token + H*W patches, all real; captions: L/2 to L real words, padding exactly 0."""
    g = torch.Generator().manual_seed(seed)
    img_tok = torch.randn(B, 1 + H * W, D_v, generator=g)                 # (B, T, D_v)
    img = Features(tokens=img_tok, mask=torch.ones(B, 1 + H * W, dtype=torch.bool), pooled=img_tok[:, 0],
                   grid=(H, W))
    n = torch.randint(L // 2, L + 1, (B,), generator=g)                   # (B,) words per caption
    mask = torch.arange(L)[None] < n[:, None]                             # (B, L) real words first
    txt_tok = torch.randn(B, L, D_l, generator=g) * mask[..., None]       # (B, L, D_l)
    txt = Features(tokens=txt_tok, mask=mask, pooled=txt_tok.sum(1) / n[:, None])
    return img.to(device), txt.to(device)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def memory(device):
    """(current, peak) bytes: the resident set and its high-water mark on CPU, the allocator on CUDA."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def reset_peak(device):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        open("/proc/self/clear_refs", "w").write("5")    # Linux: VmHWM <- VmRSS


CLOCK = time.perf_counter                                # main() sets it from --clock


def timed(run, repeats, device):
    """(median seconds over repeats after one warm-up run, peak memory growth in bytes)."""
    run()                                                # warm-up (and PAL's first-batch anchor init)
    sync(device)
    reset_peak(device)
    before = memory(device)[0]
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        run()
        sync(device)
        times.append(CLOCK() - t0)
    return statistics.median(times), max(0, memory(device)[1] - before)


def matmul_rate(M, D, device, repeats=5):
    """FLOP/s of torch.mm at the current thread count: the faster of a (M, D) @ (D, K) product (projecting
    the tokens) and a (M, K) @ (K, K) one (products in the K-dim space), so the bound is the best case."""
    rates = []
    for d in (D, K):
        a, b = torch.randn(M, d, device=device), torch.randn(d, K, device=device)
        rates.append(mm(M, d, K) / timed(lambda: torch.mm(a, b), repeats, device)[0])  # noqa: B023 (called in this iteration)
    return max(rates)


def build(name, img, txt, n_fit, device):
    """The method at its constructor defaults; closed-form methods fitted on n_fit random pairs."""
    torch.manual_seed(0)
    m = METHODS[name](img.tokens.shape[-1], txt.tokens.shape[-1]).to(device)
    if m.fit is not None:
        m.fit(img[:n_fit], txt[:n_fit])
    return m


def bench(name, size, args):
    s = dict(SIZES[size], B=args.batch)
    rate_of = lambda: matmul_rate(args.batch * (1 + s["H"] * s["W"]), s["D_v"], args.device)
    rate = rate_of()                                     # before the row (after it: below)
    n_fit = 4 * s["B"]                                   # ASIF's anchors, CSA's fit: 4 batches of random pairs
    bound = lambda B: max(flops(name, **dict(s, B=B), n_fit=n_fit)) / rate
    # a batch whose step runs in about --budget s at best and whose per-pair tensors (a few copies kept for
    # the backward) fit in --max-gb
    while s["B"] > 2 and (bound(s["B"]) > args.budget or 4 * pairwise_bytes(name, **s) > args.max_gb * 2 ** 30):
        s["B"] //= 2
    img, txt = random_features(**dict(s, B=max(s["B"], n_fit)), device=args.device)
    m = build(name, img, txt, n_fit, args.device)
    img, txt = img[:s["B"]], txt[:s["B"]]
    f_step, f_eval = flops(name, **s, n_fit=n_fit)
    row = dict(method=name, size=size, batch=f"{s['B']}{'*' if s['B'] < args.batch else ''}")
    if m.loss is not None:
        d = m.defaults
        opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[d.get("optimizer", "adamw")](
            m.parameters(), lr=d["lr"], weight_decay=d.get("weight_decay", 0.0), betas=d.get("betas", (0.9, 0.999)))

        def step():
            m.train()
            opt.zero_grad(set_to_none=True)
            m.loss(img, txt)[0].backward()
            opt.step()
        row["step"] = timed(step, args.repeats, args.device) + (f_step,)
        if args.profile:
            profile(step, f"{name} step, {size}")

    @torch.no_grad()
    def evaluate():
        m.eval()
        m.score(m.embed_image(img), m.embed_text(txt))
    row["eval"] = timed(evaluate, args.repeats, args.device) + (f_eval,)
    if args.profile:
        profile(evaluate, f"{name} eval, {size}")
    row["rate"] = max(rate, rate_of())
    return row


def profile(run, title, top=8):
    """--profile: where one run's time goes, torch.profiler's `top` operators by their own time (to stderr)."""
    from torch.profiler import profile as torch_profile
    with torch_profile() as prof:
        run()
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    print(f"  {title}: {total / 1e3:.1f} ms of operators", file=sys.stderr)
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.key:32s} {e.self_cpu_time_total / 1e3:8.1f} ms {100 * e.self_cpu_time_total / total:5.1f}%  "
              f"x{e.count}", file=sys.stderr)


def cells(r, rate):
    if r is None:
        return ["-"] * 5
    seconds, peak, f = r
    return [f"{1e3 * seconds:.1f}", f"{f / 1e9:.2f}", f"{1e3 * f / rate:.1f}", f"{seconds * rate / f:.1f}",
            f"{peak / 2 ** 20:.0f}"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's own default)")
    p.add_argument("--sizes", nargs="+", default=["shapes"], choices=list(SIZES), help="feature shapes")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="methods to time")
    p.add_argument("--repeats", type=int, default=5, help="timed runs after one warm-up; the median is shown")
    p.add_argument("--batch", type=int, default=256, help="batch B (halved per row while its bound > --budget)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds: the most a row's matmul bound may take")
    p.add_argument("--max-gb", type=float, default=4.0, help="GB: the most 4 copies of a per-pair tensor may take")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None,
                   help="cpu: the process's CPU time (default at --threads 1 on a CPU), wall: elapsed time")
    p.add_argument("--profile", action="store_true", help="print each row's top operators (torch.profiler) to stderr")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.clock is None:
        args.clock = "cpu" if args.device == "cpu" and torch.get_num_threads() == 1 else "wall"
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() > 1):
        p.error("--clock cpu needs --device cpu and one thread (CPU time adds up over threads)")
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"device {args.device}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"{args.clock} time, median of {args.repeats} after a warm-up")
    head = ["method", "batch", "mm"] + [f"{k} {c}" for k in ("step", "eval") for c in ("ms", "GF", "bound", "x", "MB")]
    for size in args.sizes:
        s = SIZES[size]
        print(f"\n{size}: B={args.batch}, T={1 + s['H'] * s['W']} image tokens ({s['H']}x{s['W']}), L={s['L']} words, "
              f"D_v={s['D_v']}, D_l={s['D_l']}")
        rows = []
        for name in args.methods:
            r = bench(name, size, args)
            rows.append([r["method"], r["batch"], f"{r['rate'] / 1e9:.0f}"] + cells(r.get("step"), r["rate"])
                        + cells(r["eval"], r["rate"]))
            print("  done", name, flush=True, file=sys.stderr)
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for row in rows:
            print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if any(row[1].endswith("*") for row in rows):
            print(f"* batch halved from {args.batch} until the row's matmul bound is under {args.budget:g} s "
                  f"and 4 copies of its per-pair tensors under {args.max_gb:g} GB")


if __name__ == "__main__":
    main()
