"""Notebook conveniences: discover the execution role (sagemaker SDK) and the default bucket."""

from __future__ import annotations

import os
from typing import Any

from llava.tools.deploy.aws import aws_client
from llava.tools.deploy.errors import DeployError


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
    getter: Any = getattr(sagemaker, "get_execution_role", None)
    if getter is None:  # SDK 3.x moved it
        from sagemaker.core.helper import session_helper

        getter = session_helper.get_execution_role
    return str(getter())


def discover_bucket(
    *, sts_client: Any = None, s3_client: Any = None, region: str | None = None
) -> str:
    """The SDK's default bucket, `sagemaker-<region>-<account>`, which must exist already.

    Computed with boto3 alone (the SDK would create the bucket; this never creates one).
    """
    sts = aws_client("sts", sts_client, region)
    account = sts.get_caller_identity()["Account"]
    region = region or getattr(sts.meta, "region_name", None) or os.environ.get("AWS_REGION")
    bucket = f"sagemaker-{region}-{account}"
    s3 = aws_client("s3", s3_client, region)
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception as exc:
        raise DeployError(
            f"no --bucket given and the default bucket {bucket} is not usable ({exc}): "
            "pass --bucket, or create it with `aws s3 mb s3://" + bucket + "`"
        ) from None
    return bucket
