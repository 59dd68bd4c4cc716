"""Gradio's own OpenAI chat (`gr.load_chat`) pointed at the kit, driven in a real Chromium.

`gr.load_chat` sends what a Gradio app sends: each uploaded image as a user message of its own
before the question, the whole chat again every turn, no session header. The test records what
its OpenAI client sent and got back (the client is Gradio's; only the temperature is pinned to
0, so the answer can be compared with transformers' pipeline on the very messages it sent).
"""

from __future__ import annotations

import base64
import copy
import io
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from engine_under_test import oracle, reusable
from helpers import Reference, chromium, launch, make_image
from PIL import Image

pytestmark = pytest.mark.integration
gradio = pytest.importorskip("gradio", reason="the Gradio test needs the ui extra")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright")


class Recorder(openai.OpenAI):
    """The OpenAI client `gr.load_chat` builds, recording each request and its usage."""

    sent: list[list[dict[str, Any]]] = []
    usage: list[Any] = []
    answers: list[str] = []  # what the kit answered, as the client read it
    done = threading.Semaphore(0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        create = self.chat.completions.create

        def recorded(**kw: Any) -> Any:
            Recorder.sent.append(copy.deepcopy(kw["messages"]))
            kw.setdefault("temperature", 0)
            if kw.get("stream"):
                kw["stream_options"] = {"include_usage": True}
                return self._watched(create(**kw))
            reply = create(**kw)
            Recorder.usage.append(reply.usage)
            Recorder.answers.append(reply.choices[0].message.content or "")
            Recorder.done.release()
            return reply

        self.chat.completions.create = recorded  # type: ignore[method-assign]

    @staticmethod
    def _watched(stream: Any) -> Iterator[Any]:
        text = []
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    Recorder.usage.append(chunk.usage)
                text += [c.delta.content or "" for c in chunk.choices]
                yield chunk
        finally:
            Recorder.answers.append("".join(text))
            Recorder.done.release()


@pytest.fixture(scope="module")
def app_url(server: Any, monkeypatch_module: Any) -> Iterator[str]:
    monkeypatch_module.setattr(openai, "OpenAI", Recorder)
    app = gradio.load_chat(
        server.url("/predictions/llava/1.0/v1/"), model="llava", token="-", file_types=["image"]
    )
    yield from launch(app)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


def pictures(messages: list[dict[str, Any]]) -> dict[str, Image.Image]:
    """The images a chat carries, by their data URL, decoded as the kit decodes them."""
    out = {}
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] == "image_url":
                url = part["image_url"]["url"]
                data = base64.b64decode(url.split(",", 1)[1])
                out[url] = Image.open(io.BytesIO(data)).convert("RGB")
    return out


def first_divergence(reference: Reference, a: list[Any], b: list[Any]) -> int:
    """Where the pipeline's own ids of two chats part (the oracle's tokenization)."""
    ids = []
    for chat in (a, b):
        converted, images = reference.from_openai(chat, pictures(chat))
        ids.append(reference.processed(images, converted)["input_ids"][0])
    return next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)


def test_gradio_load_chat_in_a_real_browser(app_url, tiny_checkpoint, tmp_path):
    reference = oracle(tiny_checkpoint)
    picture = tmp_path / "picture.png"
    make_image(306, (64, 48)).save(picture)
    Recorder.sent.clear()
    Recorder.usage.clear()
    Recorder.answers.clear()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            page.goto(app_url)
            box = page.locator("textarea").first
            box.wait_for(timeout=60_000)
            page.set_input_files("input[type=file]", str(picture))
            page.locator("img").first.wait_for(timeout=30_000)  # the upload's preview
            for turn, question in enumerate(["What is in this picture?", "And the colors?"]):
                box.fill(question)
                box.press("Enter")
                assert Recorder.done.acquire(timeout=120), f"turn {turn + 1} got no answer"
                sent = Recorder.sent[-1]
                expected = reference.chat_answer(sent, pictures(sent), 256)
                assert Recorder.answers[-1] == expected, "the kit's answer is not the pipeline's"
                # what the page shows: HTML collapses runs of spaces (a random model's answers
                # hold some), so both sides are compared with theirs collapsed
                page.wait_for_function(
                    "text => { const flat = t => t.replace(/\\s+/g, ' ').trim();"
                    " return [...document.querySelectorAll('[data-testid=\"bot\"]')]"
                    ".some(b => flat(b.innerText) === flat(text)); }",
                    arg=expected,
                    timeout=60_000,
                )
        finally:
            browser.close()
    first, second = Recorder.sent
    # Gradio's shape: the image in a user message of its own, before the question
    assert [m["role"] for m in first] == ["user", "user"]
    assert [p["type"] for p in first[0]["content"]] == ["image_url"]
    # the whole chat again (Gradio's history holds the image and the question together now),
    # the answer, and the next question
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    cached = [u.prompt_tokens_details.cached_tokens for u in Recorder.usage]
    prompts = [u.prompt_tokens for u in Recorder.usage]
    # Gradio re-sends the first turn in another shape (the image and its question merged into
    # one message), which the template renders differently after the image: what is reused is
    # the conversation up to there, the image's tokens included (on vLLM, its whole blocks).
    image_end = first_divergence(reference, first, second)
    assert cached[0] == 0 and cached[1] == reusable(image_end), (cached, prompts, image_end)
