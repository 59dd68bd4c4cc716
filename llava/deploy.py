"""Deploy the kit to a SageMaker real-time endpoint with plain boto3.

Three steps, each usable on its own:

- `upload_archive`: an unpacked TorchServe archive (`--archive-format no-archive`, a directory
  with MAR-INF/MANIFEST.json) goes to an S3 prefix file by file, uncompressed, with a progress
  bar and multipart uploads for big files. SageMaker copies that prefix into /opt/ml/model
  (`S3DataType=S3Prefix`, `CompressionType=None`): no tarball to build, no unpacking at start-up.
- `deploy(DeploySpec(...))`: CreateModel, CreateEndpointConfig, CreateEndpoint (and, in the
  optional inference-component mode, CreateInferenceComponent), then waits for InService with a
  progress line per poll, or raises with SageMaker's FailureReason.
- `delete(name)`: removes what `deploy` made (inference components, endpoint, endpoint configs,
  models), and on request the S3 model data and the ECR repository; already-missing pieces are
  reported, not errors.

Names: the endpoint is called `spec.name`; the model, endpoint config and inference component
are `<name>-<UTC yyyymmdd-HHMMSS>`, so that a redeployment (`update=True`) never collides with
the configuration still serving, and `delete` can find leftovers by that exact pattern.

The sagemaker Python SDK is never needed; `discover_role` and `discover_bucket` import it lazily
for notebook conveniences only.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
ROLE_ARN_RE = re.compile(r"^arn:aws[a-z\-]*:iam::\d{12}:role/?[a-zA-Z_0-9+=,.@\-_/]+$")
ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
STAMP_RE = r"\d{8}-\d{6}"
STAMP_LEN = 15  # yyyymmdd-HHMMSS
MAX_NAME = 63
VARIANT = "AllTraffic"
SAGEMAKER_BODY_LIMIT = 6 * 1024 * 1024
# Seconds TorchServe waits for one handler message before restarting the worker (which loses
# every session in it). The Dockerfile sets the same; repeating it in the model's Environment
# keeps a deployment correct on an image built without it. model-config.yaml's per-model
# responseTimeout still wins over both.
TS_RESPONSE_TIMEOUT_S = 300
MULTIPART_BYTES = 64 * 1024 * 1024

Progress = Callable[[str], None]
ByteProgress = Callable[[int, int], None]


class DeployError(RuntimeError):
    """A deployment step could not be done; the message says what to change."""


class EndpointExistsError(DeployError):
    """The endpoint already exists and `update` was not asked for."""


class DeploymentFailedError(DeployError):
    """SageMaker reported a failure; `reason` is its FailureReason."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- Names and URIs ---------------------------------------------------------------------------


def validate_name(name: str, what: str = "endpoint name") -> str:
    """Return `name` if SageMaker accepts it (^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}), else raise."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        hint = ""
        if isinstance(name, str):
            bad = sorted(set(re.findall(r"[^a-zA-Z0-9-]", name)))
            if not name:
                hint = " (it is empty)"
            elif bad:
                hint = f" (it contains {''.join(bad)!r}; only letters, digits and hyphens)"
            elif len(name) > MAX_NAME:
                hint = f" (it has {len(name)} characters; at most {MAX_NAME})"
            else:
                hint = " (it must start and end with a letter or digit)"
        suggestion = re.sub(r"[^a-zA-Z0-9]+", "-", str(name)).strip("-")[:MAX_NAME].strip("-")
        raise ValueError(
            f"invalid SageMaker {what} {name!r}{hint}: use 1-63 letters, digits and hyphens, "
            f"starting and ending with a letter or digit"
            + (f", e.g. {suggestion!r}" if suggestion and suggestion != name else "")
        )
    return name


def _base(name: str) -> str:
    return name[: MAX_NAME - STAMP_LEN - 1].rstrip("-")


def resource_name(name: str, stamp: str) -> str:
    """`<name>-<stamp>`, with `name` shortened so that the result fits 63 characters."""
    return validate_name(f"{_base(name)}-{stamp}", "resource name")


def _stamp_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(_base(name))}-{STAMP_RE}")


def parse_s3_uri(uri: str, *, require_prefix: bool = True) -> tuple[str, str]:
    """Split `s3://bucket/some/prefix` into (bucket, "some/prefix/")."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", uri or "")
    if not match:
        raise ValueError(f"not an S3 URI: {uri!r} (expected s3://bucket/prefix/)")
    bucket, prefix = match.group(1), (match.group(2) or "").strip("/")
    if require_prefix and not prefix:
        raise ValueError(
            f"{uri!r} names a whole bucket: give a prefix, e.g. s3://{bucket}/llava-sessions/llava/"
        )
    return bucket, f"{prefix}/" if prefix else ""


