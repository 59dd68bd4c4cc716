"""The model package AWS's Ray Serve SageMaker container reads: `config.yaml` (a Ray Serve
`applications:` config), `deployment.py` (what its import path names) and `code/requirements.txt`,
with the checkpoint beside them in `weights/`. SageMaker puts it at /opt/ml/model."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

PACKAGE_DIR = Path("/opt/ml/model")  # where SageMaker extracts the model data
CONFIG = "config.yaml"

DEPLOYMENT = '''"""The Serve application of this package: the kit's Ray Serve front."""

from llava.fronts.ray.app import build

__all__ = ["build"]
'''

REQUIREMENTS = "# Installed at start-up. The kit itself is in the image (docker/ray/Dockerfile).\n"


def write_package(
    checkpoint: Path,
    out: Path,
    *,
    model_name: str = "llava",
    replicas: int = 0,
    settings: Mapping[str, Any] | None = None,
) -> Path:
    """Write the package for `checkpoint` into `out` (weights copied) and return `out`."""
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"{checkpoint} is not a checkpoint directory (no config.json)")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(checkpoint, out / "weights", dirs_exist_ok=True)
    args: dict[str, Any] = {"model_dir": "weights", "model_name": model_name}
    if replicas:
        args["replicas"] = replicas  # else one per GPU
    if settings:
        args["settings"] = dict(settings)
    application = {
        "name": model_name,
        "route_prefix": "/",
        "import_path": "deployment:build",
        "args": args,
    }
    (out / CONFIG).write_text(yaml.safe_dump({"applications": [application]}, sort_keys=False))
    (out / "deployment.py").write_text(DEPLOYMENT)
    (out / "code").mkdir(exist_ok=True)
    (out / "code" / "requirements.txt").write_text(REQUIREMENTS)
    return out


def read_package(config: Path) -> dict[str, Any]:
    """Return the first application's args from a package's config.yaml, its `model_dir`
    resolved against the package's directory."""
    applications = yaml.safe_load(config.read_text()).get("applications") or []
    if not applications:
        raise SystemExit(f"{config} names no application (expected `applications:`)")
    args = dict(applications[0].get("args") or {})
    if "model_dir" not in args:
        raise SystemExit(f"{config}: the application's args need a model_dir")
    args["model_dir"] = str(config.parent / args["model_dir"])
    return args
