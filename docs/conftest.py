"""Runs every Python code block of docs/ (pytest-markdown-docs) as a test.

Each block runs as written, in a fresh temporary working directory, so blocks
that write checkpoints or traces leave nothing behind. A block that needs a
real backend names it with a fixture in its info string, for example
``{.python fixture:jax}``; such a block runs in the nox session that installs
that backend (``POLYDIST_DOCS_BACKEND``) and is deselected in the others, so
every block runs in exactly one session. A block meant to fail asserts its
error: its last line ends with a comment ``# raises NAME`` (for example
``strategy.run(step)  # raises CollectiveMismatchError``), and the test passes
only if the block raises that exception class (matched by class name).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from pluggy import Result

#: Fixture names that tie a block to a backend's nox session. ``threads`` is the example
#: third-party backend (examples/thirdparty_backend), run by the example_backend session.
BACKENDS = ("jax", "torch", "torch_xla", "threads")


def _backend_of(item: pytest.Item) -> str:
    names = set(getattr(item, "fixturenames", ()))
    found = [b for b in BACKENDS if b in names]
    return found[0] if found else "sim"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = os.environ.get("POLYDIST_DOCS_BACKEND", "sim")
    keep, drop = [], []
    for item in items:
        if "markdown-docs" not in item.keywords or _backend_of(item) == wanted:
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh working directory, the environment as it was (blocks set TF_CONFIG), and
    no TPU system initialized or shut down."""
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    # initialize/shutdown_tpu_system and connect_to_cluster keep process-wide records.
    from polydist.cluster_resolver import _connect
    from polydist.tpu import _system

    _system._initialized.clear()
    _system._shut_down.clear()
    _connect._connection = None


@pytest.fixture
def jax() -> object:
    import jax as jax_module

    return jax_module


@pytest.fixture
def torch() -> object:
    import torch as torch_module

    return torch_module


@pytest.fixture
def torch_xla() -> object:
    import torch_xla as torch_xla_module

    return torch_xla_module


@pytest.fixture
def threads() -> object:
    import polydist_example_backend

    return polydist_example_backend


_RAISES = re.compile(r"#\s*raises\s+([A-Za-z_][\w.]*)")


def _expected_error(item: pytest.Item) -> str | None:
    code = getattr(item, "code", None)
    if not isinstance(code, str) or not code.strip():
        return None
    match = _RAISES.search(code.rstrip().splitlines()[-1])
    return match.group(1).rsplit(".", 1)[-1] if match else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    expected = _expected_error(item)
    outcome: Result[None] = yield
    if expected is None:
        return
    exc = outcome.exception
    if exc is None:
        outcome.force_exception(
            AssertionError(f"the block's last line says '# raises {expected}'; nothing was raised")
        )
    elif expected in {cls.__name__ for cls in type(exc).__mro__}:
        outcome.force_result(None)
