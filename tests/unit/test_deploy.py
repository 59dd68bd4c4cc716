"""Deployment to SageMaker with boto3: against moto's S3/SageMaker/ECR (`mock_aws`), and botocore's
Stubber where moto has no model (inference components, UpdateEndpoint, endpoint states other than
InService). No AWS account or network is used: fake credentials, and every client is mocked or
stubbed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from boto3.s3.transfer import TransferConfig  # noqa: E402
from botocore.stub import Stubber  # noqa: E402
from moto import mock_aws  # noqa: E402

from llava.__main__ import main  # noqa: E402
from llava.tools import deploy as dp  # noqa: E402

REGION = "us-east-1"
ACCOUNT = "123456789012"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerExecution"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/llava-sessions:test"
TYPE = "ml.m5.xlarge"  # moto rejects ml.g5.*
BUCKET = "llava-models"
STAMP = "20250102-030405"
NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
ARN = f"arn:aws:sagemaker:{REGION}:{ACCOUNT}"


@pytest.fixture(autouse=True)
def fake_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and region; nothing here may reach a real AWS account."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def aws():
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=BUCKET)
        yield


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    """A small unpacked TorchServe archive (the layout torch-model-archiver writes)."""
    root = tmp_path / "llava"
    (root / "MAR-INF").mkdir(parents=True)
    (root / "MAR-INF" / "MANIFEST.json").write_text('{"model": {"modelName": "llava"}}')
    (root / "config.json").write_text('{"model_type": "llava"}')
    (root / "model.safetensors").write_bytes(os.urandom(300_000))
    (root / "model-config.yaml").write_text("minWorkers: 1\n")
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "sub" / "deeper" / "file.txt").write_text("nested")
    return root


def _objects(prefix: str, bucket: str = BUCKET) -> dict[str, bytes]:
    s3 = boto3.client("s3", region_name=REGION)
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def _spec(**overrides: Any) -> dp.DeploySpec:
    values: dict[str, Any] = dict(
        image_uri=IMAGE,
        role_arn=ROLE,
        instance_type=TYPE,
        model_data_s3=f"s3://{BUCKET}/models/llava",
    )
    values.update(overrides)
    return dp.DeploySpec(**values)


class Clock:
    """A fake monotonic clock that advances only when the code sleeps."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


EXPECTED_ENV = {
    "SAGEMAKER_MODEL_SERVER_WORKERS": "1",
    "SAGEMAKER_MODEL_SERVER_TIMEOUT": "300",
    "TS_DEFAULT_RESPONSE_TIMEOUT": "300",
    "TS_MAX_REQUEST_SIZE": "16777216",
    "TS_MAX_RESPONSE_SIZE": "6291456",
    "LLAVA_SESSION_TTL_S": "1200",
}


# --- Names, URIs, spec validation -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["llava", "a", "L1-2--3", "x" * 63])
def test_valid_names(name: str) -> None:
    assert dp.validate_name(name) == name


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("llava_1", "'_'"),
        ("my.model", "'.'"),
        ("-llava", "start and end"),
        ("llava-", "start and end"),
        ("x" * 64, "64 characters"),
        ("", "empty"),
    ],
)
def test_invalid_names_say_why(name: str, hint: str) -> None:
    with pytest.raises(ValueError, match="invalid SageMaker endpoint name") as err:
        dp.validate_name(name)
    assert hint in str(err.value)


def test_resource_names_fit_63_characters() -> None:
    assert dp.resource_name("llava", STAMP) == f"llava-{STAMP}"
    long = dp.resource_name("a" * 46 + "-" + "b" * 16, STAMP)
    assert len(long) <= 63 and dp.NAME_RE.fullmatch(long)


def test_parse_s3_uri() -> None:
    assert dp.parse_s3_uri("s3://bucket/a/b") == ("bucket", "a/b/")
    assert dp.parse_s3_uri("s3://bucket/a/b/") == ("bucket", "a/b/")
    with pytest.raises(ValueError, match="whole bucket"):
        dp.parse_s3_uri("s3://bucket")
    with pytest.raises(ValueError, match="not an S3 URI"):
        dp.parse_s3_uri("https://bucket/key")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"role_arn": "SageMakerRole"}, "not an IAM role ARN"),
        ({"name": "my_endpoint"}, "invalid SageMaker endpoint name"),
        ({"model_data_download_timeout_s": 59}, "60 to 3600"),
        ({"container_startup_health_check_timeout_s": 3601}, "60 to 3600"),
        ({"instance_count": 0}, "positive integer"),
        ({"image_uri": ""}, "build_and_push.sh"),
        ({"model_data_s3": "s3://bucket"}, "whole bucket"),
        ({"settings": {"max_sesions": 3}}, "unknown worker setting 'max_sesions'"),
        ({"settings": {"max_sessions": 0}}, "max_sessions must be positive"),
        ({"settings": {"dtype": "int4"}}, "dtype 'int4'"),
        ({"env": {"LLAVA_MAX_SESION": "3"}}, "unknown setting LLAVA_MAX_SESION"),
        ({"env": {"LLAVA_SESSION_TTL_S": "5"}}, "session_ttl_s"),
        ({"env": {"1BAD": "x"}}, "invalid environment variable name"),
        ({"session_ttl_s": 0}, "session_ttl_s must be positive"),
        ({"routing": "sticky"}, "routing 'sticky': one of"),
        ({"routing": "prefix-aware", "prefix_length": 512}, "prefix_length must be .* 1024 to"),
        ({"concurrency_threshold": 0}, "concurrency_threshold must be an integer from 1"),
    ],
)
def test_spec_rejects_bad_values_before_any_call(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**overrides)


