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
image's digest. Usage (from the repository root; PYTHONPATH makes the children run this checkout):

    PYTHONPATH=$PWD python bench/arena_placement.py [--rounds 10] [--images 6] [--too-many 7]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--fill", type=int, default=6)
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--too-many", type=int, default=7)
    parser.add_argument("--arena-size", default="1MiB")
    args = parser.parse_args()
    seed = 1000
    outcomes: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server("checksum", Path(tmp), "--frontends", "1", "--workers", "1",
                              "--arena-size", args.arena_size, "--max-images", "8")
        try:
            url = server.base_url + "/v1/chat/completions"
            with httpx.Client(timeout=60) as client:
                for _ in range(args.rounds):
                    for _ in range(args.fill):
                        seed += 1
                        one = noise_png(seed)
                        assert client.post(url, json=image_request("checksum", one, mime="image/png")).status_code == 200
                    images = [noise_png(seed + 1 + k) for k in range(args.images)]
                    seed += args.images
                    outcomes[outcome(client.post(url, json=several_images_request(images)), images)] += 1
                print(f"{args.images} new images after {args.fill} cached ones, {args.rounds} rounds: {dict(outcomes)}")
                images = [noise_png(seed + 1 + k) for k in range(args.too_many)]
                response = client.post(url, json=several_images_request(images))
                print(f"{args.too_many} new images: {outcome(response, images)}")
                if response.status_code != 200:
                    print(f"  retry-after: {response.headers.get('retry-after')}; "
                          f"message: {response.json()['error']['message']}")
        finally:
            stop_and_check(server)


if __name__ == "__main__":
    main()
