"""Batched embedding of images with a trained model (eval mode, no grad)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .model import EmbeddingNet


def autocast_context(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA where supported (fp16 otherwise); a no-op on CPU."""
    if device.type == "cuda" and enabled:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype)
    return torch.autocast(device.type, enabled=False)


@torch.no_grad()
def embed_batches(
    model: EmbeddingNet,
    batches: Iterable,
    device: torch.device,
    amp: bool = True,
    progress=None,
) -> torch.Tensor:
    """Embed every batch (a tensor, or a tuple whose first item is the image tensor).

    Returns (N, d) float32 unit-norm embeddings on `device`, in order.
    """
    was_training = model.training
    model.eval()
    out = []
    try:
        for batch in batches:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            with autocast_context(device, amp):
                out.append(model(x.to(device, non_blocking=True)).float())
            if progress is not None:
                progress.update(x.shape[0])
    finally:
        model.train(was_training)
    if not out:
        return torch.empty(0, model.config.embedding_dim, device=device)
    return torch.cat(out)
