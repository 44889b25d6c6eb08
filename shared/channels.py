"""Message channels on POSIX message queues: the only way descriptors travel.

Why message queues: they are kernel objects (a dead process cannot corrupt
one), multi-producer and multi-consumer (one request queue shared by all
workers balances load for free: an idle worker takes the next request), and a
send/receive is a synchronising operation, so the arena writes made before a
send are visible to the receiver. On Linux the queue descriptor is a file
descriptor, so a frontend's event loop waits on it with ``add_reader`` /
``add_writer`` and never blocks (invariant 3).

Limits: Linux allows ``/proc/sys/fs/mqueue/msg_max`` messages per queue (10
by default) of ``msgsize_max`` bytes (8 KiB). Depth is taken as the smaller of
what was asked and what the kernel allows; workers pull only what they can
batch, so a shallow request queue costs nothing but back-pressure. The
total size of a uid's queues is capped by RLIMIT_MSGQUEUE; the instance plans
its depths to fit it (shared/mq_budget.py).

Channels:
    request   frontends -> workers   Submit       shared by all workers
    reply k   workers -> frontend k  ToGateway    one per frontend slot
    control w frontends -> worker w  Cancel       one per worker slot
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import posix_ipc

from shmgate.shared.errors import ChannelFull, SetupError
from shmgate.shared.names import IPC_MODE
from shmgate.shared.wire import MAX_MESSAGE_BYTES, encoder

log = logging.getLogger("shmgate.channels")

__all__ = [
    "AsyncQueueReader",
    "Queue",
    "UndecodableMessage",
    "create_queue",
    "open_queue",
    "AsyncSender",
    "YieldingSender",
    "system_queue_depth",
    "unlink_queue",
]


def system_queue_depth() -> int:
    try:
        with open("/proc/sys/fs/mqueue/msg_max") as f:
            return int(f.read())
    except OSError:
        return 10


def _system_msgsize() -> int:
    try:
        with open("/proc/sys/fs/mqueue/msgsize_max") as f:
            return int(f.read())
    except OSError:
        return MAX_MESSAGE_BYTES


class UndecodableMessage(msgspec.DecodeError):
    """A message that does not decode as what the queue carries; ``data`` keeps its bytes.

    The worker reads the request id and reply slot out of a descriptor that fails to decode,
    so that request gets an error reply instead of waiting for its deadline.
    """

    def __init__(self, message: str, data: bytes) -> None:
        super().__init__(message)
        self.data = data


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise UndecodableMessage(str(exc), data) from None


class Queue:
    """A message queue carrying msgspec messages; ``decoder`` fixes what it may carry."""

    def __init__(self, mq: posix_ipc.MessageQueue, decoder: msgspec.msgpack.Decoder[Any]) -> None:
        self._mq = mq
        self._decoder = decoder
        self.depth = mq.max_messages

    @property
    def fd(self) -> int:
        return int(self._mq.mqd)

    def current_messages(self) -> int:
        return int(self._mq.current_messages)

    def try_send(self, message: Any, priority: int = 0) -> bool:
        """Send without waiting. False when the queue is full. The receiver takes the highest ``priority`` first."""
        try:
            self._mq.send(encoder.encode(message), 0, priority)
        except posix_ipc.BusyError:
            return False
        return True

    def send(self, message: Any, timeout_s: float, priority: int = 0) -> None:
        """Blocking send (worker threads only). Raises ChannelFull after ``timeout_s``."""
        try:
            self._mq.send(encoder.encode(message), timeout_s, priority)
        except posix_ipc.BusyError as exc:
            raise ChannelFull("a message channel stayed full; the receiver is not keeping up") from exc

    def try_receive(self) -> Any | None:
        """Receive without waiting. None when empty. Raises msgspec.DecodeError for a malformed message.

        An empty queue is told by its attributes first: a ``receive(0)`` of an empty queue (a timed
        receive whose time is up) costs ~16 µs of CPU here against ~0.3 µs for the attribute read,
        and nearly every drain of a reply or control queue ends on an empty one. A message that arrives just after the
        look is left for the next drain (the descriptor stays readable).
        """
        if not self._mq.current_messages:
            return None
        try:
            data, _ = self._mq.receive(0)
        except posix_ipc.BusyError:
            return None
        return _decode(self._decoder, data)

    def receive(self, timeout_s: float) -> Any | None:
        """Blocking receive (worker threads only). None after ``timeout_s``."""
        try:
            data, _ = self._mq.receive(timeout_s)
        except (posix_ipc.BusyError, posix_ipc.SignalError):  # timeout, or a signal (e.g. SIGTERM) woke us
            return None
        return _decode(self._decoder, data)

    def close(self) -> None:
        with contextlib.suppress(posix_ipc.Error):
            self._mq.close()


def create_queue(
    name: str, decoder: msgspec.msgpack.Decoder[Any], depth: int = 64, message_bytes: int = MAX_MESSAGE_BYTES
) -> Queue:
    """Create a queue (owner only), mode 0600. Raises SetupError.

    Every queue counts against the user's RLIMIT_MSGQUEUE (``ulimit -q``, 800 KiB by
    default) with depth x message size bytes, hence small messages where they suffice.
    """
    depth = max(1, min(depth, system_queue_depth()))
    size = min(message_bytes, _system_msgsize())
    try:
        mq = posix_ipc.MessageQueue(
            name, posix_ipc.O_CREX, mode=IPC_MODE, max_messages=depth, max_message_size=size, read=True, write=True
        )
    except (posix_ipc.Error, ValueError, OSError) as exc:
        raise SetupError(
            "cannot create a POSIX message queue: the per-user message queue memory limit is probably "
            "exhausted (ulimit -q; docker: --ulimit msgqueue=N) or /proc/sys/fs/mqueue/queues_max is reached; "
            "use fewer frontends or --queue-depth"
        ) from exc
    return Queue(mq, decoder)


def open_queue(name: str, decoder: msgspec.msgpack.Decoder[Any]) -> Queue:
    try:
        return Queue(posix_ipc.MessageQueue(name), decoder)
    except posix_ipc.ExistentialError as exc:
        raise SetupError("a message channel of the instance is missing") from exc


def unlink_queue(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_message_queue(name)


SEND_SLICE_S = 2.0  # AsyncSender: a blocked send looks at close() this often (and re-queues behind newer ones)
SENDER_THREADS = 32  # AsyncSender: sends of one frontend that can wait in the kernel at once
SENDER_IDLE_S = 2.0  # AsyncSender: a sender thread with nothing to send this long exits (start + join: ~0.3 ms here)
# AsyncSender: at most this long for the previous send to be in the kernel's line. Generous: a thread
# starved of CPU takes that long to get there, and the one waiting for it could not go before it anyway.
LINE_WAIT_S = 1.0
_wchan_visible: bool | None = None  # does /proc show where a sleeping thread waits? (checked once)


def _wchan(tid: int) -> str | None:
    """Where this process's thread ``tid`` sleeps in the kernel ("0": running); None when it is gone."""
    try:
        with open(f"/proc/self/task/{tid}/wchan") as f:
            return f.read().strip()
    except OSError:
        return None


