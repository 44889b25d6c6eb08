"""First-fit allocator with coalescing over one partition, process-local.

Rules kept here:
- It only does arithmetic on [0, size): it never touches shared memory, so it is
  fast and cannot be corrupted by another process. One frontend owns one
  partition and is the only caller (DESIGN section 3: ownership over locking).
- Every block is ``ALIGN``-aligned and a multiple of ``ALIGN`` long.
- ``used + free == size`` at all times, no two live blocks overlap, and adjacent
  free blocks are always merged: after releasing everything there is exactly
  one free block (checked by the hypothesis test in tests/test_allocator.py).

Free blocks are kept in address order (a sorted list of starts plus a dict of
sizes), so the search is first-fit by address: it keeps low addresses busy and
leaves large holes at the top, which matters for variable-size VLM tensors.
"""

from __future__ import annotations

import bisect

__all__ = ["ALIGN", "Allocator"]

ALIGN = 64


class Allocator:
    def __init__(self, size: int) -> None:
        if size <= 0 or size % ALIGN:
            raise ValueError(f"size must be a positive multiple of {ALIGN}")
        self.size = size
        self._starts: list[int] = [0]  # free block starts, sorted
        self._free: dict[int, int] = {0: size}  # start -> length
        self._live: dict[int, int] = {}  # start -> length
        self.used = 0

    @property
    def free(self) -> int:
        return self.size - self.used

    @property
    def free_blocks(self) -> list[tuple[int, int]]:
        return [(start, self._free[start]) for start in self._starts]

    @property
    def live_blocks(self) -> dict[int, int]:
        return dict(self._live)

    def largest_free(self) -> int:
        return max(self._free.values(), default=0)

    def allocate(self, nbytes: int) -> int | None:
        """Start of a block of at least ``nbytes`` (rounded up to ALIGN), or None when nothing fits."""
        if nbytes <= 0:
            nbytes = ALIGN
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        for i, start in enumerate(self._starts):
            length = self._free[start]
            if length < need:
                continue
            del self._free[start]
            if length == need:
                del self._starts[i]
            else:
                self._starts[i] = start + need  # still sorted: the rest stays in place
                self._free[start + need] = length - need
            self._live[start] = need
            self.used += need
            return start
        return None

    def release(self, start: int) -> int:
        """Return the block at ``start`` to the free list, merging neighbours. Returns its length.

        Raises KeyError for a start that is not a live block (a double free is a bug).
        """
        length = self._live.pop(start)
        self.used -= length
        merged_start, merged_length = start, length
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + length:  # merge with the next free block
            merged_length += self._free.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._free[self._starts[i - 1]] == start:  # and the previous
            merged_start = self._starts[i - 1]
            self._free[merged_start] += merged_length
        else:
            self._starts.insert(i, merged_start)
            self._free[merged_start] = merged_length
        return length

    def reset(self) -> None:
        """Forget every allocation (a restarted owner taking its partition over)."""
        self.__init__(self.size)  # type: ignore[misc]
