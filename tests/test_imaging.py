"""gateway/imaging.py against hostile and awkward inputs: each gives an RGB image or a shared.errors type."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from shmgate.gateway.imaging import decode, decode_image
from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor
from shmgate.shared.errors import ImageTooLarge, UndecodableImage

IMAGES = Path(__file__).parent / "data" / "images"
MAX_PIXELS = 40_000_000


def encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def handmade_png(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (8-bit RGB) but whose IDAT holds a few bytes only."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def solid(mode: str, size: tuple[int, int], colour: object) -> Image.Image:
    return Image.new(mode, size, colour)  # type: ignore[arg-type]


# -- size bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize("side", [100_000, 20_000])
def test_png_claiming_huge_dimensions_is_too_large_before_decoding(side: int) -> None:
    data = handmade_png(side, side)
    assert len(data) < 200
    # Decoding the tiny IDAT would fail as truncated (UndecodableImage): ImageTooLarge proves
    # the header check ran first.
    with pytest.raises(ImageTooLarge):
        decode_image(data, max_pixels=10**12)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_image_above_pillows_bomb_warning_limit_is_too_large_even_if_max_pixels_allows_it() -> None:
    side = 10_000  # 1e8 pixels: Pillow warns (> 89.5M) but does not raise (< 179M)
    with pytest.raises(ImageTooLarge):
        decode_image(handmade_png(side, side), max_pixels=10**12)


def test_image_above_max_pixels_is_too_large() -> None:
    with pytest.raises(ImageTooLarge, match="640x426"):
        decode_image((IMAGES / "chelsea_640.jpg").read_bytes(), max_pixels=640 * 426 - 1)


def test_image_at_max_pixels_is_accepted() -> None:
    img = decode_image((IMAGES / "chelsea_640.jpg").read_bytes(), max_pixels=640 * 426)
    assert img.size == (640, 426)


def test_zero_sized_png_is_undecodable() -> None:
    with pytest.raises(UndecodableImage):
        decode_image(handmade_png(0, 0), max_pixels=MAX_PIXELS)


# -- not images, truncated, refused formats --------------------------------------------------


@pytest.mark.parametrize(
    "data", [b"", b"hello, world", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF\x00\x00\x00\x00WEBP"]
)
def test_non_images_are_undecodable(data: bytes) -> None:
    with pytest.raises(UndecodableImage):
        decode_image(data, max_pixels=MAX_PIXELS)


def test_not_an_image_error_names_the_accepted_formats() -> None:
    with pytest.raises(UndecodableImage, match="JPEG, PNG or WebP"):
        decode_image(b"just some text, not pixels", max_pixels=MAX_PIXELS)


def test_truncated_jpeg_is_undecodable() -> None:
    data = (IMAGES / "chelsea_640.jpg").read_bytes()
    with pytest.raises(UndecodableImage, match="truncated"):
        decode_image(data[: len(data) // 2], max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_truncated_png_and_webp_are_undecodable(fmt: str) -> None:
    photo = Image.open(IMAGES / "coffee_640.jpg")
    data = encode(photo, fmt)
    with pytest.raises(UndecodableImage):
        decode_image(data[: len(data) // 2], max_pixels=MAX_PIXELS)


def test_truncated_images_are_never_loaded_leniently() -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


@pytest.mark.parametrize(("fmt", "name"), [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_other_formats_are_refused_by_name(fmt: str, name: str) -> None:
    data = encode(solid("RGB", (8, 8), (10, 20, 30)), fmt)
    with pytest.raises(UndecodableImage, match=f"{name} images are not accepted; send JPEG, PNG or WebP"):
        decode_image(data, max_pixels=MAX_PIXELS)


def test_animated_gif_is_refused() -> None:
    frames = [solid("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0)]]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(UndecodableImage, match="GIF"):
        decode_image(data, max_pixels=MAX_PIXELS)


# -- animation: first frame ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["WEBP", "PNG"])
def test_animated_webp_and_apng_give_their_first_frame(fmt: str) -> None:
    frames = [solid("RGB", (16, 12), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    options: dict[str, object] = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **options)
    img = decode_image(data, max_pixels=MAX_PIXELS)
    assert img.mode == "RGB" and img.size == (16, 12)
    assert img.getpixel((8, 6)) == (255, 0, 0)


# -- modes -----------------------------------------------------------------------------------


def test_cmyk_jpeg_becomes_rgb() -> None:
    data = encode(solid("CMYK", (32, 32), (0, 255, 255, 0)), "JPEG", quality=95)  # pure red in CMYK
    img = decode_image(data, max_pixels=MAX_PIXELS)
    assert img.mode == "RGB"
    r, g, b = img.getpixel((16, 16))  # type: ignore[misc]
    assert r > 240 and g < 15 and b < 15


def test_16_bit_grayscale_png_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257, 32768, 65535]], dtype=np.uint16)
    source = Image.fromarray(values)
    assert source.mode == "I;16"
    img = decode_image(encode(source, "PNG"), max_pixels=MAX_PIXELS)
    assert img.mode == "RGB"
    assert np.asarray(img)[0, :, 0].tolist() == [0, 1, 128, 255]


def test_palette_png_with_transparency_is_composited_on_white() -> None:
    pal = Image.new("P", (4, 1))
    pal.putpalette([0, 0, 0, 200, 30, 40] + [0] * (254 * 3))
    pal.putdata([0, 1, 0, 1])
    img = decode_image(encode(pal, "PNG", transparency=0), max_pixels=MAX_PIXELS)
    assert img.mode == "RGB"
    assert [img.getpixel((x, 0)) for x in range(4)] == [(255, 255, 255), (200, 30, 40)] * 2


@pytest.mark.parametrize(("mode", "colour"), [("RGBA", (0, 0, 0, 128)), ("LA", (0, 128))])
def test_half_transparent_black_becomes_mid_grey(mode: str, colour: tuple[int, ...]) -> None:
    img = decode_image(encode(solid(mode, (4, 4), colour), "PNG"), max_pixels=MAX_PIXELS)
    assert img.mode == "RGB"
    r, g, b = img.getpixel((1, 1))  # type: ignore[misc]
    assert r == g == b and 125 <= r <= 129


@pytest.mark.parametrize(("mode", "colour", "expected"), [("L", 77, (77, 77, 77)), ("1", 1, (255, 255, 255))])
def test_grayscale_and_bilevel_pngs_become_rgb(mode: str, colour: int, expected: tuple[int, int, int]) -> None:
    img = decode_image(encode(solid(mode, (3, 3), colour), "PNG"), max_pixels=MAX_PIXELS)
    assert img.mode == "RGB" and img.getpixel((1, 1)) == expected


def test_one_pixel_image_decodes() -> None:
    img = decode_image(encode(solid("RGB", (1, 1), (1, 2, 3)), "PNG"), max_pixels=MAX_PIXELS)
    assert img.size == (1, 1) and img.getpixel((0, 0)) == (1, 2, 3)


# -- geometry --------------------------------------------------------------------------------


def exif_rotated_jpeg(size: tuple[int, int], orientation: int) -> bytes:
    """A JPEG stored ``size`` wide/high, red in the top-left quarter, with an EXIF orientation tag."""
    img = solid("RGB", size, (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, size[0] // 2, size[1] // 2))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, "JPEG", quality=95, exif=exif.tobytes())


def test_exif_orientation_6_rotates_to_upright() -> None:
    img = decode_image(exif_rotated_jpeg((80, 40), 6), max_pixels=MAX_PIXELS)
    assert img.size == (40, 80)
    # Orientation 6: the stored top-left is displayed top-right.
    r, _, b = img.getpixel((30, 10))  # type: ignore[misc]
    assert r > 200 and b < 50


def test_exif_orientation_is_respected_when_drafting() -> None:
    decoded = decode(exif_rotated_jpeg((1024, 512), 6), max_pixels=MAX_PIXELS, draft_to=(256, 256))
    assert decoded.original_size == (512, 1024)
    assert decoded.draft_scale == 2
    assert decoded.image.size == (256, 512)


def test_draft_keeps_the_shorter_side_at_least_the_target() -> None:
    data = (IMAGES / "chelsea_1024.jpg").read_bytes()
    decoded = decode(data, max_pixels=MAX_PIXELS, draft_to=(256, 256))
    assert decoded.draft_scale == 2 and decoded.image.size == (512, 341)
    assert decoded.extent == (512.0, 340.5)
    assert decode(data, max_pixels=MAX_PIXELS, draft_to=None).image.size == (1024, 681)


def test_draft_is_ignored_for_png() -> None:
    data = encode(solid("RGB", (1024, 1024), (5, 5, 5)), "PNG")
    decoded = decode(data, max_pixels=MAX_PIXELS, draft_to=(128, 128))
    assert decoded.draft_scale == 1 and decoded.image.size == (1024, 1024)


def test_extreme_aspect_ratio_decodes() -> None:
    img = decode_image(encode(solid("RGB", (8000, 2), (9, 8, 7)), "PNG"), max_pixels=MAX_PIXELS)
    assert img.size == (8000, 2) and img.mode == "RGB"


@pytest.mark.parametrize("size", [(8000, 2), (2, 8000), (1, 1), (10000, 1)])
def test_preprocessing_handles_extreme_shapes(size: tuple[int, int]) -> None:
    data = encode(solid("RGB", size, (9, 8, 7)), "PNG")
    buffers: dict[str, np.ndarray] = {}

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        buffers[name] = np.zeros(shape, dtype)
        return buffers[name]

    EfficientNetPreprocessor().preprocess_image(data, allocate, max_pixels=MAX_PIXELS)
    pixels = buffers["pixels"]
    assert pixels.shape == (3, 224, 224) and pixels.dtype == np.uint8
    assert pixels[:, 112, 112].tolist() == [9, 8, 7]


def test_bad_image_never_allocates() -> None:
    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        raise AssertionError("allocate must not be called for an undecodable image")

    with pytest.raises(UndecodableImage):
        EfficientNetPreprocessor().preprocess_image(b"nope", allocate, max_pixels=MAX_PIXELS)


# -- fuzzing ---------------------------------------------------------------------------------


def _seed_images() -> list[bytes]:
    small = Image.open(IMAGES / "camera_640.jpg").convert("RGB").resize((48, 48))
    return [encode(small, "JPEG", quality=80), encode(small, "PNG"), encode(small, "WEBP", quality=80)]


SEEDS = _seed_images()


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.integers(0, 10_000),
)
def test_corrupted_images_raise_only_shmgate_errors(seed: int, edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(SEEDS[seed])
    for position, value in edits:
        data[position % len(data)] = value
    data = data[: max(1, len(data) - cut % 64)]
    try:
        img = decode_image(bytes(data), max_pixels=1_000_000)
    except (UndecodableImage, ImageTooLarge):
        return
    assert img.mode == "RGB" and img.width >= 1 and img.height >= 1
    # Whatever we accept, Pillow decodes in one clean load: nothing half-decoded slips through.
    with Image.open(io.BytesIO(bytes(data))) as plain:
        plain.load()


def test_png_with_corrupt_pixel_data_is_undecodable() -> None:
    data = bytearray(encode(Image.open(IMAGES / "coffee_640.jpg"), "PNG"))
    idat = data.index(b"IDAT")
    for offset in (200, 5000, 50_000):
        data[idat + offset] ^= 0xFF
    with pytest.raises(UndecodableImage):
        decode_image(bytes(data), max_pixels=MAX_PIXELS)


# -- tiled conversion matches whole-image conversion -------------------------------------------


def _whole_image_rgb(img: Image.Image) -> Image.Image:
    """The conversion semantics on the whole image at once: the reference the tiles must match."""
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    if img.mode.startswith("I;16") or img.mode == "I":
        wide = np.asarray(img).astype(np.int64)
        return Image.fromarray(((np.clip(wide, 0, 65535) + 128) // 257).astype(np.uint8)).convert("RGB")
    return img.convert("RGB")


def _many_tiles_sample(mode: str, size: tuple[int, int] = (400, 250)) -> Image.Image:
    """Noise in ``mode``; the default size is two conversion tiles, the last one partial."""
    rng = np.random.default_rng(7)
    width, height = size
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    if mode == "P":  # random indices into a random palette (quantizing noise takes seconds)
        palette = Image.fromarray(rng.integers(0, 200, (height, width), dtype=np.uint8), "P")
        palette.putpalette(rng.integers(0, 256, 200 * 3, dtype=np.uint8).tolist())
        return palette
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    return rgba.convert(mode)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize(
    ("mode", "size"), [(m, (400, 250)) for m in ("RGB", "L", "P", "LA", "RGBA", "I;16")] + [("LA", (70_000, 2))]
)  # wider than a tile: a row is split
def test_tiled_conversion_and_rotation_equal_the_whole_image_ones(
    mode: str, size: tuple[int, int], orientation: int
) -> None:
    from PIL import ImageOps

    source = _many_tiles_sample(mode, size)
    exif = Image.Exif()
    exif[0x0112] = orientation
    options: dict[str, object] = {"transparency": 3} if mode == "P" else {}
    data = encode(source, "PNG", exif=exif.tobytes(), **options)
    with Image.open(io.BytesIO(data)) as reference:
        upright = ImageOps.exif_transpose(reference)  # a transpose commutes with a per-pixel conversion
        assert upright is not None
        expected = _whole_image_rgb(upright)
    img = decode_image(data, max_pixels=MAX_PIXELS)
    assert img.mode == "RGB" and img.size == expected.size
    assert np.array_equal(np.asarray(img), np.asarray(expected))


def _png_with_exif_after_pixels(size: tuple[int, int], orientation: int) -> bytes:
    """An RGB PNG whose eXIf chunk follows IDAT (allowed by older writers): unseen in the header."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(solid("RGB", size, (9, 8, 7)), "PNG", exif=exif.tobytes())
    start = data.index(b"eXIf") - 4
    length = struct.unpack(">I", data[start : start + 4])[0]
    chunk = data[start : start + 12 + length]
    data = data.replace(chunk, b"")
    end = data.index(b"IEND") - 4
    return data[:end] + chunk + data[end:]


def test_a_rotation_seen_only_after_the_pixels_is_counted_before_converting() -> None:
    from shmgate.gateway.imaging import predict

    data = _png_with_exif_after_pixels((300, 200), 6)
    # The header shows an RGB image that needs no conversion: 4 bytes a pixel, within 60,000 pixels.
    assert predict(data, max_pixels=60_000).pixel_bytes == 300 * 200 * 4
    # Its late EXIF asks for a rotation, which needs the rotated copy too: counted before making it.
    with pytest.raises(ImageTooLarge, match="RGB result"):
        decode_image(data, max_pixels=60_000)
    assert decode_image(data, max_pixels=200_000).size == (200, 300)
