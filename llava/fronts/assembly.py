"""Assemble one serving instance from a checkpoint: engine, memory tiers, sessions, images, service.

Every front (TorchServe's worker, a Ray Serve replica) builds its instance here, so they serve the
same service over the same engine with the same budgets and recovery; a front adds only its
transport and its own metrics.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llava.core.config import ServerConfig
from llava.server.service import SessionService
from llava.sessions.registry import safe_name

log = logging.getLogger(__name__)


@dataclass
class Instance:
    """What a front keeps of an assembled instance."""

    service: SessionService[Any, Any]
    memory: Any  # the TieredMemory: sessions and bytes per tier, for metrics and routing
    decoder: Any  # the engine's decoder: answers decoded outside a batch, for metrics
    snapshots: Any = None  # the local SnapshotDir, if snapshots are on
    shared: Any = None  # the SharedStore, if a shared session store is configured
    engine_stats: Callable[[], dict[str, int]] | None = None  # the engine's own figures

    def drain(self, grace_s: float) -> dict[str, Any]:
        """Stop taking sessions, let answers finish, flush every session's latest state."""
        from llava.server.draining import drain

        def flush(timeout_s: float) -> bool:
            if self.shared is not None:  # nothing steps now: save what the store never got
                dirty = self.shared.dirty()
                for session in self.service.store.snapshot():
                    if session.id in dirty:
                        self.service.keeper.keep(session)
            if self.snapshots is not None:
                self.snapshots.flush()
            return self.shared is None or bool(self.shared.flush(timeout_s))

        return drain(self.service, grace_s, flush=flush)


def open_registry(name: str, directory: str | None = None) -> tuple[Any, list[str]]:
    """Open a model's session registry; return it and the ids a dead predecessor lost.

    Returns `(None, [])` when the registry cannot be used: sessions then work without it.
    """
    from llava.sessions.registry import SessionRegistry

    try:
        registry = SessionRegistry.for_model(name, directory)
        lost = registry.recover()
    except Exception:  # the registry is a diagnosis aid: never let it stop the worker
        log.warning(
            "session registry unavailable; lost sessions will read as unknown", exc_info=True
        )
        return None, []
    if lost:
        log.info("%d sessions of an earlier worker are lost; they answer session_lost", len(lost))
    return (registry if registry.enabled else None), lost


def open_snapshots(config: ServerConfig, name: str) -> Any:
    """Open a model's snapshot directory, or None when snapshots are off or impossible."""
    from llava.sessions.snapshots import SnapshotDir

    if config.snapshot_dir == "off":
        return None
    try:
        return SnapshotDir.for_model(config.snapshot_dir, name, config.snapshot_budget_bytes)
    except OSError as exc:  # sessions still work; only a restart loses them
        log.warning(
            "session snapshots disabled: cannot use %r (%s); set snapshot_dir to a writable "
            "local directory",
            config.snapshot_dir,
            exc,
        )
        return None


def open_shared_store(config: ServerConfig, name: str) -> Any:
    """Connect the shared session store, or None when none is configured."""
    if not config.session_store:
        return None
    from llava.sessions.objects import S3Objects, StoreLocation
    from llava.sessions.secret import store_secret
    from llava.sessions.shared import SharedStore

    location = StoreLocation.parse(config.session_store).under(safe_name(name))
    secret = store_secret(config.session_store_secret, config.session_store_secret_id)
    objects = S3Objects.connect(
        location.bucket,
        endpoint_url=config.session_store_endpoint,
        kms_key_id=config.session_store_kms_key,
    )
    return SharedStore(
        objects,
        location,
        secret=secret,
        verify_turns=config.session_store_verify_turns,
        max_pending=config.session_store_max_pending,
        max_pending_bytes=config.session_store_max_pending_mb << 20,
    )


def vllm_host_budget(config: ServerConfig) -> int | None:
    """The host memory vLLM's sessions (their pictures) may hold: `host_budget_mb`, else half
    of what is available once vLLM has started (as the transformers engine derives it)."""
    from llava.core.hostmem import available_host_bytes, host_budget

    if config.host_budget_bytes is not None:
        return config.host_budget_bytes
    available = available_host_bytes()
    if available is None:
        return None
    budget = host_budget(available)
    log.info(
        "host budget derived: %.1f GiB available -> %.1f GiB for sessions' pictures "
        "(set host_budget_mb to override)",
        available / 2**30,
        budget / 2**30,
    )
    return budget


