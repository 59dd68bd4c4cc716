"""Print pip constraints that pin the base image's own torch stack.

Run inside the image at build time, before the kit is installed:

    python docker/base_constraints.py > /opt/llava-sessions/constraints.txt
    python -m pip install -c /opt/llava-sessions/constraints.txt ...

Why: the kit's `engine` extra says `torch>=2.4`, so a resolver that sees a newer torch on PyPI may
"upgrade" the base's CUDA build (matched to the image's CUDA, NCCL and cuDNN) to a generic wheel
several GB large. Pinning each package to the version already installed makes pip keep them or
fail loudly.

Standard library only: it runs under the base image's Python (3.13 in AWS's Ray Serve container)
before anything is installed. Exit status 1, with the reason on stderr, when a required package is
missing - that means BASE_IMAGE is not AWS's Ray Serve SageMaker container (or another image
with a CUDA torch).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version

# Without this the image cannot serve: pip must never replace it. (TorchServe 0.12.0 and
# torch-model-archiver come with the kit's `serve` extra: the base has no TorchServe.)
REQUIRED = ("torch",)
# The Ray Serve front's image (`--front ray`) also keeps the base's Ray, which its SageMaker
# entrypoint and the kit's router were built against, and its transformers, AWS's tested one.
REQUIRED_RAY = ("torch", "ray", "transformers")
# Pinned when the base image has them, so that no dependency drags in a build that does not match
# its torch (torchvision/torchaudio/triton are built against one torch release).
OPTIONAL = (
    "torchvision",
    "torchaudio",
    "torchtext",
    "torchdata",
    "triton",
)


def constraints(
    lookup: Callable[[str], str] = version,
    required: Iterable[str] = REQUIRED,
    optional: Iterable[str] = OPTIONAL,
) -> tuple[list[str], list[str]]:
    """Return (`name==version` lines, names of missing required packages)."""
    lines: list[str] = []
    missing: list[str] = []
    required = tuple(required)
    for name in (*required, *optional):
        try:
            installed = lookup(name)
        except PackageNotFoundError:
            if name in required:
                missing.append(name)
            continue
        lines.append(f"{name}=={installed}")
    return lines, missing


def main(argv: list[str]) -> int:
    ray = argv[1:] == ["--front", "ray"]
    lines, missing = constraints(required=REQUIRED_RAY if ray else REQUIRED)
    if missing:
        expected = (
            "AWS's Ray Serve SageMaker container, e.g. "
            "763104351884.dkr.ecr.<region>.amazonaws.com/ray:serve-ml-sagemaker-cuda-v1.1.0"
            if ray
            else "an image with AWS's CUDA torch, e.g. AWS's Ray Serve SageMaker container "
            "763104351884.dkr.ecr.<region>.amazonaws.com/ray:serve-ml-sagemaker-cuda-v1.1.0"
        )
        print(
            f"error: the base image has no {', '.join(missing)}. BASE_IMAGE must be {expected}",
            file=sys.stderr,
        )
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
