"""Eval and train transforms, built from ModelConfig only.

Both accept a PIL image (any mode) or a uint8 tensor (C, H, W) and return a normalised float
tensor (in_channels, image_size, image_size).

Preprocessing runs on torch alone, with torchvision v2's arithmetic reproduced bit for bit
(tests/embedding/test_transforms_parity.py): importing torchvision costs ~1.3 s of every process
start (it imports torch._dynamo), and its per-call dispatch was a quarter of a small model's
training epoch. The service runs `eval_geometry` per image and `normalize_batch` per micro-batch;
`eval_transform` is the two per image. Only the large-image augmentation (RandomResizedCrop)
uses torchvision, imported when it is built.
"""

from __future__ import annotations

import platform

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

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
            t = _pil_to_tensor(img)
        else:
            t = img
        if t.ndim == 2:
            t = t.unsqueeze(0)
        c = t.shape[0]
        if c == self.channels:
            return t
        if self.channels == 1 and c == 3:  # ITU-R 601 luma, as torchvision's rgb_to_grayscale
            r, g, b = t.unbind(dim=-3)
            grey = r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114)
            return grey.unsqueeze(dim=-3).to(t.dtype)
        if c == 1:
            return t.expand(self.channels, -1, -1).contiguous()
        raise ValueError(f"cannot convert a {c}-channel image to {self.channels} channels")


def _pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 (C, H, W) of a PIL image (L or RGB), as torchvision's pil_to_tensor."""
    a = np.array(img, copy=True)
    t = torch.from_numpy(a)
    return t[None] if a.ndim == 2 else t.permute(2, 0, 1)


def resize_side(cfg: ModelConfig) -> int:
    """The short side an image is resized to before the eval transform's crop."""
    return cfg.image_size if cfg.image_size <= SMALL_IMAGE else round(cfg.image_size / cfg.crop_pct)


def _filter(cfg: ModelConfig):
    from torchvision.transforms import v2

    return v2.InterpolationMode(cfg.interpolation)


def _normalize_ops(cfg: ModelConfig) -> list:
    from torchvision.transforms import v2

    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(cfg.mean), list(cfg.std))]


def eval_transform(cfg: ModelConfig):
    """Deterministic preprocessing used for evaluation, index building and serving, one image
    at a time: eval_geometry then normalize_batch, torchvision v2's Resize (+ CenterCrop),
    ToDtype and Normalize bit for bit (tests/embedding/test_transforms_parity.py) at half its
    per-image cost (49 vs 105 us a Fashion-MNIST image)."""
    return _Eval(cfg)


class _Eval:
    def __init__(self, cfg: ModelConfig):
        self.geometry, self.cfg = _Geometry(cfg), cfg

    def __call__(self, img) -> torch.Tensor:  # -> (C, S, S) float32
        return normalize_batch(self.geometry(img)[None], self.cfg)[0]


def _native_uint8(mode: str) -> bool:
    """Whether torchvision resizes uint8 in place for `mode` on this CPU (bilinear: only with
    AVX2/AVX-512 kernels, or on ARM; bicubic: always); else it resizes in float32 and rounds."""
    if mode == "bilinear":
        cap = torch.backends.cpu.get_cpu_capability()
        return cap in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    return mode == "bicubic"


def resize_uint8(t: torch.Tensor, size, mode: str = "bilinear") -> torch.Tensor:
    """v2.Resize(size, mode, antialias=True) of a uint8 (C, H, W), on torch alone: `size` an
    int (the short side; the long one int(size * long / short)) or (h, w)."""
    h, w = t.shape[-2:]
    if isinstance(size, int):
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size, int(size * long / short)
        nh, nw = (new_long, new_short) if w <= h else (new_short, new_long)
    else:
        nh, nw = size
    if (nh, nw) == (h, w) or t.numel() == 0:
        return t
    antialias = mode in ("bilinear", "bicubic")
    align = False if antialias else None
    x = t.reshape(-1, *t.shape[-3:])
    native = _native_uint8(mode) or mode == "nearest"
    y = F.interpolate(
        x if native else x.float(), size=[nh, nw], mode=mode, align_corners=align,
        antialias=antialias,
    )  # fmt: skip
    if not native:
        if mode == "bicubic":
            y = y.clamp_(0, 255)
        y = y.round_().to(torch.uint8)
    return y.reshape(*t.shape[:-2], nh, nw)


