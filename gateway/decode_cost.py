"""How many bytes decoding one image will take, known from its header before a pixel is decoded.

Why a model and not a pixel count: a pixel costs 1 to 4 bytes in Pillow's buffer depending on the
file's mode, the conversion to RGB needs the result beside the source, and two codecs keep working
memory of the image's size on top (a progressive JPEG's DCT coefficients, libwebp's canvases). A
75 KB 16-bit grayscale PNG of 6300 x 6300 pixels is under a 40 M pixel cap but needs 227 MiB
(its 16-bit pixels and their RGB result), where an 8-bit RGB image of 40 M pixels needs 153 MiB.

Invariants:
1. ``peak_bytes`` is an upper bound of the memory ``gateway.imaging.decode`` allocates for the
   image (measured per mode by tests/test_decode_memory.py; the constants below come from those
   runs, on Pillow 13 with its bundled libjpeg-turbo, zlib and libwebp).
2. The model only reads header facts (format, mode, size, sampling, progressive flag, EXIF
   orientation, transparency); it never decodes.

Bytes per pixel (Pillow stores "RGB", "LA", "CMYK" and "I" in 4 bytes per pixel, "I;16" in 2,
"1", "L" and "P" in 1):

    part        what it is                                              bytes per pixel
    source      Pillow's buffer for the file's own mode                 1, 2 or 4
    convert     the RGB result, when the source is not already it       4
    work        one conversion tile's temporaries                       (at most 1 MiB in all)
                progressive JPEG: 16-bit DCT coefficients per sample    2 x samples per pixel
                WebP: libwebp's two RGBA canvases + Pillow's frame copy 12 (+4 lossless argb cache)

``--max-pixels`` bounds source + convert (the pixels a client chose to send); the frontend's
decode memory budget reserves all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shmgate.shared.names import format_bytes

__all__ = ["DecodeCost", "RGB_PIXEL_BYTES", "TILE_PIXELS", "decode_cost", "pixel_bytes_budget"]

RGB_PIXEL_BYTES = 4  # Pillow's "RGB" is 4 bytes per pixel (the 4th is padding)
TILE_PIXELS = 1 << 16  # conversion works on tiles of at most this many pixels (gateway/imaging.py)
# The temporaries of converting one tile, per pixel: crop, numpy copy, LUT result, RGBA, mask, RGB tile.
TILE_WORK_PIXEL_BYTES = 16
# Fixed working memory of a decode whatever its size: zlib/libjpeg state, file read buffers.
FIXED_BYTES = 2 << 20
# libwebp's animation decoder (the only one Pillow uses) keeps the current and the previous
# canvas (RGBA), Pillow copies the frame once into bytes before its raw decoder reads it, and a
# lossless stream decodes through an ARGB cache of the image's size.
WEBP_CODEC_PIXEL_BYTES = 16

_SOURCE_PIXEL_BYTES: dict[str, int] = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}


@dataclass(frozen=True)
class DecodeCost:
    """The bytes one decode allocates, by part; see the module docstring for the model."""

    width: int
    height: int
    mode: str
    source_bytes: int  # Pillow's buffer in the file's mode
    convert_bytes: int  # the RGB result; 0 when the source is the result
    work_bytes: int  # tile temporaries and decoder working memory besides the two buffers

    @property
    def pixel_bytes(self) -> int:
        """What ``--max-pixels`` bounds: the decoded pixels and their conversion to RGB."""
        return self.source_bytes + self.convert_bytes

    @property
    def peak_bytes(self) -> int:
        """What a frontend reserves from its decode memory budget for this image."""
        return self.source_bytes + self.convert_bytes + self.work_bytes + FIXED_BYTES

    def describe(self) -> str:
        """The counted parts, for a refusal the client can act on."""
        parts = [f"{self.mode} pixels {format_bytes(self.source_bytes)}"]
        if self.convert_bytes:
            parts.append(f"RGB result {format_bytes(self.convert_bytes)}")
        return " + ".join(parts)


def pixel_bytes_budget(max_pixels: int) -> int:
    """``--max-pixels`` as bytes: what an 8-bit RGB image of that many pixels needs decoded.

    So an RGB photo is accepted up to ``max_pixels`` exactly as before, and other modes up to the
    same memory: a 16-bit grayscale or transparent image gets fewer pixels.
    """
    return max_pixels * RGB_PIXEL_BYTES


def decode_cost(
    fmt: str,
    mode: str,
    size: tuple[int, int],
    *,
    needs_conversion: bool,
    progressive: bool = False,
    sampling: tuple[tuple[int, int], ...] = (),
) -> DecodeCost:
    """The cost of decoding a ``fmt`` file whose header says ``mode`` and ``size``.

    ``needs_conversion``: the decoded frame is not already the upright RGB result (another mode,
    transparency, or an EXIF rotation). ``sampling``: a JPEG's (h, v) factors per component.
    """
    width, height = size
    pixels = width * height
    source = pixels * _SOURCE_PIXEL_BYTES.get(mode, 4)
    convert = pixels * RGB_PIXEL_BYTES if needs_conversion else 0
    work = min(pixels, TILE_PIXELS) * TILE_WORK_PIXEL_BYTES if needs_conversion else 0
    if fmt == "WEBP":
        work += pixels * WEBP_CODEC_PIXEL_BYTES
    elif fmt in ("JPEG", "MPO") and progressive:
        work += _coefficient_bytes(width, height, sampling or ((1, 1),) * 3)
    return DecodeCost(width, height, mode, source, convert, work)


def _coefficient_bytes(width: int, height: int, sampling: tuple[tuple[int, int], ...]) -> int:
    """libjpeg's whole-image coefficient buffer (progressive mode): 64 int16 per 8x8 block.

    Each component's block count is rounded up to whole MCUs, as libjpeg allocates it.
    """
    h_max = max(h for h, _ in sampling)
    v_max = max(v for _, v in sampling)
    mcus_x = math.ceil(width / (8 * h_max))
    mcus_y = math.ceil(height / (8 * v_max))
    blocks = sum(mcus_x * h * mcus_y * v for h, v in sampling)
    return blocks * 64 * 2
