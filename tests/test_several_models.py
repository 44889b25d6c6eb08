"""Several models on one node: one ``shmgate serve --model efficientnet-lite0 --model checksum``, one arena.

Each model has its own workers and its own request queue; the frontends route by the request's
``model``. A request that reached the other model's worker would be answered wrongly (a classifier's
labels where a digest is expected) or failed, so correct answers to both under interleaved load are the
proof that routing holds. The two models preprocess alike, so one decode of an image serves both.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shmgate.shared.errors import EXIT_CONFIG
from tests.serving import (
    IMAGES,
    Server,
    expected_checksum,
    free_port,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
    wait_until,
)

LABELS = json.loads((IMAGES / "labels.json").read_text())["images"]
PHOTOS = ["chelsea_640.jpg", "coffee_640.jpg", "camera_640.jpg"]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # shallow queues: the per-uid message-queue budget is shared with the other servers of the suite
    server = start_server(
        "efficientnet-lite0",
        tmp_path_factory.mktemp("serve"),
        "--model",
        "checksum",
        "--workers",
        "1",
        "--queue-depth",
        "8",
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def _top1(answer: str) -> str:
    return answer.strip().splitlines()[0].rsplit(":", 1)[0].strip()


def _answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def test_both_models_answer_correctly_under_interleaved_concurrent_load(two_models: Server) -> None:
    photos = [(IMAGES / name).read_bytes() for name in PHOTOS]
    noise = [noise_png(seed) for seed in range(300, 312)]
    jobs: list[tuple[str, bytes, str]] = []
    for i, data in enumerate(noise):  # classifier and checksum requests alternate
        jobs.append(("checksum", data, ""))
        photo = PHOTOS[i % len(PHOTOS)]
        jobs.append(("efficientnet-lite0", photos[i % len(photos)], photo))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=two_models.base_url, timeout=120, limits=httpx.Limits(max_connections=len(jobs))
        ) as client:
            return await asyncio.gather(
                *(client.post("/v1/chat/completions", json=image_request(model, data)) for model, data, _ in jobs)
            )

    responses = asyncio.run(run())
    for (model, data, photo), response in zip(jobs, responses):
        answer = _answer(response)
        assert response.json()["model"] == model
        if model == "checksum":
            assert expected_checksum(data) in answer, answer
        else:
            assert _top1(answer) in LABELS[photo]["accept_top1"], answer


def test_one_decode_serves_both_models_when_their_preprocessing_agrees(two_models: Server) -> None:
    data = noise_png(977)  # an image no other test sends
    misses = two_models.metric("shmgate_cache_misses_total")
    hits = two_models.metric("shmgate_cache_hits_total") + two_models.metric("shmgate_cache_remote_hits_total")
    first = httpx.post(two_models.base_url + "/v1/chat/completions", json=image_request("checksum", data), timeout=60)
    assert expected_checksum(data) in _answer(first)
    assert two_models.metric("shmgate_cache_misses_total") == misses + 1
    second = httpx.post(
        two_models.base_url + "/v1/chat/completions", json=image_request("efficientnet-lite0", data), timeout=60
    )
    _answer(second)
    assert two_models.metric("shmgate_cache_misses_total") == misses + 1, "the classifier decoded it again"
    assert (
        two_models.metric("shmgate_cache_hits_total") + two_models.metric("shmgate_cache_remote_hits_total") == hits + 1
    )


def test_models_lists_each_model_with_its_state_and_capabilities(two_models: Server) -> None:
    url = two_models.base_url
    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in cards] == ["efficientnet-lite0", "checksum"]
    assert [card["state"] for card in cards] == ["ready", "ready"]
    # the classifier also embeds (its 1280-wide features); the checksum model only answers chat
    assert [card["capabilities"] for card in cards] == [
        {"chat": True, "embeddings": True, "tokenize": False, "max_model_len": None},
        {"chat": True, "embeddings": False, "tokenize": False, "max_model_len": None},
    ]
    one = httpx.get(url + "/v1/models/checksum", timeout=10)
    assert one.status_code == 200 and one.json() == cards[1]


def test_readiness_is_per_model_and_for_all(two_models: Server) -> None:
    url = two_models.base_url
    assert httpx.get(url + "/ready", timeout=10).status_code == 200
    for model in ("efficientnet-lite0", "checksum"):
        assert httpx.get(f"{url}/ready/{model}", timeout=10).json() == {"status": "ready", "model": model}
        assert httpx.get(url + "/ready", params={"model": model}, timeout=10).status_code == 200
    missing = httpx.get(url + "/ready/gpt-4", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/tokenize"])
def test_an_unknown_model_is_a_404_naming_the_served_ones(two_models: Server, path: str) -> None:
    body = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/embeddings":
        body = {"model": "gpt-4", "input": "hi"}
    response = httpx.post(two_models.base_url + path, json=body, timeout=10)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "model"
    assert "'efficientnet-lite0', 'checksum'" in error["message"]


def test_each_model_has_its_own_workers(two_models: Server) -> None:
    workers = [cmd for _, cmd in two_models.children() if "-m shmgate.worker" in cmd]
    assert sorted(cmd.split("--model ", 1)[1].split()[0] for cmd in workers) == ["checksum", "efficientnet-lite0"]
    assert two_models.metric("shmgate_workers_ready") == 2
    for model in ("efficientnet-lite0", "checksum"):
        _answer(
            httpx.post(
                two_models.base_url + "/v1/chat/completions", json=image_request(model, noise_png(5)), timeout=60
            )
        )
        assert two_models.metric(f'shmgate_model_workers_ready{{model="{model}"}}') == 1
        assert two_models.metric(f'shmgate_model_queue_depth{{model="{model}"}}') == 0
        assert two_models.metric(f'shmgate_model_requests_total{{model="{model}",outcome="admitted"}}') >= 1


def test_the_log_says_how_the_queue_budget_was_split(two_models: Server) -> None:
    log = two_models.log_path.read_text()
    assert "1 request efficientnet-lite0 x" in log and "1 request checksum x" in log, log[-3000:]


def test_the_startup_summary_names_both_models(two_models: Server) -> None:
    assert 'clients send "model": "efficientnet-lite0" or "checksum"' in two_models.log_path.read_text()


# -- a config file, a gateway and a worker per model, per-model admission --------------------------------


def _outcomes(server: Server, model: str) -> dict[str, float]:
    return {
        outcome: server.metric(f'shmgate_model_requests_total{{model="{model}",outcome="{outcome}"}}')
        for outcome in ("ok", "error", "overloaded", "cancelled")
    }


def test_each_request_outcome_is_counted_for_its_own_model(two_models: Server) -> None:
    """ok and error (a 400: an image that is not one) land on the model the request named, not on the other."""
    url = two_models.base_url + "/v1/chat/completions"
    before = {model: _outcomes(two_models, model) for model in ("efficientnet-lite0", "checksum")}
    _answer(httpx.post(url, json=image_request("efficientnet-lite0", noise_png(31)), timeout=60))
    for i in range(2):
        _answer(httpx.post(url, json=image_request("checksum", noise_png(32 + i)), timeout=60))
    bad = httpx.post(url, json=image_request("checksum", b"not an image at all"), timeout=60)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    after = {model: _outcomes(two_models, model) for model in ("efficientnet-lite0", "checksum")}
    gained = {model: {k: after[model][k] - before[model][k] for k in after[model]} for model in after}
    assert gained == {
        "efficientnet-lite0": {"ok": 1, "error": 0, "overloaded": 0, "cancelled": 0},
        "checksum": {"ok": 2, "error": 1, "overloaded": 0, "cancelled": 0},
    }


NODE_TOML = """
[[models]]
model = "efficientnet-lite0"
served_model_name = "classifier"

