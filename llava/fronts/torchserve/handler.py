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
        from llava.fronts.assembly import assemble, freeze_startup_objects  # imports torch

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
        instance = assemble(
            model_dir, config, model_name=str(getattr(context, "model_name", None) or "llava")
        )
        self.service, self.memory, self._decoder = (
            instance.service,
            instance.memory,
            instance.decoder,
        )
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
