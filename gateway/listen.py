"""How the frontends listen on the one HTTP port: a socket they share, or one socket each (``--listen``).

``shared``: the supervisor binds and listens once and hands the descriptor to every frontend
(``--fd``). All frontends wait on the one accept queue; whichever wakes first takes what is queued
(asyncio accepts a burst per wake-up), so the spread of connections over frontends is a race.
A frontend that dies loses only the connections it had accepted: the queue belongs to the socket.

``reuseport``: each frontend binds its own socket to the same host and port with ``SO_REUSEPORT``,
and the kernel picks a listening socket for each new connection by a hash of its addresses and
ports. The supervisor still binds first, with ``SO_REUSEPORT`` too, so a port already taken fails
``serve`` at once and ``--port 0`` learns its port, but it never listens: a bound socket reserves
the port and takes no connection. A second server of the same uid could bind beside it, so the
supervisor also refuses a port where some socket already listens (``_refuse_a_listener``). A
frontend binds before its app starts and listens only after the app's start-up (uvicorn's
``startup`` runs the lifespan, then ``create_server`` listens), so a frontend still starting takes
none. A frontend that dies takes its socket out of the kernel's
choice at once, and with it the connections waiting in its accept queue: those are reset unless
``net.ipv4.tcp_migrate_req=1`` moves them to another frontend's queue (docs/DEPLOY.md). While no
frontend listens (all of them restarting) a connection is refused rather than queued.
Only sockets of the same user can join a port's group, so another user cannot take a share of
the traffic; another process of the same user can (as it could attach to the shared memory).
"""

from __future__ import annotations

import logging
import socket

from shmgate.shared.errors import SetupError

__all__ = ["LISTEN_MODES", "bind_frontend", "bind_supervisor", "reuseport_available"]

LISTEN_MODES = ("shared", "reuseport")
BACKLOG = 2048  # the shared socket's accept queue (uvicorn's default backlog for a frontend's own)

log = logging.getLogger("shmgate")


def reuseport_available() -> bool:
    """Whether this platform lets a TCP socket set ``SO_REUSEPORT`` (Linux 3.9+, the BSDs)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        except OSError:
            return False
    return True


def _bound(host: str, port: int, *, reuseport: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_supervisor(host: str, port: int, mode: str) -> tuple[socket.socket, str]:
    """The supervisor's socket and the mode the frontends will use (``reuseport`` falls back to
    ``shared``, logged, where the platform lacks it). ``shared``: listening and inheritable;
    ``reuseport``: bound only. Its ``getsockname()`` gives the port when ``port`` is 0.

    Raises SetupError when the address cannot be bound (in use, not local, a privileged port).
    """
    if mode == "reuseport" and not reuseport_available():
        log.warning("--listen reuseport: this platform has no SO_REUSEPORT; the frontends share one socket")
        mode = "shared"
    try:
        sock = _bound(host, port, reuseport=mode == "reuseport")
    except OSError as exc:
        raise SetupError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    if mode == "reuseport":
        try:
            _refuse_a_listener(host, sock.getsockname()[1])
        except BaseException:
            sock.close()
            raise
    if mode == "shared":
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
    return sock, mode


def _refuse_a_listener(host: str, port: int) -> None:
    """Raise SetupError when some socket already listens on ``port``.

    ``SO_REUSEPORT`` lets every socket of the same uid bind the port, so a second ``serve`` on the
    same port would bind too and split the connections with the first. A socket with ``SO_REUSEADDR``
    alone can bind beside bound sockets that do not listen (ours, and connections in TIME_WAIT) but
    not beside a listening one, so binding one tells. (It cannot tell while the other server has no
    frontend listening, in the seconds its frontends start.)
    """
    try:
        _bound(host, port, reuseport=False).close()
    except OSError as exc:
        raise SetupError(f"cannot listen on {host}:{port}: {exc.strerror} (another server listens there)") from exc


def bind_frontend(host: str, port: int) -> socket.socket:
    """A frontend's own socket on the supervisor's port (``reuseport``), bound and not yet listening:
    uvicorn listens on it once the app has started."""
    return _bound(host, port, reuseport=True)
