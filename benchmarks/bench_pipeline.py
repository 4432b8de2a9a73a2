"""The data path of a run, each stage against its bound, side by side in one run.

    python benchmarks/bench_pipeline.py                          # CPU, small sizes (a minute or two)
    python benchmarks/bench_pipeline.py --device cuda --coco-size   # one GPU, COCO sizes (see docs/pipeline.md)
    python benchmarks/bench_pipeline.py --tiny                   # seconds (tests/test_pipeline.py runs it)

(a) feature reads: rows/s of the training loader's read stage (features.read_ahead over
    memory-mapped shards.StoredFeatures shards of fixed-length image rows, random batches, fp16
    host batches) against a plain numpy fancy-index of the same shards (sorted indices, one copy
    per shard, one thread); ratio = reader / numpy (expected >= 2/3). Also the whole loader
    (features.batch_loader: batches as fp32 on the device, what a training step reads).
(b) extraction: images/s of JPEG decode + resize alone (model_files.ImagePreprocess), of the model
    alone (a randomly initialised DINOv2 config, tokens back on the host), and of cache.extract
    over the files (the pipeline); ratio = pipeline / the slower of the two (expected >= 0.8).
(c) layer selection (layers.select_layers, mknn): seconds against the naive form (every layer's
    tokens read per layer, both kNN sets recomputed for every layer pair on the host); ratio =
    naive / this (expected >= 10), and the seconds of a rerun (read from the cache).
(d) evaluation of the token-level methods (evaluate.embed + evaluate.score_matrix, every image x
    every caption): seconds against the matrix-product bound, 2 x the multiply-adds of the
    token similarities over the captions' real lengths at this device's measured fp32 matmul
    rate; ratio = bound / measured (1 = at the bound).

Synthetic data throughout (random smooth JPEGs, random features, randomly initialised models):
no download, no data set. Figures are medians of --repeats runs (min in brackets).
"""
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import data  # noqa: E402
import encoders  # noqa: E402
import evaluate  # noqa: E402
import features
import layers
import model_files  # noqa: E402
import shapes
import shapes_encoders as se  # noqa: E402
import similarity  # noqa: E402
from features import Features  # noqa: E402
from infra import cache, shards  # noqa: E402

SIZES = {  # rows, tokens, dim of (a); images, model (hidden, layers, heads) of (b); pairs, text layers of (c); (d)
    "tiny": dict(rows=128, T=17, D=32, batch=32, images=4, ext_batch=2, shard_rows=4, hidden=32, layers=2, heads=2,
                 pairs=24, t_layers=2, t_dim=32, n_img=6, n_txt=24, ev_T=17, ev_D=32, K=32,
                 cov_batch=8, pal_batch=16, step_T=17, step_L=8, step_D=32),
    "cpu": dict(rows=2048, T=257, D=256, batch=128, images=48, ext_batch=8, hidden=192, layers=6, heads=3, pairs=300,
                t_layers=6, t_dim=96, n_img=64, n_txt=320, ev_T=65, ev_D=96, K=128,
                cov_batch=128, pal_batch=256, step_T=257, step_L=32, step_D=1024),
    "coco": dict(rows=8192, T=257, D=1024, batch=128, images=1024, ext_batch=128, hidden=1024, layers=24, heads=16,
                 pairs=5000, t_layers=24, t_dim=1024, n_img=1000, n_txt=5000, ev_T=257, ev_D=1024, K=512,
                 cov_batch=128, pal_batch=256, step_T=257, step_L=32, step_D=1024),
}


