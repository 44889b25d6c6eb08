"""Names of IPC objects, instance ids, /dev/shm space checks.

Rules kept here:
- Every IPC object of one running instance carries the same random instance id
  (``secrets.token_hex(8)``), so two instances never collide and a leftover can
  be attributed to its (dead) instance.
- Objects are created with mode 0600 (``IPC_MODE``).
- Names are built in this module only; nothing outside shared/ spells one, and
  no name ever appears in a client-facing message.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

__all__ = [
    "IPC_MODE",
    "PREFIX",
    "InstanceNames",
    "check_shm_space",
    "list_arena_instances",
    "new_instance_id",
]

PREFIX = "shmgate"
IPC_MODE = 0o600
SHM_DIR = "/dev/shm"
_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def new_instance_id() -> str:
    """An unguessable id for a new instance."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class InstanceNames:
    """Every IPC object name of one instance, derived from its id."""

    instance_id: str

    def __post_init__(self) -> None:
        if not _ID_RE.match(self.instance_id):
            raise ValueError(f"instance id must be 16 hex digits, got {self.instance_id!r}")

    @property
    def arena(self) -> str:
        return f"/{PREFIX}.{self.instance_id}.arena"

    @property
    def index_lock(self) -> str:
        return f"/{PREFIX}.{self.instance_id}.index"

    @property
    def repair_lock(self) -> str:
        return f"/{PREFIX}.{self.instance_id}.repair"

    @property
    def table_lock(self) -> str:
        return f"/{PREFIX}.{self.instance_id}.table"

    @property
    def request_queue(self) -> str:
        return f"/{PREFIX}.{self.instance_id}.req"

    def model_request_queue(self, model_index: int) -> str:
        """The request queue of the gateway's ``model_index``-th model (the first keeps the one-model name)."""
        return self.request_queue if model_index == 0 else f"{self.request_queue}{model_index}"

    def reply_queue(self, frontend_slot: int) -> str:
        return f"/{PREFIX}.{self.instance_id}.rep{frontend_slot}"

    def control_queue(self, worker_slot: int) -> str:
        return f"/{PREFIX}.{self.instance_id}.ctl{worker_slot}"

    def semaphores(self) -> list[str]:
        return [self.index_lock, self.repair_lock, self.table_lock]

    # A model's shared vision-tower outputs (shared/encoder_store.py): a segment and two locks per
    # model index, made by the model's first worker that shares, unlinked with the instance.
    def encoder_arena(self, model_index: int) -> str:
        return f"/{PREFIX}.{self.instance_id}.enc{model_index}"

    def encoder_semaphores(self, model_index: int) -> list[str]:
        """(index lock, repair lock) of model ``model_index``'s shared encoder outputs."""
        return [f"/{PREFIX}.{self.instance_id}.enc{model_index}i", f"/{PREFIX}.{self.instance_id}.enc{model_index}r"]


def _shm_names() -> list[list[str]]:
    """Our entries of /dev/shm, split on dots (semaphores appear there as ``sem.<name>``).

    Only objects owned by our effective uid: another user's instance is created 0600, so we can
    neither attach to it nor unlink it (/dev/shm is sticky), and must not trip over it at start-up.
    """
    uid = os.geteuid()
    names = []
    try:
        with os.scandir(SHM_DIR) as entries:
            for entry in entries:
                try:
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        names.append(entry.name.split("."))
                except FileNotFoundError:
                    continue  # unlinked while we looked
    except FileNotFoundError:
        return []
    return names


def list_arena_instances() -> list[str]:
    """Instance ids that have an arena segment in /dev/shm (alive or not)."""
    return sorted(
        p[1] for p in _shm_names() if len(p) == 3 and p[0] == PREFIX and p[2] == "arena" and _ID_RE.match(p[1])
    )


def list_orphan_semaphore_ids() -> list[str]:
    """Instance ids that have semaphores in /dev/shm but no arena any more."""
    arenas = set(list_arena_instances())
    return sorted(
        {p[2] for p in _shm_names() if len(p) == 4 and p[:2] == ["sem", PREFIX] and _ID_RE.match(p[2])} - arenas
    )


def list_orphan_encoder_ids() -> list[str]:
    """Instance ids that have a shared encoder segment (``encoder_arena``) in /dev/shm but no arena any more:
    a worker that created one while its instance was being unlinked."""
    arenas = set(list_arena_instances())
    return sorted(
        {
            p[1]
            for p in _shm_names()
            if len(p) == 3 and p[0] == PREFIX and _ID_RE.match(p[1]) and re.fullmatch(r"enc\d+", p[2])
        }
        - arenas
    )


def format_bytes(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}".replace(".0 ", " ")
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '64M', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB or 1GiB)")
    number, unit, _ = match.groups()
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit]
    return int(float(number) * scale)


def check_shm_space(nbytes: int) -> None:
    """Raise SetupError when /dev/shm cannot hold an arena of ``nbytes``.

    Docker's default /dev/shm is 64 MB, which is the usual cause; the message
    says what to change.
    """
    from shmgate.shared.errors import SetupError

    try:
        stat = os.statvfs(SHM_DIR)
    except FileNotFoundError as exc:
        raise SetupError("/dev/shm is not mounted; shmgate needs POSIX shared memory") from exc
    free = stat.f_bavail * stat.f_frsize
    if free < nbytes:
        raise SetupError(
            f"/dev/shm has {format_bytes(free)} free but the arena needs {format_bytes(nbytes)}; "
            "set shm_size in the compose file (or --shm-size for docker run); in Kubernetes raise "
            "emptyDir.sizeLimit of the pod's /dev/shm volume (medium: Memory, mounted in every container); "
            "or lower --arena-size"
        )
