"""Start vLLM's engine for a checkpoint, with the kit's settings (`engine: vllm`).

The V1 `LLMEngine` is what the kit steps: it takes requests by id, advances every one of them
per `step()` (continuous batching, chunked prefill, prefix caching, CUDA graphs on a GPU) and
returns each request's new tokens, which is the contract's `step` already. `AsyncLLM` would add
an event loop of its own under the kit's step loop. Its engine core runs in a process of its own
(vLLM's default), so a crash there leaves the worker, and every session in it, standing.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

from llava.core.config import ServerConfig

log = logging.getLogger(__name__)


def engine_args(model_dir: Path, config: ServerConfig) -> Any:
    """Translate the kit's settings into vLLM's `EngineArgs`."""
    from vllm import EngineArgs
    from vllm.platforms import current_platform

    dtype = config.dtype
    if dtype == "auto" and current_platform.is_cpu():  # the kit's auto: float32 on a CPU
        dtype = "float32"
    return EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        seed=0,
        max_model_len=config.max_context_tokens or None,
        enforce_eager=config.enforce_eager,
        gpu_memory_utilization=config.gpu_memory_utilization,
        tensor_parallel_size=config.tensor_parallel_size,
        kv_cache_memory_bytes=kv_cache_bytes(config.kv_cache_gb, current_platform.is_cpu()),
        enable_prefix_caching=True,
        block_size=block_size(config.kv_block_size, current_platform.is_cpu()),
        limit_mm_per_prompt={"image": config.max_images_per_session},
        max_num_batched_tokens=step_tokens(config.step_token_budget, current_platform.is_cpu()),
        # Sampling follows the request alone, as on the transformers engine: the checkpoint's
        # generation_config.json sets no defaults (its end-of-answer ids are passed per request).
        generation_config="vllm",
        disable_log_stats=False,
    )


CPU_KV_CACHE_MAX = 8 * 2**30
CPU_STEP_TOKENS = 64


def kv_cache_bytes(configured_gb: float, on_cpu: bool) -> int | None:
    """The KV cache to ask vLLM for: as configured, else on a CPU a quarter of the memory
    available now, at most 8 GiB (vLLM's CPU backend otherwise reserves
    `gpu_memory_utilization` of all the machine's memory, and will not start beside other
    programs), unless VLLM_CPU_KVCACHE_SPACE says; else vLLM's (its share of each GPU)."""
    if configured_gb:
        if on_cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log.warning(
                "VLLM_CPU_KVCACHE_SPACE=%s overrides kv_cache_gb=%s (vLLM applies its own "
                "setting over the size asked for): unset one of them",
                os.environ["VLLM_CPU_KVCACHE_SPACE"],
                configured_gb,
            )
        return int(configured_gb * 2**30)
    if not on_cpu or os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    import psutil

    quarter = psutil.virtual_memory().available // 4
    return min(quarter, CPU_KV_CACHE_MAX) // 2**20 * 2**20


def step_tokens(configured: int, on_cpu: bool) -> int | None:
    """The tokens one of vLLM's steps may take (its `max_num_batched_tokens`, chunked prefill's
    budget): as configured, else 64 on a CPU, else vLLM's. Fewer tokens a step shorten streams'
    gaps while pictures open: a CPU prefills about 0.45 ms a token here, so at vLLM's default
    (2,048) one llava15 picture's 576 tokens hold every stream for a quarter of a second (28x the
    quiet median gap while 4 open, 12x at 256, 5-13x at 64, where vLLM's engine alone with no
    server is at 5.4-8.9x; bench/results/gaps-vllm*.json). vLLM then runs at most 64 requests
    at once (its max_num_seqs follows the budget when unset). A GPU's steps are fast enough for
    vLLM's own default. Seeded answers split across steps on a CPU need the kit's vLLM plugin
    (cpu_seeds), which installing the kit registers."""
    if configured:
        return configured
    return CPU_STEP_TOKENS if on_cpu else None


SEEDS_PLUGIN = "llava_cpu_seeds"  # pyproject.toml's vllm.general_plugins entry (cpu_seeds.py)


def keep_plugin(name: str) -> None:
    """Keep the kit's vLLM plugin loaded where VLLM_PLUGINS names which plugins vLLM loads
    (unset: all): without cpu_seeds a seeded prompt split across steps kills a CPU's core."""
    allowed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    if "VLLM_PLUGINS" in os.environ and name not in allowed:
        os.environ["VLLM_PLUGINS"] = ",".join([*allowed, name])


def block_size(configured: int, on_cpu: bool) -> int | None:
    """The KV block size to ask vLLM for: as configured, else 32 on a CPU (vLLM's CPU default
    of 128 leaves up to 127 tokens of a session's conversation to prefill again each turn; 32
    is the least its CPU attention takes: follow-ups 1.5-1.9x faster on llava15 here,
    bench/results/engines-llava15-block128.json against engines-llava15.json), else vLLM's."""
    if configured:
        return configured
    return 32 if on_cpu else None


