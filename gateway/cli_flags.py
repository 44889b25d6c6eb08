"""The flags of ``shmgate serve``, ``shmgate gateway`` and the frontend child, in the groups ``--help`` shows.

Every flag is declared with shared/flags.py ``add_flag`` (its SHMGATE_* variable, its typed default,
the help suffix) and a type from shared/flag_types.py, so a bad value ends the command when it is
parsed. gateway/cli.py builds the commands from these groups and forwards the gateway flags to each
frontend child (``forward``), which parses them with the same definitions.
"""

from __future__ import annotations

import argparse
import json

from shmgate.gateway.listen import LISTEN_MODES
from shmgate.shared import flag_types
from shmgate.shared.flags import add_batching_flags, add_flag
from shmgate.shared.models import KNOWN_SPECS
from shmgate.shared.tracing import add_tracing_flags

__all__ = ["DEFAULT_STALL_TIMEOUT_S", "HF_STALL_TIMEOUT_S", "Repeatable", "add_gateway_flags", "add_worker_flags"]

# The longest a work loop may go without progress. The embedded classifier's longest step (a
# batch of 8 on a busy 2-core CPU) is well under a second, so 10 s never fires on a healthy
# worker and still brings a wedged one back within the 30 s the tests allow. A generative model
# stamps per decode step, but its prefill of a full batch of large images is one step: the rule
# is at least 3x the slowest single forward pass under peak load (docs/RELIABILITY.md).
DEFAULT_STALL_TIMEOUT_S = 10.0
HF_STALL_TIMEOUT_S = 60.0


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    """The flags of every command that runs frontends (serve, gateway and the frontend child)."""
    _server_flags(p.add_argument_group("server"))
    _model_flags(p.add_argument_group("model"))
    _limit_flags(p.add_argument_group("limits"))
    _image_url_flags(p.add_argument_group("image URLs"))
    _observability_flags(p.add_argument_group("observability"))
    add_tracing_flags(p.add_argument_group("tracing"))


def _server_flags(server: argparse._ArgumentGroup) -> None:
    add_flag(server, "--host", "address to listen on (0.0.0.0: every interface)", default="127.0.0.1")
    add_flag(server, "--port", "TCP port to listen on", default="8000", type=flag_types.port)
    add_flag(
        server,
        "--frontends",
        "HTTP frontend processes; auto: the CPUs this process may use (cgroup limit, affinity, cores)",
        default="auto",
        type=flag_types.auto_count,
    )
    add_flag(
        server,
        "--listen",
        "shared: the frontends accept from one listening socket; reuseport: each frontend listens "
        "on its own socket on the same port (SO_REUSEPORT) and the kernel spreads new connections "
        "over the live ones (docs/DEPLOY.md)",
        default="shared",
        type=flag_types.choice(*LISTEN_MODES),
        metavar="{" + ",".join(LISTEN_MODES) + "}",
    )
    add_flag(
        server,
        "--api-key",
        "key clients must send as 'Authorization: Bearer KEY'; prefer the "
        "environment variable: a flag is visible in ps",
        shown_default="none: no key needed",
    )
    add_flag(
        server,
        "--allowed-hosts",
        "comma list of host names the Host header may carry ('*': any); empty: "
        "the loopback names when --host is a loopback address, else any (docs/SECURITY.md)",
        default="",
        shown_default="loopback names for a loopback --host, else *",
    )
    add_flag(
        server, "--label", "name workers in other containers attach by (shmgate worker --label)", default="default"
    )
    add_flag(
        server,
        "--drain-timeout-s",
        "on SIGTERM, how long requests in flight may take to finish",
        default="30",
        type=flag_types.non_negative_float,
    )
    add_flag(
        server,
        "--stall-timeout-s",
        "replace a frontend or worker whose work loop makes no progress for "
        "this long; 0: never (docs/RELIABILITY.md for slow models)",
        shown_default=f"{DEFAULT_STALL_TIMEOUT_S:g} s, {HF_STALL_TIMEOUT_S:g} s for hf: models",
        type=flag_types.non_negative_float,
    )


