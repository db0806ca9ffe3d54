"""Eight fake CPU devices, set before JAX is imported (it reads XLA_FLAGS once)."""

from __future__ import annotations

import os
import sys

# Test modules share helpers from jax_testutil.py (pytest runs with --import-mode=importlib).
sys.path.insert(0, os.path.dirname(__file__))

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

from collections.abc import Iterator  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from polydist.backend import busy_workers  # noqa: E402
from polydist_jax import JaxBackend  # noqa: E402
from polydist_sim import SimBackend  # noqa: E402

assert jax.device_count() == 8, "conftest could not set 8 fake CPU devices (jax imported earlier?)"


@pytest.fixture(autouse=True)
def _no_busy_replica_threads() -> Iterator[None]:
    """Eager fallbacks run replicas on pooled threads; none may still be busy."""
    yield
    assert busy_workers() == 0, f"{busy_workers()} replica threads still busy after the test"


@pytest.fixture(autouse=True)
def _donate_every_written_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Donation is tested on variables of every size (by default XLA:CPU steps whose
    written state is small are not donated: `test_dispatch.py` tests that rule)."""
    from polydist_jax import _spmd

    monkeypatch.setattr(_spmd, "DONATE_CPU_MIN_BYTES", 0)


@pytest.fixture
def jax_backend() -> JaxBackend:
    """A fresh backend per test, so compile counts and caches start empty."""
    return JaxBackend()


@pytest.fixture
def sim_backend() -> SimBackend:
    """The reference: XLA's CPU all-reduce adds in mesh order, i.e. "sequential"."""
    return SimBackend("sequential")
