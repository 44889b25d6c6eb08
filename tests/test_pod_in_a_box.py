"""A shmgate unit as Kubernetes runs it (deploy/k8s/base), rebuilt with namespaces (tests/podbox.py).

The gateway and a worker run as two containers of one pod: separate PID namespaces, one IPC
namespace, one fresh /dev/shm of the emptyDir's size, the kernel's default queue limits and
RLIMIT_MSGQUEUE. Checked: the facts the manifests rely on, a chat completion through the unit,
and SIGTERM to both containers at once under load (the kubelet's way) failing no request.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest

from tests.podbox import Pod, gateway_argv, require_pods, terminate_together, uid_prefix, worker_argv
from tests.serving import IMAGES, expected_checksum, free_port, image_request, noise_png, wait_until

SHM_BYTES = 80 * 2**20  # the emptyDir's sizeLimit in these tests: a 64 MiB arena plus its tables


@pytest.fixture(autouse=True)
def _pods_possible() -> None:
    require_pods()


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def _chat(port: int, data: bytes, timeout_s: float = 60) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions", json=image_request("checksum", data), timeout=timeout_s
    )


def test_unit_in_a_pod_serves_a_chat_completion(tmp_path: Path) -> None:
    port = free_port()
    with Pod("pod-a", SHM_BYTES, tmp_path) as pod:
        # the facts the manifests rest on: a new IPC namespace has the kernel's default queue limits
        assert pod.exec(["cat", "/proc/sys/fs/mqueue/msg_max"]).strip() == "10"
        assert pod.exec(["cat", "/proc/sys/fs/mqueue/msgsize_max"]).strip() == "8192"
        gateway = pod.run("gateway", gateway_argv(port))
        worker = pod.run("worker", worker_argv())
        wait_until(lambda: _ready(port) or not gateway.alive() or not worker.alive(), 120, "the unit ready")
        assert _ready(port), gateway.log() + worker.log()
        # the two containers are in different PID namespaces; liveness crossed them by heartbeats
        assert (
            Path(f"/proc/{gateway.main_pid()}/ns/pid").readlink()
            != Path(f"/proc/{worker.main_pid()}/ns/pid").readlink()
        )
        data = (IMAGES / "chelsea_640.jpg").read_bytes()
        response = _chat(port, data)
        assert response.status_code == 200, response.text
        assert expected_checksum(data) in response.json()["choices"][0]["message"]["content"]
        assert any(name.startswith("shmgate") for name in pod.shm_files()), "the arena lives in the pod's /dev/shm"
        terminate_together(gateway, worker)
        assert gateway.wait(60) == 0, gateway.log()
        assert worker.wait(60) == 0, worker.log()
        assert pod.shm_files() == [], "the gateway unlinks everything on the way out"


def test_a_container_without_the_emptydir_cannot_find_the_gateway(tmp_path: Path) -> None:
    """Same IPC namespace, but the node's /dev/shm: the arena is not there (mount it in every container)."""
    port = free_port()
    with Pod("pod-b", SHM_BYTES, tmp_path) as pod:
        gateway = pod.run("gateway", gateway_argv(port, label="unmounted"))
        wait_until(lambda: "listening on" in gateway.log() or not gateway.alive(), 60, "the gateway up")
        worker = pod.run("worker", worker_argv(label="unmounted", attach_wait_s=2), mount_shm=False)
        assert worker.wait(120) == 2
        assert "no running shmgate gateway with label 'unmounted'" in worker.log()


def test_dev_shm_too_small_names_the_emptydir_size_limit(tmp_path: Path) -> None:
    with Pod("pod-c", 16 * 2**20, tmp_path) as pod:
        gateway = pod.run("gateway", gateway_argv(free_port(), arena="64MiB"))
        assert gateway.wait(60) == 2
        assert "emptyDir.sizeLimit" in gateway.log()


