"""Test helpers: raw HTTP calls to the session API and a stateless reference computation."""

from __future__ import annotations

import base64
import copy
import io
import json
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from llava.api.headers import SESSION_HEADER
from llava.tools.tiny.scenes import Shape


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
    rendered as text, with every image of it passed as one sample, exactly as a stateless
    transformers user (or `apply_chat_template(..., tokenize=True)`) would.
    """

    def __init__(self, checkpoint: Path, dtype: Any = None, device: str = "cpu") -> None:
        from transformers import AutoModelForImageTextToText

        self.processor = _load_processor(checkpoint)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForImageTextToText.from_pretrained(checkpoint, **kwargs)
        self.model = model.to(device).eval()

    @staticmethod
    def messages(
        system_prompt: str | None,
        history: list[tuple[str, str]],
        prompt: str,
        images: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """Write a conversation as chat messages; `images[i]` images come with question i
        (default: one, with the first question)."""
        questions = [*history, (prompt, None)]
        counts = images if images is not None else [1] + [0] * (len(questions) - 1)
        out: list[dict[str, Any]] = []
        if system_prompt:
            out.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        for (question, answer), count in zip(questions, counts, strict=True):
            content: list[dict[str, str]] = [{"type": "image"} for _ in range(count)]
            content.append({"type": "text", "text": question})
            out.append({"role": "user", "content": content})
            if answer is not None:
                out.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        return out

    def processed(self, images: list[Image.Image], messages: list[dict[str, Any]]) -> Any:
        """A conversation rendered with the chat template, through the processor (its ids are
        the pipeline's on either engine: vLLM's oracle has no transformers model)."""
        text = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        pictures = {"images": [images]} if images else {}
        return self.processor(text=[text], return_tensors="pt", **pictures)

    def inputs(self, images: list[Image.Image], messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The model's inputs for a conversation (`processed`), on the model's device."""
        inputs = self.processed(images, messages)
        device = self.model.device
        return {
            k: v.to(device, self.model.dtype) if v.is_floating_point() else v.to(device)
            for k, v in inputs.items()
        }

    def answer(
        self,
        images: list[Image.Image],
        messages: list[dict[str, Any]],
        max_new_tokens: int,
    ) -> str:
        """Answer one conversation greedily, from scratch."""
        return self.greedy(images, messages, max_new_tokens).text

    def greedy(
        self, images: list[Image.Image], messages: list[dict[str, Any]], max_new_tokens: int
    ) -> Greedy:
        """Answer greedily from scratch, keeping each step's most likely tokens (the oracle
        for devices where near-ties may break either way: bf16 on a GPU)."""
        import torch

        inputs = self.inputs(images, messages)
        # The model's own generation config with these settings, passed whole: generate given
        # none checks the model's config for generation settings first, building a default
        # config for it each call (a third of this tiny model's time), and answers the same.
        settings = copy.deepcopy(self.model.generation_config)
        settings.update(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=settings)
        generated = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        top = [scores[0].topk(TOP_K).indices.tolist() for scores in out.scores]
        text = self.processor.tokenizer.decode(generated, skip_special_tokens=True)
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        while generated and generated[-1] in eos_ids:  # the kit's tokens hold no EOS
            generated.pop()
        return Greedy(generated, top, text)

    @staticmethod
    def from_openai(
        messages: list[dict[str, Any]], images: dict[str, Image.Image]
    ) -> tuple[list[dict[str, Any]], list[Image.Image]]:
        """Write an OpenAI-style chat in the chat template's format: each `image_url` part
        becomes an image, the picture `images[url]`, in the order they come."""
        converted, pictures = [], []
        for message in messages:
            content = message.get("content") or ""
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            out = []
            for part in parts:
                if part["type"] == "image_url":
                    pictures.append(images[part["image_url"]["url"]])
                    out.append({"type": "image"})
                else:
                    out.append({"type": "text", "text": part["text"]})
            converted.append({"role": message["role"], "content": out})
        return converted, pictures

    def chat_answer(
        self, messages: list[dict[str, Any]], images: dict[str, Image.Image], max_new_tokens: int
    ) -> str:
        """Answer an OpenAI-style chat as transformers would."""
        converted, pictures = self.from_openai(messages, images)
        return self.answer(pictures, converted, max_new_tokens)

    def answers(
        self,
        image: Image.Image,
        prompts: list[str],
        max_new_tokens: int,
        system_prompt: str | None = None,
        *,
        history: bool = True,
        added: dict[int, Image.Image] | None = None,
    ) -> list[str]:
        """Answer each prompt in turn, each from the whole conversation so far.

        `added[i]` is an image sent with prompt i, joining the conversation from then on.
        """
        added = added or {}
        past: list[tuple[str, str]] = []
        answers = []
        for i, prompt in enumerate(prompts):
            if history:
                counts = [1 + (0 in added)] + [int(j in added) for j in range(1, i + 1)]
                images = [image] + [added[j] for j in range(i + 1) if j in added]
                messages = self.messages(system_prompt, past, prompt, counts)
            else:
                images, messages = [image], self.messages(system_prompt, [], prompt)
            answer = self.answer(images, messages, max_new_tokens)
            if history:
                past.append((prompt, answer))
            answers.append(answer)
        return answers


