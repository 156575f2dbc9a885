"""The package's rooms import only rooms below them, and no module imports itself back.

The layers are stated once, in ``pyproject.toml`` (``[tool.importlinter]``), and checked with
import-linter; the cycle check covers what a layers contract does not: modules of one room.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# import-linter's graph library (the dev extra, which CI installs); a GPU machine without it skips these
grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[1]


def test_rooms_import_only_rooms_below_them():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph.find_modules_directly_imported_by(m):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle():
    graph = grimp.build_graph("cpcompile", exclude_type_checking_imports=True)
    assert _cycles(graph) == []