arena_share = 0.5

[[models]]
model = "checksum"
max_in_flight = 2
arena_share = 0.25
"""


@pytest.fixture(scope="module")
def gateway_with_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``shmgate gateway --config node.toml`` and one ``shmgate worker --model X`` per model, by label.

    The checksum worker is slow on purpose (each batch of one waits 2 s), so its requests stay in flight.
    """
    tmp = tmp_path_factory.mktemp("gateway")
    config = tmp / "node.toml"
    config.write_text(NODE_TOML)
    label = f"models-{os.getpid()}"
    port = free_port()
    log_path = tmp / "gateway.log"
    with open(log_path, "wb") as log:
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "gateway",
                "--port",
                str(port),
                "--config",
                str(config),
                "--frontends",
                "1",
                "--arena-size",
                "64MiB",
                "--label",
                label,
                "--queue-depth",
                "8",
                "--max-workers",
                "4",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = Server(gateway, port, "classifier", log_path)
    worker_flags = ["--label", label, "--device", "cpu", "--threads", "1"]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.worker",
                "--model",
                "efficientnet-lite0",
                "--served-model-name",
                "classifier",
                *worker_flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.worker",
                "--model",
                "checksum",
                "--max-batch-size",
                "1",
                "--diag-batch-delay-ms",
                "2000",
                *worker_flags,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        server.wait_ready()
        yield server
    finally:
        try:
            stop_and_check(server)
        finally:
            for worker in workers:
                worker.terminate()
                worker.wait(30)


