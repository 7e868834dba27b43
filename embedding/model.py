"""EmbeddingNet = backbone + linear projection to d + L2 normalisation (paper §3.1).

`v = normalize(W · backbone(x))`; cosine similarity between two embeddings is their dot product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class Conv4(nn.Module):
    """The small 4-layer convnet: 4 x [3x3 conv 64, BatchNorm, ReLU, 2x2 max-pool]."""

    def __init__(self, in_channels: int, image_size: int, width: int = 64):
        super().__init__()
        layers: list[nn.Module] = []
        c, s = in_channels, image_size
        for _ in range(4):
            layers += [
                nn.Conv2d(c, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            c, s = width, s // 2
        self.features = nn.Sequential(*layers)
        self.out_dim = width * max(s, 1) ** 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, out_dim)
        return torch.flatten(self.features(x), 1)


def _resnet(arch: str, in_channels: int, small_stem: bool) -> tuple[nn.Module, int]:
    import torchvision

    net = getattr(torchvision.models, arch)(weights=None)
    if small_stem:
        # CIFAR-style stem for small images: 3x3 stride-1 conv, no max-pool.
        net.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    out_dim = net.fc.in_features
    net.fc = nn.Identity()
    return net, out_dim


def build_backbone(cfg: ModelConfig) -> tuple[nn.Module, int]:
    """Return (backbone, feature dim) for `cfg.arch`."""
    if cfg.arch == "conv4":
        m = Conv4(cfg.in_channels, cfg.image_size)
        return m, m.out_dim
    return _resnet(cfg.arch, cfg.in_channels, cfg.small_stem)


class EmbeddingNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.backbone, self.feature_dim = build_backbone(cfg)
        self.embed = nn.Linear(self.feature_dim, cfg.embedding_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate backbone features, (B, feature_dim)."""
        return self.backbone(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Unnormalised d-dim projection, (B, d); the softmax baseline's classifier reads this."""
        return self.embed(self.backbone(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Unit-norm embeddings v, (B, d) float."""
        return F.normalize(self.project(x).float(), dim=1)
