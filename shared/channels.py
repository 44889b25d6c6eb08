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


class AsyncSender:
    """Sends from the event loop without blocking it; many tasks may wait on one full queue.

    Waiters are served first come, first served: a send finds the queue full, or finds others
    already waiting, and queues behind them; when the queue becomes writable the waiters' messages
    go in their order, as many as fit. (A free-for-all, where every waiter and every new send
    raced for each free place, let unlucky requests wait for seconds behind later ones once the
    request queue filled: the tail of issue 16.) asyncio allows one writer callback per file
    descriptor, so the waiters share one registration.
    """

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self._waiters: collections.deque[tuple[Any, asyncio.Future[None]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def send(self, message: Any, timeout_s: float) -> None:
        """Raises ChannelFull after ``timeout_s``."""
        if not self._waiters and self._queue.try_send(message):
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append((message, waiter))
        if self._loop is None:
            self._loop = loop
            loop.add_writer(self._queue.fd, self._wake)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError as exc:
            if waiter.done() and not waiter.cancelled():
                waiter.result()  # sent (or failed) just as the time ran out
                return
            raise ChannelFull("the channel stayed full; its receivers are saturated") from exc
        finally:
            if not waiter.done():
                waiter.cancel()  # timed out or cancelled: its message must not go any more
            self._forget_done()

    def _wake(self) -> None:
        """Writable: send the waiting messages in order while they fit."""
        while self._waiters:
            message, waiter = self._waiters[0]
            if waiter.done():  # its sender gave up
                self._waiters.popleft()
                continue
            try:
                sent = self._queue.try_send(message)
            except Exception as exc:  # noqa: BLE001 - that sender's failure, raised in its task
                self._waiters.popleft()
                waiter.set_exception(exc)
                continue
            if not sent:
                return  # full again: stay registered, wake on the next free place
            self._waiters.popleft()
            waiter.set_result(None)
        self._forget_done()

    def _forget_done(self) -> None:
        while self._waiters and self._waiters[0][1].done():
            self._waiters.popleft()
        if not self._waiters and self._loop is not None:
            self._loop.remove_writer(self._queue.fd)
            self._loop = None


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
