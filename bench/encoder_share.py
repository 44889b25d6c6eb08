"""Is a vision-tower output cheaper to copy through shared memory than to compute? Tower time against copy time.

For each tower and image size: the time of one Qwen2-VL vision-tower run over one image (random weights,
float32 on CPU, ``torch.inference_mode``), against the time to share its output between two workers the
way ``--encoder-share-mb`` does (shared/encoder_store.py under worker/encoder_share.py): the publish
(device-to-host, copy into the publisher's partition, index insert under the index semaphore) and the
read (index look-up, generation-checked copy into a fresh torch tensor, to the device). Both in this
process, side by side, medians of ``--repeats`` runs (tower) and ``--copies`` runs (publish, read).

Towers:
- ``vlm8``: the tower of the project's 8-layer 512-wide Qwen2-VL (``python -m bench vlm-serving --build``:
  the test fixture's tower, depth 1, embed_dim 32, merged to 512 wide);
- ``qwen2-vl-2b``: Qwen2-VL-2B's vision config (depth 32, embed_dim 1280, 16 heads, merged to 1536 wide).

    flock /tmp/bench.lock python -m bench encoder-share --towers vlm8,qwen2-vl-2b --sizes 224,448

One JSON line per (tower, size), then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TOWERS: dict[str, dict[str, Any]] = {
    "vlm8": {
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": 512,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "qwen2-vl-2b": {
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1536,
        "num_heads": 16,
        "mlp_ratio": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def build_tower(config: dict[str, Any]) -> Any:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(0)
    vision = Qwen2VLConfig(vision_config=config).vision_config
    return Qwen2VisionTransformerPretrainedModel._from_config(vision, dtype=torch.float32).eval()


def image_inputs(config: dict[str, Any], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image of ``size`` x ``size`` pixels as the processor gives it: patches and its (t, h, w) grid."""
    side = size // config["patch_size"]
    grid = torch.tensor([[1, side, side]])
    patch = 3 * config["temporal_patch_size"] * config["patch_size"] ** 2
    return torch.randn(side * side, patch), grid


def median_ms(fn: Any, repeats: int, budget_s: float = 0.0) -> float:
    """The median of at least ``repeats`` runs, more while ``budget_s`` lasts (at most 50): a cheap tower
    gets enough runs that a neighbour's burst of CPU on the shared machine does not set its figure."""
    times: list[float] = []
    ends = time.perf_counter() + budget_s
    while len(times) < repeats or (time.perf_counter() < ends and len(times) < 50):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


class Pair:
    """Two workers' doors to one model's shared outputs, in a scratch instance (removed by ``close``)."""

    def __init__(self, partition_mb: int) -> None:
        from shmgate.shared.encoder_store import EncoderStore
        from shmgate.shared.instance import Instance
        from shmgate.shared.locks import HolderKind
        from shmgate.worker.encoder_share import SharedEncoderOutputs

        self.instance = Instance.create(arena_size=2 << 20, n_frontends=1, n_workers=2, queue_depth=2)
        seg = self.instance.segment
        self.stores = []
        self.doors = []
        for slot in range(2):
            epoch = seg.claim_slot(seg.workers, slot, model="bench")
            store = EncoderStore.open(
                self.instance.names,
                0,
                slot=slot,
                n_slots=2,
                partition_bytes=partition_mb << 20,
                identity=(HolderKind.WORKER, slot, epoch),
                is_dead=self.instance.holder_is_dead,
            )
            self.stores.append(store)
            self.doors.append(SharedEncoderOutputs(store, model="bench", device=torch.device("cpu"), merge_size=2))

    def close(self) -> None:
        for store in self.stores:
            store.close()
        self.instance.unlink()
        self.instance.close()


def measure(pair: Pair, name: str, size: int, repeats: int, copies: int) -> dict[str, Any]:
    config = TOWERS[name]
    tower = build_tower(config)
    pixels, grid = image_inputs(config, size)
    with torch.inference_mode():
        features = tower(pixels, grid_thw=grid).pooler_output  # warm-up; the merged output is what is shared
        tower_ms = median_ms(lambda: tower(pixels, grid_thw=grid), repeats, budget_s=2.0)
    grid_key = tuple(int(v) for v in grid[0].tolist())
    publisher, reader = pair.doors
    keys = [os.urandom(16) for _ in range(copies)]
    counter = iter(keys)
    publish_ms = median_ms(lambda: publisher.publish(next(counter), grid_key, features), copies)
    width = features.shape[1]
    got: list[torch.Tensor | None] = []
    reads = iter(keys)
    read_ms = median_ms(lambda: got.append(reader.get(next(reads), grid_key, features.dtype, width)), copies)
    found = [g for g in got if g is not None]
    assert found and all(torch.equal(g, features) for g in found), "a shared read differed from the tower's output"
    return {
        "tower": name,
        "image_px": size,
        "tokens": features.shape[0],
        "width": width,
        "output_kib": features.numel() * features.element_size() // 1024,
        "tower_ms": round(tower_ms, 3),
        "publish_ms": round(publish_ms, 3),
        "read_ms": round(read_ms, 3),
        "read_hits": f"{len(found)}/{copies}",
        "tower_over_read": round(tower_ms / read_ms, 1),
        "torch_threads": torch.get_num_threads(),
    }


