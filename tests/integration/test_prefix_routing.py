"""Header-less chats across two real TorchServes behind the local SageMaker runtime, routed
prefix-aware as an endpoint deployed with `--routing prefix-aware` is: through boto3's
InvokeEndpoint and through SageMaker's OpenAI-compatible path with the openai SDK and LangChain
(bearer tokens as AWS's generator makes them). Every follow-up must find its conversation's
earlier turns cached, as a sticky session does, and answer as the pipeline does; routed by
least-outstanding instead, the same chats miss."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import httpx
import openai
import pytest
from botocore.config import Config
from engine_under_test import least_reused, oracle
from helpers import data_uri, make_image, sagemaker_token

from llava.fronts.local_runtime.prefix import PREFIX_AWARE_ID_HEADER, PrefixAware
from llava.fronts.local_runtime.server import LocalRuntime

pytestmark = pytest.mark.integration

TOKENS = 8
QUESTIONS = ["What is in the picture?", "Which colours?", "Anything else?"]
KEYS = {"test": "test"}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return oracle(tiny_checkpoint)


@pytest.fixture(scope="module")
def instances(server_pair):
    return [ts.url() for ts in server_pair]


@pytest.fixture(scope="module")
def runtime(instances) -> Iterator[LocalRuntime]:
    routing = PrefixAware(prefix_length=1024, concurrency_threshold=8)
    with LocalRuntime(instances, prefix_aware=routing, credentials=KEYS) as rt:
        yield rt


def boto3_client(url: str) -> Any:
    config = Config(retries={"total_max_attempts": 1})
    return boto3.client(
        "sagemaker-runtime",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=config,
    )


def messages(url: str, past: list[tuple[str, str]], question: str) -> list[dict[str, Any]]:
    """A chat as clients send it: the whole conversation again, the picture in the first turn."""
    out: list[dict[str, Any]] = []
    for i, (asked, answer) in enumerate([*past, (question, "")]):
        picture = {"type": "image_url", "image_url": {"url": url}}
        content: Any = [picture, {"type": "text", "text": asked}] if i == 0 else asked
        out.append({"role": "user", "content": content})
        if answer:
            out.append({"role": "assistant", "content": answer})
    return out


def invoke_chats(smr: Any, seeds: list[int], reference: Any) -> float:
    """Three turns of each chat, interleaved, through InvokeEndpoint with no session id: the
    share of follow-ups that found their conversation's last turn cached."""
    pictures = {seed: make_image(seed) for seed in seeds}
    past: dict[int, list[tuple[str, str]]] = {seed: [] for seed in seeds}
    asked: dict[int, int] = {}
    reused = 0
    for question in QUESTIONS:
        for seed in seeds:
            body = {
                "model": "llava",
                "messages": messages(data_uri(pictures[seed]), past[seed], question),
                "max_tokens": TOKENS,
                "temperature": 0,
            }
            out = smr.invoke_endpoint(
                EndpointName="llava", Body=json.dumps(body), ContentType="application/json"
            )
            assert "NewSessionId" not in out
            completion = json.loads(out["Body"].read())
            usage = completion["usage"]
            if seed in asked:
                reused += usage["prompt_tokens_details"]["cached_tokens"] >= least_reused(
                    asked[seed]
                )
            asked[seed] = usage["prompt_tokens"]
            past[seed].append((question, completion["choices"][0]["message"]["content"]))
    for seed in seeds:
        prompts = [question for question, _ in past[seed]]
        assert [a for _, a in past[seed]] == reference.answers(pictures[seed], prompts, TOKENS)
    return reused / (len(seeds) * (len(QUESTIONS) - 1))


def test_invoke_endpoint_chats_reach_their_cached_turns_as_sticky_sessions_do(
    runtime, instances, reference
):
    prefix_aware = invoke_chats(boto3_client(runtime.url), [401, 402, 403], reference)
    with LocalRuntime(instances) as least_outstanding:
        spread = invoke_chats(boto3_client(least_outstanding.url), [411, 412, 413], reference)
    print(
        f"follow-ups reaching their cached turns: prefix-aware {prefix_aware:.0%}, "
        f"least-outstanding {spread:.0%}"
    )
    assert prefix_aware == 1.0 > spread


def openai_client(runtime: LocalRuntime, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{runtime.url}/endpoints/llava/openai/v1",
        api_key=sagemaker_token("test", "test", "us-east-1"),
        max_retries=0,
        **kwargs,
    )