def test_spec_environment_and_settings() -> None:
    spec = _spec(
        session_ttl_s=600,
        settings={
            "max_sessions": 8,
            "image_allow_hosts": ["a.com", "b.com"],
            "image_allow_http": 1,
        },
        env={"EXTRA": 7, "TS_DEFAULT_RESPONSE_TIMEOUT": "400"},
    )
    assert spec.model_data_s3 == f"s3://{BUCKET}/models/llava/"
    assert spec.environment() == {
        **EXPECTED_ENV,
        "LLAVA_SESSION_TTL_S": "600",
        "LLAVA_MAX_SESSIONS": "8",
        "LLAVA_IMAGE_ALLOW_HOSTS": "a.com,b.com",
        "LLAVA_IMAGE_ALLOW_HTTP": "1",
        "EXTRA": "7",
        "TS_DEFAULT_RESPONSE_TIMEOUT": "400",  # env wins
    }
    with pytest.raises(TypeError):
        spec.env["X"] = "y"  # frozen all the way down


# --- Upload ---------------------------------------------------------------------------------------


def test_upload_archive_puts_every_file_with_identical_bytes(aws, archive: Path) -> None:
    calls: list[tuple[int, int]] = []
    uri = dp.upload_archive(
        archive, f"s3://{BUCKET}/models/llava", progress=lambda d, t: calls.append((d, t))
    )
    assert uri == f"s3://{BUCKET}/models/llava/"
    files = {
        p.relative_to(archive).as_posix(): p.read_bytes() for p in archive.rglob("*") if p.is_file()
    }
    assert _objects("models/llava/") == {f"models/llava/{k}": v for k, v in files.items()}
    total = sum(len(v) for v in files.values())
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)

    # The same archive again replaces the same keys: allowed, the prefix stays one archive.
    dp.upload_archive(archive, uri, progress=lambda d, t: None)
    assert len(_objects("models/llava/")) == len(files)


def test_upload_default_progress_goes_to_stderr(aws, archive: Path, capsys) -> None:
    dp.upload_archive(archive, f"s3://{BUCKET}/p")
    err = capsys.readouterr().err
    assert "uploading 5 files" in err and f"s3://{BUCKET}/p/" in err


