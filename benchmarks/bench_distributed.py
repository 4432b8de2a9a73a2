"""Sharded extraction time on 1 vs N ranks: the Shapes world's training images and captions
(6000 + 6000 rows), every set sharded (docs/scaling.md).

    python benchmarks/bench_distributed.py --cache-dir /tmp/bench-cache                  # 1 rank
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_distributed.py --cache-dir /tmp/bench-cache2

The cache folder must hold the pretrained tiny encoders and no features (a fresh copy of a
cache's encoders/ folder); the timer starts after the Shapes world is generated, at a barrier.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import encoders  # noqa: E402
import shapes
from infra import (
    cache,  # noqa: E402
    distributed,  # noqa: E402
    shards,  # noqa: E402
)

shards.MEMMAP_BYTES, shards.SHARD_BYTES = 0, 4 * 2**20     # every set sharded, into 256-row shards (24 per 6000 images)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", required=True, help="a cache holding only the pretrained encoders")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    distributed.setup("cpu")
    image, text = encoders.load_encoders("shapes-cnn", "shapes-text", args.cache_dir)
    train = shapes.shapes_world()["train"]
    distributed.barrier()
    t0 = time.time()
    for enc, inputs, modality in ((image, train.images, "image"), (text, train.captions, "text")):
        cache.extract(enc, inputs, args.cache_dir, dataset="shapes", split="train", modality=modality)
    print(f"[bench] {distributed.WORLD} rank(s) x {args.threads} thread(s): 6000 images + 6000 captions "
          f"extracted in {time.time() - t0:.1f}s")
    distributed.finish()


if __name__ == "__main__":
    main()
