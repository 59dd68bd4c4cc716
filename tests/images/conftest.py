"""Fixtures for the image tests: Docker (Debian's dockerd, started here when none runs), the
stand-in base, the images built from the repo's Dockerfiles, and the shipped model's data in both
of SageMaker's layouts (an uncompressed S3 prefix, and a model.tar.gz as SageMaker unpacks it)."""

from __future__ import annotations

import os
import shutil
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from containers import build_image, daemon_up, image_size, standin, start_daemon

from llava.fronts.ray.package import write_package
from llava.tools.archive import build_archive
from llava.tools.tiny.train import SHIPPED


@pytest.fixture(scope="session")
def docker_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A running Docker daemon: the one there is, or Debian's dockerd started with no bridge."""
    if daemon_up():
        yield
        return
    if shutil.which("dockerd") is None and not os.environ.get("CI"):
        pytest.skip(
            "no Docker here: apt-get install docker.io (.ci/run does), then make test-images"
        )
    process = start_daemon(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    yield
    process.terminate()
    process.wait(120)


@pytest.fixture(scope="session")
def images(docker_daemon: None, request: pytest.FixtureRequest) -> Iterator[Callable[..., str]]:
    """`images(front, engine)`: the image's tag, built once a run (Docker's cache keeps layers
    between runs); the build times and sizes are printed at the end."""
    base = standin()
    built: dict[tuple[str, str], tuple[str, float]] = {}

    def get(front: str, engine: str) -> str:
        if (front, engine) not in built:
            built[front, engine] = build_image(front, engine, base)
        return built[front, engine][0]

    yield get
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for (front, engine), (tag, seconds) in built.items():
        line = (
            f"image {front}/{engine}: built in {seconds:.0f} s, {image_size(tag) / 2**30:.2f} GiB"
        )
        if reporter is not None:
            reporter.write_line(line)


def _unpack(tgz: Path, into: Path) -> Path:
    """Unpack a model.tar.gz as SageMaker does: its content becomes /opt/ml/model."""
    into.mkdir(parents=True)
    with tarfile.open(tgz) as archive:
        archive.extractall(into, filter="data")
    return into


@pytest.fixture(scope="session")
def model_data(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(front, layout) -> the folder mounted at /opt/ml/model; layout "prefix" (S3Prefix,
    CompressionType None: the folder as uploaded) or "tar.gz" (unpacked by SageMaker)."""
    root = tmp_path_factory.mktemp("model-data")
    archive = Path(build_archive(SHIPPED, root / "torchserve", name="model"))
    tgz = Path(build_archive(SHIPPED, root / "torchserve-tgz", name="model", archive_format="tgz"))
    package = write_package(SHIPPED, root / "ray")
    ray_tgz = root / "ray-model.tar.gz"
    with tarfile.open(ray_tgz, "w:gz") as out:  # `tar czf model.tar.gz package/`: one folder
        out.add(package, arcname="llava-package")
    return {
        ("torchserve", "prefix"): archive,
        ("torchserve", "tar.gz"): _unpack(tgz, root / "torchserve-unpacked"),
        ("ray", "prefix"): package,
        ("ray", "tar.gz"): _unpack(ray_tgz, root / "ray-unpacked"),
    }


@pytest.fixture(scope="module")
def moto_port() -> Iterator[int]:
    """moto's S3 and SageMaker API server on loopback (the containers reach it relayed)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield int(server.get_host_and_port()[1])
    finally:
        server.stop()
