"""Memory per upload is bounded and predictable: each mode's decode peak, the 75 KB 16-bit PNG, the budget.

Peaks are the kernel's RSS high-water mark in a fresh process (tests/decode_peak.py): Pillow's pixels
are plain malloc, invisible to tracemalloc. Bounds are in units of the RGB uint8 result (w x h x 3):

    PNG (every mode) and baseline JPEG   <= 3 x   source + the RGB result (Pillow: 4 bytes per pixel)
    progressive JPEG                     <= 4.5 x libjpeg keeps every DCT coefficient (CMYK: 8 B/px)
    WebP                                 <= 7 x   libwebp's two RGBA canvases + Pillow's frame copy

and every peak is within its prediction from the header (gateway/decode_cost.py), which is what a
frontend reserves from its decode memory budget.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image

from shmgate.gateway.decode_budget import DecodeBudget
from shmgate.gateway.decode_cost import FIXED_BYTES
from shmgate.gateway.imaging import decode, predict
from shmgate.shared.errors import ImageTooLarge, Overloaded
from tests.decode_samples import SAMPLES, attack_png
from tests.serving import IMAGES, Server, image_request, start_server, stop_and_check


@pytest.fixture
def checksum_server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py)."""
    return shared_checksum_server


ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1600, 1200
SLACK_BYTES = FIXED_BYTES  # the codecs' fixed state and allocator rounding, whatever the image size


def bound(name: str) -> float:
    """The peak allowed for sample ``name``, in multiples of its RGB result (see the module docstring)."""
    if name.startswith("webp"):
        return 7.0
    if "progressive" in name:
        return 4.5
    return 3.0


def peaks(paths: list[Path], max_pixels: int) -> list[dict[str, object]]:
    """Each file's decode peak, measured in one fresh interpreter (one decode after another)."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.decode_peak", str(max_pixels), *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    folder = tmp_path_factory.mktemp("modes")
    paths = []
    for name, make in SAMPLES.items():
        paths.append(folder / name)
        paths[-1].write_bytes(make(WIDTH, HEIGHT))
    return dict(zip(SAMPLES, peaks(paths, 40_000_000), strict=True))


@pytest.mark.parametrize("name", list(SAMPLES))
def test_decode_peak_is_bounded_by_its_rgb_size_and_its_prediction(
    measured: dict[str, dict[str, object]], name: str
) -> None:
    result = measured[name]
    peak, predicted, rgb = int(result["peak_bytes"]), result["predicted_bytes"], int(result["rgb_bytes"])  # type: ignore[call-overload]
    assert rgb == WIDTH * HEIGHT * 3, result
    assert peak <= bound(name) * rgb + SLACK_BYTES, f"{name}: {peak / rgb:.2f} x its RGB size"
    assert isinstance(predicted, int) and peak <= predicted, f"{name}: peak {peak} above the prediction {predicted}"


@pytest.mark.parametrize("name", list(SAMPLES))
def test_the_decoded_image_keeps_only_its_own_pixels_alive(measured: dict[str, dict[str, object]], name: str) -> None:
    # Pillow's RGB is 4 bytes a pixel: 4/3 of the RGB uint8 size; no codec state rides along.
    result = measured[name]
    held, rgb = int(result["held_bytes"]), int(result["rgb_bytes"])  # type: ignore[call-overload]
    assert held <= 4 / 3 * rgb + SLACK_BYTES, f"{name}: holds {held / rgb:.2f} x its RGB size"


# -- the attack image ------------------------------------------------------------------------------


def test_a_16_bit_gray_png_under_the_pixel_cap_is_refused_for_the_memory_it_needs() -> None:
    data = attack_png(6300)
    assert len(data) < 100_000
    with pytest.raises(
        ImageTooLarge, match=r"6300x6300 pixels in mode I;16; decoding it needs I;16 pixels 75.7 MiB \+ RGB result 151"
    ):
        predict(data, max_pixels=40_000_000)
    with pytest.raises(ImageTooLarge, match="I;16"):
        decode(data, max_pixels=40_000_000)


def test_the_same_png_allowed_by_max_pixels_decodes_within_twice_its_rgb_size(tmp_path: Path) -> None:
    path = tmp_path / "attack.png"
    path.write_bytes(attack_png(6300))
    (result,) = peaks([path], 60_000_000)
    rgb = 6300 * 6300 * 3
    assert result["rgb_bytes"] == rgb
    assert int(result["peak_bytes"]) <= 2.1 * rgb + SLACK_BYTES, result  # type: ignore[call-overload]
    assert int(result["peak_bytes"]) <= int(result["predicted_bytes"]), result  # type: ignore[call-overload]


# -- the budget ------------------------------------------------------------------------------------


def test_a_reservation_larger_than_the_whole_budget_is_refused_at_once() -> None:
    budget = DecodeBudget(100, wait_s=60)
    started = time.monotonic()
    with pytest.raises(ImageTooLarge), budget.reserve(101):
        pass
    assert time.monotonic() - started < 5  # refused, not waited for
    assert budget.reserved_bytes == 0


def test_a_reservation_waits_for_room_then_is_overloaded_with_a_retry_after() -> None:
    budget = DecodeBudget(100, wait_s=0.3)
    with budget.reserve(70):
        started = time.monotonic()
        with pytest.raises(Overloaded) as refused, budget.reserve(40):
            pass
        waited = time.monotonic() - started
        with budget.reserve(30):  # whoever fits goes at once
            assert budget.reserved_bytes == 100
    assert 0.3 <= waited < 5
    assert refused.value.retry_after_s >= 1 and refused.value.status_hint == 503
    assert budget.reserved_bytes == 0 and budget.refused == 1


def test_a_waiting_reservation_proceeds_when_room_is_given_back() -> None:
    budget = DecodeBudget(100, wait_s=30)
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with budget.reserve(80):
            holding.set()
            release.wait(10)

    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(hold)
        assert holding.wait(10)
        threading.Timer(0.2, release.set).start()
        with budget.reserve(50):
            assert budget.reserved_bytes == 50  # the first one gave its 80 back before we got in
        held.result(10)
    assert budget.reserved_bytes == 0


# -- over HTTP -------------------------------------------------------------------------------------


def _vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _post(base_url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)


def test_the_attack_png_gets_a_413_and_costs_the_frontend_nothing(checksum_server: Server) -> None:
    attack = image_request("checksum", attack_png(6300), mime="image/png")
    photo = image_request("checksum", (IMAGES / "chelsea_640.jpg").read_bytes())
    with ThreadPoolExecutor(5) as pool:
        attacks = [pool.submit(_post, checksum_server.base_url, attack) for _ in range(4)]
        neighbour = pool.submit(_post, checksum_server.base_url, photo)
        assert neighbour.result().status_code == 200, neighbour.result().text
        for answer in attacks:
            response = answer.result()
            assert response.status_code == 413, response.text
            error = response.json()["error"]
            assert error["code"] == "image_too_large" and "I;16" in error["message"]
            assert error["param"] == "messages[0].content[1].image_url"
    for pid in checksum_server.pids("frontend"):
        assert _vm_kib(pid, "VmHWM") < 400 << 10, "a frontend's peak RSS went past 400 MiB"


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One frontend that accepts the attack image by pixels but decodes at most one of them at a time."""
    server = start_server(
        "checksum",
        tmp_path_factory.mktemp("budget"),
        "--frontends",
        "1",
        "--workers",
        "1",
        "--max-pixels",
        "60000000",
        "--decode-memory-mb",
        "300",
        "--decode-wait-s",
        "0.2",
        "--decode-threads",
        "4",
    )
    yield server  # type: ignore[misc]
    stop_and_check(server)


