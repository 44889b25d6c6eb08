"""Input normalisation of EfficientNet-Lite0: the fused (compiled) form equals the eager one.

Workers normalise eagerly; with --compile-normalise they compile it into one kernel. Here the
compiled wrapper is exercised on CPU with torch.compile's "aot_eager" backend (the same
tracing, no code generation), and its fallback with a backend that fails. The Inductor
kernel itself is compared on CUDA only (skipped without a GPU).
"""

from __future__ import annotations

import logging

import pytest
import torch

from shmgate.worker.backends.efficientnet import FusedNormaliser, make_normaliser, normalise

TOLERANCE = 1e-6  # values lie in [-1, 1]; a float32 ulp there is at most 1.2e-7


def _pixels(n: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8, generator=g).to(device)


def _check(out: torch.Tensor, pixels: torch.Tensor) -> None:
    reference = pixels.to(torch.float64) / 127.5 - 1.0
    assert out.dtype == torch.float32 and out.shape == pixels.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=TOLERANCE)


def test_eager_normalisation_is_x_over_127_5_minus_1_in_channels_last() -> None:
    pixels = _pixels(3)
    out = normalise(pixels)
    _check(out, pixels)
    assert out.min().item() >= -1.0 and out.max().item() <= 1.0
    edge = normalise(torch.tensor([0, 255], dtype=torch.uint8).reshape(1, 1, 1, 2).expand(1, 3, 1, 2))
    assert edge[0, 0, 0].tolist() == [-1.0, 1.0]


def test_cpu_workers_use_the_eager_function() -> None:
    assert make_normaliser(torch.device("cpu")) is normalise


def test_cuda_workers_normalise_eagerly_unless_asked_to_compile() -> None:
    # Compiling costs every worker's start for ~1 % of a batch (worker/backends/efficientnet.py).
    assert make_normaliser(torch.device("cuda", 0)) is normalise


def test_compiling_without_a_c_compiler_says_so_and_stays_eager(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # the slim image: no cc, no gcc
    with caplog.at_level(logging.WARNING, logger="shmgate.worker.efficientnet"):
        assert make_normaliser(torch.device("cuda", 0), compile=True) is normalise
    assert "no C compiler" in caplog.text


def test_compiled_normalisation_equals_eager_for_every_batch_size() -> None:
    fused = FusedNormaliser(backend="aot_eager")
    with torch.inference_mode():
        for n in (1, 2, 5, 8):
            pixels = _pixels(n, seed=n)
            out = fused(pixels)
            _check(out, pixels)
            torch.testing.assert_close(out, normalise(pixels), rtol=0, atol=TOLERANCE)
    assert fused.fused, "the compiled path fell back to eager"


def test_a_compiler_that_fails_falls_back_to_eager_with_the_same_result(caplog: pytest.LogCaptureFixture) -> None:
    def broken_backend(graph: object, inputs: object) -> object:
        raise RuntimeError("no compiler here")

    fused = FusedNormaliser(backend=broken_backend)
    pixels = _pixels(2)
    with torch._dynamo.config.patch(suppress_errors=False):
        out = fused(pixels)
    assert not fused.fused
    assert "fused normalisation unavailable" in caplog.text
    assert torch.equal(out, normalise(pixels))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Inductor kernel needs a CUDA device")
def test_fused_cuda_kernel_equals_eager_on_the_gpu() -> None:
    device = torch.device("cuda")
    fused = make_normaliser(device, compile=True)
    assert isinstance(fused, FusedNormaliser) and fused.fused
    with torch.inference_mode():
        for n in (1, 3, 8):
            pixels = _pixels(n, "cuda", seed=n)
            out = fused(pixels)
            _check(out, pixels)
            torch.testing.assert_close(out, normalise(pixels), rtol=0, atol=TOLERANCE)
