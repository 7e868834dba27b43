"""torchrun + DistributedDataParallel plumbing (gloo on CPU, NCCL on GPU).

Every rank holds the full memory bank. Each step all-gathers (features, slots) of the global
batch so every replica applies the same eq. 11 update and the banks stay identical.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized: bool = False  # a process group exists (torchrun), even with one process

    @property
    def enabled(self) -> bool:
        return self.initialized or self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of all ranks along dim 0, in rank order."""
        if not self.enabled:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t)
        return t

    def broadcast_object(self, obj):
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed(device_type: str) -> DistEnv:
    """Join the process group when launched by torchrun (which sets WORLD_SIZE and RANK), also
    with a single process, so the DDP path runs the same code at any scale."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return DistEnv()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, initialized=True)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class GlobalBatchSampler(Sampler[list[int]]):
    """Shuffled global batches of `global_batch` items (incomplete last batch dropped), seeded by
    (seed, epoch); rank r takes the r-th contiguous chunk of each. One process with the same
    global batch size sees exactly the same batches, which makes DDP and single-process runs
    comparable step for step."""

    def __init__(
        self,
        n: int,
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        weights: torch.Tensor | None = None,
    ):
        """`weights` (n,): draw the epoch's n items with replacement, each with its weight
        (class-balanced draws), instead of a permutation."""
        if global_batch % world_size:
            raise ValueError(
                f"batch size {global_batch} must be divisible by the number of processes {world_size}"
            )
        if n < global_batch:
            raise ValueError(f"batch size {global_batch} exceeds the {n} training images")
        self.n, self.global_batch = n, global_batch
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.weights = weights
        self.epoch = 0
        self.local = global_batch // world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.global_batch

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        if self.weights is not None:
            order = torch.multinomial(self.weights, self.n, replacement=True, generator=g)
        elif self.shuffle:
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        for b in range(len(self)):
            start = b * self.global_batch + self.rank * self.local
            yield order[start : start + self.local].tolist()
