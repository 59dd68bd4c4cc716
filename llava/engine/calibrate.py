"""Size the step's token budget from this machine's own speed, measured once at start.

A step holds every stream for as long as it runs, so what bounds a stream's longest gap is the
time of a step's prefill work against the time of a plain decode step. How many prefill tokens
cost as much as a decode step differs by two orders of magnitude between a CPU (prefill is as
memory-bound as decoding, a token costs about a token) and a GPU (a decode step reads every
weight for one token; a prefill chunk of hundreds of tokens reads them once). So with
`step_token_budget: 0` (the default) the engine times, on the loaded model, a decode step and a
prefill chunk over a cache holding an image's worth of tokens, and a run of the vision tower,
and lets a step's prefill work cost about `GAP_FACTOR` decode steps. A forward's fixed cost (a
decode step is nearly all fixed cost: it reads every weight for one token) is charged to each
prefill chunk, so a step that would run several short chunks runs fewer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from llava.engine.cache import crop_to, new_cache
from llava.engine.vision import image_features, process_images

if TYPE_CHECKING:
    from llava.engine.engine import LlavaEngine

log = logging.getLogger(__name__)

GAP_FACTOR = 2  # a step's prefill work may cost this many decode steps (the stream waits 3)
MIN_BUDGET, MAX_BUDGET = 16, 4096
PROBE = 128  # tokens per timed prefill chunk


class StepCosts(NamedTuple):
    """What the scheduler spends, in prefill tokens of this machine's model."""

    budget: int  # tokens a step's prefill work may cost
    tower_ratio: float  # the vision tower's cost per image token it produces
    forward_cost: int  # the fixed cost of one more forward (a prefill chunk)


def _best_of(runs: int, fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """The fastest of `runs` timed calls (the first, cold one is a warm-up)."""
    fn()
    sync()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return min(times)


@torch.inference_mode()
def calibrate(engine: LlavaEngine) -> StepCosts:
    """Time the loaded model; return the step's budget and the costs of its pieces."""
    from PIL import Image

    replica = engine.replicas[0]
    device = replica.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    filler = engine.tokenizer.eos_token_id or 0
    blank = Image.new("RGB", (336, 336))
    processed = process_images(engine.processor, [blank], engine.image_token_id)
    context = max(processed.total, PROBE)

    cache = new_cache(engine.num_layers)
    engine.forward(replica, cache, [filler] * context, None, 0)

    def forward(tokens: int) -> Callable[[], None]:
        def run() -> None:  # a forward over the image's worth of cache, then cut back
            engine.forward(replica, cache, [filler] * tokens, None, 0)
            crop_to(cache, context)

        return run

    decode = _best_of(5, forward(1), sync)
    chunk = _best_of(3, forward(PROBE), sync)
    # cost(n) = decode + (n - 1) * per_token: a forward's fixed cost plus its tokens'
    per_token = max((chunk - decode) / (PROBE - 1), 1e-9)
    tower = _best_of(2, lambda: image_features(replica.model, processed, device), sync)
    budget = int(min(MAX_BUDGET, max(MIN_BUDGET, GAP_FACTOR * decode / per_token)))
    costs = StepCosts(
        budget=budget,
        tower_ratio=tower / per_token / processed.total,
        forward_cost=min(budget // 2, round(decode / per_token)),
    )
    log.info(
        "step budget calibrated: decode step %.1f ms, prefill %.3f ms/token, vision tower %.1f ms "
        "per image -> %d tokens per step, %d per extra forward (set step_token_budget to override)",
        decode * 1000,
        per_token * 1000,
        tower * 1000,
        costs.budget,
        costs.forward_cost,
    )
    return costs
