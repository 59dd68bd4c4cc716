"""Print pip constraints that pin the base image's own torch stack.

Run inside the image at build time, before the kit is installed:

    python docker/base_constraints.py [--front ray] [--engine vllm] > /opt/llava-sessions/base.txt
    python -m pip install -c /opt/llava-sessions/base.txt ...

and again after it (without --engine), so that every later pip run keeps what was installed.
With `--engine vllm` the base's torch stack is not pinned: vLLM's wheel requires its own torch
(2.13.0 for vLLM 0.32.0, with torchvision and torchaudio built for it) and replaces the base's;
only the Ray front's Ray stays the base's.

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
    "vllm",  # once installed: later pip runs must not move vLLM or the torch it was built for
    "flashinfer-python",
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
    args = argv[1:]
    ray = args[:2] == ["--front", "ray"]
    args = args[2:] if ray else args
    if args not in ([], ["--engine", "vllm"], ["--engine", "transformers"]):
        print(
            "usage: base_constraints.py [--front ray] [--engine vllm|transformers]",
            file=sys.stderr,
        )
        return 2
    if args == ["--engine", "vllm"]:  # vLLM brings its torch stack; Ray stays the base's
        lines, missing = constraints(required=("ray",) if ray else (), optional=())
    else:
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