def test_a_config_file_declares_the_models_and_a_worker_per_model_attaches(gateway_with_workers: Server) -> None:
    cards = httpx.get(gateway_with_workers.base_url + "/v1/models", timeout=10).json()["data"]
    assert [(card["id"], card["state"]) for card in cards] == [("classifier", "ready"), ("checksum", "ready")]
    answer = _answer(
        httpx.post(
            gateway_with_workers.base_url + "/v1/chat/completions",
            json=image_request("classifier", (IMAGES / "coffee_640.jpg").read_bytes()),
            timeout=60,
        )
    )
    assert _top1(answer) == "espresso"


def test_one_model_over_its_max_in_flight_gets_429_while_the_other_is_served(gateway_with_workers: Server) -> None:
    url = gateway_with_workers.base_url

    async def run() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            held = [
                asyncio.create_task(
                    client.post("/v1/chat/completions", json=image_request("checksum", noise_png(400 + i)))
                )
                for i in range(2)
            ]
            for _ in range(200):  # until both are admitted (a hang guard, not a timing check)
                if gateway_with_workers.metric("shmgate_in_flight_requests") >= 2:
                    break
                await asyncio.sleep(0.05)
            refused = await client.post("/v1/chat/completions", json=image_request("checksum", noise_png(402)))
            other = await client.post(
                "/v1/chat/completions", json=image_request("classifier", (IMAGES / "camera_640.jpg").read_bytes())
            )
            return list(await asyncio.gather(*held)), refused, other

    refused_before = gateway_with_workers.metric('shmgate_model_requests_total{model="checksum",outcome="overloaded"}')
    other_refused = gateway_with_workers.metric('shmgate_model_requests_total{model="classifier",outcome="overloaded"}')
    held, refused, other = asyncio.run(run())
    assert (
        gateway_with_workers.metric('shmgate_model_requests_total{model="checksum",outcome="overloaded"}')
        == refused_before + 1
    )
    assert (
        gateway_with_workers.metric('shmgate_model_requests_total{model="classifier",outcome="overloaded"}')
        == other_refused
    )
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] and "model 'checksum'" in refused.json()["error"]["message"]
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert other.status_code == 200, other.text
    for i, response in enumerate(held):
        assert expected_checksum(noise_png(400 + i)) in _answer(response)


