"""Image processes: images are decoded and prepared (and, on a CPU, run through the vision
tower) in other processes, with their errors typed, a crashed process replaced, and no process
outliving its worker."""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import crash_on, data_uri, make_image, pid_and, same, unloadable

from llava.core.config import ServerConfig
from llava.core.errors import ImageError
from llava.engines.transformers import LlavaEngine
from llava.engines.transformers.model.loading import HOST
from llava.engines.transformers.model.vision import (
    as_bytes,
    from_bytes,
    image_features,
    process_images,
)
from llava.images import ImageLoader
from llava.images.background import BackgroundImages
from llava.images.processes import ImageProcesses
from llava.tools.tiny import build_checkpoint


class Bytes:
    """An image source whose `read` returns the reference's own bytes."""

    decoder = staticmethod(crash_on)

    def read(self, ref: str) -> bytes:
        return ref.encode()


def test_images_are_prepared_in_other_processes() -> None:
    processes = ImageProcesses(same, pid_and, 2)
    try:
        started = processes.start()
        pid, image, earlier = processes.run("a picture", ["an earlier one"])
        # One process may have answered every start-up call (then `started` repeats its pid)
        # while another takes the image: the image's process is one of this pool's children.
        children = {child.pid for child in multiprocessing.active_children()}
        assert pid != os.getpid() and pid in children and set(started) <= children
        assert (image, earlier) == ("a picture", 1)
    finally:
        processes.close()


def test_a_process_that_dies_is_replaced_and_only_its_image_fails() -> None:
    images = BackgroundImages(Bytes(), pid_and, threads=2, processes=1)
    assert images.processes is not None
    try:
        (first,) = images.processes.start()
        crashed = images.submit("crash")  # Bytes.read -> b"crash": the decoder exits, twice
        with pytest.raises(ImageError) as failed:
            crashed.result(timeout=120)
        assert failed.value.field == "image" and "stopped the process" in failed.value.message
        pid, image, _ = images.submit("fine").result(timeout=120)
        assert image == b"fine" and pid != first  # a new process took over
    finally:
        images.close()


def test_decode_errors_come_back_typed_and_naming_the_image() -> None:
    loader = ImageLoader()
    images = BackgroundImages(loader, pid_and, threads=1, processes=1)
    try:
        with pytest.raises(ImageError) as failed:
            images.submit("data:image/png;base64,bm90IGFuIGltYWdl").result(timeout=120)
        assert failed.value.code == "invalid_image" and failed.value.field == "image"
        pid, image, _ = images.submit(data_uri(make_image(1))).result(timeout=120)
        assert pid != os.getpid() and image.size == (48, 40) and image.mode == "RGB"
    finally:
        images.close()


def test_a_preparer_that_cannot_be_pickled_says_what_to_set() -> None:
    with pytest.raises(TypeError, match="image_processes: 0"):
        ImageProcesses(same, lambda image, earlier: image, 1)


def test_image_processes_exit_with_their_worker(tmp_path: Path) -> None:
    """A worker killed outright (kill -9) takes its image processes with it."""
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from helpers import pid_and, same
            from llava.images.processes import ImageProcesses
            if __name__ == "__main__":
                processes = ImageProcesses(same, pid_and, 2)
                print(*processes.start(), flush=True)
                time.sleep(600)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    worker = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert worker.stdout is not None
    children = [int(pid) for pid in worker.stdout.readline().split()]
    assert len(children) == 2
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    for pid in children:  # each watches its parent and exits
        try:
            exited = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # already gone
        try:
            readable, _, _ = select.select([exited], [], [], 30)
        finally:
            os.close(exited)
        assert readable, f"image process {pid} outlived its worker by 30 s"


def test_image_processes_start_where_tmpdir_is_too_deep_for_a_socket(tmp_path: Path) -> None:
    """`make serve` points TMPDIR into the checkout: in a deep one, the fork server's socket
    path would pass the 107 bytes a Unix socket takes, and every worker failed to start."""
    deep = tmp_path / ("a-checkout-folder-with-a-long-name-" * 3) / ".torchserve"
    deep.mkdir(parents=True)
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, tempfile
            from helpers import pid_and, same
            from llava.images.processes import ImageProcesses
            if __name__ == "__main__":
                processes = ImageProcesses(same, pid_and, 1)
                try:
                    image = processes.run("a picture", [])[1]
                    print(json.dumps([image, tempfile.gettempdir()]), flush=True)
                finally:
                    processes.close()
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(deep)}
    worker = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert json.loads(worker.stdout) == [
        "a picture",
        str(deep),
    ]  # the worker's own temporary files stay where TMPDIR says


@pytest.mark.parametrize("profile", ["llava15", "next", "onevision"])
def test_the_tower_in_an_image_process_gives_the_models_own_features(tmp_path, profile) -> None:
    checkpoint = build_checkpoint(tmp_path / profile, profile)
    engine = LlavaEngine.load(checkpoint, ServerConfig(device="cpu", step_token_budget=64))
    loader = ImageLoader()
    images = [make_image(7, (64, 48)), make_image(8, (40, 70))]
    processes = ImageProcesses(loader.decoder, engine.image_preparer(), 1)
    try:
        first = processes.run(loader.read(data_uri(images[0])))
        # A second image, with the first when the family encodes them jointly (OneVision).
        second = processes.run(loader.read(data_uri(images[1])), first.sources)
    finally:
        processes.close()
    model = engine.runner.replicas[0].model  # the model's own tower, in this process
    for prepared, together in ((first, images[:1]), (second, [*first.sources, images[1]])):
        assert prepared.features is not None and not prepared.processed.inputs
        processed = process_images(engine.runner.processor, together, engine.runner.image_token_id)
        assert prepared.processed.tokens == processed.tokens
        assert torch.equal(prepared.features, image_features(model, processed, HOST))


def test_processes_that_cannot_start_say_what_to_set() -> None:
    processes = ImageProcesses(same, unloadable, 1)
    try:
        with pytest.raises(RuntimeError, match="image_processes: 0"):
            processes.start(timeout_s=120)
    finally:
        processes.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(2, 3), (0, 4), (1,)])
def test_tensors_cross_as_plain_bytes_unchanged(dtype, shape) -> None:
    tensor = (torch.arange(int(torch.tensor(shape).prod())) * 3 - 1).reshape(shape).to(dtype)
    back = from_bytes(as_bytes(tensor))
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)
