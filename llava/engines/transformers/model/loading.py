"""Load a checkpoint: check its family, pick devices and dtype, prove the engine's contract.

The engine feeds the model its own input embeddings (image features scattered in) and reads the
vision tower through `get_image_features`; both differ across transformers versions. A worker
checks at start that the installed transformers and the checkpoint agree with what the engine
passes, so a mismatch fails the worker with a message instead of answering wrongly.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from llava.core.config import ServerConfig

log = logging.getLogger(__name__)

HOST = torch.device("cpu")


def torch_threads(configured: int, usable_cpus: int, torch_default: int) -> int:
    """The intra-op threads to run with: as configured, else every CPU the worker may use."""
    if configured:
        return configured
    return max(1, min(torch_default, usable_cpus))


def set_torch_threads(config: ServerConfig) -> int:
    """Apply `torch_threads` to this process and return the count."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = torch_threads(config.torch_threads, usable or 1, torch.get_num_threads())
    torch.set_num_threads(threads)
    log.info("torch runs %d CPU threads (set torch_threads to override)", threads)
    return threads


def resolve_devices(config: ServerConfig) -> list[torch.device]:
    """List the devices to put a replica on: every visible GPU (capped), else the CPU."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return [HOST]
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {config.device!r} asked for but CUDA is not available")
    if config.device.startswith("cuda:"):
        return [torch.device(config.device)]
    count = torch.cuda.device_count()
    if config.max_replicas:
        count = min(count, config.max_replicas)
    return [torch.device("cuda", i) for i in range(count)]


def native_bf16(device: torch.device) -> bool:
    """Tell whether a GPU computes in bfloat16 natively (compute capability 8.0, Ampere, on).

    `torch.cuda.is_bf16_supported()` answers True on T4 and V100 too, which only emulate it.
    """
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_dtype(config: ServerConfig, device: torch.device) -> torch.dtype:
    """Pick the weights' dtype: bf16 on Ampere and later, fp16 on older GPUs, fp32 on CPU."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda":
        return torch.bfloat16 if native_bf16(device) else torch.float16
    return torch.float32


def load_model(model_dir: Path, device: torch.device, config: ServerConfig) -> Any:
    """Load one replica of the model on `device` through transformers' auto class, each tensor
    read from the checkpoint straight to the device (a `device_map`, through accelerate): a 7B
    model in bf16 never needs its 14 GB in host memory first, which an ml.g5.xlarge's 16 GB
    does not have beside the worker."""
    from transformers import AutoModelForImageTextToText

    started = time.perf_counter()
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir,
        dtype=resolve_dtype(config, device),
        attn_implementation=config.attn_implementation,
        device_map={"": str(device)},
    )
    model.eval()
    log.info("loaded %s on %s in %.1f s", model_dir.name, device, time.perf_counter() - started)
    return model


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)
