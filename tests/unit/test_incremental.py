"""A turn's prompt rendered and tokenized from the last one's has the whole conversation's ids.

The oracle is transformers' own: the processor's chat template over every message, each image
placeholder expanded to its image's tokens, the tokenizer over the whole text.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from helpers import _load_processor

from llava.engines.conversation import chat as chat_module
from llava.engines.conversation.chat import ChatFormatter, Exchange
from llava.engines.conversation.incremental import Rendered, splice_ids
from llava.tools.tiny import build_checkpoint

FAMILIES = ["tiny", "llava15", "next", "interleave", "onevision"]
MULTI_IMAGE = {"interleave", "onevision"}
WORDS = [
    "What colour is the circle?",
    "And the other one?",
    "Ünïcödé ✓ and 😀 emoji",
    "two  spaces  inside",
    "  leading and trailing  ",
    "a\nnew line\n\n",
    "漢字とかな",
    "</s> spelled out",
    "tab\tseparated",
    "x",
]


@pytest.fixture(scope="module", params=FAMILIES)
def formatter(request: pytest.FixtureRequest, tmp_path_factory: Any) -> tuple[str, Any]:
    path = build_checkpoint(tmp_path_factory.mktemp(request.param) / "m", profile=request.param)
    return request.param, _load_processor(Path(path))


def pipeline_ids(processor: Any, messages: list[dict[str, Any]], tokens: list[int]) -> list[int]:
    """transformers' own ids: the template over every message, placeholders expanded."""
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    parts = text.split(processor.image_token)
    assert len(parts) - 1 == len(tokens)
    expanded = parts[0] + "".join(
        processor.image_token * n + part for n, part in zip(tokens, parts[1:], strict=True)
    )
    return processor.tokenizer(expanded)["input_ids"]


