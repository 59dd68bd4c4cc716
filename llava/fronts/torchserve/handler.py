"""The TorchServe adapter: turn a continuous-batching call into a service step and back.

TorchServe 0.12's continuous batching (without sequence batching) calls `handle()` once per
step with every active request. The rules this adapter follows (docs/torchserve.md):
- a request's body arrives only on its first step; state is keyed by `context.request_ids`;
- removing a request's index from `context.request_ids` sends nothing for it this step: the
  frontend keeps the job and re-sends it next step (how a whole answer waits for its last token);
- `context.stopping_criteria` holds one function per position that cannot raise: None = whole
  response, False = more chunks to come, True = last chunk;
- `handle()` never raises, because an exception would fail every request in the batch.

A worker records the session ids it issues in a per-model registry file
(`llava.sessions.registry`) and snapshots each session's conversation and image features to
local disk (`llava.sessions.snapshots`). A worker started after one died restores the sessions
it left open from their snapshots (their next turn recomputes the prefix); those without one
answer 400 `session_lost`.
"""

from __future__ import annotations

import gc
import logging
import os
from http import HTTPStatus
from pathlib import Path
from typing import Any

from llava.api.replies import Reply, error_reply, internal_error
from llava.core.config import ServerConfig
from llava.server.service import Incoming, SessionService

log = logging.getLogger(__name__)


def _constant(value: bool | None) -> Any:
    return lambda _output: value


_WHOLE, _MORE, _LAST = _constant(None), _constant(False), _constant(True)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Error"


def open_registry(context: Any) -> tuple[Any, list[str]]:
    """Open this model's session registry; return it and the ids a dead predecessor lost.

    Returns `(None, [])` when the registry cannot be used: sessions then work without it.
    """
    from llava.sessions.registry import SessionRegistry

    name = str(getattr(context, "model_name", None) or "llava")
    try:
        registry = SessionRegistry.for_model(name)
        lost = registry.recover()
    except Exception:  # the registry is a diagnosis aid: never let it stop the worker
        log.warning(
            "session registry unavailable; lost sessions will read as unknown", exc_info=True
        )
        return None, []
    if lost:
        log.info("%d sessions of an earlier worker are lost; they answer session_lost", len(lost))
    return (registry if registry.enabled else None), lost


def open_snapshots(config: ServerConfig, context: Any) -> Any:
    """Open this model's snapshot directory, or None when snapshots are off or impossible."""
    from llava.sessions.snapshots import SnapshotDir

    if config.snapshot_dir == "off":
        return None
    name = str(getattr(context, "model_name", None) or "llava")
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


def freeze_startup_objects() -> None:
    """Keep what startup built out of every later garbage collection.

    torch, transformers and the model leave some 360,000 objects that live as long as the
    worker; a full collection walks them all, about 125 ms on 2 cores, during which every
    stream waits. Frozen, they are never walked again (as CPython's `gc.freeze` documents for
    long-running servers), and a full collection walks only what sessions allocated since.
    """
    gc.collect()  # garbage left by startup is freed, not kept for ever
    gc.freeze()


