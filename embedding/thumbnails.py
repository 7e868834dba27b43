"""Small preview images kept in the gallery store for the web page (`GET
/gallery/items/{id}/thumbnail`): at most `side` pixels on the long edge, PNG for grey images
(Fashion-MNIST's 28x28 items are ~0.4 KB), JPEG for colour, and never more than `max_bytes`."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

DEFAULT_SIDE = 96
DEFAULT_MAX_BYTES = 32 * 1024


def make_thumbnail(
    img: Image.Image, side: int = DEFAULT_SIDE, max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes | None:
    """PNG (grey) or JPEG (colour) bytes of `img` shrunk to fit side x side; None if even the
    most compressed encoding exceeds max_bytes."""
    im = img
    if im.mode in ("RGBA", "LA", "P", "PA"):  # flatten transparency on white
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(bg, im)
    im = im.convert("L" if im.mode in ("L", "LA", "I", "I;16", "F", "1") else "RGB")
    im.thumbnail((side, side), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    if im.mode == "L":
        im.save(buf, format="PNG", optimize=True)
        if buf.tell() <= max_bytes:
            return buf.getvalue()
    for quality in (85, 60, 35):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality, optimize=True)
        if buf.tell() <= max_bytes:
            return buf.getvalue()
    return None


def tensor_thumbnail(x, side: int = DEFAULT_SIDE) -> bytes | None:
    """Thumbnail of a dataset item: a uint8 tensor (C, H, W) / (H, W) or a PIL image."""
    if isinstance(x, Image.Image):
        return make_thumbnail(x, side)
    a = np.asarray(x)
    if a.ndim == 3:
        a = a.transpose(1, 2, 0)
        a = a[:, :, 0] if a.shape[2] == 1 else a
    return make_thumbnail(Image.fromarray(a.astype(np.uint8)), side)


def thumbnail_mime(data: bytes) -> str:
    return "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
