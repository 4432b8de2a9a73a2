"""Every method computes on the device of its inputs (CSA on CUDA included).

No GPU here, so the check is turned around: the features stay on the CPU while
torch's DEFAULT device is `meta` (torch.device as a context manager). A tensor a
method creates without device= then lands on meta instead of the features'
device, exactly as it would land on the CPU next to CUDA features: mixing it with
the features raises, and a meta tensor in an output is caught by the asserts.
"""
import pytest
import torch
from conftest import random_features

from methods import METHODS

D_IMG, D_TXT, B = 16, 12, 6


def batch(seed):
    img = random_features(B, 1 + 4, D_IMG, grid=(2, 2), seed=seed)          # global token + 2x2 patches
    txt = random_features(B, 5, D_TXT, lengths=[5, 3, 4, 2, 5, 1], seed=seed + 1)
    return img, txt


def on_cpu(*tensors):
    return all(t.device.type == "cpu" and torch.isfinite(t).all() for t in tensors)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_creates_no_tensor_off_its_inputs_device(name):
    torch.manual_seed(0)
    method = METHODS[name](D_IMG, D_TXT)                                     # parameters on the CPU
    (img, txt), (q_img, q_txt) = batch(0), batch(10)                          # made on the CPU
    with torch.device("meta"):                                               # the "other" default device
        if method.fit is not None:
            method.fit(img, txt)
        if method.loss is not None:
            method.train()
            loss, _ = method.loss(img, txt)
            loss.backward()
            assert on_cpu(loss) and all(on_cpu(p.grad) for p in method.parameters() if p.grad is not None)
        method.eval()
        with torch.no_grad():
            e_v, e_l = method.embed_image(q_img), method.embed_text(q_txt)
            S = method.score(e_v, e_l)
            dense = method.dense_image(q_img)
            S_dense = method.score(dense[:, 0], e_l)                          # a patch is a valid image emb
    assert on_cpu(e_v, e_l, S, dense, S_dense)
    assert S.shape == (B, B) and S_dense.shape == (B, B)
    assert all(t.device.type == "cpu" for t in method.state_dict().values())


@pytest.mark.parametrize("name", ["csa", "linear", "cov"])        # closed form, global head, token-level
def test_evaluation_protocols_create_no_tensor_off_the_cpu(name):
    """evaluate.py gathers embeddings and scores on the CPU on purpose: every tensor it makes says so."""
    import evaluate
    torch.manual_seed(0)
    method = METHODS[name](D_IMG, D_TXT)
    (img, txt), (q_img, q_txt) = batch(0), batch(10)
    if method.fit is not None:
        method.fit(img, txt)
    masks = torch.randint(0, 3, (B, 8, 8), generator=torch.Generator().manual_seed(0))
    labels, txt_to_img = torch.arange(B) % 3, torch.arange(B)
    with torch.device("meta"):
        r = evaluate.retrieval(method, q_img, q_txt, txt_to_img, device="cpu")
        c = evaluate.classification(method, q_img, labels, q_txt[:3], 1, device="cpu")
        s = evaluate.segmentation(method, q_img, masks, q_txt[:3], 1, device="cpu")
        b = evaluate.binding(method, q_img, q_txt, {"swap": txt}, device="cpu")
    values = [r["rsum"], r["i2t_map"], c["top1"], s["miou_fg"], b["binding_acc"]]
    assert all(isinstance(v, float) and v == v for v in values)
