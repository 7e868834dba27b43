"""--init torchvision:NAME[:WEIGHTS] (torchvision:resnet50, torchvision:resnet18:IMAGENET1K_V1):
torchvision's published weights, read from torch's hub cache ($TORCH_HOME/hub/checkpoints, where
torchvision itself keeps them). A missing file is downloaded there with torch.hub's download and
hash check (download.py; SNCA_WEIGHTS_MIRROR for a mirror), unless SNCA_OFFLINE=1: then the
error names the file and where to put it."""

from __future__ import annotations

from pathlib import Path

import torch

from embedding.config import ARCHS
from embedding.errors import SNCAError

from .base import Loaded
from .checkpoint import CheckpointFile
from .download import fetch, mirrored


class TorchvisionWeights:
    @staticmethod
    def claims(spec: str) -> bool:
        return spec.startswith("torchvision:")

    @staticmethod
    def load(spec: str) -> Loaded:
        import torchvision

        name, _, which = spec.removeprefix("torchvision:").partition(":")
        try:
            enum = torchvision.models.get_model_weights(name)
        except (ValueError, KeyError):
            raise SNCAError(f"--init {spec}: torchvision has no model {name!r}") from None
        try:
            weights = enum[which] if which else enum.DEFAULT
        except KeyError:
            options = ", ".join(w.name for w in enum)
            raise SNCAError(f"--init {spec}: {name} has no weights {which!r} ({options})") from None
        file = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
        if not file.is_file():  # downloaded (hash-checked) unless offline
            fetch(mirrored(weights.url), file, spec)
        loaded = CheckpointFile.load(str(file), kind="torchvision")
        loaded.spec = spec
        tf = weights.transforms()  # ImageClassification: the weights' own mean/std
        loaded.preprocessing = {"mean": list(tf.mean), "std": list(tf.std)}
        if name in ARCHS:  # the weights need their architecture: --arch need not repeat it
            loaded.arch = name
        return loaded
