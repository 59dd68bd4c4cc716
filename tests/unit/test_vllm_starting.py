"""vLLM's start-up settings that need no vLLM: its message queues fitted to /dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest

from llava.engines.vllm import starting
from llava.engines.vllm.starting import QUEUE_CHUNKS, fit_queues_to_shm, queue_chunk_mb

MiB = 2**20


def test_a_container_s_64_mib_of_shm_gets_chunks_that_fit_in_half_of_it() -> None:
    chunk = queue_chunk_mb(64 * MiB)
    assert chunk is not None and chunk * QUEUE_CHUNKS * MiB <= 32 * MiB
    assert queue_chunk_mb(1 * MiB) == 1  # never 0: vLLM needs a chunk


def test_where_vllm_s_default_fits_it_is_left_alone() -> None:
    assert queue_chunk_mb(64 * 1024 * MiB) is None
    assert queue_chunk_mb(2 * QUEUE_CHUNKS * 16 * MiB) is None


def test_the_setting_is_applied_unless_the_user_set_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", raising=False)
    usage = starting.shutil._ntuple_diskusage(64 * MiB, 0, 64 * MiB)  # type: ignore[attr-defined]
    monkeypatch.setattr(starting.shutil, "disk_usage", lambda path: usage)
    fit_queues_to_shm(tmp_path)
    assert starting.os.environ["VLLM_MQ_MAX_CHUNK_BYTES_MB"] == str(queue_chunk_mb(64 * MiB))
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "8")
    fit_queues_to_shm(tmp_path)
    assert starting.os.environ["VLLM_MQ_MAX_CHUNK_BYTES_MB"] == "8"
