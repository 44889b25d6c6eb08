"""Qwen2-VL's video processing, on frames a frontend decodes: sampling, sizes, patches, prompt tokens.

What transformers' ``Qwen2VLVideoProcessor`` does, without torch (a frontend never imports it):
- Sampling (``sample_frames``): ``fps`` frames per second of the stream, at least ``min_frames`` and at
  most ``max_frames`` (and the stream's own count), floored to a multiple of ``temporal_patch_size``;
  indices ``arange(0, total, total / n)`` truncated.
- Size (``smart_resize``): both sides multiples of ``patch_size * merge_size``, the area between the
  video's ``size.shortest_edge`` and ``size.longest_edge`` pixels, the aspect ratio kept.
- Pixels: bicubic resize (Pillow's, as the image processor's PIL backend resizes: the same frame sent
  as an image and as a video gives the same patches), rescale by ``rescale_factor``, normalise by the
  image processor's mean and std.
- Patches (``patchify``): a frame count padded with the last frame to a multiple of
  ``temporal_patch_size``, then ``(grid_t * grid_h * grid_w, C * temporal * patch * patch)`` in the
  merge order; ``video_grid_thw`` int64 ``(1, 3)``.

Every setting comes from the checkpoint: ``video_preprocessor_config.json`` when it has one, else the
image processor's patch, merge, temporal patch size, mean and std with the video processor's class
defaults for the rest (``fps`` 2, frames 4..768, 128..768 merged patches per frame).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from shmgate.gateway import video
from shmgate.gateway.preprocess.base import AllocateFn
from shmgate.shared.errors import ImageTooLarge, InvalidRequest, UndecodableVideo

__all__ = [
    "PIXEL_VALUES_VIDEOS",
    "VIDEO_GRID_THW",
    "VideoSettings",
    "preprocess_video",
    "sample_indices",
    "smart_resize",
]

PIXEL_VALUES_VIDEOS = "pixel_values_videos"
VIDEO_GRID_THW = "video_grid_thw"
# Seconds per temporal patch (float32 (1,)): Qwen2.5-VL spaces a video's temporal positions by it, as
# its processor computes it (temporal_patch_size / the sampled frame rate); Qwen2-VL ignores it.
SECOND_PER_GRID = "second_per_grid_ts"
# Qwen2VLVideoProcessor's class defaults, used where the checkpoint says nothing.
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 768
DEFAULT_MIN_TOKENS = 128  # size.shortest_edge = 128 merged patches' pixels
DEFAULT_MAX_TOKENS = 768  # size.longest_edge


@dataclass(frozen=True)
class VideoSettings:
    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_checkpoint(cls, path: str, image_processor: Any) -> VideoSettings:
        """The checkpoint's video processor settings, with the defaults the module docstring names."""
        config: dict[str, Any] = {}
        name = os.path.join(path, "video_preprocessor_config.json")
        if os.path.isfile(name):
            with open(name, encoding="utf-8") as f:
                config = json.load(f)
        patch = int(config.get("patch_size", image_processor.patch_size))
        merge = int(config.get("merge_size", image_processor.merge_size))
        side = patch * merge
        size = config.get("size") or {}
        return cls(
            fps=float(config.get("fps") or DEFAULT_FPS),
            min_frames=int(config.get("min_frames", DEFAULT_MIN_FRAMES)),
            max_frames=int(config.get("max_frames", DEFAULT_MAX_FRAMES)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_TOKENS * side * side),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_TOKENS * side * side),
            patch_size=patch,
            temporal_patch_size=int(config.get("temporal_patch_size", image_processor.temporal_patch_size)),
            merge_size=merge,
            rescale_factor=float(config.get("rescale_factor", image_processor.rescale_factor)),
            mean=tuple(float(v) for v in config.get("image_mean", image_processor.image_mean)),
            std=tuple(float(v) for v in config.get("image_std", image_processor.image_std)),
        )

    def describe(self) -> dict[str, Any]:
        """What the content-cache key holds of these settings."""
        return {"kind": "qwen-video/1", **self.__dict__}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize`` (Qwen2-VL's), the aspect-ratio bound a 400 here."""
    if max(height, width) / min(height, width) > 200:
        raise UndecodableVideo("the video's aspect ratio is above 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_indices(total: int, stream_fps: float, s: VideoSettings, most: int) -> tuple[int, ...]:
    """``Qwen2VLVideoProcessor.sample_frames`` with ``fps``; refuses more than ``most`` frames (the
    ``--max-video-frames`` flag) with a 413."""
    temporal = s.temporal_patch_size
    max_frames = math.floor(min(s.max_frames, total) / temporal) * temporal
    wanted = total / stream_fps * s.fps
    n = math.floor(min(max(wanted, s.min_frames), max_frames, total) / temporal) * temporal
    if n <= 0:  # fewer frames than one temporal patch: every frame, padded later with the last
        n = total
    if n > most:
        raise ImageTooLarge(f"the video samples {n} frames; at most {most} are decoded (--max-video-frames)")
    step = total / n
    return tuple(int(i * step) for i in range(n))  # arange(0, total, total / n).int()


def _resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))


