"""DeploySpec: what to deploy, validated, and the exact SageMaker request parameters it makes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from llava.tools.deploy.names import parse_s3_uri, validate_name

ROLE_ARN_RE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
VARIANT = "AllTraffic"
SAGEMAKER_BODY_LIMIT = 6 * 1024 * 1024
# TorchServe's own request limit, above SageMaker's: a body between the two reaches the kit, which
# refuses it with a JSON 413 naming the limit (TorchServe's own 413 has no body).
TORCHSERVE_REQUEST_LIMIT = 16 * 1024 * 1024
# Seconds TorchServe waits for one handler message before restarting the worker (which loses
# every session in it). The Dockerfile sets the same; repeating it in the model's Environment
# keeps a deployment correct on an image built without it. model-config.yaml's per-model
# responseTimeout still wins over both.
TS_RESPONSE_TIMEOUT_S = 300
# The images' vLLM wheel runs torch 2.13 built for CUDA 13, which needs NVIDIA driver 580: of
# SageMaker's inference AMIs (ProductionVariant.InferenceAmiVersion) only this one has it; the
# others carry drivers 535 and 550 (CUDA 12.2, 12.4). It applies to GPU instance types only.
GPU_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"
GPU_INSTANCE_RE = re.compile(r"^ml\.(g|gr|p)\d")
# How requests without a session id reach an instance (ProductionVariantRoutingConfig): the
# least busy one, a random one, or the one that got requests sharing this one's start
# (PREFIX_AWARE: what lets header-less chats find the instance that holds their conversation).
ROUTING = {
    "least-outstanding": "LEAST_OUTSTANDING_REQUESTS",
    "random": "RANDOM",
    "prefix-aware": "PREFIX_AWARE",
}
# PrefixAwareRoutingConfig's bounds (SageMaker's API model): bytes of an InvokeEndpoint body, or
# characters of an OpenAI chat's message text; requests in flight on the chosen instance.
PREFIX_LENGTH_RANGE = (1024, 65536)
CONCURRENCY_THRESHOLD_RANGE = (1, 1024)
PREFIX_LENGTH = 4096  # a system prompt and the start of what follows it
CONCURRENCY_THRESHOLD = 16


def _known_llava_env() -> dict[str, str]:
    from dataclasses import fields

    from llava.core.config import ENV_PREFIX, ServerConfig

    return {ENV_PREFIX + f.name.upper(): f.name for f in fields(ServerConfig)}


def _check_llava_env(environment: Mapping[str, str]) -> None:
    """Refuse unknown LLAVA_* names and values the worker would reject at start-up."""
    import yaml

    from llava.core.config import ENV_PREFIX, ServerConfig
    from llava.tools.archive import MODEL_CONFIG

    known = _known_llava_env()
    for key in environment:
        if key.startswith(ENV_PREFIX) and key not in known:
            raise ValueError(f"unknown setting {key}: the worker reads {', '.join(sorted(known))}")
    section = (yaml.safe_load(MODEL_CONFIG.read_text()) or {}).get("handler") or {}
    llava_env = {k: v for k, v in environment.items() if k in known}
    try:
        ServerConfig.from_mapping(section, env=llava_env)
    except ValueError as exc:
        raise ValueError(f"the worker would refuse these settings: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class DeploySpec:
    """What to deploy and where. Only `image_uri` and `role_arn` have no default.

    - `model_data_s3`: the S3 prefix of an unpacked archive (from `upload_archive`), or None for
      an image with the archive baked into /opt/ml/model (build_and_push.sh with MODEL_DIR).
    - `session_ttl_s` becomes LLAVA_SESSION_TTL_S; `settings` sets other worker settings by
      name (`{"max_sessions": 32}` -> LLAVA_MAX_SESSIONS=32), checked as the worker would;
      `env` adds raw environment variables and wins over everything else.
    - The two timeouts (60-3600 s) cover downloading ~14 GB of 7B weights and loading them on the
      GPU before /ping answers.
    - `routing` ("least-outstanding", "random", "prefix-aware", or None for SageMaker's default)
      sends requests without a session id; prefix-aware routing keys on the first
      `prefix_length` bytes of a body (characters of an OpenAI chat's text) and moves to another
      instance when `concurrency_threshold` requests are in flight on the chosen one.
    - `inference_component=True` deploys the model as an inference component on an endpoint
      without a model, reserving `accelerators` GPUs, `memory_mb` of host memory (and
      `cpu_cores` if set) per copy, with `copy_count` copies.
    """

    image_uri: str
    role_arn: str
    name: str = "llava"
    model_data_s3: str | None = None
    instance_type: str = "ml.g5.2xlarge"
    instance_count: int = 1
    session_ttl_s: float = 1200
    settings: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    model_data_download_timeout_s: int = 1800
    container_startup_health_check_timeout_s: int = 1800
    variant_name: str = VARIANT
    inference_component: bool = False
    accelerators: int = 1
    memory_mb: int = 16384
    cpu_cores: float | None = None
    copy_count: int = 1
    inference_ami: str | None = GPU_AMI
    routing: str | None = None
    prefix_length: int = PREFIX_LENGTH
    concurrency_threshold: int = CONCURRENCY_THRESHOLD

    def __post_init__(self) -> None:
        validate_name(self.name)
        validate_name(self.variant_name, "variant name")
        if not self.image_uri or re.search(r"\s", self.image_uri) or len(self.image_uri) > 255:
            raise ValueError(
                f"image_uri {self.image_uri!r}: give the ECR image URI printed by "
                "./build_and_push.sh, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/"
                "llava-sessions:abc1234"
            )
        if not ROLE_ARN_RE.fullmatch(self.role_arn or ""):
            raise ValueError(
                f"role_arn {self.role_arn!r} is not an IAM role ARN "
                "(arn:aws:iam::123456789012:role/NAME): give the SageMaker execution role"
            )
        if self.model_data_s3 is not None:
            bucket, prefix = parse_s3_uri(self.model_data_s3)
            object.__setattr__(self, "model_data_s3", f"s3://{bucket}/{prefix}")
        if not re.fullmatch(r"ml\.[a-z0-9-]+\.[a-z0-9]+", self.instance_type):
            raise ValueError(f"instance_type {self.instance_type!r}: expected e.g. ml.g5.2xlarge")
        if self.inference_ami is not None and not re.fullmatch(
            r"al2(023)?-ami-sagemaker-inference-gpu-[0-9-]+", self.inference_ami
        ):
            raise ValueError(
                f"inference_ami {self.inference_ami!r}: expected a SageMaker GPU inference AMI "
                f"such as {GPU_AMI} (see ProductionVariant.InferenceAmiVersion)"
            )
        for attr in ("instance_count", "copy_count", "accelerators", "memory_mb"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{attr} must be a positive integer, got {value!r}")
        if self.memory_mb < 128:
            raise ValueError(f"memory_mb must be at least 128, got {self.memory_mb}")
        if self.cpu_cores is not None and self.cpu_cores < 0.25:
            raise ValueError(f"cpu_cores must be at least 0.25, got {self.cpu_cores}")
        for attr in ("model_data_download_timeout_s", "container_startup_health_check_timeout_s"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or not 60 <= value <= 3600:
                raise ValueError(f"{attr} must be an integer from 60 to 3600 s, got {value!r}")
        self._check_routing()
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be positive, got {self.session_ttl_s}")
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "env", MappingProxyType({k: str(v) for k, v in self.env.items()}))
        if "session_ttl_s" in self.settings or "LLAVA_SESSION_TTL_S" in self.env:
            raise ValueError("set the session TTL with session_ttl_s, not settings or env")
        self.environment()  # validates

    def _check_routing(self) -> None:
        if self.routing is not None and self.routing not in ROUTING:
            raise ValueError(f"routing {self.routing!r}: one of {', '.join(ROUTING)}")
        for attr, (low, high) in (
            ("prefix_length", PREFIX_LENGTH_RANGE),
            ("concurrency_threshold", CONCURRENCY_THRESHOLD_RANGE),
        ):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{attr} must be an integer from {low} to {high}, got {value!r}")

    def routing_config(self) -> dict[str, Any] | None:
        """The variant's RoutingConfig (an inference component's copies: the least busy)."""
        routing = self.routing or ("least-outstanding" if self.inference_component else None)
        if routing is None:
            return None
        config: dict[str, Any] = {"RoutingStrategy": ROUTING[routing]}
        if routing == "prefix-aware":
            config["PrefixAwareRoutingConfig"] = {
                "PrefixLength": self.prefix_length,
                "ConcurrencyThreshold": self.concurrency_threshold,
            }
        return config

    def environment(self) -> dict[str, str]:
        """The container's Environment: worker count, TorchServe limits, LLAVA_* settings."""
        from llava.core.config import ENV_PREFIX

        known = _known_llava_env()
        env = {
            # One TorchServe worker owns every session of an instance (sessions live in its
            # memory); model-config.yaml pins minWorkers/maxWorkers to 1 as well.
            "SAGEMAKER_MODEL_SERVER_WORKERS": "1",
            "SAGEMAKER_MODEL_SERVER_TIMEOUT": str(TS_RESPONSE_TIMEOUT_S),
            "TS_DEFAULT_RESPONSE_TIMEOUT": str(TS_RESPONSE_TIMEOUT_S),
            # Above SageMaker's 6 MiB body limit, which the kit enforces itself with a JSON 413
            # (TorchServe's default is slightly smaller, and its 413 has no body).
            "TS_MAX_REQUEST_SIZE": str(TORCHSERVE_REQUEST_LIMIT),
            "TS_MAX_RESPONSE_SIZE": str(SAGEMAKER_BODY_LIMIT),
            "LLAVA_SESSION_TTL_S": _env_value(self.session_ttl_s),
        }
        for setting, value in self.settings.items():
            key = ENV_PREFIX + str(setting).upper()
            if key not in known:
                names = ", ".join(sorted(known.values()))
                raise ValueError(f"unknown worker setting {setting!r}; known: {names}")
            env[key] = _env_value(value)
        env.update(self.env)
        if len(env) > 100:
            raise ValueError(f"SageMaker allows 100 environment variables, this has {len(env)}")
        for key, value in env.items():
            if not ENV_KEY_RE.fullmatch(key) or len(key) > 1024:
                raise ValueError(f"invalid environment variable name {key!r}")
            if len(value) > 1024:
                raise ValueError(f"environment variable {key} is longer than 1024 characters")
        _check_llava_env(env)
        return env

    # The exact request parameters, separate from the calls so that they can be read and tested.

    def create_model_params(self, model_name: str) -> dict[str, Any]:
        container: dict[str, Any] = {"Image": self.image_uri, "Environment": self.environment()}
        if self.model_data_s3:
            container["ModelDataSource"] = {
                "S3DataSource": {
                    "S3Uri": self.model_data_s3,
                    "S3DataType": "S3Prefix",
                    "CompressionType": "None",
                }
            }
        return {
            "ModelName": model_name,
            "PrimaryContainer": container,
            "ExecutionRoleArn": self.role_arn,
        }

    def create_endpoint_config_params(self, config_name: str, model_name: str) -> dict[str, Any]:
        variant: dict[str, Any] = {
            "VariantName": self.variant_name,
            "InstanceType": self.instance_type,
            "InitialInstanceCount": self.instance_count,
            "ModelDataDownloadTimeoutInSeconds": self.model_data_download_timeout_s,
            "ContainerStartupHealthCheckTimeoutInSeconds": (
                self.container_startup_health_check_timeout_s
            ),
        }
        if self.inference_ami and GPU_INSTANCE_RE.match(self.instance_type):
            variant["InferenceAmiVersion"] = self.inference_ami
        params: dict[str, Any] = {"EndpointConfigName": config_name}
        if self.inference_component:
            # An endpoint without a model: the inference component brings it.
            params["ExecutionRoleArn"] = self.role_arn
        else:
            variant["ModelName"] = model_name
            variant["InitialVariantWeight"] = 1.0
        routing = self.routing_config()
        if routing is not None:
            variant["RoutingConfig"] = routing
        params["ProductionVariants"] = [variant]
        return params

    def create_inference_component_params(
        self, component_name: str, model_name: str
    ) -> dict[str, Any]:
        compute: dict[str, Any] = {
            "NumberOfAcceleratorDevicesRequired": self.accelerators,
            "MinMemoryRequiredInMb": self.memory_mb,
        }
        if self.cpu_cores is not None:
            compute["NumberOfCpuCoresRequired"] = self.cpu_cores
        return {
            "InferenceComponentName": component_name,
            "EndpointName": self.name,
            "VariantName": self.variant_name,
            "Specification": {
                "ModelName": model_name,
                "StartupParameters": {
                    "ModelDataDownloadTimeoutInSeconds": self.model_data_download_timeout_s,
                    "ContainerStartupHealthCheckTimeoutInSeconds": (
                        self.container_startup_health_check_timeout_s
                    ),
                },
                "ComputeResourceRequirements": compute,
            },
            "RuntimeConfig": {"CopyCount": self.copy_count},
        }


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)
