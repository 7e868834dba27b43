"""Helpers the embedding tests share: torchvision v2's eval recipe, the reference that the
torch-only preprocessing (embedding/transforms.py) is held to."""

import torch

from embedding.config import ModelConfig
from embedding.transforms import SMALL_IMAGE


def v2_eval(cfg: ModelConfig):
    """torchvision v2's eval recipe, the reference: small images resized to the model's size,
    large ones' short side to size / crop_pct then the centre crop; ToDtype, Normalize."""
    from torchvision.transforms import v2

    from embedding.transforms import ToChannels, resize_side

    if cfg.image_size <= SMALL_IMAGE:
        geo = [v2.Resize((cfg.image_size, cfg.image_size), antialias=True)]
    else:
        mode = v2.InterpolationMode(cfg.interpolation)
        geo = [v2.Resize(resize_side(cfg), mode, antialias=True), v2.CenterCrop(cfg.image_size)]
    norm = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(cfg.mean), list(cfg.std))]
    return v2.Compose([ToChannels(cfg.in_channels), *geo, *norm])