def center_crop(t: torch.Tensor, side: int) -> torch.Tensor:
    """v2.CenterCrop(side) of an image at least `side` on both sides."""
    h, w = t.shape[-2:]
    top, left = round((h - side) / 2.0), round((w - side) / 2.0)
    return t[..., top : top + side, left : left + side]


class _Geometry:
    """ToChannels + the eval resize (and crop), on torch alone: the same pixels as
    torchvision v2's eval ops. A small image already at the model's size is not resized."""

    def __init__(self, cfg: ModelConfig):
        self.channels = ToChannels(cfg.in_channels)
        self.size = (cfg.image_size, cfg.image_size)
        self.small = cfg.image_size <= SMALL_IMAGE
        self.side = resize_side(cfg)
        self.mode = cfg.interpolation

    def __call__(self, img) -> torch.Tensor:
        t = self.channels(img)
        if self.small:
            return t if tuple(t.shape[-2:]) == self.size else resize_uint8(t, self.size)
        return center_crop(resize_uint8(t, self.side, self.mode), self.size[0])


def eval_geometry(cfg: ModelConfig) -> _Geometry:
    """The first half of `eval_transform`: any image -> uint8 (C, H, W) at the model's size.
    The service runs this per image and `normalize_batch` once per micro-batch, which is the
    same arithmetic as `eval_transform` (tested) at a fraction of the per-image overhead."""
    return _Geometry(cfg)


def normalize_batch(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The second half of `eval_transform` on a stacked uint8 batch (B, C, H, W) -> float."""
    x = x.to(torch.float32).mul_(1.0 / 255)  # as v2.ToDtype(float32, scale=True)
    mean = torch.as_tensor(cfg.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.as_tensor(cfg.std, dtype=torch.float32).view(-1, 1, 1)
    return x.sub(mean).div_(std)  # as v2.Normalize


def train_transform(cfg: ModelConfig):
    """Augmentation for training: pad-and-crop + flip for small images (paper's CIFAR recipe),
    random-resized-crop + flip for large ones (paper's ImageNet recipe)."""
    if cfg.image_size <= SMALL_IMAGE:
        return _PadCropFlip(cfg)
    from torchvision.transforms import v2

    geo = [
        v2.RandomResizedCrop(
            cfg.image_size, scale=(0.2, 1.0), interpolation=_filter(cfg), antialias=True
        ),
        v2.RandomHorizontalFlip(),
    ]
    return v2.Compose([ToChannels(cfg.in_channels), *geo, *_normalize_ops(cfg)])


class _PadCropFlip:
    """The small-image augmentation on torch alone: the eval geometry (resized to the model's
    size), zero-padded by size // 8 on each side, a crop of the model's size at a uniform
    offset, flipped left-right with p = 1/2, normalised. The distribution of torchvision v2's
    Resize + RandomCrop(padding) + RandomHorizontalFlip (tests/embedding/test_transforms.py)
    at 103 vs 275 us a Fashion-MNIST image: a quarter of a conv4 epoch was v2's dispatch."""

    def __init__(self, cfg: ModelConfig):
        self.geometry, self.cfg = _Geometry(cfg), cfg
        self.pad = max(cfg.image_size // 8, 1)

    def __call__(self, img) -> torch.Tensor:  # -> (C, S, S) float32
        t = self.geometry(img)  # (C, S, S) uint8
        p, s = self.pad, t.shape[-1]
        top, left = torch.randint(0, 2 * p + 1, (2,)).tolist()
        t = F.pad(t, (p, p, p, p))[..., top : top + s, left : left + s]
        if torch.rand(()).item() < 0.5:
            t = t.flip(-1)
        return normalize_batch(t[None], self.cfg)[0]