def spliced_count(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the turns whose ids were spliced (not tokenized whole)."""
    hits = [0]

    def counting(*args: Any) -> Any:
        out = splice_ids(*args)
        hits[0] += out is not None
        return out

    monkeypatch.setattr(chat_module, "splice_ids", counting)
    return hits


@pytest.mark.parametrize("system", [None, "Answer briefly."])
def test_every_turn_has_the_whole_conversations_ids(
    formatter: tuple[str, Any], system: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    family, processor = formatter
    chat = ChatFormatter(processor)
    assert chat.incremental, f"{family}'s template should render each message on its own"
    hits = spliced_count(monkeypatch)
    rng = random.Random(family)
    history: list[Exchange] = []
    held: Rendered | None = None
    tokens = [rng.randint(2, 9)]
    turns = 30
    for turn in range(turns):
        added = int(family in MULTI_IMAGE and turn in (7, 19))
        if added:  # OneVision encodes its images together: every count may change
            tokens = [rng.randint(2, 9) for _ in range(len(tokens) + 1)]
        messages = chat.messages(system, history, rng.choice(WORDS), added)
        rendered = chat.prompt(messages, tokens, held)
        assert rendered.ids == pipeline_ids(processor, messages, tokens), f"turn {turn + 1}"
        held = rendered
        history.append(Exchange(messages[-1]["content"][-1]["text"], rng.choice(WORDS), added))
    assert hits[0] >= (turns - 1) * 0.7, f"only {hits[0]} of {turns - 1} turns were spliced"


def test_a_client_chat_in_any_shape_has_the_whole_conversations_ids(
    formatter: tuple[str, Any],
) -> None:
    """Chats as clients send them: an image alone, consecutive user messages, text only."""
    family, processor = formatter
    chat = ChatFormatter(processor)

    def text(words: str, role: str = "user") -> dict[str, Any]:
        return {"role": role, "content": [{"type": "text", "text": words}]}

    image = {"role": "user", "content": [{"type": "image"}]}
    sent: list[dict[str, Any]] = [image, text("What is it?")]
    held = None
    for turn in range(6):
        rendered = chat.chat_prompt("Be kind.", sent, [4], held)
        want = pipeline_ids(processor, chat.chat_messages("Be kind.", sent), [4])
        assert rendered.ids == want, f"turn {turn + 1}"
        held = rendered
        sent = [*sent, text(WORDS[turn], "assistant"), text(WORDS[-1 - turn]), text("And?")]


MOVES_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: "
    "{% if loop.last and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'][0]['text'] }} {% endif %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}"
    "{{ c['text'] }} {% endif %}{% endfor %}"
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'][0]['text'] }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
NUMBERS_IMAGES = (
    "{% set n = namespace(i=0) %}{% for m in messages %}{{ m['role'].upper() }}: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}{% set n.i = n.i + 1 %}"
    "Picture {{ n.i }}: <image>\n{% else %}{{ c['text'] }} {% endif %}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

LOOKS_BACK = (  # an answer after a question with a picture is introduced differently
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}"
    "{{ c['text'] }} {% endif %}{% endfor %}{% else %}ASSISTANT: "
    "{% if messages[loop.index0 - 1]['content'][0]['type'] == 'image' %}Seen: {% endif %}"
    "{{ m['content'][0]['text'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

NEEDS_IMAGE_FIRST = (  # refuses a conversation whose first question has no picture
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% if users and users[0]['content'][0]['type'] != 'image' %}"
    "{{ raise_exception('the first question needs an image') }}{% endif %}"
    "{% for m in messages %}{{ m['role'].upper() }}: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}"
    "{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [MOVES_SYSTEM, NUMBERS_IMAGES, LOOKS_BACK, NEEDS_IMAGE_FIRST],
    ids=["moves", "numbers", "looks back", "needs an image first"],
)
def test_a_template_that_renders_across_messages_is_rendered_whole(
    tiny_checkpoint: Path, template: str
) -> None:
    processor = _load_processor(tiny_checkpoint)
    processor.chat_template = template
    chat = ChatFormatter(processor)
    assert not chat.incremental
    history: list[Exchange] = []
    held = None
    tokens = [3]
    for turn in range(4):
        tokens += [3] * (turn == 2)
        messages = chat.messages("Be brief.", history, WORDS[turn], int(turn == 2))
        held = chat.prompt(messages, tokens, held)
        assert held.ids == pipeline_ids(processor, messages, tokens)
        history.append(Exchange(WORDS[turn], "Yes.", int(turn == 2)))


def word_pieces(text: str, first: int = 0) -> tuple[list[int], list[int]]:
    """A word-level tokenizer: a piece is a word with the space before it; the first piece's
    id is shifted by `first` (as a tokenizer that marks the start of its input would)."""
    ids, ends, at = [], [], 0
    while at < len(text):
        end = text.find(" ", at + 1)
        end = len(text) if end < 0 else end
        ids.append(sum(map(ord, text[at:end])) + (first if not ids else 0))
        ends.append(end)
        at = end
    return ids, ends


def test_a_tail_is_spliced_only_where_it_tokenizes_as_the_whole_text() -> None:
    text = "aa bb cc dd ee ff gg"
    held = Rendered((), text, *word_pieces(text), ())
    new = text + " hh ii"
    assert splice_ids(word_pieces, held, new, len(text)) == word_pieces(new)
    # A tokenizer that reads the cut otherwise (its tail's first piece differs): no splice.
    marks = lambda tail: word_pieces(tail, first=1000)  # noqa: E731
    assert splice_ids(marks, held, new, len(text)) is None
    # No word boundary to cut at: no splice.
    solid = Rendered((), "abcdefgh", [1] * 8, list(range(1, 9)), ())
    assert splice_ids(word_pieces, solid, "abcdefghij", 8) is None


TRICKY = [
    "",
    "x",
    "Hi there",
    " ",
    "😀" * 7,
    "ﷺ ﬁ ㍻ Ⅻ",
    "漢字" * 5,
    "a\tb\n c",
    "  two  ",
    "e\u0301" * 4,
]


def test_a_questions_tokens_are_counted_exactly_where_they_could_be_over(
    formatter: tuple[str, Any],
) -> None:
    """A question is refused by its own token count, as the tokenizer counts it, at any limit
    (texts whose bytes prove them within it are not tokenized)."""
    family, processor = formatter
    chat = ChatFormatter(processor)
    rng = random.Random(family)
    texts = [*TRICKY, *("".join(rng.choices(TRICKY, k=4)) for _ in range(40))]
    for text in texts:
        count = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        for limit in {0, max(0, count - 1), count, count + 1, len(text.encode()) + 1}:
            want = count if count > limit else None
            assert chat.tokens_over(text, limit) == want, (family, text, limit)


def test_the_tokenizers_own_backend_is_used_only_where_it_tokenizes_alike(
    tiny_checkpoint: Path,
) -> None:
    """The `tokenizers` object is called directly only if it gives the wrapper's ids."""
    processor = _load_processor(tiny_checkpoint)
    assert ChatFormatter(processor)._backend is processor.tokenizer.backend_tokenizer
    wrapper = type(processor.tokenizer)

    class Lowering(wrapper):  # type: ignore[misc, valid-type]
        def __call__(self, text: str, **kwargs: Any) -> Any:
            return super().__call__(text.lower(), **kwargs)

    processor.tokenizer.__class__ = Lowering
    chat = ChatFormatter(processor)
    assert chat._backend is None
    messages = chat.messages(None, [Exchange("Hi", "Yes.")], "What Colour?")
    assert chat.prompt(messages, [3]).ids == pipeline_ids(processor, messages, [3])
