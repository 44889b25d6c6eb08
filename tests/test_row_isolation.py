"""Rows are isolated: one request whose numbers go wrong fails alone, its batch mates finish untouched.

Backend level: ``HFBackend.run`` on a batch where one row's pixels are NaN (so its logits are),
or whose sampling parameters no frontend would send. The served path (a real ``shmgate serve``)
is tests/test_hostile_inputs.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.shared.errors import ModelError  # noqa: E402
from shmgate.shared.wire import SamplingParams  # noqa: E402
from shmgate.worker.backends.base import BackendEvent, WorkItem  # noqa: E402
from shmgate.worker.backends.hf import HFBackend, guarded_pick, sample_token  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, work_item  # noqa: E402


@pytest.fixture(scope="module")
def pre(tiny_qwen2_vl_dir: Path) -> HFPreprocessor:
    return HFPreprocessor(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def backend(tiny_qwen2_vl_dir: Path) -> Iterator[HFBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFBackend(str(tiny_qwen2_vl_dir), torch.device("cpu"))
    torch.set_num_threads(threads)


def _failure(events: list[BackendEvent], index: int) -> BackendEvent:
    mine = [e for e in events if e.index == index]
    assert len(mine) == 1 and mine[0].finish_reason is None, "a failed row ends with exactly one error event"
    assert isinstance(mine[0].error, ModelError)
    return mine[0]


def _with_nan_pixels(item: WorkItem) -> WorkItem:
    pixels = [torch.full_like(p, float("nan")) for p in item.tensors["pixel_values"]]
    return WorkItem(item.request_id, {**item.tensors, "pixel_values": pixels}, item.params, inline=item.inline)


@pytest.mark.parametrize(
    ("mate_temperature", "bad_temperature"),
    [(0.8, 1.0), (0.0, 0.0)],
    ids=["sampled", "greedy rows picked together"],
)
def test_a_row_with_nan_logits_fails_alone_and_its_mates_answer_as_when_alone(
    pre: HFPreprocessor, backend: HFBackend, mate_temperature: float, bad_temperature: float
) -> None:
    mates = [
        work_item(pre, "Describe it.", [WIDE], SamplingParams(max_tokens=10, temperature=mate_temperature, seed=3), 1),
        work_item(pre, "Square.", [SQUARE], SamplingParams(max_tokens=12, temperature=0.0), 3),
    ]
    bad_params = SamplingParams(max_tokens=12, temperature=bad_temperature)
    bad = _with_nan_pixels(work_item(pre, "NaN me.", [SQUARE], bad_params, 2))
    alone = [answer(list(backend.run([item]))) for item in mates]
    events = list(backend.run([mates[0], bad, mates[1]]))
    assert "not finite" in str(_failure(events, 1).error)
    together = [answer(events, 0), answer(events, 2)]
    for (text_alone, end_alone), (text, end) in zip(alone, together):
        assert text == text_alone
        assert (end.finish_reason, end.completion_tokens) == (end_alone.finish_reason, end_alone.completion_tokens)


def test_a_tiny_temperature_is_greedy_in_the_worker_too(pre: HFPreprocessor, backend: HFBackend) -> None:
    # Descriptors are distrusted: a temperature that overflows logits / temperature samples greedily.
    greedy = work_item(pre, "Hi", [WIDE], SamplingParams(max_tokens=8, temperature=0.0), 1)
    tiny = work_item(pre, "Hi", [WIDE], SamplingParams(max_tokens=8, temperature=1e-300), 2)
    events = list(backend.run([greedy, tiny]))
    assert answer(events, 0)[0] == answer(events, 1)[0]


def test_the_pick_flags_a_distribution_that_is_not_finite_and_never_samples_it() -> None:
    generator = torch.Generator().manual_seed(0)
    assert bool(guarded_pick(torch.tensor([0.0, 1.0]), 1.0, 1.0, generator)[1])
    assert not bool(guarded_pick(torch.tensor([float("nan"), 1.0]), 1.0, 1.0, generator)[1])
    # finite logits whose division by a (permitted) small temperature overflows float32
    assert not bool(guarded_pick(torch.tensor([3e38, 0.0]), 1e-4, 1.0, generator)[1])
    assert sample_token(torch.tensor([0.0, 5.0, 1.0]), 1e-300, 1.0, torch.Generator().manual_seed(0)) == 1


def test_a_row_whose_sampling_raises_fails_alone(
    pre: HFPreprocessor, backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sampling failure no check foresaw, injected into one row's pick: that row ends, its mate runs on.
    from shmgate.worker.generation import output as hf  # the output processor samples each row

    real = hf.guarded_pick

    def pick(
        logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if temperature == 0.5:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, temperature, top_p, generator)

    monkeypatch.setattr(hf, "guarded_pick", pick)
    good = work_item(pre, "Hi", [WIDE], SamplingParams(max_tokens=6, temperature=0.0), 1)
    bad = work_item(pre, "Hi", [SQUARE], SamplingParams(max_tokens=6, temperature=0.5), 2)
    alone = answer(list(backend.run([good])))[0]
    events = list(backend.run([good, bad]))
    assert "sampling failed" in str(_failure(events, 1).error)
    assert answer(events, 0)[0] == alone
