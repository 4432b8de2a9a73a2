"""The image index's speed-up and the commands' pipeline against the image encoder's own rate.

    python benchmarks/bench_index.py --cache-dir .cache                  # 600 Shapes PNGs, 1 thread, batch 32
    python benchmarks/bench_index.py --run results/pal-shapes-seed0 --images 2000 --threads 2
    python benchmarks/bench_index.py --image-encoder efficientnet-lite2 --text-encoder minilm --size 224 --format jpg

A folder of --images Shapes images saved as PNG files (in 6 subfolders; --size S: resized to S x S, --format jpg:
JPEG files), and a finished run (--run; else a quick default run made here: PAL, 1 epoch, 512 pairs; with
--image-encoder / --text-encoder: a run folder written here by hand, linear heads at their seeded init on
those encoders, as speed does not depend on the weights). Each call runs in its own fresh process, as a user's
would; its time is measured inside the process from just before aligned.main (loading the run and its
encoders, walking the folder, encoding or reading the index, scoring, printing) to its end ("call"), and
also as the process's whole wall time (Python and torch's import included: "process"):
  1. classify, no index (the first call);  2. index;  3. classify, indexed (the second call);
  4. search for three queries, indexed.
The bound: the encoder's own decode + forward rate, in one thread after another at the same batch and
threads (no pipeline: each batch decoded, then its forward), over the same files.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSES = "red circle,blue square,green triangle,yellow cross"
QUERIES = ["a red circle", "a blue square left of a green triangle", "a yellow cross"]

CHILD = """
import sys, time, json
t0 = time.perf_counter()
import aligned
argv = json.loads(sys.argv[1])
t1 = time.perf_counter()
aligned.main(argv)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "call": t2 - t1}), file=sys.stderr)
"""

BOUND = """
import sys, time, json, torch
import aligned
run, folder, batch, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
files = aligned.image_files([folder])
model = aligned.load(run)
model.forward(model.prepared(files[:2]))                                  # warm-up
t0 = time.perf_counter()
for i in range(0, len(files), batch):                                     # decode, then forward: one thread
    model.forward(model.prepared(files[i:i + batch]))
print(json.dumps({"rate": len(files) / (time.perf_counter() - t0)}), file=sys.stderr)
"""


def timed(argv, env):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argv)], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{argv[0]} failed:\n{r.stderr[-3000:]}")
    return {**json.loads(r.stderr.strip().splitlines()[-1]), "process": wall}


def make_images(folder, n, cache_dir, size=None, suffix="png"):
    """n Shapes images (test, cls, then train) as files in folder/d0 .. d5 (size: resized to size x size)."""
    import torch
    from PIL import Image

    import shapes
    w = shapes.cached_world(cache_dir)
    images = torch.cat([w[k].images for k in ("test", "cls", "train")])[:n]
    for i, x in enumerate(images):
        sub = Path(folder) / f"d{i * 6 // n}"
        sub.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(x.permute(1, 2, 0).numpy())
        image = image.resize((size, size), Image.BICUBIC) if size else image
        image.save(sub / f"{i:05d}.{suffix}", quality=90) if suffix == "jpg" else image.save(sub / f"{i:05d}.png")


def run_by_hand(run, image_name, text_name, cache_dir):
    """A finished run folder of linear heads at their seeded init on the named encoders (config.json's "model",
    model.safetensors, a metrics.json), as align.py writes one."""
    import torch

    import encoders
    from infra import folder
    from methods import METHODS
    image_enc, text_enc = encoders.load_encoders(image_name, text_name, cache_dir)
    torch.manual_seed(0)
    method = METHODS["linear"](image_enc.dim, text_enc.dim)
    run.mkdir(parents=True)
    folder.save_weights(method, run / "model.safetensors")
    model = dict(method="linear", hp={}, dims=[image_enc.dim, text_enc.dim], image_encoder=image_name,
                 text_encoder=text_name, image_layer=-1, text_layer=-1, cache_dir=str(Path(cache_dir).resolve()),
                 templates=["a photo of a {}."])
    (run / "config.json").write_text(json.dumps({"identity": {"method": "linear"}, "model": model}))
    (run / "metrics.json").write_text("{}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default=None, help="a finished run folder (default: a quick default run made here)")
    p.add_argument("--images", type=int, default=600, help="images in the folder (default: 600)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every call (default: 1)")
    p.add_argument("--batch-size", type=int, default=32, help="images per forward (default: 32)")
    p.add_argument("--cache-dir", default=".cache", help="the feature / encoder cache (default: .cache)")
    p.add_argument("--image-encoder", default=None, help="a run by hand on this image encoder (default: none)")
    p.add_argument("--text-encoder", default="shapes-text", help="... and this text encoder (default: shapes-text)")
    p.add_argument("--size", type=int, default=None, help="images resized to S x S (default: 64, as made)")
    p.add_argument("--format", default="png", choices=["png", "jpg"], help="image files (default: png)")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        run = Path(a.run) if a.run else work / "run"
        if a.image_encoder and not a.run:
            run_by_hand(run, a.image_encoder, a.text_encoder, a.cache_dir)
        elif not a.run:
            subprocess.run([sys.executable, "align.py", "--epochs", "1", "--num-pairs", "512", "--eval-images", "20",
                            "--no-figures", "--threads", "1", "--quiet", "--cache-dir", a.cache_dir, "--out",
                            str(run)], cwd=ROOT, env=env, check=True, capture_output=True)
        images, index = work / "images", work / "index"
        make_images(images, a.images, a.cache_dir, a.size, a.format)
        common = ["--threads", str(a.threads), "--batch-size", str(a.batch_size), "--index", str(index)]
        out = lambda name: ["--json", str(work / f"{name}.json")]
        first = timed(["classify", str(run), str(images), "--classes", CLASSES, "--top", "2", *common,
                       *out("first")], env)
        build = timed(["index", str(run), str(images), *common], env)
        second = timed(["classify", str(run), str(images), "--classes", CLASSES, "--top", "2", *common,
                        *out("second")], env)
        search = timed(["search", str(run), str(images), *QUERIES, "--top", "5", *common, *out("search")], env)
        same = json.loads((work / "first.json").read_text()) == json.loads((work / "second.json").read_text())
        r = subprocess.run([sys.executable, "-c", BOUND, str(run), str(images), str(a.batch_size), str(a.threads)],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        bound = json.loads(r.stderr.strip().splitlines()[-1])["rate"]
    n = a.images
    print(f"{n} images, batch {a.batch_size}, {a.threads} thread(s), run {run.name}")
    print(f"{'call':<32} {'call s':>7} {'process s':>10} {'images/s':>9}")
    for name, t in (("1. classify, no index (first)", first), ("2. index", build),
                    ("3. classify, indexed (second)", second), ("4. search 3 queries, indexed", search)):
        print(f"{name:<32} {t['call']:>7.2f} {t['process']:>10.2f} {n / t['call']:>9.1f}")
    print(f"second / first: {second['call'] / first['call']:.3f} (call), {second['process'] / first['process']:.3f} "
          f"(process); search / first: {search['call'] / first['call']:.3f} (call)")
    print(f"encoder's own decode + forward: {bound:.1f} images/s; first classify call {n / first['call']:.1f} "
          f"images/s = {n / first['call'] / bound:.2f} of it (loading the encoders and prompts included)")
    print(f"indexed classify gives the same records as the first: {same}")


if __name__ == "__main__":
    main()
