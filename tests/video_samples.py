"""Tiny synthetic videos made with PyAV for the video tests: each frame a flat grey of its own index,
so which frames were sampled can be read back from the pixels.

``python -m tests.video_samples clip.mp4`` (or ``clip.webm``) writes one for trying the ``video_url``
examples of docs/MODELS.md: 2 seconds at 10 frames/s, 64 x 48 pixels, H.264 in MP4 or VP9 in WebM
(PyAV comes with the ``hf`` extra); ``--seconds`` and ``--size WxH`` change it.
"""

from __future__ import annotations

import argparse
import io
import sys
from fractions import Fraction

import numpy as np

# container, codec, pixel format of the encoder
MP4 = ("mp4", "libx264", "yuv420p")
MP4_MPEG4 = ("mp4", "mpeg4", "yuv420p")
WEBM = ("webm", "libvpx-vp9", "yuv420p")
WEBM_VP8 = ("webm", "libvpx", "yuv420p")


def frame_level(i: int) -> int:
    """Frame ``i``'s grey level (distinct for the first 25 frames, then repeating)."""
    return 16 + (i % 25) * 9


def make_video(
    kind: tuple[str, str, str] = MP4,
    *,
    width: int = 64,
    height: int = 48,
    frames: int = 20,
    fps: int = 10,
    gop: int = 10,
    pts_step: int = 1,
    extra_streams: int = 0,
    shift: int = 0,
) -> bytes:
    """An encoded video of ``frames`` flat frames (``frame_level``) at ``fps``; ``pts_step`` spaces the
    frames' timestamps (a long duration from few frames); ``extra_streams`` more tiny video streams;
    ``shift`` offsets every grey level (distinct files of the same shape)."""
    import av

    fmt, codec, pix = kind
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        streams = []
        for n in range(1 + extra_streams):
            s = out.add_stream(codec, rate=fps)
            s.width, s.height = (width, height) if n == 0 else (16, 16)
            s.pix_fmt = pix
            s.time_base = Fraction(1, fps)
            s.codec_context.gop_size = gop
            streams.append(s)
        for i in range(frames):
            for n, s in enumerate(streams):
                if n and i:
                    continue
                w, h = s.width, s.height
                rgb = np.full((h, w, 3), (frame_level(i) + shift) % 256, dtype=np.uint8)
                rgb[: h // 4, : w // 4] = 255 - rgb[: h // 4, : w // 4]  # some detail for the encoder
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts = i * pts_step
                for packet in s.encode(frame):
                    out.mux(packet)
        for s in streams:
            for packet in s.encode():
                out.mux(packet)
    return buf.getvalue()


def lying_video(claimed: tuple[int, int] = (64, 48), actual: tuple[int, int] = (640, 360)) -> bytes:
    """A WebM whose VP8 stream says ``claimed`` (its header, what a probe reads) but switches to
    ``actual`` after five frames: VP8 keyframes carry their own size, so the decoder follows them."""
    import av

    def packets(width: int, height: int, n: int, start: int) -> list[av.Packet]:
        encoder = av.CodecContext.create("libvpx", "w")
        encoder.width, encoder.height, encoder.pix_fmt = width, height, "yuv420p"
        encoder.time_base = Fraction(1, 10)
        out: list[av.Packet] = []
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 100, np.uint8), format="rgb24")
            frame = frame.reformat(format="yuv420p")
            frame.pts = i
            out += encoder.encode(frame)
        out += encoder.encode(None)
        for packet in out:
            packet.pts = packet.dts = (packet.pts or 0) + start
        return out

    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as container:
        stream = container.add_stream("libvpx", rate=10)
        stream.width, stream.height = claimed
        stream.pix_fmt = "yuv420p"
        stream.time_base = Fraction(1, 10)
        for packet in packets(*claimed, 5, 0) + packets(*actual, 5, 5):
            packet.stream = stream
            packet.time_base = Fraction(1, 10)
            container.mux(packet)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.video_samples", description="write a small test video")
    parser.add_argument("path", help="where to write it: a name ending in .mp4 (H.264) or .webm (VP9)")
    parser.add_argument("--seconds", type=float, default=2.0, help="its length at 10 frames a second (default 2)")
    parser.add_argument("--size", default="64x48", help="WIDTHxHEIGHT in pixels, even numbers (default 64x48)")
    args = parser.parse_args(argv)
    kinds = {".mp4": MP4, ".webm": WEBM}
    kind = kinds.get(args.path[args.path.rfind(".") :].lower())
    if kind is None:
        parser.error(f"{args.path}: the name must end in .mp4 or .webm")
    width, _, height = args.size.partition("x")
    if not (width.isdigit() and height.isdigit()) or int(width) % 2 or int(height) % 2:
        parser.error(f"--size {args.size!r}: WIDTHxHEIGHT in even pixels, e.g. 64x48")
    frames = max(1, round(args.seconds * 10))
    data = make_video(kind, width=int(width), height=int(height), frames=frames)
    with open(args.path, "wb") as out:
        out.write(data)
    print(f"{args.path}: {frames} frames at 10 frames/s, {width} x {height}, {len(data):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
