"""Several images in one request on a small arena, against a real ``shmgate serve --model checksum``.

What it shows: whether a request whose images fit one frontend's partition together is placed once
earlier requests have filled the content cache (every cached entry unheld, so evictable), and what a
request that could not fit even in an empty partition is answered.

The checksum model's tensor is (3, 224, 224) uint8 for every image: 150,528 bytes plus a 64-byte block
header, so a 1 MiB partition (``--arena-size 1MiB --frontends 1``) holds 6 images and not 7.

Rounds, each on fresh images (so every image of the request is a miss):
    fill     ``--fill`` single-image requests, one after another: the cache holds them, unheld
    several  one request with ``--images`` new images (default 6: they fit together)
Then once: one request with ``--too-many`` new images (default 7: more than an empty partition holds).

Printed: the status and error code of every multi-image request, and whether the answer carried every
image's digest.

``--hf DIR`` (a Qwen2-VL checkpoint, e.g. the tiny one tests/hf_fixture.py builds) runs the scattered-holes
case instead, on ``checksum:hf:DIR``, whose tensors take the size of the image (float32 patches): the cache
is filled with a 112x112 (294 KiB), a 168x168 (459 KiB) and a 112x56 (147 KiB) image, the first and last
used again (so the middle one is least recently used), then one request sends two new 168x168 images
(918 KiB together, in a 1 MiB partition). Evicting least recently used first puts the first in the middle
hole; the second then finds 294 and 270 KiB holes with nothing else held.

Usage (from the repository root; PYTHONPATH makes the children run this checkout):

    PYTHONPATH=$PWD python bench/arena_placement.py [--rounds 10] [--images 6] [--too-many 7]
    PYTHONPATH=$PWD python bench/arena_placement.py --hf /tmp/tiny-qwen2-vl [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.serving import (  # noqa: E402
    data_url,
    expected_checksum,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
)


def several_images_request(images: list[bytes]) -> dict[str, object]:
    body = image_request("checksum", images[0], mime="image/png")
    content = body["messages"][0]["content"]  # type: ignore[index]
    content += [{"type": "image_url", "image_url": {"url": data_url(d, "image/png")}} for d in images[1:]]
    return body


def outcome(response: httpx.Response, images: list[bytes]) -> str:
    if response.status_code == 200:
        answer = response.json()["choices"][0]["message"]["content"]
        right = all(expected_checksum(d) in answer for d in images)
        return "200 digests right" if right else "200 DIGESTS WRONG"
    return f"{response.status_code} {response.json()['error']['code']}"


def png(seed: int, width: int, height: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def scattered_holes(model_dir: str, rounds: int, arena_size: str) -> None:
    model = "checksum:" + Path(model_dir).name
    outcomes: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(
            f"checksum:hf:{model_dir}", Path(tmp), "--frontends", "1", "--workers", "1", "--arena-size", arena_size
        )
        try:
            url = server.base_url + "/v1/chat/completions"
            with httpx.Client(timeout=60) as client:
                for r in range(rounds):
                    seed = 10 * r
                    fill = [png(seed, 112, 112), png(seed + 1, 168, 168), png(seed + 2, 112, 56)]
                    for image in [*fill, fill[0], fill[2]]:
                        body = image_request(model, image, mime="image/png")
                        assert client.post(url, json=body).status_code == 200
                    pair = [png(seed + 3, 168, 168), png(seed + 4, 168, 168)]
                    body = several_images_request(pair)
                    body["model"] = model
                    response = client.post(url, json=body)
                    code = "" if response.status_code == 200 else " " + response.json()["error"]["code"]
                    outcomes[f"{response.status_code}{code}"] += 1
            print(f"two 168x168 images after a scattered fill, {rounds} rounds: {dict(outcomes)}")
        finally:
            stop_and_check(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fill", type=int, default=6)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--too-many", type=int, default=7)
    parser.add_argument("--arena-size", default="1MiB")
    parser.add_argument("--hf", metavar="DIR", help="a Qwen2-VL checkpoint: the scattered-holes case instead")
    args = parser.parse_args()
    if args.hf:
        scattered_holes(args.hf, args.rounds, args.arena_size)
        return
    seed = 1000
    outcomes: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(
            "checksum",
            Path(tmp),
            "--frontends",
            "1",
            "--workers",
            "1",
            "--arena-size",
            args.arena_size,
            "--max-images",
            "8",
        )
        try:
            url = server.base_url + "/v1/chat/completions"
            with httpx.Client(timeout=60) as client:
                for _ in range(args.rounds):
                    for _ in range(args.fill):
                        seed += 1
                        one = noise_png(seed)
                        assert (
                            client.post(url, json=image_request("checksum", one, mime="image/png")).status_code == 200
                        )
                    images = [noise_png(seed + 1 + k) for k in range(args.images)]
                    seed += args.images
                    outcomes[outcome(client.post(url, json=several_images_request(images)), images)] += 1
                print(f"{args.images} new images after {args.fill} cached ones, {args.rounds} rounds: {dict(outcomes)}")
                images = [noise_png(seed + 1 + k) for k in range(args.too_many)]
                response = client.post(url, json=several_images_request(images))
                print(f"{args.too_many} new images: {outcome(response, images)}")
                if response.status_code != 200:
                    print(
                        f"  retry-after: {response.headers.get('retry-after')}; "
                        f"message: {response.json()['error']['message']}"
                    )
        finally:
            stop_and_check(server)


if __name__ == "__main__":
    main()
