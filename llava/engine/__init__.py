"""The model engine: the only layer that imports torch and transformers."""

from llava.core.tiers import Tier
from llava.engine.engine import LlavaEngine
from llava.engine.model.loading import set_torch_threads
from llava.engine.state.session import SessionState, Turn

__all__ = ["LlavaEngine", "SessionState", "Tier", "Turn", "set_torch_threads"]
