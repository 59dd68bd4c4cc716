"""A packed forward is each piece's own forward, in one: same logits, same caches, all or nothing.

The oracle is the model's own forward over each piece alone (the stock attention, with the
masks transformers builds), not the packing code: a packed forward must give every piece what
that forward gives it, for the plain causal layers and for sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import make_image
from torch.nn.attention.bias import CausalBias

from llava.core.config import ServerConfig
from llava.engines.transformers import LlavaEngine
from llava.engines.transformers.decoding.batch import DecodeBatch
from llava.engines.transformers.model.cache import new_cache
from llava.engines.transformers.model.packed import Piece, packed_forward
from llava.tools.tiny import build_checkpoint


@pytest.fixture(scope="module", params=["tiny", "next", "onevision"])
def engine(request: Any, tmp_path_factory: Any) -> LlavaEngine:
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("ckpt") / request.param, request.param)
    return LlavaEngine.load(checkpoint, ServerConfig(device="cpu", image_processes=0))


def conversation(engine: LlavaEngine, seed: int) -> tuple[list[int], torch.Tensor]:
    """An open's ids (system prompt, image tokens) and the image's features."""
    state = engine.new_session(engine.prepare(make_image(seed)))
    replica = engine.runner.replicas[0]
    images = state.images
    if images.pending is not None:  # the tower has not run yet (it runs in the first step)
        images = engine.runner.images.encode_pending(replica.model, replica.device, images)
    features = engine.runner.images.features(replica.model, replica.device, images)
    assert features is not None
    return state.prefix_ids, features


def caches_after(engine: LlavaEngine, prefixes: list[tuple[list[int], torch.Tensor]]) -> list[Any]:
    """A cache per conversation holding its first `len - 7` ids (7 are left to feed)."""
    replica = engine.runner.replicas[0]
    caches = []
    for ids, features in prefixes:
        cache = new_cache(engine.runner.num_layers)
        engine.runner.forward(replica, cache, ids[:-7], features, 0)
        caches.append(cache)
    return caches


def pieces_of(engine: LlavaEngine, prefixes: Any, caches: list[Any]) -> list[Piece]:
    """Piece 0 feeds one token (a decode), piece 1 the last 7 ids (a chunk, image tokens in it)."""
    pieces = []
    for (ids, features), cache, count in zip(prefixes, caches, (1, 7), strict=True):
        fed = ids[: len(ids) - 7]
        offset = sum(1 for i in fed if i == engine.runner.image_token_id)
        pieces.append(Piece(cache, ids[len(fed) : len(fed) + count], features, offset))
    return pieces


def both_ways(engine: LlavaEngine) -> tuple[list[torch.Tensor], list[Any], torch.Tensor, list[Any]]:
    """The same two pieces fed alone (the model's own forward each) and packed."""
    prefixes = [conversation(engine, 1), conversation(engine, 2)]
    replica = engine.runner.replicas[0]
    alone_caches = caches_after(engine, prefixes)
    alone = [
        engine.runner.forward(replica, p.cache, p.ids, p.features, p.offset)
        for p in pieces_of(engine, prefixes, alone_caches)
    ]
    packed_caches = caches_after(engine, prefixes)
    packed = packed_forward(
        replica.model, pieces_of(engine, prefixes, packed_caches), engine.runner.image_token_id
    )
    return alone, alone_caches, packed, packed_caches


def sliding(text: Any) -> bool:
    """Whether the text model honours `sliding_window` in every layer (Mistral; Qwen2 keeps
    it for the layers its `layer_types` name)."""
    return hasattr(text, "sliding_window") and text.model_type != "qwen2"


def test_every_piece_gets_the_logits_and_cache_of_its_own_forward(engine) -> None:
    with torch.inference_mode():
        alone, alone_caches, packed, packed_caches = both_ways(engine)
    for row in range(2):
        torch.testing.assert_close(packed[row], alone[row], rtol=1e-4, atol=1e-4)
        for mine, theirs in zip(packed_caches[row].layers, alone_caches[row].layers, strict=True):
            assert mine.get_seq_length() == theirs.get_seq_length()
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-4, atol=1e-4)


def test_a_sliding_window_is_kept(engine) -> None:
    text = engine.runner.replicas[0].model.config.get_text_config()
    if not sliding(text):
        pytest.skip("no sliding-window attention in this family's text model")
    saved = text.sliding_window
    text.sliding_window = 9  # shorter than every cache: some keys fall out of every window
    try:
        with torch.inference_mode():
            alone, _, packed, _ = both_ways(engine)
            text.sliding_window = None
            unwindowed, _, _, _ = both_ways(engine)
    finally:
        text.sliding_window = saved
    assert not torch.allclose(alone[1], unwindowed[1], atol=1e-3)  # the window matters here
    for row in range(2):
        torch.testing.assert_close(packed[row], alone[row], rtol=1e-4, atol=1e-4)