def test_upload_uses_multipart_for_big_files(aws, tmp_path: Path) -> None:
    root = tmp_path / "big"
    (root / "MAR-INF").mkdir(parents=True)
    (root / "MAR-INF" / "MANIFEST.json").write_text("{}")
    blob = os.urandom(11 * 1024 * 1024)
    (root / "model.safetensors").write_bytes(blob)
    mib5 = 5 * 1024 * 1024
    config = TransferConfig(multipart_threshold=mib5, multipart_chunksize=mib5)
    dp.upload_archive(
        root, f"s3://{BUCKET}/big", progress=lambda d, t: None, transfer_config=config
    )
    s3 = boto3.client("s3", region_name=REGION)
    head = s3.head_object(Bucket=BUCKET, Key="big/model.safetensors")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    body = s3.get_object(Bucket=BUCKET, Key="big/model.safetensors")["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(blob).digest()


def test_upload_refuses_a_directory_without_mar_inf(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    with pytest.raises(dp.DeployError, match="no MAR-INF/MANIFEST.json.*no-archive"):
        dp.upload_archive(tmp_path / "ckpt", f"s3://{BUCKET}/x")
    (tmp_path / "llava.mar").write_bytes(b"PK")
    with pytest.raises(dp.DeployError, match="is not a directory"):
        dp.upload_archive(tmp_path / "llava.mar", f"s3://{BUCKET}/x")


def test_upload_refuses_a_prefix_holding_other_objects(aws, archive: Path) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    s3.put_object(Bucket=BUCKET, Key="models/llava/old-weights.safetensors", Body=b"old")
    with pytest.raises(dp.DeployError, match="old-weights.safetensors.*empty prefix"):
        dp.upload_archive(archive, f"s3://{BUCKET}/models/llava", progress=lambda d, t: None)
    assert list(_objects("models/llava/")) == ["models/llava/old-weights.safetensors"]


# --- Deploy against moto --------------------------------------------------------------------------


def test_deploy_creates_model_config_endpoint(aws) -> None:
    lines: list[str] = []
    spec = _spec(instance_count=2, settings={"max_sessions": 8})
    record = dp.deploy(spec, progress=lines.append, now=lambda: NOW)
    name = f"llava-{STAMP}"
    assert record == dp.Deployment(
        endpoint_name="llava",
        endpoint_config_name=name,
        model_name=name,
        inference_component_name=None,
        model_data_s3=f"s3://{BUCKET}/models/llava/",
        status="InService",
        region=REGION,
    )
    sm = boto3.client("sagemaker", region_name=REGION)
    model = sm.describe_model(ModelName=name)
    assert model["ExecutionRoleArn"] == ROLE
    assert model["PrimaryContainer"] == {
        "Image": IMAGE,
        "Environment": {**EXPECTED_ENV, "LLAVA_MAX_SESSIONS": "8"},
        "ModelDataSource": {
            "S3DataSource": {
                "S3Uri": f"s3://{BUCKET}/models/llava/",
                "S3DataType": "S3Prefix",
                "CompressionType": "None",
            }
        },
    }
    config = sm.describe_endpoint_config(EndpointConfigName=name)
    assert config["ProductionVariants"] == [
        {
            "VariantName": "AllTraffic",
            "ModelName": name,
            "InstanceType": TYPE,
            "InitialInstanceCount": 2,
            "InitialVariantWeight": 1.0,
            "ModelDataDownloadTimeoutInSeconds": 1800,
            "ContainerStartupHealthCheckTimeoutInSeconds": 1800,
        }
    ]
    endpoint = sm.describe_endpoint(EndpointName="llava")
    assert endpoint["EndpointConfigName"] == name
    assert endpoint["EndpointStatus"] == "InService"
    assert lines[-1].startswith("endpoint llava: InService (0s elapsed)")
    assert "SessionClient.for_endpoint('llava', region_name='us-east-1')" in (
        record.client_snippet()
    )


def test_deploy_baked_image_has_no_model_data(aws) -> None:
    record = dp.deploy(_spec(model_data_s3=None), progress=lambda line: None, now=lambda: NOW)
    sm = boto3.client("sagemaker", region_name=REGION)
    container = sm.describe_model(ModelName=record.model_name)["PrimaryContainer"]
    assert "ModelDataSource" not in container and "ModelDataUrl" not in container


def test_deploy_refuses_an_existing_endpoint(aws) -> None:
    dp.deploy(_spec(), progress=lambda line: None, now=lambda: NOW)
    with pytest.raises(dp.EndpointExistsError, match="already exists.*llava delete.*update"):
        dp.deploy(_spec(), progress=lambda line: None)
    sm = boto3.client("sagemaker", region_name=REGION)
    assert len(sm.list_models()["Models"]) == 1


def test_deploy_rolls_back_what_it_created_when_refused(aws) -> None:
    lines: list[str] = []
    # moto, like SageMaker for an unknown type, refuses the config: the model must not linger.
    with pytest.raises(dp.DeployError, match="SageMaker refused the deployment"):
        dp.deploy(_spec(instance_type="ml.g5.2xlarge"), progress=lines.append, now=lambda: NOW)
    sm = boto3.client("sagemaker", region_name=REGION)
    assert sm.list_models()["Models"] == []
    assert any("rolling back model" in line for line in lines)


# --- Deploy with a Stubber (states moto does not produce) -----------------------------------------


def _missing(stub: Stubber, operation: str, what: str) -> None:
    stub.add_client_error(
        operation,
        service_error_code="ValidationException",
        service_message=f"Could not find {what}.",
        http_status_code=400,
    )


def _endpoint(status: str, config: str = f"llava-{STAMP}", **extra: Any) -> dict:
    return {
        "EndpointName": "llava",
        "EndpointArn": f"{ARN}:endpoint/llava",
        "EndpointConfigName": config,
        "EndpointStatus": status,
        "CreationTime": T0,
        "LastModifiedTime": T0,
        **extra,
    }


def _stubbed() -> tuple[Any, Stubber]:
    sm = boto3.client("sagemaker", region_name=REGION)
    return sm, Stubber(sm)


def _expect_creates(stub: Stubber, spec: dp.DeploySpec, name: str = f"llava-{STAMP}") -> None:
    stub.add_response(
        "create_model", {"ModelArn": f"{ARN}:model/{name}"}, spec.create_model_params(name)
    )
    stub.add_response(
        "create_endpoint_config",
        {"EndpointConfigArn": f"{ARN}:endpoint-config/{name}"},
        spec.create_endpoint_config_params(name, name),
    )


def test_deploy_polls_until_in_service_with_progress() -> None:
    sm, stub = _stubbed()
    spec = _spec()
    _missing(stub, "describe_endpoint", "endpoint")
    _expect_creates(stub, spec)
    stub.add_response(
        "create_endpoint",
        {"EndpointArn": f"{ARN}:endpoint/llava"},
        {"EndpointName": "llava", "EndpointConfigName": f"llava-{STAMP}"},
    )
    for status in ("Creating", "Creating", "InService"):
        stub.add_response("describe_endpoint", _endpoint(status), {"EndpointName": "llava"})
    clock, lines = Clock(), []
    with stub:
        record = dp.deploy(
            spec,
            sm_client=sm,
            poll_s=30,
            progress=lines.append,
            sleep=clock.sleep,
            clock=clock,
            now=lambda: NOW,
        )
    stub.assert_no_pending_responses()
    assert record.status == "InService"
    assert clock.sleeps == [30, 30]
    assert lines[-3:] == [
        "endpoint llava: Creating (0s elapsed)",
        "endpoint llava: Creating (30s elapsed)",
        "endpoint llava: InService (1m00s elapsed)",
    ]


def test_deploy_raises_failure_reason_when_failed() -> None:
    sm, stub = _stubbed()
    spec = _spec()
    _missing(stub, "describe_endpoint", "endpoint")
    _expect_creates(stub, spec)
    stub.add_response("create_endpoint", {"EndpointArn": f"{ARN}:endpoint/llava"})
    stub.add_response("describe_endpoint", _endpoint("Creating"))
    reason = "The primary container for production variant AllTraffic did not pass the ping check"
    stub.add_response("describe_endpoint", _endpoint("Failed", FailureReason=reason))
    clock = Clock()
    with stub, pytest.raises(dp.DeploymentFailedError) as err:
        dp.deploy(
            spec,
            sm_client=sm,
            progress=lambda line: None,
            sleep=clock.sleep,
            clock=clock,
            now=lambda: NOW,
        )
    assert err.value.reason == reason
    assert "Failed" in str(err.value) and "llava delete --name llava" in str(err.value)


def test_deploy_wait_has_a_deadline() -> None:
    sm, stub = _stubbed()
    spec = _spec()
    _missing(stub, "describe_endpoint", "endpoint")
    _expect_creates(stub, spec)
    stub.add_response("create_endpoint", {"EndpointArn": f"{ARN}:endpoint/llava"})
    for _ in range(3):
        stub.add_response("describe_endpoint", _endpoint("Creating"))
    clock = Clock()
    with stub, pytest.raises(dp.DeployError, match="still Creating after 1m00s"):
        dp.deploy(
            spec,
            sm_client=sm,
            timeout_s=60,
            progress=lambda line: None,
            sleep=clock.sleep,
            clock=clock,
            now=lambda: NOW,
        )


def test_deploy_no_wait_returns_after_create_endpoint() -> None:
    sm, stub = _stubbed()
    spec = _spec()
    _missing(stub, "describe_endpoint", "endpoint")
    _expect_creates(stub, spec)
    stub.add_response("create_endpoint", {"EndpointArn": f"{ARN}:endpoint/llava"})
    with stub:
        record = dp.deploy(
            spec, sm_client=sm, wait=False, progress=lambda line: None, now=lambda: NOW
        )
    stub.assert_no_pending_responses()
    assert record.status == "Creating"


def test_deploy_update_switches_the_endpoint_and_removes_the_old_config() -> None:
    sm, stub = _stubbed()
    spec = _spec()
    old = "llava-20240101-000000"
    new = f"llava-{STAMP}"
    stub.add_response("describe_endpoint", _endpoint("InService", config=old))
    _expect_creates(stub, spec)
    stub.add_response(
        "update_endpoint",
        {"EndpointArn": f"{ARN}:endpoint/llava"},
        {"EndpointName": "llava", "EndpointConfigName": new},
    )
    stub.add_response("describe_endpoint", _endpoint("Updating", config=old))
    stub.add_response("describe_endpoint", _endpoint("InService", config=new))
    stub.add_response(
        "describe_endpoint_config",
        {
            "EndpointConfigName": old,
            "EndpointConfigArn": f"{ARN}:endpoint-config/{old}",
            "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": old}],
            "CreationTime": T0,
        },
        {"EndpointConfigName": old},
    )
    stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": old})
    stub.add_response("delete_model", {}, {"ModelName": old})
    clock = Clock()
    with stub:
        record = dp.deploy(
            spec,
            sm_client=sm,
            update=True,
            progress=lambda line: None,
            sleep=clock.sleep,
            clock=clock,
            now=lambda: NOW,
        )
    stub.assert_no_pending_responses()
    assert record.endpoint_config_name == new and record.status == "InService"


