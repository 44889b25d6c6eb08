"""shared/models.py: one parse of a --model spec, the same kind and public id for both halves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmgate.shared.models import ModelKind, model_id_for, parse_model_spec, resolve_model


def test_each_spec_form_names_its_kind_public_id_and_directory(tmp_path: Path) -> None:
    chat = tmp_path / "Qwen2-VL"
    chat.mkdir()
    (chat / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    embed = tmp_path / "siglip-small"
    embed.mkdir()
    (embed / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    assert parse_model_spec("efficientnet-lite0").kind is ModelKind.EFFICIENTNET
    assert parse_model_spec("checksum").public_id == "checksum"
    spec = parse_model_spec(f"hf:{chat}/")
    assert (spec.kind, spec.public_id, spec.directory) == (ModelKind.HF_CHAT, "Qwen2-VL", f"{chat}/")
    assert parse_model_spec(f"hf:{embed}").kind is ModelKind.HF_EMBED
    spec = parse_model_spec(f"checksum:hf:{chat}")
    assert (spec.kind, spec.public_id) == (ModelKind.CHECKSUM_HF, "checksum:Qwen2-VL")


@pytest.mark.parametrize("model", ["resnet50", "hf:", "checksum:hf:", "HF:/m/x", ""])
def test_an_unknown_spec_is_a_value_error_listing_the_known_forms(model: str) -> None:
    with pytest.raises(ValueError, match="known: efficientnet-lite0, checksum, hf:<directory>"):
        parse_model_spec(model)


def test_a_hub_cache_snapshot_is_served_as_its_repository_id_not_its_commit(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2-VL-2B-Instruct" / "snapshots" / "8c5a1d2b9e"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    assert parse_model_spec(f"hf:{snapshot}").public_id == "Qwen/Qwen2-VL-2B-Instruct"
    assert parse_model_spec(f"checksum:hf:{snapshot}/").public_id == "checksum:Qwen/Qwen2-VL-2B-Instruct"
    assert model_id_for(tmp_path / "snapshots" / "abc") == "abc"  # not a hub cache: the base name


def test_a_served_model_name_replaces_the_default_id_and_keeps_the_kind(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    spec = parse_model_spec(f"hf:{tmp_path}", "team/embedder")
    assert (spec.kind, spec.public_id, spec.directory) == (ModelKind.HF_EMBED, "team/embedder", str(tmp_path))
    assert parse_model_spec("checksum", "").public_id == "checksum"


def test_a_tilde_in_an_hf_directory_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m" / "Qwen2-VL").mkdir(parents=True)
    (tmp_path / "m" / "Qwen2-VL" / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = resolve_model("hf:~/m/Qwen2-VL")
    assert (spec.directory, spec.public_id) == (str(tmp_path / "m" / "Qwen2-VL"), "Qwen2-VL")


def test_a_missing_directory_and_a_directory_without_config_read_differently(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model(f"hf:{tmp_path / 'nope'}")
    (tmp_path / "snapshots").mkdir()
    with pytest.raises(ValueError, match=r"not a checkpoint \(no config.json in it\)"):
        resolve_model(f"hf:{tmp_path / 'snapshots'}")
