"""Fine-tuning that keeps what `--init` started from: the backbone's learning rate as a factor
of --lr, its first stages frozen, its BatchNorm statistics frozen (small batches estimate them
badly). Stages: conv4's four blocks; a ResNet's stem (conv1 + bn1) and layer1..layer4, so a
ResNet has five and `--freeze-stages 1` freezes the stem only."""

from __future__ import annotations

from torch import nn

from embedding.errors import SNCAError
from embedding.model import Conv4, EmbeddingNet


def stages(model: EmbeddingNet) -> list[list[nn.Module]]:
    """The backbone's stages, input first."""
    b = model.backbone
    if isinstance(b, Conv4):
        return [list(b.features[i : i + 4]) for i in range(0, len(b.features), 4)]
    if not hasattr(b, "layer4"):  # a timm backbone: its stages are named per family
        raise SNCAError(
            f"--freeze-stages: {model.config.arch} has no stages this knows; use --backbone-lr "
            "(0 holds the whole backbone) or --bn-frozen"
        )
    return [[b.conv1, b.bn1], [b.layer1], [b.layer2], [b.layer3], [b.layer4]]


def freeze(model: EmbeddingNet, n: int) -> int:
    """Freeze the first `n` stages (no gradient; their BatchNorm keeps its statistics, see
    `hold_frozen_bn`); the number of parameters frozen."""
    count = 0
    for stage in stages(model)[:n]:
        for m in stage:
            for p in m.parameters():
                p.requires_grad_(False)
                count += p.numel()
    return count


def param_groups(model: nn.Module, backbone: nn.Module, factor: float) -> list[dict]:
    """The optimizer's groups: the trainable backbone parameters at `factor` × the learning
    rate (`lr_factor`, applied at every step), everything else at 1×; frozen ones left out."""
    own = {id(p) for p in backbone.parameters()}
    train = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in train if id(p) in own], "lr_factor": factor},
        {"params": [p for p in train if id(p) not in own], "lr_factor": 1.0},
    ]
    return [g for g in groups if g["params"]]


def hold_bn(model: EmbeddingNet, all_of_backbone: bool, frozen_stages: int) -> None:
    """After model.train(): BatchNorm layers whose statistics must not move go back to eval
    mode: every one of the backbone (`--bn-frozen`), or those of the frozen stages."""
    if not all_of_backbone and not frozen_stages:
        return
    mods = (
        list(model.backbone.modules())
        if all_of_backbone
        else [m for stage in stages(model)[:frozen_stages] for s in stage for m in s.modules()]
    )
    for m in mods:
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
