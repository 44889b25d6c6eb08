"""A Kubernetes pod in a box, for tests and the scale-out scenario: namespaces made with util-linux `unshare`, as root.

What a pod gives a shmgate unit, rebuilt here without a cluster:
  - one IPC namespace for all its containers (message queues, and the kernel's defaults in it:
    fs.mqueue.msg_max 10, msgsize_max 8192, since the fs.mqueue sysctls are "unsafe" in Kubernetes);
  - a Memory emptyDir mounted at /dev/shm: a fresh tmpfs of the emptyDir's sizeLimit, in a mount
    namespace of the pod (a container sees it only if it mounts it; see ``Pod.run(mount_shm=False)``);
  - a PID namespace per container (the kubelet's default), so processes of different containers
    cannot see each other's pids: liveness has to come from heartbeats;
  - one uid for all containers, with RLIMIT_MSGQUEUE at the kernel's default 819,200 bytes, which is
    counted per uid across the node (all pods of that uid share it).

A holder process (`sleep`) keeps the pod's IPC and mount namespaces alive; every container is
`nsenter` into them plus `unshare --pid --fork --mount-proc`. Killing the holder and the containers
ends the namespaces, and the kernel frees the queues and the tmpfs with them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

K8S_MSGQUEUE_BYTES = 819_200  # RLIMIT_MSGQUEUE's default: a pod cannot raise it (no ulimit field)
POD_UID = 61414  # not a uid anything else on the machine uses, so its queue budget is ours alone


def pods_unavailable() -> str | None:
    """Why pods cannot be built here (not root, no util-linux tools, unshare refused), or None."""
    if os.geteuid() != 0:
        return "pod-in-a-box needs root (unshare of IPC, mount and PID namespaces)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    if not _unshare_works():
        return "unshare --ipc --mount --pid is not permitted here (a restricted container?)"
    return None


@functools.cache
def _unshare_works() -> bool:
    probe = subprocess.run(
        ["unshare", "--ipc", "--mount", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


@functools.cache
def uid_prefix() -> tuple[str, ...]:
    """Run containers as POD_UID when this machine lets that uid run our Python; else as root.

    A uid of our own gives the tests a queue budget no other process on the machine draws on,
    exactly as a pod's uid has on its node. Where the interpreter lies under a directory that uid
    cannot search (a pyenv under /root), the containers keep CAP_DAC_READ_SEARCH (read access to
    files only): it changes nothing about queues, their limits or shared memory.
    """
    if shutil.which("setpriv") is None:
        return ()
    base = ("setpriv", f"--reuid={POD_UID}", f"--regid={POD_UID}", "--clear-groups")
    # the probe starts a grandchild too: a supervisor must be able to exec the interpreter again
    probe = (
        "import subprocess, sys; "
        "sys.exit(subprocess.run([sys.executable, '-c', 'import shared.segment, torch']).returncode)"
    )
    for extra in ((), ("--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")):
        prefix = (*base, *extra)
        done = subprocess.run(
            [*prefix, sys.executable, "-c", probe],
            capture_output=True,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if done.returncode == 0:
            return prefix
    return ()


def _k8s_rlimits() -> None:
    """preexec: the pod's RLIMIT_MSGQUEUE (inherited by every process of the container)."""
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (K8S_MSGQUEUE_BYTES, K8S_MSGQUEUE_BYTES))


