"""Build the TorchServe model archive: resolve the weights, then run torch-model-archiver.

The model source is resolved at archive time, never at worker start: `shapes` (the default: the
tiny LLaVA trained here and committed under `models/shapes`), a random-weight profile such as
`tiny` (generated offline), a local checkpoint directory, or a Hugging Face id such as
`llava-hf/llava-1.5-7b-hf` (downloaded with huggingface_hub, with a progress bar).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from llava.core.families import checkpoint_family
from llava.core.paths import CHECKOUT
from llava.tools.tiny.profiles import PROFILES

log = logging.getLogger(__name__)

ROOT = CHECKOUT
HANDLER = ROOT / "handler" / "llava_handler.py"
MODEL_CONFIG = ROOT / "handler" / "model-config.yaml"
# Trained checkpoints shipped in the repository, by name; the other profiles are random weights.
TRAINED = {"shapes": ROOT / "models" / "shapes"}
BUILTIN_PROFILES = tuple(name for name in PROFILES if name not in TRAINED)
# Only what from_pretrained needs: skips the .bin duplicates and training files many repos hold.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `--model` and `--cache-dir` options every archive-building command takes."""
    parser.add_argument(
        "--model",
        default="shapes",
        help="shapes (trained here, sees drawn shapes) | tiny | llava15 (random weights) | a "
        "checkpoint directory | a Hugging Face id such as llava-hf/llava-1.5-7b-hf "
        "(default: shapes)",
    )
    parser.add_argument("--cache-dir", default="build/models", help="where checkpoints go")


def resolve_model(source: str, cache_dir: str | Path = "build/models") -> Path:
    """Return a local checkpoint directory for `source`, building or downloading it if needed
    (absolute: it is handed to processes started elsewhere, e.g. Ray's replicas)."""
    cache_dir = Path(cache_dir).resolve()
    if source in TRAINED:
        if not (TRAINED[source] / "config.json").is_file():
            raise SystemExit(
                f"{TRAINED[source]} holds no checkpoint: re-train it with "
                "`python -m llava.tools.tiny.train`"
            )
        return TRAINED[source]
    if source in BUILTIN_PROFILES:
        from llava.tools.tiny import build_checkpoint

        target = cache_dir / source
        if not (target / "config.json").is_file():
            print(f"building the random-weight '{source}' checkpoint in {target}", file=sys.stderr)
            build_checkpoint(target, profile=source, overwrite=True)
        return target
    local = Path(source).expanduser().resolve()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise SystemExit(f"{local} is not a checkpoint directory (no config.json)")
        return local
    if source.count("/") != 1 or source.startswith((".", "/")):
        raise SystemExit(
            f"model source {source!r} is neither a directory nor a Hugging Face id "
            "(owner/name, e.g. llava-hf/llava-1.5-7b-hf) nor one of "
            + ", ".join([*TRAINED, *BUILTIN_PROFILES])
        )
    from huggingface_hub import snapshot_download

    target = cache_dir / source.replace("/", "--")
    print(f"downloading {source} from the Hugging Face hub into {target}", file=sys.stderr)
    snapshot_download(repo_id=source, local_dir=target, allow_patterns=HUB_PATTERNS)
    return target


def build_archive(
    model_dir: str | Path,
    export_path: str | Path = "model-store",
    *,
    name: str = "llava",
    version: str = "1.0",
    archive_format: str = "no-archive",
    config_file: str | Path = MODEL_CONFIG,
) -> Path:
    """Run torch-model-archiver over a checkpoint; return the archive's path.

    A checkpoint of a family the kit does not serve is refused here, before anything is packed.
    """
    model_dir, export_path = Path(model_dir), Path(export_path)
    check_checkpoint(model_dir)
    export_path.mkdir(parents=True, exist_ok=True)
    archiver = shutil.which("torch-model-archiver") or str(
        Path(sys.executable).parent / "torch-model-archiver"
    )
    cmd = [
        archiver,
        "--model-name",
        name,
        "--version",
        version,
        "--handler",
        str(HANDLER),
        "--config-file",
        str(config_file),
        "--extra-files",
        str(model_dir),  # copied flat into the model root: from_pretrained works
        "--export-path",
        str(export_path),
        "--archive-format",
        archive_format,
        "--force",
    ]
    print(f"archiving {model_dir} -> {export_path}/{name} ({archive_format})", file=sys.stderr)
    suffix = {"no-archive": "", "default": ".mar", "tgz": ".tar.gz"}.get(archive_format, "")
    target = export_path / f"{name}{suffix}"
    with subprocess.Popen(cmd) as proc:
        _show_progress(proc, target, _size(model_dir))
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return target


def check_checkpoint(model_dir: Path) -> None:
    """Refuse a directory that is not a checkpoint of a supported llava-hf family."""
    try:
        checkpoint_family(model_dir)
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def _show_progress(proc: subprocess.Popen, target: Path, total: int) -> None:
    """Report how much of the archive is written while the archiver runs (weights are big)."""
    from tqdm import tqdm

    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="archive",
        file=sys.stderr,
        disable=total < 64 * 1024 * 1024,
    ) as bar:
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            bar.update(max(0, min(total, _size(target)) - bar.n))
        bar.update(max(0, total - bar.n) if proc.returncode == 0 else 0)
