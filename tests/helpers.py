"""Test helpers: raw HTTP calls to the session API and a stateless reference computation."""

from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from llava.protocol import SESSION_HEADER


def make_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """Return a deterministic noisy RGB image; different seeds give different answers."""
    rng = random.Random(seed)
    data = bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))
    return Image.frombytes("RGB", size, data)


def data_uri(image: Image.Image) -> str:
    """Encode an image as a PNG data: URI."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(
    client: httpx.Client, url: str, body: dict[str, Any], sid: str | None = None, **headers: str
) -> httpx.Response:
    """POST one JSON request, with the session header when given."""
    hdrs = {"Content-Type": "application/json", **headers}
    if sid is not None:
        hdrs[SESSION_HEADER] = sid
    return client.post(url, content=json.dumps(body), headers=hdrs)


def open_session(client: httpx.Client, url: str, image: str, **extra: Any) -> str:
    """Open a session and return its id (asserting success)."""
    r = post(client, url, {"type": "open_session", "image": image, **extra})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def ask(client: httpx.Client, url: str, sid: str, prompt: str, **params: Any) -> dict[str, Any]:
    """Ask a question (greedy unless told otherwise) and return the JSON answer."""
    r = post(client, url, {"type": "query", "prompt": prompt, **params}, sid)
    assert r.status_code == 200, r.text
    return r.json()


class Reference:
    """The model's own pipeline, the oracle: `apply_chat_template` + processor + `generate`.

    Shares nothing with the kit's engine: each answer is computed from the whole conversation
    rendered as text, exactly as a stateless transformers user would.
    """

    def __init__(self, checkpoint: Path, dtype: Any = None) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(checkpoint)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        self.model = AutoModelForImageTextToText.from_pretrained(checkpoint, **kwargs).eval()

    @staticmethod
    def messages(
        system_prompt: str | None, history: list[tuple[str, str]], prompt: str
    ) -> list[dict[str, Any]]:
        """Write a conversation as chat messages, the image with the first question."""
        out: list[dict[str, Any]] = []
        if system_prompt:
            out.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        for i, (question, answer) in enumerate([*history, (prompt, None)]):
            content: list[dict[str, str]] = [{"type": "text", "text": question}]
            if i == 0:
                content.insert(0, {"type": "image"})
            out.append({"role": "user", "content": content})
            if answer is not None:
                out.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        return out

    def answer(
        self,
        images: list[Image.Image],
        messages: list[dict[str, Any]],
        max_new_tokens: int,
    ) -> str:
        """Answer one conversation greedily, from scratch."""
        import torch

        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        inputs = self.processor(images=images, text=text, return_tensors="pt")
        inputs = {
            k: v.to(self.model.dtype) if v.is_floating_point() else v for k, v in inputs.items()
        }
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        generated = out[0, inputs["input_ids"].shape[1] :]
        return self.processor.tokenizer.decode(generated, skip_special_tokens=True)

    def answers(
        self,
        image: Image.Image,
        prompts: list[str],
        max_new_tokens: int,
        system_prompt: str | None = None,
        *,
        history: bool = True,
    ) -> list[str]:
        """Answer each prompt in turn, each from the whole conversation so far."""
        past: list[tuple[str, str]] = []
        answers = []
        for prompt in prompts:
            messages = self.messages(system_prompt, past if history else [], prompt)
            answer = self.answer([image], messages, max_new_tokens)
            if history:
                past.append((prompt, answer))
            answers.append(answer)
        return answers