def test_deploy_update_rolled_back_is_an_error() -> None:
    sm, stub = _stubbed()
    spec = _spec()
    old = "llava-20240101-000000"
    stub.add_response("describe_endpoint", _endpoint("InService", config=old))
    _expect_creates(stub, spec)
    stub.add_response("update_endpoint", {"EndpointArn": f"{ARN}:endpoint/llava"})
    stub.add_response(
        "describe_endpoint", _endpoint("InService", config=old, FailureReason="ping failed")
    )
    stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": f"llava-{STAMP}"})
    stub.add_response("delete_model", {}, {"ModelName": f"llava-{STAMP}"})
    with stub, pytest.raises(dp.DeploymentFailedError, match="still serves .*ping failed"):
        dp.deploy(spec, sm_client=sm, update=True, progress=lambda line: None, now=lambda: NOW)
    stub.assert_no_pending_responses()


# --- Inference-component mode (moto has no inference components: Stubber) -------------------------


def test_inference_component_mode_makes_exactly_these_calls() -> None:
    sm, stub = _stubbed()
    spec = _spec(
        inference_component=True, accelerators=1, memory_mb=20480, cpu_cores=4, copy_count=2
    )
    name = f"llava-{STAMP}"
    _missing(stub, "describe_endpoint", "endpoint")
    stub.add_response(
        "create_model",
        {"ModelArn": f"{ARN}:model/{name}"},
        {
            "ModelName": name,
            "ExecutionRoleArn": ROLE,
            "PrimaryContainer": {
                "Image": IMAGE,
                "Environment": EXPECTED_ENV,
                "ModelDataSource": {
                    "S3DataSource": {
                        "S3Uri": f"s3://{BUCKET}/models/llava/",
                        "S3DataType": "S3Prefix",
                        "CompressionType": "None",
                    }
                },
            },
        },
    )
    stub.add_response(
        "create_endpoint_config",
        {"EndpointConfigArn": f"{ARN}:endpoint-config/{name}"},
        {
            "EndpointConfigName": name,
            "ExecutionRoleArn": ROLE,
            "ProductionVariants": [
                {
                    "VariantName": "AllTraffic",
                    "InstanceType": TYPE,
                    "InitialInstanceCount": 1,
                    "ModelDataDownloadTimeoutInSeconds": 1800,
                    "ContainerStartupHealthCheckTimeoutInSeconds": 1800,
                    "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
                }
            ],
        },
    )
    stub.add_response(
        "create_endpoint",
        {"EndpointArn": f"{ARN}:endpoint/llava"},
        {"EndpointName": "llava", "EndpointConfigName": name},
    )
    stub.add_response("describe_endpoint", _endpoint("InService"), {"EndpointName": "llava"})
    stub.add_response(
        "create_inference_component",
        {"InferenceComponentArn": f"{ARN}:inference-component/{name}"},
        {
            "InferenceComponentName": name,
            "EndpointName": "llava",
            "VariantName": "AllTraffic",
            "Specification": {
                "ModelName": name,
                "StartupParameters": {
                    "ModelDataDownloadTimeoutInSeconds": 1800,
                    "ContainerStartupHealthCheckTimeoutInSeconds": 1800,
                },
                "ComputeResourceRequirements": {
                    "NumberOfAcceleratorDevicesRequired": 1,
                    "MinMemoryRequiredInMb": 20480,
                    "NumberOfCpuCoresRequired": 4,
                },
            },
            "RuntimeConfig": {"CopyCount": 2},
        },
    )
    for status in ("Creating", "InService"):
        stub.add_response(
            "describe_inference_component",
            {
                "InferenceComponentName": name,
                "InferenceComponentArn": f"{ARN}:inference-component/{name}",
                "EndpointName": "llava",
                "EndpointArn": f"{ARN}:endpoint/llava",
                "InferenceComponentStatus": status,
                "CreationTime": T0,
                "LastModifiedTime": T0,
            },
            {"InferenceComponentName": name},
        )
    clock, lines = Clock(), []
    with stub:
        record = dp.deploy(
            spec,
            sm_client=sm,
            progress=lines.append,
            sleep=clock.sleep,
            clock=clock,
            now=lambda: NOW,
        )
    stub.assert_no_pending_responses()
    assert record.inference_component_name == name and record.status == "InService"
    assert lines[-1] == f"inference component {name}: InService (30s elapsed)"
    assert f"region_name='us-east-1', inference_component={name!r})" in (record.client_snippet())


