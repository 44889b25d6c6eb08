"""``--model org/name``: a Hugging Face hub id, served from the local Hugging Face cache or downloaded into it.

vLLM, SGLang and ``transformers serve`` take a hub id where shmgate took only a checkpoint directory
(``hf:<directory>``). ``resolve_hub_id`` turns the id into that directory, in the process that parses
the flag (the supervisor; a worker started by hand), so every child gets a directory and nothing
downstream knows about the hub:

1. the cache first (``snapshot_download(..., local_files_only=True)``: ``HF_HUB_CACHE``, else
   ``HF_HOME``/hub, else ~/.cache/huggingface/hub), so a machine without network serves what it has;
2. else a download into the cache, unless ``HF_HUB_OFFLINE`` is set;
3. else one line saying it is neither, and what to do.

The snapshot directory is served under the id itself (shared/models.py ``model_id_for`` reads it off
the cache's layout). huggingface_hub comes with the ``hf`` extra (transformers needs it); nothing here
imports it unless a hub id is given.
"""

from __future__ import annotations

import os
import re

__all__ = ["HubError", "is_hub_id", "resolve_hub_id"]

# org/name as the hub spells repository ids (letters, digits, - _ .), one slash
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = ("1", "true", "yes", "on")


class HubError(ValueError):
    """The id is neither in the cache nor downloadable; the message is the one line the user sees."""


def is_hub_id(text: str) -> bool:
    """``org/name`` that is not a local directory (a directory of that relative path is one, as transformers reads it)."""
    return bool(_HUB_ID.match(text)) and not os.path.isdir(text)


def _cache_dir() -> str:
    """Where huggingface_hub keeps snapshots, read at each call (its own constant is read once at import)."""
    hub_cache = os.environ.get("HF_HUB_CACHE")
    if hub_cache:
        return os.path.expanduser(hub_cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_hub_id(repo_id: str) -> str:
    """The local snapshot directory of ``repo_id``: cached, else downloaded. Raises HubError."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubError(
            f"{repo_id}: serving a Hugging Face hub id needs huggingface_hub: pip install 'shmgate[hf]'"
        ) from None
    cache = _cache_dir()
    try:
        return str(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or an incomplete snapshot: try the hub
        pass
    fix = (
        f"download it where the hub is reachable (hf download {repo_id}) or serve a local checkpoint as hf:<directory>"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        raise HubError(f"{repo_id}: not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; {fix}")
    try:
        return str(snapshot_download(repo_id, cache_dir=cache, endpoint=os.environ.get("HF_ENDPOINT") or None))
    except Exception as exc:  # no network, no such repository, a gated one: say which, in one line
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise HubError(
            f"{repo_id}: not in the Hugging Face cache ({cache}) and the hub could not provide it "
            f"({type(exc).__name__}: {why}); {fix}"
        ) from None
