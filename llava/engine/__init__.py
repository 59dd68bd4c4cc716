"""The model engine: the only layer that imports torch and transformers."""

from llava.engine.engine import LlavaEngine, SessionState, Turn

__all__ = ["LlavaEngine", "SessionState", "Turn"]