def test_inference_component_mode_refuses_update() -> None:
    sm, stub = _stubbed()
    stub.add_response("describe_endpoint", _endpoint("InService"))
    with stub, pytest.raises(dp.DeployError, match="not supported in inference-component mode"):
        dp.deploy(_spec(inference_component=True), sm_client=sm, update=True)


def test_delete_inference_component_endpoint() -> None:
    sm, stub = _stubbed()
    name = f"llava-{STAMP}"
    stub.add_response("describe_endpoint", _endpoint("InService"), {"EndpointName": "llava"})
    stub.add_response(
        "list_endpoint_configs",
        {
            "EndpointConfigs": [
                {"EndpointConfigName": name, "EndpointConfigArn": f"{ARN}:x", "CreationTime": T0},
                {
                    "EndpointConfigName": f"llava-2-{STAMP}",
                    "EndpointConfigArn": f"{ARN}:y",
                    "CreationTime": T0,
                },
            ]
        },
        {"NameContains": "llava"},
    )
    stub.add_response(
        "describe_endpoint_config",
        {
            "EndpointConfigName": name,
            "EndpointConfigArn": f"{ARN}:endpoint-config/{name}",
            "ProductionVariants": [{"VariantName": "AllTraffic", "InstanceType": TYPE}],
            "CreationTime": T0,
        },
        {"EndpointConfigName": name},
    )
    stub.add_response(
        "list_inference_components",
        {
            "InferenceComponents": [
                {
                    "InferenceComponentName": name,
                    "InferenceComponentArn": f"{ARN}:inference-component/{name}",
                    "EndpointName": "llava",
                    "EndpointArn": f"{ARN}:endpoint/llava",
                    "VariantName": "AllTraffic",
                    "CreationTime": T0,
                    "LastModifiedTime": T0,
                }
            ]
        },
        {"EndpointNameEquals": "llava"},
    )
    ic = {
        "InferenceComponentName": name,
        "InferenceComponentArn": f"{ARN}:inference-component/{name}",
        "EndpointName": "llava",
        "EndpointArn": f"{ARN}:endpoint/llava",
        "Specification": {"ModelName": name},
        "CreationTime": T0,
        "LastModifiedTime": T0,
    }
    stub.add_response("describe_inference_component", ic, {"InferenceComponentName": name})
    stub.add_response("delete_inference_component", {}, {"InferenceComponentName": name})
    stub.add_response(
        "describe_inference_component",
        {**ic, "InferenceComponentStatus": "Deleting"},
        {"InferenceComponentName": name},
    )
    _missing(stub, "describe_inference_component", "inference component")
    stub.add_response("delete_endpoint", {}, {"EndpointName": "llava"})
    stub.add_response("describe_endpoint", _endpoint("Deleting"), {"EndpointName": "llava"})
    _missing(stub, "describe_endpoint", "endpoint")
    stub.add_response(
        "list_models",
        {"Models": [{"ModelName": name, "ModelArn": f"{ARN}:model/{name}", "CreationTime": T0}]},
        {"NameContains": "llava"},
    )
    stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": name})
    stub.add_response("delete_model", {}, {"ModelName": name})
    secrets = boto3.client("secretsmanager", region_name=REGION)
    secrets_stub = Stubber(secrets)  # no session store: no secret to delete
    secrets_stub.add_client_error(
        "describe_secret",
        "ResourceNotFoundException",
        expected_params={"SecretId": "llava/llava/session-store"},
    )
    clock = Clock()
    with stub, secrets_stub:
        report = dp.delete(
            "llava",
            sm_client=sm,
            secrets_client=secrets,
            progress=lambda line: None,
            poll_s=5,
            sleep=clock.sleep,
            clock=clock,
        )
    stub.assert_no_pending_responses()
    assert report.deleted == [
        f"inference component {name}",
        "endpoint llava",
        f"endpoint config {name}",
        f"model {name}",
    ]
    assert clock.sleeps == [5, 5]


# --- Delete against moto --------------------------------------------------------------------------


def test_delete_removes_everything_and_the_s3_prefix_on_request(aws, archive: Path) -> None:
    uri = dp.upload_archive(archive, f"s3://{BUCKET}/models/llava", progress=lambda d, t: None)
    boto3.client("s3", region_name=REGION).put_object(
        Bucket=BUCKET, Key="models/llava-2/x", Body=b""
    )
    record = dp.deploy(_spec(model_data_s3=uri), progress=lambda line: None, now=lambda: NOW)
    sm = boto3.client("sagemaker", region_name=REGION)
    # Another deployment whose name starts the same must survive.
    sm.create_model(
        ModelName=f"llava-2-{STAMP}", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": IMAGE}
    )

    report = dp.delete("llava", s3_uri=uri, progress=lambda line: None)
    assert report.deleted == [
        "endpoint llava",
        f"endpoint config {record.endpoint_config_name}",
        f"model {record.model_name}",
        f"5 objects under s3://{BUCKET}/models/llava/",
    ]
    for call, params in [
        (sm.describe_endpoint, {"EndpointName": "llava"}),
        (sm.describe_endpoint_config, {"EndpointConfigName": record.endpoint_config_name}),
        (sm.describe_model, {"ModelName": record.model_name}),
    ]:
        with pytest.raises(sm.exceptions.ClientError, match="Could not find"):
            call(**params)
    assert _objects("models/llava/") == {}
    assert list(_objects("models/")) == ["models/llava-2/x"]  # the prefix ends at its slash
    assert [m["ModelName"] for m in sm.list_models()["Models"]] == [f"llava-2-{STAMP}"]


