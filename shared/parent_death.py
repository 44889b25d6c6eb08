"""Children of ``shmgate serve`` die with their supervisor instead of outliving it.

Without this, a SIGKILLed (or OOM-killed) supervisor leaves its frontends listening on the port and its
workers holding the model and the instance's queues, with nobody left to restart or stop them.

The supervisor starts each child with ``SHMGATE_SUPERVISOR_PID`` in its environment; the child calls
``follow_supervisor`` as early as it can. It asks the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``: Linux only, and it is kept across ``exec``), then compares
``os.getppid()`` with the expected pid: a supervisor that died between the fork and the ``prctl``
left the child re-parented already, and the kernel would never send the signal. A worker started on
its own (``shmgate worker``, a compose service) has no such variable and is not affected: its
container's restart policy and the instance heartbeat look after it.

Which signal: a worker gets SIGTERM and stops after its current batch. A frontend gets SIGKILL: on
SIGTERM uvicorn waits (up to the drain timeout) for requests in flight, and with the supervisor gone a
request still queued has no worker coming for it, so that wait ran its full length (seen: a frontend
still alive 10 s after its supervisor was SIGKILLed under load). Its clients lose their connections
either way; ``shmgate cleanup`` removes the IPC objects nobody unlinked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

from shmgate.shared.errors import EXIT_FAILURE

__all__ = ["SUPERVISOR_PID_ENV", "follow_supervisor", "set_parent_death_signal"]

log = logging.getLogger("shmgate.parent")

SUPERVISOR_PID_ENV = "SHMGATE_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies. False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0


def follow_supervisor(signum: int = signal.SIGTERM, environ: dict[str, str] | None = None) -> None:
    """In a supervised child: ``signum`` when the supervisor dies; exit now if it is gone already.

    A no-op when ``SHMGATE_SUPERVISOR_PID`` is not set (a child nobody supervises).
    """
    value = (os.environ if environ is None else environ).get(SUPERVISOR_PID_ENV, "")
    if not value.isdigit():
        return
    if not set_parent_death_signal(signum):
        log.warning("cannot ask for a parent-death signal here; this process may outlive its supervisor")
        return
    if os.getppid() != int(value):
        # The supervisor died before the prctl: the signal will never come. Nobody is left to serve for.
        print(f"shmgate: the supervisor (pid {value}) is gone; exiting", file=sys.stderr)
        os._exit(EXIT_FAILURE)
