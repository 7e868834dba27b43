"""A net for the model-path tests (test modules import this, never each other)."""

from __future__ import annotations

import torch

from embedding.config import ModelConfig
from embedding.model import EmbeddingNet


def net_with_statistics(cfg: ModelConfig | None = None, seed: int = 0) -> EmbeddingNet:
    """An EmbeddingNet of `cfg` (default: conv4) in eval mode with BatchNorm running statistics
    that matter, so that folding or exporting them must be exact to pass."""
    torch.manual_seed(seed)
    m = EmbeddingNet(cfg or ModelConfig()).eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    return m
