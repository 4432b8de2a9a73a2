"""Every row of README.md's "What happens when..." table: bad inputs, faults, planted files.

CLI rows run align.py as a subprocess with a short budget (--epochs <= 3, --eval-images 20);
they share the session's pretrained cache (conftest.cache_dir), so the tiny encoders are
pretrained at most once per pytest session. Rows that need features written anew copy only
the two encoder checkpoints into a fresh cache folder.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from conftest import interrupted, random_features, train_with

import align
import cnn_encoders
import encoders
import shapes
import shapes_encoders
from infra import cache, storage
from infra import run as runs
from methods.linear import Linear
from methods.mlp import MLP

ROOT = Path(__file__).resolve().parents[1]
RUN = ("--method", "linear", "--epochs", "3")          # every full run: 3 short epochs, 20 test images


def align_cmd(cache, out, *extra):
    return [sys.executable, str(ROOT / "align.py"), "--cache-dir", str(cache), "--out", str(out), "--threads", "1",
            "--no-figures", "--eval-images", "20", *extra]


def env(**kw):
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **kw)


def run(cache, out, *extra, **env_kw):
    return subprocess.run(align_cmd(cache, out, *extra), cwd=ROOT, env=env(**env_kw), capture_output=True,
                          text=True, timeout=900)


def metrics(out):
    m = json.loads((Path(out) / "metrics.json").read_text())
    m["train"].pop("seconds")
    return m


def fresh_cache(folder, shared):
    """A cache folder holding only the shared cache's two pretrained encoders: features are extracted anew."""
    (folder / "encoders").mkdir(parents=True)
    for f in (shared / "encoders").glob("shapes-*-seed0.pt"):
        shutil.copy(f, folder / "encoders" / f.name)
    return folder


class RunsCode:
    """Unpickling this object runs code: it creates the marker file (a planted malicious file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def one_line_error(r, *needles):
    """The run stopped with exit code 1 and one error on stderr holding every needle, no traceback."""
    err = r.stderr.strip()
    assert r.returncode == 1 and "Traceback" not in err and err.startswith("error: ") and err.count("error:") == 1, \
        r.stdout[-1500:] + r.stderr[-3000:]
    for n in needles:
        assert n in err, err


@pytest.fixture(scope="module")
def shared(cache_dir):
    return cache_dir


@pytest.fixture(scope="module")
def reference(shared, tmp_path_factory):
    """One uninterrupted run on the shared cache: what every interrupted or concurrent run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    r = run(shared, out, *RUN, "--keep-checkpoint")                   # its checkpoint: test 8 copies it
    assert r.returncode == 0, r.stderr[-3000:]
    return out, metrics(out)


# ----------------------------------------------------------------------------- 1. changed weights
def plant_tiny_encoders(folder, seed, vocab):
    """Random-init tiny encoders saved as the cache's pretrained checkpoints (as a re-pretraining would)."""
    torch.manual_seed(seed)
    image, text = shapes_encoders.TinyImageEncoder(len(shapes.CLASS_NAMES)), shapes_encoders.TinyTextEncoder(len(vocab))
    storage.atomic_save({"key": "shapes-cnn-1", "state": image.state_dict(), "acc": 0.0},   # seed 1: cached
                      folder / "encoders" / "shapes-cnn-seed1.pt")                      # (seed 0 ships)
    storage.atomic_save({"key": "shapes-text-1", "state": text.state_dict(), "vocab": vocab, "acc": 0.0},
                      folder / "encoders" / "shapes-text-seed1.pt")


