"""The digest that the processes of a compiled multi-worker step agree on describes the
traced program (its collectives), computed once per traced program.

A `ProcessGroup` of one process stands in for the cluster (`test_multi_worker_jax`
runs two real workers): it records what `agree` was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist_jax import JaxBackend, _spmd
from polydist_jax._spmd import CompiledRunner

N = 2


class RecordingGroup:
    def __init__(self) -> None:
        self.signatures: list[bytes | None] = []

    def agree(self, signature: bytes | None, mesh: Any) -> str | None:
        self.signatures.append(signature)
        return None

    def compile(self, jitted: Any, mesh: Any, inputs: Sequence[Any]) -> Any:
        return jitted

    def execute(
        self, signature: bytes, mesh: Any, executable: Any, inputs: Sequence[Any]
    ) -> tuple[str | None, Any]:
        self.signatures.append(signature)
        return None, executable(*inputs)


@pytest.fixture
def grouped() -> tuple[pd.Strategy, RecordingGroup]:
    backend = JaxBackend()
    group = RecordingGroup()
    backend._compiled = CompiledRunner(group=lambda: group)
    return pd.MirroredStrategy(N, backend=backend), group


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def make_step(size: int, op: str, gather: bool) -> Callable[[], Any]:
    # Every variant is a function of one name and module, with no inputs.
    def step() -> Any:
        value = np.arange(1, size + 1, dtype=np.float32)
        if gather:
            return ctx().all_gather(value, axis=0)
        return ctx().all_reduce(op, value)

    return step


def digest(grouped: tuple[pd.Strategy, RecordingGroup], step: Callable[[], Any]) -> bytes:
    strategy, group = grouped
    strategy.run(step)
    signature = group.signatures[-1]
    assert signature is not None
    return signature


def test_programs_that_differ_only_in_their_closures_have_other_digests(
    grouped: tuple[pd.Strategy, RecordingGroup],
) -> None:
    base = digest(grouped, make_step(3, "SUM", False))
    assert digest(grouped, make_step(3, "SUM", False)) == base  # the same program
    assert digest(grouped, make_step(4, "SUM", False)) != base  # another shape
    assert digest(grouped, make_step(3, "MEAN", False)) != base  # another reduce op
    assert digest(grouped, make_step(3, "SUM", True)) != base  # all_gather


def test_a_global_that_changes_the_collectives_changes_the_digest(
    grouped: tuple[pd.Strategy, RecordingGroup],
) -> None:
    global SIZE
    SIZE = 3
    first = digest(grouped, _global_step)
    grouped[0].extended.backend.clear_cache()  # a new process: traced anew
    SIZE = 5
    assert digest(grouped, _global_step) != first


SIZE = 3


def _global_step() -> Any:
    return ctx().all_reduce("SUM", np.ones(SIZE, np.float32))


def test_the_digest_is_computed_once_per_traced_program(
    grouped: tuple[pd.Strategy, RecordingGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    computed: list[bytes] = []
    original = _spmd._signature

    def counting(*args: Any) -> bytes:
        computed.append(original(*args))
        return computed[-1]

    monkeypatch.setattr(_spmd, "_signature", counting)
    strategy, group = grouped
    step = make_step(3, "SUM", False)
    for _ in range(4):
        out = strategy.run(step)
    assert len(computed) == 1
    assert group.signatures == computed * 4
    assert strategy.extended.backend.compile_count == 1  # traced once: for the digest
    for value in strategy.experimental_local_results(out):
        np.testing.assert_array_equal(np.asarray(value), np.arange(1, 4) * N)
