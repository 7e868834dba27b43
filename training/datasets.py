"""Training data: class filters, the coarse grouping, a stratified subset and a validation split
carved from the training set (the test split is never used for tuning), a Dataset yielding
(image, label, index), a run's data (`build_data`) and the eval-transform loaders and embedding
of a split that training, evaluation and the few-shot protocol share. The raw readers live in
embedding/datasets.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

from embedding.config import ModelConfig
from embedding.datasets import STATS, FileSource, RawDataset, load_raw, verify_images
from embedding.errors import DataError
from embedding.inference import embed_images
from embedding.transforms import eval_transform

from .config import TrainConfig
from .distributed import DistEnv


# ---------------------------------------------------------------------------- selection
@dataclass
class Split:
    """Items of a RawDataset kept for one role (train / val), with contiguous label ids."""

    raw: RawDataset
    positions: np.ndarray  # (n,) index into raw.source: the "dataset index"
    labels: np.ndarray  # (n,) label ids in [0, len(class_names))
    class_names: list[str]
    fine_labels: np.ndarray | None = None  # (n,) with --coarse: original class ids (remapped)
    fine_class_names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)

    def subset(self, keep: np.ndarray) -> Split:
        return Split(
            self.raw,
            self.positions[keep],
            self.labels[keep],
            self.class_names,
            None if self.fine_labels is None else self.fine_labels[keep],
            self.fine_class_names,
        )


def parse_classes(spec: str | list | None, class_names: list[str]) -> list[int] | None:
    """'0,1,3' or 'Trouser,Bag' -> sorted class ids; None keeps all."""
    if spec is None or spec == "" or spec == []:
        return None
    items = spec if isinstance(spec, list) else [s.strip() for s in str(spec).split(",")]
    ids = []
    for it in items:
        it = str(it).strip()
        if it.lstrip("-").isdigit():
            i = int(it)
            if not 0 <= i < len(class_names):
                raise DataError(f"class id {i} out of range 0-{len(class_names) - 1}")
        elif it in class_names:
            i = class_names.index(it)
        else:
            raise DataError(f"unknown class {it!r}; classes are: {', '.join(class_names)}")
        ids.append(i)
    return sorted(set(ids))


def select(raw: RawDataset, classes: list[int] | None, coarse: bool) -> Split:
    """Keep `classes` (original ids), remap labels to 0..K-1; with `coarse`, train labels are the
    coarse groups of the kept classes and the fine ones are kept for sub-category evaluation."""
    t = raw.targets
    keep_ids = classes if classes is not None else sorted(set(range(len(raw.class_names))))
    mask = np.isin(t, keep_ids)
    if not mask.any():
        raise DataError(f"the class filter {keep_ids} leaves no {raw.name} images")
    positions = np.nonzero(mask)[0]
    fine_remap = {c: i for i, c in enumerate(keep_ids)}
    fine = np.array([fine_remap[c] for c in t[positions]], dtype=np.int64)
    fine_names = [raw.class_names[c] for c in keep_ids]
    if not coarse:
        return Split(raw, positions, fine, fine_names)
    if raw.coarse_of is None:
        raise DataError(f"--coarse: {raw.name} has no coarse grouping")
    kept_coarse = sorted({raw.coarse_of[c] for c in keep_ids})
    c_remap = {c: i for i, c in enumerate(kept_coarse)}
    labels = np.array([c_remap[raw.coarse_of[c]] for c in t[positions]], dtype=np.int64)
    names = [raw.coarse_names[c] for c in kept_coarse]
    return Split(raw, positions, labels, names, fine, fine_names)


def stratified_pick(labels: np.ndarray, amount: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask picking `amount` of the items (a fraction < 1, or a count >= 1), the same
    share from every class, at least one per class that has two or more items."""
    n = len(labels)
    frac = amount if amount < 1 else amount / n
    pick = np.zeros(n, dtype=bool)
    for c in np.unique(labels):
        idx = np.nonzero(labels == c)[0]
        k = round(frac * len(idx))
        if frac > 0 and len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        pick[rng.permutation(idx)[:k]] = True
    return pick