def _wchan_is_visible() -> bool:
    """Checked once per process on a thread parked on an Event: some kernels and sandboxes hide wchan."""
    global _wchan_visible
    if _wchan_visible is None:
        parked, release = threading.Event(), threading.Event()
        tids: list[int] = []

        def park() -> None:
            tids.append(threading.get_native_id())
            parked.set()
            release.wait(1.0)

        thread = threading.Thread(target=park, name="wchan-probe", daemon=True)
        thread.start()
        parked.wait(1.0)
        visible, deadline = False, time.monotonic() + 0.5
        while tids and not visible and time.monotonic() < deadline:
            visible = _wchan(tids[0]) not in (None, "", "0")
            time.sleep(0.001)
        release.set()
        thread.join(1.0)
        _wchan_visible = visible
    return _wchan_visible


def _in_a_queue_wait(wchan: str | None) -> bool:
    """Is a thread with this wchan blocked on a message queue (ipc/mqueue.c: wq_sleep, or its caller if inlined), or gone?"""
    return wchan is None or wchan == "wq_sleep" or "mq_timed" in wchan


@dataclass
class _Blocking:
    """A sender thread on its way into a blocking send: the next one waits until it is in the kernel's line."""

    tid: int
    left: bool = False  # its blocking send returned


@dataclass
class _Send:
    """One send handed to the sender threads, and where its outcome goes."""

    message: Any
    deadline: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    priority: int = 0  # the queue's receiver takes higher priorities first (Queue.try_send)
    cancelled: bool = False  # its caller stopped waiting before a thread took it: it never goes