def test_a_fault_in_any_layer_leaves_every_cache_as_before(engine) -> None:
    prefixes = [conversation(engine, 3), conversation(engine, 4)]
    layers = engine.runner.replicas[0].model.model.language_model.layers

    def fail(module: Any, args: Any, kwargs: Any) -> None:
        raise RuntimeError("injected fault")

    caches = caches_after(engine, prefixes)
    before = [[(layer.keys.clone(), layer.values.clone()) for layer in c.layers] for c in caches]
    handle = layers[len(layers) // 2].register_forward_pre_hook(fail, with_kwargs=True)
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="injected"):
            packed_forward(
                engine.runner.replicas[0].model,
                pieces_of(engine, prefixes, caches),
                engine.runner.image_token_id,
            )
    finally:
        handle.remove()
    for cache, saved in zip(caches, before, strict=True):
        for layer, (keys, values) in zip(cache.layers, saved, strict=True):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@dataclass
class Row:
    """What a stacked decode batch reads of an answer."""

    cache: Any
    pending: list[int]
    max_new_tokens: int = 4
    generated: list[int] = field(default_factory=list)


def test_a_stacked_decode_batch_is_one_piece(engine) -> None:
    # Three answers of different lengths in a left-padded batch, and a chunk beside them: the
    # batch's rows get what the batch's own forward gives them, the chunk its own forward's.
    replica = engine.runner.replicas[0]
    answers = [conversation(engine, 5 + i) for i in range(3)]
    chunked = conversation(engine, 9)

    def setup() -> tuple[DecodeBatch, Piece]:
        shorter = [(ids[: len(ids) - 3 * i], features) for i, (ids, features) in enumerate(answers)]
        batch = DecodeBatch(
            [Row(cache, [11 + i]) for i, cache in enumerate(caches_after(engine, shorter))]
        )
        ids, features = chunked
        fed = ids[: len(ids) - 7]
        offset = sum(1 for i in fed if i == engine.runner.image_token_id)
        return batch, Piece(caches_after(engine, [chunked])[0], ids[len(fed) :], features, offset)

    text = replica.model.config.get_text_config()
    windows = [None] + ([9] if sliding(text) else [])  # and with keys out of the window
    saved = getattr(text, "sliding_window", None)
    try:
        for window in windows:
            if window is not None:
                text.sliding_window = window
            with torch.inference_mode():
                batch, chunk = setup()
                rows = batch.forward(replica.model)
                alone = engine.runner.forward(
                    replica, chunk.cache, chunk.ids, chunk.features, chunk.offset
                )
                packed_batch, packed_chunk = setup()
                packed = packed_forward(
                    replica.model,
                    [packed_batch.piece(), packed_chunk],
                    engine.runner.image_token_id,
                )
            torch.testing.assert_close(packed[:3], rows, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(packed[3], alone, rtol=1e-4, atol=1e-4)
            for ours, theirs in zip(packed_batch.cache.layers, batch.cache.layers, strict=True):
                torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(ours.values, theirs.values, rtol=1e-4, atol=1e-4)
    finally:
        if windows[-1] is not None:
            text.sliding_window = saved


def test_a_stacked_decode_never_needs_the_math_kernel(engine, monkeypatch) -> None:
    """A stacked decode's rows over grouped-query heads reach SDPA with their query heads
    folded onto their key heads (no key repeated) and the padding mask, never with
    `enable_gqa` beside a mask, which only SDPA's math kernel runs (repeating every key and
    holding every score); the rows get what the batch's own forward gives them."""
    from llava.engines.transformers.model import packed as packed_module

    real, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        calls.append((q.shape, k.shape, kwargs["attn_mask"], kwargs.get("enable_gqa", False)))
        return real(q, k, v, **kwargs)

    replica = engine.runner.replicas[0]
    text = replica.model.config.get_text_config()
    assert text.num_key_value_heads < text.num_attention_heads  # grouped-query
    answers = [conversation(engine, 20 + i) for i in range(3)]

    def batch() -> DecodeBatch:
        shorter = [(ids[: len(ids) - 2 * i], f) for i, (ids, f) in enumerate(answers)]
        return DecodeBatch([Row(c, [7 + i]) for i, c in enumerate(caches_after(engine, shorter))])

    with torch.inference_mode():
        expected = batch().forward(replica.model)
        monkeypatch.setattr(
            packed_module, "F", SimpleNamespace(scaled_dot_product_attention=recorded)
        )
        rows = packed_forward(replica.model, [batch().piece()], engine.runner.image_token_id)
    assert len(calls) == text.num_hidden_layers
    for q_shape, k_shape, mask, grouped in calls:
        assert mask is not None and not grouped and q_shape[1] == k_shape[1]
        assert q_shape[2] == text.num_attention_heads // text.num_key_value_heads
    torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)


