"""The README tells the truth about itself: every command it gives runs something that exists,
every path and link it names is there, and the figures it quotes are the ones their results
files hold."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def make_targets() -> set[str]:
    """The Makefile's targets (rules and .PHONY names)."""
    text = (REPO / "Makefile").read_text()
    rules = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.MULTILINE))
    phony = re.search(r"^\.PHONY:(.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    names = set(phony.group(1).replace("\\\n", " ").split()) if phony else set()
    return rules | names


def test_every_make_command_the_readme_gives_is_a_target() -> None:
    targets = make_targets()
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert named, "the README names no make command"
    missing = named - targets
    assert missing == set(), f"the README names make targets the Makefile lacks: {missing}"


def test_every_path_and_link_the_readme_names_exists() -> None:
    """Paths from the repo's root; a bare file name (a table's `fenced.py` beside
    `llava/sessions/shared.py`) is a file of the repo's; a path the server makes as it runs
    (`.torchserve/`, `build/test-logs/`) is one under a folder .gitignore names."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    quoted = re.findall(r"`([\w./-]+/[\w./-]*|[\w-]+\.(?:py|md|sh|ipynb|png|yaml|json))`", README)
    named = {p for p in [*links, *quoted] if not p.startswith(("http", "s3:", "/", "arn:"))}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    files = {Path(line).name for line in tracked.stdout.splitlines()}
    ignored = [e for e in (REPO / ".gitignore").read_text().split() if e.startswith("/")]
    missing = [
        path
        for path in sorted(named)
        if not (REPO / path).exists()
        and not ("/" not in path and path in files)
        and not any(f"/{path.rstrip('/')}/".startswith(entry) for entry in ignored)
    ]
    assert named and missing == [], f"the README names paths that do not exist: {missing}"


def test_every_module_the_readme_runs_exists() -> None:
    modules = set(re.findall(r"python -m ([\w.]+)", README))
    assert modules
    for name in modules:
        parts = name.split(".")
        found = (REPO / Path(*parts)).with_suffix(".py").exists() or (
            REPO / Path(*parts) / "__main__.py"
        ).exists()
        assert found, f"the README runs `python -m {name}`, which is not in the repo"


def test_every_anchor_the_readme_links_to_is_a_heading_there() -> None:
    for path, anchor in re.findall(r"\]\(([^)#\s]+)#([^)]+)\)", README):
        headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.MULTILINE)
        slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
        assert anchor in slugs, f"{path} has no heading for #{anchor}"


def _capacity() -> dict[str, Any]:
    return dict(json.loads((REPO / "bench/results/capacity-llava15.json").read_text()))


def test_the_capacity_figures_are_the_benchmark_s() -> None:
    """README: 'the session cache held 0.72 conversations/s ... p95 133 ms ... the pixel-cache
    design missed a 1 s p95 at the lowest rates tried, 0.035-0.054/s'."""
    said = re.search(
        r"session cache held ([\d.]+) conversations/s.*?p95 (\d+) ms.*?"
        r"rates tried, ([\d.]+)-([\d.]+)/s",
        README,
        re.DOTALL,
    )
    assert said, "the README no longer quotes bench/capacity.py's figures"
    held, p95, low, high = float(said[1]), float(said[2]), float(said[3]), float(said[4])
    strategies = _capacity()["strategies"]
    session = next(
        v for k, v in strategies.items() if k.startswith("session") and v["capacity_per_s"]
    )
    assert held == session["capacity_per_s"]
    at = next(row for row in session["sweep"] if row["rate_per_s"] == held)
    assert p95 == pytest.approx(at["p95_ms"], abs=0.5)
    pixels = [
        row["rate_per_s"]
        for k, v in strategies.items()
        if k.startswith("pixels")
        for row in v["sweep"]
    ]
    assert (low, high) == (min(pixels), max(r for r in pixels if r <= high)), pixels
