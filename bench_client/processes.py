"""A server's processes as /proc shows them: what each one is, and what it holds.

Shared by the benchmarks and the tests that count a server's CPU, memory, descriptors and threads.
A process is named from its command line only (``role``), so this module knows shmgate's command
lines, not its internals; a process that ends while it is read counts as gone, never as an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shmgate.bench_client.loadgen import process_tree

__all__ = ["ProcessSample", "memory_kib", "role", "sample_process", "sample_tree"]


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    role: str  # see ``role``
    rss_kib: int  # all resident pages, including touched pages of the shared arena
    anon_kib: int  # private heap: what would grow with a leak (the arena is RssShmem, bounded by its size)
    fds: int
    threads: int


def role(pid: int, root: int | None = None) -> str:
    """ "frontend <slot>", "worker", "supervisor" (of ``shmgate serve`` or ``gateway``), "main" (``root``
    when it is no shmgate process), "pool" (any other process of the tree) or "gone"."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "gone"
    if "frontend" in argv and "--slot" in argv:
        return f"frontend {argv[argv.index('--slot') + 1]}"
    if "shmgate.worker" in argv or "worker" in argv:  # python -m shmgate.worker, shmgate worker
        return "worker"
    if "serve" in argv or "gateway" in argv:
        return "supervisor"
    return "main" if pid == root else "pool"


def sample_process(pid: int, root: int | None = None) -> ProcessSample | None:
    """RSS, open fds and threads of one process; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return ProcessSample(
        pid,
        role(pid, root),
        int(fields["VmRSS"].split()[0]),
        int(fields["RssAnon"].split()[0]),
        fds,
        int(fields["Threads"]),
    )


def sample_tree(root: int) -> dict[int, ProcessSample]:
    """Every live process of the tree under ``root`` (``root`` included), by pid."""
    return {pid: s for pid in sorted(process_tree([root])) if (s := sample_process(pid, root)) is not None}


def memory_kib() -> dict[str, int]:
    """This process's anonymous huge pages and resident set, in KiB (/proc/self/smaps_rollup)."""
    fields = {"AnonHugePages:": "huge_kib", "Rss:": "rss_kib"}
    found = {}
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            name = line.split(maxsplit=1)[0]
            if name in fields:
                found[fields[name]] = int(line.split()[1])
    return found
