"""notebooks/deploy_and_chat.ipynb, executed end to end with nbclient, with no AWS account.

The notebook runs unmodified in a `python3` kernel of this virtual environment; only
environment variables steer it:

- the SageMaker control plane and S3 are moto in server mode (`ThreadedMotoServer` on
  127.0.0.1), reached through `AWS_ENDPOINT_URL_SAGEMAKER` and `AWS_ENDPOINT_URL_S3`;
- invocations go to the local SageMaker runtime (`LocalRuntime`) in front of two real
  TorchServes serving the tiny model, through `AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME`; its
  endpoint name is the one the notebook deploys in moto;
- the notebook's settings (endpoint name, image URI, role, bucket, an instance type moto
  accepts, the tiny checkpoint) come from its environment overrides, credentials are dummies.

One cell is appended to the in-memory copy before execution: it prints the notebook's results
as one JSON line for the assertions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_under_test import oracle

from llava.fronts.local_runtime.server import LocalRuntime
from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("boto3")
pytest.importorskip("moto")
try:
    from moto.server import ThreadedMotoServer
except ImportError as exc:  # flask / flask-cors come with the dev extra
    pytest.skip(f"moto's server mode is unavailable ({exc})", allow_module_level=True)

from notebook_run import (  # noqa: E402
    ENDPOINT,
    NOTEBOOK,
    QUESTIONS,
    REGION,
    ROOT,
    TOKENS,
    check_notebook_run,
    run_notebook,
)


@pytest.fixture(scope="module")
def instances(server_pair: list[TorchServe]) -> list[TorchServe]:
    return server_pair


@pytest.fixture(scope="module")
def runtime(instances: list[TorchServe]) -> Iterator[LocalRuntime]:
    with LocalRuntime([ts.url() for ts in instances], name=ENDPOINT, region=REGION) as rt:
        yield rt


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_committed_notebook_is_clean() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def test_notebook_deploys_chats_and_cleans_up(
    runtime: LocalRuntime, moto_url: str, tiny_checkpoint: Path
) -> None:
    from PIL import Image

    result, text = run_notebook(moto_url, runtime.url, tiny_checkpoint)
    image = Image.open(ROOT / "examples" / "sample.png").convert("RGB")
    expected = oracle(tiny_checkpoint).answers(image, QUESTIONS, TOKENS)
    check_notebook_run(result, text, moto_url, expected, runtime.routes)
