"""The example backend imports only polydist's public names: ``polydist`` and
``polydist.backend.*``, never a module or name that starts with ``_``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "polydist_example_backend"


def private_polydist_imports(source: str) -> list[str]:
    """Each import of a private polydist module or name in ``source``, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            names = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "polydist":
                continue
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    ("source", "private"),
    [
        ("import polydist as pd\nfrom polydist.backend.values import regroup", False),
        ("from polydist.errors import CollectiveMismatchError", False),
        ("from numpy import _core", False),
        ("from polydist._strategies.eager import EagerReplicaRunner", True),
        ("import polydist._valuetypes.values", True),
        ("from polydist.backend import _contract", True),
        ("from polydist import _sim", True),
    ],
)
def test_the_check_tells_private_from_public(source: str, private: bool) -> None:
    assert bool(private_polydist_imports(source)) is private


def test_the_backend_imports_nothing_private() -> None:
    files = sorted(SOURCE.rglob("*.py"))
    assert files, f"no sources under {SOURCE}"
    offending = {
        str(f.relative_to(SOURCE)): found
        for f in files
        if (found := private_polydist_imports(f.read_text(encoding="utf-8")))
    }
    assert offending == {}