def test_delete_tolerates_missing_pieces(aws) -> None:
    sm = boto3.client("sagemaker", region_name=REGION)
    # A half-finished delete: the endpoint is gone, its config and model are not.
    record = dp.deploy(_spec(), progress=lambda line: None, now=lambda: NOW)
    sm.delete_endpoint(EndpointName="llava")
    report = dp.delete("llava", progress=lambda line: None)
    assert report.deleted == [
        f"endpoint config {record.endpoint_config_name}",
        f"model {record.model_name}",
    ]
    assert report.missing == ["endpoint llava"]

    again = dp.delete(
        "llava",
        s3_uri=f"s3://{BUCKET}/nothing",
        ecr_repository="llava-sessions",
        progress=lambda line: None,
    )
    assert again.deleted == []
    assert again.missing == [
        "endpoint llava",
        "endpoint config for llava",
        "model for llava",
        f"objects under s3://{BUCKET}/nothing/",
        "ECR repository llava-sessions",
    ]


def test_delete_ecr_repository_only_on_request(aws) -> None:
    ecr = boto3.client("ecr", region_name=REGION)
    ecr.create_repository(repositoryName="llava-sessions")
    dp.delete("llava", progress=lambda line: None)
    assert ecr.describe_repositories()["repositories"]
    report = dp.delete("llava", ecr_repository="llava-sessions", progress=lambda line: None)
    assert report.deleted == ["ECR repository llava-sessions"]
    assert ecr.describe_repositories()["repositories"] == []


def test_discover_bucket_needs_no_sdk(aws) -> None:
    with pytest.raises(dp.DeployError, match=f"sagemaker-{REGION}-{ACCOUNT}.*--bucket"):
        dp.discover_bucket(region=REGION)
    boto3.client("s3", region_name=REGION).create_bucket(Bucket=f"sagemaker-{REGION}-{ACCOUNT}")
    assert dp.discover_bucket(region=REGION) == f"sagemaker-{REGION}-{ACCOUNT}"


# --- Command line ---------------------------------------------------------------------------------


def test_cli_deploy_and_delete_with_the_tiny_model(aws, tmp_path: Path, capsys) -> None:
    main(
        [
            "deploy",
            "--image-uri",
            IMAGE,
            "--role-arn",
            ROLE,
            "--bucket",
            BUCKET,
            "--prefix",
            "models/tiny",
            "--model",
            "tiny",
            "--cache-dir",
            str(tmp_path / "models"),
            "--instance-type",
            TYPE,
            "--ttl",
            "600",
            "--setting",
            "max_sessions=4",
        ]
    )
    out = capsys.readouterr().out
    assert "endpoint: llava (InService, us-east-1)" in out
    assert "SessionClient.for_endpoint('llava', region_name='us-east-1')" in out
    assert f"python -m llava delete --name llava --s3-uri s3://{BUCKET}/models/tiny/" in out

    keys = _objects("models/tiny/")
    assert {
        "models/tiny/MAR-INF/MANIFEST.json",
        "models/tiny/model.safetensors",
        "models/tiny/config.json",
        "models/tiny/llava_handler.py",
    } <= set(keys)
    built = tmp_path / "models" / "tiny" / "model.safetensors"
    assert keys["models/tiny/model.safetensors"] == built.read_bytes()

    sm = boto3.client("sagemaker", region_name=REGION)
    endpoint = sm.describe_endpoint(EndpointName="llava")
    assert endpoint["EndpointStatus"] == "InService"
    config = sm.describe_endpoint_config(EndpointConfigName=endpoint["EndpointConfigName"])
    model = sm.describe_model(ModelName=config["ProductionVariants"][0]["ModelName"])
    container = model["PrimaryContainer"]
    assert container["ModelDataSource"]["S3DataSource"]["S3Uri"] == f"s3://{BUCKET}/models/tiny/"
    assert container["Environment"]["LLAVA_SESSION_TTL_S"] == "600"
    assert container["Environment"]["LLAVA_MAX_SESSIONS"] == "4"

    # A second deploy fails fast, before building or uploading anything.
    with pytest.raises(SystemExit, match="already exists"):
        main(
            [
                "deploy",
                "--image-uri",
                IMAGE,
                "--role-arn",
                ROLE,
                "--bucket",
                BUCKET,
                "--instance-type",
                TYPE,
                "--model",
                "/nonexistent",
            ]
        )

    main(["delete", "--name", "llava", "--s3-uri", f"s3://{BUCKET}/models/tiny/"])
    out = capsys.readouterr().out
    assert out.startswith("deleted: endpoint llava, endpoint config")
    assert _objects("models/tiny/") == {}
    with pytest.raises(sm.exceptions.ClientError):
        sm.describe_endpoint(EndpointName="llava")


def test_cli_deploy_front_ray_uploads_the_ray_containers_model_package(
    aws, tmp_path: Path, capsys
) -> None:
    main(
        ["deploy", "--image-uri", IMAGE, "--role-arn", ROLE, "--bucket", BUCKET]
        + ["--prefix", "models/ray", "--model", "tiny", "--cache-dir", str(tmp_path / "models")]
        + ["--instance-type", TYPE, "--front", "ray"]
    )
    assert "endpoint: llava (InService, us-east-1)" in capsys.readouterr().out
    keys = _objects("models/ray/")
    assert {
        "models/ray/config.yaml",
        "models/ray/deployment.py",
        "models/ray/code/requirements.txt",
        "models/ray/weights/config.json",
        "models/ray/weights/model.safetensors",
    } <= set(keys)
    assert not any("MAR-INF" in key for key in keys)
    assert b"import_path: deployment:build" in keys["models/ray/config.yaml"]


