"""notebooks/deploy_and_chat.ipynb run headless (nbclient) with no AWS account: the SageMaker
control plane and S3 are moto's server, invocations go to a local SageMaker runtime (in front of
TorchServes, or of the images' containers), and only environment variables steer the notebook.
One cell is appended to the in-memory copy: it prints the notebook's results as one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import boto3
import nbclient
import nbformat
import pytest
from botocore.exceptions import ClientError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "deploy_and_chat.ipynb"
REGION = "us-east-1"
ACCOUNT = "123456789012"
ENDPOINT = "llava-notebook"  # not the default: proves the notebook honors its settings
BUCKET = "llava-notebook-models"
TOKENS = 12
QUESTIONS = ["What is in this picture?", "Describe it in more detail."]  # the notebook's

RESULT_MARKER = "NOTEBOOK_RESULT "
RESULT_CELL = f"""
import json
import sys

print({RESULT_MARKER!r} + json.dumps({{
    "python": sys.executable,
    "session_id": session.id,
    "closed": session.closed,
    "answer": answer.text,
    "answer_tokens": answer.usage["generated_tokens"],
    "streamed": "".join(deltas),
    "stream_tokens": session.last_usage["generated_tokens"],
    "model_data": MODEL_DATA,
    "objects": [obj["Key"] for obj in objects],
    "deleted": report.deleted,
    "sdk_session_id": sdk_session_id,
    "sdk_answer": sdk_answer,
    "sdk_closed": closed.closed_session_id,
}}))
"""


def aws_env(moto_url: str, runtime_url: str) -> dict[str, str]:
    """This process's environment without any real AWS setting, pointed at moto and the runtime."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION=REGION,
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_ENDPOINT_URL_SAGEMAKER=moto_url,
        AWS_ENDPOINT_URL_S3=moto_url,
        AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME=runtime_url,
    )
    return env


def aws_client(service: str, env: dict[str, str]) -> Any:
    return boto3.client(
        service,
        region_name=REGION,
        endpoint_url=env[f"AWS_ENDPOINT_URL_{service.upper()}"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def outputs(nb: Any) -> list[dict[str, Any]]:
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def text_of(nb: Any) -> str:
    return "".join(out.get("text", "") for out in outputs(nb) if out["output_type"] == "stream")


def run_notebook(moto_url: str, runtime_url: str, checkpoint: Path) -> tuple[dict[str, Any], str]:
    """Execute the notebook, deploying `checkpoint`; return its results and printed text."""
    from jupyter_client.kernelspec import KernelSpecManager

    # `python3` is ipykernel's native kernel spec; jupyter_client runs its `python` with
    # sys.executable, i.e. this virtual environment (checked again from inside the kernel).
    assert KernelSpecManager().get_kernel_spec("python3").language == "python"

    env = aws_env(moto_url, runtime_url)
    aws_client("s3", env).create_bucket(Bucket=BUCKET)
    env.update(
        ENDPOINT=ENDPOINT,
        SKIP_BUILD="1",
        IMAGE_URI=f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/llava-sessions:test",
        ROLE_ARN=f"arn:aws:iam::{ACCOUNT}:role/LlavaSageMakerExecution",
        BUCKET=BUCKET,
        INSTANCE_TYPE="ml.m5.xlarge",  # moto refuses ml.g5.*
        MODEL=str(checkpoint),
        MAX_NEW_TOKENS=str(TOKENS),
    )

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(RESULT_CELL))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,
        startup_timeout=60,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute(env=env)  # raises CellExecutionError on the first failing cell

    errors = [out for out in outputs(nb) if out["output_type"] == "error"]
    assert not errors, errors
    text = text_of(nb)
    assert "Traceback" not in text
    line = next(line for line in text.splitlines() if line.startswith(RESULT_MARKER))
    result = json.loads(line[len(RESULT_MARKER) :])

    assert os.path.realpath(result["python"]) == os.path.realpath(sys.executable)
    return result, text


def check_notebook_run(
    result: dict[str, Any], text: str, moto_url: str, expected: list[str], routes: dict[str, int]
) -> None:
    """What a run of the notebook must show: uploaded, deployed, answered as `expected` (the
    engine's own pipeline's answers to QUESTIONS), streamed, closed and cleaned up."""
    env = aws_env(moto_url, "")
    # uploaded under a fresh prefix of the bucket, an unpacked archive
    prefix = f"llava-sessions/{ENDPOINT}/"
    assert result["model_data"].startswith(f"s3://{BUCKET}/{prefix}")
    assert any(key.endswith("MAR-INF/MANIFEST.json") for key in result["objects"])
    assert f"endpoint {ENDPOINT}: InService" in text

    # the session answered (greedy: exactly the stateless recomputation), streamed, and closed
    assert result["answer_tokens"] >= 1 and result["stream_tokens"] >= 1
    for question in QUESTIONS:
        assert f"Q: {question}" in text
    assert [result["answer"], result["streamed"]] == expected
    assert result["closed"] is True
    # the same first question through the SageMaker Python SDK's Endpoint.invoke(session_id=...)
    assert result["sdk_session_id"] not in ("", result["session_id"])
    assert result["sdk_answer"] == expected[0]
    assert result["sdk_closed"].split(";")[0].strip() == result["sdk_session_id"]
    assert routes == {}

    # cleaned up: endpoint, its config and model gone from moto, the S3 prefix empty
    assert f"endpoint {ENDPOINT}" in result["deleted"]
    sm = aws_client("sagemaker", env)
    with pytest.raises(ClientError) as info:
        sm.describe_endpoint(EndpointName=ENDPOINT)
    assert "Could not find endpoint" in str(info.value)
    assert sm.list_endpoint_configs(NameContains=ENDPOINT)["EndpointConfigs"] == []
    assert sm.list_models(NameContains=ENDPOINT)["Models"] == []
    listing = aws_client("s3", env).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    assert listing["KeyCount"] == 0
