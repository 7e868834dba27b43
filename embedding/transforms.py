"""Eval and train transforms, built from ModelConfig only.

Both accept a PIL image (any mode) or a uint8 tensor (C, H, W) and return a normalised float
tensor (in_channels, image_size, image_size).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from .config import ModelConfig

# Images at most this large are treated as "small" (MNIST/CIFAR-like): resized as a whole and
# augmented by pad-and-crop; larger ones get the ImageNet recipe (resize + center/random crop).
SMALL_IMAGE = 64


class ToChannels:
    """Convert a PIL image (any mode: L, RGB, RGBA, P, I;16, CMYK...) or a uint8 tensor to
    `channels` channels (1 = luminance, 3 = RGB) as a uint8 tensor (C, H, W)."""

    def __init__(self, channels: int):
        self.channels = channels

    def __call__(self, img):
        if isinstance(img, Image.Image) and img.mode == "L" and self.channels == 1:
            return torch.from_numpy(np.array(img))[None]  # fast path: greyscale in, greyscale out
        if isinstance(img, Image.Image):
            if img.mode in ("I;16", "I;16B", "I;16L", "I"):
                # 16/32-bit greyscale: scale to 8 bit instead of clipping.
                arr = torch.from_numpy(np.asarray(img, dtype=np.float32))
                hi = float(arr.max()) if arr.numel() else 1.0
                arr = (arr / max(hi, 1.0) * 255.0).round().to(torch.uint8)
                img = Image.fromarray(arr.numpy(), mode="L")
            if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
                # Composite transparency onto white rather than black.
                rgba = img.convert("RGBA")
                bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                img = Image.alpha_composite(bg, rgba)
            img = img.convert("L" if self.channels == 1 else "RGB")
            t = v2.functional.pil_to_tensor(img)
        else:
            t = img
        if t.ndim == 2:
            t = t.unsqueeze(0)
        c = t.shape[0]
        if c == self.channels:
            return t
        if self.channels == 1 and c == 3:
            return v2.functional.rgb_to_grayscale(t)
        if c == 1:
            return t.expand(self.channels, -1, -1).contiguous()
        raise ValueError(f"cannot convert a {c}-channel image to {self.channels} channels")


def resize_side(cfg: ModelConfig) -> int:
    """The short side an image is resized to before the eval transform's crop."""
    return cfg.image_size if cfg.image_size <= SMALL_IMAGE else round(cfg.image_size / cfg.crop_pct)


def _filter(cfg: ModelConfig) -> v2.InterpolationMode:
    return v2.InterpolationMode(cfg.interpolation)


def _resize_ops(cfg: ModelConfig) -> list:
    if cfg.image_size <= SMALL_IMAGE:
        return [v2.Resize((cfg.image_size, cfg.image_size), antialias=True)]
    return [  # short side to size / crop_pct, then the centre crop (ImageNet's eval recipe)
        v2.Resize(resize_side(cfg), _filter(cfg), antialias=True),
        v2.CenterCrop(cfg.image_size),
    ]


def _normalize_ops(cfg: ModelConfig) -> list:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(cfg.mean), list(cfg.std))]


def eval_transform(cfg: ModelConfig) -> v2.Compose:
    """Deterministic preprocessing used for evaluation, index building and serving."""
    return v2.Compose([ToChannels(cfg.in_channels), *_resize_ops(cfg), *_normalize_ops(cfg)])


class _Geometry:
    """ToChannels + the eval resize, skipping the resize when a small image already has the
    model's size (v2.Resize to the same size is the identity; this saves ~40 us per image)."""

    def __init__(self, cfg: ModelConfig):
        self.channels = ToChannels(cfg.in_channels)
        self.size = (cfg.image_size, cfg.image_size)
        self.small = cfg.image_size <= SMALL_IMAGE
        self.resize = v2.Compose(_resize_ops(cfg))

    def __call__(self, img) -> torch.Tensor:
        t = self.channels(img)
        if self.small and tuple(t.shape[-2:]) == self.size:
            return t
        return self.resize(t)


def eval_geometry(cfg: ModelConfig) -> _Geometry:
    """The first half of `eval_transform`: any image -> uint8 (C, H, W) at the model's size.
    The service runs this per image and `normalize_batch` once per micro-batch, which is the
    same arithmetic as `eval_transform` (tested) at a fraction of the per-image overhead."""
    return _Geometry(cfg)


def normalize_batch(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The second half of `eval_transform` on a stacked uint8 batch (B, C, H, W) -> float."""
    x = v2.functional.to_dtype(x, torch.float32, scale=True)
    return v2.functional.normalize(x, list(cfg.mean), list(cfg.std))


def train_transform(cfg: ModelConfig) -> v2.Compose:
    """Augmentation for training: pad-and-crop + flip for small images (paper's CIFAR recipe),
    random-resized-crop + flip for large ones (paper's ImageNet recipe)."""
    if cfg.image_size <= SMALL_IMAGE:
        geo = [
            v2.Resize((cfg.image_size, cfg.image_size), antialias=True),
            v2.RandomCrop(cfg.image_size, padding=max(cfg.image_size // 8, 1)),
            v2.RandomHorizontalFlip(),
        ]
    else:
        geo = [
            v2.RandomResizedCrop(
                cfg.image_size, scale=(0.2, 1.0), interpolation=_filter(cfg), antialias=True
            ),
            v2.RandomHorizontalFlip(),
        ]
    return v2.Compose([ToChannels(cfg.in_channels), *geo, *_normalize_ops(cfg)])