class Repeatable(argparse.Action):
    """A flag that may be given several times: ``dest`` keeps the first value (what a one-model command
    reads, and what is forwarded to a frontend child), ``<dest>_all`` every value in order."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest + "_all", None) or []
        if not given:
            setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_all", [*given, values])


def _model_flags(model: argparse._ArgumentGroup) -> None:
    add_flag(
        model,
        "--model",
        f"what to serve: {KNOWN_SPECS}; repeat it to serve several models (docs/MODELS.md)",
        default="efficientnet-lite0",
        type=flag_types.model_spec,
        action=Repeatable,
    )
    add_flag(
        model,
        "--served-model-name",
        "the model id clients send and /v1/models lists; with several --model, one per --model in the same order",
        action=Repeatable,
        shown_default="from --model: the directory's name for hf:DIR, org/name for a hub-cache snapshot",
    )
    add_flag(
        model,
        "--config",
        "a TOML file declaring the models and their own settings (workers, device, "
        'batching, max in flight, queue depth, stall timeout; docs/MODELS.md "Several models"); '
        "instead of --model",
        shown_default="none: --model",
    )
    # The models as the supervisor resolved them, for the frontend children (gateway/node_config.py).
    model.add_argument("--models-json", default=None, help=argparse.SUPPRESS)
    add_flag(
        model,
        "--mm-processor-kwargs",
        "hf: models: image processor arguments over the checkpoint's, "
        'as JSON, e.g. \'{"max_pixels": 200704}\' (docs/MODELS.md "Processor options"); classifier models: '
        "jpeg_draft_margin and embedding_jpeg_draft_margin (docs/TUNING.md)",
        default="{}",
        type=_json_object,
    )


def _limit_flags(limits: argparse._ArgumentGroup) -> None:
    add_flag(
        limits,
        "--arena-size",
        "shared memory for decoded images, in /dev/shm (e.g. 512MiB, 4GiB)",
        default="1GiB",
        type=_arena_size,
    )
    add_flag(limits, "--max-images", "images per request; more get 400", default="8", type=flag_types.positive_int)
    add_flag(
        limits,
        "--max-in-flight",
        "requests in flight per frontend; beyond it requests get 429",
        default="256",
        type=flag_types.positive_int,
    )
    add_flag(
        limits,
        "--request-timeout-s",
        "a request not answered in this long gets 504",
        default="60",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--max-body-mb",
        "request body size in MiB; larger gets 413",
        default="32",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--max-pixels",
        "largest 8-bit RGB image decoded; other modes get the same memory, so "
        "16-bit gray or transparent images get fewer pixels; larger gets 413",
        default="40000000",
        type=flag_types.positive_int,
    )
    add_flag(
        limits,
        "--max-video-seconds",
        "longest video (by its container's duration) decoded; longer gets 413",
        default="600",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--max-video-frames",
        "most frames sampled and decoded from one video; more gets 413",
        default="768",
        type=flag_types.positive_int,
    )
    add_flag(
        limits, "--decode-threads", "image decoding threads per frontend", default="2", type=flag_types.positive_int
    )
    add_flag(
        limits,
        "--decode-memory-mb",
        "memory (MiB) one frontend's concurrent image decodes may use "
        "together; a decode waits for room, then gets a 503",
        default="512",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--header-timeout-s",
        "per connection: a request line and headers must arrive within this "
        "many seconds of the connection's start or the previous response's end, else 408 and close",
        default="10",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--body-timeout-s",
        "a request body must arrive within this many seconds, plus one per "
        "--body-min-rate bytes received, else 408 and close",
        default="30",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--body-min-rate",
        "bytes per second of body that extend --body-timeout-s by a second",
        default="500",
        type=flag_types.positive_float,
    )
    add_flag(
        limits,
        "--max-connections",
        "per frontend: open connections beyond this get a 503 and are closed",
        default="1000",
        type=flag_types.positive_int,
    )
    add_flag(
        limits,
        "--decode-wait-s",
        "how long a decode waits for room in --decode-memory-mb before a 503",
        default="5",
        type=flag_types.non_negative_float,
    )
    add_flag(
        limits,
        "--max-workers",
        "worker slots in the shared segment, each with a control queue; 0: serve twice its workers, gateway 16",
        default="0",
        type=flag_types.non_negative_int,
    )
    add_flag(
        limits,
        "--queue-depth",
        "message queue depth (capped by /proc/sys/fs/mqueue/msg_max)",
        default="64",
        type=flag_types.positive_int,
    )
    add_flag(
        limits,
        "--result-cache-mb",
        "per frontend: keep this many MiB of deterministic answers "
        "(embeddings, the classifier's); 0: off (docs/MODELS.md)",
        default="0",
        type=flag_types.non_negative_float,
    )


def _image_url_flags(urls: argparse._ArgumentGroup) -> None:
    add_flag(urls, "--allow-image-urls", "fetch http(s) image URLs (docs/SECURITY.md)", on_off=True)
    add_flag(
        urls,
        "--image-url-allowlist",
        "comma list of CIDRs / host names that image URLs may reach besides public addresses",
        default="",
        shown_default="none",
        type=_allowlist,
    )
    add_flag(urls, "--image-url-max-bytes", "largest image a URL may return", default="20MiB", type=flag_types.size)
    add_flag(urls, "--image-url-timeout-s", "time to fetch one image URL", default="10", type=flag_types.positive_float)


def _observability_flags(seen: argparse._ArgumentGroup) -> None:
    add_flag(
        seen, "--log-level", f"one of {', '.join(flag_types.LOG_LEVELS)}", default="info", type=flag_types.log_level
    )
    add_flag(
        seen, "--access-log", "log one line per HTTP request (uvicorn's access log, in each frontend)", on_off=True
    )
    add_flag(
        seen,
        "--log-stats-interval-s",
        "log a line of serving statistics this often (requests/s, errors, in flight, queue, arena); 0: off",
        default="0",
        type=flag_types.non_negative_float,
    )
    add_flag(seen, "--metrics-need-key", "/metrics asks for the API key too", on_off=True)
    add_flag(
        seen,
        "--server-timing",
        "add a Server-Timing header (ms per serving stage) to non-streamed "
        "answers; it tells a client how long its image waited and was decoded (docs/SECURITY.md)",
        on_off=True,
    )


def _arena_size(text: str) -> int:
    value = flag_types.size(text)
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is too small for an arena: use at least 1MiB (e.g. 1GiB)")
    return value


def _json_object(text: str) -> str:
    """Check --mm-processor-kwargs is a JSON object when the flags are parsed (the frontends parse it again)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


