"""What one forward may allocate beyond the weights: the bytes a step's chunks cost in memory.

The token budget bounds a step's time; this bounds its memory. A forward over a packed row of
`T` tokens holds, in the layer it is running, the row's activations (the residual stream, the
query/key/value projections, the MLP's intermediate), the logits of the rows it keeps, and for
the piece whose attention is running its attention workspace: with grouped-query heads the
piece's keys and values repeated to every query head (so SDPA's fused kernels run, `packed.py`)
and the causal mask a kernel without causal support builds. Its cache grows by the new
positions, in chunks of `cache.CHUNK`, copying a layer's buffers when they run out. Layers run
one after another and pieces attend one at a time (the answers decoding, stacked, are one
piece: rows padded to the longest, `batch.py`), so a forward's peak is the activations plus the
largest piece's attention, plus the growth. `Workspace.room` answers the scheduler: the most
tokens a chunk may take beside what the step already holds, within the reserve the device
budget leaves for activations (`budget.py`).

Upper bounds, not estimates: `tests/unit/test_workspace.py` measures real forwards (the CPU
allocator's events) against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers.integrations import sdpa_attention

from llava.engines.transformers.model.cache import CHUNK

# Live tensors per token in the layer that runs, in units of the hidden size, the projections'
# width and the MLP's width (counted on llama, mistral and qwen2 layers: the residual, the
# normed input, the attention output and its projection; q/k/v before and after rotary; gate,
# up and their product). Rounded up.
HIDDEN_COPIES = 6
PROJECTION_COPIES = 3
MLP_COPIES = 4
LOGIT_BYTES = 4  # logits come out in float32 for sampling
# What SDPA's math kernel holds at once beside the inputs, per query and key and head, in
# float32: the scores, the mask made additive and added to them, and their softmax (measured
# with the kernel forced: `tests/unit/test_workspace.py`).
SCORE_COPIES = 3


@dataclass(frozen=True)
class Workspace:
    """A text model's shapes, and what a forward over them may allocate."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    element: int  # bytes per activation (the model's dtype)
    # SDPA's fused kernels and flash attention (a GPU in half precision) never hold the
    # attention scores; SDPA's math kernel and eager attention hold them (`unfused`). The CPU
    # is counted as unfused, the bound for whichever kernel SDPA picks there.
    fused: bool = False
    # transformers before 5.22 repeats the key heads for a stacked decode's masked attention
    # (`repeat_kv`); later ones fold the query heads instead (`pack_gqa`), as `packed.py` does.
    decode_repeats_keys: bool = False

    @classmethod
    def of(cls, model: Any) -> Workspace:
        """Read the shapes off a loaded transformers model."""
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        weight = next(model.parameters())
        return cls(
            hidden=text.hidden_size,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate=text.intermediate_size,
            vocab=text.vocab_size,
            layers=text.num_hidden_layers,
            element=weight.element_size(),
            fused=weight.device.type == "cuda"
            and weight.element_size() == 2
            and text._attn_implementation != "eager",  # eager attention holds its scores
            decode_repeats_keys=not hasattr(sdpa_attention, "pack_gqa"),
        )

    def per_token(self) -> int:
        """Bytes of activations each token of a forward's row holds while a layer runs."""
        projections = (self.heads + 2 * self.kv_heads) * self.head_dim
        width = (
            HIDDEN_COPIES * self.hidden
            + PROJECTION_COPIES * projections
            + MLP_COPIES * self.intermediate
        )
        return width * self.element

    def attention(self, context: int, tokens: int) -> int:
        """Bytes a chunk's attention adds while it runs: its repeated keys and values (over
        grouped-query heads), its causal mask (one byte per query and key) and, where no fused
        kernel runs, what the math kernel holds."""
        keys = context + tokens
        repeated = self.repeated(keys) if self.kv_heads != self.heads else 0
        return self.unfused(tokens, keys, self.heads) + repeated + tokens * keys

    def repeated(self, keys: int) -> int:
        """Bytes of one layer's `keys` keys and values repeated to every query head."""
        return 2 * keys * self.heads * self.head_dim * self.element

    def unfused(self, queries: int, keys: int, key_heads: int) -> int:
        """Bytes SDPA's math kernel holds beside its inputs for `queries` of every head over
        `keys` of `key_heads` (none where a fused kernel runs): the scores in float32
        (`SCORE_COPIES`), the mask made additive, and the queries and keys scaled."""
        if self.fused:
            return 0
        scores = (SCORE_COPIES * self.heads + 1) * queries * keys * LOGIT_BYTES
        scaled = (queries * self.heads + keys * key_heads) * self.head_dim * self.element
        return scores + scaled

    def decodes(self, contexts: Sequence[int]) -> int:
        """Bytes the attention of answers decoding together adds while it runs: one piece of
        rows padded to the longest (`batch.py`), each row's scores and mask, and one layer's
        keys and values repeated to every query head where something repeats them: an older
        transformers' `repeat_kv`, or SDPA's math kernel for `enable_gqa`, which transformers
        asks for when rows of one length need no padding mask (padded rows' query heads are
        folded instead, by transformers' `pack_gqa` and by `packed.py`)."""
        if not contexts:
            return 0
        rows, keys = len(contexts), max(contexts) + 1
        key_heads = self.kv_heads
        repeated = 0
        unpadded = len(set(contexts)) == 1
        if self.kv_heads != self.heads and (
            self.decode_repeats_keys or (unpadded and not self.fused)
        ):
            key_heads = self.heads
            repeated = self.repeated(keys)
        return rows * (self.unfused(1, keys, key_heads) + repeated + keys * LOGIT_BYTES)

    def stacked_bytes(self, contexts: Sequence[int]) -> int:
        """Bytes a stacked decode forward over rows at `contexts` may allocate beyond its
        preallocated cache (`batch.py`): the rows' activations, logits and attention."""
        rows = len(contexts)
        return rows * (self.per_token() + self.vocab * LOGIT_BYTES) + self.decodes(contexts)

    def growth(self, context: int, tokens: int) -> int:
        """Bytes the piece's cache may grow by: its new positions and spare room in every layer,
        and one layer's buffers copied when they run out (the old ones freed after)."""
        position = 2 * self.kv_heads * self.head_dim * self.element  # keys and values
        return position * ((tokens + CHUNK) * self.layers + context + tokens + CHUNK)

    def forward_bytes(self, pieces: Sequence[tuple[int, int]]) -> int:
        """Bytes a forward over `pieces` ((cached tokens, new tokens) each) may allocate."""
        if not pieces:
            return 0
        row = sum(tokens for _, tokens in pieces)
        chunks = [self.attention(c, n) for c, n in pieces if n > 1]
        return (
            row * self.per_token()
            + len(pieces) * self.vocab * LOGIT_BYTES
            + max([*chunks, self.decodes([c for c, n in pieces if n <= 1])])
            + sum(self.growth(c, n) for c, n in pieces)
        )

    def room(self, context: int, beside: Sequence[tuple[int, int]], reserve: int) -> int:
        """Return the most tokens a chunk at `context` may take in a forward that also runs
        `beside`, within `reserve` bytes (0: not even one token fits)."""
        low, high = 0, 1
        while self.forward_bytes([*beside, (context, high)]) <= reserve:
            low, high = high, high * 2
            if high > 1 << 24:
                return low
        while high - low > 1:  # forward_bytes grows with the chunk: bisect
            middle = (low + high) // 2
            if self.forward_bytes([*beside, (context, middle)]) <= reserve:
                low = middle
            else:
                high = middle
        return low
