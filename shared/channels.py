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
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
import posix_ipc

from shared.errors import ChannelFull, SetupError
from shared.names import IPC_MODE
from shared.wire import MAX_MESSAGE_BYTES, encoder

__all__ = [
    "AsyncQueueReader",
    "Queue",
    "UndecodableMessage",
    "create_queue",
    "open_queue",
    "AsyncSender",
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

    def try_send(self, message: Any) -> bool:
        """Send without waiting. False when the queue is full."""
        try:
            self._mq.send(encoder.encode(message), 0)
        except posix_ipc.BusyError:
            return False
        return True

    def send(self, message: Any, timeout_s: float) -> None:
        """Blocking send (worker threads only). Raises ChannelFull after ``timeout_s``."""
        try:
            self._mq.send(encoder.encode(message), timeout_s)
        except posix_ipc.BusyError as exc:
            raise ChannelFull("a message channel stayed full; the receiver is not keeping up") from exc

    def try_receive(self) -> Any | None:
        """Receive without waiting. None when empty. Raises msgspec.DecodeError for a malformed message."""
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


SEND_SLICE_S = 0.5  # AsyncSender: a blocked send looks at close() this often


class AsyncSender:
    """Sends from the event loop without blocking it, first come, first served, across processes too.

    A send that finds the queue free goes at once. Otherwise it waits behind the sends already
    waiting, and one sender thread per AsyncSender sends them in order with a blocking send: Linux
    keeps the senders blocked on a full message queue in arrival order and, when a receiver frees
    a place, moves the first one's message in at once, whichever process it belongs to and whether
    or not that process is running just then. So requests enter the shared request queue in the
    order they started waiting, across frontends. (Before issue 16, waiters woke on writability and
    raced for each free place, a new send could slip in ahead of them, and a frontend starved of
    CPU lost every race: some requests waited seconds behind later ones once the queue filled.)
    One thread keeps this frontend's own sends in their order, which ``Frontend._check_taken``
    relies on. A send cancelled while it waits never goes; one already handed to the kernel may
    still go (harmless: its arena holds carry generations, and its answer matches no request).
    """

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="send")
        self._waiting = 0  # sends handed to the thread and not yet answered
        self._closed = False

    async def send(self, message: Any, timeout_s: float) -> None:
        """Raises ChannelFull after ``timeout_s``."""
        if not self._waiting and self._queue.try_send(message):
            return
        deadline = time.monotonic() + timeout_s
        self._waiting += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._send_by, message, deadline)
        finally:
            self._waiting -= 1

    def _send_by(self, message: Any, deadline: float) -> None:
        """The sender thread: a blocking send until ``deadline`` (time spent queued here counts)."""
        while (remaining := deadline - time.monotonic()) > 0 and not self._closed:
            try:
                # In slices, so that close() is noticed (a process exits only once this thread has). A
                # slice that ends puts this send behind the other processes' blocked senders, i.e. behind
                # at most one send per other frontend: each has one sender thread.
                self._queue.send(message, min(remaining, SEND_SLICE_S))
                return
            except (ChannelFull, posix_ipc.SignalError):  # still full, or a signal woke us: wait on
                continue
        if self._closed or not self._queue.try_send(message):
            raise ChannelFull("the channel stayed full; its receivers are saturated")

    def close(self) -> None:
        """Drop the sends still waiting (their callers were cancelled or gave up); the thread exits."""
        self._closed = True
        self._thread.shutdown(wait=False, cancel_futures=True)


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
