"""What admission's "does this model have a live worker?" costs a frontend per request, with and without the memo.

    python bench/admission_cost.py [--workers 2] [--slots 4] [--iters 20000]

Every request asks it (gateway/frontend.py ``_admit``). The answer scans the segment's worker table
(state, model, stall, and a ``kill(pid, 0)`` per live worker: ``Segment.live_workers``);
``PosixFrontendLink.has_live_worker`` keeps a yes for LIVE_ANSWER_TTL_S. This builds a real
instance in /dev/shm with ``--workers`` slots claimed by this process (alive, beating, READY) out
of ``--slots``, and prints microseconds per call of the scan and of the memoised answer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shmgate.shared.instance import Instance  # noqa: E402
from shmgate.shared.transport.posix import PosixFrontendLink  # noqa: E402
from shmgate.shared.vocabulary import DEAD_AFTER_S, SlotState  # noqa: E402

MODEL = "checksum"


def per_call_us(call: object, iters: int) -> float:
    assert callable(call)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(iters):
            call()
        best = min(best, (time.perf_counter() - started) / iters * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4, help="worker slots (serve keeps twice its workers)")
    parser.add_argument("--iters", type=int, default=20000)
    args = parser.parse_args()
    inst = Instance.create(arena_size=1 << 20, n_frontends=1, n_workers=args.slots, queue_depth=1, model=MODEL)
    try:
        seg = inst.segment
        for slot in range(args.workers):
            seg.claim_slot(seg.workers, slot, model=MODEL)
            seg.workers[slot]["state"] = SlotState.READY
        link = PosixFrontendLink(inst, 0)
        assert len(seg.live_workers(DEAD_AFTER_S, MODEL)) == args.workers and link.has_live_worker(MODEL)
        scan = per_call_us(lambda: seg.live_workers(DEAD_AFTER_S, MODEL), args.iters)
        memo = per_call_us(lambda: link.has_live_worker(MODEL), args.iters)
        print(
            f"{args.workers} live workers of {args.slots} slots: the scan {scan:.1f} µs, the memoised answer {memo:.2f} µs"
        )
    finally:
        inst.unlink()
        inst.close()


if __name__ == "__main__":
    main()