class SessionHandler:
    """Load the engine once per worker, then serve every step of every request."""

    def __init__(self) -> None:
        self.service: SessionService[Any, Any] | None = None
        self.config: ServerConfig | None = None
        self.memory: Any = None
        self._last_tiers: dict[str, Any] | None = None
        self._reported_version: int | None = None
        self._last_snapshots: dict[str, int] | None = None
        self._decoder: Any = None  # the engine's, for what it decoded outside a batch
        self._last_alone: dict[str, int] = {}

    def initialize(self, context: Any) -> None:
        """Build config, engine, session store and image loader from the model archive."""
        from llava.engine import (  # torch is imported here only
            LlavaEngine,
            SessionState,
            Turn,
            set_torch_threads,
        )
        from llava.engine.model.budget import derive_budgets
        from llava.images import ImageLoader, ImagePolicy
        from llava.server.contract import Engine
        from llava.sessions.memory import TieredMemory
        from llava.sessions.session import LOST, Session
        from llava.sessions.snapshots import recover
        from llava.sessions.store import SessionStore

        model_dir = Path(context.system_properties.get("model_dir"))
        section = (getattr(context, "model_yaml_config", None) or {}).get("handler")
        self.config = config = ServerConfig.from_mapping(section, os.environ)
        # TorchServe re-sends a request that gets no reply this step (an open whose image is
        # still being prepared) with its whole body, every step: left to TorchServe, each
        # re-send's JSON would be decoded again inside the step loop. Raw bytes are parsed
        # once, by the kit, on the request's first step. (Read per message by TorchServe's
        # worker, so setting it here takes effect from the first request.)
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        in_flight = int(context.system_properties.get("batch_size") or 0)
        if 0 < in_flight < config.max_sessions:
            log.warning(
                "batchSize %d is below max_sessions %d: at most %d requests are in flight, and "
                "opens waiting on images hold places; raise batchSize in model-config.yaml",
                in_flight,
                config.max_sessions,
                in_flight,
            )
        set_torch_threads(config)
        llava_engine = LlavaEngine.load(model_dir, config)
        engine: Engine[SessionState, Turn] = llava_engine  # mypy checks the contract here
        budgets = derive_budgets(
            [r.device for r in llava_engine.runner.replicas],
            config.device_budget_bytes,
            config.host_budget_bytes,
        )
        self.memory = TieredMemory(llava_engine, budgets.device, budgets.host)
        llava_engine.limit_batches(budgets.device)  # the batch has the budget's other half
        self._decoder = llava_engine.runner.decoder
        registry, left_open = open_registry(context)
        # Snapshots need the registry: it alone tells which sessions an earlier worker left open.
        snapshots = open_snapshots(config, context) if registry is not None else None

        def release(session: Session, reason: str) -> None:
            engine.release(session.state)
            if snapshots is not None:
                snapshots.remove(session.id)

        store = SessionStore(
            ttl_s=config.session_ttl_s,
            max_sessions=config.max_sessions,
            memory=self.memory,
            release=release,
            journal=registry,
        )
        if snapshots is not None:
            recover(snapshots, engine, store, left_open)
        else:
            store.load_tombstones(left_open, LOST)
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
        self.service = SessionService(
            engine,
            store,
            images,
            limits=config.limits,
            fetch_threads=config.image_fetch_threads,
            image_processes=config.image_processes,
            snapshots=snapshots,
            model_name=str(getattr(context, "model_name", None) or "llava"),
            whole_answer_s=config.whole_answer_s or None,
        )
        self.service.start_image_processes()
        freeze_startup_objects()
        log.info("llava handler ready: %s", config)

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        """Advance every request in the batch by one step; one output per request."""
        try:
            batch = [
                Incoming(
                    request_id=context.request_ids[i],
                    body=row.get("body", row.get("data")) if isinstance(row, dict) else row,
                    headers=context.get_all_request_header(i) or {},
                )
                for i, row in enumerate(data)
            ]
            if self.service is None:
                raise RuntimeError("handle() called before initialize()")
            replies = self.service.step(batch)
        except Exception as exc:  # a bug above the per-request guards: still answer each one
            replies = [error_reply(internal_error(exc))] * len(data)
        self._report_memory(context)
        return self._emit(replies, context)

    def _report_memory(self, context: Any) -> None:
        """Publish sessions and bytes per memory tier as TorchServe gauges when they change."""
        metrics = getattr(context, "metrics", None)
        if self.memory is None or metrics is None or self.service is None:
            return
        self._report_snapshots(metrics)
        self._report_alone(metrics)
        store = self.service.store
        if store.version == self._reported_version:
            return  # nothing changed since the last step: skip walking every cache
        self._reported_version = store.version
        try:
            from ts.metrics.dimension import Dimension
            from ts.metrics.metric_type_enum import MetricTypes

            tiers = self.memory.tiers(store.snapshot())
            if tiers == self._last_tiers:
                return
            self._last_tiers = tiers
            for tier, figures in tiers.items():
                dims = [Dimension("Tier", tier)]
                metrics.add_metric(
                    "LlavaSessions",
                    figures["sessions"],
                    "count",
                    dimensions=dims,
                    metric_type=MetricTypes.GAUGE,
                )
                for kind in ("device_bytes", "host_bytes"):
                    metrics.add_metric(
                        f"LlavaSession{kind.title().replace('_', '')}",
                        figures[kind],
                        "B",
                        dimensions=dims,
                        metric_type=MetricTypes.GAUGE,
                    )
        except Exception:  # metrics must never cost a request its answer
            log.warning("could not publish session metrics", exc_info=True)

    def _report_alone(self, metrics: Any) -> None:
        """Publish the answer steps decoded outside the stacked batch, by reason (no room for a
        long conversation; the stacked forward failed), when they change."""
        if self._decoder is None:
            return
        counts = {"room": self._decoder.alone_for_room, "failure": self._decoder.stack_failures}
        if counts == self._last_alone:
            return
        self._last_alone = counts
        try:
            from ts.metrics.dimension import Dimension
            from ts.metrics.metric_type_enum import MetricTypes

            for reason, count in counts.items():
                metrics.add_metric(
                    "LlavaDecodedAlone",
                    count,
                    "Count",
                    dimensions=[Dimension("Reason", reason)],
                    metric_type=MetricTypes.GAUGE,
                )
        except Exception:  # metrics must never cost a request its answer
            log.warning("could not publish decode metrics", exc_info=True)

    def _report_snapshots(self, metrics: Any) -> None:
        """Publish the snapshots on disk (count and bytes) when they change."""
        snapshots = self.service.snapshots if self.service is not None else None
        if snapshots is None:
            return
        stats = snapshots.stats()
        if stats == self._last_snapshots:
            return
        self._last_snapshots = stats
        try:
            from ts.metrics.dimension import Dimension
            from ts.metrics.metric_type_enum import MetricTypes

            dims = [Dimension("Store", "disk")]
            for name, value, unit in (
                ("LlavaSnapshots", stats["snapshots"], "Count"),
                ("LlavaSnapshotBytes", stats["bytes"], "Bytes"),
            ):
                metrics.add_metric(
                    name, value, unit, dimensions=dims, metric_type=MetricTypes.GAUGE
                )
        except Exception:  # metrics must never cost a request its answer
            log.warning("could not publish snapshot metrics", exc_info=True)

    @staticmethod
    def _emit(replies: list[Reply | None], context: Any) -> list[Any]:
        outputs: list[Any] = []
        criteria = []
        for i, reply in enumerate(replies):
            if reply is None:
                context.request_ids.pop(i, None)  # withhold: the frontend re-sends it next step
                outputs.append(b"")
                criteria.append(_WHOLE)
                continue
            context.set_response_status(reply.status, _phrase(reply.status), i)
            context.set_response_content_type(i, reply.content_type)
            for key, value in reply.headers.items():
                context.set_response_header(i, key, value)
            outputs.append(reply.body)
            criteria.append({None: _WHOLE, False: _MORE, True: _LAST}[reply.last])
        context.stopping_criteria = criteria
        return outputs
