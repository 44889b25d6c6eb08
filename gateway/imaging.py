"""Decode untrusted image bytes into an RGB Pillow image, or fail with a shared.errors type.

Invariants this module keeps:
1. Only JPEG, PNG and WebP are parsed (``Image.open(formats=...)``), so no other Pillow
   plugin ever sees client bytes. GIF, BMP, TIFF, HEIC, ... are named in the refusal.
2. The size is checked from the header, before a single pixel is decoded: a 100-byte PNG
   claiming 100000 x 100000 fails in microseconds. ``max_pixels`` bounds the pixel count and
   the bytes the decode needs in the file's own mode plus the RGB result
   (gateway/decode_cost.py): an 8-bit RGB image may have ``max_pixels`` pixels, a 16-bit gray
   or transparent one as many as fit the same memory. ``predict`` gives that cost (and the
   codecs' own working memory) without decoding, for the frontend's decode memory budget.
   Pillow's own bomb limit (``Image.MAX_IMAGE_PIXELS``) also counts: anything Pillow would warn
   about or refuse is ImageTooLarge. (Pillow still emits its DecompressionBombWarning from
   inside ``Image.open``; we do not change warning filters, which are process-global and not
   thread-safe, and preprocessing runs in threads.)
3. Every failure caused by the input is UndecodableImage or ImageTooLarge; no Pillow, zlib
   or struct exception escapes. Truncated files fail: ``ImageFile.LOAD_TRUNCATED_IMAGES``
   is never enabled (a half-grey photo would be silently misclassified and cached).
4. The result is mode "RGB", upright (the EXIF orientation is applied, as
   ``ImageOps.exif_transpose`` would, without its copy when there is nothing to rotate).
5. Peak memory is the decoded frame, the RGB result and one tile: conversion and rotation run
   tile by tile (TILE_PIXELS) into one preallocated result, never on whole-image temporaries.
   Measured peaks, in multiples of the RGB uint8 result (w x h x 3; tests/test_decode_memory.py):
   PNG in every mode and baseline JPEG <= 3x (16-bit gray 2.1x, was 6.4x with int64 copies);
   progressive JPEG <= 4.5x (libjpeg holds every DCT coefficient); WebP <= 7x (libwebp's
   animation decoder, the only one Pillow has, keeps two RGBA canvases).

Choices for awkward inputs:
- Animated WebP / APNG: the first frame is used (friendlier than refusing a sticker).
- Transparency (RGBA, LA, PA, palette or colour-key ``tRNS``): composited on white, which is
  what a browser shows on a page; dropping alpha would expose whatever colour the encoder
  left under transparent pixels (often black).
- 16-bit grayscale (modes I;16*, I): scaled by 1/257 with rounding, through a 64 KiB table.
  Pillow's ``convert`` clips at 255 instead, which turns most of a 16-bit photo white.
  16-bit RGB(A) PNGs are already reduced to 8 bits by Pillow's decoder.
- CMYK / YCbCr / 1-bit / grayscale: Pillow's conversion to RGB.
- Extreme aspect ratios (10000 x 1) decode fine here; the resizer (gateway/preprocess/
  vision.py) resamples only the region it keeps, so its cost does not grow with the ratio.

JPEG draft mode: ``draft_to=(w, h)`` lets libjpeg shrink by 1/2, 1/4 or 1/8 during the
DCT while the result stays at least w x h (in upright orientation). ``decode`` reports the
factor so callers can keep exact geometry. Draft mode is used because most of the cost of a
large photo is in the resize, which then reads 4x (or 16x) fewer source pixels: 2.6x faster
decode+resize to 224 for a 1024-pixel JPEG, 8x for a 4032x3024 one (docs/benchmarks-history.md,
"JPEG draft mode").
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from shmgate.gateway.decode_cost import TILE_PIXELS, DecodeCost, decode_cost, pixel_bytes_budget
from shmgate.shared.errors import ImageTooLarge, UndecodableImage
from shmgate.shared.names import format_bytes

__all__ = ["ACCEPTED_FORMATS", "DecodedImage", "decode", "decode_image", "predict"]

# Pillow format ids we parse. Order matters only for speed: the first plugin that accepts
# the prefix wins, and JPEG is the common case.
ACCEPTED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP")
_ACCEPTED_TEXT = "JPEG, PNG or WebP"

# Exceptions Pillow and the codecs behind it raise for bad input. ``UnidentifiedImageError``
# is an OSError; ``DecompressionBombError`` is handled separately (it means "too large").
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    EOFError,
    struct.error,
    zlib.error,
)

# Magic numbers of formats we refuse, so the client learns what it sent, not just "invalid".
_REFUSED_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"GIF87a", "GIF"),
    (0, b"GIF89a", "GIF"),
    (0, b"BM", "BMP"),
    (0, b"II*\x00", "TIFF"),
    (0, b"MM\x00*", "TIFF"),
    (4, b"ftypheic", "HEIC"),
    (4, b"ftypheix", "HEIC"),
    (4, b"ftypmif1", "HEIF"),
    (4, b"ftypavif", "AVIF"),
    (0, b"\x00\x00\x01\x00", "ICO"),
    (0, b"%PDF", "PDF"),
)

# EXIF orientation -> the transpose that makes the image upright (same table as
# ImageOps.exif_transpose). 5-8 swap width and height.
_ORIENTATION_FIX: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_EXIF_ORIENTATION_TAG = 0x0112

_WHITE = (255, 255, 255)
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
# 16-bit value -> 8-bit, round(v / 257): 64 KiB, indexed per tile instead of widening pixels to int64.
_SIXTEEN_TO_EIGHT = ((np.arange(65536, dtype=np.uint32) + 128) // 257).astype(np.uint8)


@dataclass(frozen=True)
class DecodedImage:
    """An upright RGB image and how it relates to the file's full-resolution pixels.

    ``draft_scale`` is 1, or 2/4/8 when the JPEG decoder shrank the image. The shrunk size
    is rounded up, so the file's picture covers ``extent`` (fractional) pixels of ``image``,
    not all of ``image.size``: geometry that must match a full decode uses ``extent``.
    """

    image: Image.Image
    original_size: tuple[int, int]  # (width, height) of the file's pixels, upright
    draft_scale: int = 1

    @property
    def extent(self) -> tuple[float, float]:
        width, height = self.original_size
        return width / self.draft_scale, height / self.draft_scale


def decode_image(data: bytes, *, max_pixels: int, draft_to: tuple[int, int] | None = None) -> Image.Image:
    """Decode ``data`` into an upright RGB image; see ``decode`` for arguments and errors."""
    return decode(data, max_pixels=max_pixels, draft_to=draft_to).image


def decode(data: bytes, *, max_pixels: int, draft_to: tuple[int, int] | None = None) -> DecodedImage:
    """Decode ``data`` (JPEG, PNG or WebP) into an upright RGB image.

    ``max_pixels`` bounds the bytes the decode needs, checked from the header before decoding
    (gateway/decode_cost.py: an 8-bit RGB image may have ``max_pixels`` pixels, other modes the
    same memory). ``draft_to=(w, h)`` allows a JPEG to be decoded at 1/2, 1/4 or 1/8 scale as
    long as the upright result is at least w x h; pass (s, s) to keep the shorter side >= s.

    Raises:
        ImageTooLarge: more bytes than ``max_pixels`` allows, or beyond Pillow's bomb limit.
        UndecodableImage: empty, not an accepted format, 0-sized, truncated or corrupt.
    """
    with _input_errors(data):
        return _decode(data, max_pixels, draft_to)


def predict(data: bytes, *, max_pixels: int) -> DecodeCost:
    """The cost of ``decode(data)`` from the header alone (microseconds): reserve it, then decode.

    The prediction assumes no JPEG draft, so it bounds a drafted decode too.
    Raises as ``decode`` does for what the header shows (refused format, too large, corrupt header).
    """
    with _input_errors(data), _open(data) as img:
        return _checked_cost(img, _header_orientation(img), max_pixels)


@contextmanager
def _input_errors(data: bytes) -> Iterator[None]:
    """Map every exception the input can cause to UndecodableImage or ImageTooLarge."""
    if not data:
        raise UndecodableImage("The image is empty (0 bytes).")
    try:
        yield
    except Image.DecompressionBombError:
        raise ImageTooLarge("The image has more pixels than can be decoded safely. Resize it before sending.") from None
    except _DECODE_ERRORS as exc:
        raise UndecodableImage(
            f"The image could not be decoded: {_describe(exc)}. Send a complete {_ACCEPTED_TEXT} file."
        ) from None


def _decode(data: bytes, max_pixels: int, draft_to: tuple[int, int] | None) -> DecodedImage:
    """The body of ``decode``; every raw exception it lets out is mapped by the caller."""
    img = _open(data)
    predicted_orientation = _header_orientation(img)
    _checked_cost(img, predicted_orientation, max_pixels)
    width, height = img.size
    draft_scale = 1
    if draft_to is not None and img.format in ("JPEG", "MPO"):
        draft_scale = _draft(img, draft_to)
    img.load()  # the first frame only; raises OSError on truncated or corrupt data
    _release_codec(img)
    # Read only after load(): PNG's getexif() loads the image itself, and a failed load
    # swallowed there would leave a half-decoded image that a second load() accepts.
    orientation = _orientation(img)
    if _rotates(orientation) != _rotates(predicted_orientation):  # a PNG's EXIF after its pixels
        _checked_cost(img, orientation, max_pixels)
    rgb = _upright_rgb(img, orientation)
    swapped = orientation in (5, 6, 7, 8)
    original = (height, width) if swapped else (width, height)
    return DecodedImage(rgb, original, draft_scale)


def _release_codec(img: ImageFile.ImageFile) -> None:
    """Free libwebp's decoder, with its two RGBA canvases, once the first frame is loaded.

    Pillow keeps a WebP's animation decoder as long as the image lives (to seek), and an RGB
    WebP's image is our result: the canvases, twice the result's size, would stay resident through
    the resize. We never seek, and a loaded frame does not touch its decoder again.
    """
    if img.format == "WEBP" and getattr(img, "_decoder", None) is not None:
        img._decoder = None  # type: ignore[attr-defined]


def _draft(img: ImageFile.ImageFile, draft_to: tuple[int, int]) -> int:
    """Ask libjpeg for a 1/2, 1/4 or 1/8 decode no smaller than ``draft_to`` (upright); the factor."""
    # A JPEG's EXIF comes from its header (APP1), so this reads no pixels.
    if _orientation(img) in (5, 6, 7, 8):
        draft_to = (draft_to[1], draft_to[0])
    if draft_to[0] < 1 or draft_to[1] < 1:
        return 1
    full_width = img.size[0]
    drafted = img.draft(None, draft_to)
    if drafted is None:
        return 1
    # The box is the file's picture in shrunk pixels: (0, 0, width / s, height / s).
    return max(1, round(full_width / drafted[1][2]))


def _open(data: bytes) -> ImageFile.ImageFile:
    """Parse the header with the accepted plugins only, naming refused formats."""
    try:
        return Image.open(io.BytesIO(data), formats=list(ACCEPTED_FORMATS))
    except UnidentifiedImageError:
        refused = _sniff_refused(data)
        if refused is not None:
            raise UndecodableImage(f"{refused} images are not accepted; send {_ACCEPTED_TEXT}.") from None
        raise UndecodableImage(f"The data is not a {_ACCEPTED_TEXT} image.") from None


def _sniff_refused(data: bytes) -> str | None:
    for offset, magic, name in _REFUSED_SIGNATURES:
        if data[offset : offset + len(magic)] == magic:
            return name
    return None


def _checked_cost(img: ImageFile.ImageFile, orientation: int, max_pixels: int) -> DecodeCost:
    """The decode's cost from header facts, refused when over ``max_pixels`` or Pillow's bomb limit."""
    width, height = img.size
    if width < 1 or height < 1:
        raise UndecodableImage(f"The image is {width}x{height} pixels; it must be at least 1x1.")
    pillow_limit = Image.MAX_IMAGE_PIXELS
    limit = max_pixels if pillow_limit is None else min(max_pixels, pillow_limit)
    if width * height > limit:
        raise ImageTooLarge(
            f"The image is {width}x{height} = {width * height} pixels; at most {limit} are accepted. "
            "Resize it before sending."
        )
    mode = img.mode
    cost = decode_cost(
        img.format or "",
        mode,
        (width, height),
        needs_conversion=_tile_converter(img) is not None or _rotates(orientation),
        progressive=bool(img.info.get("progressive")),
        sampling=tuple((h, v) for _, h, v, _ in getattr(img, "layer", ())),
    )
    budget = pixel_bytes_budget(max_pixels)
    if cost.pixel_bytes > budget:
        raise ImageTooLarge(
            f"The image is {width}x{height} pixels in mode {mode}; decoding it needs {cost.describe()} "
            f"= {format_bytes(cost.pixel_bytes)}, and at most {format_bytes(budget)} (an 8-bit RGB image of "
            f"{max_pixels} pixels) is accepted. Resize it or send 8-bit RGB."
        )
    return cost


def _rotates(orientation: int) -> bool:
    return orientation in _ORIENTATION_FIX


def _header_orientation(img: ImageFile.ImageFile) -> int:
    """The EXIF orientation known before decoding: a PNG's only if its EXIF precedes the pixels."""
    if img.format == "PNG" and "exif" not in img.info:
        return 1  # getexif() would decode the image to look behind the pixel data
    return _orientation(img)


