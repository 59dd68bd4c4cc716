"""The default model sees: true answers about scenes it never saw, through a real TorchServe.

Images go in as users send them (inline PNG or JPEG, by URL from a loopback server, a JPEG rotated
by an EXIF tag); every answer must equal transformers' own pipeline on the picture the user meant,
so a loss anywhere in the stack (decoding, orientation, colour mode, resizing) shows as a
difference, and the accuracy must reach its target for each kind of question.
"""

from __future__ import annotations

import base64
import io
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import drawn_elsewhere
import engine_under_test
import httpx
import pytest
from conftest import served
from helpers import Reference, ask, open_session, post
from PIL import Image, ImageOps

from llava.core.paths import SAMPLE_IMAGE
from llava.fronts.torchserve.launcher import TorchServe
from llava.tools.archive import build_archive
from llava.tools.quickstart import FOLLOW_UP, QUESTION
from llava.tools.tiny.chatter import REPLY, TITLE
from llava.tools.tiny.quiz import Item, make_quiz, report, score, shortfalls
from llava.tools.tiny.scenes import SAMPLE, colour_answer, shape_answer
from llava.tools.tiny.train import SHIPPED

SCENES = 100
MAX_NEW_TOKENS = 24
ORIENTATION = 0x0112  # the EXIF tag; 6 = "rotate 90 degrees clockwise to display"
MODES = ("inline", "url", "exif")
QUIZ = make_quiz(SCENES * len(MODES))
# On pictures it was not trained on (tests/drawn_elsewhere.py), every kind of question but the
# whole description is held to this.
ELSEWHERE_TARGET = 0.9


class Files(BaseHTTPRequestHandler):
    """Serve the test's image files by path, as any web server would."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    host = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()


@pytest.fixture(scope="module")
def shapes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchServe]:
    store = tmp_path_factory.mktemp("store-shapes")
    build_archive(SHIPPED, store, name="llava")
    with served(
        store,
        tmp_path_factory.mktemp("ts-shapes"),
        LLAVA_IMAGE_ALLOW_HTTP="true",
        LLAVA_IMAGE_ALLOW_HOSTS="127.0.0.1",
    ) as ts:
        yield ts


@pytest.fixture(scope="module")
def oracle() -> Reference:
    import torch

    return engine_under_test.oracle(Path(SHIPPED), dtype=torch.float32)


def exif_rotated(image: Image.Image) -> bytes:
    """Return a JPEG whose pixels lie on their side, with the EXIF tag that stands them up."""
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    out = io.BytesIO()
    image.transpose(Image.Transpose.ROTATE_90).save(out, "JPEG", quality=95, exif=exif)
    return out.getvalue()


def as_sent(mode: str, index: int, item: Item, host: str) -> tuple[str, Image.Image]:
    """Return the image reference a user sends, and the picture they mean (the oracle's input)."""
    if mode == "exif":
        data = exif_rotated(item.scene.draw())
        with Image.open(io.BytesIO(data)) as stored:
            meant = ImageOps.exif_transpose(stored).convert("RGB")
        assert meant.size == (item.scene.width, item.scene.height)
        return "data:image/jpeg;base64," + base64.b64encode(data).decode(), meant
    fmt = "JPEG" if index % 2 else "PNG"
    data = item.scene.encode(fmt)
    with Image.open(io.BytesIO(data)) as decoded:
        meant = decoded.convert("RGB")
    if mode == "url":
        Files.files[f"/scene-{index}.{fmt.lower()}"] = data
        return f"{host}/scene-{index}.{fmt.lower()}", meant
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode(), meant


def converse(url: str, image: str, questions: list[str]) -> list[str]:
    """Open a session on the image, ask each question in turn, close it; return the answers."""
    with httpx.Client(timeout=120) as client:
        sid = open_session(client, url, image)
        answers = [
            ask(client, url, sid, q, max_new_tokens=MAX_NEW_TOKENS)["text"] for q in questions
        ]
        assert post(client, url, {"type": "close_session"}, sid).status_code == 200
    return answers


def test_answers_about_unseen_scenes_are_true(
    shapes_server: TorchServe, oracle: Reference, image_host: str
) -> None:
    """Each way of sending a picture gets scenes of its own; the targets hold over all of them
    (300 scenes: on 100, one question of a rare kind moved its score by 5-6 points)."""
    url = shapes_server.url("/predictions/llava")
    served_answers: list[list[str]] = []
    for m, mode in enumerate(MODES):
        items = QUIZ[m * SCENES : (m + 1) * SCENES]
        sent = [as_sent(mode, i, item, image_host) for i, item in enumerate(items)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(
                    lambda pair: converse(url, pair[0][0], [t.question for t in pair[1].turns]),
                    zip(sent, items, strict=True),
                )
            )
        in_process = [
            oracle.answers(meant, [t.question for t in item.turns], MAX_NEW_TOKENS)
            for (_, meant), item in zip(sent, items, strict=True)
        ]
        differ = [
            (i, got, want)
            for i, (got, want) in enumerate(zip(answers, in_process, strict=True))
            if got != want
        ]
        assert not differ, f"{mode}: served answers differ from transformers' own: {differ[:5]}"
        served_answers += answers
    scores = score(QUIZ, served_answers)
    print("\n" + report(scores))
    assert not shortfalls(scores), report(scores)


def test_scenes_drawn_by_another_renderer_are_seen_too(
    shapes_server: TorchServe, oracle: Reference
) -> None:
    """Pictures as people make them: anti-aliased, in CSS shades, on white, paper or dark-theme
    canvases, as JPEGs, drawn by a renderer written apart from the training one."""
    elsewhere = drawn_elsewhere.quiz(2 * SCENES)
    url = shapes_server.url("/predictions/llava")

    def sent(item: Item) -> str:
        assert item.picture is not None
        return "data:image/jpeg;base64," + base64.b64encode(item.picture).decode()

    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda item: converse(url, sent(item), [t.question for t in item.turns]), elsewhere
            )
        )
    scores = score(elsewhere, answers)
    print("\n" + report(scores))
    low = [
        kind
        for kind, (right, asked) in scores.items()
        if kind != "describe" and right < ELSEWHERE_TARGET * asked
    ]
    assert not low, f"below {ELSEWHERE_TARGET:.0%} on {low}:\n{report(scores)}"
    in_process = [
        oracle.answers(item.image(), [t.question for t in item.turns], MAX_NEW_TOKENS)
        for item in elsewhere
    ]
    assert answers == in_process  # the JPEG decoded as transformers' pipeline decodes it


