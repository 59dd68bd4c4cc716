"""Ray Serve entry point for bench/front.py: on PYTHONPATH of a bench's `llava serve-ray` only,
so each of its Ray workers loads the paced engine (bench/paced.py) in place of the model's."""

import os

if os.environ.get("LLAVA_PACED_STEP_MS"):
    import importlib.util
    import sys
    from pathlib import Path

    # By path: bench/ itself on PYTHONPATH would shadow Ray with bench/ray.py.
    spec = importlib.util.spec_from_file_location("paced", Path(__file__).parents[1] / "paced.py")
    assert spec is not None and spec.loader is not None
    paced = sys.modules["paced"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paced)
    paced.install()
