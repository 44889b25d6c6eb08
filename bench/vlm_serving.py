"""Who waits in a VLM server: a short request's TTFT idle and while a long answer streams, and a Poisson mix.

A random-weight Qwen2-VL of 8 layers and width 512 (the test fixture's tokenizer, processor and vision
tower, a bigger text model; ``--build`` writes it) served by ``shmgate serve --model hf:DIR --device cpu``:

1. idle: a short request (16 tokens, streamed) alone, ``--idle`` times; its TTFT;
2. behind: the same short request sent as soon as a 300-token answer has streamed its first token, ``--behind``
   times; its TTFT, and whether it finished before the long answer did;
3. mix: 24 requests (``--requests``) arriving at 2 req/s (``--rate``, exponential gaps from ``--seed``), each
   asking for 32-256 tokens (uniform, same seed): TTFT p50/p99 (from each request's scheduled arrival),
   TPOT (``vllm bench serve``'s: (latency - TTFT) / (tokens - 1)), output tokens/s over the mix.

Every answer runs to its ``max_tokens`` (a logit_bias forbids the end tokens), greedy, so both engines do
the same work. The server under test is this checkout (``--module gateway``) or another one, e.g. the
static engine of main checked out in /tmp/static-base: ``--pythonpath /tmp/static-base --module shmgate``.
Compare A and B alternately (ABBA), one ``flock /tmp/bench.lock`` run each; the figures are a JSON line.

``--server vllm`` runs them against vLLM's CPU engine (the peer recipe in ../shared/peers/vllm: its venv in
``VLLM_VENV``, its ``serve.sh`` at NICE=0 unless ``NICE`` says otherwise). ``--images repeated,distinct`` runs
the mix once with one photo for every request and once with a photo of its own per request (no image,
encoder or prefix cache can help), in one server start. ``--layouts`` times the padded and paged KV layouts
in this process (``layouts``).

``--server transformers`` runs the same measurements, with the same client, prompts, photos and
``logit_bias``, against ``transformers serve DIR --device cpu`` (its /v1/chat/completions, streamed; it
has no /metrics, so no stages). It needs nothing beyond the ``hf`` and ``test`` extras (fastapi,
uvicorn, openai), but its Qwen2-VL processor needs torchvision, so compare on a LLaVA with the same
text model: ``--build DIR --family llava`` (the fixture's tokenizer, CLIP processor and vision tower).
It runs one ``generate`` at a time on one inference thread; ``--extra=--continuous-batching`` falls
back to that for a VLM (transformers 5.24 batches continuously only models it classes as text-only).
It gets the OpenMP environment shmgate's worker sets itself (``OMP_WAIT_POLICY=PASSIVE``,
``THP_MEM_ALLOC_ENABLE=1``); both run torch with its default intra-op threads (the usable CPUs). The
mix's ``busy_threads`` shows each server's threads that computed, ``full_answers`` that every answer
ran to its ``max_tokens`` on either server.

    python bench/vlm_serving.py --build /tmp/vlm8
    flock /tmp/bench.lock python bench/vlm_serving.py --model-dir /tmp/vlm8 --label continuous
    flock /tmp/bench.lock python bench/vlm_serving.py --model-dir /tmp/vlm8 --label static \\
        --pythonpath /tmp/static-base --module shmgate
    VLLM_VENV=/work/vllm-venv flock /tmp/bench.lock python -m bench vlm-serving --model-dir /tmp/vlm8 --server vllm \\
        --images repeated,distinct --label vllm
    SHMGATE_KV_LAYOUT=paged flock /tmp/bench.lock python -m bench vlm-serving --model-dir /tmp/vlm8 \\
        --images repeated,distinct --label paged
    python -m bench vlm-serving --model-dir /tmp/vlm8 --layouts 1,8,32     # padded against paged, in process
    python -m bench vlm-serving --build /tmp/llava8 --family llava
    flock /tmp/bench.lock python -m bench vlm-serving --model-dir /tmp/llava8 --label shmgate
    flock /tmp/bench.lock python -m bench vlm-serving --model-dir /tmp/llava8 --server transformers \\
        --label transformers
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port, tree_env

REPO = Path(__file__).resolve().parent.parent
PHOTOS = sorted((REPO / "tests" / "data" / "images").glob("*.jpg"))
TEXT = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8}


def text_size(size: str) -> dict[str, int]:
    """``LAYERSxWIDTH`` (``8x512``, ``12x1024``) as a text model's settings: 64-wide heads, an MLP 2.6875x the
    width (the 8x512 model's 1376, the 12x1024 one's 2752)."""
    layers, width = (int(n) for n in size.lower().split("x"))
    if width % 64:
        raise ValueError(f"--size {size}: the width must be a multiple of 64 (the heads are 64 wide)")
    return {
        "hidden_size": width,
        "intermediate_size": width * 43 // 16,
        "num_hidden_layers": layers,
        "num_attention_heads": width // 64,
    }


def build(path: Path, vision: dict[str, Any] | None = None, text: dict[str, int] | None = None) -> None:
    """The fixture's Qwen2-VL (tests/hf_fixture.py) with an 8-layer, 512-wide text model unless ``text`` (see
    ``text_size``) (``vision``: other vision-tower settings, e.g. a real tower's depth and width; its output is
    merged to the text width)."""
    import torch
    import transformers

    from tests import hf_fixture

    text = text or TEXT

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = hf_fixture._build_processor(path, "qwen2_vl")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in hf_fixture._SPECIAL_TOKENS}
    vision = {**hf_fixture._vision_config("qwen2_vl"), **(vision or {}), "hidden_size": text["hidden_size"]}
    config = transformers.Qwen2VLConfig(
        text_config={
            **text,
            "vocab_size": len(tokenizer),
            "num_key_value_heads": 4,
            "head_dim": 64,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    # Random weights pick byte-level tokens that are halves of characters as often as whole ones, so an
    # answer's first text could wait many tokens: silenced like the control tokens, every token is text
    # and TTFT measures scheduling, not when a random model completes a UTF-8 character.
    halves = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    hf_fixture._finish_model(model, path, [*ids.values(), *halves], ids)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


def build_llava(path: Path) -> None:
    """The fixture's LLaVA (tests/hf_fixture.py: its tokenizer, CLIP processor and vision tower) with the
    same 8-layer, 512-wide text model: a checkpoint ``transformers serve`` loads without torchvision."""
    import torch
    import transformers

    from tests import hf_fixture

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = hf_fixture._build_processor(path, "llava")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in hf_fixture._SPECIAL_TOKENS}
    torch.manual_seed(0)
    model = hf_fixture._build_llava(tokenizer, ids, "llava")
    text = {**model.config.text_config.to_dict(), **TEXT, "num_key_value_heads": 4, "head_dim": 64}
    config = transformers.LlavaConfig(
        vision_config=model.config.vision_config.to_dict(),
        text_config=text,
        image_token_index=model.config.image_token_index,
        vision_feature_layer=model.config.vision_feature_layer,
        vision_feature_select_strategy=model.config.vision_feature_select_strategy,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    halves = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]  # as in build()
    control = [*ids.values(), tokenizer.convert_tokens_to_ids("<image>"), *halves]
    hf_fixture._finish_model(model, path, control, ids)
    # As real LLaVA-1.5 checkpoints ship it: transformers' LlavaProcessor counts image tokens from it.
    processor = {"processor_class": "LlavaProcessor", "patch_size": 14, "num_additional_image_tokens": 1}
    (path / "processor_config.json").write_text(
        json.dumps({**processor, "vision_feature_select_strategy": "default"}) + "\n"
    )
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


def no_end(model_dir: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    return {str(i): -100.0 for i in ids}


def variant(photo: Path, n: int) -> bytes:
    """``photo`` with its top-left pixel set from ``n``, re-encoded: other bytes and other pixels, so no
    server's image, encoder or prefix cache can serve it from an earlier request's (``--images distinct``)."""
    import io

    from PIL import Image

    with Image.open(photo) as image:
        image = image.convert("RGB")
        image.putpixel((0, 0), (n % 256, (n // 256) % 256, 7))
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=95)
    return out.getvalue()


def body(model: str, photo: Path | bytes, text: str, max_tokens: int, bias: dict[str, float]) -> dict[str, Any]:
    data = photo if isinstance(photo, bytes) else photo.read_bytes()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": bias,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream(
    client: httpx.AsyncClient, payload: dict[str, Any], start: float, on_first: Any = None
) -> dict[str, float]:
    """One streamed request: TTFT and latency from ``start`` (monotonic), output tokens, content chunks."""
    first = 0.0
    chunks = tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                chunks += 1
                if not first:
                    first = time.monotonic()
                    if on_first is not None:
                        on_first()
    end = time.monotonic()
    return {"ttft": first - start, "latency": end - start, "tokens": tokens, "chunks": chunks, "end": end}


async def stages(client: httpx.AsyncClient) -> dict[str, tuple[float, float]]:
    """Each stage's (sum, count) from /metrics' shmgate_stage_duration_seconds."""
    found: dict[str, list[float]] = {}
    for line in (await client.get("/metrics")).text.splitlines():
        for suffix, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("shmgate_stage_duration_seconds" + suffix):
                stage = line.split('stage="')[1].split('"')[0]
                found.setdefault(stage, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
        for counter in ("steps", "step_seconds", "step_tokens"):  # the engine's (absent from a static one)
            if line.startswith(f"shmgate_engine_{counter}_total "):
                found[f"engine_{counter}"] = [float(line.rsplit(" ", 1)[1]), 0.0]
    return {stage: (v[0], v[1]) for stage, v in found.items()}


def thread_cpu(pid: int) -> dict[tuple[str, int], float]:
    """CPU seconds of every thread of ``pid`` and its descendants (Linux /proc), keyed by (process, tid):
    the process is its ``python -m`` module (``shmgate.worker``, ``transformers.cli.transformers``)."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[tuple[str, int], float] = {}
    pending = [pid]
    while pending:
        proc = Path(f"/proc/{pending.pop()}")
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            name = argv[2].decode() if len(argv) > 2 and argv[1] == b"-m" else argv[0].decode()
            for task in (proc / "task").iterdir():
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                found[(name, int(task.name))] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process or thread that ended meanwhile
    return found


