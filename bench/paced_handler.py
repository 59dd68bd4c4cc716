"""TorchServe entry point for bench/front.py: the kit's handler with the paced engine
(bench/paced.py) in place of the model's, so only the front is measured. Copied into a bench
model store as its handler; never part of the kit's archive."""

from __future__ import annotations

import paced  # beside this file in the model store

from llava.fronts.torchserve.handler import SessionHandler

paced.install()


class PacedSessionHandler(SessionHandler):
    """The kit's TorchServe handler; only the engine behind it is paced."""
