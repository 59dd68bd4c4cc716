"""The TorchServe adapter: turn a continuous-batching call into a service step and back.

TorchServe 0.12's continuous batching (without sequence batching) calls `handle()` once per
step with every active request. The rules this adapter follows (docs/torchserve.md):
- a request's body arrives with every step until it has had a reply; state is keyed by
  `context.request_ids`;
- removing a request's index from `context.request_ids` sends nothing for it this step: the
  frontend keeps the job and re-sends it next step (how a whole answer waits for its last token),
  with its whole body until the request has had a reply (`EARLY_HEAD_BYTES`);
- `context.stopping_criteria` holds one function per position that cannot raise: None = whole
  response, False = more chunks to come, True = last chunk;
- `handle()` never raises, because an exception would fail every request in the batch.

A worker records the session ids it issues in a per-model registry file
(`llava.sessions.registry`) and snapshots each session's conversation and image features to
local disk (`llava.sessions.snapshots`). A worker started after one died restores the sessions
it left open from their snapshots (their next turn recomputes the prefix); those without one
answer 400 `session_lost`. With a shared session store (`session_store`), every session's
latest state is also kept there and any instance resumes it; on SIGTERM the worker drains
(`stopping.py`) and flushes the store before it exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any

from llava.api.replies import Reply, error_reply, internal_error
from llava.core.config import ServerConfig
from llava.fronts.gauges import Gauges
from llava.fronts.torchserve.stopping import on_sigterm
from llava.server.service import Incoming, SessionService

log = logging.getLogger(__name__)


def _constant(value: bool | None) -> Any:
    return lambda _output: value


_WHOLE, _MORE, _LAST = _constant(None), _constant(False), _constant(True)

# A whole answer to a request this large sends its head (200, chunked) with its first token, as
# a stream does: TorchServe re-sends a request's body to the worker every step until the request
# has had a reply (docs/performance.md measures what that costs). Smaller requests keep their
# head, so a late failure keeps its status.
EARLY_HEAD_BYTES = 64 * 1024


def _size(body: Any) -> int:
    return len(body) if isinstance(body, (bytes, bytearray, str)) else 0


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Error"


def exit_when_engine_fails(instance: Any, period_s: float = 1.0) -> None:
    """End the worker once its engine has failed for good (`Engine.failure`): TorchServe starts
    new workers, and once none has come back for `maxRetryTimeoutInSec` (model-config.yaml)
    /ping fails, so SageMaker replaces an instance whose engine cannot start. Sessions are
    flushed first; they resume from their snapshots (or the shared store) wherever they are
    asked next."""

    def watch() -> None:
        while (failure := instance.service.engine.failure) is None:
            time.sleep(period_s)
        log.critical("the engine failed (%s): this worker exits for a new one", failure)
        try:
            instance.drain(0.0)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="llava-engine-health", daemon=True).start()


class SessionHandler:
    """Load the engine once per worker, then serve every step of every request."""

    def __init__(self) -> None:
        self.service: SessionService[Any, Any] | None = None
        self.config: ServerConfig | None = None
        self.gauges: Gauges | None = None

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
        self.service, self.gauges = instance.service, Gauges(instance)
        on_sigterm(lambda: instance.drain(config.drain_grace_s))
        exit_when_engine_fails(instance)
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
            for i, item in enumerate(batch):
                if replies[i] is None and _size(item.body) >= EARLY_HEAD_BYTES:
                    replies[i] = self._head(item.request_id)
        except Exception as exc:  # a bug above the per-request guards: still answer each one
            replies = [error_reply(internal_error(exc))] * len(data)
        self._report(context)
        return self._emit(replies, context)

    def _head(self, request_id: str) -> Reply | None:
        """A large whole answer's head, or None (withheld, its body re-sent) should that fail:
        the other replies of the step are committed already."""
        try:
            return self.service.head_reply(request_id) if self.service else None
        except Exception:
            log.warning("could not send the head of %s early", request_id, exc_info=True)
            return None

    def _report(self, context: Any) -> None:
        """Publish the instance's gauges that changed this step as TorchServe metrics."""
        metrics = getattr(context, "metrics", None)
        if self.gauges is None or metrics is None:
            return
        try:
            from ts.metrics.dimension import Dimension
            from ts.metrics.metric_type_enum import MetricTypes

            for reading in self.gauges.changed():
                metrics.add_metric(
                    reading.name,
                    reading.value,
                    reading.unit,
                    dimensions=[Dimension(*reading.dimension)],
                    metric_type=MetricTypes.GAUGE,
                )
        except Exception:  # metrics must never cost a request its answer
            log.warning("could not publish metrics", exc_info=True)

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
