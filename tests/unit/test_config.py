"""Server configuration: yaml section, LLAVA_* environment overrides, validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from llava.core.config import DTYPES, ServerConfig
from llava.core.params import Limits

YAML = """
handler:
  model_dir: /opt/ml/model
  model_source: llava-hf/llava-1.5-7b-hf
  device: cpu
  dtype: bfloat16
  max_sessions: 16
  session_ttl_s: 600
  device_budget_mb: 2048
  max_new_tokens: 512
  default_max_new_tokens: 128
  image_allow_http: true
  image_allow_hosts: [example.com, images.example.org]
  image_timeout_s: 7.5
"""


def from_env(**env: str) -> ServerConfig:
    return ServerConfig.from_mapping({}, {f"LLAVA_{k.upper()}": v for k, v in env.items()})


def test_defaults_are_valid() -> None:
    config = ServerConfig()
    assert config.device == "auto"
    assert config.dtype in DTYPES
    assert config.device_budget_bytes is None and config.host_budget_bytes is None
    assert ServerConfig.from_mapping(None, {}) == config
    assert ServerConfig.from_mapping({}, {}) == config


def test_from_mapping_reads_a_yaml_handler_section() -> None:
    section = yaml.safe_load(YAML)["handler"]
    config = ServerConfig.from_mapping(section, {})
    assert config.device == "cpu"
    assert config.dtype == "bfloat16"
    assert config.max_sessions == 16
    assert config.session_ttl_s == 600.0 and isinstance(config.session_ttl_s, float)
    assert config.device_budget_bytes == 2048 * 1024 * 1024
    assert config.max_new_tokens == 512
    assert config.default_max_new_tokens == 128
    assert config.image_allow_http is True
    assert config.image_allow_hosts == ("example.com", "images.example.org")
    assert config.image_timeout_s == 7.5


def test_yaml_float_with_integral_value_is_accepted_for_int() -> None:
    assert ServerConfig.from_mapping({"max_sessions": 16.0}, {}).max_sessions == 16


def test_yaml_numeric_strings_are_accepted_like_env_values() -> None:
    assert ServerConfig.from_mapping({"max_sessions": "8"}, {}).max_sessions == 8


def test_yaml_single_host_string_becomes_a_one_item_tuple() -> None:
    config = ServerConfig.from_mapping({"image_allow_hosts": "example.com"}, {})
    assert config.image_allow_hosts == ("example.com",)


def test_unknown_key_is_rejected_naming_it() -> None:
    with pytest.raises(ValueError, match="max_sesions"):
        ServerConfig.from_mapping({"max_sesions": 4}, {})


def test_archive_time_keys_are_ignored() -> None:
    config = ServerConfig.from_mapping({"model_dir": "/x", "model_source": "y"}, {})
    assert config == ServerConfig()


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("max_sessions", "3", 3),
        ("max_sessions", " 12 ", 12),
        ("session_ttl_s", "2.5", 2.5),
        ("session_ttl_s", "30", 30.0),
        ("device", "cuda:1", "cuda:1"),
        ("dtype", "float16", "float16"),
        ("image_allow_http", "true", True),
        ("image_allow_http", "TRUE", True),
        ("image_allow_http", "1", True),
        ("image_allow_http", "yes", True),
        ("image_allow_http", "false", False),
        ("image_allow_http", "0", False),
        ("image_allow_http", " off ", False),
        ("image_allow_hosts", "a.com, b.org,,c.net ", ("a.com", "b.org", "c.net")),
        ("image_allow_hosts", "a.com", ("a.com",)),
        ("image_allow_hosts", "", ()),
    ],
)
def test_env_overrides_are_parsed_to_the_field_type(name: str, raw: str, expected: Any) -> None:
    value = getattr(from_env(**{name: raw}), name)
    assert value == expected
    assert type(value) is type(expected)


def test_env_overrides_the_yaml_value() -> None:
    section = {"max_sessions": 16, "image_allow_http": True, "image_allow_hosts": ["x.com"]}
    env = {
        "LLAVA_MAX_SESSIONS": "2",
        "LLAVA_IMAGE_ALLOW_HTTP": "false",
        "LLAVA_IMAGE_ALLOW_HOSTS": "y.com,z.com",
    }
    config = ServerConfig.from_mapping(section, env)
    assert config.max_sessions == 2
    assert config.image_allow_http is False
    assert config.image_allow_hosts == ("y.com", "z.com")


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAVA_MAX_SESSIONS", "5")
    assert ServerConfig.from_mapping({}).max_sessions == 5


def test_env_prefix_and_case_matter() -> None:
    config = ServerConfig.from_mapping({}, {"MAX_SESSIONS": "2", "llava_max_sessions": "3"})
    assert config.max_sessions == ServerConfig().max_sessions


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("max_sessions", "many"),
        ("max_sessions", "2.5"),
        ("max_sessions", ""),
        ("session_ttl_s", "soon"),
        ("image_allow_http", "maybe"),
        ("image_allow_http", ""),
        ("max_sessions", "0"),
        ("max_sessions", "-1"),
        ("session_ttl_s", "0"),
        ("reaper_interval_s", "-5"),
        ("image_fetch_threads", "0"),
        ("max_prompt_tokens", "0"),
        ("dtype", "int8"),
        ("device", "tpu"),
    ],
)
def test_bad_env_values_name_the_field(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=f"(?i){name}"):
        from_env(**{name: raw})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_sessions", "eight"),
        ("max_sessions", True),
        ("max_sessions", 2.5),
        ("max_sessions", None),
        ("session_ttl_s", "ten"),
        ("session_ttl_s", [1]),
        ("image_allow_http", "true"),
        ("image_allow_http", 1),
        ("max_new_tokens", -3),
        ("dtype", "fp8"),
        ("device", "gpu"),
    ],
)
def test_bad_yaml_values_name_the_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        ServerConfig.from_mapping({name: value}, {})


@pytest.mark.parametrize(("default", "maximum"), [(0, 10), (11, 10), (-1, 10)])
def test_default_max_new_tokens_must_fit_the_maximum(default: int, maximum: int) -> None:
    with pytest.raises(ValueError, match="default_max_new_tokens"):
        ServerConfig(default_max_new_tokens=default, max_new_tokens=maximum)


def test_nan_ttl_is_rejected() -> None:
    with pytest.raises(ValueError, match="session_ttl_s"):
        from_env(session_ttl_s="nan")


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerConfig().max_sessions = 1  # type: ignore[misc]


def test_limits_property_carries_the_request_limits() -> None:
    config = ServerConfig(
        max_body_bytes=1000, max_prompt_chars=50, max_new_tokens=20, default_max_new_tokens=5
    )
    limits = config.limits
    assert isinstance(limits, Limits)
    assert limits.max_body_bytes == 1000
    assert limits.max_prompt_chars == 50
    assert limits.max_new_tokens == 20
    assert limits.default_max_new_tokens == 5
    assert limits.max_system_prompt_chars == Limits().max_system_prompt_chars


def test_budgets_in_mb_become_bytes() -> None:
    assert ServerConfig(host_budget_mb=3).host_budget_bytes == 3 * 1024 * 1024
    assert ServerConfig(device_budget_mb=0).device_budget_bytes is None


@pytest.mark.parametrize(
    ("configured", "usable", "torch_default", "expected"),
    [
        (0, 2, 2, 2),  # 2 cores: both for the step's forwards (bench/capacity.py)
        (0, 8, 4, 4),  # never more than torch's own default (its physical cores)
        (0, 4, 8, 4),  # never more than the CPUs the worker may use
        (0, 1, 1, 1),  # one core: one thread
        (3, 2, 2, 3),  # as configured
    ],
)
def test_torch_threads_use_the_worker_s_cpus(
    configured: int, usable: int, torch_default: int, expected: int
) -> None:
    from llava.engines.transformers.model.loading import torch_threads

    assert torch_threads(configured, usable, torch_default) == expected


def test_torchserve_keeps_every_session_answering_and_room_for_opens() -> None:
    """TorchServe's batchSize caps the requests in flight: below max_sessions it would cap
    the sessions answering at once, and an open waiting on its image holds a place too."""
    handler_dir = Path(__file__).resolve().parents[2] / "handler"
    archive = yaml.safe_load((handler_dir / "model-config.yaml").read_text())
    config = ServerConfig.from_mapping(archive["handler"], {})
    assert archive["batchSize"] >= config.max_sessions + 32
