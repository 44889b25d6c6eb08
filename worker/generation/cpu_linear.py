"""The language model's linear layers through oneDNN with weights packed once, on CPU.

Why: a decode step multiplies a few rows (one token per running request) by every weight of the language
model. For so few rows MKL's sgemm, which ``nn.Linear`` calls, reads the weight in its plain layout at about
half the speed oneDNN reaches with the weight reordered once into its own blocked layout (measured on this
project's 2-core CI machine, one thread, a 512x1376 weight, 40 of them so they come from memory: 1 row
188-192 -> 104-116 us, 8 rows 306-322 -> 125-127 us, 32 rows 624-651 -> 277-288 us; ``python -m bench
kernel-costs``). vLLM's CPU engine packs its weights the same way (its ``onednn_mm``).

``pack_linears`` swaps each ``nn.Linear`` under a module for a ``PackedLinear`` holding only the packed weight
(the plain one is dropped). Memory: the packed copy is the process's own; the checkpoint's file pages read to
pack it stay mapped (transformers maps the whole file and the other weights still point into it), so they
count in the worker's RSS as clean page cache, which the kernel reclaims under pressure and shares among
the workers of one checkpoint (12-layer 1024-wide checkpoint: 770 MB anonymous and 613 MB file-backed
after loading). The vision tower keeps its layers: it runs hundreds of patches at once, where sgemm is at
its best. Results equal ``nn.Linear``'s to rounding (another
summation order: ~1e-6 relative in float32).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PackedLinear", "can_pack", "pack_language_model", "pack_linears"]

# rows the packing is tuned for: oneDNN picks its blocking for this batch, and serves any other
_TUNED_ROWS = 32


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN serves this device and dtype (torch's CPU builds for x86 and arm64 include it)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward over a weight packed for oneDNN."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _TUNED_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_language_model(model: Any) -> int:
    """Pack a transformers model's language model and output head (not its vision tower); return how many
    layers were packed."""
    checked: dict[tuple[Any, ...], bool] = {}
    swapped = pack_linears(model.get_decoder(), checked)
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and (packed := _packed(head, checked)) is not None:
        model.set_output_embeddings(packed)
        swapped += 1
    return swapped


def pack_linears(module: torch.nn.Module, _checked: dict[tuple[Any, ...], bool] | None = None) -> int:
    """Swap every ``nn.Linear`` under ``module`` for a ``PackedLinear``; return how many were swapped. The first
    layer of each shape is checked against its plain self on a probe: a build or CPU whose oneDNN lacks the
    kernel, or computes otherwise, keeps the plain layers."""
    checked = {} if _checked is None else _checked
    swapped = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            packed = _packed(child, checked)
            if packed is not None:
                setattr(module, name, packed)
                swapped += 1
        else:
            swapped += pack_linears(child, checked)
    return swapped


def _packed(linear: torch.nn.Linear, checked: dict[tuple[Any, ...], bool]) -> PackedLinear | None:
    """``linear`` packed, or None when oneDNN cannot pack it or the first of its shape disagreed with it."""
    kind = (linear.in_features, linear.out_features, linear.weight.dtype, linear.bias is not None)
    try:
        packed = PackedLinear(linear)
    except RuntimeError:
        return None
    if kind not in checked:
        checked[kind] = _agrees(linear, packed)
    return packed if checked[kind] else None


def _agrees(linear: torch.nn.Linear, packed: PackedLinear) -> bool:
    """``packed`` computes what ``linear`` does, to rounding, on a probe."""
    try:
        with torch.inference_mode():
            probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(packed.dtype)
            want, got = linear(probe).float(), packed(probe).float()
    except RuntimeError:
        return False
    tolerance = 1e-4 if packed.dtype == torch.float32 else 3e-2
    return bool((got - want).abs().max().item() <= tolerance * (want.abs().max().item() + 1e-6))
