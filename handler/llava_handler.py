"""TorchServe entry point for LLaVA sessions: all logic lives in the `llava` package.

TorchServe loads this file from the model archive and requires it to define exactly one class.
"""

from llava.fronts.torchserve.handler import SessionHandler


class LlavaSessionHandler(SessionHandler):
    """Serve open_session / query / close_session with continuous batching in one worker."""