def load_engine(model_dir: Path, config: ServerConfig) -> tuple[Any, Any, Any, Any]:
    """Start the configured engine (torch and vLLM are imported here only); return it, its
    memory tiers, the transformers engine's decoder (None on vLLM) and the engine's figures."""
    from llava.engines import resolve_engine
    from llava.server.contract import Engine
    from llava.sessions.memory import TieredMemory

    engine: Engine[Any, Any]  # mypy checks each engine against the contract here
    if resolve_engine(config.engine) == "vllm":
        from llava.engines.vllm import VllmEngine

        vllm_engine = VllmEngine.load(model_dir, config)
        engine = vllm_engine  # vLLM sizes its own cache; sessions keep pictures on the host
        memory = TieredMemory(vllm_engine, None, vllm_host_budget(config))
        return engine, memory, None, vllm_engine.stats
    from llava.engines.transformers import LlavaEngine, set_torch_threads
    from llava.engines.transformers.model.budget import derive_budgets

    set_torch_threads(config)
    llava_engine = LlavaEngine.load(model_dir, config)
    engine = llava_engine
    budgets = derive_budgets(
        [r.device for r in llava_engine.runner.replicas],
        config.device_budget_bytes,
        config.host_budget_bytes,
    )
    memory = TieredMemory(llava_engine, budgets.device, budgets.host)
    llava_engine.limit_batches(budgets.device)  # the batch has the budget's other half
    llava_engine.limit_workspace(budgets.workspace)
    return engine, memory, llava_engine.runner.decoder, None


def assemble(
    model_dir: Path,
    config: ServerConfig,
    *,
    model_name: str,
    state_name: str | None = None,
    id_prefix: str = "",
    registry_dir: str | None = None,
) -> Instance:
    """Load the checkpoint and build a ready service; restore what a predecessor left open.

    `state_name` names this instance's registry and snapshots (default: the model's name): an
    instance that replaces a dead one under the same name takes over its sessions. `id_prefix`
    starts every session id it issues (a router reads it back)."""
    from llava.images import ImageLoader, ImagePolicy
    from llava.sessions.session import LOST, Session
    from llava.sessions.snapshots import recover
    from llava.sessions.store import SessionStore

    engine, memory, decoder, stats = load_engine(model_dir, config)
    name = state_name or model_name
    registry, left_open = open_registry(name, registry_dir)
    # Snapshots need the registry: it alone tells which sessions an earlier worker left open.
    snapshots = open_snapshots(config, name) if registry is not None else None
    shared = open_shared_store(config, model_name)

    def release(session: Session, reason: str) -> None:
        engine.release(session.state)
        if snapshots is not None:
            snapshots.remove(session.id)
        if shared is not None:
            shared.remove(session.id, reason)

    store = SessionStore(
        ttl_s=config.session_ttl_s,
        max_sessions=config.max_sessions,
        max_opening=config.max_opening,
        memory=memory,
        release=release,
        journal=registry,
        id_prefix=id_prefix,
    )
    holds = shared.holds if shared is not None else None
    if snapshots is not None:
        recover(snapshots, engine, store, left_open, shared=holds)
    elif holds is None:
        store.load_tombstones(left_open, LOST)
    else:  # what the store holds resumes from there on its next request
        store.load_tombstones([sid for sid in left_open if not holds(sid)], LOST)
    store.start_reaper(config.reaper_interval_s)
    images = ImageLoader(
        ImagePolicy(
            allow_http=config.image_allow_http,
            allow_hosts=config.image_allow_hosts,
            s3_allow=config.image_s3_allow,
            total_timeout_s=config.image_timeout_s,
            max_bytes=config.image_max_bytes,
            max_pixels=config.image_max_pixels,
        )
    )
    service: SessionService[Any, Any] = SessionService(
        engine,
        store,
        images,
        limits=config.limits,
        fetch_threads=config.image_fetch_threads,
        image_processes=config.image_processes,
        snapshots=snapshots,
        shared=shared,
        model_name=model_name,
        whole_answer_s=config.whole_answer_s or None,
    )
    service.start_image_processes()
    return Instance(service, memory, decoder, snapshots, shared, stats)


def freeze_startup_objects() -> None:
    """Keep what startup built out of every later garbage collection.

    torch, transformers and the model leave some 360,000 objects that live as long as the
    worker; a full collection walks them all, about 125 ms on 2 cores, during which every
    stream waits. Frozen, they are never walked again (as CPython's `gc.freeze` documents for
    long-running servers), and a full collection walks only what sessions allocated since.
    """
    gc.collect()  # garbage left by startup is freed, not kept for ever
    gc.freeze()
