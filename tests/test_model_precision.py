"""A model folder saved in half precision (fp16 / bf16 safetensors, as many hub checkpoints are): run
in fp32, the precision the feature cache key records for the CPU, not in the file's dtype."""
import shutil

import pytest
import torch
from test_real import models  # noqa: F401  (the tiny Hugging Face models fixture)

import encoders


# ----------------------------------------------------------------------------- case 9: fp16 / bf16 folders
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_model_folder_saved_in_half_precision_runs_in_fp32(tmp_path, models, dtype):
    """from_pretrained without dtype (transformers 5: "auto") ran a folder saved in fp16 in fp16 on the
    CPU: pooled vectors 0.46% off fp32 while the cache key said "precision fp32". Loaded in fp32: the
    same features as the fp32 model of the same (rounded) weights."""
    from transformers import AutoModel
    half = tmp_path / "bert-half"
    shutil.copytree(models / "bert", half)
    model = AutoModel.from_pretrained(models / "bert")
    model.to(dtype).save_pretrained(half)
    enc = encoders.load_hf_text(str(half))
    assert {p.dtype for p in enc.model.parameters()} == {torch.float32}
    rounded = tmp_path / "bert-rounded"
    shutil.copytree(models / "bert", rounded)
    model.to(dtype).float().save_pretrained(rounded)                            # the same values, stored in fp32
    ref = encoders.load_hf_text(str(rounded))
    texts = ["a dog on the grass .", "a man ."]
    assert torch.equal(enc.encode(texts).pooled, ref.encode(texts).pooled)


# ----------------------------------------------------------------------------- case 13: NaN weights
def test_nan_weights_in_a_model_folder_are_said_as_nan_not_beyond_fp16(tmp_path, models):
    """A model folder with NaN weights was reported as '960 tokens value(s) beyond 65504 ... pick another
    layer' (check_fp16 counted NaN as beyond the range): the outputs are NaN, and the folder needs
    another copy. Said so, when the features go into the cache."""
    from transformers import AutoModel

    from infra import cache
    broken = tmp_path / "bert-nan"
    shutil.copytree(models / "bert", broken)
    model = AutoModel.from_pretrained(models / "bert")
    with torch.no_grad():
        model.encoder.layer[0].attention.output.dense.weight[0, 0] = float("nan")
    model.save_pretrained(broken)
    enc = encoders.load_hf_text(str(broken))
    with pytest.raises(SystemExit) as e:
        cache.extract(enc, ["a dog .", "a man on the grass ."], tmp_path / "cache", batch_size=2, dataset="coco",
                      split="train", modality="text")
    msg = str(e.value)
    assert msg.startswith("error: ") and "NaN" in msg and "beyond" not in msg and "copy" in msg, msg
    assert "\n" not in msg