def test_text_without_a_picture_gets_the_one_true_reply(shapes_server: TorchServe) -> None:
    """What chat clients send with no picture: a greeting, a question, Open WebUI's title
    request, a second turn; the model says what it can do, nothing else."""
    from openai import OpenAI

    client = OpenAI(
        base_url=shapes_server.url("/predictions/llava/1.0/v1"), api_key="unused", max_retries=0
    )
    title = TITLE.replace("{question}", "What colour is the circle?")
    chats: list[list[dict[str, str]]] = [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "user", "content": "What can you do?"}],
        [{"role": "user", "content": "Good evening! Could you help me?"}],  # not trained on
        [{"role": "user", "content": "How do I bake bread?"}],  # nor this
        [{"role": "user", "content": title}],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": REPLY},
            {"role": "user", "content": "Who are you?"},
        ],
    ]
    for chat in chats:
        # No max_tokens, as chat clients send it: the reply ends by itself, at EOS. Greedy,
        # since OpenAI's default temperature (1) samples, and a word may then stray.
        reply = client.chat.completions.create(
            model="llava",
            messages=chat,  # type: ignore[arg-type]
            temperature=0,
        )
        said = (chat[-1]["content"][:40], reply.choices[0].finish_reason, reply.choices[0].message)
        assert reply.choices[0].finish_reason == "stop", said
        assert reply.choices[0].message.content == REPLY, said


def test_the_quickstart_answers_truly_about_the_sample(shapes_server: TorchServe) -> None:
    with Image.open(SAMPLE_IMAGE) as shipped:
        assert list(shipped.convert("RGB").getdata()) == list(SAMPLE.draw().getdata())
    data = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
    answers = converse(
        shapes_server.url("/predictions/llava"),
        f"data:image/png;base64,{data}",
        [QUESTION, FOLLOW_UP],
    )
    assert answers == [colour_answer(SAMPLE, "circle"), colour_answer(SAMPLE, "square")]


def test_openai_chat_completions_answer_truly(shapes_server: TorchServe) -> None:
    from openai import OpenAI

    data = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
    content: list[Any] = [
        {"type": "text", "text": "What shape is blue?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
    ]
    client = OpenAI(
        base_url=shapes_server.url("/predictions/llava/1.0/v1"), api_key="unused", max_retries=0
    )
    reply = client.chat.completions.create(
        model="llava",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW_TOKENS,
        temperature=0,
    )
    assert reply.choices[0].message.content == shape_answer(SAMPLE, "blue")


def test_the_chat_page_shows_true_answers(shapes_server: TorchServe) -> None:
    """The chat page in Chromium: upload the sample, ask, and read the true answer on the page
    (LLAVA_CHAT_SCREENSHOT=docs/chat-page.png takes the README's picture)."""
    pytest.importorskip("gradio", reason="the chat page needs the ui extra")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright")
    from helpers import chromium, launch

    from llava.client import SessionClient
    from llava.tools.chat_page.app import build_app

    url = shapes_server.url("/predictions/llava")
    for page_url in launch(build_app(lambda: SessionClient.for_url(url), url)):
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(page_url)
            page.set_input_files("#image input[type=file]", str(SAMPLE_IMAGE))
            page.wait_for_selector("#chat")
            page.wait_for_function(  # the upload is taken: the page says so
                "document.querySelector('#notice').innerText.includes('New conversation')"
            )
            for turn, (question, kind) in enumerate(((QUESTION, "circle"), (FOLLOW_UP, "square"))):
                before = page.inner_text("#usage")
                page.fill("#prompt textarea", question)
                page.click("#send")
                page.wait_for_function(  # the answer has streamed in: its own usage line shows
                    "([prev, n]) => { const t = document.querySelector('#usage').innerText;"
                    " const bots = document.querySelectorAll('#chat [data-testid=\"bot\"]');"
                    " return t.includes('tokens generated') && t !== prev && bots.length === n; }",
                    arg=[before, turn + 1],
                    timeout=60_000,
                )
                bots = page.locator("#chat [data-testid='bot']").all_inner_texts()
                assert len(bots) == turn + 1
                assert bots[-1].strip() == colour_answer(SAMPLE, kind)
            if os.environ.get("LLAVA_CHAT_SCREENSHOT"):
                page.screenshot(path=os.environ["LLAVA_CHAT_SCREENSHOT"], full_page=True)
            browser.close()
