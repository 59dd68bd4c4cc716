"""The transformers engine: runs the model itself, a KV cache per session (the reference)."""

from llava.core.tiers import Tier
from llava.engines.transformers.engine import LlavaEngine
from llava.engines.transformers.model.loading import set_torch_threads
from llava.engines.transformers.state.session import SessionState, Turn

__all__ = ["LlavaEngine", "SessionState", "Tier", "Turn", "set_torch_threads"]
