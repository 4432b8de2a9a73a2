"""torchrun and infra/distributed.py on the CPU: 2 gloo ranks of 1 thread each against one process.

The reference is always the single-process code path on the same inputs: its loss and
gradients (the gather-with-grad step), its trained parameters and metrics (align.py), its
cache files byte for byte (sharded extraction). Tolerance of the training comparisons: the
ranks add the gradient's parts in another order than one process, so parameters agree to
1e-4 absolute after an epoch (measured: PAL 9e-6, CSA exactly), and the metrics
to 1e-6 (measured: identical).
"""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_features

import aligned
import encoders
from infra import distributed
from methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def env(**kw):
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **kw)


@pytest.fixture(scope="module")
def cache(cache_dir):
    encoders.load_encoders("shapes-cnn", "shapes-text", cache_dir)      # pretrained once per session
    return cache_dir


def fresh_cache(folder, shared):
    """A cache holding only the two pretrained tiny encoders: features are extracted anew."""
    (folder / "encoders").mkdir(parents=True)
    for f in (shared / "encoders").glob("shapes-*-seed0.pt"):
        (folder / "encoders" / f.name).write_bytes(f.read_bytes())
    return folder


# ----------------------------------------------------------------------------- the global loss of split batches
B = 8
LENGTHS = [1, 2, 3, 2, 6, 4, 5, 3]           # rank 0's rows have 3 words at most, rank 1's 6: padding differs
SPLIT = [n for n, cls in METHODS.items() if cls.split_loss]   # split_loss = True
HP = dict(pal=dict(K=8), pal_rel=dict(K=8), fa=dict(dropout=0.0), mlp=dict(dropout=0.0))


def case(name):
    torch.manual_seed(0)
    method = METHODS[name](16, 12, **HP.get(name, {}))
    img = random_features(B, 5, 16, grid=(2, 2), seed=1)                  # global token + 2x2 patches
    txt = random_features(B, 6, 12, lengths=LENGTHS, seed=2)
    return method, img, txt


