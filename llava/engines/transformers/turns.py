"""Turning a conversation's ids into a turn: the checks a question must pass, how much of it
the session's cache already holds, and the turn that prefills the rest."""

from __future__ import annotations

from llava.core.errors import ContextLengthExceeded
from llava.core.params import GenerationParams
from llava.engines.conversation import checks
from llava.engines.conversation.chat import Exchange, common_prefix
from llava.engines.conversation.text import Detokenizer
from llava.engines.transformers.decoding.sampling import make_generator
from llava.engines.transformers.runner import ModelRunner
from llava.engines.transformers.state import tiers
from llava.engines.transformers.state.imageset import ImageSet
from llava.engines.transformers.state.session import SessionState, Turn


def check_prompt_tokens(runner: ModelRunner, text: str, field: str) -> None:
    """Refuse a question over `max_prompt_tokens` (counted on its own)."""
    checks.check_prompt_tokens(runner.chat, runner.config.max_prompt_tokens, text, field)


def room_for_answer(runner: ModelRunner, ids: list[int], field: str) -> int:
    """Return how many tokens an answer may take; refuse a conversation past the context."""
    room = runner.max_context - len(ids)
    if room < 1:
        raise ContextLengthExceeded(
            f"the conversation is {len(ids)} tokens and the model's context is "
            f"{runner.max_context}: open a new session, or shorten the conversation",
            field=field,
            limit=runner.max_context,
            tokens=len(ids),
        )
    return room


def reusable(runner: ModelRunner, state: SessionState, ids: list[int]) -> int:
    """Return how many of `ids` the session's cache holds (at least one is fed again)."""
    if not runner.keeps_kv:
        return 0
    return min(common_prefix(state.cache_ids, ids), len(ids) - 1)


def new_turn(
    runner: ModelRunner,
    state: SessionState,
    prompt: str,
    params: GenerationParams,
    ids: list[int],
    past: list[Exchange],
    images: ImageSet,
    common: int,
    added: int,
    history: bool = True,
) -> Turn:
    """Bring the session's cache back, keep its first `common` ids and plan the rest."""
    cache, found = tiers.for_turn(state, common, runner.num_layers, runner.keeps_kv, history)
    tower = runner.images.pending_tokens(images)
    if images.processed is not None:  # pixels mode: the tower runs for every answer
        tower = images.processed.total
    return Turn(
        state=state,
        prompt=prompt,
        params=params,
        branch=not history,
        images=images,
        added_images=added,
        past=list(past),
        cache=cache,
        start_len=common,
        ids=ids,
        fed=ids[:common],
        pending=ids[common:],
        max_new_tokens=0,
        detokenizer=Detokenizer(runner.tokenizer),
        generator=make_generator(params, state.replica.device),
        found_in=found,
        prefill_tokens=len(ids) - common,
        cached_tokens=common,
        tower_tokens=tower,
        features=images.features if not tower else None,
    )


def refuse_placeholder(runner: ModelRunner, text: str | None, field: str) -> None:
    """Refuse user text holding the image placeholder: images come only as images."""
    checks.refuse_placeholder(runner.chat, text, field)