def _allowlist(text: str) -> str:
    """Validate the allow-list when the flags are parsed, so a typo stops ``serve`` at once."""
    from shmgate.gateway.addresses import AllowList

    try:
        AllowList.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    workers = p.add_argument_group("workers and batching")
    add_flag(
        workers,
        "--workers",
        "worker processes; auto: one per GPU, on CPU two (one for hf: models)",
        default="auto",
        type=flag_types.auto_count,
    )
    add_flag(workers, "--workers-per-gpu", "workers sharing each GPU", default="1", type=flag_types.positive_int)
    add_flag(
        workers,
        "--device",
        "cpu, cuda (every visible GPU) or cuda:N (GPU N only)",
        shown_default="cuda when a GPU is visible, else cpu",
        type=flag_types.device,
    )
    add_flag(
        workers,
        "--threads",
        "torch threads per CPU worker; 0: usable CPUs / workers (see --frontends)",
        default="0",
        type=flag_types.non_negative_int,
    )
    add_flag(
        workers,
        "--restart-budget",
        "with several models: a worker that served and then dies more than "
        "this many times in 5 minutes is not restarted, and its model is failed once none of its workers "
        "is left (the others keep serving); 0: restart for ever (one model always is)",
        default="5",
        type=flag_types.non_negative_int,
    )
    add_flag(
        workers,
        "--skip-gpu-fit-check",
        "start even when the models placed on a GPU are estimated not to fit "
        'in its free memory (docs/MODELS.md "GPU memory at start-up")',
        on_off=True,
    )
    add_batching_flags(workers)
