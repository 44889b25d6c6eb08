"""The start-up GPU memory check: its arithmetic on real (tiny) checkpoints and stated GPU sizes, on CPU.

The CUDA query itself (``cuda_free_bytes``) needs a GPU; the last test runs it where one is visible.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open

from shmgate.node import gpu_fit
from shmgate.node.cli import parse_config
from shmgate.node.config import ServeConfig
from shmgate.node.gpu_fit import (
    CUDA_OVERHEAD_BYTES,
    GpuNeed,
    PlacedModel,
    WorkerNeed,
    checkpoint_parameters,
    hf_need,
    misfits,
)
from tests.embed_fixture import build_tiny_embedder


def _misfits(argv: list[str], free: dict[str, int]) -> list[str]:
    from shmgate.node.plan import gpu_misfits

    config = parse_config(argv)
    assert isinstance(config, ServeConfig)
    return gpu_misfits(config, free=free)


def _numel_by_loading(model_dir: Path) -> int:
    """The floating-point values of every tensor, counted by opening each one (the slow way)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    total += tensor.numel()
    return total


def test_parameters_from_the_headers_match_the_tensors(tiny_vlm: Callable[[str], Path]) -> None:
    model_dir = tiny_vlm("qwen2_vl")
    floats, _ = checkpoint_parameters(model_dir)
    assert floats == _numel_by_loading(model_dir) > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_weights_estimate_is_what_the_loaded_model_holds(tiny_vlm: Callable[[str], Path], dtype: str) -> None:
    """The worker's own load (from_pretrained at the dtype, as worker/backends/hf.py does), on CPU: its
    parameters take the bytes the estimate says (a GPU holds the same tensors)."""
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_vlm("qwen2_vl")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    need = hf_need(model_dir, dtype_bytes=gpu_fit.DTYPE_BYTES[dtype], max_batch_size=1, chat=True)
    assert need.weights == held


