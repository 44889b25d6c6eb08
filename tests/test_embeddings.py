"""``POST /v1/embeddings`` against real servers: efficientnet-lite0 (real weights) and tiny CLIP/SigLIP/SigLIP2.

The reference for every vector is the model's own features computed here, in the test process,
on the same preprocessing (efficientnet: its pooled features on the frontend's pixels; CLIP-class
models: ``get_image_features`` / ``get_text_features`` through transformers' processor parts).
Plus the request forms, encodings, errors, the result cache and the OpenAI client.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from shmgate.gateway.result_cache import ResultCache
from shmgate.shared.wire import REPLY_MESSAGE_BYTES, Vector, encoder
from shmgate.worker.vectors import vector_messages
from tests.serving import IMAGES, Server, data_url, start_server, stop_and_check

KEY = "sk-embed-test"
PHOTOS = ["chelsea_640.jpg", "coffee_640.jpg", "camera_640.jpg"]


def _url(name: str) -> str:
    return data_url((IMAGES / name).read_bytes())


def _vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# -- no server ---------------------------------------------------------------------------------


def test_a_1280_d_vector_travels_in_pieces_that_fit_a_reply_message() -> None:
    data = np.random.default_rng(0).standard_normal(1280).astype("<f4").tobytes()
    messages = vector_messages(7, data)
    assert len(messages) == 2
    assert all(len(encoder.encode(m)) <= REPLY_MESSAGE_BYTES for m in messages)
    assert b"".join(m.data for m in messages) == data and [m.offset for m in messages] == [0, 3072]
    assert isinstance(messages[0], Vector)


def test_the_result_cache_is_bounded_and_least_recently_used() -> None:
    cache = ResultCache(3 * (100 + 200))
    for k in (b"a", b"b", b"c"):
        cache.put(k, bytes(100))
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", bytes(100))
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 3
    assert cache.used_bytes <= cache.max_bytes and cache.stats.evictions == 1


# -- efficientnet-lite0 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        "efficientnet-lite0",
        tmp_path_factory.mktemp("embed"),
        "--api-key",
        KEY,
        "--result-cache-mb",
        "4",
        "--max-pixels",
        "1000000",
        "--max-images",
        "4",
        "--allow-image-urls",
        "--image-url-allowlist",
        "127.0.0.1/32",
    )
    try:
        yield s
    finally:
        stop_and_check(s)


def _post(server: Server, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/embeddings", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}", **headers}
    )


def _reference_features(names: list[str]) -> np.ndarray:
    """EfficientNet-Lite0's own pooled features on the frontend's preprocessing of each photo."""
    import torch

    from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor
    from shmgate.worker.backends.efficientnet import EfficientNetBackend

    pre = EfficientNetPreprocessor()
    pixels = []
    for name in names:
        out: list[np.ndarray] = []
        pre.preprocess_image(
            (IMAGES / name).read_bytes(),
            lambda n, d, s: out.append(np.empty(s, d)) or out[-1],
            max_pixels=10**8,
            options=pre.embedding_image_options(),
        )  # an embedding's decode
        pixels.append(torch.from_numpy(out[0]))
    backend = EfficientNetBackend(torch.device("cpu"), threads=1)
    with torch.inference_mode():
        return backend.model.features(backend.normalise(torch.stack(pixels))).numpy()


def test_vectors_are_the_models_pooled_features_and_batched_equals_solo(server: Server) -> None:
    batched = _post(server, {"model": "efficientnet-lite0", "input": [_url(n) for n in PHOTOS]})
    assert batched.status_code == 200, batched.text
    body = batched.json()
    assert body["object"] == "list" and body["model"] == "efficientnet-lite0"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "embedding"
    assert body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}
    vectors = _vectors(body)
    assert vectors.shape == (3, 1280)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert _cos(vectors, _reference_features(PHOTOS)).min() >= 0.9999
    for i, name in enumerate(PHOTOS):
        solo = _post(server, {"model": "efficientnet-lite0", "input": _url(name)}, **{"Cache-Control": "no-cache"})
        assert _cos(_vectors(solo.json())[0], vectors[i]) >= 0.9999


def test_messages_form_agrees_with_input_and_base64_is_the_float_vector(server: Server) -> None:
    url = _url("coffee_1024.jpg")
    by_input = _vectors(_post(server, {"model": "efficientnet-lite0", "input": [url]}).json())[0]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    by_messages = _vectors(_post(server, {"model": "efficientnet-lite0", "messages": messages}).json())[0]
    assert _cos(by_input, by_messages) >= 0.9999
    b64 = _post(server, {"model": "efficientnet-lite0", "input": url, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, by_input)


def test_the_result_cache_answers_identical_bytes_and_is_bypassed_when_asked(server: Server) -> None:
    body = {"model": "efficientnet-lite0", "input": [_url("chelsea_1024.jpg")]}
    first = _post(server, body)
    # each frontend keeps its own cache: ask until both frontends have answered it twice
    answered: dict[str, int] = {}
    for _ in range(60):
        response = _post(server, body)
        assert response.content == first.content
        slot = response.headers["x-shmgate-frontend"]
        answered[slot] = answered.get(slot, 0) + 1
        if len(answered) == 2 and min(answered.values()) >= 2:
            break
    assert server.metric("shmgate_result_cache_hits_total") >= 2
    ran = server.metric("shmgate_batch_size_sum")  # requests the workers ran
    for _ in range(4):
        assert _post(server, body).content == first.content
    assert server.metric("shmgate_batch_size_sum") == ran  # hits never reached a worker
    hits = server.metric("shmgate_result_cache_hits_total")
    again = _post(server, body, **{"Cache-Control": "no-cache"})
    assert again.status_code == 200 and _cos(_vectors(again.json())[0], _vectors(first.json())[0]) >= 0.9999
    assert server.metric("shmgate_result_cache_hits_total") == hits
    assert server.metric("shmgate_batch_size_sum") == ran + 1


def test_the_classifiers_chat_answer_is_cached_too_streamed_or_not(server: Server) -> None:
    from tests.serving import image_request

    body = image_request("efficientnet-lite0", (IMAGES / "camera_640.jpg").read_bytes())
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.base_url + "/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=60).json()["choices"][0]["message"]["content"]
    hits = server.metric("shmgate_result_cache_hits_total")
    for _ in range(60):  # until a frontend answers from its cache
        again = httpx.post(url, json=body, headers=headers, timeout=60).json()
        if server.metric("shmgate_result_cache_hits_total") > hits:
            break
    assert server.metric("shmgate_result_cache_hits_total") > hits
    assert again["choices"][0]["message"]["content"] == first and again["usage"]["completion_tokens"] == 5
    streamed = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(streamed) == first


def _big_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "body,status,param,code",
    [
        ({"input": ["a cat"]}, 400, "input[0]", None),
        ({"input": "a cat"}, 400, "input", None),
        ({"input": [_url("camera_640.jpg")], "dimensions": 64}, 400, "dimensions", None),
        ({"input": [_url("camera_640.jpg")] * 5}, 400, "input", "too_many_images"),
        ({"input": ["data:image/jpeg;base64,!!!!"]}, 400, "input[0]", None),
        ({"input": ["data:image/gif;base64,R0lGODlh"]}, 400, "input[0]", None),
        ({"input": [_url("camera_640.jpg"), "http://10.1.2.3/cat.jpg"]}, 400, "input[1]", None),
        ({"input": [data_url(_big_png(1200, 1000), "image/png")]}, 413, "input[0]", "image_too_large"),
        ({"input": []}, 400, "input", None),
        ({"input": [[1, 2, 3]]}, 400, "input[0]", None),
        ({"input": [_url("camera_640.jpg")], "model": "gpt-4"}, 404, "model", "model_not_found"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a cat"},
                            {"type": "image_url", "image_url": {"url": _url("camera_640.jpg")}},
                        ],
                    }
                ]
            },
            400,
            "messages",
            None,
        ),
    ],
)
def test_bad_inputs_get_the_chat_paths_errors(
    server: Server, body: dict, status: int, param: str, code: str | None
) -> None:
    response = _post(server, {"model": "efficientnet-lite0", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    if code:
        assert error["code"] == code


def test_an_image_url_is_fetched_and_embedded_like_its_data_url(server: Server) -> None:
    from tests.image_host import Route, serve_images

    photo = (IMAGES / "coffee_640.jpg").read_bytes()
    with serve_images() as host:
        host.routes["/coffee.jpg"] = Route(body=photo, headers={"Content-Type": "image/jpeg"})
        fetched = _post(server, {"model": "efficientnet-lite0", "input": [host.url("/coffee.jpg")]})
    assert fetched.status_code == 200, fetched.text
    inline = _post(server, {"model": "efficientnet-lite0", "input": [data_url(photo)]})
    assert _cos(_vectors(fetched.json())[0], _vectors(inline.json())[0]) >= 0.9999


def test_the_api_key_guards_embeddings(server: Server) -> None:
    response = httpx.post(
        server.base_url + "/v1/embeddings",
        timeout=30,
        json={"model": "efficientnet-lite0", "input": _url("camera_640.jpg")},
    )
    assert response.status_code == 401 and response.json()["error"]["code"]


def test_the_openai_client_creates_embeddings(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    result = client.embeddings.create(model="efficientnet-lite0", input=[_url(n) for n in PHOTOS[:2]])
    assert len(result.data) == 2 and len(result.data[0].embedding) == 1280
    # the client's default asks for base64 and decodes it itself when numpy is installed
    float_result = client.embeddings.create(model="efficientnet-lite0", input=_url(PHOTOS[0]), encoding_format="float")
    assert _cos(np.array(result.data[0].embedding), np.array(float_result.data[0].embedding)) >= 0.9999


def test_shmgate_bench_embeddings_runs_and_checks_agreement(server: Server, tmp_path: Path) -> None:
    import argparse
    import asyncio

    from shmgate.bench_client import loadgen

    for name in PHOTOS:  # within this server's --max-pixels
        (tmp_path / name).symlink_to(IMAGES / name)

    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url",
            server.base_url,
            "--model",
            "efficientnet-lite0",
            "--embeddings",
            "--images",
            str(tmp_path),
            "--concurrency",
            "4",
            "--requests",
            "8",
            "--unique",
            "--api-key",
            KEY,
        ]
    )
    result = asyncio.run(loadgen.run(args))
    assert result["embeddings"] and result["errors"] == 0 and result["mismatches"] == 0, result["errors_by_kind"]
    vector = base64.b64encode(np.ones(4, dtype="<f4").tobytes()).decode()
    other = base64.b64encode(np.array([1, -1, 1, -1], dtype="<f4").tobytes()).decode()
    assert loadgen.count_vector_mismatches([("a", vector), ("a", vector), ("a", other), ("b", other)]) == 1


# -- CLIP, SigLIP, SigLIP2 --------------------------------------------------------------------


@pytest.fixture(scope="session")
def embedder_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.embed_fixture import build_tiny_embedder

    root = tmp_path_factory.mktemp("embedders")
    return {kind: build_tiny_embedder(kind, root / f"tiny-{kind}") for kind in ("clip", "siglip", "siglip2")}


TEXTS = ["a photo of a cat", "a cup of coffee on a table"]


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_the_two_halves_give_the_models_features(kind: str, embedder_dirs: dict[str, Path]) -> None:
    """Frontend preprocessing -> (arrays standing in for the arena) -> worker backend, one mixed batch."""
    import torch

    from shmgate.gateway.preprocess import get_preprocessor
    from shmgate.worker.backends.base import WorkItem
    from shmgate.worker.backends.hf_embed import HFEmbeddingBackend
    from tests.embed_fixture import reference_features

    model_dir = embedder_dirs[kind]
    pre = get_preprocessor(f"hf:{model_dir}")
    items = []
    for name in PHOTOS[:2]:
        arrays: dict[str, np.ndarray] = {}

        def allocate(n: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            arrays[n] = np.empty(shape, dtype)
            return arrays[n]

        pre.preprocess_image((IMAGES / name).read_bytes(), allocate, max_pixels=10**8)
        items.append(WorkItem(len(items), {n: [torch.from_numpy(a)] for n, a in arrays.items()}, task="embed"))
    for text in TEXTS:
        prompt = pre.build_prompt([{"role": "user", "content": [{"type": "text", "text": text}]}], [])
        items.append(WorkItem(len(items), {}, inline=prompt.inline, task="embed"))
    backend = HFEmbeddingBackend(str(model_dir), torch.device("cpu"), name=pre.model)
    events = list(backend.run(items))
    vectors = np.stack(
        [np.frombuffer(e.vector, dtype="<f4") for e in sorted(events, key=lambda e: e.index) if e.vector is not None]
    )
    assert vectors.shape == (4, pre.embedding_dim)
    assert [e.index for e in events if e.finish_reason] == [0, 1, 2, 3]
    images = [Image.open(IMAGES / name).convert("RGB") for name in PHOTOS[:2]]
    assert _cos(vectors, reference_features(model_dir, images=images, texts=TEXTS)).min() >= 0.9999


def test_a_siglip2_server_embeds_images_and_text_in_one_space(embedder_dirs: dict[str, Path], tmp_path: Path) -> None:
    """SigLIP2 sends three tensors per image (pixels, patch mask, spatial shapes) through the arena."""
    from tests.embed_fixture import reference_features

    model_dir = embedder_dirs["siglip2"]
    s = start_server(f"hf:{model_dir}", tmp_path, "--frontends", "1", "--workers", "1")
    try:
        model = model_dir.name
        inputs = [_url(PHOTOS[0]), TEXTS[0], _url(PHOTOS[1]), TEXTS[1]]
        response = httpx.post(s.base_url + "/v1/embeddings", json={"model": model, "input": inputs}, timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        vectors = _vectors(body)
        images = [Image.open(IMAGES / name).convert("RGB") for name in PHOTOS[:2]]
        reference = reference_features(model_dir, images=images, texts=TEXTS)
        assert _cos(vectors[[0, 2, 1, 3]], reference).min() >= 0.9999
        assert body["usage"]["prompt_tokens"] > 0  # the texts' tokens
        text_only = httpx.post(
            s.base_url + "/v1/embeddings",
            timeout=60,
            json={"model": model, "messages": [{"role": "user", "content": TEXTS[0]}]},
        ).json()
        assert _cos(_vectors(text_only)[0], vectors[1]) >= 0.9999
        chat = httpx.post(
            s.base_url + "/v1/chat/completions",
            timeout=30,
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "model"
        dims = httpx.post(
            s.base_url + "/v1/embeddings",
            timeout=30,
            json={"model": model, "input": "x", "dimensions": vectors.shape[1]},
        )
        assert dims.status_code == 200, dims.text
    finally:
        stop_and_check(s)


def test_a_request_of_several_inputs_is_admitted_once_as_it_is_counted_once(server: Server) -> None:
    admitted = 'shmgate_model_requests_total{model="efficientnet-lite0",outcome="admitted"}'
    before = server.metric(admitted)
    inputs = [_url(n) for n in PHOTOS[:3]]
    answer = _post(server, {"model": "efficientnet-lite0", "input": inputs}, **{"Cache-Control": "no-cache"})
    assert answer.status_code == 200 and len(answer.json()["data"]) == 3
    assert server.metric(admitted) - before == 1
