"""Fidelity bounds of the classifier preprocessing's fast paths, against a reference written apart from it.

The reference (``reference_pixels``) is the textbook EfficientNet-Lite0 recipe, written here from
Pillow's documented calls and nothing of gateway/: full decode, EXIF transpose
(``ImageOps.exif_transpose``), RGB (alpha composited on white, 16-bit gray scaled by 1/257),
resize of the whole image so its shorter side is 256 (bicubic, longer side rounded), centre crop
224 (offset rounded), inputs scaled to [-1, 1] (``x / 127.5 - 1``). Each fast path of
``gateway.preprocess.vision.EfficientNetPreprocessor`` (JPEG draft decode at a margin: the DCT
downscale may stop at ``resize_to * margin`` on the shorter side; 0 is a full decode; the
crop-box resize that never builds the 256 px intermediate is in every path) is fed the same files and
compared on:

* pixels: the largest absolute difference of any uint8 value, and the mean one;
* the classifier: top-1 agreement with the reference's label (the same weights for both);
* embeddings: the cosine between the pooled 1280-d features, the smallest over the set;
* its cost: CPU ms per image of the preprocessing alone (one thread), for the trade-off.

The set (``fidelity_set``): the photos of tests/data/images, seeded crops of them at many sizes,
aspect ratios and JPEG qualities, and generated edge cases (EXIF orientations 2-8, CMYK, 16-bit
PNG, grayscale, RGBA and palette PNGs with transparency, WebP, odd and tiny sizes).

Usage: ``python bench/fidelity.py [--crops N] [--margins 0 1 1.5 2] [--json FILE]``; prints a markdown
table. tests/test_fidelity.py asserts the bounds docs/BENCHMARKS.md states on a smaller set.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageOps  # noqa: E402

PHOTOS = sorted((REPO / "tests" / "data" / "images").glob("*.jpg"))
RESIZE, CROP = 256, 224
MAX_PIXELS = 8192 * 8192
DEFAULT_MARGINS = (0.0, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class Sample:
    name: str
    data: bytes


# -- the reference ------------------------------------------------------------------------------


def reference_pixels(data: bytes, resize_to: int = RESIZE, crop: int = CROP) -> np.ndarray:
    """(crop, crop, 3) uint8: full decode, EXIF transpose, RGB, shorter side to ``resize_to``, centre crop."""
    img = Image.open(io.BytesIO(data))
    img.load()
    img = ImageOps.exif_transpose(img) or img
    img = _to_rgb(img)
    w, h = img.size
    if w <= h:
        size = (resize_to, max(resize_to, round(resize_to * h / w)))
    else:
        size = (max(resize_to, round(resize_to * w / h)), resize_to)
    img = img.resize(size, Image.Resampling.BICUBIC)
    left, top = round((size[0] - crop) / 2), round((size[1] - crop) / 2)
    return np.asarray(img.crop((left, top, left + crop, top + crop)))


def _to_rgb(img: Image.Image) -> Image.Image:
    if (
        img.mode in ("RGBA", "LA", "PA")
        or (img.mode == "P" and "transparency" in img.info)
        or (img.mode in ("L", "RGB") and "transparency" in img.info)
    ):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode.startswith("I;16") or img.mode == "I":
        gray = np.asarray(img, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(gray / 257.0), 0, 255).astype(np.uint8), "L").convert("RGB")
    return img.convert("RGB")


def normalise(pixels_hwc: np.ndarray) -> torch.Tensor:
    """EfficientNet-Lite0's input: NCHW float32 in [-1, 1]."""
    return torch.from_numpy(pixels_hwc.astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()


# -- the gateway's fast paths -------------------------------------------------------------------


def gateway_pixels(data: bytes, margin: float, reducing_gap: float | None = None) -> np.ndarray:
    """(crop, crop, 3) uint8 from the gateway's classifier preprocessing at this draft margin (and resize)."""
    from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor

    out: list[np.ndarray] = []

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        out.append(np.empty(shape, dtype=dtype))
        return out[-1]

    pre = EfficientNetPreprocessor(draft_margin=margin, reducing_gap=reducing_gap)
    pre.preprocess_image(data, allocate, max_pixels=MAX_PIXELS)
    return out[0].transpose(1, 2, 0)


# -- the test set -------------------------------------------------------------------------------


def _jpeg(img: Image.Image, quality: int = 90, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, **kwargs)
    return buf.getvalue()


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def crops(count: int, seed: int = 0) -> Iterator[Sample]:
    """Seeded crops of the 1024 px photos: 0.3-1.0 of a side, aspect 0.5-2, long side 240-1800 px, JPEG
    quality 70-97: many distinct classifier inputs out of three photos."""
    rng = random.Random(seed)
    sources = [Image.open(p).convert("RGB") for p in PHOTOS if "_1024" in p.name]
    for i in range(count):
        src = sources[i % len(sources)]
        w, h = src.size
        cw = max(16, int(w * rng.uniform(0.3, 1.0)))
        ch = max(16, min(h, int(cw * rng.uniform(0.5, 2.0))))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        region = src.crop((x, y, x + cw, y + ch))
        long_side = rng.randint(240, 1800)
        scale = long_side / max(cw, ch)
        region = region.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.Resampling.LANCZOS)
        yield Sample(f"crop{i}", _jpeg(region, quality=rng.randint(70, 97)))


