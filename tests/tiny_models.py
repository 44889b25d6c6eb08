"""``python -m tests.tiny_models FAMILY DIR``: write a tiny, randomly initialised checkpoint to DIR, offline.

The checkpoints the tests serve, for people to serve too (``shmgate serve --model hf:DIR``): the chat
families of tests/hf_fixture.py (``FAMILIES``: qwen2_vl, llava, idefics3, ...) and the embedders of
tests/embed_fixture.py (clip, siglip, siglip2, which serve ``/v1/embeddings``). Nothing is downloaded:
the family's real config, model classes and image processor, a tokenizer trained on the spot, random
weights from a fixed seed (the text a chat model writes is gibberish; the vectors mean nothing). Run it
from the repository root with the project's venv; scripts/try_hf.sh builds and serves one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.embed_fixture import build_tiny_embedder
from tests.hf_fixture import FAMILIES, build_tiny_vlm

EMBEDDERS = ("clip", "siglip", "siglip2")
NAMES = (*FAMILIES, *EMBEDDERS)


def unknown_family(family: str) -> str:
    """The one line a wrong name gets: every valid one, chat families first."""
    return (
        f"unknown family {family!r}; chat: {', '.join(FAMILIES)}; embeddings (/v1/embeddings): {', '.join(EMBEDDERS)}"
    )


def build(family: str, path: Path) -> Path:
    """Write ``family``'s tiny checkpoint into ``path`` (created if needed). Raises ValueError for a name
    not in NAMES, saying which are."""
    if family in EMBEDDERS:
        return build_tiny_embedder(family, path)
    if family in FAMILIES:
        return build_tiny_vlm(path, family)
    raise ValueError(unknown_family(family))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.tiny_models", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("family", help=f"one of: {', '.join(NAMES)}")
    parser.add_argument("dir", type=Path, help="the checkpoint's directory (its name is the served model id)")
    args = parser.parse_args(argv)
    if args.family not in NAMES:
        print(f"{parser.prog}: {unknown_family(args.family)}", file=sys.stderr)
        return 2
    build(args.family, args.dir)
    print(f"{args.dir}: a tiny random {args.family} checkpoint; serve it with: shmgate serve --model hf:{args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
