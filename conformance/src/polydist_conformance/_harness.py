"""Running one program on the backend under test and on the sim oracle."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import numpy as np
import pytest

import polydist as pd
from polydist.backend import Backend
from polydist_conformance._compare import EXPECTED, Policy, compare, observe, plain
from polydist_conformance._loading import load_backend
from polydist_conformance._pytrees import Build, framework_pytrees
from polydist_sim import REDUCTION_ORDERS, SimBackend

__all__ = ["Conformance", "ConformanceSession", "Program", "StrategyFactory", "StrategyKind"]

#: ``program(strategy, xp)``: the code under test, run once per backend.
Program = Callable[[pd.Strategy, Any], Any]
StrategyKind = Literal["mirrored", "one_device", "default"]
#: Builds the strategy a program runs under, for one backend (the backend under test,
#: then the oracle): ``lambda backend: pd.TPUStrategy(resolver, backend=backend)``.
StrategyFactory = Callable[[Backend], pd.Strategy]

_MISSING: Any = object()


@dataclass
class ConformanceSession:
    """What one conformance run is about: the backend, its oracle and the replica count."""

    spec: str
    backend: Backend
    oracle: SimBackend
    replicas: int
    policy: Policy
    pytrees: dict[str, Build] | None = None

    @classmethod
    def create(cls, spec: str, replicas: int | None) -> ConformanceSession:
        backend = load_backend(spec)
        orders = [o for o in backend.capabilities.reduction_orders if o in REDUCTION_ORDERS]
        # A backend that reproduces one of the sim's orders is compared bit for
        # bit with an oracle using that order; others within the error bound
        # of correctly rounded sums.
        order = orders[0] if orders else "exact"
        oracle = SimBackend(order)  # type: ignore[arg-type]
        policy = Policy(bitwise_sums=bool(orders), reference_exact=order == "exact")
        if replicas is None:
            replicas = default_replicas(backend)
        elif replicas < 1:
            raise ValueError(f"--polydist-replicas must be >= 1, got {replicas}.")
        devices = backend.replica_devices(replicas)  # a backend with too few raises ValueError
        if len(devices) != replicas:
            raise ValueError(
                f"--polydist-replicas={replicas}: backend {backend.name!r} gives {len(devices)} "
                f"device(s) for {replicas} replicas: {devices}."
            )
        return cls(spec, backend, oracle, replicas, policy)

    @property
    def comparison(self) -> str:
        if self.policy.bitwise_sums:
            return f"bit for bit with SimBackend({self.oracle.reduction_order!r})"
        return "within the floating-point error bound of correctly rounded sums"


def default_replicas(backend: Backend) -> int:
    """The backend's default device count if above 1, else 4 where the backend has them."""
    count = len(backend.replica_devices(None))
    if count > 1:
        return count
    try:
        if len(backend.replica_devices(4)) == 4:
            return 4
    except ValueError:
        pass
    return count