def test_cli_errors_are_one_line(aws) -> None:
    with pytest.raises(SystemExit, match="^error: invalid SageMaker endpoint name 'my_llava'"):
        main(
            [
                "deploy",
                "--image-uri",
                IMAGE,
                "--role-arn",
                ROLE,
                "--bucket",
                BUCKET,
                "--name",
                "my_llava",
            ]
        )
    with pytest.raises(SystemExit, match="^error: .*--setting 'oops'"):
        main(
            [
                "deploy",
                "--image-uri",
                IMAGE,
                "--role-arn",
                ROLE,
                "--bucket",
                BUCKET,
                "--setting",
                "oops",
            ]
        )


def test_client_snippet_matches_the_client_api() -> None:
    """The printed snippet calls SessionClient.for_endpoint with arguments it accepts."""
    import inspect

    client = pytest.importorskip("llava.client")
    record = dp.Deployment("llava", "c", "m", inference_component_name="ic", region=REGION)
    assert (
        "SessionClient.for_endpoint('llava', region_name='us-east-1', inference_component='ic')"
        in (record.client_snippet())
    )
    signature = inspect.signature(client.SessionClient.for_endpoint)
    signature.bind("llava", region_name=REGION, inference_component="ic")
    assert {"session"} <= set(dir(client.SessionClient))
    assert {"ask", "stream"} <= set(dir(client.Session))


class RecordingIam:
    """IAM's policy simulator cannot run here: answer from a set of denied actions, recording
    every call (the role, actions and resources asked about)."""

    def __init__(self, denied: set[str] = frozenset(), fail: Exception | None = None) -> None:
        self.denied, self.fail = set(denied), fail
        self.calls: list[dict[str, Any]] = []

    def simulate_principal_policy(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        if self.fail is not None:
            raise self.fail
        return {
            "EvaluationResults": [
                {
                    "EvalActionName": action,
                    "EvalDecision": "implicitDeny" if action in self.denied else "allowed",
                }
                for action in kwargs["ActionNames"]
            ]
        }


def test_the_roles_access_to_the_session_store_is_checked_before_deploying() -> None:
    from llava.tools.deploy.store_access import check_store_access

    said: list[str] = []
    iam = RecordingIam()
    check_store_access(
        iam, ROLE, "s3://bucket/sessions/llava", endpoint="llava", progress=said.append
    )
    account = ROLE.split(":")[4]
    secret = f"arn:aws:secretsmanager:us-east-1:{account}:secret:llava/llava/session-store"
    assert iam.calls == [
        {
            "PolicySourceArn": ROLE,
            "ActionNames": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
            "ResourceArns": ["arn:aws:s3:::bucket/sessions/llava/llava-check.snap"],
        },
        {
            "PolicySourceArn": ROLE,
            "ActionNames": ["s3:ListBucket"],
            "ResourceArns": ["arn:aws:s3:::bucket"],
        },
        {  # the secret deploy makes: Secrets Manager ends its ARN with 6 random characters
            "PolicySourceArn": ROLE,
            "ActionNames": ["secretsmanager:GetSecretValue"],
            "ResourceArns": [f"{secret}-AbCdEf"],
        },
    ]
    assert said == ["the execution role may use the session store s3://bucket/sessions/llava"]
    # with a key: the key's actions too, on its ARN (a bare id is in the role's account)
    iam = RecordingIam(denied={"s3:PutObject", "kms:GenerateDataKey"})
    with pytest.raises(dp.DeployError) as info:
        check_store_access(
            iam, ROLE, "s3://bucket/p", endpoint="chat", kms_key="k-1", region="eu-west-1"
        )
    assert iam.calls[3]["ResourceArns"] == [f"arn:aws:kms:eu-west-1:{account}:key/k-1"]
    message = str(info.value)
    assert "may not s3:PutObject, kms:GenerateDataKey" in message
    policy = json.loads(message[message.index("{") :])
    assert [s["Resource"] for s in policy["Statement"]] == [
        "arn:aws:s3:::bucket/p/*",
        "arn:aws:s3:::bucket",
        f"arn:aws:secretsmanager:eu-west-1:{account}:secret:llava/chat/session-store-??????",
        f"arn:aws:kms:eu-west-1:{account}:key/k-1",
    ]
    # a caller who may not simulate is warned, not stopped
    said.clear()
    check_store_access(
        RecordingIam(fail=RuntimeError("AccessDenied")),
        ROLE,
        "s3://bucket/p",
        endpoint="llava",
        progress=said.append,
    )
    assert said[0].startswith("warning: could not check") and "s3:PutObject" in said[0]


def test_gpu_instances_get_the_ami_whose_driver_runs_the_images_vllm() -> None:
    """vLLM's wheel (torch 2.13, CUDA 13) needs driver 580: the AMI is one SageMaker lists, with
    that driver, set on GPU instance types only and validated as botocore validates the call."""
    model = botocore_model()
    amis = model.shape_for("ProductionVariantInferenceAmiVersion").enum
    assert dp.spec.GPU_AMI in amis
    doc = model.shape_for("ProductionVariant").members["InferenceAmiVersion"].documentation
    assert re.search(rf"{dp.spec.GPU_AMI}.*?NVIDIA driver version: 580", doc, re.S)
    gpu = _spec(instance_type="ml.g5.2xlarge")
    variant = gpu.create_endpoint_config_params("c", "m")["ProductionVariants"][0]
    assert variant["InferenceAmiVersion"] == dp.spec.GPU_AMI
    sm, stub = _stubbed()
    _expect_creates(stub, gpu, "c")
    with stub:  # the Stubber checks the parameters against SageMaker's API model
        sm.create_model(**gpu.create_model_params("c"))
        sm.create_endpoint_config(**gpu.create_endpoint_config_params("c", "c"))
    for spec in (_spec(), _spec(instance_type="ml.g6.xlarge", inference_ami=None)):
        variant = spec.create_endpoint_config_params("c", "m")["ProductionVariants"][0]
        assert "InferenceAmiVersion" not in variant  # a CPU type, or SageMaker's own choice
    with pytest.raises(ValueError, match="SageMaker GPU inference AMI"):
        _spec(inference_ami="ubuntu-22.04")


@pytest.mark.parametrize("inference_component", [False, True])
def test_prefix_aware_routing_is_set_as_sagemakers_api_model_takes_it(inference_component) -> None:
    """`--routing prefix-aware` sets PREFIX_AWARE with its two numbers on the variant; the
    Stubber validates the call against botocore's model of CreateEndpointConfig."""
    spec = _spec(
        routing="prefix-aware",
        prefix_length=2048,
        concurrency_threshold=8,
        inference_component=inference_component,
    )
    variant = spec.create_endpoint_config_params("c", "m")["ProductionVariants"][0]
    assert variant["RoutingConfig"] == {
        "RoutingStrategy": "PREFIX_AWARE",
        "PrefixAwareRoutingConfig": {"PrefixLength": 2048, "ConcurrencyThreshold": 8},
    }
    model = botocore_model()
    assert "PREFIX_AWARE" in model.shape_for("RoutingStrategy").enum
    bounds = model.shape_for("PrefixAwareRoutingPrefixLength").metadata
    assert (bounds["min"], bounds["max"]) == dp.spec.PREFIX_LENGTH_RANGE
    sm, stub = _stubbed()
    _expect_creates(stub, spec, "c")
    with stub:
        sm.create_model(**spec.create_model_params("c"))
        sm.create_endpoint_config(**spec.create_endpoint_config_params("c", "c"))
    plain = _spec().create_endpoint_config_params("c", "m")["ProductionVariants"][0]
    assert "RoutingConfig" not in plain  # SageMaker's default unless asked


def botocore_model() -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker")


@mock_aws
def test_the_session_store_gets_a_lifecycle_rule_beside_the_buckets_own() -> None:
    """Objects no instance deleted expire a day past the TTL after their last write; the
    bucket's other rules stay, deploying again replaces the kit's rule, and a caller who may
    not set it is given the rule."""
    import boto3

    from llava.tools.deploy.store_lifecycle import check_apart, ensure_lifecycle

    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket="bucket")
    own = {"ID": "logs", "Filter": {"Prefix": "logs/"}, "Status": "Enabled",
           "Expiration": {"Days": 30}}  # fmt: skip
    s3.put_bucket_lifecycle_configuration(Bucket="bucket", LifecycleConfiguration={"Rules": [own]})
    said: list[str] = []
    for ttl in (1200, 3 * 86_400):  # deployed, then deployed again with a longer TTL
        rule = ensure_lifecycle(s3, "s3://bucket/sessions/llava", ttl, progress=said.append)
    assert rule is not None and rule["Filter"] == {"Prefix": "sessions/llava/llava/"}
    rules = s3.get_bucket_lifecycle_configuration(Bucket="bucket")["Rules"]
    assert [r["ID"] for r in rules] == ["logs", rule["ID"]]
    assert rules[1]["Expiration"] == {"Days": 4}
    assert rules[1]["NoncurrentVersionExpiration"]["NoncurrentDays"] == 1  # versioned buckets
    assert said[0].endswith("llava/llava/ expire 2 days after their last write")
    # a store whose sessions' prefix holds the model's archive (or sits under it) is refused
    check_apart("s3://bucket/sessions", ["s3://other/sessions/llava/model/"])
    for model_data in ("s3://bucket/sessions/llava/20261128/", "s3://bucket/sessions/"):
        with pytest.raises(dp.DeployError, match="overlap"):
            check_apart("s3://bucket/sessions", [model_data])
    with pytest.raises(ValueError, match="whole bucket"):  # never a rule over a whole bucket
        ensure_lifecycle(s3, "s3://bucket", 1200)

    class Refusing:
        def get_bucket_lifecycle_configuration(self, **kwargs: Any) -> Any:
            raise RuntimeError("AccessDenied")

    said.clear()
    assert ensure_lifecycle(Refusing(), "s3://bucket/p", 1200, progress=said.append) is None
    assert said[0].startswith("warning: could not set") and '"Days": 2' in said[0]


