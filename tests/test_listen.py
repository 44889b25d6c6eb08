"""``--listen reuseport``: each frontend listens on a socket of its own on the one port (node/listen.py, gateway/sockets.py).

The sockets first, as the supervisor and a frontend make them: the supervisor's reserves the port
and takes no connection, each frontend's takes a share, a closed one's share goes to the others,
IPv6 binds alike, and a platform without SO_REUSEPORT falls back to the shared socket. Then a real
``shmgate serve --listen reuseport`` with two frontends: both listen and both take fresh
connections; a frontend SIGKILLed under load costs only the requests that were on it (each
succeeds on a retry), and its replacement binds again and takes connections; SIGTERM leaves no
shared memory, no queue and no socket on the port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmgate.gateway import sockets
from shmgate.gateway.sockets import bind_frontend
from shmgate.node.cli import build_parser, parse_config
from shmgate.node.listen import bind_supervisor
from shmgate.node.plan import declared_models, frontend_config
from shmgate.shared.errors import SetupError
from tests.serving import Server, expected_checksum, image_request, noise_png, start_server, stop_and_check, wait_until

GUARD_S = 60.0


def _accepted(listeners: list[socket.socket], port: int, host: str = "127.0.0.1", n: int = 64) -> list[int]:
    """Open ``n`` fresh connections to ``port``; how many each of ``listeners`` accepted."""
    counts = [0] * len(listeners)
    clients = []
    for sock in listeners:
        sock.setblocking(False)
    try:
        for _ in range(n):
            client = socket.create_connection((host, port), timeout=5)
            clients.append(client)
            for i, sock in enumerate(listeners):
                with contextlib.suppress(BlockingIOError):
                    while True:
                        sock.accept()[0].close()
                        counts[i] += 1
    finally:
        for client in clients:
            client.close()
    return counts


def test_the_supervisors_socket_reserves_the_port_and_each_frontends_takes_a_share() -> None:
    reserved, mode = bind_supervisor("127.0.0.1", 0, "reuseport")
    port = reserved.getsockname()[1]  # --port 0: the kernel's choice, which the frontends bind
    frontends = [bind_frontend("127.0.0.1", port) for _ in range(2)]
    try:
        assert mode == "reuseport" and port > 0
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: a frontend still starting takes none
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with socket.socket() as intruder, pytest.raises(OSError):  # the port is taken for anyone without the option
            intruder.bind(("127.0.0.1", port))
        for sock in frontends:
            sock.listen(16)  # what uvicorn does after the app's start-up
        counts = _accepted(frontends, port)
        assert sum(counts) == 64 and min(counts) > 0, counts
        frontends.pop().close()  # a frontend dies: the next connections all go to the other
        assert _accepted(frontends, port) == [64]
    finally:
        for sock in [reserved, *frontends]:
            sock.close()


def test_a_port_another_server_listens_on_is_refused_though_it_has_so_reuseport_too() -> None:
    first, _ = bind_supervisor("127.0.0.1", 0, "reuseport")
    port = first.getsockname()[1]
    with first, bind_frontend("127.0.0.1", port) as listening:
        listening.listen(16)  # the first server serves: a second one must not split its connections
        with pytest.raises(SetupError, match="another server listens there"):
            bind_supervisor("127.0.0.1", port, "reuseport")
    with socket.socket() as plain:  # any other server on the port
        plain.bind(("127.0.0.1", 0))
        plain.listen(1)
        for mode in ("reuseport", "shared"):
            with pytest.raises(SetupError):
                bind_supervisor("127.0.0.1", plain.getsockname()[1], mode)


def test_a_restarted_frontend_binds_the_port_again() -> None:
    reserved, _ = bind_supervisor("127.0.0.1", 0, "reuseport")
    port = reserved.getsockname()[1]
    try:
        for _ in range(3):  # die and come back, with connections left in TIME_WAIT by the last run
            with bind_frontend("127.0.0.1", port) as sock:
                sock.listen(16)
                assert _accepted([sock], port, n=4) == [4]
    finally:
        reserved.close()


def test_ipv6_hosts_bind_alike() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        reserved, _ = bind_supervisor("::1", 0, "reuseport")
    except Exception as exc:  # SetupError: a kernel with IPv6 off
        pytest.skip(f"::1 cannot be bound here: {exc}")
    port = reserved.getsockname()[1]
    frontends = [bind_frontend("::1", port) for _ in range(2)]
    try:
        for sock in frontends:
            sock.listen(16)
        counts = _accepted(frontends, port, host="::1")
        assert sum(counts) == 64 and min(counts) > 0, counts
    finally:
        for sock in [reserved, *frontends]:
            sock.close()


def test_the_shared_socket_listens_in_the_supervisor_and_is_inherited() -> None:
    sock, mode = bind_supervisor("127.0.0.1", 0, "shared")
    with sock:
        assert mode == "shared" and sock.get_inheritable()
        socket.create_connection(sock.getsockname(), timeout=5).close()  # queued until a frontend accepts


def test_without_so_reuseport_the_frontends_share_one_socket(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(sockets.socket, "SO_REUSEPORT")
    with caplog.at_level(logging.WARNING, "shmgate"):
        sock, mode = bind_supervisor("127.0.0.1", 0, "reuseport")
    sock.close()
    assert mode == "shared"
    assert [r.message for r in caplog.records if "SO_REUSEPORT" in r.message], caplog.text


def test_a_frontend_of_reuseport_gets_the_port_and_no_descriptor() -> None:
    parent = parse_config(["serve", "--listen", "reuseport", "--host", "::1", "--port", "9010"])
    child = frontend_config(parent, declared_models(parent), "abc", 1, None)
    server = child.options.server
    assert (child.fd, server.host, server.port, server.listen) == (None, "::1", 9010, "reuseport")
    default = parse_config(["serve"])
    shared = frontend_config(default, declared_models(default), "abc", 1, 3)
    assert (shared.fd, shared.options.server.listen) == (3, "shared")


def test_the_listen_mode_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMGATE_LISTEN", "reuseport")
    assert build_parser().parse_args(["serve"]).listen == "reuseport"
    monkeypatch.setenv("SHMGATE_LISTEN", "both")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve"])
    assert exit_info.value.code == 2


# -- a real server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server("checksum", tmp_path_factory.mktemp("listen"), "--listen", "reuseport", "--workers", "1")
    try:
        yield started
    finally:
        started.stop()


def _listening_sockets(port: int) -> int:
    """Sockets in LISTEN on ``port`` (any address, IPv4 and IPv6), from /proc/net/tcp*."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                count += fields[1].rsplit(":", 1)[1] == f"{port:04X}" and fields[3] == "0A"
    return count


