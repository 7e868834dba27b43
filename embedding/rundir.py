"""The run dir contract: what `snca-train` writes and every later stage reads.

    <run dir>/
        model.safetensors + model.json   weights and model card (embedding/artifacts.py)
        memory.safetensors               final memory bank: embeddings, labels, dataset indices
        classifier.safetensors           softmax runs only: the linear classifier
        dataset.json                     where the training images came from (DatasetProvenance)
        config.json                      training's resolved config (training reads it back)
        metrics.jsonl, curves.png        per-epoch metrics and their plot
        summary.json                     final validation numbers, wall time, hardware
        checkpoint.safetensors           training state for --resume (training only)

`RunDir` names these files and loads them, so no stage spells another stage's file names. The
index builder needs the training images again (re-embedding, thumbnails): it reads them through
`DatasetProvenance`, which records the folder training found them in, never training's config.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .artifacts import (
    MEMORY_BANK,
    MODEL_CARD,
    MODEL_WEIGHTS,
    load_memory_bank,
    load_model,
    load_model_card,
)
from .config import ModelConfig
from .errors import ArtifactError, DataError
from .files import atomic_write_json, read_json

PROVENANCE_FORMAT_VERSION = 1


def labels_digest(targets: np.ndarray) -> str:
    """sha256 of a split's class ids (int64, little-endian): the same images in the same order
    give the same digest, a different or reordered dataset a different one."""
    return hashlib.sha256(np.ascontiguousarray(targets, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class DatasetProvenance:
    """Which images a run trained on, enough to read the very same ones again."""

    dataset: str  # embedding.datasets.DATASETS
    root: str | None  # absolute folder the training split was read from (None: not recorded)
    train_items: int | None  # images in the raw training split
    labels_sha256: str | None  # labels_digest of the raw training split
    image_size: int | None = None  # the size the images were read at (ImageFolder)
    in_channels: int | None = None
    format_version: int = PROVENANCE_FORMAT_VERSION

    @classmethod
    def of(cls, raw) -> DatasetProvenance:
        """From an embedding.datasets.RawDataset (the training split as loaded)."""
        return cls(
            dataset=raw.name,
            root=str(raw.root) if raw.root is not None else None,
            train_items=len(raw.source),
            labels_sha256=labels_digest(raw.targets),
            image_size=raw.image_size,
            in_channels=raw.in_channels,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> DatasetProvenance:
        if not isinstance(d, dict) or not isinstance(d.get("dataset"), str):
            raise ArtifactError(f"{where} is not a dataset provenance record (needs 'dataset')")
        if d.get("format_version", PROVENANCE_FORMAT_VERSION) != PROVENANCE_FORMAT_VERSION:
            raise ArtifactError(
                f"{where}: provenance format_version {d.get('format_version')!r} is not "
                f"supported (this version reads {PROVENANCE_FORMAT_VERSION})"
            )
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    def load_train(self, data_dir: str | Path | None = None, log=None):
        """The raw training split as the run read it: from `data_dir` when given, else from
        the recorded folder (never downloading: it held the files), else by the usual lookup
        ($SNCA_DATA_DIR, the Debian package, the download cache). Checked against the recorded
        size and labels, so a different dataset is an error rather than wrong thumbnails."""
        from .datasets import load_raw

        recorded = Path(self.root) if self.root else None
        if data_dir is not None:
            where, download = Path(data_dir), True
        elif recorded is not None and recorded.is_dir():
            where, download = recorded, False
        else:
            where, download = None, True
            if recorded is not None and log is not None:
                log(f"the training images' folder {recorded} is gone; looking for {self.dataset}")
        raw = load_raw(
            self.dataset, "train", where, self.image_size, self.in_channels, download=download
        )
        if self.train_items is not None and len(raw.source) != self.train_items:
            raise DataError(
                f"{self.dataset} in {raw.root} has {len(raw.source)} training images; the run "
                f"trained on {self.train_items} (from {self.root}): pass the dataset it used"
            )
        if self.labels_sha256 is not None and labels_digest(raw.targets) != self.labels_sha256:
            raise DataError(
                f"{self.dataset} in {raw.root} is not the dataset the run trained on (from "
                f"{self.root}): its labels differ"
            )
        return raw


@dataclass(frozen=True)
class MemoryBankFile:
    """The final memory bank of a run (memory.safetensors)."""

    embeddings: torch.Tensor  # (N, d) float32 unit rows
    labels: torch.Tensor  # (N,) int64 label ids of the run's classes
    indices: torch.Tensor  # (N,) int64 dataset index of each slot
    fine_labels: torch.Tensor | None  # (N,) with --coarse: the fine class ids
    model_fingerprint: str


def _named(name: str) -> property:
    return property(lambda self: self.path / name, doc=f"<run dir>/{name}")


class RunDir:
    """A training run dir: its files by name, and their loaders."""

    MODEL_WEIGHTS = MODEL_WEIGHTS
    MODEL_CARD = MODEL_CARD
    MEMORY = MEMORY_BANK
    CLASSIFIER = "classifier.safetensors"
    DATASET = "dataset.json"
    CONFIG = "config.json"
    METRICS = "metrics.jsonl"
    CURVES = "curves.png"
    SUMMARY = "summary.json"
    CHECKPOINT = "checkpoint.safetensors"
    WORLD = "world.safetensors"  # embedding/world.py: the world check's Gaussian (since issue 28)
    # A run trained on a served gallery (snca-train --dataset gallery, snca-gallery learn): where
    # that gallery lives ({"data_dir": absolute path, "model": the served run dir}), so the
    # service and its tools find the gallery of this run without --data-dir (issue 53)
    GALLERY = "gallery.json"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    memory = _named(MEMORY)
    classifier = _named(CLASSIFIER)
    dataset = _named(DATASET)
    config = _named(CONFIG)
    metrics = _named(METRICS)
    curves = _named(CURVES)
    summary = _named(SUMMARY)
    checkpoint = _named(CHECKPOINT)
    world = _named(WORLD)
    gallery = _named(GALLERY)

    # ------------------------------------------------------------------ checks
    def require(self, *names: str) -> None:
        """ArtifactError naming what is missing unless the dir holds the model and `names`."""
        if not self.path.is_dir():
            raise ArtifactError(f"run dir {self.path} does not exist")
        missing = [n for n in (MODEL_CARD, MODEL_WEIGHTS, *names) if not self.file(n).is_file()]
        if missing:
            raise ArtifactError(
                f"{self.path} is not a complete training run dir: missing {', '.join(missing)} "
                "(train one with snca-train)"
            )

    # ------------------------------------------------------------------ loaders
    def load_model_card(self) -> tuple[ModelConfig, str]:
        return load_model_card(self.path)

    def load_model(self, device: str | torch.device = "cpu"):
        """The EmbeddingNet, fingerprint-checked, in eval mode (embedding.artifacts)."""
        return load_model(self.path, device)

    def load_memory(self, expected_fingerprint: str | None = None) -> MemoryBankFile:
        """The memory bank; with `expected_fingerprint`, refused unless written for that
        model (a memory bank beside the weights of another run)."""
        tensors, meta = load_memory_bank(self.memory)
        fp = str(meta.get("model_fingerprint", ""))
        if expected_fingerprint is not None and fp != expected_fingerprint:
            raise ArtifactError(
                f"{self.memory} was written for another model ({fp[:19]}...) than "
                f"{self.file(MODEL_CARD)} ({expected_fingerprint[:19]}...)"
            )
        return MemoryBankFile(
            tensors["embeddings"].float(),
            tensors["labels"].long(),
            tensors["indices"].long(),
            tensors.get("fine_labels"),
            fp,
        )

    def read_config(self) -> dict[str, Any]:
        """Training's resolved config (a dict; training turns it back into a TrainConfig)."""
        d = read_json(self.config)
        if not isinstance(d, dict):
            raise ArtifactError(f"{self.config} is not a JSON object")
        return d

    def read_summary(self) -> dict[str, Any]:
        d = read_json(self.summary)
        if not isinstance(d, dict):
            raise ArtifactError(f"{self.summary} is not a JSON object")
        return d

    def gallery_data_dir(self) -> Path | None:
        """The data dir of the gallery this run was trained from (gallery.json), None when it
        was not trained on a gallery or the record is unreadable (then the default applies)."""
        try:
            d = json.loads(self.gallery.read_text())
        except (OSError, ValueError):
            return None
        where = d.get("data_dir") if isinstance(d, dict) else None
        return Path(where) if isinstance(where, str) and where else None

    def read_metrics(self) -> list[dict[str, Any]]:
        try:
            return [json.loads(x) for x in self.metrics.read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            raise ArtifactError(f"missing file: {self.metrics}") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"cannot read {self.metrics}: {e}") from None

    def read_provenance(self) -> DatasetProvenance:
        """dataset.json; for runs written before it existed, what config.json says (the
        dataset's name and the --data-dir given, if any)."""
        if self.dataset.is_file():
            return DatasetProvenance.from_dict(read_json(self.dataset), str(self.dataset))
        if not self.config.is_file():
            raise ArtifactError(
                f"{self.path} records no training dataset (neither {self.DATASET} nor "
                f"{self.CONFIG}): it cannot be re-embedded"
            )
        cfg = self.read_config()
        if not isinstance(cfg.get("dataset"), str):
            raise ArtifactError(f"{self.config} does not name the training dataset")
        root = cfg.get("data_dir")
        return DatasetProvenance(
            dataset=cfg["dataset"],
            root=str(Path(root).resolve()) if root else None,
            train_items=None,
            labels_sha256=None,
            image_size=cfg.get("image_size"),
            in_channels=cfg.get("in_channels"),
        )

    def write_provenance(self, provenance: DatasetProvenance) -> None:
        atomic_write_json(self.dataset, provenance.to_dict())