def test_changed_tiny_encoder_weights_never_read_old_features(tmp_path):
    vocab = shapes_encoders.SPECIALS + ["a", "red", "blue", "circle", "square"]
    texts, images = ["a red circle", "a blue square"], torch.randint(0, 256, (3, 3, 64, 64), dtype=torch.uint8)
    got = []
    for seed in (0, 1):                                       # the same names, other weights
        plant_tiny_encoders(tmp_path, seed, vocab)
        img_enc, txt_enc = shapes_encoders.load_shapes_encoders(tmp_path, seed=1, log=lambda s: None)
        img = cache.extract(img_enc, images, tmp_path, dataset="t", split="s", modality="image")
        txt = cache.extract(txt_enc, texts, tmp_path, dataset="t", split="s", modality="text")
        assert torch.equal(img.tokens, img_enc.encode(images).tokens.half())   # this encoder's own features
        assert torch.equal(txt.tokens, txt_enc.encode(texts).tokens.half())
        got.append((img, txt, img_enc.fingerprint, txt_enc.fingerprint))
    assert not torch.equal(got[0][0].tokens, got[1][0].tokens) and not torch.equal(got[0][1].tokens, got[1][1].tokens)
    assert got[0][2] != got[1][2] and got[0][3] != got[1][3]
    assert len(list((tmp_path / "features").glob("*.pt"))) == 4       # two keys per modality


def test_a_model_folder_rewritten_in_place_gets_new_features(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel, BertTokenizer
    folder, texts = tmp_path / "bert", ["a red circle", "a blue square"]
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "circle",
                                         "square"])}
    got = []
    for seed in (0, 1):                                       # another revision written into the same folder
        torch.manual_seed(seed)
        BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=16)).save_pretrained(folder)
        BertTokenizer(vocab=vocab, model_max_length=16).save_pretrained(folder)
        enc = encoders.load_hf_text(str(folder))
        f = cache.extract(enc, texts, tmp_path / "cache", dataset="t", split="s", modality="text")
        assert torch.equal(f.tokens, enc.encode(texts).tokens.half())
        got.append((f, enc.fingerprint))
    assert got[0][1] != got[1][1] and not torch.equal(got[0][0].tokens, got[1][0].tokens)
    # a Hugging Face cache snapshot is keyed by its commit; torchvision by its weights enum
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--org--m" / "snapshots" / commit
    snap.mkdir(parents=True)
    assert storage.folder_fingerprint(snap) == f"commit {commit}"
    import torchvision
    calls = []

    def offline_state(self, **kw):                            # the file torchvision would read from $TORCH_HOME
        calls.append(kw)
        return torchvision.models.resnet18(weights=None).state_dict()
    monkeypatch.setattr(torchvision.models.ResNet18_Weights, "get_state_dict", offline_state)
    enc = cnn_encoders.load_torchvision("torchvision/resnet18")
    assert enc.fingerprint.startswith("ResNet18_Weights.IMAGENET1K_V1 https://") and calls[0]["weights_only"] is True


# ----------------------------------------------------------------------------- 2-6. bad inputs: one line, at once
BAD_INPUTS = {
    "batch of one, contrastive": (["--method", "pal", "--batch-size", "1"], ["PAL takes batch_size in [2, inf)"]),
    "hp out of range": (["--method", "cov", "--hp", "eps=2"], ["--hp eps=2: CoV takes eps in [0, 1]"]),
    "hp of the wrong type": (["--hp", "K=abc"], ["--hp K=abc", "an integer is expected", "512"]),
    "hp zero": (["--hp", "K=0"], ["--hp K=0: PAL takes K in [5, inf)"]),
    "eval images 0": (["--eval-images", "0"], ["--eval-images 0"]),
    "eval images 10": (["--eval-images", "10"], ["--eval-images 10", "R@10 of 10, is 100 whatever the method"]),
    "missing model folder": (["--image-encoder", "/no/such/model"],
                             ["--image-encoder /no/such/model: no such directory"]),
    "hub name not downloaded": (["--text-encoder", "org/not-downloaded"], ["--text-encoder", "not available offline"]),
}


