"""Only supported llava-hf families get archived or loaded, with one message for both."""

from __future__ import annotations

import json

import pytest

from llava.core.families import FAMILIES, UnsupportedModel, checkpoint_family
from llava.tools.archive import build_archive


def checkpoint(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tmp_path


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_supported_model_types_are_read_from_config_json(tmp_path, model_type):
    assert checkpoint_family(checkpoint(tmp_path, model_type)).model_type == model_type


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava_next_video", None])
def test_other_model_types_are_refused_naming_the_supported_ones(tmp_path, model_type):
    with pytest.raises(UnsupportedModel, match="llava .*llava_next .*llava_onevision"):
        checkpoint_family(checkpoint(tmp_path, model_type))


def test_the_archive_refuses_before_packing_anything(tmp_path):
    store = tmp_path / "store"
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(SystemExit, match="qwen2_vl.*Supported: llava"):
        build_archive(checkpoint(tmp_path / "ckpt", "qwen2_vl"), store)
    assert not store.exists()


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no config.json"):
        build_archive(tmp_path, tmp_path / "store")
