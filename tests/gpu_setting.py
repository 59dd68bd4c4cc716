"""Where the GPU suite runs: CUDA with 7B shapes, the CPU with tiny ones, or nowhere."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Setting:
    device: str
    dtype: str
    profiles: tuple[str, str]  # llava-1.5-shaped, then a second family
    vllm_profile: str  # llava-1.5-shaped, with heads vLLM's attention takes (CPU: 32 wide)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


CUDA = Setting("cuda", "bfloat16", ("llava15-7b", "next-7b"), "llava15-7b")
CPU_LOGIC = Setting("cpu", "float32", ("tiny", "next"), "tiny-vllm")


def setting() -> Setting | None:
    if torch.cuda.is_available():
        return CUDA
    if os.environ.get("LLAVA_GPU_LOGIC") == "cpu":
        return CPU_LOGIC
    return None