def busy_threads(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float], span: float) -> Any:
    """Per process, the CPU share (of one core, over ``span``) of each thread busier than 1 %: how many
    threads really computed (torch's intra-op pool shows as the model's thread plus its OpenMP workers)."""
    shares: dict[str, list[float]] = {}
    for key, seconds in after.items():
        share = (seconds - before.get(key, 0.0)) / span
        if share > 0.01:
            shares.setdefault(key[0], []).append(round(share, 2))
    return {name: sorted(found, reverse=True) for name, found in shares.items()}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure(
    args: argparse.Namespace, base_url: str, model: str, bias: dict[str, float], server_pid: int
) -> dict[str, Any]:
    short = body(model, PHOTOS[0], "Say something short.", 16, bias)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for _ in range(2):  # warm-up
            await stream(client, short, time.monotonic())
        idle = [(await stream(client, short, time.monotonic()))["ttft"] for _ in range(args.idle)]
        out["idle_ttft_ms"] = round(statistics.median(idle) * 1000, 1)
        behind, first_done = [], 0
        for i in range(args.behind):
            started = asyncio.Event()
            long = asyncio.create_task(
                stream(
                    client,
                    body(model, PHOTOS[1 + i % 3], "Tell me everything.", 300, bias),
                    time.monotonic(),
                    started.set,
                )
            )
            await started.wait()
            result = await stream(client, short, time.monotonic())
            long_result = await long
            behind.append(result["ttft"])
            first_done += result["end"] < long_result["end"]
        out["behind_ttft_ms"] = round(statistics.median(behind) * 1000, 1)
        out["behind_over_idle"] = round(out["behind_ttft_ms"] / out["idle_ttft_ms"], 2)
        out["short_done_before_long"] = f"{first_done}/{args.behind}"
        for images in args.images.split(","):
            key = "mix" if images == "cycle" else f"mix_{images}"
            out[key] = await mix(args, client, model, bias, server_pid, images)
    return out


