"""The chat page in a real headless Chromium, against a real TorchServe with the tiny model.

Upload, ask and watch the answer grow, stop, regenerate (prefilling nothing: the session rolled
its last turn back), start a new conversation (the old session closed), and ask again after the
session expired (reopened with its conversation, with a notice). The browser is Debian's
`chromium` (browsers cannot be downloaded here); a failing test saves a screenshot.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import served
from engine_under_test import KV_BLOCK
from helpers import chromium, launch, make_image

from llava.api.headers import SESSION_HEADER
from llava.client import Session, SessionClient
from llava.fronts.torchserve.launcher import TorchServe

pytestmark = pytest.mark.integration
gradio = pytest.importorskip("gradio", reason="the chat page needs the ui extra")
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs playwright")

TTL_S = 4
ARTIFACTS = Path(os.environ.get("LLAVA_TEST_ARTIFACTS", "test-artifacts"))


class RecordingClient(SessionClient):
    """The page's client, keeping every session it opens (to check them from outside).

    With `hold_after` set, a stream waits after that many deltas until `release` is set: the
    tiny model answers 1024 tokens in about 2 s, so without the hold a Stop could come after
    the page had already read the whole answer.
    """

    opened: list[Session] = []
    hold_after: int | None = None
    release = threading.Event()

    def session(self, *args: Any, **kwargs: Any) -> Session:
        session = super().session(*args, **kwargs)
        self.opened.append(session)
        stream = session.stream

        def held(*args: Any, **kwargs: Any) -> Iterator[str]:
            deltas = stream(*args, **kwargs)
            try:
                for i, delta in enumerate(deltas):
                    if i == RecordingClient.hold_after:
                        assert RecordingClient.release.wait(60), "the test never released it"
                    yield delta
            finally:
                deltas.close()  # type: ignore[attr-defined]

        session.stream = held  # type: ignore[method-assign]
        return session


@pytest.fixture(scope="module")
def torchserve(model_store, tmp_path_factory) -> Iterator[TorchServe]:
    with served(
        model_store,
        tmp_path_factory.mktemp("chat"),
        LLAVA_SESSION_TTL_S=str(TTL_S),
        LLAVA_REAPER_INTERVAL_S="0.2",
    ) as ts:
        yield ts


@pytest.fixture(scope="module")
def page_url(torchserve: TorchServe) -> Iterator[str]:
    from llava.tools.chat_page.app import build_app

    url = torchserve.url("/predictions/llava")
    yield from launch(build_app(lambda: RecordingClient.for_url(url), url))


@pytest.fixture()
def page(page_url: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1280, "height": 900})
        tab.goto(page_url)
        try:
            yield tab
        finally:
            report = getattr(request.node, "rep_call", None)
            if report is not None and report.failed:
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                shot = ARTIFACTS / f"{request.node.name}.png"
                tab.screenshot(path=str(shot), full_page=True)
                print(f"\nscreenshot of the failing page: {shot}")
            browser.close()


# -- page helpers ----------------------------------------------------------------------------

WATCH = """() => {
    window.lengths = [];
    const chat = document.querySelector('#chat');
    new MutationObserver(() => {
        const bots = chat.querySelectorAll('[data-testid="bot"]');
        const last = bots[bots.length - 1];
        if (last) window.lengths.push(last.innerText.length);
    }).observe(chat, {subtree: true, childList: true, characterData: true});
}"""


def ask(page: Any, question: str) -> None:
    page.fill("#prompt textarea", question)
    page.click("#send")


def usage(page: Any, previous: str = "") -> str:
    """Wait for a new usage line under the answer; return it."""
    page.wait_for_function(
        "prev => { const t = document.querySelector('#usage').innerText.trim();"
        " return /^time to first token \\d+ ms · \\d+ tokens generated · \\d+ reused from the"
        " session · \\d+ prefilled$/.test(t) && t !== prev; }",
        arg=previous,
        timeout=60_000,
    )
    return page.inner_text("#usage").strip()


def bot_messages(page: Any) -> list[str]:
    return page.locator("#chat [data-testid='bot']").all_inner_texts()


def set_max_tokens(page: Any, value: int) -> None:
    box = page.locator("#max-tokens input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def prefilled(line: str) -> int:
    return int(re.search(r"(\d+) prefilled", line).group(1))


# -- the test --------------------------------------------------------------------------------


def test_chat_in_a_real_browser(page: Any, torchserve: TorchServe, tmp_path: Path) -> None:
    RecordingClient.opened.clear()
    picture = tmp_path / "picture.png"
    make_image(5, (96, 80)).save(picture)
    page.set_input_files("#image input[type=file]", str(picture))
    page.wait_for_selector("#chat")  # Gradio renders the chat on its own schedule
    page.evaluate(WATCH)

    # Ask: the answer streams in (its text grows), then its usage shows.
    set_max_tokens(page, 48)
    ask(page, "What is in this picture?")
    first = usage(page)
    lengths = page.evaluate("window.lengths")
    assert len({n for n in lengths if n}) >= 3, lengths  # seen growing, not all at once
    assert bot_messages(page) and bot_messages(page)[-1].strip()
    if os.environ.get("LLAVA_CHAT_SCREENSHOT"):  # the README's picture of the page
        page.screenshot(path=os.environ["LLAVA_CHAT_SCREENSHOT"], full_page=True)
    session = RecordingClient.opened[-1]
    assert all(earlier.closed for earlier in RecordingClient.opened[:-1])

    # Stop a long answer: it is dropped from the page and from the session.
    set_max_tokens(page, 1024)
    RecordingClient.release.clear()
    RecordingClient.hold_after = 20
    page.evaluate("window.lengths = []")
    ask(page, "Tell me a very long story.")
    # Stop only once this answer shows: a Stop before its stream starts has nothing to stop.
    page.wait_for_function(
        "document.querySelectorAll('#chat [data-testid=\"bot\"]').length === 2"
        " && window.lengths.length > 3",
        timeout=30_000,
    )
    # The question left the box as it was sent; what is typed while the answer streams stays.
    assert page.input_value("#prompt textarea") == ""
    page.fill("#prompt textarea", "a draft of the next question")
    with page.expect_response(lambda response: response.request.method == "POST"):
        page.click("#stop")  # answered once the page's server has taken the stop
    RecordingClient.hold_after = None
    RecordingClient.release.set()
    page.wait_for_function(
        "document.querySelector('#notice').innerText.includes('Stopped')", timeout=30_000
    )
    assert len(bot_messages(page)) == 1
    assert page.input_value("#prompt textarea") == "a draft of the next question"

    # Regenerate the first answer: the session rolled it back, so nothing is prefilled again.
    set_max_tokens(page, 48)
    page.click("#regenerate")
    again = usage(page, first)
    assert prefilled(again) <= KV_BLOCK, again  # all but the last unit of the cache was held
    assert len(bot_messages(page)) == 1

    # A new conversation closes the session and opens another.
    page.click("#new")
    page.wait_for_function("document.querySelectorAll('#chat [data-testid=\"bot\"]').length === 0")
    assert session.closed
    r = httpx.post(
        torchserve.url("/predictions/llava"),
        json={"type": "query", "prompt": "still there?"},
        headers={SESSION_HEADER: session.id},
        timeout=30,
    )
    assert r.json()["error"]["code"] == "session_closed"

    # Expiry: once the session has been idle past its TTL, the next question reopens it with
    # the same image and conversation, and says so.
    ask(page, "What is in this picture?")
    line = usage(page, again)
    current = RecordingClient.opened[-1]
    time.sleep(TTL_S + 1.0)  # the subject is time passing: idle past the TTL (and a reaper run)
    ask(page, "And the colors?")
    usage(page, line)
    page.wait_for_function(  # the notice is written with the answer's last update
        "/reopened|Error/.test(document.querySelector('#notice').innerText)", timeout=30_000
    )
    notice = page.inner_text("#notice")
    assert "reopened with the same image and conversation" in notice, notice
    assert "session_expired" in notice
    assert len(bot_messages(page)) == 2
    reopened = RecordingClient.opened[-1]
    assert reopened is not current
