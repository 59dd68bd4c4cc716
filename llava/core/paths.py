"""Where a source checkout keeps what the tools read: the handler, configs and the sample image."""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]  # llava/core/paths.py -> the repository root
SAMPLE_IMAGE = CHECKOUT / "examples" / "sample.png"
