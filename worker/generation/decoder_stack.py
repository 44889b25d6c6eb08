"""One paged step through a language model's decoder layers, without transformers' per-module machinery.

Why: transformers' forward does per-layer work beside the kernels (module calls and their hooks, keyword
plumbing, the attention interface's lookup, output records; per step the mask mapping and the rotary table).
``DecoderStack`` runs the same weights and the same arithmetic in a plain loop: the model's own rotary module
computes the step's cos and sin once (multimodal RoPE included: it is the family's module), each layer's
projections are its own modules' ``forward`` (packed oneDNN weights on CPU, cpu_linear.py), attention is
paged.py's over the rows' blocks. Only the logits the step samples from are computed. Measured with the
output processor's batched greedy picks that came with it (the 8-layer checkpoint, one thread, CPU time a
paged step, A B B A against the tree before both): 1 row 6.20-6.32 -> 5.61-5.89 ms, 8 rows 10.1-10.3 ->
9.4-10.9 ms (no difference in the noise), 32 rows 28.1-28.6 -> 23.1-23.6 ms (docs/BENCHMARKS.md, "The plain
decoder loop, measured"). At a few rows the step is the weights streamed from memory, which no loop changes.

It serves the decoder shape most chat families' text models share (Qwen2, Qwen2-VL, Qwen2.5-VL, Llama):
RMSNorm before attention and MLP, q/k/v/o projections, rotary positions, a SiLU-gated MLP, every layer full
attention. ``DecoderStack.of`` returns None for any other shape (extra norms, sliding windows, another
activation), and the runner then calls the model's own forward. tests/test_paged_engine.py checks that its
answers equal transformers' ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shmgate.worker.generation.paged import PagedStep, paged_attention

__all__ = ["DecoderStack"]

_LAYER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, read once from the model."""

    attention: Any  # the model's attention module: paged_attention reads its layer_idx
    q: Any
    k: Any
    v: Any
    o: Any
    gate: Any
    up: Any
    down: Any
    norm_in: torch.Tensor
    norm_mid: torch.Tensor
    eps: float


def _rms_weight(norm: Any) -> tuple[torch.Tensor, float] | None:
    """An RMSNorm's weight and epsilon, when ``norm`` is transformers' plain RMSNorm (weight times x over rms)."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or eps is None or "RMSNorm" not in type(norm).__name__:
        return None
    if "Gemma" in type(norm).__name__:  # Gemma's scales by 1 + weight
        return None
    return weight.detach(), float(eps)


class DecoderStack:
    """The text model's layers, final norm and output head, run as one loop over a paged step."""

    def __init__(self, text_model: Any, head: Any, layers: list[_Layer], norm: torch.Tensor, eps: float) -> None:
        self._rotary = text_model.rotary_emb
        self._head = head
        self._layers = layers
        self._norm = norm
        self._eps = eps
        attention = layers[0].attention
        self._heads = attention.config.num_attention_heads
        self._kv_heads = attention.config.num_key_value_heads
        self._head_dim = attention.head_dim
        self._scaling = attention.scaling

    @classmethod
    def of(cls, model: Any) -> DecoderStack | None:
        """The stack of ``model``'s language model, or None when its layers are not of the shape it serves."""
        text = model.get_decoder()
        head = model.get_output_embeddings()
        config = getattr(text, "config", None)
        if config is None or not hasattr(text, "rotary_emb") or head is None or not hasattr(text, "norm"):
            return None
        if getattr(config, "hidden_act", None) != "silu" or set(getattr(config, "layer_types", None) or ()) - {
            "full_attention"
        }:
            return None
        final = _rms_weight(text.norm)
        if final is None:
            return None
        layers: list[_Layer] = []
        for layer in text.layers:
            if any(not hasattr(layer, part) for part in _LAYER_PARTS):
                return None
            attention, mlp = layer.self_attn, layer.mlp
            if any(not hasattr(attention, part) for part in _ATTENTION_PARTS) or any(
                not hasattr(mlp, part) for part in _MLP_PARTS
            ):
                return None
            if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):  # Qwen3's norms on q and k
                return None
            norm_in, norm_mid = _rms_weight(layer.input_layernorm), _rms_weight(layer.post_attention_layernorm)
            if norm_in is None or norm_mid is None or norm_in[1] != norm_mid[1]:
                return None
            layers.append(
                _Layer(
                    attention,
                    attention.q_proj.forward,
                    attention.k_proj.forward,
                    attention.v_proj.forward,
                    attention.o_proj.forward,
                    mlp.gate_proj.forward,
                    mlp.up_proj.forward,
                    mlp.down_proj.forward,
                    norm_in[0],
                    norm_mid[0],
                    norm_in[1],
                )
            )
        if not layers:
            return None
        return cls(text, head.forward, layers, final[0], final[1])

    def _rms(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # transformers' RMSNorm: in float32, then back to the input's dtype before the weight
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)

    def __call__(
        self, embeds: torch.Tensor, positions: torch.Tensor, step: PagedStep, keep: torch.Tensor
    ) -> torch.Tensor:
        """``embeds [1, tokens, hidden]`` at ``positions`` (the model's rotary module's shape); return the
        logits of the tokens ``keep`` names, ``[len(keep), vocab]``."""
        x = embeds[0]
        tokens = x.shape[0]
        cos, sin = self._rotary(embeds, positions)  # [1, tokens, head_dim]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [tokens, 1, head_dim]
        half = self._head_dim // 2
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim

        def rope(t: torch.Tensor) -> torch.Tensor:
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

        for layer in self._layers:
            h = self._rms(x, layer.norm_in, layer.eps)
            q = rope(layer.q(h).view(tokens, heads, dim))
            k = rope(layer.k(h).view(tokens, kv_heads, dim))
            v = layer.v(h).view(tokens, kv_heads, dim)
            attended, _ = paged_attention(
                layer.attention,
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                step,
                scaling=self._scaling,
            )
            x = x + layer.o(attended.reshape(tokens, heads * dim))
            h = self._rms(x, layer.norm_mid, layer.eps)
            x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
        last = self._rms(x.index_select(0, keep), self._norm, self._eps)
        logits: torch.Tensor = self._head(last)
        return logits
