"""Allocations in the arena: the owner's side (Partition) and the reader's side (read_tensor).

Each allocation is a block: a 64-byte header followed by the tensor's data, both
64-byte aligned. The header holds a magic number, the allocation's generation and
its size. Generations come from a counter per partition kept in the frontend's
slot row, so they never repeat, not even across a restart of the frontend.

The rules that make reads safe without a lock (a seqlock):
- The owner writes a new block's generation into its header when it allocates,
  and sets it to 0 *before* the block is freed or reused.
- The header also carries the owner's slot epoch. A successor that takes a dead
  frontend's partition over claims the slot first (new epoch), so every block of
  the dead owner turns stale at once: the successor cannot zero headers it does
  not know about, and a surviving old header over overwritten data must never
  pass the check.
- A reader (worker, or a frontend copying another frontend's cached tensor)
  checks the generation against the descriptor before reading, copies, and
  checks it again after copying. A mismatch on either side makes the read a
  StaleGeneration error for that request, never a wrong answer.
- The descriptor reaches the reader through a message queue send/receive, a
  synchronising operation, so the data and header written before the send are
  visible to the reader (DESIGN section 3).

All validation of descriptors lives in ``validate`` and is done with plain
``if`` statements (``python -O`` removes asserts).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from math import prod

import numpy as np

from shmgate.shared.allocator import ALIGN, Allocator
from shmgate.shared.errors import InconsistentTensor, OutOfBounds, StaleGeneration
from shmgate.shared.segment import Segment
from shmgate.shared.wire import DTYPE_ITEMSIZE, TensorRef

__all__ = ["BLOCK_HEADER_BYTES", "Allocation", "Partition", "read_tensor", "validate"]

BLOCK_MAGIC = 0x5348_4D47_424C_4B31  # "SHMGBLK1"
BLOCK_HEADER_BYTES = 64
MAX_NDIM = 8
_U64 = np.dtype("<u8")


@dataclass(frozen=True)
class Allocation:
    """One block owned by a partition. ``offset`` is where the data starts (absolute)."""

    block: int  # absolute offset of the block header
    offset: int
    nbytes: int
    generation: int


class Partition:
    """The owner's view of its partition: allocate, write, free. Thread-safe within the process.

    Only the frontend that owns slot ``slot`` creates one for it; nobody else
    writes into the partition (DESIGN section 3: ownership over locking).
    """

    def __init__(self, segment: Segment, slot: int) -> None:
        self.segment = segment
        self.slot = slot
        self.start, self.end = segment.partition_bounds(slot)
        self._allocator = Allocator(self.end - self.start)
        self._row = segment.frontends[slot]
        self._epoch = int(self._row["epoch"])  # built after claim_slot: blocks carry the owner's epoch
        self._lock = threading.Lock()
        self._words = np.frombuffer(segment.mm, _U64, (self.end - self.start) // 8, self.start)

    @property
    def used_bytes(self) -> int:
        return self._allocator.used

    @property
    def free_bytes(self) -> int:
        return self._allocator.free

    @property
    def size(self) -> int:
        return self._allocator.size

    def live_blocks(self) -> int:
        return len(self._allocator.live_blocks)

    def allocate(self, nbytes: int) -> Allocation | None:
        """A new block for ``nbytes`` of data with a fresh generation, or None when nothing fits."""
        with self._lock:
            rel = self._allocator.allocate(BLOCK_HEADER_BYTES + max(nbytes, 1))
            if rel is None:
                return None
            generation = int(self._row["gen_counter"]) + 1
            self._row["gen_counter"] = generation
        w = rel // 8
        self._words[w] = BLOCK_MAGIC
        self._words[w + 2] = nbytes
        self._words[w + 3] = self.slot
        self._words[w + 4] = self._epoch
        self._words[w + 1] = generation
        return Allocation(self.start + rel, self.start + rel + BLOCK_HEADER_BYTES, nbytes, generation)

    def free(self, allocation: Allocation) -> None:
        """Invalidate the header (generation 0) first, then return the space."""
        rel = allocation.block - self.start
        self._words[rel // 8 + 1] = 0
        with self._lock:
            self._allocator.release(rel)

    def array(self, allocation: Allocation, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """A writable numpy view of the allocation's data (the only copy of the tensor)."""
        return np.frombuffer(self.segment.mm, numpy_dtype(dtype), prod(shape), allocation.offset).reshape(shape)

    def reset(self) -> None:
        """Forget all allocations (a successor taking a dead frontend's partition over)."""
        with self._lock:
            self._allocator.reset()
            self._epoch = int(self._row["epoch"])


