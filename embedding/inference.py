"""Batched embedding of images with a trained model (eval mode, no grad): the one loop that
training's evaluation, the few-shot protocol and the index builder all use."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def autocast_context(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA where supported (fp16 otherwise); a no-op on CPU."""
    if device.type == "cuda" and enabled:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype)
    return torch.autocast(device.type, enabled=False)


class _Images(Dataset):
    """Items `positions` of a raw source, through `transform` (picklable for loader workers)."""

    def __init__(self, source, positions: np.ndarray, transform):
        self.source, self.positions, self.transform = source, positions, transform

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(self.source.get(int(self.positions[i])))


@torch.no_grad()
def embed_images(
    fn: Callable[[torch.Tensor], torch.Tensor],
    source,
    positions,
    transform,
    device: torch.device,
    batch_size: int = 512,
    num_workers: int = 0,
    amp: bool = True,
    progress=None,
) -> torch.Tensor:
    """Run `fn` on the images `positions` of `source` (an embedding.datasets source) after
    `transform` (e.g. the eval transform), `batch_size` at a time.

    fn: (B, C, H, W) float on `device` -> (B, D): a model (unit embeddings), its `project`
    (unnormalised), its `features`, or a module of embedding.model.in_space. Modules are put in
    eval mode for the call and restored after. `progress`: an embedding.progress.Progress.
    Returns (N, D) float32 on `device`, in the order of `positions`.
    """
    positions = np.asarray(positions)
    owner = getattr(fn, "__self__", fn)  # a bound method's module, or the module itself
    was_training = getattr(owner, "training", None)
    if was_training is not None:
        owner.eval()
    loader = DataLoader(
        _Images(source, positions, transform),
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )
    out = []
    try:
        for x in loader:
            with autocast_context(device, amp):
                out.append(fn(x.to(device, non_blocking=True)).float())
            if progress is not None:
                progress.update(x.shape[0])
    finally:
        if was_training is not None:
            owner.train(was_training)
    if not out:
        return torch.empty(0, 0, device=device)
    return torch.cat(out)