class AsyncSender:
    """Sends from the event loop without blocking it, first come, first served, across processes too.

    A send that finds the queue free goes at once. Otherwise it waits behind the sends already
    waiting: each waiting send gets a sender thread of its own (up to ``SENDER_THREADS``) whose
    blocking send waits in the kernel. Linux keeps the senders blocked on a full message queue in
    the order they blocked and, when a receiver frees a place, moves the first one's message in at
    once, whichever process it belongs to and whether or not that process is running just then. So
    requests enter the shared request queue in the order they became ready, across frontends.

    Why a thread per waiting send, not one per frontend: with one, each frontend had one
    send in the kernel's line, so the frontends took turns, one message each, however many requests
    each had waiting: a frontend with more connections served its requests later. Measured at c=32
    on 2 frontends, the p50 of one frontend's requests was 478 ms against 235 ms for the other's
    (docs/benchmarks-history.md). Before that, waiters woke on writability and raced for
    each free place, and a frontend starved of CPU lost every race.

    This frontend's own sends keep their order: a thread takes the next send and tries it under one
    lock, and a thread that must block first waits (up to ``LINE_WAIT_S``) until the thread that
    blocked before it is in the kernel's line, which Linux shows as its ``wchan``. Without that wait,
    a thread preempted between the lock and its blocking call was overtaken: measured with two cores
    of other load, 3 runs in 10 of tests/test_fifo_sender.py delivered two sends swapped. (Where
    /proc cannot tell, the wait is skipped and such swaps stay possible; ``ReplyRouter`` does not
    rely on the order.) A send whose
    caller stopped waiting before a thread took it never goes; one already handed to the kernel may
    still go (harmless: its arena holds carry generations, and its answer matches no request).
    The threads are daemons: a frontend that exits does not wait for sends blocked in the kernel.
    One idle for ``SENDER_IDLE_S`` exits, so a frontend at rest holds none, whatever bursts it saw.
    """

    def __init__(self, queue: Queue, threads: int = SENDER_THREADS) -> None:
        self._queue = queue
        self._max_threads = max(1, threads)
        self._threads = 0
        self._idle = 0
        self._sends: collections.deque[_Send] = collections.deque()
        self._turn = threading.Condition()  # guards the fields above; held from taking a send to trying it
        self._waiting = 0  # sends handed to the threads and not yet answered
        self._closed = False
        self._last_blocking: _Blocking | None = None  # the thread that went to block most recently

    async def send(self, message: Any, timeout_s: float, priority: int = 0) -> None:
        """Raises ChannelFull after ``timeout_s``."""
        if not self._waiting and self._queue.try_send(message, priority):
            return
        loop = asyncio.get_running_loop()
        job = _Send(message, time.monotonic() + timeout_s, loop, loop.create_future(), priority)
        self._waiting += 1
        try:
            with self._turn:
                if self._closed:
                    raise ChannelFull("the channel is closed")
                self._sends.append(job)
                if len(self._sends) > self._idle and self._threads < self._max_threads:  # each idle thread takes one
                    self._threads += 1
                    threading.Thread(target=self._serve, name="send", daemon=True).start()
                self._turn.notify()
            await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        finally:
            self._waiting -= 1

    def _serve(self) -> None:
        """A sender thread: take the next send, try it at once, else block in the kernel until its deadline."""
        while True:
            with self._turn:
                idle_for_long = False
                while not self._sends and not self._closed and not idle_for_long:
                    self._idle += 1
                    idle_for_long = not self._turn.wait(SENDER_IDLE_S)
                    self._idle -= 1
                if not self._sends:  # closed or idle for long, nothing left
                    self._threads -= 1
                    return
                job = self._sends.popleft()
                if job.cancelled:
                    continue
                if self._closed:
                    self._finish(job, ChannelFull("the channel is closed"))
                    continue
                ahead = self._last_blocking
                # Under the lock: our sends keep their order. Not while an earlier one is still on its
                # way into the kernel: a place freed meanwhile is its place.
                if (ahead is None or ahead.left) and self._queue.try_send(job.message, job.priority):
                    self._finish(job, None)
                    continue
                me = self._last_blocking = _Blocking(threading.get_native_id())
            if ahead is not None:
                self._wait_until_in_line(ahead)
            error = self._send_by(job)
            me.left = True
            self._finish(job, error)

    @staticmethod
    def _wait_until_in_line(ahead: _Blocking) -> None:
        """Wait (briefly, outside the lock) until the send before ours is blocked in the kernel, or done."""
        global _wchan_visible
        if not _wchan_is_visible():
            return
        deadline = time.monotonic() + LINE_WAIT_S
        while not ahead.left and not _in_a_queue_wait(wchan := _wchan(ahead.tid)):
            if time.monotonic() >= deadline:
                if wchan != "0":  # asleep elsewhere for a whole second: a kernel that names the wait otherwise?
                    _wchan_visible = False
                    log.warning(
                        "sender thread %d waits in %r, not a message queue; sends wait in order "
                        "without checking from now on",
                        ahead.tid,
                        wchan,
                    )
                return
            time.sleep(0.0002)

    def _send_by(self, job: _Send) -> BaseException | None:
        """A blocking send until the job's deadline (time spent waiting for a thread counts); its error."""
        while (remaining := job.deadline - time.monotonic()) > 0 and not self._closed:
            try:
                # In slices, so that close() is noticed. A slice that ends puts this send behind the
                # senders that blocked after it: only sends that waited SEND_SLICE_S already lose places.
                self._queue.send(job.message, min(remaining, SEND_SLICE_S), job.priority)
                return None
            except (ChannelFull, posix_ipc.SignalError):  # still full, or a signal woke us: wait on
                continue
        if self._closed or not self._queue.try_send(job.message, job.priority):
            return ChannelFull("the channel stayed full; its receivers are saturated")
        return None

    @staticmethod
    def _finish(job: _Send, error: BaseException | None) -> None:
        """Hand a send's outcome to its event loop (gone already when the frontend is shutting down)."""

        def resolve() -> None:
            if job.future.done():
                return
            if error is None:
                job.future.set_result(None)
            else:
                job.future.set_exception(error)

        with contextlib.suppress(RuntimeError):  # the loop was closed
            job.loop.call_soon_threadsafe(resolve)

    def close(self) -> None:
        """Drop the sends still waiting for a thread (their callers get ChannelFull); blocked ones end within a slice."""
        with self._turn:
            self._closed = True
            self._turn.notify_all()