def test_a_client_that_hangs_up_is_counted_cancelled_for_its_model(gateway_with_workers: Server) -> None:
    """The checksum worker holds each request 2 s: a client that gives up after 0.5 s is its model's cancelled."""
    before = {model: _outcomes(gateway_with_workers, model) for model in ("classifier", "checksum")}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gateway_with_workers.base_url + "/v1/chat/completions",
            json=image_request("checksum", noise_png(77)),
            timeout=httpx.Timeout(60, read=0.5),
        )
    wait_until(
        lambda: _outcomes(gateway_with_workers, "checksum")["cancelled"] == before["checksum"]["cancelled"] + 1,
        30,
        "the hang-up counted as checksum's cancelled",
    )
    wait_until(lambda: gateway_with_workers.metric("shmgate_in_flight_requests") == 0, 30, "the request released")
    assert _outcomes(gateway_with_workers, "classifier") == before["classifier"]
    assert _outcomes(gateway_with_workers, "checksum")["ok"] == before["checksum"]["ok"]


def test_a_worker_for_an_undeclared_model_refuses_to_attach(gateway_with_workers: Server) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.worker",
            "--instance",
            gateway_with_workers.instance_id,
            "--model",
            "efficientnet-lite0",
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "'classifier', 'checksum'" in done.stderr


# -- declaring models: one line naming the model and the key, status 2 ------------------------------------


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ('[[models]]\nmodel = "checksum"\nworkers = 0\n', "models[0] ('checksum'): workers: '0': use auto"),
        ('[[models]]\nmodel = "checksum"\nbatch_size = 4\n', "models[0] ('checksum'): unknown key 'batch_size'"),
        ('[[models]]\nmodel = "checksum"\n[[models]]\nmodel = "gpt-4"\n', "models[1] ('gpt-4'): model: unknown model"),
        (
            '[[models]]\nmodel = "checksum"\n[[models]]\nmodel = "checksum"\n',
            "models[1] ('checksum'): served_model_name: the id 'checksum' is served by models[0] already",
        ),
        ('[[models]]\nmodel = "checksum"\nmax_in_flight = "many"\n', "max_in_flight: 'many' must be a number"),
        ('[[models]]\nmodel = "checksum"\ndevice = "gpu"\n', "models[0] ('checksum'): device: 'gpu' is not a device"),
        ("port = 80\n", "unknown key 'port'"),
        ('[[models]]\nmodel = "checksum"\narena_share = 1.5\n', "arena_share: '1.5' must be a fraction of the arena"),
        (
            '[[models]]\nmodel = "checksum"\narena_share = 0.6\n[[models]]\nmodel = "efficientnet-lite0"\n'
            "arena_share = 0.6\n",
            "arena_share: the models' shares add up to 1.2",
        ),
        ("[[models]]\nworkers = 1\n", "models[0]: model: missing"),
        ("[[models]\n", "not TOML"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_model_and_the_key(tmp_path: Path, toml: str, says: str) -> None:
    from shmgate.node.cli import parse_config
    from shmgate.node.models import NodeConfigError
    from shmgate.node.plan import declared_models

    config = tmp_path / "node.toml"
    config.write_text(toml)
    with pytest.raises(NodeConfigError) as refused:
        declared_models(parse_config(["serve", "--config", str(config)]))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{config}: ") and says in message, message


def test_serve_with_a_bad_config_file_ends_at_once_with_status_2_and_one_line(tmp_path: Path) -> None:
    """A real process: nothing started, no traceback (a hang guard, not a timing check)."""
    config = tmp_path / "node.toml"
    config.write_text('[[models]]\nmodel = "checksum"\nworkers = 0\n')
    done = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SHMGATE_LABEL": f"bad-config-{os.getpid()}"},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"shmgate serve: error: {config}: models[0] ('checksum'): workers: '0': use auto for the "
        "default, or a count of 1 or more"
    ], done.stderr


