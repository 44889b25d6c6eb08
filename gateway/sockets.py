"""A frontend's side of ``--listen`` (node/listen.py says how the two modes work): the modes, and the socket
a frontend binds for itself under ``reuseport``."""

from __future__ import annotations

import socket

__all__ = ["LISTEN_MODES", "bind_frontend", "bound"]

LISTEN_MODES = ("shared", "reuseport")


def bound(host: str, port: int, *, reuseport: bool) -> socket.socket:
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


def bind_frontend(host: str, port: int) -> socket.socket:
    """A frontend's own socket on the supervisor's port (``reuseport``), bound and not yet listening:
    uvicorn listens on it once the app has started."""
    return bound(host, port, reuseport=True)