def test_a_sharded_checkpoint_counts_the_shards_its_index_names_once(
    tiny_vlm: Callable[[str], Path], tmp_path: Path
) -> None:
    """Shards named by model.safetensors.index.json, beside a consolidated copy of the same weights."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_vlm("qwen2_vl") / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / shard))
    save_file(tensors, str(tmp_path / "consolidated.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: shard for shard, keys in halves.items() for k in keys}})
    )
    floats, _ = checkpoint_parameters(tmp_path)
    assert floats == sum(t.numel() for t in tensors.values() if t.is_floating_point())


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        checkpoint_parameters(tmp_path)


def test_a_chat_model_needs_its_weights_at_the_load_dtype_and_a_full_batch_of_kv_cache(
    tiny_vlm: Callable[[str], Path],
) -> None:
    model_dir = tiny_vlm("qwen2_vl")
    floats = _numel_by_loading(model_dir)
    text = json.loads((model_dir / "config.json").read_text()).get("text_config") or json.loads(
        (model_dir / "config.json").read_text()
    )
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_per_token = 2 * text["num_hidden_layers"] * text.get("num_key_value_heads", heads) * head_dim

    bf16_one = hf_need(model_dir, dtype_bytes=2, max_batch_size=1, chat=True)
    bf16_four = hf_need(model_dir, dtype_bytes=2, max_batch_size=4, chat=True)
    fp32_one = hf_need(model_dir, dtype_bytes=4, max_batch_size=1, chat=True)
    assert bf16_one.weights == 2 * floats and fp32_one.weights == 4 * floats
    # the KV cache is part of the activations and grows with the batch: 3 more sequences of max_model_len
    kv_one_sequence = text["max_position_embeddings"] * kv_per_token * 2
    assert bf16_four.activations - bf16_one.activations >= 3 * kv_one_sequence
    assert bf16_one.activations >= kv_one_sequence
    # a larger pixel budget in the processor kwargs means more patches per image, so more activations
    assert (
        hf_need(model_dir, dtype_bytes=2, max_batch_size=1, chat=True, max_pixels=4 * 25088).activations
        > bf16_one.activations
    )
    # an embedding-style reading of the same checkpoint (no generation) keeps no KV cache
    assert hf_need(model_dir, dtype_bytes=2, max_batch_size=1, chat=False).activations < bf16_one.activations


def test_an_embedding_model_counts_its_vision_tower_per_image(tmp_path: Path) -> None:
    model_dir = build_tiny_embedder("siglip", tmp_path / "siglip")
    one = hf_need(model_dir, dtype_bytes=2, max_batch_size=1, chat=False)
    eight = hf_need(model_dir, dtype_bytes=2, max_batch_size=8, chat=False)
    assert one.weights == 2 * _numel_by_loading(model_dir)
    assert one.activations > 0 and eight.activations == 8 * one.activations


def test_the_classifier_counts_the_padded_pass_its_cuda_worker_runs() -> None:
    per_image = gpu_fit.classifier_need(__file__, max_batch_size=1).activations // 8  # padded to 8 images
    assert [
        gpu_fit.classifier_need(__file__, max_batch_size=n).activations // per_image for n in (0, 1, 8, 9, 16, 17)
    ] == [8, 8, 8, 16, 16, 32]


def test_models_sharing_a_gpu_that_fit_alone_but_not_together_are_named_with_their_needs() -> None:
    a = GpuNeed("classifier", "0", 1, WorkerNeed(weights=3 << 30, activations=1 << 30))
    b = GpuNeed("captioner", "0", 2, WorkerNeed(weights=4 << 30, activations=1 << 30))
    elsewhere = GpuNeed("embedder", "1", 1, WorkerNeed(weights=1 << 30, activations=0))
    free = {"0": b.total + (1 << 30), "1": 80 << 30}
    assert misfits([a], free) == [] and misfits([b], free) == []
    (line,) = misfits([a, b, elsewhere], free)
    assert line.startswith(
        f"GPU 0: the models placed on it need {(a.total + b.total) / (1 << 30):.2f} GiB, "
        f"{free['0'] / (1 << 30):.2f} GiB is free"
    )
    assert "'classifier'" in line and "'captioner'" in line and "2 x [weights 4.00 GiB" in line
    assert "embedder" not in line
    assert misfits([a, b], {"0": a.total + b.total}) == []  # exactly enough fits
    assert misfits([a, b], {}) == []  # a GPU not visible from here is the workers' to find out


def test_serve_refuses_naming_the_model_the_gpu_and_the_bytes(
    tiny_vlm: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shmgate serve``'s check for two models on GPU 0 of a stated size: the classifier alone fits, with a chat
    model it does not. The plan (placements from the flags) and the arithmetic are the ones ``main`` runs, which
    prints the first line and exits 2; only the free bytes are stated instead of asked of CUDA."""
    model_dir = tiny_vlm("qwen2_vl")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # the flags' default bounds of the worker's encoder and prefix caches (256 MiB each) count too
    chat = gpu_fit.worker_need(f"hf:{model_dir}", dtype="auto", max_batch_size=0, cache_bytes=512 << 20)
    classifier = gpu_fit.worker_need("efficientnet-lite0", dtype="auto", max_batch_size=0)
    assert classifier.weights > 10 << 20 and classifier.overhead == CUDA_OVERHEAD_BYTES  # the real weights file
    assert chat.caches == 512 << 20 and classifier.caches == 0
    assert chat.total - chat.caches < 1 << 30  # a tiny checkpoint needs little
    stated = classifier.total + chat.total // 2

    both = ["serve", "--model", "efficientnet-lite0", "--model", f"hf:{model_dir}", "--device", "cuda:0"]
    (line,) = _misfits(both, free={"0": stated})
    assert line.startswith(
        f"GPU 0: the models placed on it need {(classifier.total + chat.total) / (1 << 30):.2f} "
        f"GiB, {stated / (1 << 30):.2f} GiB is free"
    )
    assert "'efficientnet-lite0' " in line and f"'{model_dir.name}' " in line

    # a pixel budget in the processor kwargs is the model's own: more patches, a larger need
    (wider,) = _misfits([*both, "--mm-processor-kwargs", '{"max_pixels": 1003520}'], free={"0": stated})
    assert float(wider.split(" need ")[1].split()[0]) > float(line.split(" need ")[1].split()[0])

    assert _misfits([*both[:3], *both[5:]], free={"0": stated}) == []
    # smaller caches, a smaller need: they are what the bounds say, not a guess
    (lean,) = _misfits([*both, "--encoder-cache-mb", "8", "--prefix-cache-mb", "8"], free={"0": classifier.total})
    assert float(lean.split(" need ")[1].split()[0]) < float(line.split(" need ")[1].split()[0])
    assert _misfits([*both[:5], "--device", "cpu"], free={"0": 0}) == []  # nothing on a GPU: nothing to check


def test_a_checkpoint_that_cannot_be_sized_is_left_to_its_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))  # no weights
    fits = GpuNeed("classifier", "0", 1, WorkerNeed(weights=1 << 30, activations=0))
    needs = gpu_fit.placed_needs(
        [
            PlacedModel("broken", f"hf:{tmp_path}", "auto", 0, ("0",)),
            PlacedModel("classifier", "efficientnet-lite0", "auto", 0, ("0",)),
        ]
    )
    assert [n.model for n in needs] == ["classifier"]
    assert "cannot size model 'broken'" in caplog.text
    assert misfits(needs, {"0": fits.total}) == []


def test_cuda_free_bytes_on_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    free = gpu_fit.cuda_free_bytes([str(i) for i in range(torch.cuda.device_count())])
    assert set(free) == {str(i) for i in range(torch.cuda.device_count())}
    assert all(0 < value <= torch.cuda.mem_get_info(int(i))[1] for i, value in free.items())