def test_the_config_file_also_comes_from_shmgate_config_and_fills_in_the_global_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shmgate.node.cli import parse_config
    from shmgate.node.config import ServeConfig
    from shmgate.node.plan import declared_models, model_plans, worker_children

    config = tmp_path / "node.toml"
    config.write_text(
        '[[models]]\nmodel = "checksum"\nworkers = 2\nmax_batch_size = 3\n\n'
        '[[models]]\nmodel = "efficientnet-lite0"\nserved_model_name = "classifier"\n'
    )
    monkeypatch.setenv("SHMGATE_CONFIG", str(config))
    args = parse_config(["serve", "--device", "cpu", "--max-batch-size", "5", "--threads", "1"])
    assert isinstance(args, ServeConfig)
    models = declared_models(args)
    assert [(m.public_id, m.workers, m.max_batch_size) for m in models] == [("checksum", 2, 3), ("classifier", 0, 5)]
    children = [child.config for child in worker_children(args, model_plans(models), "0123456789abcdef")]
    assert [c.model.model for c in children] == [("checksum",), ("checksum",), ("efficientnet-lite0",)]
    assert [c.batching.max_batch_size for c in children] == [3, 3, 5]
    assert children[2].model.served_model_name == ("classifier",)


def test_model_flags_and_a_config_file_do_not_mix_and_served_names_pair_with_models(tmp_path: Path) -> None:
    from shmgate.node.cli import parse_config
    from shmgate.node.models import NodeConfigError
    from shmgate.node.plan import declared_models

    config = tmp_path / "node.toml"
    config.write_text('[[models]]\nmodel = "checksum"\n')
    with pytest.raises(NodeConfigError, match="both declare models"):
        declared_models(parse_config(["serve", "--config", str(config), "--model", "checksum"]))
    with pytest.raises(NodeConfigError, match="served_model_name in the file"):
        declared_models(parse_config(["serve", "--config", str(config), "--served-model-name", "x"]))
    with pytest.raises(NodeConfigError, match="one per --model"):
        declared_models(
            parse_config(["serve", "--model", "checksum", "--model", "efficientnet-lite0", "--served-model-name", "a"])
        )
    args = parse_config(
        [
            "serve",
            "--model",
            "checksum",
            "--served-model-name",
            "a",
            "--model",
            "efficientnet-lite0",
            "--served-model-name",
            "b",
        ]
    )
    assert [m.public_id for m in declared_models(args)] == ["a", "b"]


# -- a model whose workers die beyond their restart budget fails; the others keep serving ----------------


def test_a_model_whose_workers_die_beyond_the_budget_is_failed_and_the_other_keeps_running() -> None:
    """The supervisor's decision over an in-memory link with real (sleeping) child processes."""
    from shmgate.shared.transport.memory import MemorySupervisorLink
    from shmgate.supervise.supervisor import ChildProcess, Supervisor, child_env

    link = MemorySupervisorLink()
    sleeper = ["sh", "-c", "exec sleep 30"]
    flaky = ChildProcess("worker", 0, sleeper, child_env(), model="checksum")
    steady = ChildProcess("worker", 1, sleeper, child_env(), model="classifier")
    failed: list[str] = []
    sup = Supervisor(link, [], [flaky, steady], restart_backoff_s=0.0, restart_budget=2, on_model_failed=failed.append)
    try:
        steady.start()
        link.claim("worker", 1, steady.pid)
        for death in range(3):
            flaky.start()
            link.claim("worker", 0, flaky.pid)
            sup.check_children()  # it is seen READY: it served
            assert flaky.ever_ready
            assert flaky.process is not None
            os.kill(flaky.pid, signal.SIGKILL)
            flaky.process.wait(5)
            sup.check_children()
            assert flaky.process is None
            assert failed == ([] if death < 2 else ["checksum"])
        assert flaky.given_up and flaky.restart_at == float("inf")
        sup.check_children()
        assert flaky.process is None, "a worker beyond its budget was restarted"
        assert steady.is_alive() and not sup._fatal
    finally:
        for child in (flaky, steady):
            child.kill()
            child.join(5)


