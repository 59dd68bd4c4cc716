"""The vLLM engine: the kit's sessions on vLLM's `LLMEngine` (the only package importing vLLM)."""

from llava.engines.vllm.engine import VllmEngine
from llava.engines.vllm.state import VllmSession, VllmTurn

__all__ = ["VllmEngine", "VllmSession", "VllmTurn"]
