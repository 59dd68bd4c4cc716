"""Deploy: create or update model, endpoint config, endpoint (and inference component).

Also the `Deployment` record it returns and the best-effort rollback of a failed attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from llava.tools.deploy.aws import aws_client, describe_or_none, is_missing
from llava.tools.deploy.errors import DeployError, DeploymentFailedError, EndpointExistsError
from llava.tools.deploy.names import resource_name
from llava.tools.deploy.progress import Progress, print_stderr
from llava.tools.deploy.spec import DeploySpec
from llava.tools.deploy.waiting import wait_status


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


def deploy(
    spec: DeploySpec,
    *,
    sm_client: Any = None,
    wait: bool = True,
    update: bool = False,
    poll_s: float = 30,
    timeout_s: float | None = None,
    progress: Progress = print_stderr,
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
    sm = aws_client("sagemaker", sm_client)
    region = getattr(getattr(sm, "meta", None), "region_name", None)
    timeout = timeout_s or (
        spec.model_data_download_timeout_s + spec.container_startup_health_check_timeout_s + 1800
    )
    waits: dict[str, Any] = dict(
        poll_s=poll_s, timeout_s=timeout, progress=progress, sleep=sleep, clock=clock
    )
    hint = f"\n(see CloudWatch log group /aws/sagemaker/Endpoints/{spec.name}; "
    hint += f"remove it with `python -m llava delete --name {spec.name}`)"

    existing = describe_or_none(sm.describe_endpoint, EndpointName=spec.name)
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

    desc = wait_status(
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
        old = describe_or_none(sm.describe_endpoint_config, EndpointConfigName=old_config)
        stale: list[tuple[str, str]] = [
            ("model", v["ModelName"])
            for v in (old or {}).get("ProductionVariants", [])
            if v.get("ModelName") and v["ModelName"] != model_name
        ]
        if old:
            stale.append(("endpoint config", str(old_config)))
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
            ic = wait_status(
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
            if not is_missing(exc):
                progress(f"{verb} {kind} {name}: could not delete ({exc})")
