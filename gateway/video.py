"""Video content: a container probed, frames sampled by seeking, decoded in a frontend's decode thread.

Video is images over time: a ``video_url`` content part travels the path of an ``image_url`` (the
content cache keyed by the file's bytes and its processing, the arena, the decode memory budget,
the decode threads), marked by ``VIDEO_OPTION`` in its processing options. What differs is here:

1. ``probe`` reads the container's metadata (format, streams, codec, size, duration, frame count)
   without decoding a frame, and refuses what is not a video this server decodes or exceeds the
   limits (``VideoLimits``: the longest duration, the most frames sampled, the largest frame; the
   frontend's, handed down with each decode by its decode budget, gateway/decode_budget.py).
2. The memory the decode will take is predicted from the probe (``VideoPlan.peak_bytes``: the codec's
   reference frames at the stream's size, one full-size RGB frame, and the sampled frames at their
   processed size, as uint8 and as one float32 copy) and reserved in the frontend's decode budget
   before any frame is decoded, as an image's header prediction is (gateway/decode_budget.py).
3. ``decode_frames`` seeks to each sampled timestamp (the keyframe before it, then decodes forward)
   when the next sample is further than ``SEEK_GAP_S`` ahead, and decodes straight on otherwise. Each
   frame is resized as soon as it is decoded, so only the sampled frames at their processed size are
   held. A frame larger than the probe said (a stream that lies about its size) is refused; a decode
   that runs past ``VideoLimits.decode_timeout_s`` is stopped between frames.

What a frame becomes (sampling counts, sizes, patches) is the model's processor's business
(gateway/preprocess/qwen_video.py); this module only hands it frames at the size it asks for.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmgate.shared.errors import ImageTooLarge, UndecodableVideo

__all__ = [
    "ACCEPTED_VIDEO_TYPES",
    "DEFAULT_LIMITS",
    "VIDEO_DETAIL",
    "VIDEO_OPTION",
    "VideoLimits",
    "VideoPlan",
    "VideoProbe",
    "decode_frames",
    "is_video",
    "probe",
]

# The internal markers a video part carries through intake (its "detail") and its processing options
# (part of its content-cache key, so a file sent as a video and as an image never share tensors).
VIDEO_DETAIL = "\x00video"
VIDEO_OPTION = "video"
ACCEPTED_VIDEO_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/mpeg4")
# FFmpeg's demuxer names (``container.format.name`` lists aliases joined by commas) and decoders taken.
_FORMATS = frozenset({"mov", "mp4", "m4a", "3gp", "3g2", "mj2", "matroska", "webm"})
_CODECS = frozenset({"h264", "hevc", "mpeg4", "vp8", "vp9", "av1", "libdav1d", "libvpx", "libvpx-vp9"})
# Decode straight on when the next sample is this close; seek to the keyframe before it otherwise.
SEEK_GAP_S = 1.0
# The codec's own working memory per pixel of the stream: up to 16 reference frames of YUV 4:2:0
# (H.264's most; VP9 keeps 8, AV1 8) at 1.5 bytes per pixel, plus the frame being decoded.
CODEC_PIXEL_BYTES = 17 * 3 // 2 + 1
FIXED_BYTES = 16 << 20  # the demuxer's and decoder's fixed state, the file's own bytes aside


@dataclass(frozen=True)
class VideoLimits:
    """What a frontend decodes of one video (``--max-video-seconds``, ``--max-video-frames``)."""

    max_seconds: float = 600.0
    max_frames: int = 768
    # The largest frame (pixels) a stream may have: DCI 4K. A 4096 x 4096 or 8K stream is refused.
    max_frame_pixels: int = 4096 * 2160
    max_streams: int = 8  # a container of thousands of tiny streams is refused at the probe
    decode_timeout_s: float = 20.0  # a decode still running after this is stopped between frames


DEFAULT_LIMITS = VideoLimits()  # a frontend's without --max-video-seconds and --max-video-frames


def is_video(options: dict[str, Any] | None) -> bool:
    """Whether an item's processing options mark it as a video part."""
    return options is not None and VIDEO_OPTION in options


@dataclass(frozen=True)
class VideoProbe:
    """A video stream's facts, read from the container without decoding."""

    format: str
    codec: str
    width: int
    height: int
    duration_s: float
    frames: int  # the stream's frame count (from the container, else duration x rate)
    fps: float


@dataclass(frozen=True)
class VideoPlan:
    """What will be decoded: the sampled frame indices, the size each is resized to, and the bytes."""

    indices: tuple[int, ...]
    height: int  # processed size of each sampled frame
    width: int

    def peak_bytes(self, found: VideoProbe) -> int:
        pixels = found.width * found.height
        # The resized frames as uint8 (one more where the processor pads a temporal patch) and their one
        # float32 copy; the patches are written into the arena, which bounds them on its own.
        held = (len(self.indices) + 1) * self.height * self.width * 3
        return FIXED_BYTES + pixels * (CODEC_PIXEL_BYTES + 3 + 4) + held * (1 + 4)


_READABLE = "send MP4/MOV or WebM/Matroska with H.264, H.265, MPEG-4, VP8, VP9 or AV1 video"


def _reason(exc: Exception) -> str:
    """FFmpeg's own words for a failure, without its errno and the '<none>' file name of an in-memory input."""
    import av

    if isinstance(exc, av.error.FFmpegError) and exc.strerror:
        return str(exc.strerror)[:120]
    return f"{type(exc).__name__}: {str(exc)[:120]}"