def timed(fn, repeats, sync):
    """(median, min) seconds of fn() over repeats runs."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


class RowEncoder:
    """Random fixed-length rows (image-like) to fill the shards of (a)."""

    def __init__(self, T, D):
        self.name, self.layer, self.preprocess, self.fingerprint, self.T, self.D = "rows", -1, "none", "rows", T, D

    def encode(self, rows, device="cpu"):
        g = torch.Generator().manual_seed(int(rows[0]))
        tokens = torch.randn(len(rows), self.T, self.D, generator=g, dtype=torch.float32)
        return Features(tokens=tokens, mask=torch.ones(len(rows), self.T, dtype=torch.bool), pooled=tokens[:, 0],
                        grid=(1, self.T - 1))


def bench_reader(z, work, device, repeats, sync):
    old = shards.MEMMAP_BYTES, shards.SHARD_BYTES
    shards.MEMMAP_BYTES = 0                                                  # always to shards
    shards.SHARD_BYTES = 64 * 2**20
    try:
        f = cache.extract(RowEncoder(z["T"], z["D"]), list(range(z["rows"])), work / "reader", batch_size=z["batch"],
                          dataset="bench", split="reader", modality="image")
    finally:
        shards.MEMMAP_BYTES, shards.SHARD_BYTES = old
    txt = Features(tokens=torch.zeros(len(f), 1, 4), mask=torch.ones(len(f), 1, dtype=torch.bool),
                   pooled=torch.zeros(len(f), 4))                          # a negligible text side
    g = torch.Generator().manual_seed(0)
    batches = lambda: list(torch.randperm(len(f), generator=g).split(z["batch"]))
    views = [flat.reshape(-1, z["T"], z["D"]) for flat in f.tokens_files]
    starts = f.starts.numpy()

    def numpy_epoch():
        for idx in batches():
            rows = np.sort(idx.numpy())
            s = np.searchsorted(starts, rows, side="right") - 1
            [views[k][rows[s == k] - starts[k]] for k in np.unique(s)]      # one fancy-index copy per shard

    def reader_epoch():                                                     # the loader's read stage: fp16 host batches
        for _ in features.read_ahead(lambda idx: f[idx], batches()):
            pass

    def loader_epoch():                                                     # the whole loader, on the device as fp32
        for _ in features.batch_loader(f, txt, batches(), device):
            pass
    numpy_epoch()                                                           # the pages in the page cache for all
    np_t, np_min = timed(numpy_epoch, repeats, lambda: None)
    rd_t, rd_min = timed(reader_epoch, repeats, sync)
    ld_t, ld_min = timed(loader_epoch, repeats, sync)
    n, mb = len(f), len(f) * z["T"] * z["D"] * 2 / 2**20
    print(f"(a) feature reads: {n} rows x {z['T']} tokens x {z['D']} fp16 ({mb:.0f} MB in {len(views)} shards), "
          f"random batches of {z['batch']}; "
          f"{features.READ_WORKERS} reader threads, {features.READ_AHEAD} batches ahead")
    print(f"    reader rows/s            {n / rd_t:10.0f}  [{n / rd_min:.0f}]   ratio to numpy {np_t / rd_t:.2f} "
          f"(expected >= 0.67)")
    print(f"    numpy fancy-index rows/s {n / np_t:10.0f}  [{n / np_min:.0f}]   (the bound)")
    print(f"    loader rows/s            {n / ld_t:10.0f}  [{n / ld_min:.0f}]   ratio to numpy {np_t / ld_t:.2f} "
          f"(batches as fp32 on {device}: the training loop's input)")
    return {"reader_rows_s": {"value": n / rd_t, "ratio": np_t / rd_t},
            "numpy_rows_s": {"value": n / np_t, "ratio": 1.0},
            "loader_rows_s": {"value": n / ld_t, "ratio": np_t / ld_t}}


def jpegs(folder, n, seed=0):
    """n random smooth 640 x 480 JPEGs (COCO's typical size), as file paths."""
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(n):
        small = (torch.rand(3, 15, 20, generator=g) * 255)[None]
        img = torch.nn.functional.interpolate(small, size=(480, 640), mode="bilinear")[0]
        img = (img + torch.randn(3, 480, 640, generator=g) * 12).clamp(0, 255).byte().permute(1, 2, 0).numpy()
        paths.append(str(folder / f"{i:05d}.jpg"))
        Image.fromarray(img).save(paths[-1], quality=90)
    return paths


def dinov2(z, device):
    from transformers import Dinov2Config, Dinov2Model
    torch.manual_seed(0)
    cfg = Dinov2Config(hidden_size=z["hidden"], num_hidden_layers=z["layers"], num_attention_heads=z["heads"],
                       intermediate_size=4 * z["hidden"], image_size=224, patch_size=14)
    model = Dinov2Model(cfg).eval().to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    enc = encoders.HFImageEncoder(f"random-dinov2-{z['hidden']}x{z['layers']}", model,
                                  model_files.ImagePreprocess(256, 224))
    enc.fingerprint = "random init, seed 0"
    return enc


def bench_extraction(z, work, device, repeats, sync):
    paths = jpegs(work / "jpegs", z["images"])
    images = data.LazyImages(paths)
    enc = dinov2(z, device)
    B = z["ext_batch"]
    decode = lambda: [enc.transform(images[i:i + B]) for i in range(0, len(images), B)]
    x = enc.transform(images[:B])

    def model_only():
        for i in range(0, len(images), B):
            with torch.no_grad(), features.autocast(device):
                out = enc.model(pixel_values=x[:min(B, len(images) - i)].to(device))
            enc.layer_features(out, -1)
    runs = iter(range(10**6))

    def pipeline():
        cache.extract(enc, images, work / f"extract{next(runs)}", batch_size=B, device=device,
                      dataset="bench", split="extract", modality="image")
    T, D = (224 // 14) ** 2 + 1, z["hidden"]                                # the cache's rows: 257 tokens x hidden
    rows = z.get("shard_rows") or B * max(1, shards.SHARD_BYTES // (2 * T * D * B))   # as shards.shard_plan plans
    g = torch.Generator().manual_seed(0)
    shard = [Features(tokens=torch.randn(b, T, D, generator=g).half(), mask=torch.ones(b, T, dtype=torch.bool),
                      pooled=torch.randn(b, D, generator=g).half(), grid=(16, 16))
             for b in [B] * (rows // B) + ([rows % B] if rows % B else [])]
    (work / "shard").mkdir(exist_ok=True)
    host_work = lambda: shards.write_shard(work / "shard", 0, shard, "bench")  # cat, gather, np.save, checksum
    model_only()                                                            # warm-up (kernels, allocator)
    d_t, d_min = timed(decode, repeats, sync)
    m_t, m_min = timed(model_only, repeats, sync)
    p_t, p_min = timed(pipeline, repeats, sync)
    n = len(images)
    bound = min(n / d_t, n / m_t)
    print(f"(b) extraction: {n} synthetic 640x480 JPEGs -> resize 256, crop 224; random DINOv2 "
          f"(hidden {z['hidden']}, {z['layers']} layers) on {device}; {model_files.IMAGE_THREADS} decode threads, "
          f"batch {B}")
    print(f"    decode images/s          {n / d_t:10.1f}  [{n / d_min:.1f}]")
    print(f"    model images/s           {n / m_t:10.1f}  [{n / m_min:.1f}]")
    print(f"    pipeline images/s        {n / p_t:10.1f}  [{n / p_min:.1f}]   "
          f"ratio to the slower {n / p_t / bound:.2f} (expected >= 0.8)")
    h_t, h_min = timed(host_work, repeats, lambda: None)
    f_t = rows * m_t / n                                                    # the forward of a shard's rows
    print(f"    host work per shard s    {h_t:10.3f}  [{h_min:.3f}]   {rows} rows x {T} x {D} fp16 (cat, gather, save, "
          f"checksum: the writer thread's); forward per shard s {f_t:.3f}")
    batch = shard[0]
    c_t, _ = timed(lambda: shards.check_fp16(batch, enc), repeats, lambda: None)
    b_t = len(batch) * m_t / n                                              # the forward of one batch
    print(f"    host ms per batch        {c_t * 1e3:10.2f}   the range check of {len(batch)} rows on the host "
          f"(a CPU run's; on CUDA it runs on the device before the copy back: 0 host ms); forward per batch ms "
          f"{b_t * 1e3:.1f}")
    return {"decode_images_s": {"value": n / d_t, "ratio": n / d_t / bound},
            "host_per_batch_ms": {"value": c_t * 1e3, "ratio": c_t / b_t},
            "host_per_shard_s": {"value": h_t, "ratio": h_t / f_t},
            "model_images_s": {"value": n / m_t, "ratio": n / m_t / bound},
            "pipeline_images_s": {"value": n / p_t, "ratio": n / p_t / bound}}


def naive_select(image_enc, text_enc, images, captions, k, device, pairs_share=1.0, batch_size=64):
    """The naive layer selection: every layer's tokens formed and copied to the host as fp32 to keep the
    pooled vector, then both kNN sets recomputed on the host for every layer pair. pairs_share < 1 times
    that share of the pairs and scales it up (COCO size: the full 576 pairs would take ~25 minutes)."""
    X, Y = {}, {}
    for i in range(0, len(images), batch_size):
        out = image_enc.forward(images[i:i + batch_size], device, all_layers=True)
        for l in range(1, image_enc.n_layers + 1):
            X.setdefault(l, []).append(image_enc.layer_features(out, l).pooled)     # tokens to the host per layer
        ids, mask = text_enc.tokenizer(captions[i:i + batch_size])
        m = mask[..., None].float()
        for l in range(1, text_enc.n_layers + 1):
            h = text_enc.model.to(device)(ids.to(device), mask.to(device), l).cpu()    # one forward per layer
            Y.setdefault(l, []).append((h * m).sum(1) / m.sum(1))
    X = {l: torch.cat(v).float() for l, v in X.items()}
    Y = {l: torch.cat(v).float() for l, v in Y.items()}
    pairs = [(a, b) for a in X for b in Y]
    some = pairs[:max(1, round(len(pairs) * pairs_share))]
    t0 = time.perf_counter()
    for a, b in some:
        similarity.mutual_knn(X[a], Y[b], k)
    scoring = (time.perf_counter() - t0) * len(pairs) / len(some)
    return X, Y, scoring, scoring * (1 - len(some) / len(pairs))             # all pairs; the share not timed


def bench_layers(z, work, device, repeats, sync):
    n = z["pairs"]
    paths = jpegs(work / "layer_jpegs", min(n, 64), seed=1)
    images = data.LazyImages([paths[i % len(paths)] for i in range(n)])
    captions = shapes.text_corpus(n, seed=5)[:n]
    vocab = se.SPECIALS + sorted({w for c in captions for w in se.WordTokenizer.split(c)})
    torch.manual_seed(0)
    txt = se.ShapesTextEncoder(se.TinyTextEncoder(len(vocab), D=z["t_dim"], n_layers=z["t_layers"],
                                                  n_heads=max(1, z["t_dim"] // 64)).to(device).eval(),
                               se.WordTokenizer(vocab))
    img = dinov2(z, device)
    pairs = data.PairSet(images, captions, torch.arange(n))
    k = math.ceil(2 * n ** (1 / 3))
    share = 1.0 if n <= 1000 else 24 / (img.n_layers * txt.n_layers)
    t0 = time.perf_counter()
    X, Y, naive_scoring, extra = naive_select(img, txt, images, captions, k, device, share)
    sync()
    naive = time.perf_counter() - t0 + extra
    X, Y = {a: v.to(device) for a, v in X.items()}, {b: v.to(device) for b, v in Y.items()}
    scoring, _ = timed(lambda: similarity.mutual_knn_table(X, Y, k), repeats, sync)
    quiet = lambda s: None
    now_t, now_min = timed(lambda: layers.select_layers(img, txt, pairs, "mknn", n=n, device=device, log=quiet,
                                                          cache_dir=work / "layers_now"), 1, sync)
    again, _ = timed(lambda: layers.select_layers(img, txt, pairs, "mknn", n=n, device=device, log=quiet,
                                                    cache_dir=work / "layers_now"), repeats, sync)
    L = img.n_layers * txt.n_layers
    print(f"(c) layer selection, mknn on {n} pairs (k = {k}): {img.n_layers} image x {txt.n_layers} text layers "
          f"= {L} pairs, on {device}"
          + ("" if share == 1 else f" (naive: {round(share * L)} pairs timed, scaled to {L})"))
    print(f"    layer selection s        {now_t:10.2f}  [{now_min:.2f}]   ratio naive / this {naive / now_t:.1f} "
          f"(expected >= 10)")
    print(f"    naive layer selection s  {naive:10.2f}")
    print(f"    scoring alone s          {scoring:10.3f}   naive {naive_scoring:.3f} s, "
          f"ratio {naive_scoring / scoring:.1f} "
          f"(the kNN part: each layer's sets once; the rest is the encoders' forwards)")
    print(f"    rerun (cached) s         {again:10.3f}")
    return {"select_s": {"value": now_t, "ratio": naive / now_t}, "naive_s": {"value": naive, "ratio": 1.0},
            "rerun_s": {"value": max(again, 1e-6), "ratio": naive / max(again, 1e-6)},
            "scoring_s": {"value": scoring, "ratio": naive_scoring / scoring}}


def matmul_rate(device, sync, n=1024):
    """Measured fp32 matmul multiply-adds per second on device."""
    a = torch.randn(n, n, device=device)
    a @ a
    t, _ = timed(lambda: [a @ a for _ in range(4)], 3, sync)
    return 4 * n ** 3 / t


def bench_evaluation(z, device, repeats, sync):
    import methods
    g = torch.Generator().manual_seed(0)
    I, T, D, Ti = z["n_img"], z["n_txt"], z["ev_D"], z["ev_T"]
    H = math.isqrt(Ti - 1)
    img = Features(tokens=torch.randn(I, Ti, D, generator=g).half(), mask=torch.ones(I, Ti, dtype=torch.bool),
                   pooled=torch.randn(I, D, generator=g).half(), grid=(H, H))
    lengths = torch.randint(6, 31, (T,), generator=g)                        # caption words, COCO-like spread
    lengths[0] = 40                                                          # one long caption
    L = int(lengths.max())
    mask = torch.arange(L)[None] < lengths[:, None]
    txt = Features(tokens=(torch.randn(T, L, D, generator=g) * mask[..., None]).half(), mask=mask,
                   pooled=torch.randn(T, D, generator=g).half())
    rate = matmul_rate(device, sync)
    out = {}
    print(f"(d) evaluation: {I} images ({Ti - 1} patches) x {T} captions ({int(lengths.min())}-{L} words, mean "
          f"{lengths.float().mean():.1f}), D {D}, K {z['K']}, on {device}; matmul rate {rate / 1e9:.0f} GMAC/s")
    for name in ("filip", "cov", "text_guided"):
        torch.manual_seed(0)
        m = methods.METHODS[name](D, D, **({"dim": z["K"]} if name == "cov" else {"K": z["K"]})).to(device).eval()

        def run():
            with evaluate.inference(m):  # noqa: B023 (called in this iteration)
                a = evaluate.embed(m.embed_image, img, device=device)  # noqa: B023 (called in this iteration)
                b = evaluate.embed(m.embed_text, txt, device=device)  # noqa: B023 (called in this iteration)
                evaluate.score_matrix(m, a, b, device=device)  # noqa: B023 (called in this iteration)
        with evaluate.inference(m):
            e = evaluate.embed(m.embed_image, img[:2], device=device)
        N, K = e.shape[1], e.shape[2]                                        # patches or regions per image, dim
        macs = I * int(lengths.sum()) * N * K + (I * int(lengths.sum()) * N * N if name == "text_guided" else 0)
        t, t_min = timed(run, repeats, sync)
        bound = macs / rate
        print(f"    evaluation {name:12s} s {t:9.2f}  [{t_min:.2f}]   bound {bound:.2f} s, ratio bound / measured "
              f"{bound / t:.2f}")
        out[f"{name}_s"] = {"value": t, "ratio": bound / t}
    return out


H100_FP32 = 67e12   # FLOP/s: an H100 SXM's dense fp32 peak (the methods train in fp32): the strictest bound


def step_flops(name, B, T_img, T_txt, D):
    """FLOPs of one training step of method name at batch B: benchmarks/bench_steps.py's count of its matrix
    products (forward, and the backward of what is trained; the formulas tests/test_docs.py checks)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_steps
    H = math.isqrt(T_img - 1)
    return bench_steps.flops(name, B=B, H=H, W=H, L=T_txt, D_v=D, D_l=D, n_fit=4 * 256)[0]


def count_ops(fn):
    """The aten ops fn() dispatches (each a kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    n = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            n[0] += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return n[0]


def bench_steps(z, work, repeats):
    """(e) host work per training step at COCO shapes, against the step's FLOPs at an H100's fp32 rate."""
    import methods
    B_of, D, T_img, T_txt = {"cov": z["cov_batch"], "pal": z["pal_batch"]}, z["step_D"], z["step_T"], z["step_L"]
    row_mb = T_img * D * 2 / 2**20
    print(f"(e) a training step at {T_img} image tokens x {T_txt} words x D {D} (COCO at DINOv2-L / RoBERTa-L: "
          f"257 x ~15-32 x 1024); GPU time = FLOPs at {H100_FP32 / 1e12:.0f} TFLOP/s (H100 fp32 peak)")
    # the streamed path's host work: a batch's rows read from memory-mapped shards into one buffer
    n = 2 * max(B_of.values())
    old = shards.MEMMAP_BYTES, shards.SHARD_BYTES
    shards.MEMMAP_BYTES, shards.SHARD_BYTES = 0, 64 * 2**20
    try:
        f = cache.extract(RowEncoder(T_img, D), list(range(n)), work / "steps", batch_size=64, dataset="bench",
                          split="steps", modality="image")
    finally:
        shards.MEMMAP_BYTES, shards.SHARD_BYTES = old
    views = [flat.reshape(-1, T_img, D) for flat in f.tokens_files]
    starts = f.starts.numpy()
    one = torch.zeros(1)
    per_op, _ = timed(lambda: [torch.add(one, one) for _ in range(2000)], repeats, lambda: None)
    per_op /= 2000                                                           # one small op issued from Python
    print(f"    issuing one op from Python: {per_op * 1e6:.1f} us on this CPU (a CUDA launch adds ~3-5 us)")
    out = {}
    for name, B in B_of.items():
        g = torch.Generator().manual_seed(0)
        idx = torch.randperm(n, generator=g)[:B]
        buffer = np.empty((B, T_img, D), dtype=np.float16)

        def numpy_read(idx=idx, buffer=buffer):                  # the bound: one fancy-index copy per shard
            rows = np.sort(idx.numpy())
            s = np.searchsorted(starts, rows, side="right") - 1
            at = 0
            for k in np.unique(s):
                local = rows[s == k] - starts[k]
                np.take(views[k], local, axis=0, out=buffer[at:at + len(local)])
                at += len(local)
        numpy_read()                                             # the pages in the page cache
        read_t, _ = timed(lambda: f.rows(idx), repeats, lambda: None)     # noqa: B023 (called in this iteration)
        np_t, _ = timed(numpy_read, repeats, lambda: None)
        # the step's own host work: its ops (counted at tiny shapes: the same ops) x this CPU's cost to issue one
        torch.manual_seed(0)
        m = methods.METHODS[name](16, 16)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        img, txt = Features(torch.randn(B, 17, 16), torch.ones(B, 17, dtype=torch.bool), torch.randn(B, 16),
                            (4, 4)), Features(torch.randn(B, 8, 16), torch.ones(B, 8, dtype=torch.bool),
                                              torch.randn(B, 16))

        def step():
            loss, _ = m.loss(img, txt)                           # noqa: B023 (called in this iteration)
            opt.zero_grad()                                      # noqa: B023
            loss.backward()
            opt.step()                                           # noqa: B023
        step()
        ops = count_ops(step)
        host_t = ops * per_op                                    # seconds the host spends issuing the step's ops
        flops = step_flops(name, B, T_img, T_txt, D)
        gpu_ms = flops / H100_FP32 * 1e3
        mb = B * row_mb
        print(f"    {name} batch {B}: {flops / 1e9:7.1f} GFLOP a step = {gpu_ms:6.2f} ms on an H100")
        print(f"      device-resident: host ms per step {host_t * 1e3:7.2f} ({ops} ops issued; no read, no copy, "
              f"0 syncs: tests/test_feed.py)")
        print(f"      streamed:        host ms per step {read_t * 1e3:7.2f} one thread ({mb:.0f} MB of image rows "
              f"into one buffer), {read_t * 1e3 / features.READ_WORKERS:.2f} over {features.READ_WORKERS} reader "
              f"threads; numpy fancy-index {np_t * 1e3:.2f} ms, ratio {np_t / read_t:.2f}")
        out[f"{name}_gflop"] = {"value": flops / 1e9, "ratio": 1.0}
        out[f"{name}_resident_host_ms"] = {"value": host_t * 1e3, "ratio": gpu_ms / (host_t * 1e3)}
        out[f"{name}_streamed_host_ms"] = {"value": read_t * 1e3, "ratio": np_t / read_t}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--coco-size", action="store_true", help="COCO sizes (for a GPU: DINOv2-L shapes, 5K pairs)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: seconds, for the test")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3, --tiny 1)")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed after)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--only", default="abcde", help="sections to run, e.g. ab")
    args = p.parse_args(argv)
    z = SIZES["coco" if args.coco_size else "tiny" if args.tiny else "cpu"]
    repeats = args.repeats or (1 if args.tiny else 3)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_pipeline_"))
    print(f"[bench] device {args.device} ({torch.cuda.get_device_name() if cuda else f'{os.cpu_count()} cores'}), "
          f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}, repeats {repeats}, "
          f"sizes {'coco' if args.coco_size else 'tiny' if args.tiny else 'cpu'}")
    figures = {}
    try:
        if "a" in args.only:
            figures["reader"] = bench_reader(z, work, args.device, repeats, sync)
        if "b" in args.only:
            figures["extraction"] = bench_extraction(z, work, args.device, repeats, sync)
        if "c" in args.only:
            figures["layers"] = bench_layers(z, work, args.device, repeats, sync)
        if "d" in args.only:
            figures["evaluation"] = bench_evaluation(z, args.device, repeats, sync)
        if "e" in args.only:
            figures["steps"] = bench_steps(z, work, repeats)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
