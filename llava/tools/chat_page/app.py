"""The chat page, laid out with Gradio: `python -m llava chat --url URL` (or `--endpoint NAME`).

Upload a picture (or paste an https / s3 URL), ask, watch the answer stream, stop it, regenerate
the last answer, start a new conversation; set the system prompt, temperature, top-p and answer
length. Each answer shows its usage. Every tab has its own `Conversation` (its own session).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

from llava.client import SessionClient, image_ref
from llava.core.errors import KitError
from llava.tools.chat_page.conversation import Conversation, Settings, usage_line

TITLE = "LLaVA sessions"
Chat = list[dict[str, str]]


def build_app(make_client: Callable[[], SessionClient], endpoint: str) -> Any:
    """Lay out the page; `make_client` gives each tab its client."""
    import gradio as gr

    def conversation(state: Conversation | None) -> Conversation:
        return state if state is not None else Conversation(make_client())

    def chosen_image(upload: str | None, url: str) -> str | None:
        if url.strip():
            return url.strip()
        return image_ref(upload) if upload else None

    def settings(system: str, temperature: float, top_p: float, tokens: float) -> Settings:
        return Settings(system.strip() or None, float(temperature), float(top_p), int(tokens))

    def stream(
        state: Conversation, chat: Chat, prompt: str, answers: Iterator[str]
    ) -> Iterator[tuple[Any, ...]]:
        asked = [*chat, {"role": "user", "content": prompt}]
        state.stopping = False
        try:
            for text in answers:
                if state.stopping:  # Stop: close the stream; the server drops the answer
                    answers.close()  # type: ignore[attr-defined]
                    yield chat, state, "", "Stopped: that answer was dropped from the conversation."
                    return
                yield [*asked, {"role": "assistant", "content": text}], state, "", state.notice
        except (KitError, ValueError) as exc:  # the page shows the chat as before the question
            yield chat, state, "", f"**Error:** {exc}"
            return
        yield (
            [*asked, {"role": "assistant", "content": state.turns[-1][1]}],
            state,
            usage_line(state.usage),
            state.notice,
        )

    def send(state, chat, prompt, upload, url, system, temperature, top_p, tokens):
        state = conversation(state)
        prompt = (prompt or "").strip()
        if not prompt:
            yield chat, state, gr.skip(), "Type a question first."
            return
        if state.image is None:
            image = chosen_image(upload, url)
            try:
                state.start(image, system.strip() or None)
            except KitError as exc:
                yield chat, state, "", f"**Error:** {exc}"
                return
        yield from stream(
            state, chat, prompt, state.ask(prompt, settings(system, temperature, top_p, tokens))
        )

    def regenerate(state, chat, system, temperature, top_p, tokens):
        state = conversation(state)
        if not state.turns:
            yield chat, state, gr.skip(), "There is no answer to regenerate yet."
            return
        prompt = state.turns[-1][0]
        answers = state.regenerate(settings(system, temperature, top_p, tokens))
        yield from stream(state, chat[:-2], prompt, answers)

    def new_conversation(state, upload, url, system):
        state = conversation(state)
        try:
            state.start(chosen_image(upload, url), system.strip() or None)
        except KitError as exc:
            return [], state, "", f"**Error:** {exc}"
        note = "New conversation." if state.image else "Upload an image or paste its URL."
        return [], state, "", note

    def take_question(text: str) -> tuple[str, str]:
        return "", text

    def stop(state: Conversation | None) -> None:
        if state is not None:
            state.stopping = True

    with gr.Blocks(title=TITLE) as app:
        gr.Markdown(f"## {TITLE}\nTalking to `{endpoint}`")
        state = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1):
                upload = gr.Image(type="filepath", label="Image", elem_id="image")
                url = gr.Textbox(label="...or an image URL (https:// or s3://)", elem_id="url")
                system = gr.Textbox(label="System prompt", lines=2, elem_id="system")
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="Temperature")
                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="Top-p")
                tokens = gr.Slider(
                    1, 1024, value=256, step=1, label="Max new tokens", elem_id="max-tokens"
                )
                new = gr.Button("New conversation", elem_id="new")
            with gr.Column(scale=2):
                chat = gr.Chatbot(label="Conversation", elem_id="chat", height=480)
                prompt = gr.Textbox(
                    label="Question", placeholder="Ask about the image", elem_id="prompt"
                )
                with gr.Row():
                    ask_btn = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                    regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                usage = gr.Markdown(elem_id="usage")
                notice = gr.Markdown(elem_id="notice")
        question = gr.State("")  # the question as sent: the box is emptied at once
        ask_inputs = [state, chat, question, upload, url, system, temperature, top_p, tokens]
        outputs = [chat, state, usage, notice]
        for trigger in (ask_btn.click, prompt.submit):  # what is typed meanwhile is kept
            trigger(take_question, prompt, [prompt, question], queue=False).then(
                send, ask_inputs, outputs
            )
        regen_btn.click(regenerate, [state, chat, system, temperature, top_p, tokens], outputs)
        stop_btn.click(stop, [state], None, queue=False)
        new.click(new_conversation, [state, upload, url, system], outputs)
        upload.change(new_conversation, [state, upload, url, system], outputs)
    return app


def client_factory(args: argparse.Namespace) -> tuple[Callable[[], SessionClient], str]:
    """How each tab reaches the endpoint: a TorchServe URL or a SageMaker endpoint."""
    if args.url:
        return (lambda: SessionClient.for_url(args.url)), args.url
    return (lambda: SessionClient.for_endpoint(args.endpoint, args.region)), args.endpoint


def serve(args: argparse.Namespace) -> None:
    """Start the page on 127.0.0.1 (`--host 0.0.0.0` to share it on a network)."""
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise SystemExit("the chat page needs Gradio: pip install 'llava-sessions[ui]'") from None
    make_client, endpoint = client_factory(args)
    app = build_app(make_client, endpoint)
    print(f"chat page for {endpoint} on http://{args.host}:{args.port}")
    app.queue().launch(server_name=args.host, server_port=args.port, show_error=True)
