"""``--model org/name``: a Hugging Face hub id served from the local cache (shared/hub.py), and one line when it
is neither cached nor downloadable. No network: the cache is a directory laid out as huggingface_hub lays
it out, and the hub is either switched off (HF_HUB_OFFLINE) or an address that refuses connections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmgate.node.cli import build_parser, parse_config
from shmgate.node.config import gateway_of
from shmgate.node.plan import declared_models

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached(cache: Path, repo_id: str, config: dict[str, object]) -> Path:
    """A snapshot of ``repo_id`` in the hub cache ``cache``: refs/main names the commit, snapshots/<commit> holds the files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def test_a_cached_hub_id_is_served_from_its_snapshot_under_its_own_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = _cached(tmp_path / "hub", "team/tiny-vlm", {"model_type": "qwen2_vl"})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone: no download is tried
    config = parse_config(["serve", "--model", "team/tiny-vlm"])
    assert gateway_of(config).model.model == (f"hf:{snapshot}",)
    [model] = declared_models(config)
    assert model.public_id == "team/tiny-vlm"  # what clients send: the id, not the commit directory


@pytest.mark.parametrize(
    ("environ", "why"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
        ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "the hub could not provide it"),
    ],
)
def test_a_hub_id_neither_cached_nor_downloadable_is_one_line_saying_so(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    environ: dict[str, str],
    why: str,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", "--model", "team/absent"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "argument --model: team/absent: not in the Hugging Face cache" in err and why in err, err
    assert "hf download team/absent" in err and "hf:<directory>" in err, err


def test_a_relative_directory_is_not_taken_for_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmgate.shared.hub import is_hub_id

    monkeypatch.chdir(tmp_path)
    assert is_hub_id("team/model")
    (tmp_path / "team" / "model").mkdir(parents=True)
    assert not is_hub_id("team/model")
    assert not is_hub_id("efficientnet-lite0") and not is_hub_id("hf:/models/x") and not is_hub_id("a/b/c")
