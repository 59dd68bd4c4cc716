"""The model fingerprint that tags every snapshot: fine-tunes of one base (same config, same file
sizes) differ, files that do not shape answers do not count, and gigabytes are not read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from llava.engines import checkpoint
from llava.engines.checkpoint import model_fingerprint


def write_checkpoint(root: Path, tensors: dict[str, np.ndarray], template: str = "{{ x }}") -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (root / "chat_template.jinja").write_text(template)
    save_file(tensors, str(root / "model.safetensors"))
    return root


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((64, 48)).astype(np.float32) for name in ("a", "b", "c")}


def test_a_fine_tune_of_the_same_shape_has_another_fingerprint(tmp_path: Path) -> None:
    base = write_checkpoint(tmp_path / "base", weights())
    same = write_checkpoint(tmp_path / "same", weights())
    tuned_tensors = weights()
    tuned_tensors["b"] = tuned_tensors["b"] + np.float32(1e-3)  # one tensor perturbed
    tuned = write_checkpoint(tmp_path / "tuned", tuned_tensors)
    assert (tuned / "model.safetensors").stat().st_size == (
        base / "model.safetensors"
    ).stat().st_size
    assert model_fingerprint(base) == model_fingerprint(same)
    assert model_fingerprint(tuned) != model_fingerprint(base)


def test_a_new_chat_template_counts_and_the_servers_own_files_do_not(tmp_path: Path) -> None:
    base = write_checkpoint(tmp_path / "base", weights())
    other = write_checkpoint(tmp_path / "other", weights(), template="{{ y }}")
    assert model_fingerprint(other) != model_fingerprint(base)
    before = model_fingerprint(base)
    (base / "llava_handler.py").write_text("# the kit's handler, another release")
    (base / "model-config.yaml").write_text("minWorkers: 1\n")
    assert model_fingerprint(base) == before  # a kit upgrade keeps its sessions


def test_large_weights_are_sampled_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = {"w": np.zeros((4096, 2048), np.float32), "v": np.ones((1024,), np.float32)}  # 32 MiB
    root = write_checkpoint(tmp_path / "big", big)
    read: list[int] = []
    real = checkpoint.read_at
    monkeypatch.setattr(checkpoint, "read_at", lambda f, at, n: read.append(n) or real(f, at, n))
    model_fingerprint(root)
    assert 0 < sum(read) < 4096, read


def test_a_weight_file_that_is_not_whole_is_named_not_read(tmp_path: Path) -> None:
    """A Git LFS pointer or a truncated download named *.safetensors: a clear error naming the
    file (not a MemoryError from a header length of exabytes)."""
    root = write_checkpoint(tmp_path / "lfs", weights())
    (root / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match="model.safetensors is not a whole safetensors file"):
        model_fingerprint(root)
    cut = write_checkpoint(tmp_path / "cut", weights())
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="outside the file"):
        model_fingerprint(cut)
