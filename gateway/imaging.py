"""Decode untrusted image bytes into an RGB Pillow image, or fail with a shared.errors type.

Invariants this module keeps:
1. Only JPEG, PNG and WebP are parsed (``Image.open(formats=...)``), so no other Pillow
   plugin ever sees client bytes. GIF, BMP, TIFF, HEIC, ... are named in the refusal.
2. The pixel count is checked against ``max_pixels`` from the header, before a single pixel
   is decoded: a 100-byte PNG claiming 100000 x 100000 fails in microseconds. Pillow's own
   bomb limit (``Image.MAX_IMAGE_PIXELS``) also counts: anything Pillow would warn about or
   refuse is ImageTooLarge. (Pillow still emits its DecompressionBombWarning from inside
   ``Image.open``; we do not change warning filters, which are process-global and not
   thread-safe, and preprocessing runs in threads.)
3. Every failure caused by the input is UndecodableImage or ImageTooLarge; no Pillow, zlib
   or struct exception escapes. Truncated files fail: ``ImageFile.LOAD_TRUNCATED_IMAGES``
   is never enabled (a half-grey photo would be silently misclassified and cached).
4. The result is mode "RGB", upright (the EXIF orientation is applied, as
   ``ImageOps.exif_transpose`` would, without its copy when there is nothing to rotate).

Choices for awkward inputs:
- Animated WebP / APNG: the first frame is used (friendlier than refusing a sticker).
- Transparency (RGBA, LA, PA, palette or colour-key ``tRNS``): composited on white, which is
  what a browser shows on a page; dropping alpha would expose whatever colour the encoder
  left under transparent pixels (often black).
- 16-bit grayscale (modes I;16*, I): scaled by 1/257. Pillow's ``convert`` clips at 255
  instead, which turns most of a 16-bit photo white. 16-bit RGB(A) PNGs are already reduced
  to 8 bits by Pillow's decoder.
- CMYK / YCbCr / 1-bit / grayscale: Pillow's conversion to RGB.
- Extreme aspect ratios (10000 x 1) decode fine here; the resizer (gateway/preprocess/
  vision.py) resamples only the region it keeps, so its cost does not grow with the ratio.

JPEG draft mode: ``draft_to=(w, h)`` lets libjpeg shrink by 1/2, 1/4 or 1/8 during the
DCT while the result stays at least w x h (in upright orientation). ``decode`` reports the
factor so callers can keep exact geometry. Draft mode is used because most of the cost of a
large photo is in the resize, which then reads 4x (or 16x) fewer source pixels: 2.6x faster
decode+resize to 224 for a 1024-pixel JPEG, 8x for a 4032x3024 one (docs/BENCHMARKS.md,
"JPEG draft mode").
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from shared.errors import ImageTooLarge, UndecodableImage

__all__ = ["ACCEPTED_FORMATS", "DecodedImage", "decode", "decode_image"]

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

    ``max_pixels`` bounds width x height as the header states it, checked before decoding.
    ``draft_to=(w, h)`` allows a JPEG to be decoded at 1/2, 1/4 or 1/8 scale as long as the
    upright result is at least w x h; pass (s, s) to keep the shorter side >= s.

    Raises:
        ImageTooLarge: more pixels than ``max_pixels`` or Pillow's bomb limit.
        UndecodableImage: empty, not an accepted format, 0-sized, truncated or corrupt.
    """
    if not data:
        raise UndecodableImage("The image is empty (0 bytes).")
    try:
        return _decode(data, max_pixels, draft_to)
    except Image.DecompressionBombError:
        raise ImageTooLarge(
            "The image has more pixels than can be decoded safely. Resize it before sending."
        ) from None
    except _DECODE_ERRORS as exc:
        raise UndecodableImage(
            f"The image could not be decoded: {_describe(exc)}. Send a complete {_ACCEPTED_TEXT} file."
        ) from None


def _decode(data: bytes, max_pixels: int, draft_to: tuple[int, int] | None) -> DecodedImage:
    """The body of ``decode``; every raw exception it lets out is mapped by the caller."""
    img = _open(data)
    width, height = img.size
    _check_size(width, height, max_pixels)
    draft_scale = 1
    if draft_to is not None and img.format in ("JPEG", "MPO"):
        draft_scale = _draft(img, draft_to)
    img.load()  # the first frame only; raises OSError on truncated or corrupt data
    # Read only after load(): PNG's getexif() loads the image itself, and a failed load
    # swallowed there would leave a half-decoded image that a second load() accepts.
    orientation = _orientation(img)
    rgb = _to_rgb(img)
    fix = _ORIENTATION_FIX.get(orientation)
    if fix is not None:
        rgb = rgb.transpose(fix)
    swapped = orientation in (5, 6, 7, 8)
    original = (height, width) if swapped else (width, height)
    return DecodedImage(rgb, original, draft_scale)


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


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width < 1 or height < 1:
        raise UndecodableImage(f"The image is {width}x{height} pixels; it must be at least 1x1.")
    pillow_limit = Image.MAX_IMAGE_PIXELS
    limit = max_pixels if pillow_limit is None else min(max_pixels, pillow_limit)
    if width * height > limit:
        raise ImageTooLarge(
            f"The image is {width}x{height} = {width * height} pixels; at most {limit} are accepted. "
            "Resize it before sending."
        )


def _orientation(img: Image.Image) -> int:
    """EXIF orientation 1-8; 1 when absent or unreadable (bad metadata should not lose a photo)."""
    try:
        value = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    except _DECODE_ERRORS:
        return 1
    return value if isinstance(value, int) and value in _ORIENTATION_FIX else 1


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert a loaded frame of any mode our formats produce to RGB (see module docstring)."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img if mode == "RGBA" else img.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, _WHITE)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    if mode.startswith("I;16") or mode == "I":
        wide = np.asarray(img).astype(np.int64)
        narrow = ((np.clip(wide, 0, 65535) + 128) // 257).astype(np.uint8)
        return Image.fromarray(narrow).convert("RGB")
    return img.convert("RGB")


def _describe(exc: BaseException) -> str:
    """A short reason for the client; Pillow messages are safe (no paths: we parse bytes)."""
    text = str(exc).strip() or type(exc).__name__
    return text[:200]