def test_decodes_beyond_the_budget_wait_then_get_503_and_a_neighbour_is_answered(budget_server: Server) -> None:
    (frontend,) = budget_server.pids("frontend")
    resting_kib = _vm_kib(frontend, "VmRSS")
    # Distinct sizes: the same bytes four times would be one decode and three cache hits.
    attacks = [image_request("checksum", attack_png(6300 - i), mime="image/png") for i in range(4)]
    photo = image_request("checksum", (IMAGES / "chelsea_640.jpg").read_bytes())
    with ThreadPoolExecutor(5) as pool:
        answers = [pool.submit(_post, budget_server.base_url, body) for body in attacks]
        time.sleep(0.1)
        neighbour = pool.submit(_post, budget_server.base_url, photo)
        assert neighbour.result().status_code == 200, neighbour.result().text
        responses = [a.result() for a in answers]
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "overloaded"
    # 300 MiB of decodes at most, over what the frontend held at rest; 64 MiB for everything else.
    assert _vm_kib(frontend, "VmHWM") - resting_kib < (300 + 64) << 10


def test_an_image_bigger_than_the_whole_budget_is_a_413(budget_server: Server) -> None:
    # A 4200 x 4000 WebP: 67 MB of pixels, well within --max-pixels, but libwebp's canvases make its
    # predicted peak 338 MB, above the 300 MiB budget: no amount of waiting would let it in.
    big = io.BytesIO()
    Image.new("RGB", (4200, 4000), (10, 20, 30)).save(big, "WEBP", quality=50)
    response = _post(budget_server.base_url, image_request("checksum", big.getvalue(), mime="image/webp"))
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "image_too_large" and "MiB" in error["message"]


def test_the_budget_flags_read_their_variables_and_reach_the_frontends(monkeypatch: pytest.MonkeyPatch) -> None:
    from shmgate.node.cli import parse_config
    from shmgate.node.config import gateway_of
    from shmgate.node.plan import declared_models, frontend_config

    monkeypatch.setenv("SHMGATE_DECODE_MEMORY_MB", "64")
    monkeypatch.setenv("SHMGATE_DECODE_WAIT_S", "0.5")
    config = parse_config(["serve"])
    limits = gateway_of(config).frontend.limits
    assert limits.decode_memory_mb == 64 and limits.decode_wait_s == 0.5
    child = frontend_config(config, declared_models(config), "0" * 16, 0, 3).options.limits
    assert (child.decode_memory_mb, child.decode_wait_s) == (64, 0.5)


def test_a_zero_decode_budget_is_a_usage_error_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shmgate.node.cli import build_parser

    monkeypatch.setenv("SHMGATE_DECODE_MEMORY_MB", "0")
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve"])
    assert exited.value.code == 2 and "SHMGATE_DECODE_MEMORY_MB" in capsys.readouterr().err
