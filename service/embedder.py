"""Image decoding (content-sniffed, size-checked) and the model forward, off the event loop."""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from embedding.inference import autocast_context
from embedding.model import EmbeddingNet
from embedding.transforms import eval_transform

# What the service accepts, by the format Pillow reads from the bytes (never the filename).
FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
    "GIF": "image/gif",
}


class ImageError(Exception):
    """A client's image is unusable; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def decode_image(data: bytes, max_pixels: int, name: str = "image") -> tuple[Image.Image, str]:
    """bytes -> (RGB/L/... PIL image with EXIF orientation applied, MIME type).

    415 for anything that is not one of FORMATS, 413 above `max_pixels`, 400 for a file that
    claims a format but does not decode (truncated, corrupt, decompression bomb)."""
    if not data:
        raise ImageError(400, f"{name}: the file is empty")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise ImageError(
            415, f"{name}: not an image ({', '.join(FORMATS)} are accepted)"
        ) from None
    except Image.DecompressionBombError as e:
        raise ImageError(413, f"{name}: too many pixels ({e})") from None
    except (OSError, ValueError) as e:
        raise ImageError(400, f"{name}: cannot be decoded: {e}") from None
    if img.format not in FORMATS:
        raise ImageError(415, f"{name}: {img.format} images are not accepted ({', '.join(FORMATS)} are)")
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(400, f"{name}: the image has no pixels ({w}x{h})")
    if w * h > max_pixels:
        raise ImageError(413, f"{name}: {w}x{h} = {w * h} pixels; the limit is {max_pixels}")
    fmt = img.format
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.seek(0)  # animated images: the first frame
            img.load()
            img = ImageOps.exif_transpose(img)  # (returns a copy without .format)
    except (
        OSError,
        ValueError,
        SyntaxError,
        EOFError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as e:
        raise ImageError(400, f"{name}: cannot be decoded as {FORMATS[fmt]}: {e}") from None
    return img, FORMATS[fmt]


class Embedder:
    """The model in eval mode with its eval transform (both from the model card)."""

    def __init__(self, model: EmbeddingNet, device: torch.device, amp: bool = True):
        self.model = model.to(device).eval()
        self.device = device
        self.amp = amp
        self.transform = eval_transform(model.config)
        self.dim = model.config.embedding_dim

    def preprocess(self, img: Image.Image) -> torch.Tensor:
        """PIL image -> normalised (C, H, W) float tensor."""
        try:
            return self.transform(img)
        except (OSError, ValueError) as e:
            raise ImageError(400, f"image cannot be converted: {e}") from None

    @torch.inference_mode()
    def embed(self, batch: torch.Tensor) -> np.ndarray:
        """(B, C, H, W) -> (B, d) float32 unit rows (numpy)."""
        with autocast_context(self.device, self.amp):
            v = self.model(batch.to(self.device, non_blocking=True))
        return v.float().cpu().numpy()

    def warmup(self, sizes=(1, 8)) -> None:
        """One forward per batch size so the first request is not the slow one."""
        c, s = self.model.config.in_channels, self.model.config.image_size
        for b in sizes:
            self.embed(torch.zeros(b, c, s, s))
