"""align.py's CUDA paths on a simulated device (tests/simulated_device.py): the training device's
tensors are kept apart from the host's, so an op that mixes them fails as on a GPU, and the
CUDA-only branches (side stream, pinned buffers, autocast, decode threads) run their control flow."""
import json

import pytest
import torch
from conftest import train_with
from simulated_device import simulated_cuda

import aligned
import features
import shapes
from infra import shards

TINY = ["--device", "cuda", "--threads", "1", "--epochs", "1", "--eval-images", "24"]


def run(cache_dir, out, *flags, monkeypatch):
    import align
    with simulated_cuda(monkeypatch) as counts:
        metrics = align.main([*TINY, "--cache-dir", str(cache_dir), "--out", str(out), *flags])
    return metrics, counts


@pytest.mark.slow
def test_default_run_writes_its_metrics_and_figures_on_the_device(cache_dir, tmp_path, monkeypatch):
    """python align.py (PAL, figures on) on CUDA: the anchor figure's heatmaps cross to the host."""
    metrics, counts = run(cache_dir, tmp_path / "run", monkeypatch=monkeypatch)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["retrieval"]["rsum"] == pytest.approx(metrics["retrieval"]["rsum"]) and saved["retrieval"]["rsum"] > 0
    assert "analysis" in saved and (tmp_path / "run" / "pal_anchors_0.png").exists()
    assert counts["pin_memory"] >= 1        # the training set went to the device once: each step's rows pinned


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(__import__("methods").METHODS))
def test_every_method_trains_evaluates_and_draws_on_the_device(name, cache_dir, tmp_path, monkeypatch):
    metrics, _ = run(cache_dir, tmp_path / name, "--method", name, "--eval-images", "16",
                     monkeypatch=monkeypatch)
    assert metrics["retrieval"]["rsum"] > 0 and (tmp_path / name / "metrics.json").exists()
    assert all(v.device.type == "cpu" for v in aligned.read_weights(tmp_path / name).values())


@pytest.mark.slow
def test_analyses_run_on_the_device(cache_dir, tmp_path, monkeypatch):
    """--analyses: the head rows and the class-name features reach the analyses' CPU MLP on the host."""
    metrics, _ = run(cache_dir, tmp_path / "a", "--method", "linear", "--analyses", "--no-figures",
                     monkeypatch=monkeypatch)
    table2 = metrics["recycling"]["cls"]
    assert table2 and all(isinstance(v, (float, int, dict, list, type(None))) for v in table2.values())


@pytest.mark.slow
@pytest.mark.parametrize("align_data", ["weights", "weights+pairs"])
def test_head_rows_align_on_the_device(align_data, cache_dir, tmp_path, monkeypatch):
    metrics, _ = run(cache_dir, tmp_path / "w", "--method", "mlp", "--align-data", align_data, "--no-figures",
                     monkeypatch=monkeypatch)
    assert metrics["classification"] and metrics["train"]["final_loss"] is not None


@pytest.mark.slow
def test_hard_negatives_on_the_device(cache_dir, tmp_path, monkeypatch):
    metrics, _ = run(cache_dir, tmp_path / "h", "--method", "linear", "--hard-negatives", "--no-figures",
                     monkeypatch=monkeypatch)
    assert metrics["train"]["final_loss"] > 0


@pytest.mark.slow
def test_resume_on_the_device(cache_dir, tmp_path, monkeypatch):
    """--resume on CUDA of a run stopped after its last checkpoint (before metrics.json): the checkpoint is read
    back onto the device, no epoch reruns."""
    first, _ = run(cache_dir, tmp_path / "r", "--method", "mlp", "--no-figures", "--keep-checkpoint",
                   monkeypatch=monkeypatch)
    (tmp_path / "r" / "metrics.json").unlink()                     # unfinished: stopped before the evaluation
    again, _ = run(cache_dir, tmp_path / "r", "--method", "mlp", "--no-figures", "--resume", monkeypatch=monkeypatch)
    assert again["train"]["final_loss"] == first["train"]["final_loss"]
    assert again["retrieval"]["rsum"] == pytest.approx(first["retrieval"]["rsum"])


