"""The TorchServe image's `serve` (docker/torchserve/serve with its sagemaker-ts.properties), run
as SageMaker runs it: the unpacked archive at SM_MODEL_DIR, TorchServe in the foreground.

The image binds 0.0.0.0:8080; here TS_* variables (which the properties file lets override it,
as a model's Environment would) move every address to a free loopback port.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import ask, open_session, post

from llava.core.paths import SAMPLE_IMAGE
from llava.fronts.torchserve.launcher import free_ports
from llava.tools.archive import build_archive
from llava.tools.quickstart import FOLLOW_UP, QUESTION
from llava.tools.tiny.scenes import SAMPLE, colour_answer
from llava.tools.tiny.train import SHIPPED

REPO = Path(__file__).resolve().parents[2]
SERVE = REPO / "docker" / "torchserve" / "serve"


def _env(tmp: Path, model_dir: Path, port: int, others: list[int]) -> dict[str, str]:
    """The Dockerfile's ENV, with every address on loopback and the logs in `tmp`."""
    management, metrics, grpc_inference, grpc_management, worker = others
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "SM_MODEL_DIR": str(model_dir),
        "LOG_LOCATION": str(tmp / "logs"),
        "METRICS_LOCATION": str(tmp / "logs"),
        "TS_CONFIG_FILE": str(REPO / "docker" / "torchserve" / "sagemaker-ts.properties"),
        "TS_INFERENCE_ADDRESS": f"http://127.0.0.1:{port}",
        "TS_MANAGEMENT_ADDRESS": f"http://127.0.0.1:{management}",
        "TS_METRICS_ADDRESS": f"http://127.0.0.1:{metrics}",
        "TS_GRPC_INFERENCE_PORT": str(grpc_inference),
        "TS_GRPC_MANAGEMENT_PORT": str(grpc_management),
        "TS_INITIAL_WORKER_PORT": str(worker),
        "TS_METRICS_CONFIG": str(REPO / "handler" / "metrics.yaml"),
        "TS_DEFAULT_STARTUP_TIMEOUT": "600",
        "TMPDIR": str(tmp),
    }


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Poll /ping until 200, failing at once if `serve` exits."""
    deadline = 240.0
    with httpx.Client(timeout=2) as client:
        while deadline > 0:
            if process.poll() is not None:
                raise AssertionError(
                    f"serve exited {process.returncode}:\n{log.read_text()[-4000:]}"
                )
            try:
                if client.get(url + "/ping").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            process_wait(process, 0.5)
            deadline -= 0.5
    raise AssertionError("serve never became healthy:\n" + log.read_text()[-4000:])


def process_wait(process: subprocess.Popen[bytes], seconds: float) -> None:
    """Wait up to `seconds` for the process to exit (a poll interval that ends early on exit)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(seconds)


@pytest.fixture(scope="module")
def image_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`serve` started as the image starts it, on the shipped model; yields its base URL."""
    tmp = tmp_path_factory.mktemp("image-serve")
    store = tmp / "opt-ml"
    build_archive(SHIPPED, store, name="model")  # /opt/ml/model: the unpacked archive
    port, *others = free_ports(6)
    log = tmp / "serve.out"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [str(SERVE), "serve"],
            env=_env(tmp, store / "model", port, others),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # TorchServe's Java frontend and worker go with it
        )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", process, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop `serve`'s whole process group (it may have exited already)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_serve_answers_sagemaker_s_invocations_with_the_archive_at_sm_model_dir(
    image_serve: str,
) -> None:
    image = "data:image/png;base64," + base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
    url = image_serve + "/invocations"
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, image)
        first = ask(client, url, sid, QUESTION, max_new_tokens=12)
        second = ask(client, url, sid, FOLLOW_UP, max_new_tokens=12)
        assert post(client, url, {"type": "close_session"}, sid).status_code == 200
    assert first["text"] == colour_answer(SAMPLE, "circle")
    assert second["text"] == colour_answer(SAMPLE, "square")


def test_serve_refuses_a_model_dir_without_an_archive(tmp_path: Path) -> None:
    run = subprocess.run(
        [str(SERVE), "serve"],
        env={**os.environ, "SM_MODEL_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "MAR-INF/MANIFEST.json" in run.stderr and "python -m llava archive" in run.stderr


def test_serve_runs_any_other_command_as_given() -> None:
    run = subprocess.run(
        [str(SERVE), "echo", "debugging"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout == "debugging\n"
