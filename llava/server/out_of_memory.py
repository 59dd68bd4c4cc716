"""One engine step that survives running out of device memory: free memory, retry once.

A CUDA out-of-memory error arrives from inside a forward; the engine has rolled the failing
pieces back (every forward is transactional), so the turns can simply run again. Before the
retry the engine drops what it holds between steps (stacked batches, the allocator's cache)
and the store moves every idle session's cache to host memory. Turns that run out again get
503 `out_of_device_memory`; their sessions are as before the question.
"""

from __future__ import annotations

import logging
from typing import Any

from llava.core.errors import OutOfDeviceMemory
from llava.server.contract import Engine, TurnT
from llava.sessions.store import SessionStore

log = logging.getLogger(__name__)


def step_with_retry(
    engine: Engine[Any, TurnT], store: SessionStore, turns: list[TurnT]
) -> dict[int, BaseException]:
    """Run one engine step over `turns`; return each failure by position."""
    if all(turn.done for turn in turns):
        return {}
    try:
        errors = engine.step(turns)
    except Exception as exc:  # the engine could not even isolate the failure
        return dict.fromkeys(range(len(turns)), exc)
    short = [i for i, exc in errors.items() if engine.out_of_memory(exc)]
    if not short:
        return errors
    log.warning("%d request(s) ran out of device memory; freeing memory, retrying", len(short))
    try:
        engine.free_memory()
        store.relieve()
        again = engine.step([turns[i] for i in short])
    except Exception as failure:
        again = dict.fromkeys(range(len(short)), failure)
    for i in short:
        errors.pop(i)
    for j, error in again.items():
        if engine.out_of_memory(error):
            error = OutOfDeviceMemory(
                "the GPU ran out of memory for this request, even after moving idle sessions "
                "to host memory; retry shortly, or lower device_budget_mb"
            )
        errors[short[j]] = error
    return errors
