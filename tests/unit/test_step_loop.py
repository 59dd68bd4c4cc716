"""The Ray front's step loop (llava/server/loop.py): a stream whose caller falls behind gets
the chunks that queued meanwhile as one, in order, so its lag never grows (issue 50)."""

from __future__ import annotations

import asyncio
import json

from llava.api.headers import STREAM_CONTENT_TYPE, stream_line
from llava.api.replies import Reply
from llava.server.loop import merge_queued


def chunk(text: str, last: bool = False, status: int = 200) -> Reply:
    headers = {"X-Step": text}
    body = stream_line({"text": text})
    return Reply(body, status, headers, STREAM_CONTENT_TYPE, last)


def queued(*replies: Reply) -> asyncio.Queue[Reply]:
    queue: asyncio.Queue[Reply] = asyncio.Queue()
    for reply in replies:
        queue.put_nowait(reply)
    return queue


def texts(reply: Reply) -> list[str]:
    return [json.loads(line)["text"] for line in reply.body.decode().splitlines()]


def test_chunks_queued_behind_a_slow_caller_go_as_one_in_order() -> None:
    behind = queued(chunk("b"), chunk("c"), chunk("d", last=True))
    merged = merge_queued(chunk("a"), behind)
    assert texts(merged) == ["a", "b", "c", "d"]
    assert merged.last is True  # the stream's end came along: the caller stops after it
    assert merged.headers == {"X-Step": "a"} and merged.status == 200  # the first chunk's head
    assert behind.empty()


def test_a_chunk_with_nothing_queued_goes_at_once_and_unchanged() -> None:
    first = chunk("a")
    assert merge_queued(first, queued()) is first


def test_merging_stops_at_the_streams_end() -> None:
    """What is queued after a stream's last chunk is not this stream's: it stays."""
    stray = chunk("x")
    behind = queued(chunk("b", last=True), stray)
    merged = merge_queued(chunk("a"), behind)
    assert texts(merged) == ["a", "b"] and merged.last is True
    assert behind.get_nowait() is stray


def test_a_whole_reply_is_never_merged() -> None:
    whole = Reply(b'{"text": "all"}')
    behind = queued(chunk("b"))
    assert merge_queued(whole, behind) is whole and behind.qsize() == 1
