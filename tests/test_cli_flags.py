"""The command line: SHMGATE_* environment values are flag defaults; a bad value, typed or from the
environment, ends the command with status 2 and one line naming where it came from, before anything
starts; an empty variable means "unset". Every flag explains itself (help, default, variable). A
child gets its configuration whole, as the supervisor parsed it."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from shmgate.gateway.config import FrontendConfig
from shmgate.node import plan
from shmgate.node.checks import ConfigError, check_device, torch_cuda_build
from shmgate.node.cli import build_parser, main, parse_config
from shmgate.node.config import ServeConfig
from shmgate.shared.options import decode, encode, knob_values
from shmgate.worker.__main__ import build_parser as worker_parser
from shmgate.worker.__main__ import parse_args as worker_args
from shmgate.worker.config import WorkerConfig
from tests.serving import shm_entries, shm_entries_created_by

# (variable without SHMGATE_, bad value, what the one line must say besides the variable)
BAD_ENVIRONMENT = [
    ("PORT", "eighty", "not a whole number"),
    ("REQUEST_TIMEOUT_S", "soon", "not a number"),
    ("MAX_BATCH_SIZE", "8.5", "not a whole number"),
    ("STALL_TIMEOUT_S", "x", "not a number"),
    ("IMAGE_URL_MAX_BYTES", "lots", "not a size"),
    ("WORKERS", "-1", "use auto"),
    ("ARENA_SIZE", "lots", "not a size"),
    ("LOG_LEVEL", "verbose", "not a log level"),
    ("DEVICE", "gpu", "use cpu, cuda or cuda:N"),
    ("BATCH_POLICY", "fifo", "not one of fcfs, held"),
    ("ACCESS_LOG", "maybe", "not on or off"),
    ("MODEL", "gpt-4", "unknown model"),
]


@pytest.mark.parametrize(("name", "value", "says"), BAD_ENVIRONMENT)
def test_a_bad_environment_value_is_one_line_naming_its_variable_not_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str, says: str
) -> None:
    monkeypatch.setenv(f"SHMGATE_{name}", value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shmgate serve: error: "), err
    assert f"SHMGATE_{name}" in err and says in err, err
    assert "--" + name.lower().replace("_", "-") not in err.split("(see")[0], "the user never typed the flag"


# (flag, bad value, what the one line must say)
BAD_FLAGS = [
    ("--workers", "-1", "use auto for the default, or a count of 1 or more"),
    ("--workers", "0", "use auto"),
    ("--frontends", "0", "use auto"),
    ("--arena-size", "lots", "not a size"),
    ("--arena-size", "1KiB", "too small"),
    ("--log-level", "verbose", "not a log level"),
    ("--device", "gpu", "use cpu, cuda or cuda:N"),
    ("--device", "cuda:x", "use cpu, cuda or cuda:N"),
    ("--port", "70000", "1 to 65535"),
    ("--port", "eighty", "not a whole number"),
    ("--request-timeout-s", "-1", "more than 0"),
    ("--drain-timeout-s", "-5", "0 or more"),
    ("--image-url-timeout-s", "nan", "not a finite number"),
    ("--max-batch-wait-ms", "-1", "0 or more"),
    ("--model", "gpt-4", "unknown model 'gpt-4'"),
    ("--model", "hf:/no/such/dir", "no such directory"),
    ("--batch-policy", "fifo", "not one of fcfs, held"),
]


@pytest.mark.parametrize(("flag", "value", "says"), BAD_FLAGS)
def test_a_bad_flag_value_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", f"{flag}={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}: " in err and says in err, err


def test_an_hf_directory_without_config_json_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", f"hf:{tmp_path}"])
    assert "not a Hugging Face checkpoint (no config.json)" in capsys.readouterr().err


def test_the_worker_refuses_bad_values_the_same_way(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHMGATE_MAX_BATCH_WAIT_MS", "fast")
    with pytest.raises(SystemExit) as exited:
        worker_args([])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "SHMGATE_MAX_BATCH_WAIT_MS: 'fast' is not a number" in err, err
    monkeypatch.delenv("SHMGATE_MAX_BATCH_WAIT_MS")
    with pytest.raises(SystemExit):
        worker_args(["--device", "gpu"])
    assert "argument --device: 'gpu' is not a device" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve"], ["gateway"], ["worker", "--attach-wait-s", "0"]])
def test_each_command_ends_at_once_with_status_2_and_one_line(command: list[str]) -> None:
    """A real process: no traceback, no restart loop, nothing started (a hang guard, not a timing check)."""
    env = {**os.environ, "SHMGATE_LOG_LEVEL": "verbose", "SHMGATE_LABEL": "never-attached-cli-test"}
    done = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", *command], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "SHMGATE_LOG_LEVEL: 'verbose' is not a log level" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


# -- the machine: a device it does not have -------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "environ", "gpus", "says"),
    [
        (["--device", "cuda"], {}, 0, "--device cuda: no GPU is visible (no NVIDIA GPU was found); use --device cpu"),
        ([], {"SHMGATE_DEVICE": "cuda"}, 0, "SHMGATE_DEVICE='cuda': no GPU is visible"),
        (["--device", "cuda:0"], {"CUDA_VISIBLE_DEVICES": ""}, 4, "CUDA_VISIBLE_DEVICES='' hides them"),
        (["--device", "cuda:2"], {"CUDA_VISIBLE_DEVICES": "0,1"}, 4, "only 2 GPU(s) are visible, cuda:0 to cuda:1"),
    ],
)
def test_serve_refuses_a_gpu_the_machine_does_not_have_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    environ: dict[str, str],
    gpus: int,
    says: str,
) -> None:
    monkeypatch.setattr(plan, "_gpu_count", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    before = shm_entries()
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"shmgate serve: error: {says}\n" or (says in err and err.count("\n") == 1), err
    created = shm_entries_created_by(os.getpid(), before)
    assert created == set(), "nothing may be created for a configuration that cannot run"


def test_a_config_file_s_device_the_machine_lacks_names_the_file_s_key_not_a_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(plan, "_gpu_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = tmp_path / "node.toml"
    config.write_text('[[models]]\nmodel = "checksum"\ndevice = "cuda"\n')
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"shmgate serve: error: {config}: model 'checksum': device cuda: no GPU is visible (no NVIDIA GPU was "
        f'found); set device = "cpu" for this model in {config}\n'
    ), err


def test_a_cpu_only_torch_cannot_serve_cuda_even_with_a_gpu() -> None:
    with pytest.raises(ConfigError, match="CPU-only build; install a CUDA build of torch"):
        check_device("cuda", ["0"], cuda_build=lambda: None)
    check_device("cuda", ["0"], cuda_build=lambda: "12.4")
    check_device("cpu", [], cuda_build=lambda: None)


def test_torch_cuda_build_reads_the_installed_torch_without_importing_it() -> None:
    """Whatever build this machine has, the answer matches torch's own."""
    import torch

    assert torch_cuda_build() == torch.version.cuda