async def _fresh_get(port: int, path: str = "/health") -> int:
    """GET ``path`` on a new connection; the slot of the frontend that answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    finally:
        writer.close()
    assert head.startswith("HTTP/1.1 200"), head
    return int(head.lower().split("x-shmgate-frontend:", 1)[1].split("\r\n", 1)[0])


def _slots_seen(port: int, n: int = 200) -> collections.Counter[int]:
    """Which frontend answered each of up to ``n`` fresh connections (stops once both have)."""

    async def run() -> collections.Counter[int]:
        seen: collections.Counter[int] = collections.Counter()
        for _ in range(n):
            seen[await _fresh_get(port)] += 1
            if len(seen) == 2:
                break
        return seen

    return asyncio.run(run())


def test_each_frontend_listens_on_its_own_socket_and_takes_fresh_connections(server: Server) -> None:
    wait_until(lambda: _listening_sockets(server.port) == 2, GUARD_S, "both frontends listen")
    seen = _slots_seen(server.port)
    assert set(seen) == {0, 1}, seen


async def _post_chat(port: int, body: bytes) -> tuple[int, str]:
    """A chat request on a new connection: (status, body). Raises OSError when the connection dies
    before the whole answer came (a frontend killed between the head and the body closes it cleanly)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    answer_head, sep, answer = raw.decode("latin-1").partition("\r\n\r\n")
    length = re.search(r"(?im)^content-length:\s*(\d+)", answer_head)
    if not sep or length is None or len(answer) < int(length.group(1)):
        raise ConnectionResetError(f"cut short: {raw[:200]!r}")
    return int(answer_head.split(" ", 2)[1]), answer


def test_a_killed_frontend_costs_only_its_own_connections_and_its_replacement_listens_again(server: Server) -> None:
    image = noise_png(11)
    want = expected_checksum(image)
    body = json.dumps(image_request("checksum", image)).encode()
    victim = server.frontend_pid(0)
    assert victim is not None
    outcomes: list[tuple[int, bool, str]] = []  # (attempts, answered right, what) per request
    killed = asyncio.Event()

    async def one_request() -> None:
        for attempt in range(1, 6):
            try:
                status, text = await _post_chat(server.port, body)
            except OSError:
                continue  # its connection was on the killed frontend: retry on a new one
            outcomes.append((attempt, status == 200 and want in text, f"{status} {text[-300:]}"))
            return
        outcomes.append((5, False, "no answer"))

    async def client() -> None:
        while not killed.is_set() or len(outcomes) < done_at_kill + 40:
            await one_request()

    async def run() -> None:
        nonlocal done_at_kill
        clients = [asyncio.create_task(client()) for _ in range(4)]
        while len(outcomes) < 20:
            await asyncio.sleep(0.05)
        done_at_kill = len(outcomes)
        os.kill(victim, signal.SIGKILL)
        killed.set()
        await asyncio.wait_for(asyncio.gather(*clients), GUARD_S)

    done_at_kill = 1 << 30
    asyncio.run(run())
    assert all(ok for _, ok, _ in outcomes), [o for o in outcomes if not o[1]]
    retried = sum(attempts > 1 for attempts, _, _ in outcomes)  # their connections were on the killed frontend
    wait_until(lambda: server.frontend_pid(0) not in (None, victim), GUARD_S, "frontend 0 restarted")
    wait_until(lambda: _listening_sockets(server.port) == 2, GUARD_S, "the restarted frontend listens again")
    seen = _slots_seen(server.port)
    assert set(seen) == {0, 1}, seen
    print(f"\nfrontend 0 SIGKILLed under load: {len(outcomes)} requests, {retried} needed a retry, none lost")


def test_sigterm_leaves_no_shared_memory_and_frees_the_port(tmp_path: Path) -> None:
    started = start_server("checksum", tmp_path, "--listen", "reuseport", "--workers", "1")
    _slots_seen(started.port, n=4)
    stop_and_check(started)
    with socket.socket() as again:  # any server could bind it now (TIME_WAIT aside, as for every server)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", started.port))
        again.listen(1)
