"""Write a checkpoint's weights in llava-hf's hub layout, which every loader reads.

transformers 5's `save_pretrained` names the vision tower's weights `vision_tower.<layer>...`;
the checkpoints on the Hugging Face hub (llava-hf/*) name them `vision_tower.vision_model.<layer>`.
transformers loads both alike, vLLM only the hub's ("There is no module or parameter named
'vision_tower.embeddings'"), so the kit's checkpoints are written the hub's way.
"""

from __future__ import annotations

import json
from pathlib import Path

TOWER = "vision_tower."
INNER = "vision_model."


def hub_key(key: str) -> str:
    """Return a weight's name in the hub layout (`vision_tower.vision_model.X`)."""
    head, tower, rest = key.partition(TOWER)
    if not tower or head not in ("", "model.") or rest.startswith(INNER):
        return key
    return f"{head}{TOWER}{INNER}{rest}"


def to_hub_layout(directory: str | Path) -> int:
    """Rename the vision tower's weights in every safetensors file (and the shard index) of a
    checkpoint directory, in place; return how many were renamed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(directory)
    renamed = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
            tensors = {hub_key(k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            renamed += sum(hub_key(k) != k for k in f.keys())  # noqa: SIM118
        mode = path.stat().st_mode & 0o777
        save_file(tensors, path, metadata={"format": "pt", **metadata})
        path.chmod(mode)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {hub_key(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2) + "\n")
    return renamed