# -- help and version ---------------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))
    ]


def _subparser(name: str) -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices[name]
    return parser


@pytest.mark.parametrize("parser_name", ["serve", "gateway", "worker"])
def test_every_flag_has_help_with_its_default_and_its_variable(
    monkeypatch: pytest.MonkeyPatch, parser_name: str
) -> None:
    for name in [n for n in os.environ if n.startswith("SHMGATE_")]:
        monkeypatch.delenv(name)
    parser = worker_parser() if parser_name == "worker" else _subparser(parser_name)
    options = _options(parser)
    assert len(options) >= {"worker": 12, "gateway": 25, "serve": 35}[parser_name]
    for action in options:
        help_text = action.help or ""
        variable = "SHMGATE_" + action.dest.upper()
        assert help_text.endswith(f"[env: {variable}]"), (action.option_strings, help_text)
        assert "(default: " in help_text, (action.option_strings, help_text)
        if action.nargs == 0:
            assert "(default: off)" in help_text
        elif isinstance(action.default, str) and action.default:
            assert f"(default: {action.default})" in help_text, (action.option_strings, help_text)
        assert not re.search(r"\bissue \d+", help_text), help_text
    groups = {g.title for g in parser._action_groups}
    if parser_name == "serve":
        assert {"server", "model", "workers and batching", "limits", "image URLs", "observability"} <= groups


def test_top_level_help_lists_the_commands_but_not_the_internal_frontend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "cleanup" in out
    assert "frontend " not in out and "SUPPRESS" not in out and "frontend}" not in out


