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
    """Recompute a conversation from scratch for every turn with transformers' own generate."""

    def __init__(self, checkpoint: Path) -> None:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        from llava.engine.chat import ChatFormatter

        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.model = LlavaForConditionalGeneration.from_pretrained(checkpoint).eval()
        self.chat = ChatFormatter(self.processor)
        self.eos = self.model.generation_config.eos_token_id

    def answers(
        self,
        image: Image.Image,
        prompts: list[str],
        max_new_tokens: int,
        system_prompt: str | None = None,
    ) -> list[str]:
        """Return the greedy answer to each prompt, each computed from the whole conversation."""
        import torch

        tokenizer = self.processor.tokenizer
        inputs = self.processor(
            images=image, text=self.chat.open_text(system_prompt), return_tensors="pt"
        )
        ids = inputs["input_ids"][0].tolist()
        history: list[tuple[str, str]] = []
        answers = []
        for prompt in prompts:
            text = self.chat.turn_text(system_prompt, history, prompt)
            ids += tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=torch.tensor([ids]),
                    pixel_values=inputs["pixel_values"],
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                )
            generated = out[0, len(ids) :].tolist()
            if generated and generated[-1] == self.eos:
                generated = generated[:-1]
            answer = tokenizer.decode(generated, skip_special_tokens=True)
            ids += generated
            history.append((prompt, answer))
            answers.append(answer)
        return answers
