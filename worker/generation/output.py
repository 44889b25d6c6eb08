"""The output processor: from a step's logits to each row's events (sampling, grammar masks, logprobs,
detokenising, stop strings, usage), apart from the scheduler and the model.

``sample`` picks every row's next token with one host sync for all of them; ``accept`` takes a token into
its row (its penalties' counts, its grammar, its text held back while a stop string may start) and says
whether the row ended; ``finish`` ends a row with its last text and usage. A row's own fault (logits that
are not finite, a grammar that refuses the token, a sampler that raises) ends that row alone with an error
event; its step mates go on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from shmgate.shared.errors import ModelError
from shmgate.shared.wire import MAX_LOGPROB_TOKEN_CHARS, MIN_TEMPERATURE, TokenLogprob
from shmgate.worker.backends.base import BackendEvent
from shmgate.worker.constraints import GrammarConstraints, RowConstraint
from shmgate.worker.generation.rows import Row
from shmgate.worker.generation.sampling import guarded_pick, to_host

__all__ = ["OutputProcessor"]

log = logging.getLogger("shmgate.worker.hf")


class OutputProcessor:
    """Sampling and text for the rows of one model (its tokenizer, vocabulary and end tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer: Any = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = eos_token_ids
        self._grammars: GrammarConstraints | None = None  # built on the first response_format row

    def sample(self, rows: Sequence[Row], logits: torch.Tensor) -> list[BackendEvent]:
        """Pick and take each row's next token (one host sync for them all); a row whose logits are not
        finite ends alone with an error. Greedy rows without penalties, grammar or logprobs (most rows)
        are picked together, a few tensor operations for all of them; the others one by one."""
        picks: list[torch.Tensor] = [torch.zeros(2, dtype=torch.long, device=logits.device)] * len(rows)
        faults: dict[int, Exception] = {}
        greedy = [i for i, row in enumerate(rows) if self._plain_greedy(row)]
        done: set[int] = set()
        if len(greedy) > 1:
            try:
                together = _greedy_picks([rows[i] for i in greedy], logits, greedy)
            except Exception:  # noqa: BLE001  (each row again on its own: a fault ends only its row)
                together = None
            if together is not None:
                for i, pick in zip(greedy, together):
                    picks[i] = pick
                done.update(greedy)
        for i, (row, row_logits) in enumerate(zip(rows, logits)):
            if i in done:
                continue
            try:
                picks[i] = self.pick(row, row_logits)
            except Exception as exc:  # a sampling fault no check foresaw ends that row alone
                faults[row.index] = exc
        picked = to_host(picks)
        events: list[BackendEvent] = []
        for row, (token, ok) in zip(rows, picked):
            if row.index in faults:
                log.warning("row %s: sampling failed: %r", row.index, faults[row.index])
                row.finish, row.cache = "error", None
                events.append(BackendEvent(row.index, error=ModelError(f"sampling failed: {faults[row.index]}")))
                continue
            if not ok:
                row.finish, row.cache = "error", None
                events.append(
                    BackendEvent(row.index, error=ModelError("the model's output for this request was not finite"))
                )
                continue
            try:
                events += self.accept(row, token)
            except ModelError as exc:  # a row's own fault (its grammar refused the token): it ends alone
                row.finish, row.cache = "error", None
                events.append(BackendEvent(row.index, error=exc))
        return events

    @staticmethod
    def _plain_greedy(row: Row) -> bool:
        """``pick`` of this row is argmax over its logits plus its bias (no penalties, grammar or logprobs)."""
        params = row.item.params
        return (
            params.temperature < MIN_TEMPERATURE
            and row.counts is None
            and row.constraint is None
            and params.logprobs < 0
        )

    @property
    def grammars(self) -> GrammarConstraints | None:
        """The compiled grammars' cache (None until the first response_format row); /metrics gauges it."""
        return self._grammars

    def constraint(self, grammar: str) -> RowConstraint:
        """A row's grammar matcher; the model's compiler is built on its first constrained row."""
        if self._grammars is None:
            self._grammars = GrammarConstraints(self.tokenizer, self.vocab_size)
        return self._grammars.start(grammar)

    def pick(self, row: Row, logits: torch.Tensor) -> torch.Tensor:
        """The row's next token and whether its logits were finite, as ``[token, ok]`` on the device (no sync).

        ``logit_bias`` and the penalties act on the logits first, as in OpenAI's definition:
        ``logit[j] += bias[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty``,
        where ``count`` counts the row's generated tokens (not the prompt's). A per-row constraint
        (a grammar's mask) belongs here too, beside the bias.
        """
        params = row.item.params
        if row.bias is not None or row.counts is not None:
            logits = logits.float()
            if row.bias is not None:
                logits = logits + row.bias
            if row.counts is not None:
                logits = (
                    logits - row.counts * params.frequency_penalty - (row.counts > 0).float() * params.presence_penalty
                )
        if row.constraint is not None:  # structured outputs: tokens the grammar refuses go to -inf
            logits = row.constraint.mask(logits)
        if params.logprobs >= 0:
            row.logprobs = torch.log_softmax(logits.float(), dim=-1)
        token, ok = guarded_pick(logits, params.temperature, params.top_p, row.generator)
        return torch.stack([token.reshape(()).long(), ok.long()])

    def accept(self, row: Row, token: int) -> list[BackendEvent]:
        """Take the row's sampled ``token``; return its text, and the end if it ended."""
        row.completion_tokens += 1
        row.token = token
        row.generated.append(token)  # a preempted row's prefill recomputes them
        if row.counts is not None:
            row.counts[token] += 1
        first: list[BackendEvent] = []
        if row.logprobs is not None:
            first.append(BackendEvent(row.index, logprob=self.logprob(row.logprobs, token, row.item.params.logprobs)))
            row.logprobs = None
        if row.constraint is not None:
            row.constraint.accept(token)  # raises ModelError if the grammar refused it: sample fails the row
        if token in self.eos_token_ids or token in row.item.params.stop_token_ids:
            return first + self.finish(row, "stop")
        text = row.stops.push(row.detok.push(token))
        events = first + ([BackendEvent(row.index, text=text)] if text else [])
        if row.stops.stopped or (row.constraint is not None and row.constraint.finished):
            return events + self.finish(row, "stop")
        if row.completion_tokens >= row.limit:  # no forward pass for a token nobody will read
            return events + self.finish(row, "length")
        return events

    def logprob(self, logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        """The sampled token's log-probability and the ``top`` likeliest (one host sync, rows asking only).

        The distribution is the model's after ``logit_bias`` and the penalties, before temperature and
        top_p (vLLM's default, "raw" log-probabilities of the processed logits).
        """
        values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
        chosen, top_values, top_ids = float(logprobs[token]), values.tolist(), ids.tolist()
        return TokenLogprob(
            self.token_text(token), chosen, tuple((self.token_text(i), v) for i, v in zip(top_ids, top_values))
        )

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))[:MAX_LOGPROB_TOKEN_CHARS]

    def finish(self, row: Row, reason: str) -> list[BackendEvent]:
        """End the row: release held-back text (unless a stop string cut it) and report usage."""
        row.finish = reason
        row.cache = row.prefill = None
        tail = ""
        if not row.stops.stopped:  # EOS, length or cancel: release what was held back
            tail = row.stops.push(row.detok.flush())
            tail += row.stops.flush()
        events = [BackendEvent(row.index, text=tail)] if tail else []
        events.append(
            BackendEvent(
                row.index,
                finish_reason=reason,
                prompt_tokens=row.prompt_tokens,
                completion_tokens=row.completion_tokens,
            )
        )
        return events


def _greedy_picks(rows: Sequence[Row], logits: torch.Tensor, where: Sequence[int]) -> torch.Tensor:
    """``[token, ok]`` of greedy rows (their logits ``logits[where]``) as ``pick`` gives them one by one:
    argmax over the logits plus the row's bias, ok when no logit is NaN or +inf and one is finite."""
    index = torch.tensor(list(where), dtype=torch.long, device=logits.device)
    block = logits.index_select(0, index).float()
    for k, row in enumerate(rows):
        if row.bias is not None:
            block[k] += row.bias
    ok = ~torch.isnan(block).any(-1) & ~torch.isposinf(block).any(-1) & torch.isfinite(block).any(-1)
    return torch.stack([torch.argmax(block, dim=-1), ok.long()], dim=1)
