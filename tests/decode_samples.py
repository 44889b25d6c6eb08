"""One encoded image per pixel mode JPEG, PNG and WebP can produce, at any size, for memory tests and bench.

Content is smooth (gradients), so even large samples encode in a fraction of a second and compress
like a photo rather than like noise. 16-bit RGB(A) PNGs are written by hand: Pillow cannot save them.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image

__all__ = ["SAMPLES", "attack_png", "sixteen_bit_png"]


def _gradient(width: int, height: int, channels: int) -> np.ndarray:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    c = np.arange(channels, dtype=np.float32)[None, None, :] * 40
    return ((x + y + c) % 256).astype(np.uint8)


@functools.lru_cache(maxsize=4)
def _rgb(width: int, height: int) -> Image.Image:
    """Shared by several samples: callers only read it (convert, quantize and save make copies)."""
    return Image.fromarray(_gradient(width, height, 3))


def _encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    fast = {"PNG": {"compress_level": 1}, "WEBP": {"method": 0}}.get(fmt, {})  # tests wait for these
    out = io.BytesIO()
    img.save(out, fmt, **{**fast, **options})
    return out.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def sixteen_bit_png(pixels: np.ndarray, colour_type: int, level: int = 1) -> bytes:
    """A 16-bit PNG of ``pixels`` (uint16, HxW or HxWxC): 0 gray, 2 RGB, 6 RGBA."""
    height, width = pixels.shape[:2]
    rows = pixels.astype(">u2").reshape(height, -1).view(np.uint8)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1)  # filter byte 0 per row
    ihdr = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
        + _chunk(b"IEND", b"")
    )


@functools.lru_cache(maxsize=8)
def attack_png(side: int = 6300) -> bytes:
    """A 16-bit grayscale PNG of zeros: ~75 KB on the wire at 6300 x 6300, 79 MB as Pillow's I;16."""
    return sixteen_bit_png(np.zeros((side, side), np.uint16), 0, level=9)


def _wide(width: int, height: int, channels: int) -> np.ndarray:
    return _gradient(width, height, channels).astype(np.uint16) * 257


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _palette(width: int, height: int) -> Image.Image:
    return _rgb(width, height).quantize(64)


def _frames(width: int, height: int) -> list[Image.Image]:
    return [_rgb(width, height), Image.new("RGB", (width, height), (0, 90, 200))]


SAMPLES: dict[str, Callable[[int, int], bytes]] = {
    "jpeg_rgb": lambda w, h: _encode(_rgb(w, h), "JPEG", quality=90),
    "jpeg_progressive": lambda w, h: _encode(_rgb(w, h), "JPEG", quality=90, progressive=True, subsampling=0),
    "jpeg_gray": lambda w, h: _encode(_rgb(w, h).convert("L"), "JPEG", quality=90),
    "jpeg_cmyk": lambda w, h: _encode(_rgb(w, h).convert("CMYK"), "JPEG", quality=90),
    "jpeg_cmyk_progressive": lambda w, h: _encode(_rgb(w, h).convert("CMYK"), "JPEG", progressive=True),
    "jpeg_exif_rotated": lambda w, h: _encode(_rgb(w, h), "JPEG", quality=90, exif=_exif(6)),
    "png_1bit": lambda w, h: _encode(_rgb(w, h).convert("1"), "PNG"),
    "png_gray8": lambda w, h: _encode(_rgb(w, h).convert("L"), "PNG"),
    "png_gray16": lambda w, h: sixteen_bit_png(_wide(w, h, 1)[:, :, 0], 0),
    "png_rgb8": lambda w, h: _encode(_rgb(w, h), "PNG"),
    "png_rgb16": lambda w, h: sixteen_bit_png(_wide(w, h, 3), 2),
    "png_rgba16": lambda w, h: sixteen_bit_png(_wide(w, h, 4), 6),
    "png_palette": lambda w, h: _encode(_palette(w, h), "PNG"),
    "png_palette_trns": lambda w, h: _encode(_palette(w, h), "PNG", transparency=0),
    "png_la": lambda w, h: _encode(Image.fromarray(_gradient(w, h, 2), "LA"), "PNG"),
    "png_rgba": lambda w, h: _encode(Image.fromarray(_gradient(w, h, 4), "RGBA"), "PNG"),
    "png_exif_rotated": lambda w, h: _encode(_rgb(w, h), "PNG", exif=_exif(8)),
    "apng": lambda w, h: _encode(_frames(w, h)[0], "PNG", save_all=True, append_images=_frames(w, h)[1:]),
    "webp_rgb": lambda w, h: _encode(_rgb(w, h), "WEBP", quality=80),
    "webp_rgba_lossless": lambda w, h: _encode(
        Image.fromarray(_gradient(w, h, 4), "RGBA"), "WEBP", lossless=True, quality=0
    ),
    "webp_animated": lambda w, h: _encode(
        _frames(w, h)[0], "WEBP", save_all=True, append_images=_frames(w, h)[1:], quality=80
    ),
}
