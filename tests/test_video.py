"""Video content (gateway/video.py, gateway/preprocess/qwen_video.py): probing, seeking and sampling,
the processor's patches, hostile files, and a real ``shmgate serve`` of the tiny Qwen2-VL answering
MP4 and WebM videos, a repeated one from the cache."""

from __future__ import annotations

import base64
import functools
import resource
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("av")

from shmgate.gateway import video  # noqa: E402
from shmgate.gateway.decode_budget import DecodeBudget  # noqa: E402
from shmgate.gateway.preprocess import qwen_video  # noqa: E402
from shmgate.shared.errors import ImageTooLarge, RequestError, UndecodableImage  # noqa: E402
from tests.hf_fixture import SMALL_VIDEO_PROCESSOR  # noqa: E402
from tests.serving import Server  # noqa: E402
from tests.video_samples import MP4, MP4_MPEG4, WEBM, WEBM_VP8, frame_level, lying_video, make_video  # noqa: E402


class _ImageProcessor:  # the settings a Qwen2-VL image processor carries
    patch_size, merge_size, temporal_patch_size, rescale_factor = 14, 2, 2, 1 / 255
    image_mean = (0.48145466, 0.4578275, 0.40821073)
    image_std = (0.26862954, 0.26130258, 0.27577711)


SETTINGS = qwen_video.VideoSettings.from_checkpoint("/nonexistent", _ImageProcessor)


LIMITS = video.VideoLimits()  # the defaults, as a frontend without --max-video-* has them


def _decode(
    data: bytes, settings: qwen_video.VideoSettings = SETTINGS, limits: video.VideoLimits = LIMITS
) -> tuple[Any, Any, np.ndarray]:
    found = video.probe(data, limits)
    plan = qwen_video.plan(found, settings, limits.max_frames)
    return found, plan, video.decode_frames(data, found, plan, qwen_video._resize, limits)