def _open(data: bytes) -> Any:
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, OSError, UnicodeDecodeError) as exc:
        raise UndecodableVideo(f"the data is not a video this server reads ({_reason(exc)}); {_READABLE}") from None


def probe(data: bytes, limits: VideoLimits) -> VideoProbe:
    """The container's video stream facts. Raises UndecodableVideo (not a video container this server
    reads, no video stream, a codec it does not decode) or ImageTooLarge (past ``limits``)."""
    if not data:
        raise UndecodableVideo("the video is empty")
    with _open(data) as container:
        return _probe_open(container, limits)


def _probe_open(container: Any, lim: VideoLimits) -> VideoProbe:
    names = set(str(container.format.name).split(","))
    if not names & _FORMATS:
        raise UndecodableVideo(
            f"not a video container this server reads ({str(container.format.name)[:40]}); send MP4 or WebM"
        )
    if len(container.streams) > lim.max_streams:
        raise UndecodableVideo(
            f"the container holds {len(container.streams)} streams; at most {lim.max_streams} are read"
        )
    videos = container.streams.video
    if not videos:
        raise UndecodableVideo("the container holds no video stream")
    stream = videos[0]
    if stream.codec_context is None:  # FFmpeg found no decoder for what the stream claims to be
        raise UndecodableVideo("the video stream's codec is unknown")
    codec = str(stream.codec_context.name)
    if codec not in _CODECS:
        raise UndecodableVideo(
            f"the video codec {codec[:20]!r} is not decoded here; send H.264, H.265, VP8, VP9 or AV1"
        )
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise UndecodableVideo("the video stream has no frame size")
    if width * height > lim.max_frame_pixels:
        raise ImageTooLarge(
            f"the video's frames are {width} x {height} pixels; at most {lim.max_frame_pixels:,} pixels per frame are decoded"
        )
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    duration_s = 0.0
    if stream.duration is not None and stream.time_base is not None:
        duration_s = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration_s = container.duration / 1_000_000
    if not (fps > 0 and math.isfinite(fps)) or fps > 1000:
        raise UndecodableVideo("the video stream has no usable frame rate")
    if not math.isfinite(duration_s) or duration_s < 0:
        raise UndecodableVideo("the video has no usable duration")
    if duration_s > lim.max_seconds:
        raise ImageTooLarge(f"the video is {duration_s:.0f} s long; at most {lim.max_seconds:g} s are decoded")
    frames = int(stream.frames) or int(duration_s * fps)
    if frames <= 0:
        raise UndecodableVideo("the video has no frames")
    if frames > duration_s * fps * 1.5 + 2:  # a frame count the duration and rate cannot hold
        frames = max(1, int(duration_s * fps))
    return VideoProbe(",".join(sorted(names & _FORMATS)), codec, width, height, duration_s, frames, fps)


def decode_frames(
    data: bytes,
    found: VideoProbe,
    plan: VideoPlan,
    resize: Callable[[np.ndarray, int, int], np.ndarray],
    limits: VideoLimits,
) -> np.ndarray:
    """The planned frames, each resized by ``resize(rgb, height, width)`` as soon as it is decoded:
    uint8 ``(frames, height, width, 3)``. Raises UndecodableVideo for a corrupt stream, a frame larger
    than the probe said, or a decode past ``limits.decode_timeout_s``; InvalidRequest when a sampled frame is
    missing (a stream shorter than its container says)."""
    import av

    lim = limits
    deadline = time.monotonic() + lim.decode_timeout_s
    out = np.empty((len(plan.indices), plan.height, plan.width, 3), dtype=np.uint8)
    with _open(data) as container:
        stream = container.streams.video[0]
        stream.thread_count = 1  # the frontend's decode threads are the parallelism
        base = stream.start_time or 0
        tb = stream.time_base
        taken = 0
        current_s = -math.inf
        sought = -1  # the sample last sought: decoding from its keyframe runs on until it is reached
        try:
            while taken < len(plan.indices):
                if plan.indices[taken] / found.fps - current_s > SEEK_GAP_S and sought != taken:
                    target_s = plan.indices[taken] / found.fps
                    container.seek(base + int(target_s / tb), stream=stream, backward=True, any_frame=False)
                    sought = taken
                for frame in container.decode(stream):
                    if time.monotonic() > deadline:
                        raise UndecodableVideo(f"decoding the video took longer than {lim.decode_timeout_s:g} s")
                    if frame.width * frame.height > found.width * found.height:
                        raise UndecodableVideo("a frame of the video is larger than its stream says")
                    current_s = float(((frame.pts if frame.pts is not None else 0) - base) * tb)
                    # The frame shown at a sample's time: the first one starting at or (by half a frame) before it.
                    while taken < len(plan.indices) and current_s + 0.5 / found.fps >= plan.indices[taken] / found.fps:
                        out[taken] = resize(frame.to_ndarray(format="rgb24"), plan.height, plan.width)
                        taken += 1
                    if taken == len(plan.indices):
                        break
                    if plan.indices[taken] / found.fps - current_s > SEEK_GAP_S and sought != taken:
                        break  # far ahead: seek there
                else:
                    break  # the stream ended
        except av.error.FFmpegError as exc:
            raise UndecodableVideo(f"the video stream is corrupt ({_reason(exc)})") from None
    if taken == 0:
        raise UndecodableVideo("no frame of the video could be decoded")
    if taken < len(plan.indices):  # the stream ended early: the last frame stands for the rest
        out[taken:] = out[taken - 1]
    return out