def start_engine(model_dir: Path, config: ServerConfig) -> Any:
    """Start an `LLMEngine` (its engine core in its own process unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0); raise what vLLM raises if it cannot."""
    from vllm.v1.engine.llm_engine import LLMEngine

    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # the worker's logging stays its own
    keep_plugin(SEEDS_PLUGIN)
    log.info("starting vLLM's engine on %s", model_dir)
    reaper = start_reaper()  # first: a worker that dies while the core starts must not leave it
    try:
        llm = LLMEngine.from_engine_args(engine_args(model_dir, config))
    except BaseException:
        stop_reaper(reaper, signal.SIGTERM)  # what the failed start left running goes now
        raise
    stop_reaper(reaper, signal.SIGUSR1)  # the engine is up: its processes are all started
    watch_engine_core(llm)
    llm.llava_reaper = reaper
    return llm


def core_processes(llm: Any) -> list[Any]:
    """Return the engine core processes of an engine (none when the core runs in-process)."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def start_reaper() -> Any:
    """Start the process that kills this engine's processes when the worker dies or lets the
    engine go (`reaper.py`); None when the core runs in the worker's own process."""
    import subprocess
    import sys

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        return None
    from llava.engines.vllm.reaper import SIGNALS

    # blocked in the reaper until it has its handlers: their default would end it
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "llava.engines.vllm.reaper", str(os.getpid())],
            start_new_session=True,  # not in the worker's process group: outlives a group kill
            stdin=subprocess.DEVNULL,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)


def stop_reaper(reaper: Any, signum: int) -> None:
    """Tell a reaper the engine is up (SIGUSR1) or to kill its processes now (SIGTERM)."""
    if reaper is not None and reaper.poll() is None:
        reaper.send_signal(signum)


def release_reaper(llm: Any) -> None:
    """Let an engine's reaper kill what is left of its core (the engine is being replaced)."""
    stop_reaper(getattr(llm, "llava_reaper", None), signal.SIGTERM)
    llm.llava_reaper = None


def watch_engine_core(llm: Any) -> None:
    """Wake a step waiting on a dead engine core with `EngineDeadError`.

    vLLM's synchronous client (0.32) notices a dead core and shuts itself down, but its output
    thread then exits without a word, and a step already waiting for outputs waits for ever
    (its asyncio client sends `EngineDeadError` instead). A thread waiting on the core
    processes' exit sends it here. An engine core in the worker's own process has no such
    process: its death is the worker's, and TorchServe restarts the worker."""
    import multiprocessing.connection
    import threading

    from vllm.v1.engine.exceptions import EngineDeadError

    processes = core_processes(llm)
    outputs = getattr(llm.engine_core, "outputs_queue", None)
    if not processes or outputs is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([process.sentinel for process in processes])
        outputs.put_nowait(EngineDeadError())

    threading.Thread(target=watch, name="llava-vllm-core-watch", daemon=True).start()


def watch_steps(requests: Any, timeout_s: float) -> None:
    """Kill the engine core under a step that has run for over `timeout_s` (a hung core: a
    stopped process, a stuck kernel), so its death is noticed and it starts again.

    A thread reads when the step in progress began (`requests.step_started`) once a second, or
    four times per timeout if shorter. A core in the worker's own process cannot be killed
    alone: a hang there is reported once and left to the front."""
    import contextlib
    import threading
    import time

    period = min(1.0, timeout_s / 4)

    def watch() -> None:
        killed: set[int] = set()
        while True:
            time.sleep(period)
            started, llm = requests.step_started, requests.llm
            if started is None or time.monotonic() - started < timeout_s or id(llm) in killed:
                continue
            killed.add(id(llm))
            processes = core_processes(llm)
            log.error(
                "a step of vLLM's engine has run for over %.0f s: %s",
                timeout_s,
                "killing its engine core" if processes else "its core is in this process",
            )
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)

    threading.Thread(target=watch, name="llava-vllm-step-watch", daemon=True).start()


def engine_dead_error() -> type[BaseException]:
    """Return vLLM's error for an engine core that died (kill -9, a crash in a kernel)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def client_errors() -> tuple[type[BaseException], ...]:
    """Return vLLM's errors for a request it refuses (too long for the model, bad ids): its
    client errors, and the ValueErrors of older code paths."""
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError, ValueError)


# vLLM's metrics the kit republishes, and the names they take there (a gauge in percent).
METRICS = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_percent",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
}


def engine_metrics() -> dict[str, int]:
    """Read vLLM's own figures from its Prometheus registry (empty if it keeps none)."""
    from vllm.v1.metrics.reader import Counter, Gauge, get_metrics_snapshot

    out: dict[str, int] = {}
    for metric in get_metrics_snapshot():
        name = METRICS.get(metric.name)
        if name is not None and isinstance(metric, (Counter, Gauge)):
            scale = 100 if name.endswith("percent") else 1
            out[name] = out.get(name, 0) + round(metric.value * scale)
    return out
