"""What vLLM's engine alone, with no server in front of it, makes of bench/gaps.py's opens.

One answer streams from an `LLMEngine` stepped in a loop (the engine core and its model worker in
their own processes, as under either server; `vllm serve`'s settings and usage context); after
`--quiet` tokens, 4 new pictures, processed beforehand by vLLM's own renderer (so no picture work
lands on the stepping thread), are added at once, each asking for one token. The requests are the
servers' (the same chat prompts, pictures and sampling). The stream's longest gap while they open,
against its quiet median gap, is what the engine's own steps make of the opens: the figure to set
both servers' beside.
"""

from __future__ import annotations

import base64
import io
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from load import _gaps
from peer import photo_uri


def picture(uri: str) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))).convert("RGB")


def chat_prompt(processor: Any, question: str, image: str) -> dict[str, Any]:
    """A one-picture chat prompt as the servers render it (the checkpoint's chat template)."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return {"prompt": text, "multi_modal_data": {"image": picture(image)}}


def start_engine(checkpoint: Path, settings: dict[str, Any]) -> Any:
    """vLLM's engine with the settings bench/peer.py gives `vllm serve`."""
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    extra = {"gpu_memory_utilization": settings["gpu_share"]} if settings["gpu_share"] else {}
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=str(checkpoint),
            dtype=settings["dtype"],
            seed=0,
            max_model_len=settings["max_model_len"],
            kv_cache_memory_bytes=int(settings["kv_gb"] * 2**30),
            enable_prefix_caching=True,
            limit_mm_per_prompt={"image": 8},
            generation_config="vllm",
            max_num_batched_tokens=settings["step_tokens"] or None,
            **extra,
        ),
        usage_context=UsageContext.OPENAI_API_SERVER,  # vllm serve's defaults, not LLMEngine's
    )


def one_run(llm: Any, processor: Any, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Stream one answer; add the pre-processed opens after the quiet tokens. Every prompt is
    rendered before the stream starts (in the order the engine is given them), so the quiet
    gaps hold nothing but the engine's steps."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    def params(tokens: int) -> Any:  # the servers' sampling: greedy, streamed as deltas
        return SamplingParams(max_tokens=tokens, temperature=0, output_kind=RequestOutputKind.DELTA)

    def rendered(question: str, image: str) -> Any:
        (request,) = llm.input_processor.renderer.render_cmpl(
            [chat_prompt(processor, question, image)]
        )
        return request

    story = rendered("Tell me a long story.", photo_uri(seed, 0))
    opens = [
        rendered("What is this?", photo_uri(seed + 1 + i, settings["photo_px"]))
        for i in range(settings["opens"])
    ]
    llm.add_request(f"stream-{seed}", story, params(settings["tokens"]))
    events: list[float] = []
    window: dict[str, float] = {}
    waiting: set[str] = set()
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.request_id.startswith("stream") and output.outputs[0].token_ids:
                events.append(time.perf_counter())
            elif output.finished:
                waiting.discard(output.request_id)
                if not waiting and "end" not in window:
                    window["end"] = time.perf_counter()
        if len(events) >= settings["quiet"] and "start" not in window:
            window["start"] = time.perf_counter()
            for i, request in enumerate(opens):
                llm.add_request(f"open-{seed}-{i}", request, params(1))
                waiting.add(f"open-{seed}-{i}")
    if "end" not in window or events[-1] < window["end"]:
        raise RuntimeError("the stream ended before the opens finished: ask for more --tokens")
    return {
        **_gaps(events, window),
        "opens_wall_ms": round((window["end"] - window["start"]) * 1000, 1),
        "events": len(events),
    }


def _measure(checkpoint: Path, settings: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    llm = start_engine(checkpoint, settings)
    try:
        one_run(llm, processor, seed, settings)  # warm-up, not kept
        return [
            one_run(llm, processor, seed + 100 * (i + 1), settings) for i in range(settings["runs"])
        ]
    finally:
        llm.engine_core.shutdown()


def engine_gaps(checkpoint: Path, args: Any, seed: int) -> list[dict[str, Any]]:
    """Each run's figures, measured in a process of its own (its engine goes with it)."""
    settings = {
        key: getattr(args, key)
        for key in (
            "dtype",
            "max_model_len",
            "kv_gb",
            "step_tokens",
            "tokens",
            "quiet",
            "opens",
            "photo_px",
            "runs",
            "gpu_share",
        )
    }
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(_measure, checkpoint, settings, seed).result()
