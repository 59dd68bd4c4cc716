"""Server configuration: one frozen dataclass from model-config.yaml's `handler:` section.

Every field can be overridden by an environment variable `LLAVA_<FIELD>` (upper case), which is
how the SageMaker model's `Environment` tunes a deployed endpoint without rebuilding the archive.
Values are validated at start with messages that say what to change.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from llava.core.params import Limits

DTYPES = ("auto", "float32", "float16", "bfloat16")
# Numeric settings where 0 means "unset"; every other number must be positive.
_ZERO_ALLOWED = {
    "max_replicas",
    "device_budget_mb",
    "host_budget_mb",
    "max_context_tokens",
    "step_token_budget",
    "snapshot_budget_mb",
    "torch_threads",
    "image_processes",
    "whole_answer_s",
    "kv_cache_gb",
    "kv_block_size",
    "engine_step_timeout_s",
}
CACHE_MODES = ("kv", "pixels")
# "auto": vLLM's engine where vLLM is installed (the GPU images, `make venv-vllm`), else the
# transformers engine (the reference; any machine torch runs on).
ENGINE_CHOICES = ("auto", "transformers", "vllm")
ENV_PREFIX = "LLAVA_"


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one TorchServe worker serving LLaVA sessions."""

    # The engine behind the sessions (llava/engines/): auto, transformers or vllm
    engine: str = "auto"
    # vLLM's own settings (engine: vllm): the share of each GPU's memory it takes (weights and
    # its KV cache), the GPUs one model spans (tensor parallel), its KV cache in GiB (0 = on a
    # CPU a quarter of the memory available at start, at most 8 GiB, or VLLM_CPU_KVCACHE_SPACE;
    # on a GPU what gpu_memory_utilization leaves), and eager mode (no CUDA graphs or
    # torch.compile: a faster start).
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    kv_cache_gb: float = 0.0
    enforce_eager: bool = False
    # A dead engine core starts again after 1, 2, 4, ... s (at most 30); after this many failed
    # starts in a row the engine has failed: /ping and Ray's health check fail, so the instance
    # or replica is replaced. A step running longer than engine_step_timeout_s (a hung core)
    # kills the core, which then starts again (0 = never).
    engine_restart_attempts: int = 5
    engine_step_timeout_s: float = 300.0
    # Tokens per block of vLLM's KV cache, the unit its prefix cache finds (0 = 32 on a CPU, where
    # vLLM's own 128 re-prefills more of each follow-up; vLLM's 16 on a GPU).
    kv_block_size: int = 0
    # Model placement
    device: str = "auto"  # "auto" (every visible GPU, else CPU), "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # auto: bfloat16 (or float16) on GPU, float32 on CPU
    attn_implementation: str = "sdpa"
    max_replicas: int = 0  # on multi-GPU hosts, at most this many replicas (0 = one per GPU)
    # Sessions
    session_ttl_s: float = 1200.0
    max_sessions: int = 64
    # Sessions opening at once (image loading, encoding, prefilling): past it a new open gets
    # 429 with Retry-After, so an overloaded server refuses newcomers before the follow-ups of
    # the conversations it holds wait behind a growing queue of images. 0 = no limit.
    max_opening: int = 16
    # Memory tiers (0 = derived from the free memory at start: engines/transformers/model/budget):
    # past the device budget (per GPU) the least recently used sessions' caches move to host
    # memory; past the host budget they keep only their image features (recomputed on their next
    # turn); past that they are evicted.
    device_budget_mb: float = 0.0
    host_budget_mb: float = 0.0
    cache_mode: str = "kv"  # "kv": per-session KV cache; "pixels": the reference design
    # Scheduling: the tokens one step may process (decodes, prefill chunks, vision-tower work);
    # what bounds how long any stream waits while others open sessions or ask long questions.
    # 0 = measured: calibrated at start (engines/transformers/scheduling/calibrate.py), then
    # re-derived before every step from the steps actually run (.../scheduling/pacing.py). On
    # vLLM: its max_num_batched_tokens (0 = vLLM's own).
    step_token_budget: int = 0
    # CPU threads for torch's own operators. 0 = every CPU this worker may use (at most torch's
    # default). The step loop runs every forward on one thread with torch's threads beside it,
    # so with one core left to the frontend and the (niced) image processes it was the limit:
    # on 2 cores opens queued (p95 23 s) at 0.68 conversations/s with 1 thread, and 2 threads
    # held 0.72/s with opens' p95 2.6 s and follow-ups' p50 halved (bench/capacity.py).
    torch_threads: int = 0
    reaper_interval_s: float = 5.0
    # Snapshots: each session's conversation and image features on local disk, so a restarted
    # worker loses no conversation. "" = <temp dir>/llava-snapshots (in the SageMaker DLC, /tmp:
    # the container's local, writable disk); "off" = no snapshots. A budget of 0 = half the
    # disk's free space at start; past it the oldest snapshots go.
    snapshot_dir: str = ""
    snapshot_budget_mb: float = 0.0
    # A shared session store, so a conversation outlives its instance (scale-in, a deployment
    # update, a lost host): "s3://bucket/prefix" keeps every session's latest snapshot there
    # (written off the step thread after each open and finished turn) and lets any instance
    # resume it; "" = off (nothing leaves the instance). An S3-compatible server by its
    # endpoint URL; SSE-KMS by key id; the secret (below, required) seals
    # objects so one forged without it is refused.
    session_store: str = ""
    session_store_endpoint: str = ""
    session_store_kms_key: str = ""
    # The store's secret (required with a store): its value, or a Secrets Manager secret (name or
    # ARN) read at start through the instance's role; `deploy --session-store` makes the latter.
    session_store_secret: str = dataclasses.field(default="", repr=False)  # never logged
    session_store_secret_id: str = ""
    session_store_max_pending: int = 256  # sessions whose write may wait; past it the oldest go
    session_store_max_pending_mb: int = 1024  # and the snapshots they keep alive, at most
    # Before each turn of a held session, one HEAD to the store: another instance answered it
    # since? (then this copy is dropped and the newer one resumed). Off saves that round trip
    # per turn; a stale copy may then answer once before its write is refused.
    session_store_verify_turns: bool = True
    # On SIGTERM (scale-in, a deployment update): refuse new sessions, let answers in flight
    # finish for at most this long, then write every session's latest state to the store.
    drain_grace_s: float = 30.0
    # Requests
    max_body_bytes: int = 6 * 1024 * 1024
    max_prompt_chars: int = 16_000
    max_prompt_tokens: int = 2048
    max_new_tokens: int = 1024
    # A whole (not streamed) answer still generating after this many seconds ends with what it
    # has (finish reason "length"): SageMaker drops a response that takes over 60 s. 0 = never.
    whole_answer_s: float = 55.0
    default_max_new_tokens: int = 256
    max_context_tokens: int = 0  # 0 = the model's max_position_embeddings
    # Images
    image_allow_http: bool = False
    image_allow_hosts: tuple[str, ...] = ()
    image_s3_allow: tuple[str, ...] = ()  # "bucket" or "bucket/prefix/": none = s3:// off
    image_max_bytes: int = 20 * 1024 * 1024
    image_max_pixels: int = 40_000_000
    image_timeout_s: float = 20.0
    image_fetch_threads: int = 16  # downloads in flight at once (each waits on the network)
    # Processes that decode images and run the processor (0 = on the worker's threads, where
    # that CPU work holds the interpreter lock against every stream's step).
    image_processes: int = 2
    max_images_per_session: int = 8  # the opening image and those added with questions

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.engine not in ENGINE_CHOICES:
            raise ValueError(f"engine {self.engine!r} is not one of {', '.join(ENGINE_CHOICES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]: the share of each GPU")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(
                f"cache_mode {self.cache_mode!r} is not one of {', '.join(CACHE_MODES)}"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device {self.device!r}: use auto, cpu, cuda or cuda:N")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value}")
            if value < 0 or (value == 0 and f.name not in _ZERO_ALLOWED):
                raise ValueError(f"{f.name} must be positive, got {value}")
        if self.session_store and not self.session_store.startswith("s3://"):
            raise ValueError(
                f"session_store {self.session_store!r}: use s3://bucket/prefix, or leave it "
                "empty to keep sessions on the instance only"
            )
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens:
            raise ValueError("default_max_new_tokens must be between 1 and max_new_tokens")

    @property
    def limits(self) -> Limits:
        """Return the request limits the protocol layer enforces."""
        return Limits(
            max_body_bytes=self.max_body_bytes,
            max_prompt_chars=self.max_prompt_chars,
            max_new_tokens=self.max_new_tokens,
            default_max_new_tokens=self.default_max_new_tokens,
        )

    @property
    def device_budget_bytes(self) -> int | None:
        return int(self.device_budget_mb * 1024 * 1024) if self.device_budget_mb else None

    @property
    def host_budget_bytes(self) -> int | None:
        return int(self.host_budget_mb * 1024 * 1024) if self.host_budget_mb else None

    @property
    def snapshot_budget_bytes(self) -> int | None:
        return int(self.snapshot_budget_mb * 1024 * 1024) if self.snapshot_budget_mb else None

    @classmethod
    def from_mapping(
        cls, section: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build from a yaml `handler:` section, then `LLAVA_*` environment overrides."""
        section = dict(section or {})
        known = {f.name: f for f in fields(cls)}
        ignored = {"model_dir", "model_source"}  # archive-time keys, not worker settings
        unknown = sorted(set(section) - set(known) - ignored)
        if unknown:
            raise ValueError(
                f"unknown handler setting {unknown[0]!r} in model-config.yaml; "
                f"known: {', '.join(sorted(known))}"
            )
        values = {k: v for k, v in section.items() if k in known}
        for name, f in known.items():
            raw = (env if env is not None else os.environ).get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _parse_env(f, raw)
        values = {k: _coerce(known[k], v) for k, v in values.items()}
        return cls(**values)


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Convert a yaml or env value to the field's declared type, or say what is wrong."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("tuple"):
            if isinstance(value, str):
                value = value.split(",")
            return tuple(str(v).strip() for v in value if str(v).strip())
        if kind == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or float(value) != int(value):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"handler setting {f.name}: expected {kind}, got {value!r}") from None


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else str(f.type)
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: use true or false")
    return raw  # _coerce converts it, splitting comma lists