def _orientation(img: Image.Image) -> int:
    """EXIF orientation 1-8; 1 when absent or unreadable (bad metadata should not lose a photo)."""
    try:
        value = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    except _DECODE_ERRORS:
        return 1
    return value if isinstance(value, int) and value in _ORIENTATION_FIX else 1


# -- conversion to upright RGB, one tile at a time ---------------------------------------------


def _upright_rgb(img: Image.Image, orientation: int) -> Image.Image:
    """The loaded frame as upright RGB, converted and rotated tile by tile into one new image.

    Why tiles: converting the whole frame at once needs the source, the result and whole-image
    temporaries (an RGBA copy, an alpha mask, a rotated copy) together; tile by tile it needs the
    source, the result and one tile of TILE_PIXELS. Every step is per pixel, so the result is
    the same as converting the whole image.
    """
    fix = _ORIENTATION_FIX.get(orientation)
    convert = _tile_converter(img)
    if convert is None and fix is None:
        return img
    width, height = img.size
    swapped = orientation in (5, 6, 7, 8)
    out = Image.new("RGB", (height, width) if swapped else (width, height))
    for box in _tiles(width, height):
        tile = img.crop(box)
        if convert is not None:
            tile = convert(tile)
        if fix is not None:
            tile = tile.transpose(fix)
        out.paste(tile, _placed(box, (width, height), orientation))
    return out