def numpy_dtype(name: str) -> np.dtype:
    """numpy has no bfloat16: such tensors are viewed as raw 16-bit words."""
    return np.dtype("<u2") if name == "bfloat16" else np.dtype(name)


def validate(segment: Segment, ref: TensorRef) -> None:
    """Check a descriptor's tensor reference before anything is read.

    Raises OutOfBounds, InconsistentTensor or StaleGeneration; the caller fails
    that request only.
    """
    layout = segment.layout
    data_start = layout.data_offset
    data_end = layout.total_size
    offset, nbytes = ref.offset, ref.nbytes
    if not (0 <= offset < data_end) or not (0 <= nbytes <= data_end):
        raise OutOfBounds("tensor offset or size lies outside the arena")
    if offset > data_end - nbytes:  # offset + nbytes > end, written so it cannot overflow
        raise OutOfBounds("tensor extends past the end of the arena")
    if offset - BLOCK_HEADER_BYTES < data_start or (offset - data_start) % ALIGN:
        raise OutOfBounds("tensor offset is not the start of an allocation")
    partition = segment.partition_of(offset - BLOCK_HEADER_BYTES)
    if partition < 0 or (nbytes and segment.partition_of(offset + nbytes - 1) != partition):
        raise OutOfBounds("tensor crosses a partition boundary")
    itemsize = DTYPE_ITEMSIZE.get(ref.dtype)
    if itemsize is None:
        raise InconsistentTensor(f"unknown dtype {ref.dtype[:16]!r}")
    # Zero dims make prod() 0 whatever the others are: bound the rest too, or a zero-byte
    # tensor of shape (0, 2**63) passes here and numpy/torch raise ValueError on the view.
    if len(ref.shape) > MAX_NDIM or any(d < 0 for d in ref.shape) or prod(max(d, 1) for d in ref.shape) > data_end:
        raise InconsistentTensor("tensor shape is not valid")
    if prod(ref.shape) * itemsize != nbytes:
        raise InconsistentTensor("dtype and shape do not match the tensor's size")
    if nbytes == 0:  # no frontend sends one, and a zero-length view raises in torch.frombuffer
        raise InconsistentTensor("a tensor of zero bytes")
    _check_header(segment, ref)


def _check_header(segment: Segment, ref: TensorRef) -> None:
    block = ref.offset - BLOCK_HEADER_BYTES
    magic, generation, nbytes, _, epoch = np.frombuffer(segment.mm, _U64, 5, block)
    if int(magic) != BLOCK_MAGIC or ref.generation == 0 or int(generation) != ref.generation:
        raise StaleGeneration("the tensor was freed or reused before it was read")
    if int(epoch) != int(segment.frontends[segment.partition_of(block)]["epoch"]):
        raise StaleGeneration("the tensor's owner died and its partition was taken over")
    if int(nbytes) < ref.nbytes:
        raise OutOfBounds("descriptor claims more bytes than the allocation holds")


def read_tensor(segment: Segment, ref: TensorRef, out: np.ndarray | None = None) -> np.ndarray:
    """Validate ``ref``, copy its bytes into ``out`` (or a new array) and re-check the generation.

    The copy is the one copy a reader makes (on a GPU worker the device copy plays
    this part: see worker/). Raises DescriptorError subclasses.
    """
    validate(segment, ref)
    view = np.frombuffer(segment.mm, np.uint8, ref.nbytes, ref.offset)
    if out is None:
        out = np.empty(ref.nbytes, np.uint8)
    np.copyto(out.reshape(-1).view(np.uint8), view)
    _check_header(segment, ref)  # after the copy: the owner did not reuse the block meanwhile
    return out


def view_tensor(segment: Segment, ref: TensorRef) -> np.ndarray:
    """Validate ``ref`` and return a zero-copy read-only view. The caller copies, then calls ``recheck``."""
    validate(segment, ref)
    view = np.frombuffer(segment.mm, numpy_dtype(ref.dtype), prod(ref.shape), ref.offset).reshape(ref.shape)
    view.flags.writeable = False
    return view


def recheck(segment: Segment, ref: TensorRef) -> None:
    """The after-copy half of the seqlock. Raises StaleGeneration."""
    _check_header(segment, ref)