def test_resume_restores_the_cuda_generator(tmp_path, monkeypatch):
    """Dropout on CUDA draws from the CUDA generator: a checkpoint keeps its state and --resume restores it."""
    from argparse import Namespace

    from conftest import random_features

    from methods.mlp import MLP
    args = Namespace(epochs=1, batch_size=16, lr=None, weight_decay=None, seed=0, resume=False)
    img, txt = random_features(32, 1, 8, seed=1), random_features(32, 1, 6, seed=2)
    with simulated_cuda(monkeypatch):
        torch.manual_seed(0)
        train_with(MLP(8, 6).to("cuda"), img, txt, args, tmp_path, "cuda")
        saved = torch.cuda.get_rng_state()
        state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
        assert torch.equal(state["cuda_rng"], saved)
        torch.cuda.set_rng_state(torch.Generator().manual_seed(99).get_state())
        args.resume = True
        train_with(MLP(8, 6).to("cuda"), img, txt, args, tmp_path, "cuda")
        assert torch.equal(torch.cuda.get_rng_state(), saved)


def test_autocast_takes_fp16_where_bf16_is_only_emulated(monkeypatch):
    """A V100 or T4 reports bf16 'supported' under emulation: the encoders take fp16 there, bf16 on an H200."""
    for native, want in ((False, torch.float16), (True, torch.bfloat16)):
        with simulated_cuda(monkeypatch, bf16=native) as counts:
            with features.autocast("cuda"):
                pass
        assert counts == {f"autocast {want}": 1}, (native, counts)


def test_cached_features_are_keyed_by_the_precision_they_were_computed_in(monkeypatch):
    """fp32 features from a CPU, bf16- and fp16-autocast features from GPUs: three cache keys."""
    from types import SimpleNamespace

    from infra import cache
    enc = SimpleNamespace(name="shapes-text", fingerprint="abc", layer=-1, preprocess="words")
    parts = dict(dataset="shapes", split="test", modality="text")
    keys = {"cpu": cache.feature_key(enc, ["a red circle"], "cpu", **parts)}
    for native in (True, False):
        with simulated_cuda(monkeypatch, bf16=native):
            keys[native] = cache.feature_key(enc, ["a red circle"], "cuda", **parts)
    assert len(set(keys.values())) == 3
    assert keys["cpu"] == cache.feature_key(enc, ["a red circle"], **parts)     # the CPU's key by default


def test_head_rows_come_to_the_host_after_extraction_on_the_device(cache_dir, monkeypatch):
    """Module.to is in place: after an extraction on the device the encoder's head lives there, and
    head() still gives host rows (the analyses' MLP and weight_pairs run on the host)."""
    import encoders
    image_enc, text_enc = encoders.load_encoders("shapes-cnn", "shapes-text", cache_dir)
    images = shapes.shapes_world()["test"].images[:2]
    with simulated_cuda(monkeypatch):
        image_enc.encode(images, "cuda")
        W, b, names = image_enc.head()
        assert not W.is_cuda and not b.is_cuda and len(names) == W.shape[0] == b.shape[0]
        assert torch.equal(W, image_enc.model.head.weight[:-1].cpu())


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_extraction_on_the_device_gives_the_host_features_of_the_cpu(sharded, tmp_path, monkeypatch):
    """cache.extract with device="cuda" through Hugging Face encoders (tiny random DINOv2 and BERT):
    pinned host batches, the decode thread a batch ahead, autocast, features back on the host (one
    file, or memory-mapped shards), equal to the CPU's."""
    from test_real import images, write_models

    import encoders
    from infra import cache
    models = write_models(tmp_path / "models")
    image_enc, text_enc = encoders.load_encoders(str(models / "dinov2"), str(models / "bert"), tmp_path / "c")
    inputs = ((image_enc, images(20), "image"), (text_enc, [f"a red dog {i} on the cat" for i in range(20)], "text"))
    monkeypatch.setattr(cache, "EXTRACT_BATCH", 8)
    if sharded:
        monkeypatch.setattr(shards, "MEMMAP_BYTES", 1)
        monkeypatch.setattr(shards, "SHARD_BYTES", 1)
    rows = lambda f: f[torch.arange(len(f))] if sharded else f
    want = [rows(cache.extract(enc, x, tmp_path / "cpu", dataset="d", split="s", modality=m)) for enc, x, m in inputs]
    with simulated_cuda(monkeypatch) as counts:
        got = [rows(cache.extract(enc, x, tmp_path / "gpu", device="cuda", dataset="d", split="s", modality=m))
               for enc, x, m in inputs]
        for g, w in zip(got, want):
            assert not g.tokens.is_cuda and not g.pooled.is_cuda and not g.mask.is_cuda
            torch.testing.assert_close(g.pooled.float(), w.pooled.float(), atol=2e-3, rtol=2e-3)
    assert counts["autocast torch.bfloat16"] >= 2 and counts["pin_memory"] >= 1, counts
