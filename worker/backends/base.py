"""The model backend interface: what a worker needs from a model.

The worker drives every backend through one engine contract, the shape of vLLM's
EngineCore: ``add(item)`` a request, ``abort(key)`` one, ``step()`` to do one
round of model work and get the ``BackendEvent``s it produced, ``has_work()``,
and ``room()``, how many more requests it takes now. Items' tensors are already
on the backend's device (the worker copied them out of the arena and released
the arena space).

A generative backend (hf.py) implements the contract itself: a request joins the
running rows at the next step and leaves the step it ends. Every other backend
implements ``run(batch)`` and inherits the contract from ``BatchEngine``, an
adapter that runs what was added as one batch and hands its events out a group
at a time (a classifier's items all finish in its first step).

Preprocessing is *not* here: the frontend runs it (gateway/preprocess/)
and the worker only ever sees tensors. A backend never touches shared memory.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from shmgate.shared.errors import ModelError, ShmgateError
from shmgate.shared.wire import SamplingParams, TokenLogprob
from shmgate.worker.cache_gauges import SizedCache

__all__ = ["DEFAULT_BATCH_SIZE", "BackendEvent", "BatchEngine", "ModelBackend", "WorkItem", "batch_size_for"]


@dataclass
class WorkItem:
    """One request of a batch, as the backend sees it."""

    request_id: int
    # by TensorRef.name, in descriptor order; on the device, except the backend's ``host_tensors``
    tensors: dict[str, list[torch.Tensor]]
    params: SamplingParams = field(default_factory=SamplingParams)
    inline: bytes = b""  # small payload from the frontend (e.g. token ids), meaning is the backend's
    text: str = ""  # the user's text
    cancelled: bool = False  # set by the worker when the client went away; backends may stop early
    task: str = ""  # Submit.task: "" for the text answer, shared.wire.TASK_EMBED for an embedding
    # The worker's handle on it in the engine contract (``add``, ``abort``, events' ``index``): unique
    # among the items a worker holds, where request ids are unique per frontend only.
    key: int = 0
    # The content key of each image (Submit.image_keys, in image order; b"" where the frontend has none):
    # what the encoder cache is keyed by.
    image_keys: tuple[bytes, ...] = ()
    # A batch line (Submit.bulk, the bulk lane): a generation engine starts interactive requests before the
    # batch lines still waiting, and preempts batch lines first.
    bulk: bool = False


@dataclass
class BackendEvent:
    """A piece of output for ``batch[index]`` (from ``run``), or for the item whose ``key`` is ``index`` (``step``).

    ``text`` is appended to the answer. A non-None ``finish_reason`` ("stop" or
    "length") ends that item; a backend must end every item exactly once.

    ``flush=False`` says more output for this item follows at once (no model work in between):
    the worker then holds the text and sends it with the next flushed event, so a burst of small
    pieces costs one reply message, not one each. A token-streaming backend leaves it True.
    """

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    flush: bool = True
    # An embedding item's answer: the unit-normalised vector as little-endian float32 bytes
    # (worker/vectors.py sends it), given with or before its finish event.
    vector: bytes | None = None
    # The log-probabilities of the token sampled for this event (SamplingParams.logprobs >= 0), sent
    # to the frontend before the event's text.
    logprob: TokenLogprob | None = None
    # The item failed: this ends it (instead of a ``finish_reason``) and the worker answers the error;
    # the other items go on.
    error: ShmgateError | None = None


DEFAULT_BATCH_SIZE = 8  # requests per batch for a backend that states no preference


def _no_progress() -> None:
    """``ModelBackend.on_step`` until the worker sets its own."""


class ModelBackend(abc.ABC):
    """What the worker calls. Implementations: efficientnet.py, checksum.py, hf.py, hf_embed.py.

    Every capability the worker reads is declared here with its default, so the worker asks the
    backend (``backend.embeds``) instead of probing for an attribute, and a new backend states what
    it differs in and inherits the rest. ``run`` is abstract: a backend without it cannot be
    instantiated, and mypy says so where it is built.
    """

    name: str  # the public model id it answers to (Submit.model is checked against it)
    # True when it answers embedding items (``WorkItem.task == TASK_EMBED``); the worker refuses
    # them for a backend that does not.
    embeds: bool = False
    # TensorRef names it reads on the host (sizes, grids): the worker hands those over as host
    # tensors, not device copies, so reading them costs no device round trip and no host sync
    # (worker/device.py).
    host_tensors: Collection[str] = ()
    # How many requests a batch should hold when ``--max-batch-size`` is left at 0 (``batch_size_for``);
    # None: DEFAULT_BATCH_SIZE.
    preferred_batch_size: int | None = None
    # True for an engine that admits requests between its steps while others run (``room`` then says how
    # many): the worker takes only that many off the shared queue. False: a batch at a time, the next one
    # gathered while the current one runs.
    joins_running: bool = False
    # Called by a generative backend after each forward pass; the worker sets it to stamp its
    # progress there, so a long generation that yields no text for a while never reads as a hang.
    on_step: Callable[[], None] = staticmethod(_no_progress)

    @abc.abstractmethod
    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        """Run one batch and yield its output as it is produced.

        Raises: any exception fails every unfinished item of the batch with a
        server error; the worker survives it.
        """

    # -- the engine contract (the worker's only way in); by default ``BatchEngine`` over ``run`` --------

    @property
    def engine(self) -> BatchEngine:
        """This backend's adapter, made on first use (a subclass need not call an ``__init__`` for it)."""
        adapter: BatchEngine | None = self.__dict__.get("_batch_engine")
        if adapter is None:
            adapter = self.__dict__["_batch_engine"] = BatchEngine(self)
        return adapter

    def add(self, item: WorkItem) -> None:
        """Take ``item`` (its ``key`` set); its events come from later ``step`` calls."""
        self.engine.add(item)

    def abort(self, key: int) -> None:
        """The client went away: end the item at the next step boundary (it still gets its finish event)."""
        self.engine.abort(key)

    def step(self) -> list[BackendEvent]:
        """One round of model work: the events it produced, each ``index`` an item's ``key``.

        Raises: the round failed as a whole (the worker fails every item it holds and calls ``clear``).
        """
        return self.engine.step()

    def has_work(self) -> bool:
        """True while an added item has not ended."""
        return self.engine.has_work()

    def room(self, batch_size: int) -> int:
        """How many more items to add now (``batch_size``: the worker's ``--max-batch-size`` or the backend's)."""
        return self.engine.room(batch_size)

    def clear(self) -> None:
        """Forget every item (after ``step`` raised: the worker has failed them all)."""
        self.engine.clear()

    def engine_report(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """A generation engine's gauges and counters for /metrics (shared/stats_layout.py ENGINE_FIELDS
        order: the gauges, then the counters' totals since it started); None: nothing to report."""
        return None

    def caches(self) -> Mapping[str, SizedCache | None]:
        """The caches this backend keeps in its own memory, by their name in shared/stats_layout.py
        WORKER_CACHES (None: not built yet); the worker publishes their gauges (worker/cache_gauges.py)."""
        return {}


class BatchEngine:
    """The engine contract over a batch backend's ``run``: what was added runs as one batch, started by the
    next ``step``; items added meanwhile wait for the next batch (``room`` is 0 while one runs).

    Each ``step`` pulls the batch's events up to the next flushed one (a piece the worker should send
    now), so the worker reads cancels and routes output between them as it did between events.
    """

    def __init__(self, backend: ModelBackend) -> None:
        self._backend = backend
        self._added: list[WorkItem] = []
        self._batch: list[WorkItem] = []
        self._events: Iterator[BackendEvent] | None = None
        self._open: set[int] = set()  # keys of the running batch that have not ended

    def add(self, item: WorkItem) -> None:
        self._added.append(item)

    def abort(self, key: int) -> None:
        for item in (*self._added, *self._batch):
            if item.key == key:
                item.cancelled = True  # a batch backend looks at it between its events

    def has_work(self) -> bool:
        return bool(self._added) or self._events is not None

    def room(self, batch_size: int) -> int:
        return 0 if self.has_work() else batch_size

    def clear(self) -> None:
        self._added, self._batch, self._events, self._open = [], [], None, set()

    def step(self) -> list[BackendEvent]:
        if self._events is None:
            if not self._added:
                return []
            self._batch, self._added = self._added, []
            self._open = {item.key for item in self._batch}
            self._events = iter(self._backend.run(self._batch))
        out: list[BackendEvent] = []
        for event in self._events:
            key = self._batch[event.index].key
            out.append(replace(event, index=key))
            if event.finish_reason is not None or event.error is not None:
                self._open.discard(key)
            if event.flush:
                return out
        for key in sorted(self._open):  # a backend that forgot an item: never leave a request hanging
            out.append(BackendEvent(key, error=ModelError("the model produced no final answer")))
        self._batch, self._events, self._open = [], None, set()
        return out


def batch_size_for(backend: ModelBackend, requested: int) -> int:
    """The batch size a worker uses: ``requested`` (``--max-batch-size``) when set, else the backend's choice.

    Why a backend chooses: a batch binds its requests to one worker until the batch is done, so it
    should be no larger than what the model gains from running together. A CPU backend that runs a
    batch as consecutive passes gains nothing from more than one pass, and a larger batch only
    makes its last requests wait while another worker may be idle (docs/benchmarks-history.md).
    """
    if requested > 0:
        return requested
    preferred = backend.preferred_batch_size
    return preferred if preferred is not None and preferred > 0 else DEFAULT_BATCH_SIZE