TOP_K = 5


@dataclass
class Greedy:
    """The pipeline's greedy answer: its tokens, each step's top tokens, and its text."""

    tokens: list[int]
    top: list[list[int]]
    text: str

    def assert_close(self, tokens: list[int], where: str = "") -> None:
        """Assert an answer is the pipeline's up to a near-tie, as vLLM's
        `check_logprobs_close`: equal tokens, until the first difference, where the other
        token must be among the pipeline's top ones at that step; past it the two answers go
        on from different tokens and are not compared."""
        for i, (mine, theirs) in enumerate(zip(tokens, self.tokens, strict=False)):
            if mine != theirs:
                assert mine in self.top[i], (
                    f"{where}: token {i} is {mine}, not among the pipeline's top {TOP_K} "
                    f"{self.top[i]} (its answer: {self.text!r})"
                )
                return
        assert len(tokens) == len(self.tokens), f"{where}: {tokens} against {self.tokens}"

    def assert_text_close(self, text: str, tokenizer: Any, where: str = "") -> None:
        """`assert_close` for an answer known by its text alone (through a server), compared
        in text space: the pipeline's tokens are decoded one more at a time until the kit's
        text no longer carries them; there, the kit's token must be one of the pipeline's top
        ones (at that step, or at any step of the UTF-8 byte run it ends). Re-tokenizing the
        kit's text instead would compare other ids (a first word gains the tokenizer's
        word marker, a cut byte-fallback character becomes U+FFFD's bytes, pieces re-merge)."""
        if text == self.text:
            return

        def shown(ids: list[int]) -> str:  # a trailing U+FFFD may be a byte run not yet whole
            return str(tokenizer.decode(ids, skip_special_tokens=True)).rstrip("\ufffd")

        tokens, steps = self.tokens, len(self.top)
        left = next(
            (i for i in range(len(tokens)) if not text.startswith(shown(tokens[: i + 1]))),
            len(tokens),
        )
        assert left < steps, f"{where}: {text!r} goes on past the pipeline's whole {self.text!r}"
        run = left  # where the byte run that ends at `left` begins: a tie may be at any byte
        while run > 0 and shown(tokens[: run - 1]) == shown(tokens[:left]):
            run -= 1
        for i in range(run, left + 1):
            chosen = tokens[i] if i < len(tokens) else self.top[i][0]  # past them: its end
            before = shown(tokens[:i])
            ties = (other for other in self.top[i] if other != chosen)
            if any(_carries(text, before, shown([*tokens[:i], other])) for other in ties):
                return
        raise AssertionError(
            f"{where}: the kit's text {text!r} leaves the pipeline's {self.text!r} at token "
            f"{left} with none of the pipeline's top {TOP_K} there {self.top[left]}"
        )


def _carries(text: str, before: str, after: str) -> bool:
    """Whether `text` can follow a token that turned the shown `before` into `after`: it
    starts with `after`, where the token showed something; a token that shows nothing (the
    end of the answer, or a byte of a character not yet whole) fits an answer that ends
    there or goes on with a character beyond ASCII."""
    if after != before:
        return text.startswith(after)
    rest = text[len(before) :] if text.startswith(before) else None
    return rest is not None and (not rest or not rest[0].isascii())


