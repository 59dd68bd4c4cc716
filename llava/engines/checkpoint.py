"""A checkpoint as both engines read it: its processor (chat template, tokenizer, image
processor) and its identity, which tags every session snapshot."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import struct
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger(__name__)


# A checkpoint's small files that shape its answers (read whole), beside its weights (sampled).
IDENTITY_FILES = frozenset(
    {
        "config.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
        "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
        "added_tokens.json", "vocab.json", "merges.txt", "preprocessor_config.json",
        "processor_config.json",
    }
)  # fmt: skip
SAMPLE_BYTES = 64  # read at each tensor's start, middle and end
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
BLOCKS = 64  # a pickled weight file (no index of its tensors): evenly spaced blocks of 4 KiB


def model_fingerprint(model_dir: Path) -> str:
    """Identify a checkpoint by its small files and a sample of every weight tensor (its
    first, middle and last bytes), so fine-tunes of one base differ without reading
    gigabytes at start."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.name in IDENTITY_FILES:
            digest.update(f"{path.name};".encode() + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin"):
            total = path.stat().st_size
            digest.update(f"{path.name}:{total};".encode())
            with path.open("rb") as file:
                sample = _sample_safetensors if path.suffix == ".safetensors" else _sample_blocks
                for offset, size in sample(file, total):
                    digest.update(read_at(file, offset, size))
    return digest.hexdigest()[:32]


def read_at(file: BinaryIO, offset: int, size: int) -> bytes:
    file.seek(offset)
    return file.read(size)


def _sample_safetensors(file: BinaryIO, total: int) -> list[tuple[int, int]]:
    """Its header whole, then three short reads in each tensor (by the header's offsets)."""
    head = read_at(file, 0, 8)
    (length,) = struct.unpack("<Q", head) if len(head) == 8 else (total,)
    if length > min(total - 8, MAX_HEADER):  # a Git LFS pointer, a truncated download
        raise ValueError(f"{file.name} is not a whole safetensors file (its header says so)")
    header = json.loads(read_at(file, 8, length))
    spans = [(0, 8 + length)]
    for name in sorted(header):
        if name == "__metadata__":
            continue
        start, end = (8 + length + at for at in header[name]["data_offsets"])
        if not 8 + length <= start <= end <= total:
            raise ValueError(f"{file.name}: tensor {name} lies outside the file")
        for at in (start, (start + end) // 2, end - SAMPLE_BYTES):
            spans.append((max(start, at), min(SAMPLE_BYTES, end - start)))
    return spans


def _sample_blocks(file: BinaryIO, total: int) -> list[tuple[int, int]]:
    step = max(total // BLOCKS, 1)
    return [(at, 4096) for at in range(0, total, step)]


def load_processor(model_dir: Path) -> Any:
    """Load the checkpoint's processor through `AutoProcessor`, images only without torchvision.

    OneVision's processor also holds a video processor, which transformers builds only with
    torchvision installed (the SageMaker PyTorch image has it). Without it, the processor is
    built from the same files with its video part left out; images are processed identically.
    """
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    config_file = model_dir / "processor_config.json"
    name = (
        json.loads(config_file.read_text()).get("processor_class") if config_file.exists() else None
    )
    if is_torchvision_available() or name is None:
        return AutoProcessor.from_pretrained(model_dir)
    from transformers.models.auto.processing_auto import processor_class_from_name

    processor_class = processor_class_from_name(name)
    if processor_class is None or "video_processor" not in processor_class.get_attributes():
        return AutoProcessor.from_pretrained(model_dir)
    log.info("torchvision is not installed: %s is loaded without its video processor", name)
    return images_only(processor_class).from_pretrained(model_dir)


def images_only(processor_class: Any) -> Any:
    """Return a subclass of a multimodal processor class that has no video processor."""

    class ImagesOnly(processor_class):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return [a for a in super().get_attributes() if a != "video_processor"]

        def __reduce__(self) -> tuple[Any, ...]:  # image processes get a pickled copy
            real = (processor_class.__module__, processor_class.__qualname__)
            return _rebuild_images_only, (*real, self.__dict__)

    # Saved and logged under the real class's name, so a checkpoint it writes loads anywhere.
    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def _rebuild_images_only(module: str, qualname: str, state: dict[str, Any]) -> Any:
    """Unpickle a processor made by `images_only`."""
    cls = images_only(getattr(importlib.import_module(module), qualname))
    processor = cls.__new__(cls)
    processor.__dict__.update(state)
    return processor


def snapshot_meta(data: bytes, fmt: str | tuple[str, ...], fingerprint: str) -> dict[str, Any]:
    """Read a session snapshot's header (safetensors' JSON metadata, under "llava") and check
    it is `fmt` (or one of them) and of this model; raise ValueError otherwise (the arrays are
    the engine's)."""
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["llava"])
    except Exception as exc:
        raise ValueError(f"not a session snapshot: {exc}") from exc
    formats = fmt if isinstance(fmt, tuple) else (fmt,)
    if not isinstance(meta, dict) or meta.get("format") not in formats:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"unknown snapshot format {found!r}")
    if meta.get("model") != fingerprint:
        raise ValueError("the snapshot was taken with a different model")
    return meta