def carve(
    split: Split, val_size: float, subset: int | None, seed: int
) -> tuple[Split, Split | None]:
    """Optional stratified subset, then a stratified validation split (seeded)."""
    rng = np.random.default_rng(seed)
    if subset is not None and subset < len(split):
        split = split.subset(stratified_pick(split.labels, subset, rng))
    if val_size <= 0:
        return split, None
    if val_size == TrainConfig.val_size and val_size >= 1:
        # the default count is for datasets of tens of thousands: on a folder of 96 photos it
        # would take all but one image a class; there it is a sixth of the data
        val_size = min(val_size, max(1, len(split) // 6))
    val_mask = stratified_pick(split.labels, val_size, rng)
    if not val_mask.any() or val_mask.all():
        raise DataError(
            f"--val-size {val_size:g} leaves an empty training or validation split of the "
            f"{len(split)} images; pass a smaller one (a fraction < 1 works too) or 0 for none"
        )
    return split.subset(~val_mask), split.subset(val_mask)


class IndexedDataset(Dataset):
    """Yields (image tensor, label id, index) where index is the item's row in this split
    (its memory-bank slot); `Split.positions[index]` is the dataset index."""

    def __init__(self, split: Split, transform: Callable):
        self.split = split
        self.transform = transform
        self.labels = torch.from_numpy(split.labels)

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        img = self.split.raw.source.get(int(self.split.positions[i]))
        return self.transform(img), int(self.split.labels[i]), i


# ---------------------------------------------------------------------------- a run's data
@dataclass
class Data:
    """A run's training and validation splits and the model config they imply."""

    train: Split
    val: Split | None
    model_cfg: ModelConfig


def build_data(cfg: TrainConfig, dist: DistEnv | None = None) -> Data:
    """The splits of `cfg` (dataset, class filter, coarse labels, subset, validation carved from
    the training set) and the ModelConfig (image size, channels, normalisation) they imply."""
    raw = load_raw(cfg.dataset, "train", cfg.data_dir, cfg.image_size, cfg.in_channels)
    classes = parse_classes(cfg.classes, raw.class_names)
    split = select(raw, classes, cfg.coarse)
    train, val = carve(split, cfg.val_size, cfg.subset, cfg.seed)
    if isinstance(raw.source, FileSource) and (dist is None or dist.is_main):
        keep = train.positions if val is None else np.concatenate([train.positions, val.positions])
        verify_images(raw.source, keep, progress=cfg.progress)
    mean, std = STATS[cfg.dataset]
    if raw.in_channels != len(mean):  # e.g. greyscale ImageFolder: average the RGB stats
        mean, std = (
            (float(np.mean(mean)),) * raw.in_channels,
            (float(np.mean(std)),) * raw.in_channels,
        )
    model_cfg = ModelConfig(
        arch=cfg.arch,
        in_channels=raw.in_channels,
        image_size=raw.image_size,
        mean=mean,
        std=std,
        embedding_dim=cfg.embedding_dim,
        temperature=cfg.temperature,
        class_names=train.class_names,
        small_stem=cfg.resolved_small_stem(raw.image_size),
    )
    return Data(train, val, model_cfg)


def embed_split(
    fn: Callable[[torch.Tensor], torch.Tensor],
    split: Split,
    model_cfg: ModelConfig,
    device: torch.device | str = "cpu",
    batch_size: int = 512,
    num_workers: int = 0,
    amp: bool = True,
) -> torch.Tensor:
    """`fn` (a model, its `project` or `features`) over the images of `split` with the eval
    transform: (n, D) float32 on `device` (embedding.inference.embed_images)."""
    device = torch.device(device)
    return embed_images(
        fn,
        split.raw.source,
        split.positions,
        eval_transform(model_cfg),
        device,
        batch_size,
        num_workers,
        amp,
    )
