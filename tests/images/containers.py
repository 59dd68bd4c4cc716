"""Docker for the image tests: the daemon (Debian's docker.io, started here with no bridge), the
images built from the repo's Dockerfiles on the stand-in base, containers run as SageMaker
runs them (`docker run IMAGE serve`, the model data read-only at /opt/ml/model, no network but
their own loopback, reached through `relay.publish`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
from relay import Relay, publish

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {"torchserve": REPO / "Dockerfile", "ray": REPO / "docker" / "ray" / "Dockerfile"}
# Each (front, engine) image: ENGINE as users build it, vLLM's CPU build of the locked release
# in place of its GPU wheel (VLLM_BUILD=cpu: the same install path, docker/install_kit.sh).
IMAGES = [
    ("torchserve", "transformers"),
    ("torchserve", "vllm"),
    ("ray", "transformers"),
    ("ray", "vllm"),
]
# vLLM's CPU build always runs its multiprocess executor, whose shared-memory queues take 400
# MiB of /dev/shm (240 MiB of it fixed in vLLM 0.32); Docker gives a container 64 MiB. Its GPU
# wheel at one GPU per engine runs the executor inside the engine core and needs none.
VLLM_CPU_SHM = "1g"
# What a SageMaker model's Environment would set for vLLM on this CPU machine: the test
# checkpoints' settings (eager, float32, a context of 1,024) and a quarter-GiB KV cache.
VLLM_CPU_ENV = {
    "LLAVA_DTYPE": "float32",
    "LLAVA_ENFORCE_EAGER": "true",
    "LLAVA_MAX_CONTEXT_TOKENS": "1024",
    "LLAVA_KV_CACHE_GB": "0.25",
}


def docker(*args: str, timeout: float = 300, check: bool = True) -> str:
    """Run a docker command; return its stdout (raising with its stderr if it fails)."""
    run = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and run.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])} failed ({run.returncode}): {run.stderr}")
    return run.stdout


def daemon_up() -> bool:
    return (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    )


def start_daemon(log: Path) -> subprocess.Popen[bytes]:
    """Start Debian's dockerd with no bridge network (containers run on `--network none`)."""
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise RuntimeError("no dockerd: apt-get install docker.io (.ci/run does)")
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [dockerd, "--bridge=none", "--iptables=false", "--ip-masq=false"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while not daemon_up():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("dockerd did not start:\n" + log.read_text()[-3000:])
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(0.5)
    return process


def build_env() -> dict[str, str]:
    """The classic builder where the buildx plugin is missing (Debian's docker.io has none)."""
    env = dict(os.environ)
    if subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"
    return env


def standin() -> str:
    """Build (or find) the stand-in base; return its tag. Progress goes to stderr."""
    run = subprocess.run(
        [str(REPO / "docker" / "standin" / "build.sh")],
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        env=build_env(),
        timeout=1800,
        check=True,
    )
    return run.stdout.strip().splitlines()[-1]


def build_image(front: str, engine: str, base: str) -> tuple[str, float]:
    """Build one image from the repo's Dockerfile; return its tag and the seconds it took."""
    tag = f"llava-sessions-test/{front}-{engine}:latest"
    started = time.monotonic()
    subprocess.run(
        [
            "docker",
            "build",
            "--network",
            "host",
            "-f",
            str(DOCKERFILES[front]),
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            f"ENGINE={engine}",
            "--build-arg",
            "VLLM_BUILD=cpu",
            "-t",
            tag,
            str(REPO),
        ],
        stdout=sys.stderr,
        stderr=sys.stderr,
        env=build_env(),
        timeout=3600,
        check=True,
    )
    return tag, time.monotonic() - started


def image_size(tag: str) -> int:
    return int(docker("image", "inspect", "-f", "{{.Size}}", tag).strip())


class Container:
    """One container run as SageMaker runs it: `docker run IMAGE serve` on `--network none`,
    the model data mounted read-only at /opt/ml/model, no AWS variables."""

    def __init__(
        self, image: str, model: Path, name: str, engine: str, env: dict[str, str] | None = None
    ):
        self.image, self.model, self.name = image, model, name
        vllm = engine == "vllm"  # vLLM's CPU build: its settings here, and a larger /dev/shm
        self.env = {**(VLLM_CPU_ENV if vllm else {}), **(env or {})}
        self.shm = ["--shm-size", VLLM_CPU_SHM] if vllm else []
        self.relay: Relay | None = None

    def start(self) -> Container:
        docker("rm", "-f", self.name, check=False)
        flags = [f"--env={k}={v}" for k, v in self.env.items()]
        docker(
            "run",
            "-d",
            "--name",
            self.name,
            "--network",
            "none",
            "--volume",
            f"{self.model}:/opt/ml/model:ro",
            *self.shm,
            *flags,
            self.image,
            "serve",
        )
        pid = int(docker("inspect", "-f", "{{.State.Pid}}", self.name).strip())
        self.relay = publish(pid, 8080)
        return self

    @property
    def url(self) -> str:
        assert self.relay is not None, "start the container first"
        return f"http://127.0.0.1:{self.relay.port}"

    def state(self) -> dict[str, object]:
        return dict(json.loads(docker("inspect", "-f", "{{json .State}}", self.name)))

    def logs(self) -> str:
        run = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True)
        return (run.stdout + run.stderr)[-6000:]

    def wait_healthy(self, timeout_s: float = 600) -> float:
        """Poll /ping until 200; return the seconds it took (failing if the container exits)."""
        started = time.monotonic()
        with httpx.Client(timeout=2) as client:
            while time.monotonic() - started < timeout_s:
                if not self.state()["Running"]:
                    raise AssertionError(f"{self.name} exited:\n{self.logs()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/ping").status_code == 200:
                        return time.monotonic() - started
                time.sleep(0.25)  # a poll interval, not a synchronisation
        raise AssertionError(f"{self.name} never became healthy:\n{self.logs()}")

    def stop(self, grace_s: int = 30) -> tuple[int, float]:
        """`docker stop -t grace_s` (SIGTERM, then SIGKILL); return the exit code and seconds."""
        started = time.monotonic()
        docker("stop", "-t", str(grace_s), self.name, timeout=grace_s + 60)
        took = time.monotonic() - started
        return int(self.state()["ExitCode"]), took  # type: ignore[call-overload]

    def remove(self) -> None:
        if self.relay is not None:
            self.relay.close()
        docker("rm", "-f", self.name, check=False)