def _client(service: str, client: Any, region: str | None = None) -> Any:
    if client is not None:
        return client
    import boto3

    return boto3.client(service, region_name=region) if region else boto3.client(service)


def _error_code(err: Exception) -> str:
    return getattr(err, "response", {}).get("Error", {}).get("Code", "")


def _is_missing(err: Exception) -> bool:
    """SageMaker answers a missing resource with ValidationException 'Could not find ...'."""
    from botocore.exceptions import ClientError

    if not isinstance(err, ClientError):
        return False
    code = _error_code(err)
    message = str(err.response.get("Error", {}).get("Message", "")).lower()
    if code in ("ResourceNotFound", "ResourceNotFoundException", "RepositoryNotFoundException"):
        return True
    return code == "ValidationException" and (
        "could not find" in message or "does not exist" in message
    )


# --- Upload ------------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _default_byte_progress(total: int, label: str) -> tuple[ByteProgress, Callable[[], None]]:
    """A tqdm bar on stderr when tqdm is installed, else a line every 5%."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the engine extra
        tqdm = None
    if tqdm is not None:
        bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=sys.stderr
        )

        def update(done: int, _total: int) -> None:
            bar.update(done - bar.n)

        return update, bar.close
    last = [-1]

    def report(done: int, all_bytes: int) -> None:  # pragma: no cover
        step = int(20 * done / all_bytes) if all_bytes else 20
        if step != last[0]:
            last[0] = step
            _stderr(f"{label}: {_human(done)} / {_human(all_bytes)} ({5 * step}%)")

    return report, lambda: None


def upload_archive(
    archive_dir: str | Path,
    s3_uri: str,
    *,
    s3_client: Any = None,
    progress: ByteProgress | None = None,
    transfer_config: Any = None,
) -> str:
    """Upload an unpacked TorchServe archive under an S3 prefix; return the prefix URI.

    Every file of `archive_dir` lands at `s3://bucket/prefix/<relative path>`, uncompressed,
    which is what SageMaker's `S3DataType=S3Prefix, CompressionType=None` copies to
    /opt/ml/model. Files above 64 MiB go up in parallel multipart chunks. `progress(done, total)`
    receives bytes uploaded so far (from several threads; calls are serialized); by default a
    progress bar goes to stderr.

    The prefix must not hold objects outside the archive: SageMaker would copy them into
    /opt/ml/model too and serve a mix of two archives. Objects with the same keys are replaced.
    """
    root = Path(archive_dir)
    if not (root / "MAR-INF" / "MANIFEST.json").is_file():
        detail = "is not a directory" if not root.is_dir() else "has no MAR-INF/MANIFEST.json"
        raise DeployError(
            f"{root} {detail}: SageMaker needs an unpacked TorchServe archive. Build one with "
            "`python -m llava archive --format no-archive --out model-store` (the archive is "
            "model-store/llava), not a .mar or .tar.gz"
        )
    bucket, prefix = parse_s3_uri(s3_uri)
    s3 = _client("s3", s3_client)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    keys = {prefix + p.relative_to(root).as_posix(): p for p in files}

    stale: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        stale.extend(o["Key"] for o in page.get("Contents", []) if o["Key"] not in keys)
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise DeployError(
            f"s3://{bucket}/{prefix} already holds objects that are not part of this archive "
            f"({shown}): SageMaker would copy them into /opt/ml/model as well. Upload to an "
            f"empty prefix, or empty this one first (aws s3 rm --recursive s3://{bucket}/{prefix})"
        )

    total = sum(p.stat().st_size for p in files)
    label = "upload"
    _stderr(f"uploading {len(files)} files ({_human(total)}) from {root} to s3://{bucket}/{prefix}")
    close: Callable[[], None] = lambda: None  # noqa: E731
    if progress is None:
        progress, close = _default_byte_progress(total, label)
    if transfer_config is None:
        from boto3.s3.transfer import TransferConfig

        transfer_config = TransferConfig(
            multipart_threshold=MULTIPART_BYTES,
            multipart_chunksize=MULTIPART_BYTES,
            max_concurrency=8,
        )
    lock = threading.Lock()
    done = [0]

    def callback(n: int) -> None:
        with lock:
            done[0] += n
            progress(done[0], total)

    try:
        progress(0, total)
        for key, path in keys.items():
            s3.upload_file(str(path), bucket, key, Config=transfer_config, Callback=callback)
    finally:
        close()
    return f"s3://{bucket}/{prefix}"


def delete_s3_prefix(s3_uri: str, *, s3_client: Any = None) -> int:
    """Delete every object under an S3 prefix (never a whole bucket); return how many."""
    bucket, prefix = parse_s3_uri(s3_uri)
    s3 = _client("s3", s3_client)
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(objects), 1000):
            batch = objects[i : i + 1000]
            answer = s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise DeployError(
                    f"could not delete s3://{bucket}/{first.get('Key')}: {first.get('Message')}"
                )
            count += len(batch)
    return count


# --- The deployment spec ------------------------------------------------------------------------


def _known_llava_env() -> dict[str, str]:
    from dataclasses import fields

    from llava.config import ENV_PREFIX, ServerConfig

    return {ENV_PREFIX + f.name.upper(): f.name for f in fields(ServerConfig)}


def _check_llava_env(environment: Mapping[str, str]) -> None:
    """Refuse unknown LLAVA_* names and values the worker would reject at start-up."""
    import yaml

    from llava.archive import MODEL_CONFIG
    from llava.config import ENV_PREFIX, ServerConfig

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
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be positive, got {self.session_ttl_s}")
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "env", MappingProxyType({k: str(v) for k, v in self.env.items()}))
        if "session_ttl_s" in self.settings or "LLAVA_SESSION_TTL_S" in self.env:
            raise ValueError("set the session TTL with session_ttl_s, not settings or env")
        self.environment()  # validates

    def environment(self) -> dict[str, str]:
        """The container's Environment: worker count, TorchServe limits, LLAVA_* settings."""
        from llava.config import ENV_PREFIX

        known = _known_llava_env()
        env = {
            # One TorchServe worker owns every session of an instance (sessions live in its
            # memory); model-config.yaml pins minWorkers/maxWorkers to 1 as well.
            "SAGEMAKER_MODEL_SERVER_WORKERS": "1",
            "SAGEMAKER_MODEL_SERVER_TIMEOUT": str(TS_RESPONSE_TIMEOUT_S),
            "TS_DEFAULT_RESPONSE_TIMEOUT": str(TS_RESPONSE_TIMEOUT_S),
            # SageMaker's 6 MiB body limit (TorchServe's default is slightly smaller).
            "TS_MAX_REQUEST_SIZE": str(SAGEMAKER_BODY_LIMIT),
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
        params: dict[str, Any] = {"EndpointConfigName": config_name}
        if self.inference_component:
            # An endpoint without a model: the inference component brings it. New sessions go to
            # the copy with the fewest outstanding requests.
            variant["RoutingConfig"] = {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
            params["ExecutionRoleArn"] = self.role_arn
        else:
            variant["ModelName"] = model_name
            variant["InitialVariantWeight"] = 1.0
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


@dataclass(frozen=True)
class Deployment:
    """What `deploy` created."""

    endpoint_name: str
    endpoint_config_name: str
    model_name: str
    inference_component_name: str | None = None
    model_data_s3: str | None = None
    status: str = "Creating"
    region: str | None = None

    def client_snippet(self) -> str:
        """Python that opens a session on this endpoint with the kit's client."""
        args = [repr(self.endpoint_name)]
        if self.region:
            args.append(f"region_name={self.region!r}")
        if self.inference_component_name:
            args.append(f"inference_component={self.inference_component_name!r}")
        lines = [
            "from llava.client import SessionClient",
            "",
            f"client = SessionClient.for_endpoint({', '.join(args)})",
            'with client.session(image="s3://my-bucket/images/cat.png") as s:',
            '    print(s.ask("What is in this picture?").text)',
            '    for delta in s.stream("Describe it in detail."):',
            '        print(delta, end="", flush=True)',
        ]
        return "\n".join(lines)


# --- Waiting -----------------------------------------------------------------------------------


def _elapsed(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s"


def _wait_status(
    describe: Callable[[], dict[str, Any]],
    *,
    what: str,
    status_key: str,
    failed: tuple[str, ...],
    poll_s: float,
    timeout_s: float,
    progress: Progress,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    hint: str = "",
    busy: tuple[str, ...] = ("Creating", "Updating", "SystemUpdating", "RollingBack"),
) -> dict[str, Any]:
    """Poll until the status leaves `busy`; raise on a failed status or at the deadline."""
    start = clock()
    while True:
        desc = describe()
        status = desc.get(status_key, "?")
        elapsed = clock() - start
        progress(f"{what}: {status} ({_elapsed(elapsed)} elapsed)")
        if status in failed:
            reason = desc.get("FailureReason") or "SageMaker gave no FailureReason"
            raise DeploymentFailedError(f"{what} is {status}: {reason}{hint}", reason)
        if status not in busy:
            return desc
        if elapsed >= timeout_s:
            raise DeployError(
                f"{what} is still {status} after {_elapsed(elapsed)}; nothing was deleted" + hint
            )
        sleep(poll_s)


def _wait_gone(
    describe: Callable[[], Any],
    *,
    what: str,
    poll_s: float,
    timeout_s: float,
    progress: Progress,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
) -> None:
    start = clock()
    while True:
        try:
            desc = describe()
        except Exception as exc:
            if _is_missing(exc):
                progress(f"{what}: deleted ({_elapsed(clock() - start)})")
                return
            raise
        elapsed = clock() - start
        status = desc.get("EndpointStatus") or desc.get("InferenceComponentStatus") or "?"
        progress(f"{what}: {status} ({_elapsed(elapsed)} elapsed)")
        if elapsed >= timeout_s:
            raise DeployError(f"{what} is still {status} after {_elapsed(elapsed)}")
        sleep(poll_s)


def _describe_or_none(call: Callable[..., dict[str, Any]], **params: Any) -> dict[str, Any] | None:
    try:
        return call(**params)
    except Exception as exc:
        if _is_missing(exc):
            return None
        raise


# --- Deploy ------------------------------------------------------------------------------------


def deploy(
    spec: DeploySpec,
    *,
    sm_client: Any = None,
    wait: bool = True,
    update: bool = False,
    poll_s: float = 30,
    timeout_s: float | None = None,
    progress: Progress = _stderr,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
) -> Deployment:
    """Create the model, endpoint config and endpoint (and inference component); wait for it.

    An existing endpoint named `spec.name` is an `EndpointExistsError` unless `update=True`: then
    a new model and endpoint config are created and `UpdateEndpoint` switches the endpoint to
    them (SageMaker replaces the instances behind it without downtime; open sessions on the old
    instances are lost). After a successful, waited update the old config and model are deleted.
    `update` is not supported in inference-component mode.

    With `wait=False` the call returns after CreateEndpoint; in inference-component mode it
    still waits for the endpoint, since the component can only be created on an InService
    endpoint, and returns without waiting for the component. On `Failed`, DeploymentFailedError
    carries FailureReason; the resources are left for inspection (`delete(spec.name)` removes them).
    """
    sm = _client("sagemaker", sm_client)
    region = getattr(getattr(sm, "meta", None), "region_name", None)
    timeout = timeout_s or (
        spec.model_data_download_timeout_s + spec.container_startup_health_check_timeout_s + 1800
    )
    waits = dict(poll_s=poll_s, timeout_s=timeout, progress=progress, sleep=sleep, clock=clock)
    hint = f"\n(see CloudWatch log group /aws/sagemaker/Endpoints/{spec.name}; "
    hint += f"remove it with `python -m llava delete --name {spec.name}`)"

    existing = _describe_or_none(sm.describe_endpoint, EndpointName=spec.name)
    if existing is not None:
        if not update:
            raise EndpointExistsError(
                f"endpoint {spec.name!r} already exists ({existing.get('EndpointStatus')}): "
                f"delete it first (python -m llava delete --name {spec.name}), deploy under "
                "another name, or redeploy in place with update=True (--update)"
            )
        if spec.inference_component:
            raise DeployError(
                "update=True is not supported in inference-component mode: delete the endpoint "
                "first, or deploy under another name"
            )
        if existing.get("EndpointStatus") != "InService":
            raise DeployError(
                f"endpoint {spec.name!r} is {existing.get('EndpointStatus')}; SageMaker updates "
                "only InService endpoints: wait for it, or delete it and deploy again"
            )

    stamp = now().astimezone(timezone.utc).strftime("%Y%m%d-%H%M%S")
    model_name = resource_name(spec.name, stamp)
    config_name = resource_name(spec.name, stamp)
    component_name = resource_name(spec.name, stamp) if spec.inference_component else None

    created: list[tuple[str, str]] = []
    try:
        progress(f"creating model {model_name} ({spec.image_uri})")
        sm.create_model(**spec.create_model_params(model_name))
        created.append(("model", model_name))
        progress(
            f"creating endpoint config {config_name} ({spec.instance_count} x {spec.instance_type})"
        )
        sm.create_endpoint_config(**spec.create_endpoint_config_params(config_name, model_name))
        created.append(("endpoint config", config_name))
        if existing is not None:
            progress(f"updating endpoint {spec.name} to {config_name}")
            sm.update_endpoint(EndpointName=spec.name, EndpointConfigName=config_name)
        else:
            progress(f"creating endpoint {spec.name}")
            sm.create_endpoint(EndpointName=spec.name, EndpointConfigName=config_name)
    except Exception as exc:
        _rollback(sm, created, progress)
        if getattr(exc, "response", None):
            raise DeployError(f"SageMaker refused the deployment: {exc}") from exc
        raise

    record = Deployment(
        endpoint_name=spec.name,
        endpoint_config_name=config_name,
        model_name=model_name,
        inference_component_name=component_name,
        model_data_s3=spec.model_data_s3,
        region=region,
    )
    if not wait and not spec.inference_component:
        return record

    desc = _wait_status(
        lambda: sm.describe_endpoint(EndpointName=spec.name),
        what=f"endpoint {spec.name}",
        status_key="EndpointStatus",
        failed=("Failed", "UpdateRollbackFailed", "OutOfService"),
        hint=hint,
        **waits,
    )
    status = desc["EndpointStatus"]

    if existing is not None:
        if desc.get("EndpointConfigName") != config_name:
            reason = desc.get("FailureReason") or "SageMaker rolled the update back"
            _rollback(sm, created, progress)
            raise DeploymentFailedError(
                f"the update of endpoint {spec.name} failed and it still serves "
                f"{desc.get('EndpointConfigName')}: {reason}",
                reason,
            )
        old_config = existing.get("EndpointConfigName")
        old = _describe_or_none(sm.describe_endpoint_config, EndpointConfigName=old_config)
        stale: list[tuple[str, str]] = [
            ("model", v["ModelName"])
            for v in (old or {}).get("ProductionVariants", [])
            if v.get("ModelName") and v["ModelName"] != model_name
        ]
        if old:
            stale.append(("endpoint config", old_config))
        _rollback(sm, stale, progress, verb="removing the replaced")  # config first

    if spec.inference_component:
        assert component_name is not None
        progress(
            f"creating inference component {component_name} ({spec.copy_count} copies, "
            f"{spec.accelerators} GPU and {spec.memory_mb} MB each)"
        )
        sm.create_inference_component(
            **spec.create_inference_component_params(component_name, model_name)
        )
        status = "Creating"
        if wait:
            ic = _wait_status(
                lambda: sm.describe_inference_component(InferenceComponentName=component_name),
                what=f"inference component {component_name}",
                status_key="InferenceComponentStatus",
                failed=("Failed",),
                hint=hint,
                **waits,
            )
            status = ic["InferenceComponentStatus"]

    return Deployment(**{**record.__dict__, "status": status})


def _rollback(
    sm: Any, created: list[tuple[str, str]], progress: Progress, verb: str = "rolling back"
) -> None:
    """Best-effort removal of what was just created (newest first)."""
    for kind, name in reversed(created):
        call = sm.delete_endpoint_config if kind == "endpoint config" else sm.delete_model
        key = "EndpointConfigName" if kind == "endpoint config" else "ModelName"
        try:
            call(**{key: name})
            progress(f"{verb} {kind} {name}: deleted")
        except Exception as exc:  # keep the original error the one reported
            if not _is_missing(exc):
                progress(f"{verb} {kind} {name}: could not delete ({exc})")


# --- Delete ------------------------------------------------------------------------------------


@dataclass
class DeleteReport:
    """What `delete` removed, and what was already gone."""

    deleted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _paginate(sm: Any, operation: str, key: str, **params: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for page in sm.get_paginator(operation).paginate(**params):
        items.extend(page.get(key, []))
    return items


def delete(
    name: str,
    *,
    sm_client: Any = None,
    s3_client: Any = None,
    ecr_client: Any = None,
    s3_uri: str | None = None,
    ecr_repository: str | None = None,
    wait: bool = True,
    poll_s: float = 10,
    timeout_s: float = 1800,
    progress: Progress = _stderr,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> DeleteReport:
    """Delete the endpoint `name` and everything `deploy` made for it; tolerate missing pieces.

    Finds the endpoint config through the endpoint, the models through the config's variants
    and the inference components on the endpoint, plus leftovers named `<name>-<stamp>` (from an
    update not waited for, or a half-finished delete). Inference components go first, then the
    endpoint (waited for until gone, unless `wait=False`), configs, models. `s3_uri` (the model
    data prefix) and `ecr_repository` (with all its images) are deleted only when given.
    """
    validate_name(name)
    sm = _client("sagemaker", sm_client)
    region = getattr(getattr(sm, "meta", None), "region_name", None)
    report = DeleteReport()
    waits = dict(poll_s=poll_s, timeout_s=timeout_s, progress=progress, sleep=sleep, clock=clock)

    def done(what: str) -> None:
        report.deleted.append(what)
        progress(f"deleted {what}")

    def gone(what: str) -> None:
        report.missing.append(what)
        progress(f"{what}: not found (already deleted)")

    endpoint = _describe_or_none(sm.describe_endpoint, EndpointName=name)
    pattern = _stamp_pattern(name)
    config_names: list[str] = []
    if endpoint and endpoint.get("EndpointConfigName"):
        config_names.append(endpoint["EndpointConfigName"])
    for summary in _paginate(
        sm, "list_endpoint_configs", "EndpointConfigs", NameContains=_base(name)
    ):
        if pattern.fullmatch(summary["EndpointConfigName"]):
            config_names.append(summary["EndpointConfigName"])
    config_names = list(dict.fromkeys(config_names))

    configs = {}
    for config_name in config_names:
        desc = _describe_or_none(sm.describe_endpoint_config, EndpointConfigName=config_name)
        if desc is not None:
            configs[config_name] = desc
    model_names = [
        v["ModelName"]
        for desc in configs.values()
        for v in desc.get("ProductionVariants", [])
        if v.get("ModelName")
    ]
    component_mode = any(
        not v.get("ModelName") for d in configs.values() for v in d.get("ProductionVariants", [])
    )

    if endpoint is not None and component_mode:
        components = _paginate(
            sm, "list_inference_components", "InferenceComponents", EndpointNameEquals=name
        )
        for summary in components:
            ic_name = summary["InferenceComponentName"]
            desc = _describe_or_none(
                sm.describe_inference_component, InferenceComponentName=ic_name
            )
            if desc and desc.get("Specification", {}).get("ModelName"):
                model_names.append(desc["Specification"]["ModelName"])
            try:
                sm.delete_inference_component(InferenceComponentName=ic_name)
            except Exception as exc:
                if not _is_missing(exc):
                    raise
                gone(f"inference component {ic_name}")
                continue
            if wait:
                _wait_gone(
                    lambda n=ic_name: sm.describe_inference_component(InferenceComponentName=n),
                    what=f"inference component {ic_name}",
                    **waits,
                )
            done(f"inference component {ic_name}")

    try:
        sm.delete_endpoint(EndpointName=name)
    except Exception as exc:
        if not _is_missing(exc):
            raise
        gone(f"endpoint {name}")
    else:
        if wait:
            _wait_gone(
                lambda: sm.describe_endpoint(EndpointName=name), what=f"endpoint {name}", **waits
            )
        done(f"endpoint {name}")

    for summary in _paginate(sm, "list_models", "Models", NameContains=_base(name)):
        if pattern.fullmatch(summary["ModelName"]):
            model_names.append(summary["ModelName"])
    if not config_names:
        gone(f"endpoint config for {name}")
    for config_name in config_names:
        try:
            sm.delete_endpoint_config(EndpointConfigName=config_name)
            done(f"endpoint config {config_name}")
        except Exception as exc:
            if not _is_missing(exc):
                raise
            gone(f"endpoint config {config_name}")
    if not model_names:
        gone(f"model for {name}")
    for model_name in dict.fromkeys(model_names):
        try:
            sm.delete_model(ModelName=model_name)
            done(f"model {model_name}")
        except Exception as exc:
            if not _is_missing(exc):
                raise
            gone(f"model {model_name}")

    if s3_uri:
        bucket, prefix = parse_s3_uri(s3_uri)
        count = delete_s3_prefix(s3_uri, s3_client=_client("s3", s3_client, region))
        if count:
            done(f"{count} objects under s3://{bucket}/{prefix}")
        else:
            gone(f"objects under s3://{bucket}/{prefix}")
    if ecr_repository:
        ecr = _client("ecr", ecr_client, region)
        try:
            ecr.delete_repository(repositoryName=ecr_repository, force=True)
            done(f"ECR repository {ecr_repository}")
        except Exception as exc:
            if not _is_missing(exc):
                raise
            gone(f"ECR repository {ecr_repository}")
    return report


# --- Discovery (optional sagemaker SDK) ---------------------------------------------------------


def discover_role() -> str:
    """The execution role of the SageMaker notebook or Studio space this runs in.

    Needs the sagemaker Python SDK (imported only here); elsewhere pass the role ARN.
    """
    try:
        import sagemaker  # noqa: F401
    except ImportError:
        raise DeployError(
            "no role ARN given: pass --role-arn arn:aws:iam::<account>:role/<SageMaker execution "
            "role> (discovering it needs the sagemaker SDK inside a SageMaker notebook)"
        ) from None
    getter = getattr(sagemaker, "get_execution_role", None)
    if getter is None:  # SDK 3.x moved it
        from sagemaker.core.helper.session_helper import get_execution_role as getter
    return getter()


def discover_bucket(
    *, sts_client: Any = None, s3_client: Any = None, region: str | None = None
) -> str:
    """The SDK's default bucket, `sagemaker-<region>-<account>`, which must exist already.

    Computed with boto3 alone (the SDK would create the bucket; this never creates one).
    """
    sts = _client("sts", sts_client, region)
    account = sts.get_caller_identity()["Account"]
    region = region or getattr(sts.meta, "region_name", None) or os.environ.get("AWS_REGION")
    bucket = f"sagemaker-{region}-{account}"
    s3 = _client("s3", s3_client, region)
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception as exc:
        raise DeployError(
            f"no --bucket given and the default bucket {bucket} is not usable ({exc}): "
            "pass --bucket, or create it with `aws s3 mb s3://" + bucket + "`"
        ) from None
    return bucket


# --- Command line (`python -m llava deploy` / `python -m llava delete`) --------------------------


def _pairs(values: list[str] | None, option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def add_deploy_arguments(parser: Any) -> None:
    """The options of `python -m llava deploy`."""
    parser.add_argument("--image-uri", required=True, help="ECR image from ./build_and_push.sh")
    parser.add_argument(
        "--role-arn", help="SageMaker execution role (default: the notebook's, via the SDK)"
    )
    parser.add_argument(
        "--bucket", help="S3 bucket for the model data (default: sagemaker-<region>-<account>)"
    )
    parser.add_argument(
        "--prefix", help="S3 prefix for the model data (default: llava-sessions/<name>/<UTC time>)"
    )
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny | llava15 (random weights) | a checkpoint directory | a Hugging Face id such "
        "as llava-hf/llava-1.5-7b-hf (default: tiny)",
    )
    parser.add_argument("--cache-dir", default="build/models", help="where checkpoints go")
    parser.add_argument(
        "--archive", help="upload this unpacked archive (with MAR-INF) instead of building one"
    )
    parser.add_argument(
        "--baked-image",
        action="store_true",
        help="the image holds the archive (MODEL_DIR=...): no upload, no model data",
    )
    parser.add_argument("--name", default="llava", help="endpoint name (default: llava)")
    parser.add_argument("--instance-type", default="ml.g5.2xlarge")
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument("--ttl", type=float, default=1200, help="session idle TTL in seconds")
    parser.add_argument(
        "--setting",
        action="append",
        metavar="NAME=VALUE",
        help="worker setting (LLAVA_<NAME>), e.g. --setting max_sessions=32; repeatable",
    )
    parser.add_argument(
        "--env", action="append", metavar="KEY=VALUE", help="extra container variable; repeatable"
    )
    parser.add_argument("--download-timeout", type=int, default=1800, help="seconds (60-3600)")
    parser.add_argument("--startup-timeout", type=int, default=1800, help="seconds (60-3600)")
    parser.add_argument(
        "--inference-component",
        action="store_true",
        help="deploy as an inference component on a model-less endpoint",
    )
    parser.add_argument("--accelerators", type=int, default=1, help="GPUs per component copy")
    parser.add_argument("--memory-mb", type=int, default=16384, help="host memory per copy")
    parser.add_argument("--copy-count", type=int, default=1, help="component copies")
    parser.add_argument(
        "--update", action="store_true", help="switch an existing endpoint to this deployment"
    )
    parser.add_argument("--no-wait", action="store_true", help="return once creation started")
    parser.add_argument("--region", help="AWS region (default: the AWS configuration's)")


def add_delete_arguments(parser: Any) -> None:
    """The options of `python -m llava delete`."""
    parser.add_argument("--name", default="llava", help="endpoint name (default: llava)")
    parser.add_argument("--s3-uri", help="also delete the model data under this S3 prefix")
    parser.add_argument("--ecr-repository", help="also delete this ECR repository and its images")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for the endpoint")
    parser.add_argument("--region", help="AWS region (default: the AWS configuration's)")


def _bucket_region(s3: Any, bucket: str) -> str:
    location = s3.get_bucket_location(Bucket=bucket).get("LocationConstraint")
    return {None: "us-east-1", "": "us-east-1", "EU": "eu-west-1"}.get(location, location)


def run_deploy(args: Any) -> Deployment:
    """`python -m llava deploy`: build the archive, upload it, deploy, print how to call it."""
    import boto3

    try:
        sm = boto3.client("sagemaker", region_name=args.region)
        region = sm.meta.region_name
        name = validate_name(args.name)
        role_arn = args.role_arn or discover_role()
        s3_uri = None
        if not args.baked_image:
            s3 = boto3.client("s3", region_name=region)
            bucket = args.bucket or discover_bucket(s3_client=s3, region=region)
            stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
            prefix = (args.prefix or f"llava-sessions/{name}/{stamp}").strip("/")
            s3_uri = f"s3://{bucket}/{prefix}/"
            bucket_region = _bucket_region(s3, bucket)
            if bucket_region != region:
                raise DeployError(
                    f"bucket {bucket} is in {bucket_region}, the endpoint would be in {region}: "
                    "SageMaker reads model data only from its own region"
                )
        spec = DeploySpec(
            name=name,
            image_uri=args.image_uri,
            role_arn=role_arn,
            model_data_s3=s3_uri,
            instance_type=args.instance_type,
            instance_count=args.instance_count,
            session_ttl_s=args.ttl,
            settings=_pairs(args.setting, "--setting"),
            env=_pairs(args.env, "--env"),
            model_data_download_timeout_s=args.download_timeout,
            container_startup_health_check_timeout_s=args.startup_timeout,
            inference_component=args.inference_component,
            accelerators=args.accelerators,
            memory_mb=args.memory_mb,
            copy_count=args.copy_count,
        )
        existing = _describe_or_none(sm.describe_endpoint, EndpointName=name)
        if existing is not None and not args.update:  # fail before a long build and upload
            raise EndpointExistsError(
                f"endpoint {name!r} already exists ({existing.get('EndpointStatus')}): delete it "
                f"(python -m llava delete --name {name}), pick another --name, or pass --update"
            )
        if s3_uri is not None:
            if args.archive:
                upload_archive(args.archive, s3_uri, s3_client=s3)
            else:
                import tempfile

                from llava.archive import build_archive, resolve_model

                model_dir = resolve_model(args.model, args.cache_dir)
                with tempfile.TemporaryDirectory(prefix="llava-archive-") as tmp:
                    archive = build_archive(model_dir, tmp, name="llava")
                    upload_archive(archive, s3_uri, s3_client=s3)
        record = deploy(spec, sm_client=sm, wait=not args.no_wait, update=args.update)
    except (DeployError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None

    delete_cmd = f"python -m llava delete --name {record.endpoint_name}"
    if record.model_data_s3:
        delete_cmd += f" --s3-uri {record.model_data_s3}"
    print(f"endpoint: {record.endpoint_name} ({record.status}, {region})")
    if record.inference_component_name:
        print(f"inference component: {record.inference_component_name}")
    print(f"model data: {record.model_data_s3 or 'baked into the image'}")
    print("\nCall it:\n")
    print(record.client_snippet())
    print(f"\nDelete it (stops the instance charges):\n\n{delete_cmd}")
    return record


def run_delete(args: Any) -> DeleteReport:
    """`python -m llava delete`: remove the endpoint and what was made for it."""
    import boto3

    try:
        sm = boto3.client("sagemaker", region_name=args.region)
        report = delete(
            args.name,
            sm_client=sm,
            s3_uri=args.s3_uri,
            ecr_repository=args.ecr_repository,
            wait=not args.no_wait,
        )
    except (DeployError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"deleted: {', '.join(report.deleted) or 'nothing'}")
    if report.missing:
        print(f"already gone: {', '.join(report.missing)}")
    return report
