"""python align.py with its feature sets written as memory-mapped shards and read back streamed: for the
checks and tests that need the large-set path at a small size (gpu_check.py's shards step, the fault and
torchrun tests).

    python benchmarks/align_sharded.py --memmap-bytes 0 --shard-bytes 1 [--stream] -- <align.py arguments>

--memmap-bytes / --shard-bytes set infra/shards.py's MEMMAP_BYTES (a larger token set goes to shards) and
SHARD_BYTES (tokens per shard, whole batches, at least one); --stream sets features.py's RESIDENT_SHARE
to 0, so training streams its batches from the shards even where they fit on the GPU. Works under torchrun.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--memmap-bytes", type=float, required=True)
    p.add_argument("--shard-bytes", type=float, required=True)
    p.add_argument("--stream", action="store_true", help="train from the shards, never from the GPU's memory")
    args, rest = p.parse_known_args()
    import features
    from infra import shards
    shards.MEMMAP_BYTES, shards.SHARD_BYTES = int(args.memmap_bytes), int(args.shard_bytes)
    if args.stream:
        features.RESIDENT_SHARE = 0.0
    import align
    sys.argv = [str(Path(align.__file__)), *[a for a in rest if a != "--"]]
    align.cli()


if __name__ == "__main__":
    main()
