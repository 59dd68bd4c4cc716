"""TorchServe entry point for bench/front.py: the kit's handler with the paced engine
(bench/paced.py) in place of the model's, so only the front is measured. Copied into a bench
model store as its handler; never part of the kit's archive."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from paced import PacedEngine  # beside this file in the model store

from llava.fronts import assembly
from llava.fronts.torchserve.handler import SessionHandler
from llava.sessions.memory import TieredMemory


def paced_engine(model_dir: Path, config: Any) -> tuple[Any, Any, Any, Any]:
    """What `assembly.load_engine` returns, for the paced engine at LLAVA_PACED_STEP_MS."""
    from transformers import AutoTokenizer

    step_s = float(os.environ.get("LLAVA_PACED_STEP_MS", "7")) / 1000
    engine = PacedEngine(step_s, AutoTokenizer.from_pretrained(model_dir))
    return engine, TieredMemory(engine, None, None), None, None


assembly.load_engine = paced_engine


class PacedSessionHandler(SessionHandler):
    """The kit's TorchServe handler; only the engine behind it is paced."""