@pytest.mark.parametrize("parse", [build_parser().parse_args, worker_args])
def test_version_prints_the_installed_version(
    capsys: pytest.CaptureFixture[str], parse: Callable[[list[str]], argparse.Namespace]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.split()[-1] == importlib.metadata.version("shmgate")


def test_environment_values_arrive_typed_and_empty_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMGATE_PORT", "9001")
    monkeypatch.setenv("SHMGATE_REQUEST_TIMEOUT_S", "")
    monkeypatch.setenv("SHMGATE_STALL_TIMEOUT_S", "2.5")
    args = build_parser().parse_args(["serve"])
    assert (args.port, args.request_timeout_s, args.stall_timeout_s) == (9001, 60.0, 2.5)
    monkeypatch.delenv("SHMGATE_STALL_TIMEOUT_S")
    assert build_parser().parse_args(["serve"]).stall_timeout_s is None
    assert worker_args(["--max-batch-size", "4"]).max_batch_size == 4
    monkeypatch.setenv("SHMGATE_ACCESS_LOG", "true")
    monkeypatch.setenv("SHMGATE_WORKERS", "auto")
    args = build_parser().parse_args(["serve"])
    assert (args.access_log, args.workers, args.server_timing) == (True, 0, False)
    assert build_parser().parse_args(["serve", "--workers", "3"]).workers == 3
    monkeypatch.setenv("SHMGATE_LABEL", "blue")
    monkeypatch.setenv("SHMGATE_MODEL", "checksum")
    args = build_parser().parse_args(["serve"])
    assert (type(args.label), type(args.model)) == (str, str), "an env marker must not reach wire structs"


def test_a_flag_wins_over_a_bad_environment_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse converts a string default only when the flag is absent."""
    monkeypatch.setenv("SHMGATE_PORT", "eighty")
    assert build_parser().parse_args(["serve", "--port", "8080"]).port == 8080


def test_a_frontend_child_gets_the_supervisor_s_values_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option a frontend declares arrives with the value the supervisor parsed, through one
    encoded value (no flag re-rendered and re-parsed); the node's own options do not."""
    monkeypatch.setenv("SHMGATE_API_KEY", "secret-key")
    parent = parse_config(
        [
            "serve",
            "--allow-image-urls",
            "--metrics-need-key",
            "--access-log",
            "--max-images",
            "3",
            "--result-cache-mb",
            "1.5",
            "--image-url-allowlist",
            "10.0.0.0/8",
            "--label",
            "blue",
            "--port",
            "9009",
        ]
    )
    models = plan.declared_models(parent)
    child = decode(FrontendConfig, encode(plan.frontend_config(parent, models, "abc", 2, 7)))
    assert (child.instance_id, child.slot, child.fd, child.options.server.api_key) == ("abc", 2, 7, "secret-key")
    assert [m.public_id for m in child.models] == ["efficientnet-lite0"]
    assert isinstance(parent, ServeConfig)
    frontend = knob_values(child.options)
    assert {"max_images", "allow_image_urls", "metrics_need_key", "image_url_max_bytes", "access_log"} <= set(frontend)
    assert child.options.limits.max_images == 3 and child.options.limits.result_cache_mb == 1.5
    assert child.options.server.allowed_hosts, "decided once by the supervisor for --host"
    assert replace(child.options, server=parent.gateway.frontend.server) == parent.gateway.frontend
    assert not {"arena_size", "frontends", "label", "max_batch_size"} & set(frontend), "other components' options"


def test_serve_s_worker_children_get_its_batching_flags() -> None:
    """serve and worker share one declaration of the batching options (shared/common_options.py)."""
    parent = parse_config(
        [
            "serve",
            "--device",
            "cpu",
            "--workers",
            "1",
            "--max-batch-size",
            "3",
            "--max-batch-wait-ms",
            "2.5",
            "--dtype",
            "float32",
            "--compile-normalise",
        ]
    )
    assert isinstance(parent, ServeConfig)
    [worker] = plan.worker_children(parent, plan.model_plans(plan.declared_models(parent)), "abc")
    child = decode(WorkerConfig, encode(worker.config))
    assert child.attach.instance == "abc" and child.model.model == ("efficientnet-lite0",)
    assert child.placement.device == "cpu"
    assert (
        child.batching.max_batch_size,
        child.batching.max_batch_wait_ms,
        child.load.dtype,
        child.load.compile_normalise,
    ) == (
        3,
        2.5,
        "float32",
        True,
    )


def test_a_mistyped_flag_gets_the_nearest_declared_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--max-imgaes", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --max-imgaes 3; did you mean --max-images?" in err, err
    with pytest.raises(SystemExit):
        worker_args(["--attach-wiat-s", "1"])
    assert "did you mean --attach-wait-s?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--zzzz"])
    assert "did you mean" not in capsys.readouterr().err


def test_the_worker_refuses_cuda_without_a_usable_gpu_naming_where_the_value_came_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    from shmgate.worker.__main__ import main as worker_main

    never = ["--label", "never-attached-cli-test", "--attach-wait-s", "0"]
    assert worker_main(["--device", "cuda:0", *never]) == 2
    assert capsys.readouterr().err == (
        "shmgate worker: error: --device cuda:0: CUDA is not available (a CPU-only build of torch); use --device cpu\n"
    )
    monkeypatch.setenv("SHMGATE_DEVICE", "cuda")
    assert worker_main(never) == 2
    assert "error: SHMGATE_DEVICE='cuda': CUDA is not available" in capsys.readouterr().err
