"""The engines behind the one contract (`llava.server.contract`), peers side by side.

`transformers/` runs the model itself (the reference, and for machines vLLM does not run on);
`vllm/` puts the sessions on vLLM's engine. `conversation/` is what both share and neither owns:
rendering a conversation into the exact ids the model's pipeline feeds it, and ids into text.
Neither engine imports the other; only `vllm/` imports vLLM (tests/unit/test_architecture.py).
"""

ENGINES = ("transformers", "vllm")


def resolve_engine(choice: str) -> str:
    """Return the engine `engine: auto` means here: vLLM where it is installed, else the
    transformers engine."""
    if choice != "auto":
        return choice
    from importlib.util import find_spec

    return "vllm" if find_spec("vllm") is not None else "transformers"