def _tile_converter(img: Image.Image) -> Callable[[Image.Image], Image.Image] | None:
    """How a tile of this frame becomes RGB (see the module docstring); None when it already is."""
    mode = img.mode
    if mode in _ALPHA_MODES or "transparency" in img.info:
        return _composite_on_white
    if mode.startswith("I;16") or mode == "I":
        return _sixteen_bit_to_rgb
    if mode == "RGB":
        return None
    return _plain_to_rgb


def _composite_on_white(tile: Image.Image) -> Image.Image:
    rgba = tile if tile.mode == "RGBA" else tile.convert("RGBA")  # a crop keeps palette and tRNS
    canvas = Image.new("RGB", rgba.size, _WHITE)
    canvas.paste(rgba, mask=rgba.getchannel("A"))
    return canvas


def _sixteen_bit_to_rgb(tile: Image.Image) -> Image.Image:
    """16-bit gray scaled by 1/257 with rounding, through a table: no widened copy of the tile."""
    values = np.asarray(tile)
    if values.dtype.itemsize > 2:  # mode "I" is int32: clip to the 16-bit range the table covers
        values = np.clip(values, 0, 65535)
    return Image.fromarray(_SIXTEEN_TO_EIGHT[values]).convert("RGB")


def _plain_to_rgb(tile: Image.Image) -> Image.Image:
    return tile.convert("RGB")


