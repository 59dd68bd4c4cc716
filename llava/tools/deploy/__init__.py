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

Modules, one job each: `names` (names and S3 URIs), `aws` (boto3 plumbing), `progress`,
`upload` (model data on S3), `spec` (DeploySpec), `waiting` (polling), `endpoint` (deploy),
`teardown` (delete), `discover` (role and bucket), `cli` (the `deploy`/`delete` commands).
Everything public is re-exported here: `from llava.tools.deploy import X` works for each of them.
"""

from __future__ import annotations

from llava.tools.deploy.cli import (
    add_delete_arguments,
    add_deploy_arguments,
    run_delete,
    run_deploy,
)
from llava.tools.deploy.discover import discover_bucket, discover_role
from llava.tools.deploy.endpoint import Deployment, deploy
from llava.tools.deploy.errors import DeployError, DeploymentFailedError, EndpointExistsError
from llava.tools.deploy.names import (
    MAX_NAME,
    NAME_RE,
    STAMP_LEN,
    STAMP_RE,
    parse_s3_uri,
    resource_name,
    validate_name,
)
from llava.tools.deploy.progress import ByteProgress, Progress
from llava.tools.deploy.spec import (
    ENV_KEY_RE,
    ROLE_ARN_RE,
    SAGEMAKER_BODY_LIMIT,
    TS_RESPONSE_TIMEOUT_S,
    VARIANT,
    DeploySpec,
)
from llava.tools.deploy.teardown import DeleteReport, delete
from llava.tools.deploy.upload import MULTIPART_BYTES, delete_s3_prefix, upload_archive

__all__ = [
    "ByteProgress",
    "DeleteReport",
    "DeployError",
    "DeploySpec",
    "Deployment",
    "DeploymentFailedError",
    "ENV_KEY_RE",
    "EndpointExistsError",
    "MAX_NAME",
    "MULTIPART_BYTES",
    "NAME_RE",
    "Progress",
    "ROLE_ARN_RE",
    "SAGEMAKER_BODY_LIMIT",
    "STAMP_LEN",
    "STAMP_RE",
    "TS_RESPONSE_TIMEOUT_S",
    "VARIANT",
    "add_delete_arguments",
    "add_deploy_arguments",
    "delete",
    "delete_s3_prefix",
    "deploy",
    "discover_bucket",
    "discover_role",
    "parse_s3_uri",
    "resource_name",
    "run_delete",
    "run_deploy",
    "upload_archive",
    "validate_name",
]
