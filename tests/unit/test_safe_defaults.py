"""Safe defaults, checked statically: loopback binding, unguessable ids, nothing logged."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from llava.core.ids import is_valid_session_id, new_session_id
from llava.fronts.torchserve.launcher import TorchServe

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llava"
ADDRESS_KEYS = ("inference_address", "management_address", "metrics_address")
GRPC_KEYS = ("grpc_inference_address", "grpc_management_address")


def properties(text: str) -> dict[str, str]:
    """Parse a Java .properties file the simple way TorchServe's files are written."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


def host_of(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


@pytest.mark.parametrize("source", ["repository", "launcher"])
def test_local_serving_binds_every_listener_to_loopback(source: str, tmp_path) -> None:
    if source == "repository":
        text = (ROOT / "config.properties").read_text()
    else:  # what the launcher writes for tests, the benchmark and the local runtime
        text = TorchServe(tmp_path / "store", workdir=tmp_path)._write_config().read_text()
    config = properties(text)
    for key in ADDRESS_KEYS:
        assert host_of(config[key]) == "127.0.0.1", (key, config[key])
    for key in GRPC_KEYS:  # TorchServe 0.12 always starts gRPC: it must stay local too
        assert config[key] == "127.0.0.1", (key, config[key])
    # The management API can register models only when asked to; it is not.
    assert config.get("enable_model_api", "false").lower() == "false"


def test_session_ids_are_unguessable() -> None:
    ids = {new_session_id() for _ in range(2000)}
    assert len(ids) == 2000
    for sid in list(ids)[:50]:
        assert len(sid) == 40 and int(sid, 16) >= 0  # 160 random bits, hex
        assert is_valid_session_id(sid)
    # Not from `random`'s generator: seeding it the same way twice gives different ids.
    random.seed(1234)
    first = new_session_id()
    random.seed(1234)
    assert new_session_id() != first


# -- what the kit logs ------------------------------------------------------------------------

LEVELS = {"info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}
LOGGERS = {"log", "logger", "logging", "LOG", "_log"}
# Names whose values are request content: prompts, images, image references, bodies.
SENSITIVE = {
    "prompt",
    "system_prompt",
    "image",
    "images",
    "ref",
    "url",
    "body",
    "text",
    "history",
    "request",
    "data",
    "content",
    "payload",
    "headers",
    "question",
    "answer",
    "delta",
}


def _names(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def log_calls() -> list[tuple[str, int, set[str]]]:
    """Every logging call at INFO or above in llava/, with the names its arguments use."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            if (
                node.func.attr in LEVELS
                and isinstance(receiver, ast.Name)
                and receiver.id in LOGGERS
            ):
                used = set().union(*(_names(a) for a in node.args[1:]), set())
                used |= set().union(*(_names(k.value) for k in node.keywords), set())
                calls.append((str(path.relative_to(ROOT)), node.lineno, used))
    return calls


def test_no_log_call_at_info_or_above_passes_request_content() -> None:
    calls = log_calls()
    assert len(calls) >= 10  # the audit sees the kit's log calls
    offenders = [(f, line, sorted(used & SENSITIVE)) for f, line, used in calls if used & SENSITIVE]
    assert not offenders, f"log calls passing request content: {offenders}"


WORKER_MODULES = [
    "fronts/torchserve/handler.py",
    "server/service.py",
    "server/opening.py",
    "sessions/store.py",
    "sessions/registry.py",
    "api/dispatch.py",
    "api/session_api.py",
    "api/openai.py",
]


@pytest.mark.parametrize("name", WORKER_MODULES)
def test_the_request_path_has_no_http_client_and_never_prints(name: str) -> None:
    """Nothing a request sends can reach TorchServe's management API through the handler."""
    tree = ast.parse((PACKAGE / name).read_text())
    imported: set[str] = set()  # dotted names: "httpx", "http.client", "http.HTTPStatus"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id != "print", f"{name}:{node.lineno} prints to the worker log"
    clients = ("httpx", "requests", "urllib", "urllib3", "aiohttp", "socket", "http.client")
    offenders = [m for m in imported if m.startswith(clients)]
    assert not offenders, f"{name} imports network clients: {offenders}"
