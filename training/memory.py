"""The augmented memory bank (paper §3.2): one unit-norm slot per training image.

Not a parameter and never on the autograd graph (MoCo builder style: buffers updated under
no_grad). After each step, eq. 11:  v_i ← normalize(m · v_i + (1 − m) · f_i).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import MOMENTUM_SCHEDULES
from .nca import NCAOutput, nca_loss


@dataclass
class MomentumSchedule:
    """Memory momentum m per epoch, raised from `start` to `end`.

    linear:   start + (end − start) · epoch / (epochs − 1)
    step:     the reference ImageNet recipe scaled to the run: start, then
              start + 0.75 (end − start) from 80/130 of the epochs, end from 120/130 (0.5/0.8/0.9)
    constant: start throughout (the "schedule off" ablation)
    """

    start: float = 0.5
    end: float = 0.9
    kind: str = "linear"

    def __post_init__(self) -> None:
        if self.kind not in MOMENTUM_SCHEDULES:
            raise ValueError(
                f"memory momentum schedule {self.kind!r} is not one of {MOMENTUM_SCHEDULES}"
            )
        for v in (self.start, self.end):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"memory momentum must be in [0, 1), got {v}")

    def __call__(self, epoch: int, epochs: int) -> float:
        if self.kind == "constant" or epochs <= 1:
            return self.start
        if self.kind == "linear":
            return self.start + (self.end - self.start) * min(epoch, epochs - 1) / (epochs - 1)
        if epoch >= math.ceil(epochs * 120 / 130):
            return self.end
        if epoch >= math.ceil(epochs * 80 / 130):
            return self.start + 0.75 * (self.end - self.start)
        return self.start


class MemoryBank(nn.Module):
    """N x d memory, labels (N,) and dataset indices (N,), as buffers.

    Row i belongs to training sample i (the "slot" the data loader yields as its index).
    Init (reference code, LinearAverage): uniform ±sqrt(3/d) per element, so rows have norm ≈ 1;
    we then normalise the rows exactly, because the NCA loss relies on unit rows for its shift.
    """

    def __init__(
        self,
        labels: torch.Tensor,
        dim: int,
        indices: torch.Tensor | None = None,
        num_classes: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__()
        n = labels.shape[0]
        bound = math.sqrt(3.0 / dim)
        init = torch.rand(n, dim, generator=generator).mul_(2 * bound).sub_(bound)
        self.register_buffer("embeddings", F.normalize(init, dim=1))  # (N, d)
        self.register_buffer("labels", labels.long().clone())  # (N,)
        idx = torch.arange(n) if indices is None else indices.long().clone()
        self.register_buffer("indices", idx)  # (N,) dataset index of each slot
        self.num_classes = int(num_classes if num_classes is not None else labels.max() + 1)
        counts = torch.bincount(self.labels, minlength=self.num_classes)
        self.register_buffer("class_counts", counts, persistent=False)  # (C,)

    def __len__(self) -> int:
        return self.embeddings.shape[0]

    def loss(
        self, features: torch.Tensor, slots: torch.Tensor, labels: torch.Tensor, temperature: float
    ) -> NCAOutput:
        """NCA loss of a batch (B, d) against this memory (eqs. 2-4, gradient eq. 9)."""
        return nca_loss(
            features,
            self.embeddings,
            self.labels,
            slots,
            labels,
            temperature,
            class_counts=self.class_counts,
        )

    @torch.no_grad()
    def update(self, slots: torch.Tensor, features: torch.Tensor, momentum: float) -> None:
        """Eq. 11 on rows `slots` (B,) with features (B, d), then renormalise the rows."""
        rows = self.embeddings.index_select(0, slots)  # (B, d)
        rows.mul_(momentum).add_(features.detach().to(rows.dtype), alpha=1.0 - momentum)
        self.embeddings.index_copy_(0, slots, F.normalize(rows, dim=1))
