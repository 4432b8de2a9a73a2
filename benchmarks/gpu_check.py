"""The one prepared check for a GPU: the runs a CUDA machine must get through, in one table.

    python benchmarks/gpu_check.py                       # one GPU, at most ~10 minutes
    python benchmarks/gpu_check.py --device cpu --tiny   # the same steps at tiny sizes (tests/test_gpu_check.py)

Steps, each a subprocess of align.py (or a benchmark) with its own exit status and seconds:
1. default    `python align.py`: PAL on the Shapes world, figures on (the design card's first command);
2. cov        `--method cov --data coco` on a COCO-layout folder of random JPEGs (Karpathy split file),
              image encoder a randomly initialised DINOv2-L-shaped model (224 px, patch 14: 257 tokens
              x 1024), text encoder a RoBERTa-large-shaped model (1024 wide, COCO-length captions);
3. analyses   `--method pal --analyses` on the same folder with a BEiT-L-shaped classifier (197 tokens
              x 1024, a head with class names) and a EuroSAT-layout classification set;
4. resume     step 2 again with --resume, its metrics.json removed first (a run stopped before its evaluation):
              the checkpoint read back onto the device;
5. torchrun   2 processes (nccl on a GPU, gloo on a CPU): skipped, with its reason, on fewer than two
              GPUs (NCCL refuses two ranks on one GPU);
6. shards     step 2's PAL through benchmarks/align_sharded.py (SHARDED: sets above 0.25 GiB to 64 MiB
              shards; the train tokens are 0.54 GB; --stream: never resident on the GPU), so the features
              take COCO's streamed path: the shard writer on the device, training from memory-mapped
              shards through the reader threads, pinned buffers and the side-stream copy;
              its own cache, and at least one shard on disk after it;
7. pipeline   benchmarks/bench_pipeline.py --device <device> --coco-size (COCO token counts; its --tiny
              on a CPU).

Random weights: the metrics mean nothing; what counts is that every step ends with exit status 0
and writes metrics.json. Prints one table; exits 1 when any step failed.
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
sys.path.insert(0, str(ROOT / "tests"))   # the tiny on-disk layouts the tests write (tests/test_real.py)


def write_world(root, tiny):
    """A COCO layout (Karpathy split) and a EuroSAT layout of random JPEGs under root."""
    from test_real import write_eurosat, write_karpathy
    n_train, n_test = (16, 6) if tiny else (1024, 200)
    write_karpathy(root / "coco", n_train=n_train, n_test=n_test)
    write_eurosat(root)
    return root


def write_models(root, tiny):
    """dinov2 (DINOv2-L shape), beit (BEiT-L classifier shape) and roberta (RoBERTa-large shape) folders."""
    import torch
    from test_real import WORDS
    from transformers import (
        AutoModel,
        BeitConfig,
        BeitForImageClassification,
        BitImageProcessor,
        Dinov2Config,
        RobertaConfig,
        RobertaTokenizer,
    )

    import model_files
    torch.manual_seed(0)
    large = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    width = small if tiny else large
    size = 32 if tiny else 224
    processor = BitImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                  image_mean=list(model_files.IMAGENET_MEAN), image_std=list(model_files.IMAGENET_STD))
    AutoModel.from_config(Dinov2Config(**width, image_size=size, patch_size=8 if tiny else 14)
                          ).save_pretrained(root / "dinov2")
    processor.save_pretrained(root / "dinov2")
    labels = {0: "AnnualCrop", 1: "Forest", 2: "SeaLake"}
    BeitForImageClassification(BeitConfig(**width, image_size=size, patch_size=8 if tiny else 16,
                                          use_mean_pooling=True, id2label=labels,
                                          label2id={v: k for k, v in labels.items()})).save_pretrained(root / "beit")
    processor.save_pretrained(root / "beit")
    chars = sorted(set("".join(WORDS) + ".,0123456789" + "traintestvalcaption"))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}
    for c in chars + ["Ġ" + c for c in chars] + ["Ġ"]:
        vocab.setdefault(c, len(vocab))
    AutoModel.from_config(RobertaConfig(**width, vocab_size=len(vocab), max_position_embeddings=130, pad_token_id=1)
                          ).save_pretrained(root / "roberta")
    RobertaTokenizer(vocab=vocab, merges=[("Ġ", c) for c in chars], model_max_length=128
                     ).save_pretrained(root / "roberta")
    return root


SHARDED = {False: ["--memmap-bytes", str(2**28), "--shard-bytes", str(64 * 2**20)],  # COCO-shaped: train to shards
           True: ["--memmap-bytes", "1", "--shard-bytes", "107"]}                     # tiny: every set, a batch a shard


def steps(args, work, world, models):
    """(name, command, what must exist afterwards, skip reason) for each step."""
    cache = args.cache_dir or str(work / "cache")
    py = [sys.executable, str(ROOT / "align.py"), "--device", args.device, "--cache-dir", cache]
    quick = ["--epochs", "1", "--eval-images", "32", "--threads", "1"] if args.tiny else []
    coco = ["--data", "coco", "--data-root", str(world), "--text-encoder", str(models / "roberta")]
    dino = ["--image-encoder", str(models / "dinov2")]
    epochs = ["--epochs", "1" if args.tiny else "2"]
    out = lambda name: ["--out", str(work / name)]
    import torch
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    why = None if args.device == "cpu" or gpus >= 2 else f"{gpus} GPU(s): NCCL takes one GPU per rank"
    bench = [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--device", args.device,
             *(["--tiny"] if args.tiny else ["--coco-size", "--repeats", "1"])]
    sharded = [sys.executable, str(ROOT / "benchmarks" / "align_sharded.py"), *SHARDED[bool(args.tiny)],
               "--stream", *py[2:-1], str(work / "cache-shards"), *coco, *dino, "--method", "pal", "--no-figures",
               *epochs, *quick[2:], *out("shards")]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "align.py"), "--device", args.device, "--cache-dir", cache, *coco, *dino,
           "--method", "pal", "--no-figures", *epochs, *quick[2:], *out("torchrun")]
    return [("default", [*py, *quick, *out("default")], work / "default" / "metrics.json", None),
            ("cov", [*py, *coco, *dino, "--method", "cov", *epochs, *quick[2:], "--keep-checkpoint", *out("cov")],
             work / "cov" / "metrics.json", None),
            ("analyses", [*py, *coco, "--image-encoder", str(models / "beit"), "--method", "pal", "--analyses",
                          *epochs, *quick[2:], *out("analyses")], work / "analyses" / "metrics.json", None),
            ("resume", [*py, *coco, *dino, "--method", "cov", *epochs, *quick[2:], "--resume", *out("cov")],
             work / "cov" / "metrics.json", None),
            ("torchrun", run, work / "torchrun" / "metrics.json", why),
            ("shards", sharded, work / "shards" / "metrics.json", None),
            ("pipeline", bench, None, None)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where align.py runs")
    p.add_argument("--tiny", action="store_true", help="tiny models and data (a CPU check of the steps)")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--cache-dir", default=None, help="align.py's --cache-dir (default: one under --work)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for all steps together")
    p.add_argument("--only", default=None, help="comma-separated step names to run (default: all)")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    t0 = time.time()
    world = write_world(work / "data", args.tiny)
    models = write_models(work / "models", args.tiny)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    rows, deadline = [], t0 + args.timeout
    for name, cmd, expect, skip in steps(args, work, world, models):
        if args.only and name not in args.only.split(","):
            continue
        if skip:
            rows.append((name, "skip", 0.0, skip))
            continue
        left = deadline - time.time()
        if left <= 0:
            rows.append((name, "FAIL", 0.0, "no time left"))
            continue
        t = time.time()
        if name == "resume":                                   # unfinished: a finished run is never resumed into
            (work / "cov" / "metrics.json").unlink(missing_ok=True)
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            ok = r.returncode == 0 and (expect is None or expect.exists())
            written = len(list((work / "cache-shards").rglob("*.tokens.npy"))) if name == "shards" else None
            ok = ok and written != 0                                    # the shards step: through shards
            tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] if not ok else []
            note = tail[0][:90] if tail else (metrics_note(expect) if expect else last_line(r.stdout))
            note = note if written is None else f"{note}; {written} shards" if written else "no shard written"
            if not ok:
                (work / f"{name}.log").write_text(r.stdout + "\n" + r.stderr)
                note = f"rc {r.returncode}: {note} ({work / name}.log)"
        except subprocess.TimeoutExpired:
            ok, note = False, "ran past --timeout"
        rows.append((name, "ok" if ok else "FAIL", time.time() - t, note))
    print(f"gpu_check on {device_name(args.device)} ({'tiny' if args.tiny else 'COCO-shaped'}), "
          f"{time.time() - t0:.0f} s in all")
    print(f"| {'step':<9} | {'result':<6} | {'seconds':>7} | note")
    print(f"|{'-' * 11}|{'-' * 8}|{'-' * 9}|------")
    for name, result, seconds, note in rows:
        print(f"| {name:<9} | {result:<6} | {seconds:7.1f} | {note}")
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


def metrics_note(path):
    m = json.loads(path.read_text())
    rsum = m.get("retrieval", {}).get("rsum")
    return f"rsum {rsum:.1f}, train {m['train']['seconds']:.1f} s" if rsum is not None else "metrics.json written"


def last_line(text):
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:90] if lines else ""


def device_name(device):
    import torch
    return torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else "the CPU"


if __name__ == "__main__":
    sys.exit(main())