def edge_cases() -> Iterator[Sample]:
    """The files that take the decoder's other branches."""
    photo = Image.open(PHOTOS[0]).convert("RGB")  # camera_1024.jpg
    wide = photo.crop((0, 100, 1024, 500))
    for orientation in range(2, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        yield Sample(f"exif{orientation}", _jpeg(wide, exif=exif.tobytes()))
    yield Sample("cmyk", _jpeg(photo.convert("CMYK")))
    yield Sample("gray-jpeg", _jpeg(photo.convert("L")))
    gray16 = np.minimum(np.asarray(photo.convert("L"), dtype=np.uint32) * 257 + 100, 65535).astype(np.uint16)
    yield Sample("png16", _png(Image.fromarray(gray16)))
    rgba = photo.convert("RGBA")
    alpha = np.tile(np.linspace(0, 255, rgba.size[0], dtype=np.uint8), (rgba.size[1], 1))
    rgba.putalpha(Image.fromarray(alpha, "L"))
    yield Sample("rgba-png", _png(rgba))
    palette = photo.resize((400, 300)).convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 0
    yield Sample("palette-png", _png(palette))
    buf = io.BytesIO()
    photo.save(buf, "WEBP", quality=85)
    yield Sample("webp", buf.getvalue())
    for w, h in [(1023, 377), (257, 255), (255, 4000), (4000, 300), (225, 225), (15, 9), (3, 2), (1, 1)]:
        yield Sample(f"odd{w}x{h}", _jpeg(photo.resize((w, h), Image.Resampling.LANCZOS)))
    yield Sample("odd-png-31x17", _png(photo.resize((31, 17))))


def fidelity_set(n_crops: int) -> list[Sample]:
    return [Sample(p.name, p.read_bytes()) for p in PHOTOS] + list(edge_cases()) + list(crops(n_crops))


# -- measuring ----------------------------------------------------------------------------------


class Lite0:
    """EfficientNet-Lite0 on the CPU (the package's weights): logits and pooled features of a batch."""

    def __init__(self) -> None:
        from shmgate.worker.backends.efficientnet import EfficientNetBackend

        self.model = EfficientNetBackend(torch.device("cpu")).model
        # Paths that do not draft an image (PNGs, small JPEGs) give the reference's pixels or each
        # other's: each distinct input runs once.
        self._seen: dict[bytes, tuple[int, np.ndarray]] = {}

    @torch.inference_mode()
    def run(self, batch: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(top-1 labels, unit-normalised features) for HWC uint8 images."""
        keys = [hashlib.blake2b(p.tobytes(), digest_size=16).digest() for p in batch]
        todo = list({k: p for k, p in zip(keys, batch, strict=True) if k not in self._seen}.items())
        for start in range(0, len(todo), 32):
            chunk = todo[start : start + 32]
            f = self.model.features(torch.stack([normalise(p) for _, p in chunk]))
            labels = self.model._fc(f).argmax(dim=1).numpy()
            vectors = torch.nn.functional.normalize(f, dim=1).numpy()
            for i, (key, _) in enumerate(chunk):
                self._seen[key] = (int(labels[i]), vectors[i])
        return np.array([self._seen[k][0] for k in keys]), np.stack([self._seen[k][1] for k in keys])


def measure(
    samples: list[Sample],
    margins: tuple[float, ...],
    model: Lite0 | None = None,
    gaps: tuple[float | None, ...] = (None,),
) -> list[dict[str, object]]:
    """One row per fast path (each margin with each resize ``reducing_gap``; and the reference's own
    cost), each against the reference."""
    model = model or Lite0()
    started = time.process_time()
    ref = [reference_pixels(s.data) for s in samples]
    ref_ms = (time.process_time() - started) * 1000 / len(samples)
    ref_labels, ref_features = model.run(ref)
    rows: list[dict[str, object]] = [
        {"path": "reference (full decode, resize, crop)", "margin": None, "cpu_ms_per_image": round(ref_ms, 2)}
    ]
    for margin, gap in [(m, g) for g in gaps for m in margins]:
        started = time.process_time()
        ours = [gateway_pixels(s.data, margin, gap) for s in samples]
        ms = (time.process_time() - started) * 1000 / len(samples)
        labels, features = model.run(ours)
        diffs = [np.abs(a.astype(np.int16) - b.astype(np.int16)) for a, b in zip(ours, ref, strict=True)]
        cosines = (features * ref_features).sum(axis=1)
        worst = int(np.argmin(cosines))
        rows.append(
            {
                "path": _path_name(margin) + ("" if gap is None else f", resize reducing_gap {gap:g}"),
                "margin": margin,
                "reducing_gap": gap,
                "images": len(samples),
                "top1_agreement": round(float((labels == ref_labels).mean()), 4),
                "top1_disagreeing": [s.name for s, a, b in zip(samples, labels, ref_labels, strict=True) if a != b],
                "min_cosine": round(float(cosines.min()), 5),
                "worst_cosine_image": samples[worst].name,
                "mean_cosine": round(float(cosines.mean()), 6),
                "pixel_max_abs_diff": int(max(int(d.max()) for d in diffs)),
                "pixel_mean_abs_diff": round(float(np.mean([d.mean() for d in diffs])), 3),
                "cpu_ms_per_image": round(ms, 2),
            }
        )
    return rows


def _path_name(margin: float) -> str:
    from shmgate.gateway.preprocess.vision import DEFAULT_DRAFT_MARGIN, EMBEDDING_DRAFT_MARGIN, FAST_DRAFT_MARGIN

    name = "full decode" if margin <= 0 else f"JPEG draft, margin {margin:g}"
    roles = {
        DEFAULT_DRAFT_MARGIN: "the labels' default",
        EMBEDDING_DRAFT_MARGIN: "the embeddings' default",
        FAST_DRAFT_MARGIN: "the fast option",
    }
    return f"{name} ({roles[margin]})" if margin in roles else name


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| path | top-1 agreement | min cosine (image) | mean cosine | pixel max abs diff | pixel mean abs diff "
        "| CPU ms/image |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["margin"] is None:
            lines.append(f"| {r['path']} | - | - | - | - | - | {r['cpu_ms_per_image']} |")
            continue
        agreement = float(r["top1_agreement"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['path']} | {agreement * 100:.1f} % | {r['min_cosine']} ({r['worst_cosine_image']}) "
            f"| {r['mean_cosine']} | {r['pixel_max_abs_diff']} | {r['pixel_mean_abs_diff']} "
            f"| {r['cpu_ms_per_image']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crops", type=int, default=400, help="seeded crops of the photos (default %(default)s)")
    parser.add_argument(
        "--margins",
        type=float,
        nargs="+",
        default=list(DEFAULT_MARGINS),
        help="JPEG draft margins to measure; 0 is a full decode",
    )
    parser.add_argument(
        "--gaps",
        type=float,
        nargs="*",
        default=[],
        help="also measure each margin with Pillow's resize(reducing_gap=G)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    samples = fidelity_set(args.crops)
    rows = measure(samples, tuple(args.margins), gaps=(None, *args.gaps))
    print(
        f"{len(samples)} images: {len(PHOTOS)} photos, {len(list(edge_cases()))} edge cases, {args.crops} crops",
        file=sys.stderr,
    )
    print(table(rows))
    for r in rows:
        if r.get("top1_disagreeing"):
            print(f"{r['path']}: top-1 differs on {', '.join(r['top1_disagreeing'])}", file=sys.stderr)  # type: ignore[arg-type]
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
