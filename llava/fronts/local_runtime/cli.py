"""`python -m llava local-endpoint`: start N TorchServes and the local runtime in front of them."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from llava.core.paths import SAMPLE_IMAGE
from llava.fronts.local_runtime.server import LocalRuntime

log = logging.getLogger(__name__)


BANNER = """
Local SageMaker runtime for endpoint '{name}' on {url}
({n} TorchServe instance(s) of model '{model}' on ports {ports}). In another terminal:

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
) -> None:
    """Start `instances` TorchServes and the runtime in front; block until Ctrl-C, then stop."""
    from concurrent.futures import ThreadPoolExecutor

    from llava.fronts.torchserve.launcher import TorchServe

    store = Path(model_store)
    if not (store / model).exists() and not any(store.glob(f"{model}.*")):
        raise SystemExit(f"no model '{model}' in {store}: build it first with `make archive`")
    if instances < 1:
        raise SystemExit("--instances must be at least 1")
    servers = [TorchServe(store, model) for _ in range(instances)]
    runtime: LocalRuntime | None = None
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        print(f"starting {instances} TorchServe instance(s)...", flush=True)
        with ThreadPoolExecutor(instances) as pool:
            for future in [pool.submit(ts.start) for ts in servers]:
                future.result()
        runtime = LocalRuntime([ts.url() for ts in servers], name=name, host=host, port=port)
        runtime.start()
        sample = SAMPLE_IMAGE
        print(
            BANNER.format(
                name=name,
                url=runtime.url,
                n=instances,
                model=model,
                ports=", ".join(str(ts.port) for ts in servers),
                python=sys.executable,
                sample=sample,
            ),
            flush=True,
        )
        threading.Event().wait()
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
    finally:
        if runtime is not None:
            runtime.stop()
        for ts in servers:
            ts.stop()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
