"""--init torchvision:NAME[:WEIGHTS] (torchvision:resnet50, torchvision:resnet18:IMAGENET1K_V1):
torchvision's published weights, read from torch's hub cache ($TORCH_HOME/hub/checkpoints, where
torchvision itself keeps them), so it works offline once the file is there. Nothing is
downloaded here: a missing file is an error naming the file and where to put it."""

from __future__ import annotations

from pathlib import Path

import torch

from embedding.errors import SNCAError

from .base import Loaded
from .checkpoint import CheckpointFile


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
        if not file.is_file():
            raise SNCAError(
                f"--init {spec}: {file} is missing and nothing is downloaded here; fetch "
                f"{weights.url} on a machine with internet access and place it at {file} "
                "(or set TORCH_HOME to the folder whose hub/checkpoints holds it)"
            )
        loaded = CheckpointFile.load(str(file), kind="torchvision")
        loaded.spec = spec
        tf = weights.transforms()  # ImageClassification: the weights' own mean/std
        loaded.preprocessing = {"mean": list(tf.mean), "std": list(tf.std)}
        return loaded
