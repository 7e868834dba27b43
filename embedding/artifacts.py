"""Artifact formats (versioned): model = safetensors weights + JSON model card; memory bank =
safetensors. No pickle anywhere: every file here may come from outside.

All writes are atomic (embedding/files.py: temp file in the same folder, fsync, os.replace,
fsync of the folder).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .config import MODEL_FORMAT_VERSION, ModelConfig
from .errors import ArtifactError
from .files import atomic_write_bytes, atomic_write_json, check_format_version, read_json
from .model import EmbeddingNet

MODEL_WEIGHTS = "model.safetensors"
MODEL_CARD = "model.json"
MEMORY_BANK = "memory.safetensors"
MEMORY_FORMAT_VERSION = 1


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load every tensor and the metadata of a safetensors file; clear error if corrupt."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"missing file: {path}") from None
    except OSError as e:
        raise ArtifactError(f"cannot read {path}: {e}") from None
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {}) or {}
    except (SafetensorError, ValueError, json.JSONDecodeError, RuntimeError) as e:
        raise ArtifactError(f"corrupt safetensors file {path}: {e}") from None
    return tensors, meta


def write_safetensors(
    path: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write_bytes(path, st_save(tensors, metadata=metadata))


# ---------------------------------------------------------------------------- fingerprint
def model_fingerprint(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> str:
    """sha256 over the canonical model config and every tensor (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------- model
def save_model(
    model: EmbeddingNet, directory: str | os.PathLike, training: dict | None = None
) -> str:
    """Write model.safetensors + model.json into `directory`; return the fingerprint.
    `training`: how it was trained (the card records it; not part of the fingerprint)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    fp = model_fingerprint(model.config, state)
    write_safetensors(directory / MODEL_WEIGHTS, state, {"fingerprint": fp})
    card = {
        "format_version": MODEL_FORMAT_VERSION,
        "config": model.config.to_dict(),
        "fingerprint": fp,
        "weights": MODEL_WEIGHTS,
    }
    if training is not None:
        card["training"] = training
    atomic_write_json(directory / MODEL_CARD, card)
    return fp


def load_model_card(directory: str | os.PathLike) -> tuple[ModelConfig, str]:
    """Read model.json -> (ModelConfig, fingerprint)."""
    path = Path(directory) / MODEL_CARD
    card = read_json(path)
    if not isinstance(card, dict) or "config" not in card or "fingerprint" not in card:
        raise ArtifactError(f"{path} is not a model card (needs 'config' and 'fingerprint')")
    check_format_version(path, "model", card.get("format_version"), MODEL_FORMAT_VERSION)
    try:
        cfg = ModelConfig.from_dict(card["config"])
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None
    return cfg, str(card["fingerprint"])


def load_model(directory: str | os.PathLike, device: str | torch.device = "cpu") -> EmbeddingNet:
    """Rebuild the model from its card and weights, verify the fingerprint, return it in eval
    mode with `.fingerprint` set."""
    directory = Path(directory)
    cfg, fp = load_model_card(directory)
    state, _ = read_safetensors(directory / MODEL_WEIGHTS)
    actual = model_fingerprint(cfg, state)
    if actual != fp:
        raise ArtifactError(
            f"{directory / MODEL_WEIGHTS}: weights do not match the model card's fingerprint "
            f"(card {fp[:19]}..., weights {actual[:19]}...): the file was modified or mixed up"
        )
    model = EmbeddingNet(cfg)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ArtifactError(f"{directory / MODEL_WEIGHTS} does not fit {cfg.arch}: {e}") from None
    model.fingerprint = fp
    return model.to(device).eval()


# ---------------------------------------------------------------------------- memory bank
def save_memory_bank(
    path: str | os.PathLike,
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    indices: torch.Tensor,
    fingerprint: str,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """embeddings (N, d) float32 unit rows; labels (N,) int64 label ids; indices (N,) int64
    dataset indices; extra: more (N,) tensors such as fine labels."""
    n = embeddings.shape[0]
    tensors = {"embeddings": embeddings.float(), "labels": labels.long(), "indices": indices.long()}
    for k, v in (extra or {}).items():
        tensors[k] = v
    for k, v in tensors.items():
        if v.shape[0] != n:
            raise ValueError(f"memory bank tensor {k} has {v.shape[0]} rows, expected {n}")
    meta = {"format_version": str(MEMORY_FORMAT_VERSION), "model_fingerprint": fingerprint}
    write_safetensors(path, tensors, meta)


def load_memory_bank(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, meta = read_safetensors(path)
    check_format_version(
        path, "memory bank", meta.get("format_version"), str(MEMORY_FORMAT_VERSION)
    )
    missing = {"embeddings", "labels", "indices"} - set(tensors)
    if missing:
        raise ArtifactError(f"{path}: memory bank lacks tensors {sorted(missing)}")
    return tensors, meta