@dataclass
class Container:
    """One container: a process tree in its own PID namespace, inside its pod's namespaces."""

    name: str
    process: subprocess.Popen[bytes]  # the `unshare --fork` parent, in our PID namespace
    log_path: Path
    _main: int = 0

    def main_pid(self, timeout_s: float = 10.0) -> int:
        """Our-namespace pid of the container's first process (pid 1 inside its namespace)."""
        if self._main:
            return self._main
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
                if children:
                    self._main = int(children[0])
                    return self._main
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"container {self.name} has no process:\n{self.log()}")

    def signal(self, signum: int) -> None:
        """What the kubelet does: signal the container's main process (it has a handler, so pid 1 gets it)."""
        os.kill(self.main_pid(), signum)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the container's pid 1, which takes its whole PID namespace down, then its `unshare`.

        (`unshare --kill-child` alone does not do it: the parent-death signal is cleared when
        setpriv changes the uid.)
        """
        if self.process.poll() is None:
            with contextlib.suppress(RuntimeError, ProcessLookupError):
                os.kill(self.main_pid(timeout_s=2), signal.SIGKILL)
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class Pod:
    """A pod's shared IPC namespace and /dev/shm (a tmpfs of ``shm_bytes``), kept by a holder process."""

    name: str
    shm_bytes: int
    log_dir: Path
    holder: subprocess.Popen[bytes] | None = None
    containers: list[Container] = field(default_factory=list)

    def __enter__(self) -> Pod:
        script = (
            f"mount -t tmpfs -o size={self.shm_bytes},mode=1777 {self.name}-dshm /dev/shm && echo up && exec sleep 3600"
        )
        self.holder = subprocess.Popen(
            ["unshare", "--ipc", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline()
        if line.strip() != b"up":
            self.holder.kill()
            raise RuntimeError(f"could not build pod {self.name}: {line!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        for container in self.containers:
            container.kill()
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait(10)

    def run(
        self,
        name: str,
        argv: list[str],
        *,
        mount_shm: bool = True,
        env: dict[str, str] | None = None,
        pid_namespace: bool = True,
    ) -> Container:
        """Start a container running ``argv`` (as the pod's uid). ``mount_shm=False``: a container
        that does not mount the emptyDir (the pod's IPC namespace, the node's /dev/shm)."""
        assert self.holder is not None
        enter = ["nsenter", f"--target={self.holder.pid}", "--ipc"] + (["--mount"] if mount_shm else [])
        pidns = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] if pid_namespace else []
        log_path = self.log_dir / f"{self.name}-{name}.log"
        full_env = {**os.environ, "HOME": "/tmp", "PYTHONUNBUFFERED": "1", **(env or {})}
        process = subprocess.Popen(
            [*enter, "--", *pidns, *uid_prefix(), *argv],
            stdout=open(log_path, "wb"),
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=_k8s_rlimits,
            cwd=Path(__file__).resolve().parent.parent,
        )
        container = Container(name, process, log_path)
        self.containers.append(container)
        return container

    def exec(self, argv: list[str]) -> str:
        """Run a short command in the pod's IPC and mount namespaces; its stdout."""
        assert self.holder is not None
        out = subprocess.run(
            ["nsenter", f"--target={self.holder.pid}", "--ipc", "--mount", "--", *argv],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def shm_files(self) -> list[str]:
        return self.exec(["ls", "-A", "/dev/shm"]).split()


def gateway_argv(
    port: int,
    *,
    label: str = "pod",
    frontends: int = 1,
    arena: str = "64MiB",
    drain_timeout_s: float = 20,
    max_workers: int = 2,
    model: str = "checksum",
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shmgate.gateway",
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--frontends",
        str(frontends),
        "--arena-size",
        arena,
        "--label",
        label,
        "--model",
        model,
        "--max-workers",
        str(max_workers),
        "--drain-timeout-s",
        str(drain_timeout_s),
    ]


def worker_argv(
    *,
    label: str = "pod",
    follow_drain_s: float = 30,
    model: str = "checksum",
    batch_delay_ms: float = 0,
    attach_wait_s: float = 60,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shmgate.worker",
        "--label",
        label,
        "--model",
        model,
        "--device",
        "cpu",
        "--threads",
        "1",
        "--max-batch-size",
        "4",
        "--attach-wait-s",
        str(attach_wait_s),
        "--follow-drain-s",
        str(follow_drain_s),
        "--diag-batch-delay-ms",
        str(batch_delay_ms),
    ]


def terminate_together(*containers: Container) -> None:
    """SIGTERM to every container at the same moment, as the kubelet does (pids looked up first).

    The last container is signalled first: a pod lists its gateway before its worker, and a gateway
    with nothing in flight can stop within the moment a loaded machine takes between two kills. A
    worker that sees its instance stopped before its own SIGTERM arrived exits 1 (gone from under it,
    not asked to stop), which the rolling-restart test saw once in a few runs on saturated cores.
    """
    pids = [c.main_pid() for c in containers]
    for pid in reversed(pids):
        os.kill(pid, signal.SIGTERM)
