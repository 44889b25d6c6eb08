"""The model backend interface: what a worker needs from a model.

A backend receives a batch of ``WorkItem``s whose tensors are already on the
backend's device (the worker copied them out of the arena and released the
arena space), and yields ``BackendEvent``s as output becomes available, so the
worker can stream each one back before the batch is done.

Preprocessing is *not* here: the frontend runs it (gateway/preprocess/)
and the worker only ever sees tensors. A backend never touches shared memory.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from shmgate.shared.wire import SamplingParams, TokenLogprob

__all__ = ["DEFAULT_BATCH_SIZE", "BackendEvent", "ModelBackend", "WorkItem", "batch_size_for"]


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


@dataclass
class BackendEvent:
    """A piece of output for ``batch[index]``.

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
    # Called by a generative backend after each forward pass; the worker sets it to stamp its
    # progress there, so a long generation that yields no text for a while never reads as a hang.
    on_step: Callable[[], None] = staticmethod(_no_progress)

    @abc.abstractmethod
    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        """Run one batch and yield its output as it is produced.

        Raises: any exception fails every unfinished item of the batch with a
        server error; the worker survives it.
        """


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
