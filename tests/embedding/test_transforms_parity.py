"""The preprocessing (embedding/transforms.py: eval_geometry + normalize_batch, per batch as the
service runs it and per image as eval_transform, on torch alone so that a serving process never
imports torchvision) gives the very tensors of torchvision v2's eval recipe: random
images of every kind the service decodes, every interpolation, small and large models, and
torchvision's float path on CPUs without native uint8 resizing."""

import numpy as np
import pytest
import torch
from PIL import Image

from embedding.config import ModelConfig
from embedding.transforms import eval_geometry, eval_transform, normalize_batch

from .helpers import v2_eval


def images(rng, n):
    """PIL images (L, RGB, RGBA, P, I;16) and uint8 tensors of random sizes."""
    out = []
    for _ in range(n):
        h, w = int(rng.integers(9, 420)), int(rng.integers(9, 420))
        kind = rng.choice(["L", "RGB", "RGBA", "P", "I;16", "tensor1", "tensor3"])
        if kind.startswith("tensor"):
            c = int(kind[-1])
            out.append(torch.from_numpy(rng.integers(0, 256, (c, h, w), dtype=np.uint8)))
        elif kind == "I;16":
            out.append(Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16)))
        else:
            rgba = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
            out.append(rgba if kind == "RGBA" else rgba.convert(kind))
    return out


CONFIGS = [
    ModelConfig(in_channels=1, image_size=28),
    ModelConfig(in_channels=3, image_size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3)),
    *[
        ModelConfig(
            in_channels=3,
            image_size=224,
            mean=(0.485, 0.456, 0.406),
            std=(0.229, 0.224, 0.225),
            crop_pct=crop,
            interpolation=mode,
        )
        for mode, crop in (("bilinear", 0.875), ("bicubic", 0.95), ("nearest", 1.0))
    ],
]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.image_size}-{c.interpolation}")
def test_the_serving_path_gives_eval_transforms_tensors_bit_for_bit(cfg, native, monkeypatch):
    if not native:  # a CPU without AVX2: torchvision and this path both resize in float32
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    rng = np.random.default_rng(cfg.image_size + native)
    ref, geo = v2_eval(cfg), eval_geometry(cfg)
    imgs = images(rng, 12)
    pixels = [geo(img) for img in imgs]
    assert all(p.dtype == torch.uint8 for p in pixels)
    got = normalize_batch(torch.stack(pixels), cfg)
    want = torch.stack([ref(img) for img in imgs])
    assert got.shape == want.shape == (12, cfg.in_channels, cfg.image_size, cfg.image_size)
    assert torch.equal(got, want), (got - want).abs().max()
    one = torch.stack([eval_transform(cfg)(img) for img in imgs])  # per image, as training
    assert torch.equal(one, want), (one - want).abs().max()


def test_a_serving_process_does_not_import_torchvision():
    import subprocess
    import sys

    code = (
        "import sys, service.http.app, service.model_process, service.startup, "
        "service.tools.gallery_tool; print('torchvision' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