def _tiles(width: int, height: int) -> Iterator[tuple[int, int, int, int]]:
    """Boxes of at most TILE_PIXELS covering the image: whole rows, or parts of one very wide row."""
    tile_width = min(width, TILE_PIXELS)
    tile_height = max(1, TILE_PIXELS // tile_width)
    for top in range(0, height, tile_height):
        for left in range(0, width, tile_width):
            yield left, top, min(left + tile_width, width), min(top + tile_height, height)


def _placed(box: tuple[int, int, int, int], size: tuple[int, int], orientation: int) -> tuple[int, int]:
    """Where the source ``box``'s tile lands, after its transpose, in the upright image."""
    x0, y0, x1, y1 = box
    width, height = size
    corners: dict[int, tuple[int, int]] = {
        2: (width - x1, y0),  # FLIP_LEFT_RIGHT
        3: (width - x1, height - y1),  # ROTATE_180
        4: (x0, height - y1),  # FLIP_TOP_BOTTOM
        5: (y0, x0),  # TRANSPOSE
        6: (height - y1, x0),  # ROTATE_270: (x, y) -> (height - 1 - y, x)
        7: (height - y1, width - x1),  # TRANSVERSE
        8: (y0, width - x1),  # ROTATE_90: (x, y) -> (y, width - 1 - x)
    }
    return corners.get(orientation, (x0, y0))


def _describe(exc: BaseException) -> str:
    """A short reason for the client; Pillow messages are safe (no paths: we parse bytes)."""
    text = str(exc).strip() or type(exc).__name__
    return text[:200]
