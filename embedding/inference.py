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


def optimize_for_cpu(
    model: EmbeddingNet, example: torch.Tensor, atol: float = 1e-4
) -> tuple[torch.nn.Module, str]:
    """A faster CPU module for serving: traced, BatchNorm folded into the convs, oneDNN
    layouts (torch.jit.optimize_for_inference). conv4 at batch 64 runs ~4x faster on one core
    than eager mode (docs/PERFORMANCE.md). The result is checked against the eager model on
    `example` (normalised (B, C, H, W)) at two batch sizes; any failure or a difference above
    `atol` keeps the eager model. Returns (module, "optimized" | "eager: <why>")."""
    import warnings

    model.eval()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # TorchScript is deprecated in favour of torch.compile, which on this kind of CPU
            # takes ~30 s to start and is not faster for conv4; the pin keeps torch < 2.15.
            warnings.simplefilter("ignore")
            opt = torch.jit.optimize_for_inference(torch.jit.trace(model, example))
            err = max(float((opt(x) - model(x)).abs().max()) for x in (example, example[:1]))
    except Exception as e:  # any failure means "serve the eager model"
        return model, f"eager: optimization failed ({type(e).__name__}: {e})"
    if not err <= atol:
        return model, f"eager: optimized model differs by {err:.2e}"
    return opt, "optimized"
