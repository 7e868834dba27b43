"""ModelConfig: everything needed to rebuild a model and its preprocessing from the model card.

Preprocessing travels with the checkpoint (timm / nanoGPT style), so training, the index
builder and the service cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ArtifactError

ARCHS = ("conv4", "resnet18", "resnet34", "resnet50")
TIMM_PREFIX = "timm:"  # arch "timm:NAME": a timm model's backbone (pip install 'snca[timm]')
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def known_arch(arch: str) -> bool:
    return arch in ARCHS or (arch.startswith(TIMM_PREFIX) and len(arch) > len(TIMM_PREFIX))


MODEL_FORMAT_VERSION = 1


@dataclass
class ModelConfig:
    arch: str = "conv4"
    in_channels: int = 1
    image_size: int = 28
    mean: tuple[float, ...] = (0.2860,)
    std: tuple[float, ...] = (0.3530,)
    embedding_dim: int = 128
    temperature: float = 0.05  # σ of eqs. 2-4 and of the weighted kNN vote
    class_names: list[str] = field(default_factory=list)
    # ResNets only: 3x3 stride-1 first conv and no max-pool, for 28-64 px images.
    small_stem: bool = True
    # Images over 64 px: resized so that the centre crop of image_size is this share of the
    # short side, with this filter (timm's crop_pct / interpolation of pretrained weights).
    crop_pct: float = 0.875
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        self.class_names = [str(c) for c in self.class_names]
        self.validate()

    def validate(self) -> None:
        problems = []
        if not known_arch(self.arch):
            problems.append(f"arch {self.arch!r} is not one of {', '.join(ARCHS)} or timm:NAME")
        if not (isinstance(self.crop_pct, (int, float)) and 0.1 <= self.crop_pct <= 1):
            problems.append(f"crop_pct must be in [0.1, 1], got {self.crop_pct!r}")
        if self.interpolation not in INTERPOLATIONS:
            problems.append(f"interpolation must be one of {', '.join(INTERPOLATIONS)}")
        if not isinstance(self.in_channels, int) or self.in_channels < 1:
            problems.append(f"in_channels must be a positive integer, got {self.in_channels!r}")
        if not isinstance(self.image_size, int) or self.image_size < 8:
            problems.append(f"image_size must be an integer >= 8, got {self.image_size!r}")
        if len(self.mean) != self.in_channels or len(self.std) != self.in_channels:
            problems.append(
                f"mean/std need one value per input channel ({self.in_channels}), "
                f"got {len(self.mean)}/{len(self.std)}"
            )
        if any(not math.isfinite(s) or s <= 0 for s in self.std):
            problems.append(f"std values must be positive, got {self.std}")
        if not isinstance(self.embedding_dim, int) or self.embedding_dim < 2:
            problems.append(f"embedding_dim must be an integer >= 2, got {self.embedding_dim!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 < self.temperature <= 10):
            problems.append(f"temperature must be in (0, 10], got {self.temperature!r}")
        if problems:
            raise ArtifactError("invalid model config: " + "; ".join(problems))

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mean"] = list(self.mean)
        d["std"] = list(self.std)
        # fields added later enter the card (and the fingerprint, which hashes this) only when
        # they differ from what an older card meant: older run dirs keep their fingerprints
        for name, default in LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return strict_from_dict(cls, d, "model config", ArtifactError)


LATER_FIELDS = {"crop_pct": 0.875, "interpolation": "bilinear"}


def strict_from_dict(cls, d: Any, what: str, error: type[Exception]):
    """Build dataclass `cls` from a mapping, refusing unknown keys ('-' read as '_')."""
    if not isinstance(d, dict):
        raise error(f"{what} must be a mapping of option: value, got {type(d).__name__}")
    norm = {str(k).replace("-", "_"): v for k, v in d.items()}
    unknown = sorted(set(norm) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise error(f"{what} has unknown keys: {', '.join(unknown)}")
    try:
        return cls(**norm)
    except TypeError as e:
        raise error(f"invalid {what}: {e}") from None
