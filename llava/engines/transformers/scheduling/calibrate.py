"""Measure this machine's step costs once at start: the pacer's starting point.

A step holds every stream for as long as it runs, so what bounds a stream's longest gap is the
time of a step's prefill work against the time of a plain decode step. How many prefill tokens
cost as much as a decode step differs by two orders of magnitude between a CPU (prefill is as
memory-bound as decoding, a token costs about a token) and a GPU (a decode step reads every
weight for one token; a prefill chunk of hundreds of tokens reads them once). So with
`step_token_budget: 0` (the default) the engine times, on the loaded model, a decode step, two
prefill chunks of different lengths over a cache holding an image's worth of tokens (a chunk's
cost is a fixed part, paid by every forward, plus a part per token), a chunk packed beside a
decode (its fixed part there is smaller: the weights are read anyway) and a run of the vision
tower. `pacing.StepPacer` starts from these figures and follows the steps actually run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llava.engines.transformers.model.cache import crop_to, new_cache
from llava.engines.transformers.model.packed import Piece, packed_forward
from llava.engines.transformers.model.vision import image_features, process_images
from llava.engines.transformers.scheduling.pacing import StepPacer

if TYPE_CHECKING:
    from llava.engines.transformers.runner import ModelRunner

log = logging.getLogger(__name__)

SHORT, PROBE = 16, 128  # tokens per timed prefill chunk


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
def calibrate(runner: ModelRunner) -> StepPacer:
    """Time the loaded model's step pieces; return a pacer starting from them."""
    from PIL import Image

    replica = runner.replicas[0]
    device = replica.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    filler = runner.tokenizer.eos_token_id or 0
    blank = Image.new("RGB", (336, 336))
    processed = process_images(runner.processor, [blank], runner.image_token_id)
    context = max(processed.total, PROBE)

    cache = new_cache(runner.num_layers)
    runner.forward(replica, cache, [filler] * context, None, 0)

    def forward(tokens: int) -> Callable[[], None]:
        def run() -> None:  # a forward over the image's worth of cache, then cut back
            runner.forward(replica, cache, [filler] * tokens, None, 0)
            crop_to(cache, context)

        return run

    decode = _best_of(5, forward(1), sync)
    short = _best_of(3, forward(SHORT), sync)
    long = _best_of(3, forward(PROBE), sync)
    # cost(n) = fixed + n * per_token, fitted on two chunk lengths: a chunk of several tokens
    # runs other kernels than a decode step, with a larger fixed part.
    per_token = max((long - short) / (PROBE - SHORT), 1e-9)
    fixed = max(short - SHORT * per_token, 0.0)
    tower = _best_of(2, lambda: image_features(replica.model, processed, device), sync)
    rider = None
    if runner.packs:  # a chunk of SHORT tokens packed beside a decode: what it adds
        other = new_cache(runner.num_layers)
        runner.forward(replica, other, [filler] * context, None, 0)

        def packed() -> None:
            pieces = [Piece(other, [filler]), Piece(cache, [filler] * SHORT)]
            packed_forward(replica.model, pieces, runner.image_token_id)
            crop_to(other, context)
            crop_to(cache, context)

        rider = max(_best_of(3, packed, sync) - decode - SHORT * per_token, 0.0)
    pacer = StepPacer(
        quiet_s=decode,
        token_s=per_token,
        forward_s=fixed,
        tower_s=tower / processed.total,
        rider_s=rider,
    )
    costs = pacer.costs()
    log.info(
        "step costs calibrated: decode step %.1f ms, prefill %.1f ms + %.3f ms/token "
        "(packed beside a decode: %s), vision tower %.1f ms per image -> %d tokens per step to "
        "start with, %d per extra forward (set step_token_budget to fix the budget instead)",
        decode * 1000,
        fixed * 1000,
        per_token * 1000,
        "not packed" if rider is None else f"{rider * 1000:.1f} ms + the tokens",
        tower * 1000,
        costs.budget,
        costs.forward_cost,
    )
    return pacer
