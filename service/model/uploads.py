"""Uploads into model input: each upload's header read and checked against the limits, the
image decoded (EXIF orientation applied, colour converted) and preprocessed to uint8 pixels at
the model's size, on the process that runs the event loop (the front); small images inline,
large ones in a thread, a bounded number of requests at a time. Small images to classify are
left encoded when a model process runs the model: it decodes them (`decode`), which took a fifth
of the front's CPU on a 28x28 /classify (docs/PERFORMANCE.md). The image I/O itself (sniffing,
opening, loading) is embedder.py's; the pixels are `Preprocessing.pixels`."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from anyio import to_thread

from embedding.sysalloc import release_free_memory
from embedding.thumbnails import make_thumbnail
from service.config import Settings
from service.model.embedder import (
    FORMATS,
    ImageError,
    Preprocessing,
    load_image,
    open_image,
    png_size,
)

# Images up to this many pixels (per request) are decoded on the event loop: ~50 us for a
# 28x28 PNG, against ~150 us+ for a hop to a worker thread and back under load.
INLINE_PIXELS = 96 * 96
# Requests decoding large images at the same time: bounds the decoded pixels in memory.
DECODE_SLOTS = 2
# A request that decoded more pixels than this gives the freed memory back to the OS after it
# (a 6000 x 6000 PNG is 108 MB decoded); smaller ones leave the heap as it is.
TRIM_AFTER_PIXELS = 4_000_000


@dataclass
class Prepared:
    """An upload as the model takes it: its pixels, or (`encoded`) its header checked and the
    bytes left for the model process to decode (`prepare_async(encoded=True)`)."""

    pixels: np.ndarray | None  # uint8 (C, H, W), Embedder.pixels; None: encoded
    data: bytes
    mime: str
    thumbnail: bytes | None = None  # when asked for (gallery adds with SNCA_THUMBNAILS)
    name: str = "image"  # what its problems call it ("images[2]")

    @property
    def encoded(self) -> bool:
        return self.pixels is None


# requests decoding large images at once in this process (each holds one decoded image at a time)
_DECODE_SLOTS = threading.BoundedSemaphore(DECODE_SLOTS)


@dataclass
class Uploads:
    """Uploads into the input of the model `embedder` preprocesses for, under `settings`'
    limits (SNCA_MAX_IMAGE_PIXELS, SNCA_MAX_REQUEST_PIXELS, SNCA_THUMBNAIL_SIDE)."""

    settings: Settings
    embedder: Preprocessing

    def prepare(self, data: bytes, name: str) -> Prepared:
        """Decode + preprocess one upload (blocking; see `prepare_async`)."""
        return self.prepare_image(
            open_image(data, self.settings.max_image_pixels, name), data, name
        )

    def prepare_image(self, img, data: bytes, name: str, thumbnail: bool = False) -> Prepared:
        """An opened image (embedder.open_image: limits checked) -> what the model takes."""
        img, mime = load_image(img, name, self.embedder.decode_side)
        thumb = make_thumbnail(img, self.settings.thumbnail_side) if thumbnail else None
        return Prepared(self.embedder.pixels(img), data, mime, thumb, name)

    async def prepare_async(
        self,
        datas: list[bytes],
        names: list[str],
        thumbnails: bool = False,
        encoded: bool = False,
    ) -> list[Prepared]:
        """Decode + preprocess uploads. Every header is read first, on the event loop (cheap,
        bounded): the request's pixels together must be within SNCA_MAX_REQUEST_PIXELS (413
        `too_many_pixels` before anything is decoded). Small images (at most INLINE_PIXELS in
        all, e.g. 28x28 or 64x64) are decoded there too, because a thread hop costs more than
        decoding them; larger ones in a thread, one at a time, each decoded image dropped
        once it is the model's input, and at most DECODE_SLOTS requests decoding at once: a
        request holds at most one decoded image. `encoded` (the model process decodes them,
        `decode`): small images are left encoded once their headers pass."""
        s = self.settings
        if encoded and not thumbnails and len(datas) == 1:
            size = png_size(datas[0])
            if size is not None and 0 < size[0] * size[1] <= min(
                INLINE_PIXELS, s.max_image_pixels, s.max_request_pixels
            ):
                # one small PNG (the usual query): its header read without Pillow; whatever else
                # is wrong with it the model process's open_image finds, as this one's would, and
                # with a single image no other problem could have come first
                return [Prepared(None, datas[0], FORMATS["PNG"], None, names[0])]
        imgs = [open_image(d, s.max_image_pixels, n) for d, n in zip(datas, names, strict=True)]
        pixels = sum(i.size[0] * i.size[1] for i in imgs)
        if pixels > s.max_request_pixels:
            raise ImageError(
                413,
                f"the {len(imgs)} images have {pixels} pixels together; the limit is "
                f"{s.max_request_pixels} per request (SNCA_MAX_REQUEST_PIXELS)",
                "too_many_pixels",
            )
        if pixels <= INLINE_PIXELS and encoded and not thumbnails:
            return [
                Prepared(None, d, FORMATS[i.format], None, n)
                for i, d, n in zip(imgs, datas, names, strict=True)
            ]
        if pixels <= INLINE_PIXELS:
            t = thumbnails
            return [
                self.prepare_image(i, d, n, t) for i, d, n in zip(imgs, datas, names, strict=True)
            ]
        return await to_thread.run_sync(self._decode_large, imgs, datas, names, thumbnails)

    def decode(self, data: bytes, name: str) -> np.ndarray:
        """The pixels of an upload left encoded (`prepare_async(encoded=True)`), decoded where
        the model runs; ImageError as the front would have raised it."""
        return self.prepare(data, name).pixels

    def _decode_large(self, imgs: list, datas, names, thumbnails: bool) -> list[Prepared]:
        out, decoded = [], 0
        with _DECODE_SLOTS:
            try:
                for i in range(len(imgs)):
                    out.append(self.prepare_image(imgs[i], datas[i], names[i], thumbnails))
                    decoded += imgs[i].size[0] * imgs[i].size[1]  # as decoded (JPEG: reduced)
                    imgs[i].close()
                    imgs[i] = None  # its decoded pixels go now, not with the whole request
            finally:
                for img in imgs:
                    if img is not None:
                        img.close()
                if decoded > TRIM_AFTER_PIXELS or any(img is not None for img in imgs):
                    # back to the OS, not kept for the next request. Only after large images:
                    # malloc_trim also returns the model's freed activation buffers (the heap
                    # keeps them, embedding/sysalloc.py), which the next forward then faults
                    # in again: trimming after every photo made ResNet-50's forward at 224 px
                    # 75 instead of 45 ms (docs/PERFORMANCE.md)
                    release_free_memory()
        return out
