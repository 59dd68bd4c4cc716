"""Delete a deployment and what was made for it (DeleteReport), tolerating missing pieces."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from llava.tools.deploy.aws import aws_client, describe_or_none, is_missing, paginate
from llava.tools.deploy.names import base_name, parse_s3_uri, stamp_pattern, validate_name
from llava.tools.deploy.progress import Progress, print_stderr
from llava.tools.deploy.store_secret import delete_store_secret, secret_name
from llava.tools.deploy.upload import delete_s3_prefix
from llava.tools.deploy.waiting import wait_gone


@dataclass
class DeleteReport:
    """What `delete` removed, and what was already gone."""

    deleted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def delete(
    name: str,
    *,
    sm_client: Any = None,
    s3_client: Any = None,
    ecr_client: Any = None,
    secrets_client: Any = None,
    s3_uri: str | None = None,
    ecr_repository: str | None = None,
    wait: bool = True,
    poll_s: float = 10,
    timeout_s: float = 1800,
    progress: Progress = print_stderr,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> DeleteReport:
    """Delete the endpoint `name` and everything `deploy` made for it; tolerate missing pieces.

    Finds the endpoint config through the endpoint, the models through the config's variants
    and the inference components on the endpoint, plus leftovers named `<name>-<stamp>` (from an
    update not waited for, or a half-finished delete). Inference components go first, then the
    endpoint (waited for until gone, unless `wait=False`), configs, models, and the session
    store's secret if `deploy --session-store` made one. `s3_uri` (the model data prefix) and
    `ecr_repository` (with all its images) are deleted only when given.
    """
    validate_name(name)
    sm = aws_client("sagemaker", sm_client)
    region = getattr(getattr(sm, "meta", None), "region_name", None)
    report = DeleteReport()
    waits: dict[str, Any] = dict(
        poll_s=poll_s, timeout_s=timeout_s, progress=progress, sleep=sleep, clock=clock
    )

    def done(what: str) -> None:
        report.deleted.append(what)
        progress(f"deleted {what}")

    def gone(what: str) -> None:
        report.missing.append(what)
        progress(f"{what}: not found (already deleted)")

    def remove(call: Any, what: str, **params: Any) -> bool:
        """Delete one resource; report it gone and return False if it already was."""
        try:
            call(**params)
        except Exception as exc:
            if not is_missing(exc):
                raise
            gone(what)
            return False
        return True

    endpoint = describe_or_none(sm.describe_endpoint, EndpointName=name)
    pattern = stamp_pattern(name)
    config_names: list[str] = []
    if endpoint and endpoint.get("EndpointConfigName"):
        config_names.append(endpoint["EndpointConfigName"])
    for summary in paginate(
        sm, "list_endpoint_configs", "EndpointConfigs", NameContains=base_name(name)
    ):
        if pattern.fullmatch(summary["EndpointConfigName"]):
            config_names.append(summary["EndpointConfigName"])
    config_names = list(dict.fromkeys(config_names))

    configs = {}
    for config_name in config_names:
        desc = describe_or_none(sm.describe_endpoint_config, EndpointConfigName=config_name)
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
        components = paginate(
            sm, "list_inference_components", "InferenceComponents", EndpointNameEquals=name
        )
        for summary in components:
            ic_name = summary["InferenceComponentName"]
            desc = describe_or_none(sm.describe_inference_component, InferenceComponentName=ic_name)
            if desc and desc.get("Specification", {}).get("ModelName"):
                model_names.append(desc["Specification"]["ModelName"])
            what = f"inference component {ic_name}"
            if not remove(sm.delete_inference_component, what, InferenceComponentName=ic_name):
                continue
            if wait:
                wait_gone(
                    partial(sm.describe_inference_component, InferenceComponentName=ic_name),
                    what=f"inference component {ic_name}",
                    **waits,
                )
            done(f"inference component {ic_name}")

    if remove(sm.delete_endpoint, f"endpoint {name}", EndpointName=name):
        if wait:
            wait_gone(
                lambda: sm.describe_endpoint(EndpointName=name), what=f"endpoint {name}", **waits
            )
        done(f"endpoint {name}")

    for summary in paginate(sm, "list_models", "Models", NameContains=base_name(name)):
        if pattern.fullmatch(summary["ModelName"]):
            model_names.append(summary["ModelName"])
    if not config_names:
        gone(f"endpoint config for {name}")
    for config_name in config_names:
        what = f"endpoint config {config_name}"
        if remove(sm.delete_endpoint_config, what, EndpointConfigName=config_name):
            done(what)
    if not model_names:
        gone(f"model for {name}")
    for model_name in dict.fromkeys(model_names):
        if remove(sm.delete_model, f"model {model_name}", ModelName=model_name):
            done(f"model {model_name}")

    try:
        if delete_store_secret(aws_client("secretsmanager", secrets_client, region), name):
            done(f"secret {secret_name(name)}")
    except Exception as exc:  # a caller without Secrets Manager rights: the rest still goes
        progress(f"warning: could not delete the secret {secret_name(name)} ({exc})")
    if s3_uri:
        bucket, prefix = parse_s3_uri(s3_uri)
        count = delete_s3_prefix(s3_uri, s3_client=aws_client("s3", s3_client, region))
        if count:
            done(f"{count} objects under s3://{bucket}/{prefix}")
        else:
            gone(f"objects under s3://{bucket}/{prefix}")
    if ecr_repository:
        ecr = aws_client("ecr", ecr_client, region)
        try:
            ecr.delete_repository(repositoryName=ecr_repository, force=True)
            done(f"ECR repository {ecr_repository}")
        except Exception as exc:
            if not is_missing(exc):
                raise
            gone(f"ECR repository {ecr_repository}")
    return report
