"""Snapshots cut into parts stored once by content: the cut and the join are exact, a damaged or
swapped part is refused, and the shared store writes each picture once however many turns."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from safetensors.numpy import save as save_arrays
from test_shared_store import BUCKET, keys, raw, s3_url, shared  # noqa: F401 (fixture)

from llava.core.ids import new_session_id
from llava.sessions.parts import join, split
from llava.sessions.snapshots import CorruptSnapshot


def snapshot(turns: int, seed: int = 0) -> bytes:
    """A snapshot as the engines write one: a big picture array, small ids, text in the header."""
    rng = np.random.default_rng(seed)
    arrays = {
        "image.0": rng.integers(0, 255, 200_000, dtype=np.uint8),
        "ids": np.arange(40 * turns, dtype=np.int32),
    }
    return bytes(save_arrays(arrays, metadata={"llava": f'{{"history": {turns}}}'}))


def test_a_snapshot_is_cut_into_its_big_arrays_and_joined_back_exactly() -> None:
    data = snapshot(3)
    cut = split(data, min_bytes=64 * 1024)
    [(digest, part)] = cut.parts.items()
    assert digest == hashlib.sha256(part).hexdigest() and len(part) == 200_000
    assert len(cut.skeleton) < 2_000  # the ids, the header and the index
    assert join(cut.skeleton, cut.parts.__getitem__) == data
    for whole in (b"not a snapshot", b"", snapshot(1)):  # nothing big enough: kept whole
        kept = split(whole, min_bytes=10**9)
        assert kept.parts == {} and join(kept.skeleton, cut.parts.__getitem__) == whole
    # the same picture a turn later: the same part
    assert split(snapshot(4), min_bytes=64 * 1024).parts.keys() == cut.parts.keys()


def test_a_damaged_swapped_or_missing_part_is_refused() -> None:
    cut = split(snapshot(2), min_bytes=64 * 1024)
    [digest] = cut.parts
    other = split(snapshot(2, seed=1), min_bytes=64 * 1024)
    [(_, swapped)] = other.parts.items()
    flipped = bytearray(cut.parts[digest])
    flipped[7] ^= 1
    for wrong in (bytes(flipped), swapped, cut.parts[digest][:-1]):
        with pytest.raises(CorruptSnapshot, match="damaged"):
            join(cut.skeleton, lambda d, wrong=wrong: wrong)
    for bad in (b"LLSK\x01\xff\xff\xff\xff", cut.skeleton[:8] + b"x" + cut.skeleton[9:]):
        with pytest.raises(CorruptSnapshot):
            join(bad, cut.parts.__getitem__)
    whole = snapshot(2)  # written before parts existed: read as itself, the engine checks it
    assert join(whole, cut.parts.__getitem__) == whole


def test_the_store_writes_each_picture_once_and_a_missing_one_costs_that_session(
    s3_url: str,  # noqa: F811
) -> None:
    store = shared(s3_url, "parts")
    sid = new_session_id()
    sizes = []
    for turn in range(1, 5):
        before = store.stats()["bytes_written"]
        store.save(sid, lambda turn=turn: snapshot(turn), turn)
        assert store.flush(10)
        sizes.append(store.stats()["bytes_written"] - before)
    assert store.stats()["parts_written"] == 1  # the picture, once
    assert sizes[0] > 200_000 and max(sizes[1:]) < 2_500  # then a few KB a turn
    assert store.fetch(sid).result(10) == snapshot(4)
    [part_key] = [k for k in keys(s3_url, "parts/") if "/parts/" in k]
    digest = hashlib.sha256(split(snapshot(4)).parts.popitem()[1]).hexdigest()
    assert digest not in part_key  # named by a MAC: no one without the secret can tell it
    reader = shared(s3_url, "parts")  # another instance resumes it: the same bytes
    assert reader.fetch(sid).result(10) == snapshot(4)
    raw(s3_url).delete_object(Bucket=BUCKET, Key=part_key)
    with pytest.raises(CorruptSnapshot, match="no longer in the store"):
        shared(s3_url, "parts").fetch(sid).result(10)
    store.close()
    reader.close()