@mock_aws
def test_the_session_store_gets_a_secret_that_an_update_keeps_and_a_delete_removes() -> None:
    """deploy --session-store makes the endpoint's secret in Secrets Manager (256 random bits),
    an update keeps it (sessions sealed with it stay readable), the worker reads it through
    its role, and delete removes it."""
    import boto3

    from llava.sessions.secret import store_secret
    from llava.tools.deploy.store_secret import delete_store_secret, ensure_store_secret

    secrets = boto3.client("secretsmanager", region_name=REGION)
    said: list[str] = []
    arn = ensure_store_secret(secrets, "chat", progress=said.append)
    assert arn.split(":secret:")[1].startswith("llava/chat/session-store-")
    assert ensure_store_secret(secrets, "chat", progress=said.append) == arn  # an update
    assert said == [
        "made the session store's secret llava/chat/session-store in Secrets Manager",
        "the session store keeps its secret llava/chat/session-store",
    ]
    value = secrets.get_secret_value(SecretId=arn)["SecretString"]
    assert len(value) >= 43 and ensure_store_secret(secrets, "other", progress=said.append) != arn
    assert store_secret("", arn) == value  # what the worker reads at start (region from the ARN)
    tags = secrets.describe_secret(SecretId=arn)["Tags"]
    assert {"Key": "llava:endpoint", "Value": "chat"} in tags
    secrets.delete_secret(SecretId=arn, RecoveryWindowInDays=7)  # someone scheduled it gone
    assert ensure_store_secret(secrets, "chat", progress=said.append) == arn  # restored
    assert secrets.get_secret_value(SecretId=arn)["SecretString"] == value
    assert delete_store_secret(secrets, "chat") and not delete_store_secret(secrets, "chat")
    with pytest.raises(ValueError, match="GetSecretValue"):
        store_secret("", arn)