async def mix(
    args: argparse.Namespace,
    client: httpx.AsyncClient,
    model: str,
    bias: dict[str, float],
    server_pid: int,
    images: str,
) -> dict[str, Any]:
    """The Poisson mix; ``images``: cycle (the six test photos in turn), repeated (one photo for all) or
    distinct (a photo of its own per request, ``variant``)."""
    rng = random.Random(args.seed)
    at, plan = 0.0, []
    for i in range(args.requests):
        at += rng.expovariate(args.rate)
        photo: Path | bytes = PHOTOS[i % len(PHOTOS)]
        if images == "repeated":
            photo = PHOTOS[2]
        elif images == "distinct":
            photo = variant(PHOTOS[i % len(PHOTOS)], 1 + i)
        plan.append((at, rng.randint(32, 256), photo))
    zero = time.monotonic() + 0.1

    async def one(at: float, max_tokens: int, photo: Path | bytes) -> dict[str, float]:
        await asyncio.sleep(max(0.0, zero + at - time.monotonic()))
        return await stream(client, body(model, photo, "Describe the photo.", max_tokens, bias), zero + at)

    before, cpu_before = await stages(client), thread_cpu(server_pid)
    results = await asyncio.gather(*(one(*p) for p in plan))
    after, cpu_after = await stages(client), thread_cpu(server_pid)
    span = max(r["end"] for r in results) - zero
    ttfts = [r["ttft"] for r in results]
    tpots = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    out: dict[str, Any] = {
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000),
        "ttft_p99_ms": round(pct(ttfts, 0.99) * 1000),
        "tpot_mean_ms": round(statistics.mean(tpots) * 1000, 1),
        "output_tokens_per_s": round(sum(r["tokens"] for r in results) / span, 1),
        "chunks_per_s": round(sum(r["chunks"] for r in results) / span, 1),
        "span_s": round(span, 2),
        # the server's CPU over the mix, in cores (2 at most here), and its busy threads' shares
        "server_cores": round((sum(cpu_after.values()) - sum(cpu_before.values())) / span, 2),
        "busy_threads": busy_threads(cpu_before, cpu_after, span),
        # every answer should run to its max_tokens (no end token), on either server
        "full_answers": f"{sum(r['tokens'] == p[1] for r, p in zip(results, plan, strict=True))}/{len(plan)}",
        # where a request's time went, mean per stage over the mix (gateway/stages.py), ms
        "stages_ms": {
            stage: round((after[stage][0] - before[stage][0]) / (after[stage][1] - before[stage][1]) * 1000, 1)
            for stage in after
            if after[stage][1] > before.get(stage, (0, 0))[1]
        },
    }
    steps = after.get("engine_steps", (0, 0))[0] - before.get("engine_steps", (0, 0))[0]
    if steps:
        delta = {k: after[k][0] - before[k][0] for k in ("engine_step_seconds", "engine_step_tokens")}
        out["engine"] = {
            "steps": int(steps),
            "step_ms": round(delta["engine_step_seconds"] / steps * 1000, 1),
            "tokens_per_step": round(delta["engine_step_tokens"] / steps, 1),
            "busy_share": round(delta["engine_step_seconds"] / span, 2),
        }
    return out


