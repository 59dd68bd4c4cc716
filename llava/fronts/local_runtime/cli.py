"""`python -m llava local-endpoint`: start N containers (TorchServes, or Ray Serve fronts) and the
local runtime in front of them."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from llava.core.paths import SAMPLE_IMAGE
from llava.fronts.local_runtime.prefix import PrefixAware
from llava.fronts.local_runtime.server import LocalRuntime

log = logging.getLogger(__name__)


BANNER = """
Local SageMaker runtime for endpoint '{name}' on {url}
({n} {front} instance(s) of model '{model}' on ports {ports}). In another terminal:

  export AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME={url}
  export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION=us-east-1
  {python} - <<'EOF'
from llava.client import SessionClient
client = SessionClient.for_endpoint("{name}")
with client.session(image="{sample}") as s:
    print(s.ask("What is in the picture?", max_new_tokens=32).text)
    for delta in s.stream("And the colors?", max_new_tokens=32):
        print(delta, end="", flush=True)
    print()
EOF

Stop everything with Ctrl-C.
"""


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8090,
    name: str = "llava",
    instances: int = 2,
    model_store: str | Path = "model-store",
    model: str = "llava",
    front: str = "torchserve",
    checkpoint: str | Path = "",
    replicas: int = 0,
    prefix_length: int | None = None,
    concurrency_threshold: int = 16,
) -> None:
    """Start `instances` containers and the runtime in front; block until Ctrl-C, then stop.

    A TorchServe serves `model` from `model_store`; a Ray Serve front (`front="ray"`) serves the
    directory `checkpoint` with `replicas` replicas, as AWS's Ray Serve container would. With
    `prefix_length`, requests without a session id are routed prefix-aware."""
    from concurrent.futures import ThreadPoolExecutor

    if instances < 1:
        raise SystemExit("--instances must be at least 1")
    try:
        routing = (
            None if prefix_length is None else PrefixAware(prefix_length, concurrency_threshold)
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    servers = _containers(front, instances, Path(model_store), model, Path(checkpoint), replicas)
    runtime: LocalRuntime | None = None
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        print(f"starting {instances} {front} instance(s)...", flush=True)
        with ThreadPoolExecutor(instances) as pool:
            for future in [pool.submit(server.start) for server in servers]:
                future.result()
        runtime = LocalRuntime(
            [server.url() for server in servers],
            name=name,
            host=host,
            port=port,
            prefix_aware=routing,
        )
        runtime.start()
        print(
            BANNER.format(
                name=name,
                url=runtime.url,
                n=instances,
                front="Ray Serve" if front == "ray" else "TorchServe",
                model=model if front != "ray" else checkpoint,
                ports=", ".join(str(server.port) for server in servers),
                python=sys.executable,
                sample=SAMPLE_IMAGE,
            ),
            flush=True,
        )
        threading.Event().wait()
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
    finally:
        if runtime is not None:
            runtime.stop()
        for server in servers:
            server.stop()
        signal.signal(signal.SIGTERM, previous)


def _containers(
    front: str, count: int, store: Path, model: str, checkpoint: Path, replicas: int
) -> list[Any]:
    """Return the (unstarted) containers the runtime forwards to."""
    if front == "ray":
        from llava.fronts.ray.launcher import RayServe

        return [RayServe(checkpoint, replicas=replicas) for _ in range(count)]
    from llava.fronts.torchserve.launcher import TorchServe

    if not (store / model).exists() and not any(store.glob(f"{model}.*")):
        raise SystemExit(f"no model '{model}' in {store}: build it first with `make archive`")
    return [TorchServe(store, model) for _ in range(count)]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
