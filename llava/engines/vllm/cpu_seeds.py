"""A vLLM plugin so seeded sampling survives a chunked prompt on a CPU.

vLLM 0.32 samples a token for a request still in a partial prefill, throws it away, and rewinds
the request's generator with `set_offset(get_offset() - 4)`: a CUDA Philox offset. A CPU
generator has no offset ("CPU Generator does not use offset"), so on a CPU any seeded request
whose prompt is split across steps kills the engine core, with every answer in flight. This
plugin (entry point `vllm.general_plugins`, loaded by vLLM in each of its processes) keeps the
same meaning on a CPU: the generator state of a request whose sample is thrown away is put back
as it was before the sample, and vLLM's own rewind skips it. On other platforms it does nothing.
"""

from __future__ import annotations

from typing import Any

PATCHED = "_llava_cpu_seeds"


def register() -> None:
    """Patch vLLM's CPU model runner once per process (vLLM may load plugins more than once)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, PATCHED, False):
        return
    sample = CPUModelRunner._sample
    bookkeeping = CPUModelRunner._bookkeeping_sync

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        thrown_away = discarded_generators(self)
        states = {index: gen.get_state() for index, gen in thrown_away.items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for index, state in states.items():
                thrown_away[index].set_state(state)

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        put_back = {index: generators.pop(index) for index in discarded_generators(self)}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(put_back)

    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    setattr(CPUModelRunner, PATCHED, True)


def discarded_generators(runner: Any) -> dict[int, Any]:
    """The generators, by batch row, of the requests whose sample this step throws away."""
    rows = runner.discard_request_mask.np[: runner.input_batch.num_reqs].nonzero()[0]
    generators = runner.input_batch.generators
    return {int(row): generators[int(row)] for row in rows if int(row) in generators}
