"""The package's shape, kept by a check: layers import only downward, no cycles, small modules.

The layers, lowest first (README, "Where things are"): `core` -> `api`, `sessions`, `images` ->
`engine` -> `server` -> `fronts`, `client` -> `tools`. Each may import its own package and the
packages listed for it below, nothing else of `llava`; imports inside functions and under
`TYPE_CHECKING` count as well, since a cycle through them is a cycle all the same.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llava"
MAX_LINES = 400

# package -> the llava packages it may import besides itself
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "api": {"core"},
    "sessions": {"core"},
    "images": {"core"},
    "engines": {"core"},
    "server": {"core", "api", "sessions", "images"},
    "client": {"core", "api"},
    "fronts": {"core", "api", "sessions", "images", "engines", "server", "client"},
    "tools": {"core", "api", "engines", "fronts", "client", "tools"},
    "__main__": {"core", "tools", "fronts"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every `llava` import in a module, anywhere in it: (module, names imported from it)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "llava":
                out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "llava"]
    return out


def resolve(target: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """The modules an import loads: `from pkg import mod` names a module too."""
    found = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
    return found or [target]


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for target, names in imports(path):
            edges[name].update(t for t in resolve(target, names, known) if t != name)
    return edges


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "llava"


def test_layers_import_only_downward() -> None:
    wrong = []
    for module, targets in graph().items():
        own = layer(module)
        for target in targets:
            other = layer(target)
            if other in ("llava", own):
                continue
            if other not in ALLOWED.get(own, set()):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_import_cycle() -> None:
    edges = graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_module_over_the_size_limit() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_no_private_name_imported_from_another_module() -> None:
    crossing = [
        f"{module} imports {name} from {target}"
        for module, path in modules().items()
        for target, names in imports(path)
        for name in names
        if name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert crossing == []


def test_the_checks_see_a_violation() -> None:
    """The walk finds what it must: a known edge, and a cycle where one is planted."""
    edges = graph()
    assert "llava.core.errors" in edges["llava.api.fields"]
    assert "llava.engines.transformers.runner" in edges["llava.engines.transformers.stepping"]
    assert layer("llava.engines.transformers.model.packed") == "engines"


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of every package a module imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


def test_the_engines_are_peers() -> None:
    """Neither engine imports the other; only the vLLM engine imports vLLM, and only the
    engines (not their shared conversation code) import torch."""
    crossing = [
        f"{module} -> {target}"
        for module, targets in graph().items()
        for target in targets
        for own, other in (("transformers", "vllm"), ("vllm", "transformers"))
        if module.startswith(f"llava.engines.{own}") and target.startswith(f"llava.engines.{other}")
    ]
    assert crossing == []
    engines = ("llava.engines.transformers", "llava.engines.vllm")
    for module, path in modules().items():
        loaded = third_party_imports(path)
        if not module.startswith("llava.engines.vllm"):
            assert "vllm" not in loaded, module
        if not module.startswith(engines) and not module.startswith("llava.tools"):
            assert "torch" not in loaded, module


@pytest.mark.parametrize(
    ("modules_loaded", "forbidden"),
    [
        # The pure layers and the service never load torch: a front imports it when it builds
        # the engine, not before.
        (
            "llava.core.errors, llava.api.dispatch, llava.sessions.store, llava.images, "
            "llava.server.service, llava.fronts.torchserve.handler",
            ("torch", "transformers"),
        ),
        # The service, the engine and the TorchServe front never load Ray; Ray's router and
        # ingress (run in Ray's proxy processes) never load torch.
        (
            "llava.server.service, llava.server.loop, llava.fronts.assembly, "
            "llava.engines.transformers, llava.fronts.torchserve.handler",
            ("ray",),
        ),
        (
            "llava.fronts.ray.router, llava.fronts.ray.ingress, llava.fronts.ray.app, "
            "llava.fronts.ray.replica",
            ("torch", "transformers"),
        ),
        # The server never loads the dev tools or the chat page's UI library.
        (
            "llava.fronts.torchserve.handler, llava.server.service, llava.engines.transformers, "
            "llava.fronts.local_runtime.server, llava_handler",
            ("gradio", "llava.tools"),
        ),
    ],
)
def test_what_a_layer_loads(modules_loaded: str, forbidden: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        f"import {modules_loaded}\n"
        f"bad = {forbidden!r}\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in bad "
        "or any(m.startswith(b + '.') or m == b for b in bad))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent / "handler")}  # TorchServe's entry
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