@pytest.fixture(scope="module")
def bad_input_runs(shared, tmp_path_factory):
    """All the bad-input runs started at once (each stops within seconds)."""
    root = tmp_path_factory.mktemp("bad")
    procs = {row: subprocess.Popen(align_cmd(shared, root / str(i), *extra), cwd=ROOT, env=env(), text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i, (row, (extra, _)) in enumerate(BAD_INPUTS.items())}
    done = {}
    try:
        for row, p in procs.items():
            out, err = p.communicate(timeout=300)
            done[row] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in procs.values():                             # a run that did not stop (a missed check) ends here
            p.kill()
    return done


@pytest.mark.slow
@pytest.mark.parametrize("row", list(BAD_INPUTS))
def test_bad_inputs_stop_with_one_line_before_any_work(row, bad_input_runs):
    r = bad_input_runs[row]
    one_line_error(r, *BAD_INPUTS[row][1])
    assert "[features]" not in r.stdout


def test_batch_of_one_is_allowed_where_the_loss_is_per_pair_and_refused_from_too_few_pairs(tmp_path):
    args = Namespace(eval_images=None, num_pairs=None, threads=0, epochs=1, batch_size=1, lr=None, weight_decay=None,
                     seed=0, select_pairs=5000, method="mlp", align_data="pairs", hard_negatives=False)
    runs.check_flags(args, MLP)                             # 1 - cos per pair: a batch of one learns
    with pytest.raises(SystemExit, match=r"--batch-size 1: Linear takes batch_size in \[2, inf\)"):
        runs.check_flags(args, Linear)
    img, txt = random_features(1, 2, 4), random_features(1, 2, 4, seed=1)   # --num-pairs 1: a batch of one
    loop = Namespace(epochs=1, batch_size=None, lr=None, weight_decay=None, seed=0, resume=False)
    with pytest.raises(SystemExit, match=r"a batch of 1 pair\(s\).*Linear takes batch_size in \[2, inf\)"):
        train_with(Linear(4, 4, K=4), img, txt, loop, tmp_path, "cpu")


def test_hub_names_never_touch_the_network_when_offline(tmp_path, monkeypatch, shared):
    """A hub name in the local Hugging Face cache loads from its snapshot folder with no request; one that
    is not there fails at once when the hub is unreachable (no connection attempt, no 5 retries)."""
    import huggingface_hub.constants as hub
    from transformers import BertConfig, BertModel, BertTokenizer
    lookups, connections = [], []

    def recorder(calls):
        def no_network(*a, **k):
            calls.append(a)
            raise OSError("network is unreachable")
        return no_network
    monkeypatch.setattr(socket, "getaddrinfo", recorder(lookups))
    monkeypatch.setattr(socket.socket, "connect", recorder(connections))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")              # the user did not set the offline mode
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--org--tiny-bert"
    snap = repo / "snapshots" / commit
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "circle"])}
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16)).save_pretrained(snap)
    BertTokenizer(vocab=vocab, model_max_length=16).save_pretrained(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    enc = encoders.load_hf_text("org/tiny-bert")
    assert (lookups == connections == [] and enc.fingerprint == f"commit {commit}"
            and enc.encode(["a circle"]).tokens.shape[-1] == 16)
    t0 = time.time()
    with pytest.raises(SystemExit, match="not available offline") as e:
        encoders.load_hf_text("org/not-downloaded")
    assert "hf download org/not-downloaded" in str(e.value) and time.time() - t0 < 10
    assert connections == [] and len(lookups) <= 1          # a DNS lookup at most, never a connection


# ----------------------------------------------------------------------------- 7 + 9. interrupted and concurrent runs
def wait_for(proc, done, timeout=600):
    t0 = time.time()
    while not done():
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.time() - t0 < timeout
        time.sleep(0.02)


@pytest.mark.slow
def test_a_run_killed_mid_extraction_then_two_concurrent_reruns_match_an_uninterrupted_run(
        reference, shared, tmp_path):
    """SIGKILL while features are written (every set sharded), then two runs at once on that cache:
    both finish (one extracts, the other waits for it) with the uninterrupted run's numbers."""
    cache = fresh_cache(tmp_path / "cache", shared)
    log = open(tmp_path / "killed.log", "w")
    sharded = [sys.executable, str(ROOT / "benchmarks" / "align_sharded.py"), "--memmap-bytes", "1",
               "--shard-bytes", str(256 * 2**20)]                           # every set sharded
    p = subprocess.Popen(sharded + align_cmd(cache, tmp_path / "killed", *RUN)[2:], cwd=ROOT, stdout=log, stderr=log,
                         env=env())
    try:
        wait_for(p, lambda: list(cache.glob("features/*/00000.pt")))  # the first set done, the others not yet
    finally:
        p.kill()
    p.wait()
    assert not (tmp_path / "killed" / "metrics.json").exists()
    runs = [subprocess.Popen(align_cmd(cache, tmp_path / f"run{i}", *RUN), cwd=ROOT, env=env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [r.communicate(timeout=900) for r in runs]
    finally:
        for r in runs:
            r.kill()
    for i, (r, (out, err)) in enumerate(zip(runs, outs)):
        assert r.returncode == 0, out[-2000:] + err[-3000:]
        assert metrics(tmp_path / f"run{i}") == reference[1]
    assert not list(cache.glob("features/**/*.tmp*"))                # no half file left behind


class CountingEncoder:
    name, layer, preprocess, fingerprint = "counting", -1, "none", "w0"

    def __init__(self):
        self.calls = 0

    def encode(self, texts, device="cpu"):
        self.calls += 1
        return random_features(len(texts), 3, 4, seed=len(texts))


def test_a_run_waits_for_the_run_writing_the_same_cache_file_then_reads_it(tmp_path):
    """Another run holds the lock of a cache entry: extract() waits, encodes nothing, reads that run's file."""
    import threading
    enc, texts = CountingEncoder(), ["x"] * 6
    key, got = cache.feature_key(enc, texts, dataset="d", split="s", modality="text"), []
    theirs = random_features(6, 3, 4, seed=99)
    with storage.file_lock(tmp_path / "locks" / f"{key}.lock"):          # the other run, mid-write
        t = threading.Thread(target=lambda: got.append(cache.extract(enc, texts, tmp_path, dataset="d",
                                                                       split="s", modality="text")))
        t.start()
        time.sleep(0.5)
        assert t.is_alive() and enc.calls == 0                             # waiting, not encoding
        storage.atomic_save({"key": key, "tokens": theirs.tokens.half(), "mask": theirs.mask,
                              "pooled": theirs.pooled.half(), "grid": None}, tmp_path / "features" / f"{key}.pt")
    t.join(30)
    assert enc.calls == 0 and torch.equal(got[0].tokens, theirs.tokens.half())


@pytest.mark.slow
def test_ctrl_c_mid_training_then_resume_matches_an_uninterrupted_run(reference, shared, tmp_path):
    # SIGINT's default action in the run, as in a terminal, even where the test runner ignores SIGINT
    # (a shell's background job does, and an ignored signal stays ignored across exec)
    p = subprocess.Popen(align_cmd(shared, tmp_path / "out", *RUN), cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(p, lambda: ((tmp_path / "out") / "checkpoint.pt").exists())  # epoch 1 of 3 saved
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1].strip()
    finally:
        p.kill()
    assert p.returncode != 0 and not (tmp_path / "out" / "metrics.json").exists()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]      # one line: how to go on
    ckpt = (tmp_path / "out") / "checkpoint.pt"                 # --out is untouched until the end
    assert err.startswith("interrupted:") and "--resume" in err and str(ckpt) in err
    assert torch.load(ckpt, weights_only=True)["epoch"] < 2
    r = run(shared, tmp_path / "out", *RUN, "--resume")
    assert r.returncode == 0 and "[train] resumed from" in r.stdout, r.stderr[-3000:]
    assert metrics(tmp_path / "out") == reference[1]


def test_interrupted_writes_leave_no_file_and_resume_restores_dropout_and_the_last_loss(tmp_path, monkeypatch):
    # an interrupted save (encoder pretraining, a feature file, a checkpoint) leaves no file at all
    def half_then_ctrl_c(obj, f):
        f.write(b"PK half a file")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        storage.atomic_save({"x": torch.zeros(3)}, tmp_path / "f.pt")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # training with dropout, stopped in epoch 3 and resumed, ends where a straight run ends
    img, txt = random_features(64, 2, 8, seed=1), random_features(64, 2, 6, seed=2)
    loop = lambda **kw: Namespace(**{**dict(epochs=3, batch_size=16, lr=1e-2, weight_decay=None, seed=0,
                                            resume=False), **kw})
    torch.manual_seed(0)
    straight = MLP(8, 6)
    done = train_with(straight, img, txt, loop(), tmp_path / "a", "cpu")

    torch.manual_seed(0)
    with pytest.raises(KeyboardInterrupt):
        train_with(interrupted(MLP, at_call=10)(8, 6), img, txt, loop(), tmp_path / "b", "cpu")
    torch.manual_seed(123)                                   # another process: other RNG state
    resumed = MLP(8, 6)
    train_with(resumed, img, txt, loop(resume=True), tmp_path / "b", "cpu")
    for k, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    again = train_with(MLP(8, 6), img, txt, loop(resume=True), tmp_path / "a", "cpu")  # interrupted in evaluation
    assert again["final_loss"] == done["final_loss"]


# ----------------------------------------------------------------------------- 8. --resume from other settings
@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_other_settings_or_a_truncated_one(reference, shared, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "checkpoint.pt"):                      # an unfinished run: no metrics.json
        shutil.copy(reference[0] / name, out / name)                   # written by: linear, K=512, 3 epochs
    r = run(shared, out, *RUN, "--hp", "K=64", "--lr", "0.01", "--resume")
    one_line_error(r, str(out / "checkpoint.pt"), "other settings", "hp.K 512 there, 64 now",
                   "lr 0.001 there, 0.01 now")
    r = run(shared, out, "--method", "pal", "--epochs", "3", "--resume")
    one_line_error(r, "method 'linear' there, 'pal' now")
    assert "[features]" not in r.stdout                               # refused before any long work
    ckpt = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(ckpt[:len(ckpt) // 2])
    r = run(shared, out, *RUN, "--resume")
    one_line_error(r, f"{out / 'checkpoint.pt'} is truncated")
    # other dims (another encoder) under the same flags: refused with the shapes, never loaded into them
    img, txt = random_features(32, 2, 8, seed=1), random_features(32, 2, 6, seed=2)
    loop = lambda d: Namespace(epochs=1, batch_size=16, lr=None, weight_decay=None, seed=0, resume=d)
    train_with(Linear(8, 6, K=4), img, txt, loop(False), tmp_path / "dims", "cpu")
    with pytest.raises(SystemExit, match=r"shape\.\S+ \[4, 8\] there, \[4, 6\] now"):
        train_with(Linear(6, 6, K=4), random_features(32, 2, 6), txt, loop(True), tmp_path / "dims", "cpu")


# ----------------------------------------------------------------------------- 10. read-only or full cache
def make_read_only(folder):
    """A folder even root cannot write (chmod, else chattr +i); None where neither works."""
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except OSError:
        return folder
    (folder / "probe").unlink()
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        return folder
    return None


@pytest.mark.slow
def test_a_read_only_or_full_cache_is_one_error_naming_it_before_any_work(shared, tmp_path, monkeypatch):
    ro = make_read_only(tmp_path / "ro")
    try:
        if ro is not None:                                            # the real thing, as a CLI row
            r = run(ro, tmp_path / "out", *RUN)
            one_line_error(r, f"--cache-dir {ro}", "cannot write")
            assert "[features]" not in r.stdout
    finally:
        if ro is not None:
            subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
            ro.chmod(0o755)
    import errno
    import tempfile

    for code, words in ((errno.EROFS, "Read-only file system"), (errno.ENOSPC, "no space left on its disk")):
        def fails(*a, code=code, **k):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(tempfile, "mkstemp", fails)          # the write gate's temporary file
        with pytest.raises(SystemExit, match=f"--cache-dir {tmp_path / 'c'}: cannot write .*CACHEDIR.TAG \\({words}"):
            align.main(["--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "o")])
        monkeypatch.undo()
    # a disk that fills up during the run: one line naming the folder, no half file
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(SystemExit, match=f"cannot write {tmp_path / 'f' / 'x.pt'} \\(no space left on its disk\\)"):
        storage.atomic_save({"x": torch.zeros(3)}, tmp_path / "f" / "x.pt")
    assert list((tmp_path / "f").iterdir()) == []


# ----------------------------------------------------------------------------- 11. planted pickles
@pytest.mark.slow
def test_a_planted_pickle_in_the_cache_is_refused_and_never_run(shared, tmp_path):
    marker = tmp_path / "MARKER"
    folder = fresh_cache(tmp_path / "cache", shared)
    world = folder / "world" / f"{shapes.world_key(0, {})}.pt"          # the cached Shapes world
    world.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": shapes.world_key(0, {}), "sets": RunsCode(marker)}, world)
    r = run(folder, tmp_path / "out", *RUN)
    one_line_error(r, "refusing to load", world.name)
    assert not marker.exists()
    enc = shapes_encoders.ShapesTextEncoder(shapes_encoders.TinyTextEncoder(6),
                                            shapes_encoders.WordTokenizer(shapes_encoders.SPECIALS + ["a", "b"]))
    (folder / "features").mkdir()
    key = cache.feature_key(enc, ["a", "b"], dataset="t", split="s", modality="text")
    torch.save({"key": key, "tokens": RunsCode(marker)}, folder / "features" / f"{key}.pt")   # a planted feature file
    with pytest.raises(SystemExit, match="refusing to load .*could run code"):
        cache.extract(enc, ["a", "b"], folder, dataset="t", split="s", modality="text")
    assert not marker.exists()


@pytest.mark.slow
def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_run(shared, tmp_path):
    marker, out = tmp_path / "MARKER", tmp_path / "out"
    out.mkdir()
    torch.save({"method": RunsCode(marker), "epoch": 0}, out / "checkpoint.pt")
    (out / "config.json").write_text(json.dumps({"identity": {}}))                 # a run of this program's
    r = run(shared, out, *RUN, "--resume")
    one_line_error(r, "refusing to load", str(out / "checkpoint.pt"))
    assert not marker.exists() and "[features]" not in r.stdout


def test_the_readme_table_and_this_module_name_the_same_tests():
    """Every row of docs/faults.md's "Flags, runs and the cache" table names tests of this module, and
    every test of this module is named there."""
    section = (ROOT / "docs" / "faults.md").read_text().split("## Flags, runs and the cache")[1].split("\n## ")[0]
    rows = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| When")]
    named = {t for row in rows for t in re.findall(r"`(test_\w+)`", row.rsplit("|", 2)[1])}
    assert rows and all(re.findall(r"`test_\w+`", row) for row in rows)
    mine = ({n for n in globals() if n.startswith("test_")}
            - {"test_the_readme_table_and_this_module_name_the_same_tests"})
    assert named == mine


@pytest.mark.slow
def test_a_model_folder_with_its_own_code_is_refused_and_never_run(tmp_path):
    marker, folder = tmp_path / "MARKER", tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "evilnet", "auto_map": {
        "AutoConfig": "code.EvilConfig", "AutoModel": "code.EvilModel"}}))
    (folder / "code.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    for load, flag in ((encoders.load_hf_image, "--image-encoder"), (encoders.load_hf_text, "--text-encoder")):
        with pytest.raises(SystemExit, match=f"{flag} {folder}: this checkpoint needs Python code from outside"):
            load(str(folder))
    assert not marker.exists()
