"""The language model's linear layers packed for oneDNN on CPU (worker/generation/cpu_linear.py): the same
outputs as ``nn.Linear`` to rounding, for any leading shape, with and without bias, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from shmgate.worker.generation.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_the_plain_one_does(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    packed = PackedLinear(plain)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for shape in ((1, 96), (8, 96), (1, 5, 96), (2, 3, 96)):
            x = torch.randn(shape).to(dtype)
            want, got = plain(x), packed(x)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_pack_linears_swaps_every_linear_under_a_module_and_nothing_else() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.SiLU(),
        torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False), torch.nn.LayerNorm(32)),
        torch.nn.Linear(32, 8),
    )
    x = torch.randn(4, 16)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 3
        got = model(x)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 3
    assert isinstance(model[2][1], torch.nn.LayerNorm)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
