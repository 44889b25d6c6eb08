"""The content cache index: content key -> tensors resident in the arena. Shared by all frontends.

One source of truth (DESIGN section 3): the index lives in the segment, every
frontend reads it, and no frontend keeps a mirror of it. An entry points into
the partition of the frontend that inserted it, and only that frontend removes
it (when it evicts). Callers hold the index lock around every method.

Crash safety: an insert writes every field of a free slot first and sets
``state = VALID`` last; a removal sets ``state = TOMBSTONE`` first. A process
killed half way through therefore leaves either an invisible half-written slot or
a complete entry, never a visible torn one. Entries also carry their partition's
epoch: when a frontend dies and its successor takes the partition over, every
entry of the old epoch reads as a miss even before the successor purges them.

Open addressing with linear probing, bounded to ``MAX_PROBE`` slots: a full
neighbourhood makes an insert fail (the image is simply not cached), never a
long scan. Removed entries become tombstones, reused by later inserts. Each
frontend keeps its own entries within its quota of half the table
(shared/cache.py ``index_quota``), so the table stays at most half full and a
failed insert stays rare: a full table would refuse every new image for good,
however much of the arena is free.
"""

from __future__ import annotations

import enum
import mmap
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shmgate.shared.wire import DTYPE_ITEMSIZE, TensorRef

__all__ = ["ENTRY", "MAX_TENSORS", "CacheIndex", "IndexEntry"]

KEY_BYTES = 16
MAX_TENSORS = 4
MAX_PROBE = 32
MAX_NDIM = 4
_DTYPES = list(DTYPE_ITEMSIZE)

TENSOR = np.dtype(
    [
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("generation", "<u8"),
        ("dtype", "<u8"),  # index into _DTYPES
        ("ndim", "<u8"),
        ("shape", "<u8", (MAX_NDIM,)),
        ("name", "S24"),
    ]
)

ENTRY = np.dtype(
    [
        ("state", "<u8"),
        ("key", "S16"),
        ("partition", "<u8"),
        ("partition_epoch", "<u8"),
        ("ntensors", "<u8"),
        ("tensors", TENSOR, (MAX_TENSORS,)),
    ]
)


class EntryState(enum.IntEnum):
    EMPTY = 0  # never used: a probe sequence ends here
    VALID = 1
    TOMBSTONE = 2  # removed: probing continues past it, inserts reuse it


@dataclass(frozen=True)
class IndexEntry:
    key: bytes
    partition: int
    partition_epoch: int
    tensors: tuple[TensorRef, ...]


class IndexRegion(Protocol):
    """Where a segment keeps the index (shared/segment.py ``Layout``)."""

    @property
    def index_capacity(self) -> int: ...

    @property
    def index_offset(self) -> int: ...


class MappedSegment(Protocol):
    """What ``CacheIndex.in_segment`` reads of a segment: named by shape, since the segment sizes
    its own layout by ``ENTRY`` and so imports this module."""

    @property
    def mm(self) -> mmap.mmap: ...

    @property
    def layout(self) -> IndexRegion: ...