def test_the_start_up_check_stops_packing_where_the_attention_is_not_routed(
    tiny_checkpoint: Any, caplog: Any
) -> None:
    # As on a transformers whose registered attention is not the packing one: the packing
    # kwarg is then ignored, and each piece would attend to the whole row's new keys only.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from llava.engines.transformers.selfcheck import self_check

    engine = LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu", image_processes=0))
    assert engine.runner.packs
    wrapped = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface.register("sdpa", sdpa_attention_forward)
    try:
        self_check(engine.runner)
    finally:
        AttentionInterface.register("sdpa", wrapped)
    assert not engine.runner.packs
    assert "each prefill chunk runs a forward of its own" in caplog.text


def test_flash_attention_keeps_its_name_and_dispatch_when_packing(tiny_checkpoint: Any) -> None:
    """transformers picks its flash-attention library and mask by the implementation's name:
    packing wraps the function registered under `flash_attention_2` in place, so that name
    stays, the stand-in registered under it runs every unpacked forward, and packed forwards
    still equal each piece's own (a stand-in: flash-attn needs a GPU)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from llava.engines.transformers.model.packed import enable_packing

    calls = []

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    saved = (
        AttentionInterface._global_mapping["flash_attention_2"],
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["flash_attention_2"],
    )
    AttentionInterface.register("flash_attention_2", stand_in)
    ALL_MASK_ATTENTION_FUNCTIONS.register("flash_attention_2", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    try:
        engine = LlavaEngine.load(tiny_checkpoint, ServerConfig(device="cpu", image_processes=0))
        model = engine.runner.replicas[0].model
        model.config.get_text_config()._attn_implementation = "flash_attention_2"
        assert enable_packing(model)
        assert model.config.get_text_config()._attn_implementation == "flash_attention_2"
        calls.clear()
        with torch.inference_mode():
            alone, _, packed, _ = both_ways(engine)
        assert calls  # the unpacked forwards ran through the function under the name
        for row in range(2):
            torch.testing.assert_close(packed[row], alone[row], rtol=1e-4, atol=1e-4)
    finally:
        AttentionInterface.register("flash_attention_2", saved[0])
        ALL_MASK_ATTENTION_FUNCTIONS.register("flash_attention_2", saved[1])


def test_a_chunk_never_reaches_the_math_kernel_with_a_dense_mask(engine, monkeypatch) -> None:
    """A packed chunk's attention goes to SDPA as a causal bias (or, on a sliding-window
    layer, a boolean mask) with as many key heads as query heads: SDPA's math kernel, which
    materialises the whole [heads, chunk, cache] matrix, is never the only one that can run it
    (on a OneVision image's 4k-token chunk that was about 3 GB per layer). Answers unchanged."""
    from llava.engines.transformers.model import packed as packed_module

    real, calls = torch.nn.functional.scaled_dot_product_attention, []

    def recorded(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        calls.append((q.shape, k.shape, kwargs["attn_mask"], kwargs["enable_gqa"]))
        return real(q, k, v, **kwargs)

    # the packing attention's own calls only (transformers' unpacked ones go on as they were)
    monkeypatch.setattr(packed_module, "F", SimpleNamespace(scaled_dot_product_attention=recorded))
    with torch.inference_mode():
        alone, _, packed, _ = both_ways(engine)
    chunks = [c for c in calls if c[0][2] > 1]
    assert chunks
    text = engine.runner.replicas[0].model.config.get_text_config()
    for q_shape, k_shape, mask, grouped in chunks:
        assert not grouped and k_shape[1] == q_shape[1]
        # a causal bias the fused kernels take; a dense boolean mask only to narrow a window
        assert isinstance(mask, CausalBias) or (mask.dtype == torch.bool and sliding(text))
    for row in range(2):
        torch.testing.assert_close(packed[row], alone[row], rtol=1e-4, atol=1e-4)