def test_sigterm_to_every_container_at_once_fails_no_request(tmp_path: Path) -> None:
    """The kubelet signals the gateway and the worker together. The gateway drains; the worker keeps
    serving until the drain is over (--follow-drain-s), so every request in flight gets its answer."""
    port = free_port()
    images = [noise_png(seed) for seed in range(24)]
    with Pod("pod-d", SHM_BYTES, tmp_path) as pod:
        gateway = pod.run("gateway", gateway_argv(port, drain_timeout_s=30))
        # a slow model (0.5 s a batch of at most 4), so most requests are still in flight at SIGTERM
        worker = pod.run("worker", worker_argv(follow_drain_s=40, batch_delay_ms=500))
        wait_until(lambda: _ready(port) or not gateway.alive() or not worker.alive(), 120, "the unit ready")
        assert _ready(port), gateway.log() + worker.log()
        with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
            futures = [pool.submit(_chat, port, data) for data in images]
            # every request admitted (in flight, or already answered) before the signal: a request that
            # reaches a draining gateway is turned away with 503 and Retry-After, which is checked below
            wait_until(
                lambda: _metric(port, "shmgate_in_flight_requests") + sum(f.done() for f in futures) >= len(images),
                60,
                "every request admitted",
            )
            terminate_together(gateway, worker)
            time.sleep(0.3)
            late = _chat(port, images[0], timeout_s=10)  # during the drain: turned away, with a hint
            responses = [f.result() for f in futures]
        assert late.status_code == 503 and "retry-after" in late.headers, late.text
        failed = [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
        assert not failed, f"{failed}\n{gateway.log()}\n{worker.log()}"
        for data, response in zip(images, responses):
            assert expected_checksum(data) in response.json()["choices"][0]["message"]["content"]
        assert gateway.wait(60) == 0, gateway.log()
        assert worker.wait(60) == 0, worker.log()
        # it stopped after the drain: on DRAINED, or on STOPPED when that came within one turn of its loop
        assert "finished draining" in worker.log() or "the gateway instance stopped" in worker.log()
        assert pod.shm_files() == []


# serial: it fills the pods' uid's message-queue budget on purpose; a pod of another test (test_scaleout.py
# runs the same uid) would not get its queues meanwhile, or would eat into the budget under test.
@pytest.mark.serial
def test_second_unit_under_the_same_uid_on_a_node_does_not_fit(tmp_path: Path) -> None:
    """RLIMIT_MSGQUEUE is per uid per node: two pods of 12 frontends each cannot both get their queues.

    The first takes most of the 819,200 bytes at full depth (measured: 14 frontends fit alone, on Linux
    6.18). The second lowers its depths to what is left (shared/mq_budget.py), and since not even the
    minimum depth fits, it must fail at start-up with a message that names RLIMIT_MSGQUEUE (the fix).
    """
    if not uid_prefix():
        pytest.skip("needs a uid of its own (setpriv): root's queue budget is shared with everything else")
    with Pod("node-unit-1", SHM_BYTES, tmp_path) as first, Pod("node-unit-2", SHM_BYTES, tmp_path) as second:
        # the default depth, named: the suite's servers default to shallow queues (tests/conftest.py)
        full_depth = ["--queue-depth", "64"]
        one = first.run("gateway", gateway_argv(free_port(), label="u1", frontends=12) + full_depth)
        # its queues exist once it logs that it listens (before its frontends start)
        wait_until(lambda: "listening on" in one.log() or not one.alive(), 60, "the first unit's queues")
        assert one.alive(), one.log()
        two = second.run("gateway", gateway_argv(free_port(), label="u2", frontends=12) + full_depth)
        code = two.wait(60)
        one.kill()  # its frontends are not needed: its queues were the point
        assert code == 2, two.log()
        assert "message queue" in two.log(), two.log()
        assert "RLIMIT_MSGQUEUE" in two.log(), two.log()


def test_sigterm_while_requests_are_still_decoding_answers_each_with_200_or_503(tmp_path: Path) -> None:
    """Requests arrive around the signal, some still decoding their image when it comes: each gets its
    answer or a 503 with Retry-After (a proxy sends those elsewhere), never a 500 or a dropped
    connection. (The drain waits for requests that are still decoding, not only those queued.)"""
    port = free_port()
    photos = [(IMAGES / name).read_bytes() for name in ("camera_1024.jpg", "chelsea_1024.jpg", "coffee_1024.jpg")]
    with Pod("pod-e", SHM_BYTES, tmp_path) as pod:
        # one decode thread and a fast model: requests wait to be decoded, not to be run, so at the
        # signal there are requests that are admitted but not yet in flight
        gateway = pod.run("gateway", gateway_argv(port, drain_timeout_s=30) + ["--decode-threads", "1"])
        worker = pod.run("worker", worker_argv(follow_drain_s=40))
        wait_until(lambda: _ready(port) or not gateway.alive() or not worker.alive(), 120, "the unit ready")
        assert _ready(port), gateway.log() + worker.log()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(_chat, port, photos[i % 3] + bytes(i)) for i in range(32)]  # distinct: no cache
            wait_until(
                lambda: _metric(port, "shmgate_in_flight_requests") > 0 or any(f.done() for f in futures),
                60,
                "a request in flight",
            )
            terminate_together(gateway, worker)
            outcomes = []
            for future in futures:
                try:
                    outcomes.append(future.result())
                except httpx.HTTPError as exc:
                    outcomes.append(exc)
        bad = [
            o
            for o in outcomes
            if isinstance(o, Exception)
            or o.status_code not in (200, 503)
            or (o.status_code == 503 and "retry-after" not in o.headers)
        ]
        assert not bad, f"{bad}\n{gateway.log()}\n{worker.log()}"
        assert gateway.wait(60) == 0 and worker.wait(60) == 0