def test_a_global_processor_option_reaches_only_the_models_with_an_hf_processor(tmp_path: Path) -> None:
    from shmgate.shared.model_config import ModelConfig

    flags = {"mm_processor_kwargs": '{"max_pixels": 200704}'}
    classifier, vlm = ModelConfig("efficientnet-lite0"), ModelConfig(f"hf:{tmp_path}/qwen")
    assert classifier.with_globals(flags, alone=False).mm_processor_kwargs == {}
    assert vlm.with_globals(flags, alone=False).mm_processor_kwargs == {"max_pixels": 200704}
    # one model alone keeps the flag, and its frontend refuses it where it cannot apply, as before
    assert classifier.with_globals(flags).mm_processor_kwargs == {"max_pixels": 200704}


def test_a_model_that_keeps_dying_is_failed_while_the_other_keeps_serving(tmp_path: Path) -> None:
    """End to end: the checksum worker killed twice with a restart budget of one."""
    server = start_server(
        "efficientnet-lite0",
        tmp_path,
        "--model",
        "checksum",
        "--workers",
        "1",
        "--restart-budget",
        "1",
        "--queue-depth",
        "8",
    )
    try:
        url = server.base_url

        def checksum_worker() -> int | None:
            pids = [pid for pid, cmd in server.children() if "-m shmgate.worker" in cmd and "--model checksum" in cmd]
            return pids[0] if pids else None

        first = checksum_worker()
        assert first is not None
        os.kill(first, signal.SIGKILL)  # within the budget: restarted
        wait_until(lambda: checksum_worker() not in (None, first), 60, "the supervisor restarted it")
        wait_until(
            lambda: httpx.get(url + "/ready/checksum", timeout=10).status_code == 200,
            60,
            "the restarted checksum worker is ready",
        )
        second = checksum_worker()
        assert second is not None
        os.kill(second, signal.SIGKILL)  # beyond it: the model fails
        wait_until(
            lambda: httpx.get(url + "/v1/models/checksum", timeout=10).json()["state"] == "failed",
            30,
            "the model is failed",
        )
        refused = httpx.post(url + "/v1/chat/completions", json=image_request("checksum", noise_png(7)), timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert "model 'checksum' failed" in refused.json()["error"]["message"]
        ok = httpx.post(
            url + "/v1/chat/completions",
            json=image_request("efficientnet-lite0", (IMAGES / "coffee_640.jpg").read_bytes()),
            timeout=60,
        )
        assert _top1(_answer(ok)) == "espresso"
        not_ready = httpx.get(url + "/ready", timeout=10)
        assert not_ready.status_code == 503
        assert not_ready.json()["waiting_for"] == ["checksum"], not_ready.text  # says what it waits for
        assert not_ready.json()["models"] == {"efficientnet-lite0": "ready", "checksum": "failed"}
        assert not_ready.json()["message"].startswith("model 'checksum' failed: "), not_ready.text
        assert httpx.get(url + "/ready/efficientnet-lite0", timeout=10).status_code == 200
        assert httpx.get(url + "/ready/checksum", timeout=10).json()["state"] == "failed"
        assert checksum_worker() is None, "a worker beyond its budget was restarted"
        assert "model 'checksum' failed" in server.log_path.read_text()
    finally:
        stop_and_check(server)


def test_the_queue_budget_is_split_between_the_models_and_fails_naming_each_when_it_cannot_fit() -> None:
    from shmgate.shared.instance import queue_specs
    from shmgate.shared.mq_budget import MessageQueueBudgetError, plan_queue_depths

    specs = queue_specs(2, 4, [64, 16], ["classifier", "vlm"])
    assert [s.role for s in specs] == ["request classifier", "request vlm", "reply", "control"]
    plan = plan_queue_depths(819_200, specs, system_max_depth=64)
    assert plan.lowered and plan.total_bytes <= 819_200
    assert 4 <= plan.depths["request classifier"] and plan.depths["request vlm"] <= 16
    assert "1 request classifier x" in plan.describe(specs) and "1 request vlm x" in plan.describe(specs)
    with pytest.raises(MessageQueueBudgetError) as refused:
        plan_queue_depths(60_000, specs)
    assert "1 request classifier x 4 x 8192 B, 1 request vlm x 4 x 8192 B" in str(refused.value)
