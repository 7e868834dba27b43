"""CPU serving accelerations of the model: a traced, BatchNorm-folded oneDNN copy, the eval
transform's normalisation inside the module, and oneDNN-graph fused copies for small batches.
Serving-only (training and the index builder run the eager model)."""

from __future__ import annotations

import torch

from embedding.transforms import normalize_batch


def optimize_for_cpu(
    model: torch.nn.Module, example: torch.Tensor, atol: float = 1e-4
) -> tuple[torch.nn.Module, str]:
    """A faster CPU module for serving: traced, BatchNorm folded into the convs, oneDNN
    layouts (torch.jit.optimize_for_inference). conv4 at batch 64 runs ~4x faster on one core
    than eager mode (docs/PERFORMANCE.md). The result is checked against the eager model on
    `example` (normalised (B, C, H, W)) at two batch sizes; any failure or a difference above
    `atol` (`differs`: relative to each output column's scale) keeps the eager model. Returns (module, "optimized" | "eager: <why>")."""
    import warnings

    model.eval()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # TorchScript is deprecated in favour of torch.compile, which on this kind of CPU
            # takes ~30 s to start and is not faster for conv4; the pin keeps torch < 2.15.
            warnings.simplefilter("ignore")
            # (check_trace off: the comparison below is the check, at two batch sizes; the
            # tracer's own re-run imported torch.distributed and cost 1.5 s per start)
            traced = torch.jit.trace(model, example, check_trace=False)
            opt = torch.jit.optimize_for_inference(traced)
            err = max(differs(model(x), opt(x)) for x in (example, example[:1]))
    except Exception as e:  # any failure means "serve the eager model"
        return model, f"eager: optimization failed ({type(e).__name__}: {e})"
    if not err <= atol:
        return model, f"eager: optimized model differs by {err:.2e}"
    return opt, "optimized"


def differs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two outputs (B, D), each column relative to its own scale
    (at least 1): the unit vectors are compared as they are, the world statistics beside them
    (activation means and variances in the hundreds for a ResNet) to their size, where float
    rounding in a folded BatchNorm is ~1e-6 of it."""
    scale = a.abs().amax(dim=0).clamp_min(1.0)  # (D,)
    return float(((a - b).abs() / scale).max())


class NormalizedInput(torch.nn.Module):
    """uint8 (B, C, H, W) -> net(normalised x): the eval transform's second half inside the
    module, so that a traced copy serves a whole batch in one call (one release of the GIL
    instead of one per operation; docs/PERFORMANCE.md)."""

    def __init__(self, net: torch.nn.Module, config):
        super().__init__()
        self.net = net
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(normalize_batch(x, self.config))


def fuse_for_shape(
    module: torch.nn.Module, example: torch.Tensor, atol: float = 1e-4
) -> tuple[torch.nn.Module | None, str]:
    """A copy of `module` compiled by the oneDNN graph fuser (conv + ReLU + pool fused) for
    `example`'s exact shape. On this machine's CPU conv4's batch of one runs 2.2x faster than
    the `optimize_for_cpu` module (0.27 vs 0.59 ms) and ResNet-18's 2.6x; the gain fades by
    batch 8-64, and a fused copy specialises on its first shape, hence one copy per batch size.
    Checked against `module` on `example`; returns (copy, "fused") or (None, why not)."""
    import warnings

    module.eval()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.jit.enable_onednn_fusion(True)
            try:
                traced = torch.jit.trace(module, example, check_trace=False)  # (checked below)
                fused = torch.jit.freeze(traced.eval())
                for _ in range(3):  # the profiling executor compiles on the first calls
                    out = fused(example)
            finally:
                torch.jit.enable_onednn_fusion(False)
            err = differs(module(example), out)
    except Exception as e:
        return None, f"fusion failed ({type(e).__name__}: {e})"
    if not err <= atol:
        return None, f"fused copy differs by {err:.2e}"
    return fused, "fused"