def assert_conversation(
    reference: Any,
    picture: Any,
    prompts: list[str],
    answers: list[Any],
    tokens: int,
    where: str = "",
    *,
    system_prompt: str | None = None,
) -> None:
    """Each answer (a turn, or a text) is the pipeline's on the conversation the kit had, up to
    a near-tie (`Greedy.assert_close`); `reference` is a `Reference` or one with its `greedy`,
    `messages` and `processor`."""
    past: list[tuple[str, str]] = []
    for n, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        messages = reference.messages(system_prompt, past, prompt)
        greedy = reference.greedy([picture], messages, tokens)
        if isinstance(answer, str):  # through a server: the text only
            text = answer
            greedy.assert_text_close(text, reference.processor.tokenizer, f"{where} turn {n + 1}")
        else:
            text = answer.text
            greedy.assert_close(answer.generated, f"{where} turn {n + 1}")
        past.append((prompt, text))


def _load_processor(checkpoint: Path) -> Any:
    """Load a checkpoint's processor; without torchvision, OneVision's leaves out its video part."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    config = json.loads((checkpoint / "processor_config.json").read_text())
    if is_torchvision_available() or config["processor_class"] != "LlavaOnevisionProcessor":
        return AutoProcessor.from_pretrained(checkpoint)
    from transformers import LlavaOnevisionProcessor

    class NoVideo(LlavaOnevisionProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    return NoVideo.from_pretrained(checkpoint)


Row = tuple[str, dict[str, Any], dict[str, str]]  # request id, body, headers


def serve_rows(service: Any, rows: list[Row], max_steps: int = 2000) -> dict[str, Any]:
    """Step an in-process SessionService until every row has its whole reply; return
    (status, JSON body) by request id (bodies go out on a request's first step only)."""
    from llava.server.service import Incoming

    bodies: dict[str, Any] = {}
    sent: set[str] = set()
    for _ in range(max_steps):
        waiting = [row for row in rows if row[0] not in bodies]
        if not waiting:
            return bodies
        batch = [
            Incoming(rid, None if rid in sent else json.dumps(body).encode(), headers)
            for rid, body, headers in waiting
        ]
        sent.update(rid for rid, _, _ in waiting)
        for (rid, _, _), reply in zip(waiting, service.step(batch), strict=True):
            if reply is not None:
                bodies[rid] = (reply.status, json.loads(reply.body))
    raise AssertionError("the service never answered")


class SeededImages:
    """`https://images.test/<seed>` loads `picture(seed)` (on the fetch threads)."""

    def __init__(self, picture: Callable[[int], Any] | None = None) -> None:
        self.picture = picture or make_image

    @staticmethod
    def decoder(data: Any) -> Any:  # `read` returns the image itself
        return data

    def read(self, ref: str) -> Any:
        return self.picture(int(ref.rsplit("/", 1)[1]))


# -- callables for image processes (module-level, so a spawned process can unpickle them) ----


def same(data: Any) -> Any:
    """A decoder for tests whose `read` returns the image itself."""
    return data


def pid_and(image: Any, earlier: list[Any]) -> tuple[int, Any, int]:
    """A preparer that tells which process ran it."""
    import os

    return os.getpid(), image, len(earlier)


def crash_on(data: Any) -> Any:
    """A decoder that kills its process on b"crash", as a decoder crashing on a hostile file."""
    import os

    if data == b"crash":
        os._exit(1)
    return data


class Unloadable:
    """A preparer that pickles but cannot be unpickled: an image process fails to start."""

    def __call__(self, image: Any, earlier: list[Any]) -> Any:
        return image

    def __reduce__(self) -> tuple[Any, ...]:
        return _refuse, ()


def _refuse() -> Any:
    raise RuntimeError("this preparer cannot be loaded here")


unloadable = Unloadable()


def chromium() -> str:
    """Debian's Chromium, which the browser tests drive (browsers cannot be downloaded here)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no chromium on PATH: apt-get install chromium (.ci/run does)")
    return path


def launch(app: Any) -> Iterator[str]:
    """Serve a Gradio app on a free loopback port for a test; yield its URL, close it after."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        app.close()


def in_private_network() -> bool:
    """Ray binds the machine's own address: its tests run only where `make test-ray` put them in
    a private network namespace holding only loopback."""
    return os.environ.get("LLAVA_NETNS") == "1"


def peak_bytes(run: Callable[[], object]) -> int:
    """Return the most bytes `run` held at once beyond what was allocated before it: the CPU
    allocator's running total at each allocation and free, as the profiler's trace records it,
    so a kernel's temporaries (allocated and freed inside one op) count too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        run()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        recorded.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    changes = [
        event["args"]
        for event in events
        if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0
    ]
    if not changes:
        return 0
    before = changes[0]["Total Allocated"] - changes[0]["Bytes"]
    return max(0, max(c["Total Allocated"] for c in changes) - before)


def step_all(engine: Any, turns: list[Any]) -> None:
    """Step turns together (their decodes batched) until every one is done; commit them
    (either engine: the contract's `step` and `finish_turn`)."""
    while not all(turn.done for turn in turns):
        assert engine.step(turns) == {}
    for turn in turns:
        engine.finish_turn(turn)


def centre_colour(image: Image.Image, shape: Shape) -> tuple[int, int, int]:
    """Return the pixel at a point inside a drawn shape (a triangle's lower middle)."""
    y = shape.y + (shape.size / 6 if shape.kind == "triangle" else 0)
    return image.getpixel((int(shape.x), int(y)))  # type: ignore[return-value]


STORE_SECRET = "a test endpoint's session-store secret"
STORE_SECRET_NAME = "llava/tests/session-store"


def store_secret_arn(endpoint_url: str) -> str:
    """The ARN of the shared store's secret in an AWS API server (moto's), made on first use as
    `deploy --session-store` makes it in Secrets Manager."""
    import boto3

    client = boto3.client(
        "secretsmanager",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        return str(client.describe_secret(SecretId=STORE_SECRET_NAME)["ARN"])
    except client.exceptions.ResourceNotFoundException:
        made = client.create_secret(Name=STORE_SECRET_NAME, SecretString=STORE_SECRET)
        return str(made["ARN"])


def stored_sessions(
    client: Any, bucket: str, store_uri: str, sids: Iterable[str], model: str = "llava"
) -> dict[str, str]:
    """Session id -> ETag of each of `sids` with an object in a shared store sealed with
    STORE_SECRET (objects are named by a MAC of the id, so a listing alone says whose they
    are to no one)."""
    _, names = _store_names(store_uri, sids, model)
    listing = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {names[o["Key"]]: o["ETag"] for o in listing if o["Key"] in names}


def only_tombstones(
    client: Any, bucket: str, store_uri: str, sids: Iterable[str], model: str = "llava"
) -> bool:
    """Whether every object in a shared store's bucket is the tombstone of one of `sids`: a
    closed session leaves one (no stale write can bring it back), and nothing else stays but
    parts (pictures of 64 KiB or more, shared by content: the bucket's lifecycle rule ends
    them, `llava/sessions/stored_parts.py`)."""
    from llava.sessions.objects import StoreLocation
    from llava.sessions.sealed import unseal

    key, names = _store_names(store_uri, sids, model)
    parts = StoreLocation.parse(store_uri).under(model).part_key("")
    for item in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        if item["Key"].startswith(parts):
            continue
        sid = names.get(item["Key"])
        if sid is None:
            return False
        data = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        if not unseal(key, sid, data).closed:
            return False
    return True


def _store_names(store_uri: str, sids: Iterable[str], model: str) -> tuple[bytes, dict[str, str]]:
    """A store's sealing key (STORE_SECRET's), and its object keys -> the ids they name."""
    from llava.sessions.objects import StoreLocation
    from llava.sessions.sealed import object_name, store_key

    location = StoreLocation.parse(store_uri).under(model)
    key = store_key(location.uri, STORE_SECRET)
    return key, {location.key(object_name(key, sid)): sid for sid in sids}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Poll what another process makes true (a store's writes land after the answers, a
    server's health follows its workers): nothing notifies a test of it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sagemaker_token(
    access_key: str, secret: str, region: str, *, expires: int = 43200, session: str | None = None
) -> str:
    """A bearer token from AWS's own generator (`sagemaker.core.token_generator`), signed with
    these credentials."""
    from datetime import timedelta

    from botocore.credentials import CredentialProvider, Credentials
    from sagemaker.core.token_generator import generate_token

    class Given(CredentialProvider):  # type: ignore[misc]
        def load(self) -> Credentials:
            return Credentials(access_key, secret, session)

    return str(generate_token(region, Given(), timedelta(seconds=expires)))
