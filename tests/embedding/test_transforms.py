"""The small-image training augmentation (embedding/transforms.py's pad, crop and flip on torch
alone) draws from the distribution of torchvision v2's Resize + RandomCrop(padding) +
RandomHorizontalFlip: every output is one of v2's outcomes, and every outcome occurs."""

import numpy as np
import pytest
import torch
from PIL import Image

from embedding.config import ModelConfig
from embedding.transforms import train_transform

from .helpers import v2_eval


def outcomes(cfg: ModelConfig, img) -> torch.Tensor:
    """Each of v2's (2p + 1)^2 crops of the zero-padded image, unflipped then flipped, through
    v2's eval recipe (its Resize and normalisation), (2 (2p + 1)^2, C, S, S)."""
    from torchvision.transforms.v2 import functional as TF

    s, p = cfg.image_size, max(cfg.image_size // 8, 1)
    plain = ModelConfig(**{**cfg.to_dict(), "mean": (0.0,) * cfg.in_channels,
                           "std": (1.0,) * cfg.in_channels})  # fmt: skip
    at_size = (v2_eval(plain)(img) * 255).round().to(torch.uint8)  # (C, S, S) as v2 resizes it
    padded = TF.pad(at_size, [p])
    crops = [padded[:, i : i + s, j : j + s] for i in range(2 * p + 1) for j in range(2 * p + 1)]
    every = crops + [TF.horizontal_flip(c) for c in crops]
    return torch.stack([v2_eval(cfg)(c) for c in every])


@pytest.mark.parametrize(
    "cfg, size",
    [
        (ModelConfig(in_channels=1, image_size=28, mean=(0.286,), std=(0.353,)), (28, 28)),
        (
            ModelConfig(in_channels=3, image_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)),
            (40, 30),  # resized to the model's size first
        ),
    ],
)
def test_pad_crop_flip_draws_each_of_v2s_outcomes(cfg, size):
    rng = np.random.default_rng(0)
    shape = size if cfg.in_channels == 1 else (*size, 3)
    img = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
    want = outcomes(cfg, img).flatten(1)  # (K, C*S*S)
    tf = train_transform(cfg)
    torch.manual_seed(0)
    seen = []
    for _ in range(1500):
        x = tf(img)
        assert x.shape == (cfg.in_channels, cfg.image_size, cfg.image_size)
        hit = (want == x.flatten()).all(dim=1).nonzero().flatten()
        assert len(hit) >= 1, "an output that v2 cannot give"
        seen.append(int(hit[0]))
    counts = np.bincount(seen, minlength=len(want))
    # each of the K = 98 (p = 3) or 162 (p = 4) outcomes drawn; ~1500 / K times each on average
    assert (counts > 0).all(), np.flatnonzero(counts == 0)
    flipped = counts[len(want) // 2 :].sum() / counts.sum()
    assert 0.45 < flipped < 0.55
