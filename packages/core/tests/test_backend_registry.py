"""Backend selection: explicit argument, then $POLYDIST_BACKEND, then sim."""

from __future__ import annotations

import numpy as np
import pytest

import polydist as pd
from polydist.backend import Backend, available_backends, get_backend
from polydist.errors import BackendNotFoundError


def test_sim_is_installed_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)
    assert "sim" in available_backends()
    assert get_backend().name == "sim"
    assert pd.MirroredStrategy(2).extended.backend.name == "sim"


def test_backends_are_cached() -> None:
    assert get_backend("sim") is get_backend("sim")


def test_env_var_selects_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYDIST_BACKEND", "nonexistent")
    with pytest.raises(BackendNotFoundError, match=r"\$POLYDIST_BACKEND"):
        pd.MirroredStrategy(2)
    # An explicit argument wins over the environment.
    assert pd.MirroredStrategy(2, backend="sim").extended.backend.name == "sim"


@pytest.mark.parametrize(
    ("name", "package"), [("jax", "polydist-jax"), ("torch", "polydist-torch")]
)
def test_unknown_backend_lists_installed_and_pip_package(name: str, package: str) -> None:
    if name in available_backends():
        pytest.skip(f"{name} is installed here")
    with pytest.raises(BackendNotFoundError) as info:
        get_backend(name)
    message = str(info.value)
    assert f"No polydist backend named {name!r}" in message
    assert "Installed backends: " in message and "sim" in message
    assert f"pip install {package}" in message


def test_backend_object_is_accepted_and_checked() -> None:
    from polydist_sim import SimBackend

    backend = SimBackend("tree")
    strategy = pd.MirroredStrategy(2, backend=backend)
    assert strategy.extended.backend is backend
    with pytest.raises(TypeError, match="implementing polydist.backend.Backend"):
        pd.MirroredStrategy(2, backend=object())  # type: ignore[arg-type]


def test_sim_satisfies_the_protocol_statically() -> None:
    from polydist_sim import SimBackend

    backend: Backend = SimBackend()  # mypy checks this assignment against the Protocol
    assert isinstance(backend, Backend)


def test_is_symbolic_reads_the_optional_method() -> None:
    from polydist.backend import is_symbolic
    from polydist_sim import SimBackend

    sim = SimBackend()
    assert not is_symbolic(sim, np.zeros(3))  # no such method: nothing is symbolic

    class Tracing(SimBackend):
        def is_symbolic(self, value: object) -> bool:
            return isinstance(value, str)

    assert is_symbolic(Tracing(), "a tracer") and not is_symbolic(Tracing(), np.zeros(3))
