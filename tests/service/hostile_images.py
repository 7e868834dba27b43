"""A hostile-image corpus, generated (never committed as binaries): what users and attackers
upload. `corpus(base)` -> [(name, bytes, allowed statuses)], `base` a real 28x28 grey image.

    python -m tests.service.hostile_images OUT_DIR     # write the files, to try them by hand

Statuses are the service's documented ones: 200 decoded and classified, 400 undecodable, 413
too many pixels (decompression-bomb guard, checked from the header before decoding), 415 not an
image format the service reads (judged from the bytes, never the file name)."""

from __future__ import annotations

import io
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(side: int = 20000) -> bytes:
    """A real zlib bomb: side x side grey pixels of zeros, a few hundred KB compressed."""
    row = b"\x00" + b"\x00" * side  # filter byte + pixels
    comp = zlib.compressobj(9)
    data = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", data)
        + _png_chunk(b"IEND", b"")
    )


def exif_rotated_jpeg(img: Image.Image) -> bytes:
    """`img` stored rotated by 90 degrees with EXIF orientation 6 ("rotate 90 CW to view"):
    a viewer that applies the tag shows `img` upright again."""
    stored = img.convert("RGB").transpose(Image.Transpose.ROTATE_90)  # 90 CCW on disk
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(stored, "JPEG", quality=95, exif=exif.tobytes())


def _flip(data: bytes, at: int) -> bytes:
    """`data` with one byte inverted."""
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def _zero_width(png: bytes) -> bytes:
    """`png` with its IHDR's width set to 0 (and the chunk's CRC made right for it)."""
    ihdr = b"IHDR" + bytes(4) + png[20:29]
    return png[:8] + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


def corpus(base: Image.Image) -> list[tuple[str, bytes, set[int]]]:
    rng = np.random.default_rng(0)
    grey = base.convert("L")
    rgb = base.convert("RGB")
    out: list[tuple[str, bytes, set[int]]] = []
    for fmt, ext in (
        ("PNG", "png"),
        ("JPEG", "jpg"),
        ("GIF", "gif"),
        ("WEBP", "webp"),
        ("TIFF", "tif"),
    ):
        good = _save(rgb if fmt == "JPEG" else grey, fmt)
        out.append((f"valid.{ext}", good, {200}))
        out.append((f"truncated.{ext}", good[: max(16, len(good) // 3)], {400}))
        out.append((f"header-only.{ext}", good[:16], {400}))
        bad = bytearray(good)
        for i in rng.integers(len(bad) // 3, len(bad), 24):  # flip bytes after the header
            bad[int(i)] ^= 0xFF
        # a decoder may still produce pixels from a corrupt body (JPEG, GIF): 200 is honest too
        out.append((f"corrupt.{ext}", bytes(bad), {200, 400}))
    out += [
        ("bomb-20000x20000.png", png_bomb(20000), {413}),
        (
            "bomb-header-100000x100000.png",
            png_bomb(8)[:8]
            + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8, 0, 0, 0, 0))
            + _png_chunk(b"IEND", b""),
            {413},
        ),
        ("1x1.png", _save(Image.new("L", (1, 1), 128), "PNG"), {200}),
        # a small header that reads (a front may read only that much) over a broken file
        ("bad-ihdr-crc.png", _flip(_save(grey, "PNG"), 29), {400}),
        ("zero-width.png", _zero_width(_save(grey, "PNG")), {400}),
        ("ihdr-then-nothing.png", _save(grey, "PNG")[:33], {400}),
        ("1x100000.png", _save(Image.new("L", (1, 100000), 90), "PNG"), {200}),
        ("100000x1.png", _save(Image.new("L", (100000, 1), 90), "PNG"), {200}),
        ("16-bit.png", _save(Image.fromarray(np.asarray(grey, np.uint16) * 257), "PNG"), {200}),
        ("cmyk.jpg", _save(rgb.convert("CMYK"), "JPEG"), {200}),
        ("cmyk.tif", _save(rgb.convert("CMYK"), "TIFF"), {200}),
        ("palette.png", _save(rgb.convert("P"), "PNG"), {200}),
        ("rgba.png", _save(rgb.convert("RGBA"), "PNG"), {200}),
        ("la.png", _save(grey.convert("LA"), "PNG"), {200}),
        ("float.tif", _save(Image.fromarray(np.asarray(grey, np.float32) / 255.0), "TIFF"), {200}),
        ("1-bit.png", _save(grey.convert("1"), "PNG"), {200}),
        (
            "animated.gif",
            _save(
                grey,
                "GIF",
                save_all=True,
                append_images=[Image.new("L", grey.size, 255)] * 3,
                duration=50,
            ),
            {200},
        ),
        ("exif-rotated.jpg", exif_rotated_jpeg(base), {200}),
        # polyglots: a valid PNG followed by HTML / a ZIP is still that PNG
        ("png+html.png", _save(grey, "PNG") + b"<html><script>alert(1)</script></html>", {200}),
        ("png+zip.png", _save(grey, "PNG") + b"PK\x03\x04" + bytes(64), {200}),
        (
            "html-named.png",
            b"<!doctype html><html><body><img src=x onerror=alert(1)></body></html>",
            {415},
        ),
        (
            "svg-named.png",
            b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><script>alert(1)</script></svg>',
            {415},
        ),
        ("pdf-named.jpg", b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", {415}),
        ("zip-named.png", b"PK\x03\x04" + bytes(200), {415}),
        ("zeros.png", bytes(4096), {415}),
        ("random.jpg", rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), {415}),
        ("empty.png", b"", {400}),
    ]
    return out


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "hostile-images")
    out.mkdir(parents=True, exist_ok=True)
    base = Image.fromarray((np.indices((28, 28)).sum(0) * 4 % 256).astype(np.uint8))
    for name, data, _ in corpus(base):
        (out / name).write_bytes(data)
    print(f"{len(list(out.iterdir()))} files in {out}")
