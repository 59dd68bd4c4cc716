"""The command line: arguments and runners of `python -m llava deploy` and `... delete`."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llava.tools.archive import add_model_arguments
from llava.tools.deploy.aws import describe_or_none
from llava.tools.deploy.discover import discover_bucket, discover_role
from llava.tools.deploy.endpoint import Deployment, deploy
from llava.tools.deploy.errors import DeployError, EndpointExistsError
from llava.tools.deploy.names import validate_name
from llava.tools.deploy.spec import (
    CONCURRENCY_THRESHOLD,
    GPU_AMI,
    PREFIX_LENGTH,
    ROUTING,
    DeploySpec,
)
from llava.tools.deploy.store_access import check_store_access
from llava.tools.deploy.store_lifecycle import FRONTS_MODEL, check_apart, ensure_lifecycle
from llava.tools.deploy.store_secret import ensure_store_secret
from llava.tools.deploy.teardown import DeleteReport, delete
from llava.tools.deploy.upload import upload_archive


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
    add_model_arguments(parser)
    parser.add_argument(
        "--archive", help="upload this unpacked archive (with MAR-INF) instead of building one"
    )
    parser.add_argument(
        "--baked-image",
        action="store_true",
        help="the image holds the archive (MODEL_DIR=...): no upload, no model data",
    )
    parser.add_argument("--name", default="llava", help="endpoint name (default: llava)")
    parser.add_argument(
        "--front",
        default="torchserve",
        choices=["torchserve", "ray"],
        help="the image's front (FRONT= of build_and_push.sh): what model data to build",
    )
    parser.add_argument("--instance-type", default="ml.g5.2xlarge")
    parser.add_argument(
        "--inference-ami",
        default=GPU_AMI,
        help=f"the GPU hosts' AMI (default {GPU_AMI}: NVIDIA driver 580, which the images' vLLM "
        "needs); 'default' leaves SageMaker's choice",
    )
    parser.add_argument("--instance-count", type=int, default=1)
    parser.add_argument(
        "--routing",
        choices=sorted(ROUTING),
        help="how requests without a session id pick an instance (default: SageMaker's; "
        "prefix-aware sends chats that start alike to the instance holding them)",
    )
    parser.add_argument(
        "--prefix-length",
        type=int,
        help="prefix-aware routing: bytes of a body (characters of an OpenAI chat's text) it "
        "keys on (1024-65536)",
    )
    parser.add_argument(
        "--concurrency-threshold",
        type=int,
        help="prefix-aware routing: requests in flight on an instance before it sends the next "
        "elsewhere (1-1024)",
    )
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
    parser.add_argument(
        "--session-store",
        metavar="S3_URI",
        help="keep sessions in s3://bucket/prefix so they outlive their instance (the role's "
        "access is checked first)",
    )
    parser.add_argument("--session-store-kms-key", metavar="KEY", help="SSE-KMS key id or ARN")
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


def _store_settings(args: Any) -> dict[str, str]:
    """The worker settings `--session-store` and `--session-store-kms-key` stand for."""
    out = {}
    if args.session_store:
        out["session_store"] = args.session_store
    if args.session_store_kms_key:
        if not args.session_store:
            raise ValueError("--session-store-kms-key goes with --session-store")
        out["session_store_kms_key"] = args.session_store_kms_key
    return out


def _routing(args: Any) -> str | None:
    """`--routing`; its numbers are refused without prefix-aware routing (they would do nothing)."""
    given = args.prefix_length is not None or args.concurrency_threshold is not None
    if given and args.routing != "prefix-aware":
        raise ValueError(
            "--prefix-length and --concurrency-threshold go with --routing prefix-aware"
        )
    return str(args.routing) if args.routing else None


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
            settings={**_pairs(args.setting, "--setting"), **_store_settings(args)},
            env=_pairs(args.env, "--env"),
            model_data_download_timeout_s=args.download_timeout,
            container_startup_health_check_timeout_s=args.startup_timeout,
            inference_component=args.inference_component,
            accelerators=args.accelerators,
            memory_mb=args.memory_mb,
            copy_count=args.copy_count,
            inference_ami=None if args.inference_ami == "default" else args.inference_ami,
            routing=_routing(args),
            prefix_length=args.prefix_length or PREFIX_LENGTH,
            concurrency_threshold=args.concurrency_threshold or CONCURRENCY_THRESHOLD,
        )
        if args.session_store:
            iam = boto3.client("iam", region_name=region)
            check_store_access(
                iam,
                role_arn,
                args.session_store,
                endpoint=name,
                kms_key=args.session_store_kms_key or "",
                region=region,
            )
            check_apart(args.session_store, [s3_uri] if s3_uri else [], FRONTS_MODEL[args.front])
        existing = describe_or_none(sm.describe_endpoint, EndpointName=name)
        if existing is not None and not args.update:  # fail before a long build and upload
            raise EndpointExistsError(
                f"endpoint {name!r} already exists ({existing.get('EndpointStatus')}): delete it "
                f"(python -m llava delete --name {name}), pick another --name, or pass --update"
            )
        if args.session_store:  # past every check: a refused deploy changes no bucket
            s3_store = boto3.client("s3", region_name=region)
            model = FRONTS_MODEL[args.front]
            ensure_lifecycle(s3_store, args.session_store, args.ttl, model=model)
            secrets = boto3.client("secretsmanager", region_name=region)
            arn = ensure_store_secret(secrets, name)
            spec = replace(spec, settings={**spec.settings, "session_store_secret_id": arn})
        if s3_uri is not None:
            if args.archive:
                upload_archive(args.archive, s3_uri, s3_client=s3)
            else:
                import tempfile

                from llava.tools.archive import build_archive, resolve_model

                model_dir = resolve_model(args.model, args.cache_dir)
                with tempfile.TemporaryDirectory(prefix="llava-archive-") as tmp:
                    if args.front == "ray":  # AWS's Ray Serve container's model package
                        from llava.fronts.ray.package import write_package

                        archive = write_package(model_dir, Path(tmp) / "llava")
                    else:
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