class CacheIndex:
    def __init__(self, table: np.ndarray) -> None:
        self._table = table
        self._mask = len(table) - 1

    @classmethod
    def in_segment(cls, segment: MappedSegment) -> CacheIndex:
        layout = segment.layout
        return cls(np.frombuffer(segment.mm, ENTRY, layout.index_capacity, layout.index_offset))

    @property
    def capacity(self) -> int:
        """Slots in the table (a power of two)."""
        return len(self._table)

    def _probe(self, key: bytes) -> range:
        start = int.from_bytes(key[:8], "little") & self._mask
        return range(start, start + MAX_PROBE)

    def _slot(self, i: int) -> np.void:
        record: np.void = self._table[i & self._mask]
        return record

    def lookup(self, key: bytes, partition_epochs: np.ndarray | None = None) -> IndexEntry | None:
        """The entry for ``key`` or None. Entries of a superseded partition epoch are misses."""
        for i in self._probe(key):
            slot = self._slot(i)
            state = int(slot["state"])
            if state == EntryState.EMPTY:
                return None
            if state != EntryState.VALID or _stored_key(slot) != _fit(key):
                continue
            entry = _read_entry(slot, key)
            if partition_epochs is not None and int(partition_epochs[entry.partition]) != entry.partition_epoch:
                return None
            return entry
        return None

    def insert(self, entry: IndexEntry) -> bool:
        """Add ``entry`` unless its key is present. False when present or no slot is free nearby."""
        if len(entry.tensors) > MAX_TENSORS or any(len(t.shape) > MAX_NDIM for t in entry.tensors):
            return False
        free_slot = None
        for i in self._probe(entry.key):
            slot = self._slot(i)
            state = int(slot["state"])
            if state == EntryState.VALID and _stored_key(slot) == _fit(entry.key):
                return False
            if state != EntryState.VALID and free_slot is None:
                free_slot = slot
            if state == EntryState.EMPTY:
                break
        if free_slot is None:
            return False
        _write_entry(free_slot, entry)
        free_slot["state"] = EntryState.VALID  # publish last
        return True

    def remove(self, key: bytes, partition: int, generation: int) -> bool:
        """Remove the entry of ``key`` if it is the one at ``partition`` with that first-tensor generation."""
        for i in self._probe(key):
            slot = self._slot(i)
            state = int(slot["state"])
            if state == EntryState.EMPTY:
                return False
            if state == EntryState.VALID and _stored_key(slot) == _fit(key):
                if int(slot["partition"]) == partition and int(slot["tensors"][0]["generation"]) == generation:
                    slot["state"] = EntryState.TOMBSTONE
                    return True
                return False
        return False

    def purge_partition(self, partition: int) -> int:
        """Tombstone every entry of ``partition`` (a successor taking a dead frontend's place)."""
        table = self._table
        hits = np.nonzero((table["state"] == EntryState.VALID) & (table["partition"] == partition))[0]
        table["state"][hits] = EntryState.TOMBSTONE
        return len(hits)

    def count(self) -> int:
        return int(np.count_nonzero(self._table["state"] == EntryState.VALID))


def _fit(key: bytes) -> bytes:
    """The key as the table stores it: 16 bytes, cut or padded with zeros."""
    return key[:KEY_BYTES].ljust(KEY_BYTES, b"\0")


def _stored_key(slot: np.void) -> bytes:
    # numpy strips trailing zero bytes from an "S16" field: pad them back, or a key whose
    # last byte is 0 (1 content key in 256) would never match and never be removed.
    return bytes(slot["key"]).ljust(KEY_BYTES, b"\0")


def _read_entry(slot: np.void, key: bytes) -> IndexEntry:
    tensors = []
    for t in slot["tensors"][: int(slot["ntensors"])]:
        ndim = int(t["ndim"])
        tensors.append(
            TensorRef(
                offset=int(t["offset"]),
                nbytes=int(t["nbytes"]),
                generation=int(t["generation"]),
                dtype=_DTYPES[int(t["dtype"])] if int(t["dtype"]) < len(_DTYPES) else "?",
                shape=tuple(int(x) for x in t["shape"][:ndim]),
                name=bytes(t["name"]).decode(errors="replace"),
            )
        )
    return IndexEntry(key, int(slot["partition"]), int(slot["partition_epoch"]), tuple(tensors))


def _write_entry(slot: np.void, entry: IndexEntry) -> None:
    slot["key"] = entry.key
    slot["partition"] = entry.partition
    slot["partition_epoch"] = entry.partition_epoch
    slot["ntensors"] = len(entry.tensors)
    for j, ref in enumerate(entry.tensors):
        t = slot["tensors"][j]
        t["offset"] = ref.offset
        t["nbytes"] = ref.nbytes
        t["generation"] = ref.generation
        t["dtype"] = _DTYPES.index(ref.dtype)
        t["ndim"] = len(ref.shape)
        t["shape"][:] = 0
        t["shape"][: len(ref.shape)] = ref.shape
        t["name"] = ref.name.encode()[:24]
