"""Model data on S3: upload an unpacked archive under a prefix, delete a prefix."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llava.tools.deploy.aws import aws_client
from llava.tools.deploy.errors import DeployError
from llava.tools.deploy.names import parse_s3_uri
from llava.tools.deploy.progress import (
    ByteProgress,
    default_byte_progress,
    human_bytes,
    print_stderr,
)

MULTIPART_BYTES = 64 * 1024 * 1024


def upload_archive(
    archive_dir: str | Path,
    s3_uri: str,
    *,
    s3_client: Any = None,
    progress: ByteProgress | None = None,
    transfer_config: Any = None,
) -> str:
    """Upload an unpacked TorchServe archive (or the Ray image's model package, with its
    config.yaml) under an S3 prefix; return the prefix URI.

    Every file of `archive_dir` lands at `s3://bucket/prefix/<relative path>`, uncompressed,
    which is what SageMaker's `S3DataType=S3Prefix, CompressionType=None` copies to
    /opt/ml/model. Files above 64 MiB go up in parallel multipart chunks. `progress(done, total)`
    receives bytes uploaded so far (from several threads; calls are serialized); by default a
    progress bar goes to stderr.

    The prefix must not hold objects outside the archive: SageMaker would copy them into
    /opt/ml/model too and serve a mix of two archives. Objects with the same keys are replaced.
    """
    root = Path(archive_dir)
    ray_package = (root / "config.yaml").is_file() and (root / "deployment.py").is_file()
    if not ray_package and not (root / "MAR-INF" / "MANIFEST.json").is_file():
        detail = "is not a directory" if not root.is_dir() else "has no MAR-INF/MANIFEST.json"
        raise DeployError(
            f"{root} {detail}: SageMaker needs an unpacked TorchServe archive. Build one with "
            "`python -m llava archive --format no-archive --out model-store` (the archive is "
            "model-store/llava), not a .mar or .tar.gz; for the Ray image, `python -m llava "
            "package-ray`"
        )
    bucket, prefix = parse_s3_uri(s3_uri)
    s3 = aws_client("s3", s3_client)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    keys = {prefix + p.relative_to(root).as_posix(): p for p in files}

    stale: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        stale.extend(o["Key"] for o in page.get("Contents", []) if o["Key"] not in keys)
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        raise DeployError(
            f"s3://{bucket}/{prefix} already holds objects that are not part of this archive "
            f"({shown}): SageMaker would copy them into /opt/ml/model as well. Upload to an "
            f"empty prefix, or empty this one first (aws s3 rm --recursive s3://{bucket}/{prefix})"
        )

    total = sum(p.stat().st_size for p in files)
    label = "upload"
    print_stderr(
        f"uploading {len(files)} files ({human_bytes(total)}) from {root} to s3://{bucket}/{prefix}"
    )
    close: Callable[[], None] = lambda: None  # noqa: E731
    if progress is None:
        progress, close = default_byte_progress(total, label)
    if transfer_config is None:
        from boto3.s3.transfer import TransferConfig

        transfer_config = TransferConfig(
            multipart_threshold=MULTIPART_BYTES,
            multipart_chunksize=MULTIPART_BYTES,
            max_concurrency=8,
        )
    lock = threading.Lock()
    done = [0]

    def callback(n: int) -> None:
        with lock:
            done[0] += n
            progress(done[0], total)

    try:
        progress(0, total)
        for key, path in keys.items():
            s3.upload_file(str(path), bucket, key, Config=transfer_config, Callback=callback)
    finally:
        close()
    return f"s3://{bucket}/{prefix}"


def delete_s3_prefix(s3_uri: str, *, s3_client: Any = None) -> int:
    """Delete every object under an S3 prefix (never a whole bucket); return how many."""
    bucket, prefix = parse_s3_uri(s3_uri)
    s3 = aws_client("s3", s3_client)
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(objects), 1000):
            batch = objects[i : i + 1000]
            answer = s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise DeployError(
                    f"could not delete s3://{bucket}/{first.get('Key')}: {first.get('Message')}"
                )
            count += len(batch)
    return count