def test_openai_sdk_chats_on_the_openai_path_reach_their_cached_turns(runtime, reference):
    """Each chat opens with the same words (its picture is not text), so each user names
    itself with a prefix-aware id, as docs/sagemaker.md advises; one turn is streamed."""
    pictures = {seed: make_image(seed) for seed in (421, 422, 423)}
    clients = {
        seed: openai_client(runtime, default_headers={PREFIX_AWARE_ID_HEADER: f"user-{seed}"})
        for seed in pictures
    }
    past: dict[int, list[tuple[str, str]]] = {seed: [] for seed in pictures}
    cached: dict[int, list[int]] = {seed: [] for seed in pictures}
    asked: dict[int, list[int]] = {seed: [] for seed in pictures}
    for turn, question in enumerate(QUESTIONS):
        for seed, picture in pictures.items():
            chat = messages(data_uri(picture), past[seed], question)
            create = clients[seed].chat.completions.create
            if turn == 1:  # server-sent events, relayed as they arrive
                chunks = list(
                    create(
                        model="llava",
                        messages=chat,  # type: ignore[arg-type]
                        max_tokens=TOKENS,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                reply = create(
                    model="llava",
                    messages=chat,  # type: ignore[arg-type]
                    max_tokens=TOKENS,
                    temperature=0,
                )
                text, usage = reply.choices[0].message.content or "", reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached[seed].append(usage.prompt_tokens_details.cached_tokens or 0)
            asked[seed].append(usage.prompt_tokens)
            past[seed].append((question, text))
    for seed, picture in pictures.items():
        assert [a for _, a in past[seed]] == reference.answers(picture, QUESTIONS, TOKENS)
        for turn in (1, 2):
            assert cached[seed][turn] >= least_reused(asked[seed][turn - 1]), (cached, asked)


def test_langchain_on_the_openai_path_holds_a_chat(runtime, reference):
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    picture = make_image(431)
    url = data_uri(picture)
    llm = ChatOpenAI(
        model="llava",
        base_url=f"{runtime.url}/endpoints/llava/openai/v1",
        api_key=sagemaker_token("test", "test", "us-east-1"),  # type: ignore[arg-type]
        default_headers={PREFIX_AWARE_ID_HEADER: "langchain-user"},
        temperature=0,
        max_tokens=TOKENS,  # type: ignore[call-arg]
        max_retries=0,
    )
    picture_part = {"type": "image_url", "image_url": {"url": url}}
    history: list[Any] = [
        HumanMessage(content=[picture_part, {"type": "text", "text": QUESTIONS[0]}])
    ]
    answers, cached = [], []
    for question in [*QUESTIONS[1:], None]:
        reply = llm.invoke(history)
        answers.append(reply.content)
        cached.append(reply.usage_metadata["input_token_details"].get("cache_read", 0))
        if question is not None:
            history += [AIMessage(content=reply.content), HumanMessage(content=question)]
    assert answers == reference.answers(picture, QUESTIONS, TOKENS)
    assert cached[0] == 0 < cached[1] <= cached[2]


def test_the_openai_path_takes_only_a_valid_bearer_token(runtime):
    chat = messages(data_uri(make_image(441)), [], QUESTIONS[0])
    for api_key, error in [
        ("sk-not-a-sagemaker-token", openai.PermissionDeniedError),
        (sagemaker_token("test", "wrong", "us-east-1"), openai.PermissionDeniedError),
        (sagemaker_token("test", "test", "eu-west-1"), openai.PermissionDeniedError),
    ]:
        client = openai.OpenAI(
            base_url=f"{runtime.url}/endpoints/llava/openai/v1", api_key=api_key, max_retries=0
        )
        with pytest.raises(error, match="bearer token is not valid"):
            client.chat.completions.create(model="llava", messages=chat)  # type: ignore[arg-type]
    url = f"{runtime.url}/endpoints/llava/openai/v1/chat/completions"
    no_token = httpx.post(url, json={"model": "llava", "messages": chat}, timeout=30)
    assert no_token.status_code == 401
    assert "Authorization: Bearer" in no_token.json()["error"]["message"]
    bad = openai_client(runtime).chat.completions.with_raw_response.create
    with pytest.raises(openai.BadRequestError) as refused:  # the container's 400, as is
        bad(model="llava", messages=chat, n=2)  # type: ignore[arg-type]
    assert refused.value.response.json()["error"]["field"] == "n"