# -- end to end: the second worker's first request for an image, shared or not ------------------------------


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def serve_round_trip(model_dir: Path, share_mb: float, rounds: int, max_tokens: int) -> dict[str, Any]:
    """Serve ``model_dir`` on 2 CPU workers (one torch thread each, ``--encoder-share-mb share_mb``); per round a
    new image: one request (a tower run), then the same request until the other worker has answered it,
    each streamed; the TTFTs of the first request, of the other worker's and of the same worker's repeats."""
    import httpx

    from bench.servers import ServerProcess, free_port, shmgate_serve
    from tests.serving import noise_png

    port = free_port()
    flags = ["--model", f"hf:{model_dir}", "--device", "cpu", "--workers", "2", "--frontends", "1"]
    flags += ["--threads", "1", "--encoder-share-mb", str(share_mb), "--arena-size", "256MiB"]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(shmgate_serve(port, *flags), Path(tmp) / "serve.log")
        server.start()
        base = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(server.wait_ready(base + "/ready"))
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            first, other, same = [], [], []
            for r in range(rounds):
                url = "data:image/png;base64," + base64.b64encode(noise_png(9000 + r, size=448)).decode()
                first.append(_ttft(base, model, url, max_tokens))
                for _ in range(8):
                    before = httpx.get(base + "/metrics").text
                    ttft = _ttft(base, model, url, max_tokens)
                    time.sleep(0.2)  # the engines report their counters every 50 ms
                    after = httpx.get(base + "/metrics").text
                    tower = _metric(after, "shmgate_vision_tower_runs_total") - _metric(
                        before, "shmgate_vision_tower_runs_total"
                    )
                    shared = _metric(after, "shmgate_encoder_shared_hits_total") - _metric(
                        before, "shmgate_encoder_shared_hits_total"
                    )
                    if tower or shared:  # the worker that had not seen the image
                        other.append(ttft)
                        break
                    same.append(ttft)
            return {
                "share_mb": share_mb,
                "model": model_dir.name,
                "rounds": rounds,
                "first_ttft_ms": round(statistics.median(first), 1),
                "other_worker_ttft_ms": round(statistics.median(other), 1) if other else None,
                "other_worker_seen": len(other),
                "same_worker_ttft_ms": round(statistics.median(same), 1) if same else None,
            }
        finally:
            server.stop()


def _ttft(base: str, model: str, url: str, max_tokens: int) -> float:
    import httpx

    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    began = time.perf_counter()
    ttft = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = (time.perf_counter() - began) * 1000
    assert ttft is not None, "no content streamed"
    return ttft


def build_big_tower(path: Path) -> None:
    """The 8-layer model of ``vlm-serving --build`` with Qwen2-VL-2B's vision tower (merged to its width)."""
    from bench import vlm_serving

    vlm_serving.build(path, vision={k: v for k, v in TOWERS["qwen2-vl-2b"].items() if k != "hidden_size"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--towers", default="vlm8,qwen2-vl-2b", help="comma-separated: " + ", ".join(TOWERS))
    p.add_argument("--sizes", default="224,448", help="image sides in pixels (multiples of 28)")
    p.add_argument(
        "--repeats", type=int, default=3, help="tower runs per point at least (after one warm-up; more within 2 s)"
    )
    p.add_argument("--copies", type=int, default=20, help="publishes and reads per point")
    p.add_argument("--partition-mb", type=int, default=64, help="each worker's shared partition")
    p.add_argument("--serve", type=Path, help="end to end instead: serve this model directory, shared and not")
    p.add_argument("--rounds", type=int, default=4, help="--serve: images per server")
    p.add_argument("--max-tokens", type=int, default=4, help="--serve: tokens per answer")
    p.add_argument("--build-big-tower", type=Path, help="write the 8-layer model with the 2B vision tower and exit")
    args = p.parse_args(argv)
    if args.build_big_tower:
        build_big_tower(args.build_big_tower)
        return 0
    if args.serve:
        for share_mb in (0.0, float(args.partition_mb), float(args.partition_mb), 0.0):  # ABBA
            print(json.dumps(serve_round_trip(args.serve, share_mb, args.rounds, args.max_tokens)), flush=True)
        return 0
    pair = Pair(args.partition_mb)
    rows = []
    try:
        for name in args.towers.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                row = measure(pair, name, size, args.repeats, args.copies)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        pair.close()
    print("\n| tower | image | output | tower ms | publish ms | read ms | tower / read |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['tower']} | {r['image_px']} px | {r['tokens']} x {r['width']} ({r['output_kib']} KiB) | "
            f"{r['tower_ms']} | {r['publish_ms']} | {r['read_ms']} | {r['tower_over_read']} |"
        )
    return 0
