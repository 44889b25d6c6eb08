"""shared/models.py: one parse of a --model spec, the same kind and public id for both halves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.models import ModelKind, parse_model_spec


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