def patchify(frames: np.ndarray, s: VideoSettings, out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint8 ``(T, H, W, 3)`` frames -> (float32 ``pixel_values_videos``, int64 ``video_grid_thw`` (1, 3)).

    One float32 copy of the frames, normalised in place, then one strided copy into ``out`` (the
    arena's buffer, ``patch_shape``'s shape) or a new array: the decode budget reserves exactly that."""
    t, height, width, channels = frames.shape
    temporal, patch, merge = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -t % temporal:  # the last frame repeated, as the processor pads
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        t += pad
    x = frames.astype(np.float32)
    x *= np.float32(s.rescale_factor)
    x -= np.asarray(s.mean, np.float32)
    x /= np.asarray(s.std, np.float32)
    gt, gh, gw = t // temporal, height // patch, width // patch
    # (group, frame in group, block row, row in block, pixel row, block col, col in block, pixel col, channel)
    view = x.reshape(gt, temporal, gh // merge, merge, patch, gw // merge, merge, patch, channels)
    view = view.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # row order: merge blocks; within a row: C, T, P, P
    rows = out if out is not None else np.empty(patch_shape(t, height, width, channels, s), np.float32)
    np.copyto(rows.reshape(view.shape), view)
    return rows, np.asarray([[gt, gh, gw]], dtype=np.int64)


def patch_shape(frames: int, height: int, width: int, channels: int, s: VideoSettings) -> tuple[int, int]:
    """``pixel_values_videos``'s shape for ``frames`` frames of ``height`` x ``width`` (padded as patchify pads)."""
    temporal, patch = s.temporal_patch_size, s.patch_size
    groups = -(-frames // temporal)
    return groups * (height // patch) * (width // patch), channels * temporal * patch * patch


def plan(found: video.VideoProbe, s: VideoSettings, max_frames: int) -> video.VideoPlan:
    """The sampled frames of ``found`` (at most ``max_frames``) and their processed size."""
    indices = sample_indices(found.frames, found.fps, s, max_frames)
    height, width = smart_resize(found.height, found.width, s.patch_size * s.merge_size, s.min_pixels, s.max_pixels)
    return video.VideoPlan(indices, height, width)


def preprocess_video(
    data: bytes, s: VideoSettings, allocate: AllocateFn, reserve: Any, limits: video.VideoLimits
) -> None:
    """Probe, reserve the predicted memory (``reserve(nbytes)``, a context manager: the decode budget's),
    decode the sampled frames, patch them and copy ``pixel_values_videos``, ``video_grid_thw`` and
    ``second_per_grid_ts`` into the arena (asked for once, after everything succeeded). ``limits``: the
    frontend's bounds on one video."""
    found = video.probe(data, limits)
    planned = plan(found, s, limits.max_frames)
    with reserve(planned.peak_bytes(found)):
        frames = video.decode_frames(data, found, planned, _resize, limits)
        shape = patch_shape(len(frames), planned.height, planned.width, 3, s)
        _, grid = patchify(frames, s, out=allocate(PIXEL_VALUES_VIDEOS, "float32", shape))
        del frames
        sampled_fps = len(planned.indices) / found.frames * found.fps  # transformers' VideoMetadata.sampled_fps
        seconds = np.asarray([s.temporal_patch_size / sampled_fps], dtype=np.float32)
        for name, array in ((VIDEO_GRID_THW, grid), (SECOND_PER_GRID, seconds)):
            np.copyto(allocate(name, array.dtype.name, tuple(array.shape)), array, casting="no")


# config.json model_types whose video this module processes (Qwen3-VL's prompt also needs a timestamp
# per frame group, and its processor other defaults: not yet).
VIDEO_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})


def video_tokens(spec: Mapping[str, tuple[str, tuple[int, ...]]], s: VideoSettings) -> int:
    """A video's prompt tokens from its tensors' shapes: one per merge x merge block of patches."""
    shape = spec[PIXEL_VALUES_VIDEOS][1]
    merge = s.merge_size**2
    if len(shape) != 2 or shape[0] <= 0 or shape[0] % merge or VIDEO_GRID_THW not in spec:
        raise InvalidRequest(f"A video has {shape} patches, not made by this preprocessor.")
    return shape[0] // merge