@pytest.mark.parametrize("kind", [MP4, MP4_MPEG4, WEBM, WEBM_VP8], ids=lambda k: k[1])
def test_the_sampled_frames_are_the_ones_at_the_sampled_times(kind: tuple[str, str, str]) -> None:
    """10 s at 10 fps sampled at 2 fps: frames 0, 5, 10, ... (transformers' indices), read back from
    each frame's grey level, by seeking (a keyframe every 10 frames) and by decoding on."""
    found, plan, frames = _decode(make_video(kind, frames=100, gop=10))
    assert (found.duration_s, found.frames, found.fps) == (10.0, 100, 10.0)
    assert plan.indices == tuple(range(0, 100, 5))
    levels = frames[:, frames.shape[1] // 2, frames.shape[2] // 2, 1].astype(int)
    assert np.abs(levels - [frame_level(i) for i in plan.indices]).max() <= 3


def test_sampling_follows_the_processors_rules() -> None:
    """Qwen2VLVideoProcessor.sample_frames: fps, then min/max frames, floored to the temporal patch."""
    assert qwen_video.sample_indices(100, 10.0, SETTINGS, 768) == tuple(range(0, 100, 5))
    assert len(qwen_video.sample_indices(9, 30.0, SETTINGS, 768)) == 4  # min_frames
    assert len(qwen_video.sample_indices(3, 30.0, SETTINGS, 768)) == 2  # floor(3 / 2) * 2
    assert len(qwen_video.sample_indices(100_000, 30.0, SETTINGS, 768)) == 768  # max_frames
    with pytest.raises(ImageTooLarge):
        qwen_video.sample_indices(100_000, 30.0, SETTINGS, 100)  # --max-video-frames


def _reference_patches(frames: np.ndarray, s: qwen_video.VideoSettings) -> np.ndarray:
    """An independent reading of transformers' Qwen2-VL patch layout: row (t, bh, bw, mh, mw) holds
    channel-major, then frame-in-group, then the patch's rows and columns."""
    x = (frames.astype(np.float64) * s.rescale_factor - np.asarray(s.mean)) / np.asarray(s.std)
    t, height, width, _ = x.shape
    p, m, tp = s.patch_size, s.merge_size, s.temporal_patch_size
    if t % tp:
        x = np.concatenate([x, np.repeat(x[-1:], tp - t % tp, axis=0)])
    rows = []
    for g in range(x.shape[0] // tp):
        for bh in range(height // p // m):
            for bw in range(width // p // m):
                for mh in range(m):
                    for mw in range(m):
                        y, xx = (bh * m + mh) * p, (bw * m + mw) * p
                        block = x[g * tp : (g + 1) * tp, y : y + p, xx : xx + p, :]  # T, P, P, C
                        rows.append(block.transpose(3, 0, 1, 2).reshape(-1))
    return np.asarray(rows)


def test_patches_equal_an_independent_reference_and_transformers_image_processor() -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(3, 56, 84, 3), dtype=np.uint8)  # odd count: padded with the last
    rows, grid = qwen_video.patchify(frames, SETTINGS)
    assert grid.tolist() == [[2, 4, 6]]
    np.testing.assert_allclose(rows, _reference_patches(frames, SETTINGS), atol=1e-5)
    # transformers' image processor makes an image a 2-frame video of itself: its patches are a
    # video's frame for frame, on the same resized pixels.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    big = rng.integers(0, 256, size=(2, 70, 100, 3), dtype=np.uint8)
    size = {"shortest_edge": SETTINGS.min_pixels, "longest_edge": SETTINGS.max_pixels}
    processor = Qwen2VLImageProcessorPil(size=size)
    height, width = qwen_video.smart_resize(70, 100, 28, SETTINGS.min_pixels, SETTINGS.max_pixels)
    resized = np.stack([qwen_video._resize(f, height, width) for f in big])
    rows, grid = qwen_video.patchify(resized, SETTINGS)
    for i, f in enumerate(big):
        out = processor(images=[f], return_tensors="np", input_data_format="channels_last")
        assert out["image_grid_thw"].tolist() == [[1, *grid[0, 1:].tolist()]]
        image = out["pixel_values"].reshape(len(rows), 3, 2, 14, 14)[:, :, 0]
        np.testing.assert_allclose(rows.reshape(len(rows), 3, 2, 14, 14)[:, :, i], image, atol=1e-5)


# -- hostile files -------------------------------------------------------------------------------


@functools.cache
def _hostile() -> dict[str, bytes]:
    mp4 = make_video(MP4, frames=20)
    return {
        "4096x4096": make_video(MP4_MPEG4, width=4096, height=4096, frames=1),
        "10 hours claimed": make_video(MP4, frames=3, pts_step=10 * 36_000 // 2),
        "corrupt container": mp4[: len(mp4) // 2] + bytes(4096),
        "garbage": bytes(np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8)),
        "many streams": make_video(MP4_MPEG4, frames=2, extra_streams=40),
        "not a video (JPEG)": (Path(__file__).parent / "data" / "images" / "camera_640.jpg").read_bytes(),
        "a stream that lies about its size": lying_video(),
        "empty": b"",
    }


def test_hostile_files_are_refused_quickly_with_bounded_memory() -> None:
    budget = DecodeBudget(512 << 20, wait_s=1.0)

    class _Pre:
        model = "m"

        def preprocess_video(self, data: bytes, allocate: Any, reserve: Any, limits: video.VideoLimits) -> None:
            qwen_video.preprocess_video(data, SETTINGS, allocate, reserve, limits)

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    files = _hostile()  # made first: the encoder's own memory is not the decode's
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, data in files.items():
        start = time.monotonic()
        with pytest.raises(RequestError) as caught:
            budget.preprocess(_Pre(), data, allocate, max_pixels=40_000_000, options={video.VIDEO_OPTION: {}})  # type: ignore[arg-type]
        assert isinstance(caught.value, UndecodableImage | ImageTooLarge), name
        assert 400 <= caught.value.status_hint < 500, name
        assert time.monotonic() - start < 5, name
        assert budget.reserved_bytes == 0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 300, f"peak RSS grew by {grown_mb:.0f} MiB refusing hostile videos"


@pytest.mark.parametrize("kind", [MP4, WEBM], ids=lambda k: k[1])
def test_mutated_videos_decode_or_give_request_errors_only(kind: tuple[str, str, str]) -> None:
    """Flipped bytes and truncations of a real file: a decode or a 4xx, never another exception."""
    original = make_video(kind, frames=12)
    rng = np.random.default_rng(7)
    for _ in range(40):
        data = bytearray(original)
        for at in rng.integers(0, len(data), int(rng.integers(1, 20))):
            data[at] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            data = data[: int(rng.integers(1, len(data)))]
        try:
            _decode(bytes(data))
        except RequestError as exc:
            assert 400 <= exc.status_hint < 500


def test_a_video_too_large_for_the_budget_is_refused_before_decoding() -> None:
    data = make_video(MP4, frames=20)
    found = video.probe(data, LIMITS)
    need = qwen_video.plan(found, SETTINGS, LIMITS.max_frames).peak_bytes(found)
    budget = DecodeBudget(need - 1, wait_s=0.1)
    with pytest.raises(ImageTooLarge):
        with budget.reserve(need):
            pass


def test_a_stalled_decode_is_stopped() -> None:
    data = make_video(MP4, frames=100)
    with pytest.raises(UndecodableImage, match="longer than"):
        _decode(data, limits=video.VideoLimits(decode_timeout_s=0.0))


# -- a real server ---------------------------------------------------------------------------------


@pytest.fixture
def video_server(tiny_qwen2_vl_server: Server) -> Server:
    """The tiny Qwen2-VL server of the group (tests/conftest.py), whose checkpoint has a small video setting of its
    own, SMALL_VIDEO_PROCESSOR (a checkpoint's is read)."""
    return tiny_qwen2_vl_server


def _body(data: bytes, mime: str, text: str = "What happens?") -> dict[str, Any]:
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}]
    return {
        "model": "tiny-qwen2-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0,
    }


def test_serve_answers_mp4_and_webm_and_a_repeat_is_a_cache_hit(video_server: Server) -> None:
    mp4, webm = make_video(MP4, frames=30), make_video(WEBM, frames=30)
    with httpx.Client(base_url=video_server.base_url, timeout=60) as client:
        usages = []
        for data, mime in ((mp4, "video/mp4"), (webm, "video/webm")):
            reply = client.post("/v1/chat/completions", json=_body(data, mime))
            assert reply.status_code == 200, reply.text
            usages.append(reply.json()["usage"])
        # 3 s at 10 fps sampled at 2 fps: 6 frames, 3 temporal patches of 224 x 224 / 28 x 28 tokens
        # (SMALL_VIDEO_PROCESSOR's size bounds: 48 x 64 upscaled to at least 4 merged patches... of smart_resize's).
        size = SMALL_VIDEO_PROCESSOR["size"]
        height, width = qwen_video.smart_resize(48, 64, 28, size["shortest_edge"], size["longest_edge"])
        video_tokens = 3 * (height // 28) * (width // 28)
        tokenized = client.post(
            "/tokenize", json={k: v for k, v in _body(mp4, "video/mp4").items() if k in ("model", "messages")}
        )
        assert tokenized.status_code == 200, tokenized.text
        assert usages[0]["prompt_tokens"] == usages[1]["prompt_tokens"] == tokenized.json()["count"]
        text_only = client.post(
            "/tokenize",
            json={
                "model": "tiny-qwen2-vl",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What happens?"}]}],
            },
        )
        assert tokenized.json()["count"] - text_only.json()["count"] == video_tokens + 2  # + vision start/end
        hits = video_server.metric("shmgate_cache_hits_total")
        misses = video_server.metric("shmgate_cache_misses_total")
        again = client.post("/v1/chat/completions", json=_body(mp4, "video/mp4"))
        assert (
            again.status_code == 200
            and again.json()["choices"]
            == client.post("/v1/chat/completions", json=_body(mp4, "video/mp4")).json()["choices"]
        )
        assert video_server.metric("shmgate_cache_misses_total") == misses
        assert video_server.metric("shmgate_cache_hits_total") >= hits + 2


def test_serve_refuses_bad_videos_with_openai_errors(video_server: Server) -> None:
    with httpx.Client(base_url=video_server.base_url, timeout=60) as client:
        files = _hostile()
        for name, data in files.items():
            if not data:
                continue
            reply = client.post("/v1/chat/completions", json=_body(data, "video/mp4"))
            assert 400 <= reply.status_code < 500, (name, reply.text)
            error = reply.json()["error"]
            assert error["param"] == "messages[0].content[0].video_url", name
            assert "Errno" not in error["message"] and "<none>" not in error["message"], (name, error)
            if reply.status_code == 400:  # the others are 413s: a video past a limit
                assert error["code"] == "invalid_video", (name, error)
        garbage = client.post("/v1/chat/completions", json=_body(files["garbage"], "video/mp4")).json()["error"]
        assert garbage["message"].startswith("the data is not a video this server reads (Invalid data found"), garbage
        assert "MP4/MOV or WebM/Matroska" in garbage["message"]
        wrong_type = client.post("/v1/chat/completions", json=_body(b"abc", "image/png"))
        assert wrong_type.status_code == 400
        assert client.get("/health").status_code == 200


# -- the worker half, in process -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_the_worker_answers_a_video_with_its_temporal_positions(family: str, tiny_vlm: Any) -> None:
    """The worker's M-RoPE positions space a video's temporal patches as transformers' processor and
    model do: 1 apart for Qwen2-VL, tokens_per_second x second_per_grid_ts for Qwen2.5-VL (here 2.5 s
    at 10 fps sampled at 2 fps gives 4 frames, 1.6 sampled fps, 1.25 s per temporal patch)."""
    import contextlib

    import torch

    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.shared.families.mrope import mrope_positions
    from shmgate.shared.wire import SamplingParams
    from shmgate.worker.backends.base import WorkItem
    from shmgate.worker.backends.hf import HFBackend

    model_dir = tiny_vlm(family)
    pre = HFPreprocessor(model_dir)
    backend = HFBackend(str(model_dir), torch.device("cpu"))
    arrays: dict[str, np.ndarray] = {}

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        arrays[name] = np.full(shape, 7, dtype=dtype)
        return arrays[name]

    pre.preprocess_video(make_video(MP4, frames=25), allocate, lambda nbytes: contextlib.nullcontext(), LIMITS)
    assert arrays[qwen_video.VIDEO_GRID_THW].tolist()[0][0] == 2
    assert arrays[qwen_video.SECOND_PER_GRID].tolist() == [1.25]
    spec = {name: (a.dtype.name, tuple(a.shape)) for name, a in arrays.items()}
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    prompt = pre.build_prompt(messages, [spec])
    tensors = {name: [torch.from_numpy(a)] for name, a in arrays.items()}
    item = WorkItem(1, tensors, SamplingParams(max_tokens=3, temperature=0.0), inline=prompt.inline)
    inputs = backend._layout.check(item, torch.device("cpu"))
    positions, _ = mrope_positions(
        backend.model, backend._layout, inputs.input_ids, None, inputs.video_grid_thw, inputs.second_per_grid_ts
    )
    video_at = (inputs.input_ids[0] == backend._layout.video_token_id).nonzero().view(-1)
    temporal = sorted(set(positions[0, 0, video_at].tolist()))
    spacing = 1 if family == "qwen2_vl" else int(backend.model.config.vision_config.tokens_per_second * 1.25)
    assert len(temporal) == 2 and temporal[1] - temporal[0] == spacing
    events = list(backend.run([item]))
    assert events[-1].finish_reason is not None and events[-1].prompt_tokens == prompt.prompt_tokens
    # the video's pixels reach the model: other pixels, another first-token distribution
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    first = [
        next(
            e.logprob.logprob
            for e in backend.run(
                [WorkItem(2, {**tensors, "pixel_values_videos": [pixels]}, params, inline=prompt.inline)]
            )
            if e.logprob
        )
        for pixels in (tensors["pixel_values_videos"][0], torch.full_like(tensors["pixel_values_videos"][0], -1.5))
    ]
    assert first[0] != first[1]


def test_a_stream_that_grows_past_its_header_is_refused_at_the_first_larger_frame() -> None:
    with pytest.raises(UndecodableImage, match="larger than its stream says"):
        _decode(lying_video())
