"""Real colour photographs for the open-set tests: scikit-image ships a few in its wheel
(a coffee cup, a cat, an astronaut, a rocket, a motorcycle, coins, the moon, ...). Crops of
them are what a user uploads: PNG bytes at their own size and in colour."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# the photos that are not the cup (the "unrelated" ones)
OTHERS = (
    "chelsea",
    "astronaut",
    "rocket",
    "camera",
    "coins",
    "moon",
    "page",
    "text",
    "brick",
    "grass",
    "gravel",
    "hubble_deep_field",
    "retina",
    "cell",
)
CUP_BOX = (90, 0, 490, 400)  # where the cup and saucer are in skimage's coffee.png


def photo(name: str) -> Image.Image:
    import skimage.data

    if name == "motorcycle":
        im = skimage.data.stereo_motorcycle()[0]
    else:
        im = getattr(skimage.data, name)()
    if im.dtype == bool:
        im = im.astype(np.uint8) * 255
    if im.ndim == 3 and im.shape[2] == 4:
        im = im[..., :3]
    return Image.fromarray(im)


def crops(img: Image.Image, n: int, seed: int, box=None, flip: bool = False) -> list[Image.Image]:
    """`n` square crops: around `box` (its size +-15%, shifted by up to 30 px), else anywhere
    in the image at half to full its short side; mirrored at random with `flip`."""
    r = np.random.default_rng(seed)
    out = []
    w, h = img.size
    for _ in range(n):
        if box is not None:
            x0, y0, x1, y1 = box
            s = (x1 - x0) * r.uniform(0.85, 1.15)
            cx, cy = (x0 + x1) / 2 + r.uniform(-30, 30), (y0 + y1) / 2 + r.uniform(-30, 30)
            c = img.crop((int(cx - s / 2), int(cy - s / 2), int(cx + s / 2), int(cy + s / 2)))
        else:
            s = int(min(w, h) * r.uniform(0.5, 1.0))
            x, y = int(r.integers(0, w - s + 1)), int(r.integers(0, h - s + 1))
            c = img.crop((x, y, x + s, y + s))
        if flip and r.random() < 0.5:
            c = c.transpose(Image.FLIP_LEFT_RIGHT)
        out.append(c)
    return out


def png_bytes(img: Image.Image) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def unrelated(per_photo: int = 2, seed: int = 3) -> list[bytes]:
    """Crops of every photo but the cup's, and a few portraits (scikit-image's LFW subset)."""
    import skimage.data

    out = [png_bytes(c) for name in OTHERS for c in crops(photo(name), per_photo, seed)]
    faces = skimage.data.lfw_subset()[:6]
    out += [png_bytes(Image.fromarray((f * 255).astype(np.uint8))) for f in faces]
    return out