class Conformance:
    """The ``conformance`` fixture: runs case programs and compares their results.

    A program is ``program(strategy, xp)``: it builds its inputs with ``xp``
    (the backend's array namespace, ``strategy.extended.array_namespace()``),
    runs them through ``strategy`` and returns what it wants compared. It runs
    once on the backend under test and once on the sim oracle with the same
    replica count.
    """

    def __init__(self, session: ConformanceSession) -> None:
        self.session = session

    @property
    def backend(self) -> Backend:
        return self.session.backend

    @property
    def replicas(self) -> int:
        """The replica count of ``MirroredStrategy`` in this run."""
        return self.session.replicas

    @property
    def framework_pytrees(self) -> dict[str, Build]:
        """The framework pytrees the backend supplies through the optional entry point
        ``polydist_conformance.pytrees`` (see :mod:`polydist_conformance._pytrees`)."""
        if self.session.pytrees is None:
            self.session.pytrees = framework_pytrees(self.backend.name)
        return self.session.pytrees

    def check(
        self,
        program: Program,
        *,
        expected: Any = _MISSING,
        replicas: int | None = None,
        strategy: StrategyKind | StrategyFactory = "mirrored",
    ) -> Any:
        """Runs ``program`` on the backend and the oracle; fails unless the results agree.

        Args:
            expected: the documented result (NumPy arrays, ``pd.PerReplica``/
                ``pd.Mirrored`` of them, Python values). The backend's result
                must equal it too, which also checks the rules that core
                implements for every backend (the oracle shares them).
            replicas: a replica count other than the run's (a documented
                example for 2 replicas, say); skips where the backend lacks them.
            strategy: ``"mirrored"`` (``MirroredStrategy(replicas)``),
                ``"one_device"`` (``OneDeviceStrategy`` on the first device),
                ``"default"`` (the default strategy, ``polydist.get_strategy()``), or
                a :data:`StrategyFactory` called with each backend (``TPUStrategy``,
                ``MultiWorkerMirroredStrategy``, a ``MirroredStrategy`` with
                ``cross_device_ops``); an error it raises counts as the program's.

        Returns:
            The backend's result on the host: NumPy arrays, with distributed
            values as :class:`polydist_conformance.Distributed`.
        """
        n = self._replica_count(replicas, strategy)
        got, got_error = self._run(self.session.backend, program, strategy, n)
        want, want_error = self._run(self.session.oracle, program, strategy, n)
        if want_error is not None:
            raise want_error  # the case itself is wrong: the oracle cannot run it
        if got_error is not None:
            raise got_error
        errors = compare(got, want, self.session.policy)
        if expected is not _MISSING:
            reference = observe(expected, np.asarray)
            documented = compare(got, reference, EXPECTED)
            if documented and compare(want, reference, EXPECTED):
                # The oracle shares core's rules, so only the documented result
                # catches a broken rule in core (or in the sim).
                documented.append(
                    "the oracle differs from the documented result as well: the rule that "
                    "broke is in polydist core or the sim, not only in this backend"
                )
            errors += documented
        if errors:
            self._fail(errors, n, strategy)
        return plain(got)

    def check_raises(
        self,
        program: Program,
        exception: type[BaseException] | tuple[type[BaseException], ...],
        *,
        match: str | None = None,
        replicas: int | None = None,
        strategy: StrategyKind | StrategyFactory = "mirrored",
    ) -> None:
        """Both the backend and the oracle must raise ``exception`` (matching ``match``)."""
        n = self._replica_count(replicas, strategy)
        names = (
            exception.__name__
            if isinstance(exception, type)
            else " or ".join(e.__name__ for e in exception)
        )
        for who, backend in (("oracle", self.session.oracle), ("backend", self.session.backend)):
            _, error = self._run(backend, program, strategy, n)
            where = f"the {who} ({_backend_label(backend)}, {_strategy_label(strategy, n)})"
            if error is None:
                pytest.fail(f"{where} did not raise {names}.", pytrace=False)
            if not isinstance(error, exception):
                raise AssertionError(
                    f"{where} raised {type(error).__name__} instead of {names}: {error}"
                ) from error
            if match is not None and not re.search(match, str(error)):
                raise AssertionError(
                    f"{where} raised {type(error).__name__} whose message does not match "
                    f"{match!r}: {error}"
                ) from error

    # -- helpers -------------------------------------------------------------------
    def _replica_count(self, replicas: int | None, strategy: StrategyKind | StrategyFactory) -> int:
        if callable(strategy):
            if replicas is not None:
                raise ValueError("pass replicas= or a strategy factory, not both")
            return 0  # the factory decides
        if strategy != "mirrored":
            return 1
        n = self.session.replicas if replicas is None else replicas
        if n != self.session.replicas:
            try:
                available = len(self.session.backend.replica_devices(n))
            except ValueError as e:
                pytest.skip(f"needs {n} replicas; backend {self.backend.name!r}: {e}")
            if available != n:
                pytest.skip(f"needs {n} replicas; backend {self.backend.name!r} gives {available}")
        return n

    def _run(
        self, backend: Backend, program: Program, kind: StrategyKind | StrategyFactory, n: int
    ) -> tuple[Any, Exception | None]:
        if pd.has_strategy():
            raise RuntimeError("conformance programs must start outside any strategy scope")
        strategy: pd.Strategy | None = None
        if kind == "mirrored":
            strategy = pd.MirroredStrategy(n, backend=backend)
        elif kind == "one_device":
            strategy = pd.OneDeviceStrategy(backend.replica_devices(1)[0], backend=backend)
        elif kind == "default":
            strategy = pd.get_strategy()
        try:
            if strategy is None:
                assert callable(kind)
                strategy = kind(backend)  # its errors are the program's
            result = program(strategy, backend.array_namespace())
        except Exception as e:
            return None, e
        return observe(result, backend.to_numpy), None

    def _fail(
        self, errors: list[str], n: int, strategy: StrategyKind | StrategyFactory
    ) -> NoReturn:
        head = (
            f"backend {_backend_label(self.backend)} disagrees on "
            f"{_strategy_label(strategy, n)}; sums compared {self.session.comparison}:"
        )
        shown = errors[:12] + ([f"... and {len(errors) - 12} more"] if len(errors) > 12 else [])
        pytest.fail("\n".join([head, *("  " + e for e in shown)]), pytrace=False)


def _strategy_label(strategy: StrategyKind | StrategyFactory, n: int) -> str:
    if callable(strategy):
        return f"the strategy of {strategy!r}"
    return f"{strategy} strategy with {n} replica(s)"


def _backend_label(backend: Backend) -> str:
    return f"{backend.name!r} ({type(backend).__name__})"