BULK_RETRY_S = 0.002  # YieldingSender: how often a send that found the queue full tries again


class YieldingSender:
    """Sends from the event loop that never wait in the kernel's line: the bulk lane's (gateway/lane.py).

    A send that finds the queue full tries again every ``BULK_RETRY_S`` on the event loop. Linux hands
    a freed place to the first sender blocked in the kernel, so an interactive send blocked there
    (``AsyncSender``) always gets it before a yielding send, which only takes places nobody waits for.
    Its own sends are not ordered against each other (batch lines need no order).
    """

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self._closed = False

    async def send(self, message: Any, timeout_s: float, priority: int = 0) -> None:
        """Raises ChannelFull after ``timeout_s``, or when the sender is closed."""
        deadline = time.monotonic() + timeout_s
        while not self._closed:
            if self._queue.try_send(message, priority):
                return
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(BULK_RETRY_S)
        raise ChannelFull("the channel stayed full; its receivers are saturated")

    def close(self) -> None:
        self._closed = True


class AsyncQueueReader:
    """Delivers every message of a queue to ``on_message`` on the event loop.

    Drains the queue whenever its descriptor is readable. A message that fails to
    decode or a callback that raises is reported to ``on_error`` and the reader
    carries on: the pump never dies on one bad message (LitServe's did).
    """

    def __init__(
        self,
        queue: Queue,
        on_message: Callable[[Any], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self._queue = queue
        self._on_message = on_message
        self._on_error = on_error
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._queue.fd, self.drain)
        self.drain()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._queue.fd)
            self._loop = None

    def drain(self) -> None:
        """Deliver what is queued now (also called by the frontend's watchdog before a verdict)."""
        for _ in range(1024):  # bounded, so a flood cannot starve the loop
            try:
                message = self._queue.try_receive()
            except Exception as exc:  # a malformed message: report, keep going
                self._on_error(exc)
                continue
            if message is None:
                return
            try:
                self._on_message(message)
            except Exception as exc:
                self._on_error(exc)
