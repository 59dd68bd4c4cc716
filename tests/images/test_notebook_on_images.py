"""The notebook user's path against the built image: notebooks/deploy_and_chat.ipynb run
headless (nbclient), unmodified, its endpoint the local SageMaker runtime in front of two
containers of the TorchServe image (as SageMaker runs them), the control plane and S3 on moto's
server. The notebook's session calls are boto3's `invoke_endpoint` with `SessionId` under the
kit's `SessionClient`, and the SageMaker Python SDK 3.x's `Endpoint.invoke(session_id=...)`: the
client code users copy. Its answers are the engine's own pipeline's.

Not the SDK's local mode (`LocalSession`): its compose file puts the container on a
`sagemaker-local` bridge network and publishes 8080 on the host, which this machine's Docker
(no bridge) cannot do; what it would start is the same `docker run IMAGE serve` with the model
at /opt/ml/model that these containers are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from containers import Container
from notebook_run import ENDPOINT, QUESTIONS, REGION, ROOT, TOKENS, check_notebook_run, run_notebook
from oracles import pipeline_answers

from llava.fronts.local_runtime.server import LocalRuntime
from llava.tools.archive import build_archive
from llava.tools.tiny.train import SHIPPED


@pytest.fixture(scope="module")
def moto_url(moto_port: int) -> str:
    return f"http://127.0.0.1:{moto_port}"


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_the_notebook_deploys_and_chats_through_the_image(
    engine: str, images: Any, moto_url: str, tmp_path: Path
) -> None:
    tag = images("torchserve", engine)
    archive = Path(build_archive(SHIPPED, tmp_path / "model-data", name="model"))
    containers = [Container(tag, archive, f"llava-notebook-{engine}-{i}", engine) for i in (0, 1)]
    try:
        for container in containers:
            container.start()
        for container in containers:
            container.wait_healthy()
        urls = [c.url for c in containers]
        with LocalRuntime(urls, name=ENDPOINT, region=REGION) as runtime:
            result, text = run_notebook(moto_url, runtime.url, SHIPPED)
            routes = dict(runtime.routes)
        [expected] = pipeline_answers(
            engine, SHIPPED, [ROOT / "examples" / "sample.png"], QUESTIONS, TOKENS
        )
        check_notebook_run(result, text, moto_url, expected, routes)
    finally:
        for container in containers:
            container.remove()