def padding(model_dir: Path, seed: int, requests: int, every: int) -> dict[str, Any]:
    """The mix's requests replayed through the engine in this process (one arrival every 12 steps, each
    answer to its max_tokens): KV positions the left-padded cache holds against the tokens its rows
    really have, at every step; and every ``every`` steps, one decode step timed on a copy of the
    running rows' padded cache (with the mask that hides the padding) against the same rows with
    equal, unpadded lengths holding as many positions as the rows really have in all (what a paged
    layout's attention reads), alternated, best of 3 each."""
    import torch

    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.shared.wire import SamplingParams
    from shmgate.worker.backends.hf import HFBackend
    from shmgate.worker.generation.kv import cache_length as _cache_length
    from tests.test_hf import work_item

    pre, engine = HFPreprocessor(model_dir), HFBackend(str(model_dir), torch.device("cpu"))
    bias = tuple(sorted((int(token), value) for token, value in no_end(model_dir).items()))
    rng = random.Random(seed)
    items = []
    for i in range(requests):
        rng.expovariate(1.0)  # the mix's draws, in its order
        params = SamplingParams(max_tokens=rng.randint(32, 256), temperature=0.0, logit_bias=bias)
        items.append(work_item(pre, "Describe the photo.", [PHOTOS[i % len(PHOTOS)]], params, i))
        items[-1].key = i
    step = added = padded = real = peak = peak_real = 0
    timed: list[tuple[int, float, float, float]] = []  # rows, padded ms, equal ms, held / real
    while added < len(items) or engine.has_work():
        if added < len(items) and step % 12 == 0:
            engine.add(items[added])
            added += 1
        engine.step()
        step += 1
        rows = engine._running
        if rows:
            length = _cache_length(rows[0].cache)
            held, used = len(rows) * length, sum(length - row.pad for row in rows)
            padded, real = padded + held, real + used
            if held > peak:
                peak, peak_real = held, used
            if every and step % every == 0 and len(rows) > 1 and held > used:
                timed.append((len(rows), *step_cost(engine, rows, -(-used // len(rows))), held / used))
    out: dict[str, Any] = {
        "steps": step,
        "padded_over_real_mean": round(padded / real, 3),
        "peak_held": peak,
        "peak_real": peak_real,
    }
    if timed:
        out["decode_step_ms"] = {
            "padded": round(statistics.mean(t[1] for t in timed), 2),
            "equal_lengths": round(statistics.mean(t[2] for t in timed), 2),
            "padded_over_equal": round(statistics.mean(t[1] / t[2] for t in timed), 3),
            "samples": len(timed),
        }
        by_rows: dict[int, list[tuple[int, float, float, float]]] = {}
        for sample in timed:
            by_rows.setdefault(sample[0], []).append(sample)
        # rows -> [samples, padded ms, equal-length ms, positions held / real]
        out["by_rows"] = {
            n: [len(g), *(round(statistics.mean(t[k] for t in g), 2) for k in (1, 2, 3))]
            for n, g in sorted(by_rows.items())
        }
    return out


def layouts(model_dir: Path, counts: list[int], decode_steps: int, threads: int, clock_name: str) -> dict[str, Any]:
    """The KV layouts side by side in this process (``--layouts``): for each row count, that many requests
    (the mix's prompt and photos, one arrival every 3 steps so lengths differ) until all decode, then
    ``decode_steps`` steps timed: the whole step, the model's forward pass within it (the rest is host work:
    scheduling, bookkeeping, sampling, detokenising), and the KV positions held per real position. Padded
    and paged alternate A B B A per row count; each figure is the mean of the two runs. ``threads``: torch's
    threads (0: its default); ``clock_name`` "cpu" times with this process's CPU time (with one thread, the
    work done, whatever else runs on the cores), "wall" with the wall clock."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker runs (worker/__main__.py); before torch
    import torch

    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if clock_name == "cpu" else time.perf_counter

    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.shared.wire import SamplingParams
    from shmgate.worker.backends.hf import HFBackend
    from tests.test_hf import work_item

    pre = HFPreprocessor(model_dir)
    engines = {kind: HFBackend(str(model_dir), torch.device("cpu"), kv_layout=kind) for kind in ("padded", "paged")}
    bias = tuple(sorted((int(token), value) for token, value in no_end(model_dir).items()))
    spent = [0.0]
    started = [0.0]

    def before(*_: Any) -> None:
        started[0] = clock()

    def after(*_: Any) -> None:
        spent[0] += clock() - started[0]

    for engine in engines.values():
        engine.model.register_forward_pre_hook(before)
        engine.model.register_forward_hook(after)
        runner = engine._runner
        if runner is not None:  # the paged step's forward pass (its plain loop calls no model forward)
            run_forward = runner.forward

            def timed(*args: Any, _run: Any = run_forward) -> Any:
                before()
                try:
                    return _run(*args)
                finally:
                    after()

            runner.forward = timed  # type: ignore[method-assign]

    def run(kind: str, rows: int) -> tuple[float, float, float]:
        engine = engines[kind]
        engine.prefix_cache.max_bytes = 0  # every prompt prefilled in full, as in the padded layout's test
        items = []
        for i in range(rows):
            params = SamplingParams(max_tokens=3 * rows + decode_steps + 8, temperature=0.0, logit_bias=bias)
            items.append(work_item(pre, "Describe the photo.", [PHOTOS[i % len(PHOTOS)]], params, i))
            items[-1].key = i
        added = 0
        while added < rows or engine.waiting:
            if added < rows and engine.waiting == 0:
                engine.add(items[added])
                added += 1
            for _ in range(3):
                engine.step()
        step_s = forward_s = held = real = 0.0
        for _ in range(decode_steps):
            spent[0] = 0.0
            t0 = clock()
            engine.step()
            step_s += clock() - t0
            forward_s += spent[0]
            running = engine._running
            real += sum(row.done_tokens if engine._pool is not None else 0 for row in running)
            if engine._pool is None:
                from shmgate.worker.generation.kv import cache_length

                length = cache_length(running[0].cache)
                real += sum(length - row.pad for row in running)
            held += engine.kv_used
        assert engine.running == rows, (kind, engine.running)
        engine.clear()
        return step_s / decode_steps * 1000, (step_s - forward_s) / decode_steps * 1000, held / real

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "clock": clock_name}
    # warm-up: the first forward passes of a process are slower (kernels, allocator), and the paged pool grows
    # (doubling, a one-time copy) until it holds the most rows measured
    for kind in engines:
        run(kind, max(counts))
    for rows in counts:
        figures: dict[str, list[tuple[float, float, float]]] = {"padded": [], "paged": []}
        for kind in ("padded", "paged", "paged", "padded"):
            figures[kind].append(run(kind, rows))
        out[str(rows)] = {
            kind: {
                "step_ms": round(statistics.mean(f[0] for f in got), 2),
                "host_ms": round(statistics.mean(f[1] for f in got), 2),
                "held_over_real": round(statistics.mean(f[2] for f in got), 3),
            }
            for kind, got in figures.items()
        }
    return out


def step_cost(engine: Any, rows: list[Any], length: int) -> tuple[float, float]:
    """ms of one decode step of ``rows`` on a copy of their padded cache, and on a copy cut to ``length``
    positions per row with no padding (the same rows, as many positions as they really hold in all)."""
    import copy

    cache, pads = rows[0].cache, [row.pad for row in rows]
    equal = copy.deepcopy(cache)
    for layer in equal.layers:
        layer.keys, layer.values = layer.keys[..., -length:, :].clone(), layer.values[..., -length:, :].clone()
    best = {"padded": float("inf"), "equal": float("inf")}
    try:
        for kind in ("padded", "equal", "equal", "padded", "padded", "equal"):
            rows[0].cache = copy.deepcopy(cache if kind == "padded" else equal)  # a step appends to it
            for row, pad in zip(rows, pads, strict=True):
                row.pad = pad if kind == "padded" else 0
            started = time.perf_counter()
            engine._decode_step(rows)
            best[kind] = min(best[kind], (time.perf_counter() - started) * 1000)
    finally:
        rows[0].cache = cache
        for row, pad in zip(rows, pads, strict=True):
            row.pad = pad
    return best["padded"], best["equal"]


def serve_vllm(args: argparse.Namespace, port: int) -> int:
    """The measurements against vLLM's CPU engine: the recipe's serve.sh starts it on the same directory and
    prints its process group once /v1/models answers (60-95 s, torch.compile at every start)."""
    env = {**os.environ, "NICE": os.environ.get("NICE", "0")}
    script = args.vllm_dir / "serve.sh"
    started = subprocess.run(
        [str(script), str(args.model_dir), str(port), *args.extra.split()],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    group = int(started.stdout.strip().splitlines()[-1])
    base_url = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        figures = asyncio.run(measure(args, base_url, model, no_end(args.model_dir), group))
    finally:
        os.killpg(group, 15)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    print(json.dumps({"label": args.label, "command": f"{script} {args.model_dir} {port}", **figures}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", type=Path, help="write the 8-layer model into this directory and exit")
    p.add_argument("--family", choices=("qwen2_vl", "llava"), default="qwen2_vl", help="the model --build writes")
    p.add_argument(
        "--size", default="8x512", help="--build: the Qwen2-VL text model's LAYERSxWIDTH (8x512; 12x1024: 134 M)"
    )
    p.add_argument(
        "--server",
        choices=("shmgate", "transformers", "vllm"),
        default="shmgate",
        help="transformers: `transformers serve DIR` (one request at a time unless --extra=--continuous-batching); "
        "vllm: vLLM's CPU engine through the peer recipe's serve.sh (--vllm-dir, VLLM_VENV), at NICE=0 unless set",
    )
    p.add_argument(
        "--vllm-dir",
        type=Path,
        default=next((d for d in (REPO.parent / "shared", REPO.parent.parent / "shared") if d.is_dir()), Path("shared"))
        / "peers"
        / "vllm",
        help="the peer recipe (default: shared/peers/vllm beside the checkout or its parent)",
    )
    p.add_argument(
        "--images",
        default="cycle",
        help="the mix's photos, one mix each, comma-separated: cycle (six in turn), repeated (one), distinct (one each)",
    )
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--label", default="")
    p.add_argument("--module", default="shmgate", help="the package whose `serve` runs (gateway on older checkouts)")
    p.add_argument("--pythonpath", default="", help="a checkout to serve from instead of this one")
    p.add_argument("--idle", type=int, default=5)
    p.add_argument("--behind", type=int, default=3)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--extra", default="", help="more serve flags, space-separated")
    p.add_argument("--padding", action="store_true", help="only the padded KV layout's cost, in process")
    p.add_argument("--time-every", type=int, default=16, help="--padding: time a decode step every N steps (0: none)")
    p.add_argument("--layouts", default="", help="only the padded and paged KV layouts' step costs at these row counts")
    p.add_argument("--decode-steps", type=int, default=16, help="--layouts: decode steps timed per run")
    p.add_argument("--threads", type=int, default=0, help="--layouts: torch threads (0: torch's default)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="--layouts: time with the wall clock, or this process's CPU time (one thread: the work itself)",
    )
    args = p.parse_args(argv)
    if args.build:
        if args.family == "llava":
            build_llava(args.build)
        else:
            build(args.build, text=text_size(args.size))
        return 0
    if args.padding:
        print(json.dumps(padding(args.model_dir, args.seed, args.requests, args.time_every)))
        return 0
    if args.layouts:
        counts = [int(n) for n in args.layouts.split(",")]
        print(json.dumps(layouts(args.model_dir, counts, args.decode_steps, args.threads, args.clock)))
        return 0
    assert args.model_dir, "--model-dir (build one with --build)"
    port = free_port()
    env = dict(os.environ)
    cwd = str(REPO)
    if args.pythonpath:
        env, cwd = tree_env(Path(args.pythonpath)), args.pythonpath
    if args.server == "transformers":
        # The environment shmgate's worker gives torch (worker/__main__.py), so that only the engines differ
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(args.model_dir)]
        command += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *args.extra.split()]
        ready = "/health"
    else:
        command = [sys.executable, "-m", args.module, "serve", "--model", f"hf:{args.model_dir}", "--device", "cpu"]
        command += ["--port", str(port), *args.extra.split()]
        ready = "/ready"
    if args.server == "vllm":
        return serve_vllm(args, port)
    log = tempfile.NamedTemporaryFile(prefix="vlm-serving-", suffix=".log", delete=False)
    server = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None and time.monotonic() < deadline, f"the server did not start: {log.name}"
            try:
                if httpx.get(base_url + ready, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        figures = asyncio.run(measure(args, base_url, model, no_end(args.model_dir), server.pid))
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps({"label": args.label, "command": " ".join(command[1:]), **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