def rank_step(r, port, out):
    """One rank: the split step (distributed.Training) on its rows of the batch, for every split method."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                      TORCHELASTIC_RUN_ID="test")                       # as torchrun starts a rank
    torch.set_num_threads(1)
    distributed.setup("cpu")
    results = {}
    for name in SPLIT:
        method, img, txt = case(name)
        dd = distributed.Training(method, B)
        rows = dd.rows(torch.arange(B))
        with torch.no_grad():
            local = method.loss(img[rows], txt[rows])[0].item()           # what a rank would see without the gather
        loss, _ = dd.loss(img[rows], txt[rows])
        loss.backward()
        results[name] = dict(loss=loss.item(), local=local, rows=rows,
                             grads={n: p.grad for n, p in method.named_parameters() if p.grad is not None})
    torch.save(results, out / f"rank{r}.pt")
    distributed.finish()


def test_split_step_gives_the_single_process_loss_and_gradients(tmp_path):
    """The gather-with-grad step (distributed.Training: embeddings gathered, DDP summing the gradients),
    run by 2 gloo processes on halves of a batch whose captions differ in length across the halves,
    gives every rank the single-process loss on the whole batch and its gradient, for every method in
    SPLIT (split_loss = True); the loss of a half alone differs (what the gather is for)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_step, args=(port, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert set(SPLIT) == {"pal", "pal_rel", "linear", "filip", "text_guided", "fa", "sail", "mlp"}
    assert torch.equal(torch.cat([ranks[0]["pal"]["rows"], ranks[1]["pal"]["rows"]]), torch.arange(B))
    for name in SPLIT:
        method, img, txt = case(name)
        loss, _ = method.loss(img, txt)
        loss.backward()
        for got in (ranks[0][name], ranks[1][name]):
            assert got["loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-7), name
            assert abs(got["local"] - loss.item()) > 1e-4, name
            grads = {n: p.grad for n, p in method.named_parameters() if p.grad is not None}
            assert grads.keys() == got["grads"].keys(), name
            for n, g in grads.items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-7, msg=f"{name} {n}")


def test_methods_that_cannot_be_split_train_on_rank_0_alone():
    """split_blocker: the loss reads more than the embeddings, dropout, a pending init, hard negatives."""
    why = lambda name, hn=False, **hp: distributed.split_blocker(METHODS[name](16, 12, **hp), hn)
    assert why("pal") is None and why("linear") is None and why("mlp", dropout=0.0) is None
    assert "embeddings" in why("cov") and "embeddings" in why("linear_rs") and "embeddings" in why("t2c")
    assert "dropout" in why("mlp") and "dropout" in why("fa")
    assert "hard-negatives" in why("pal", True)


# ----------------------------------------------------------------------------- align.py: 2 ranks == 1 process
DRIVER = """
import functools, sys
sys.path.insert(0, sys.argv[1])
import align, shapes
shapes.shapes_world = functools.cache(shapes.shapes_world)   # the Shapes world made once
for method, hp in (("pal", ["--hp", "K=64"]), ("csa", [])):
    align.main(["--method", method, "--out", sys.argv[2] + "/" + method, *hp, *sys.argv[3:]])
"""
RUN = ("--epochs", "1", "--eval-images", "20", "--threads", "1", "--no-figures", "--keep-checkpoint")  # --resume


def flat(d, prefix=""):
    for k, v in d.items():
        yield from flat(v, f"{prefix}{k}/") if isinstance(v, dict) else [(prefix + k, v)]


@pytest.mark.slow
def test_torchrun_two_ranks_match_one_process_for_pal_and_csa(cache, tmp_path):
    """torchrun with 2 ranks (gloo) == one process: PAL splits every global batch of 256 into 2 x 128
    (DDP; every split_loss method takes this path: test_split_step_gives_the_single_process_loss_and_gradients),
    CSA fits on rank 0 once the group has ended. Same metrics (1e-6) and trained parameters (1e-4);
    rank 0 alone writes and prints (one [config] line); --resume under torchrun continues a run stopped after its
    last checkpoint."""
    (tmp_path / "driver.py").write_text(DRIVER)
    r = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(ROOT), str(tmp_path / "one"),
                        "--cache-dir", str(cache), *RUN], env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for method, hp in (("pal", ["--hp", "K=64"]), ("csa", [])):
        out = tmp_path / "two" / method
        r = subprocess.run([*TORCHRUN, str(ROOT / "align.py"), "--method", method, "--out", str(out), *hp,
                            "--cache-dir", str(cache), *RUN], env=env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert r.stdout.count("[config]") == 1 and "[distributed] 2 ranks (gloo)" in r.stdout
        if method != "csa":
            assert "each of 2 ranks takes 128 rows of every global batch of 256" in r.stdout
        one, two = (json.loads((p / "metrics.json").read_text()) for p in (tmp_path / "one" / method, out))
        one, two = dict(flat(one)), dict(flat(two))
        assert one.keys() == two.keys()
        for k in one:
            if k == "train/history":              # per-epoch rows: their seconds are wall time
                strip = lambda rows: [{c: v for c, v in r.items() if c != "seconds"} for r in rows]
                for a, b in zip(strip(one[k]), strip(two[k]), strict=True):
                    assert b == pytest.approx(a, abs=1e-6), (method, k)
            elif k != "train/seconds":
                assert two[k] == pytest.approx(one[k], abs=1e-6), (method, k)
        p1, p2 = (aligned.read_weights(p) for p in (tmp_path / "one" / method, out))
        for k in p1:
            torch.testing.assert_close(p2[k].float(), p1[k].float(), rtol=0, atol=1e-4, msg=f"{method} {k}")
    (tmp_path / "two" / "pal" / "metrics.json").unlink()          # unfinished: stopped before the evaluation
    r = subprocess.run([*TORCHRUN, str(ROOT / "align.py"), "--method", "pal", "--out", str(tmp_path / "two" / "pal"),
                        "--hp", "K=64", "--cache-dir", str(cache), *RUN, "--resume"], env=env(), capture_output=True,
                       text=True, timeout=600)                  # --resume: every rank loads rank 0's checkpoint
    assert r.returncode == 0 and "resumed from" in r.stdout and "after epoch 1" in r.stdout, r.stderr[-3000:]
    final = lambda run: json.loads((tmp_path / run / "pal" / "metrics.json").read_text())["train"]["final_loss"]
    assert final("two") == pytest.approx(final("one"), abs=1e-6)    # the checkpoint's, no epoch run again


# ----------------------------------------------------------------------------- sharded extraction
EXTRACT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
import encoders, shapes
from infra import cache, distributed, shards
shards.MEMMAP_BYTES, shards.SHARD_BYTES = 0, 104                     # every set sharded, one batch of 8 per shard
distributed.setup("cpu")
kill_after = int(os.environ.get("KILL_RANK1_AFTER", "0"))            # rank 1 dies after writing this many shards
if kill_after and distributed.RANK == 1:
    said, n = distributed.say, [0]
    def say(msg):
        said(msg)
        n[0] += 1
        if n[0] == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    distributed.say = say
image, text = encoders.load_encoders("shapes-cnn", "shapes-text", sys.argv[2])
test = shapes.shapes_world(n_train=16, n_test=96, n_cls=8, n_seg=8, n_bind=8)["test"]
for enc, inputs, modality in ((image, test.images, "image"), (text, test.captions, "text")):
    f = cache.extract(enc, inputs, sys.argv[2], batch_size=8, dataset="t", split="test", modality=modality)
    assert isinstance(f, shards.StoredFeatures) and len(f) == len(inputs)
distributed.finish()
"""
def extraction(cache, script, ranks, **kw):
    cmd = (TORCHRUN if ranks == 2 else [sys.executable]) + [str(script), str(ROOT), str(cache)]
    return subprocess.run(cmd, env=env(**kw), capture_output=True, text=True, timeout=600)


def files(cache):
    """Every cache file's content: the bytes, except for a shard's metadata (.pt next to its
    .tokens.npy), whose record of its tokens file holds the file's modification time."""
    def content(p):
        if p.suffix == ".pt" and p.with_name(p.stem + ".tokens.npy").exists():
            meta = torch.load(p, weights_only=True)
            meta.pop("checksum", None)
            meta["tokens_file"].pop("mtime_ns")
            return repr({k: v.tolist() if torch.is_tensor(v) else v for k, v in sorted(meta.items())})
        return p.read_bytes()
    return {str(p.relative_to(cache)): content(p) for p in sorted((cache / "features").rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def one_rank_shards(cache, tmp_path_factory):
    """The cache files of one process extracting 96 images (12 shards) and 480 captions (60 shards)."""
    root = tmp_path_factory.mktemp("one_rank")
    (root / "extract.py").write_text(EXTRACT)
    c = fresh_cache(root / "cache", cache)
    r = extraction(c, root / "extract.py", 1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return files(c)


@pytest.mark.slow
def test_two_ranks_write_byte_identical_shards(cache, one_rank_shards, tmp_path):
    """Sharded extraction by 2 ranks (rank r writes shards r, r + 2, ...) == 1 rank, byte for byte."""
    (tmp_path / "extract.py").write_text(EXTRACT)
    c = fresh_cache(tmp_path / "cache", cache)
    r = extraction(c, tmp_path / "extract.py", 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "[rank 1] [features]" in r.stdout and "[rank 0] [features]" in r.stdout   # shard lines say their rank
    got = files(c)
    assert len([k for k in got if k.endswith(".tokens.npy")]) == 12 + 60
    assert got.keys() == one_rank_shards.keys()
    assert all(got[k] == one_rank_shards[k] for k in got)


@pytest.mark.slow
def test_a_rank_killed_mid_extraction_then_a_rerun_resumes_to_the_same_shards(cache, one_rank_shards, tmp_path):
    """Rank 1 SIGKILLed after its 2nd shard (torchrun then stops rank 0): the rerun keeps every finished
    shard (not rewritten), writes the rest, and the cache is byte-identical to one process's, no half file."""
    (tmp_path / "extract.py").write_text(EXTRACT)
    c = fresh_cache(tmp_path / "cache", cache)
    r = extraction(c, tmp_path / "extract.py", 2, KILL_RANK1_AFTER="2")
    assert r.returncode != 0
    done = {p: p.stat().st_mtime_ns for p in (c / "features").glob("*/0*.pt")}     # finished shards
    assert 2 <= len(done) < 12 + 60
    r = extraction(c, tmp_path / "extract.py", 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())                  # resumed, not redone
    kept = [int(n) for n in re.findall(r"(\d+) of \d+ shards kept from before", r.stdout)]    # said per rank
    assert r.stdout.count("[features]") - len(kept) == 12 + 60 - len(done) and sum(kept) == len(done)
    got = files(c)
    assert got.keys() == one_rank_shards.keys() and all(got[k] == one_rank_shards[k] for k in got)


def rank_alone(r, port, out):
    """One rank of 2 with a collective timeout of 2 s: a method that trains on rank 0 alone, for longer."""
    import time
    from datetime import timedelta
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                      TORCHELASTIC_RUN_ID="test")                       # as torchrun starts a rank
    torch.set_num_threads(1)
    distributed.TIMEOUT = timedelta(seconds=2)
    distributed.setup("cpu")
    dd = distributed.Training(METHODS["cov"](16, 12), B)            # CoV: its loss reads regions(), not split
    if dd.active:
        time.sleep(5)                                                # rank 0's lone fit, past the timeout
    (out / f"rank{r}.json").write_text(json.dumps(dict(active=dd.active, goes_on=distributed.finish(),
                                                       world=distributed.WORLD)))


@pytest.mark.slow
def test_a_lone_fit_on_rank_0_outlasts_the_collective_timeout(tmp_path):
    """Rank 0 training alone (CoV, CSA under torchrun) leaves the group first: the other ranks wait in
    no collective, so a fit longer than TIMEOUT ends normally, and only rank 0 goes on to evaluate."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_alone, args=(port, tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks == [dict(active=True, goes_on=True, world=1), dict(active=False, goes_on=False, world=1)]
