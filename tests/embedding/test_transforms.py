"""The service's split transform (per-image geometry, per-batch normalisation) is exactly the
eval transform that training, evaluation and the index builder use."""

import numpy as np
import pytest
import torch
from PIL import Image

from embedding.config import ModelConfig
from embedding.transforms import eval_geometry, eval_transform, normalize_batch


def _images(rng):
    grey = rng.integers(0, 256, (28, 28), dtype=np.uint8)
    rgb = rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)
    rgba = rng.integers(0, 256, (17, 23, 4), dtype=np.uint8)
    big = rng.integers(0, 256, (300, 260, 3), dtype=np.uint8)
    return [
        Image.fromarray(grey),  # L, already the model's size (fast path)
        Image.fromarray(rgb),
        Image.fromarray(rgba),
        Image.fromarray(big),
        Image.fromarray(grey).convert("P"),
        torch.from_numpy(grey)[None],  # uint8 tensor input, as datasets give
    ]


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(in_channels=1, image_size=28, mean=(0.286,), std=(0.353,)),
        ModelConfig(in_channels=3, image_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)),
        ModelConfig(
            arch="resnet18", in_channels=3, image_size=96, mean=(0.5,) * 3, std=(0.25,) * 3
        ),
    ],
)
def test_geometry_then_batch_normalisation_equals_eval_transform(cfg):
    rng = np.random.default_rng(0)
    imgs = _images(rng)
    whole = torch.stack([eval_transform(cfg)(im) for im in imgs])
    geo = [eval_geometry(cfg)(im) for im in imgs]
    assert all(g.dtype == torch.uint8 for g in geo)
    split = normalize_batch(torch.stack(geo), cfg)
    assert split.shape == (len(imgs), cfg.in_channels, cfg.image_size, cfg.image_size)
    assert torch.equal(split, whole)  # bit-identical, not just close
