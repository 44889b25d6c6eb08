"""Structured outputs in the worker: a grammar's mask on every token a constrained row samples.

The frontend turns ``response_format`` into a grammar (gateway/structured.py) and sends it in the
request's ``SamplingParams.grammar``. Here each constrained row gets its own matcher, which says, before
every sampling, which tokens keep the output inside the grammar: the others' logits become -inf, in the
row's own sampling pass (worker/generation/engine.py ``_pick``), so constrained and free rows share a batch
and the engine's steps. A row ends with "stop" the token its grammar completes on; the model's EOS is
allowed only where the grammar may end. llguidance (an ``hf`` extra) computes the masks: it runs on the
CPU and needs neither triton nor a CUDA build of torch; it is imported on a model's first constrained
row, never by a worker that serves none.

Invariants:
1. A constrained row never samples a token its grammar refuses: the mask is applied to the logits
   after ``logit_bias`` and the penalties and before the temperature, greedy picks included.
2. A grammar is compiled once per model (an LRU of matchers by grammar text, copied for each row).
3. A matcher that errs (a token it refused was taken anyway: a bug) ends only its row, as an error.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from shmgate.shared.errors import ModelError

__all__ = ["GrammarConstraints", "RowConstraint"]

# Distinct grammars kept compiled per model (a schema is one grammar; clients reuse a few).
COMPILED_GRAMMARS = 64
COMPILED_GRAMMAR_BYTES = 8 << 20  # [memory gauges] and their texts' bytes (a generated schema can be large)


class RowConstraint:
    """One row's matcher and its bitmask buffer (host memory; the mask is copied to the logits' device)."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        from llguidance.torch import allocate_token_bitmask

        self._matcher = matcher
        self._bitmask = allocate_token_bitmask(1, vocab)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1-D) with every token the grammar refuses next at -inf (a new tensor).

        The bitmask (bit ``i`` of 32-bit word ``w`` allows token ``32 w + i``) is unpacked with numpy:
        llguidance's own torch helper (``apply_token_bitmask_inplace``) spreads it with
        ``repeat_interleave``: 6.0 ms a row per token against 43 us here, fill included (vocab 455, one
        torch thread, docs/BENCHMARKS.md "What a response_format grammar costs")."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask)
        width = logits.shape[-1]
        allowed = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[:width]
        refused = torch.from_numpy(allowed == 0)
        masked = logits.float().clone()  # the batch's logits stay as they are for the other rows
        masked[: refused.shape[0]].masked_fill_(refused.to(masked.device, non_blocking=True), float("-inf"))
        masked[refused.shape[0] :] = float("-inf")  # ids past the tokenizer's: never
        return masked

    def accept(self, token: int) -> None:
        """Advance past the sampled ``token``. Raises ModelError if the grammar refuses it (invariant 3)."""
        if not self._matcher.consume_token(token):
            raise ModelError(f"the output left its response_format grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more: the row ends here."""
        return bool(self._matcher.is_stopped())


class GrammarConstraints:
    """A model's grammar compiler: its tokenizer as llguidance reads it, and compiled grammars by text."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        """``vocab``: the width of the model's logits (may exceed the tokenizer's ids)."""
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self._vocab = max(vocab, self._tokenizer.vocab_size)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        # [memory gauges] worker/cache_gauges.py: what a compiled grammar costs inside llguidance is not
        # visible, so the bytes counted (and bounded) are the grammar texts the cache is keyed by.
        self.held_bytes = 0
        self.max_bytes = COMPILED_GRAMMAR_BYTES
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._compiled)

    def start(self, grammar: str) -> RowConstraint:
        """A fresh matcher for one row. Raises ModelError for a grammar llguidance refuses (the frontend
        checked it already, so this is a version mismatch or a bug, and fails the row alone)."""
        import llguidance

        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizer, grammar)
            if compiled.is_error():
                raise ModelError(f"response_format grammar refused: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            self.held_bytes += len(grammar)  # [memory gauges]
            while len(self._compiled) > COMPILED_GRAMMARS or (
                self.held_bytes > self.max_bytes and len(self._compiled) > 1
            ):
                old, _ = self._compiled.popitem(last=False)
                self.held_bytes -= len(old)  # [memory gauges]
                self.evictions += 1
        self._compiled.move_to_end(grammar)
        return RowConstraint(compiled.deep_copy(), self._vocab)
