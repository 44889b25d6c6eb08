"""The command line: SHMGATE_* environment values are flag defaults, and a bad one is a usage error
naming the flag (argparse, exit status 2), never a traceback; an empty one means "unset". A frontend
child gets the gateway flags it needs from the parser itself."""

from __future__ import annotations

import pytest

from gateway.cli import _NOT_FORWARDED, _frontend_argv, _worker_children, build_parser
from worker.__main__ import parse_args as worker_args


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [("PORT", "eighty", "--port"), ("REQUEST_TIMEOUT_S", "soon", "--request-timeout-s"),
     ("MAX_BATCH_SIZE", "8.5", "--max-batch-size"), ("STALL_TIMEOUT_S", "x", "--stall-timeout-s"),
     ("IMAGE_URL_MAX_BYTES", "lots", "--image-url-max-bytes")],
)
def test_a_bad_environment_value_is_a_usage_error_naming_its_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str, flag: str
) -> None:
    monkeypatch.setenv(f"SHMGATE_{name}", value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve"])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


def test_the_worker_reports_a_bad_environment_value_the_same_way(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHMGATE_MAX_BATCH_WAIT_MS", "fast")
    with pytest.raises(SystemExit) as exited:
        worker_args([])
    assert exited.value.code == 2 and "--max-batch-wait-ms" in capsys.readouterr().err


def test_environment_values_arrive_typed_and_empty_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMGATE_PORT", "9001")
    monkeypatch.setenv("SHMGATE_REQUEST_TIMEOUT_S", "")
    monkeypatch.setenv("SHMGATE_STALL_TIMEOUT_S", "2.5")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.request_timeout_s, args.stall_timeout_s) == (9001, 60.0, 2.5)
    monkeypatch.delenv("SHMGATE_STALL_TIMEOUT_S")
    assert build_parser().parse_args(["serve"]).stall_timeout_s is None
    assert worker_args(["--max-batch-size", "4"]).max_batch_size == 4


def test_a_flag_wins_over_a_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse converts a string default only when the flag is absent."""
    monkeypatch.setenv("SHMGATE_PORT", "eighty")
    assert build_parser().parse_args(["serve", "--port", "8080"]).port == 8080


def test_a_frontend_child_parses_back_to_the_supervisor_s_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMGATE_API_KEY", "secret-key")
    parent = build_parser().parse_args(
        ["serve", "--allow-image-urls", "--metrics-need-key", "--max-images", "3", "--result-cache-mb", "1.5",
         "--image-url-allowlist", "10.0.0.0/8", "--label", "blue", "--port", "9009"]
    )
    argv = _frontend_argv(parent, "abc", 2, 7)
    assert "secret-key" not in argv and "--api-key" not in argv, "a secret on argv is visible in ps"
    child = build_parser().parse_args(argv[3:])
    assert (child.command, child.instance, child.slot, child.fd) == ("frontend", "abc", 2, 7)
    shared = set(vars(child)) & set(vars(parent)) - _NOT_FORWARDED - {"command"}
    assert {"max_images", "allow_image_urls", "metrics_need_key", "image_url_max_bytes"} <= shared
    assert {dest: getattr(child, dest) for dest in shared} == {dest: getattr(parent, dest) for dest in shared}


def test_serve_s_worker_children_get_its_batching_flags() -> None:
    """serve and worker share one definition of the batching flags (shared/flags.py)."""
    parent = build_parser().parse_args(
        ["serve", "--device", "cpu", "--workers", "1", "--max-batch-size", "3", "--max-batch-wait-ms", "2.5",
         "--dtype", "float32", "--compile-normalise"]
    )
    [(argv, _)] = _worker_children(parent, "abc")
    child = worker_args(argv[3:])
    assert child.instance == "abc"
    assert (child.max_batch_size, child.max_batch_wait_ms, child.dtype, child.compile_normalise) == (
        3, 2.5, "float32", True)
