"""EmbeddingNet = backbone + linear projection to d + L2 normalisation (paper §3.1).

`v = normalize(W · backbone(x))`; cosine similarity between two embeddings is their dot product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TIMM_PREFIX, ModelConfig
from .errors import ArtifactError


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


def _timm(name: str, in_channels: int) -> tuple[nn.Module, int]:
    """A timm model without its classifier (num_classes=0: pooled features), random weights;
    `--init timm:NAME` loads its pretrained ones (training/init/timm_hub.py)."""
    try:
        import timm
    except ImportError:
        raise ArtifactError(
            f"this model's backbone is {TIMM_PREFIX}{name}, which needs timm: "
            "pip install 'snca[timm]'"
        ) from None
    try:
        net = timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_channels)
    except RuntimeError as e:  # "Unknown model (...)"
        raise ArtifactError(f"{TIMM_PREFIX}{name}: {e}") from None
    return net, int(net.num_features)


def build_backbone(cfg: ModelConfig) -> tuple[nn.Module, int]:
    """Return (backbone, feature dim) for `cfg.arch`."""
    if cfg.arch.startswith(TIMM_PREFIX):
        return _timm(cfg.arch[len(TIMM_PREFIX) :], cfg.in_channels)
    if cfg.arch == "conv4":
        m = Conv4(cfg.in_channels, cfg.image_size)
        return m, m.out_dim
    return _resnet(cfg.arch, cfg.in_channels, cfg.small_stem)


class EmbeddingNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.backbone, self.feature_dim = build_backbone(cfg)
        # oneDNN's convolutions and pools run NHWC natively: with the weights channels-last every
        # conv takes that path (the input is converted once, in the first conv). On this 2-core
        # CPU, batch 8: conv4 3.6 -> 1.9 ms, EfficientNet-Lite0 277 -> 155-168, ResNet-18 285 ->
        # 219; a conv4 training step (batch 128) 126 -> 88 ms. The same values: the weights'
        # layout, not their numbers (state_dict, fingerprints and files are unchanged).
        self.backbone.to(memory_format=torch.channels_last)
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


# The vector spaces a gallery can live in. "embedding": the NCA embedding v (the paper's; the
# memory bank holds it). "spatial": the backbone's last feature map before its final pooling,
# flattened and L2-normalised (conv4 on 28 x 28: block 4 before its max-pool, 64 x 3 x 3 = 576;
# ResNet: layer4's output). The projection is trained to separate the *base* classes; the
# un-pooled map keeps where on the image the evidence is (sleeve length, collar), which is what
# novel labels added from a few images need: generalized 5-shot HM 0.611 -> 0.656 on the
# held-out T-shirt/Pullover/Shirt split (docs/RESULTS.md).
SPACES = ("embedding", "spatial")


class SpatialNet(nn.Module):
    """x -> normalize(flatten(last feature map)), (B, C*h*w) float. Same `config` as the model."""

    def __init__(self, model: EmbeddingNet):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.model.backbone
        if isinstance(b, Conv4):
            h = b.features[:-1](x)  # every layer but the last max-pool: (B, 64, h, w)
        elif hasattr(b, "forward_features"):  # timm: the unpooled features, (B, C, h, w)
            h = b.forward_features(x)
        else:  # torchvision ResNet: its forward up to (not including) the average pool
            h = b.maxpool(b.relu(b.bn1(b.conv1(x))))
            h = b.layer4(b.layer3(b.layer2(b.layer1(h))))  # (B, 512, h, w)
        return F.normalize(torch.flatten(h, 1).float(), dim=1)


def in_space(model: EmbeddingNet, space: str) -> nn.Module:
    """The module that maps images to vectors of `space` (see SPACES)."""
    if space == "embedding":
        return model
    if space == "spatial":
        return SpatialNet(model)
    raise ValueError(f"unknown vector space {space!r} (choose from {', '.join(SPACES)})")


def space_dim(model: EmbeddingNet, space: str) -> int:
    """Vector length of `space` for this model (one forward of a blank image)."""
    if space == "embedding":
        return model.config.embedding_dim
    return blank_width(model, in_space(model, space))


def blank_width(model: EmbeddingNet, fn) -> int:
    """The width of fn(x) (its first output if a tuple) for one blank image of the model's
    size, in eval mode: how long the vectors of a module built on `model` are."""
    c, s = model.config.in_channels, model.config.image_size
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            x = torch.zeros(1, c, s, s, device=next(model.parameters()).device)
            out = fn(x)
            return int((out[0] if isinstance(out, tuple) else out).shape[1])
    finally:
        model.train(was)
