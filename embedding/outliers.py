"""Synthetic outliers: images of no class, made from a batch of real ones (outlier exposure in
training, training/nca.py; the far-OOD measurements, benchmarks/open_set.py).

Each family maps uint8 images (B, C, H, W) and a generator to uint8 images of the same shape,
so it works for any dataset's size and channels (nothing assumes a black background or 28 x 28).
TRAINED are the families outlier exposure trains on by default; HELD_OUT are never trained on
and measure whether what was learnt is "not this world" rather than "not these families".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported in the functions: the registry's names cost no torch (snca-train checks
# --outlier-families before it loads torch)
Family = Callable[["torch.Tensor", "torch.Generator"], "torch.Tensor"]


def _u8(x: torch.Tensor) -> torch.Tensor:
    import torch

    return x.round().clamp(0, 255).to(torch.uint8)


def uniform_noise(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    import torch

    return torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8)


def gaussian_noise(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    import torch

    b = x.shape[0]
    mean = torch.rand(b, 1, 1, 1, generator=g) * 255
    std = 10 + torch.rand(b, 1, 1, 1, generator=g) * 80
    return _u8(mean + std * torch.randn(x.shape, generator=g))


def flat(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One grey (or colour) level over the whole image."""
    import torch

    b, c = x.shape[:2]
    return _u8(torch.rand(b, c, 1, 1, generator=g) * 255).expand(x.shape).contiguous()


def inverted(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return 255 - x


def permuted_blurred(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The image's own pixels in a random order, then blurred: its intensity histogram, no
    shape (Hendrycks et al.'s "permuted" family)."""
    import torch
    import torch.nn.functional as F

    b, c, h, w = x.shape
    perm = torch.randperm(h * w, generator=g)
    y = x.flatten(2)[:, :, perm].reshape(b, c, h, w).float()
    return _u8(F.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=False))


def patch_shuffled(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The image cut in a 4 x 4 grid of patches, shuffled: local texture, no global shape."""
    import torch

    b, c, h, w = x.shape
    n = 4
    ph, pw = h // n, w // n
    y = x[:, :, : ph * n, : pw * n]
    patches = y.unfold(2, ph, ph).unfold(3, pw, pw).reshape(b, c, n * n, ph, pw)
    perm = torch.randperm(n * n, generator=g)
    patches = patches[:, :, perm].reshape(b, c, n, n, ph, pw).permute(0, 1, 2, 4, 3, 5)
    out = x.clone()
    out[:, :, : ph * n, : pw * n] = patches.reshape(b, c, ph * n, pw * n)
    return out


def mixture(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Two images of the batch blended half and half (two objects, neither)."""
    import torch

    other = x[torch.randperm(x.shape[0], generator=g)]
    return _u8((x.float() + other.float()) / 2)


def checkerboard(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Periodic patterns of random cell size and contrast (held out)."""
    import torch

    b, c, h, w = x.shape
    out = torch.empty_like(x)
    for i in range(b):
        cell = int(torch.randint(1, max(2, h // 3), (1,), generator=g))
        lo, hi = sorted(torch.randint(0, 256, (2,), generator=g).tolist())
        yy = torch.arange(h).view(h, 1) // cell
        xx = torch.arange(w).view(1, w) // cell
        out[i] = torch.where((yy + xx) % 2 == 0, hi, lo).to(torch.uint8).expand(c, h, w)
    return out


def smooth_noise(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Low-frequency random fields: blobs (held out)."""
    import torch
    import torch.nn.functional as F

    b, c, h, w = x.shape
    coarse = torch.rand(b, c, max(2, h // 7), max(2, w // 7), generator=g) * 255
    return _u8(F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False))


def salt_pepper(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Black and white specks on mid grey (held out)."""
    import torch

    r = torch.rand(x.shape, generator=g)
    out = torch.full_like(x, 128)
    out[r < 0.15] = 0
    out[r > 0.85] = 255
    return out


FAMILIES: dict[str, Family] = {
    "uniform_noise": uniform_noise,
    "gaussian_noise": gaussian_noise,
    "flat": flat,
    "inverted": inverted,
    "permuted_blurred": permuted_blurred,
    "patch_shuffled": patch_shuffled,
    "mixture": mixture,
    "checkerboard": checkerboard,
    "smooth_noise": smooth_noise,
    "salt_pepper": salt_pepper,
}
TRAINED = (
    "uniform_noise",
    "gaussian_noise",
    "flat",
    "inverted",
    "permuted_blurred",
    "patch_shuffled",
    "mixture",
)
HELD_OUT = ("checkerboard", "smooth_noise", "salt_pepper")


def make(x: torch.Tensor, families: tuple[str, ...], g: torch.Generator) -> torch.Tensor:
    """One outlier per image of `x` (uint8 (B, C, H, W)), each of a family drawn at random."""
    import torch

    pick = torch.randint(0, len(families), (x.shape[0],), generator=g)
    out = torch.empty_like(x)
    for k, name in enumerate(families):
        idx = (pick == k).nonzero().flatten()
        if len(idx):
            out[idx] = FAMILIES[name](x[idx], g)
    return out
