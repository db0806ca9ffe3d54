"""The digest that the processes of a compiled multi-worker step agree on describes the
traced program (its collectives), computed once per traced program.

A `ProcessGroup` of one process stands in for the cluster (`test_multi_worker_jax`
runs two real workers): it records what `agree` was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import polydist as pd
from polydist_jax import JaxBackend, _spmd
from polydist_jax._spmd import CompiledRunner

N = 2


class RecordingGroup:
    def __init__(self) -> None:
        self.signatures: list[bytes | None] = []
        self.disagree: set[int] = set()  # the calls of `execute` whose processes disagree

    def agree(self, signature: bytes | None, mesh: Any) -> str | None:
        self.signatures.append(signature)
        return None

    def compile(self, jitted: Any, mesh: Any, inputs: Sequence[Any]) -> Any:
        return jitted

    def execute(
        self,
        signature: bytes,
        mesh: Any,
        executable: Any,
        inputs: Sequence[Any],
        then: Callable[[Any], Any] | None = None,
    ) -> tuple[str | None, Any]:
        self.signatures.append(signature)
        if len(self.signatures) - 1 in self.disagree:
            return "another worker runs another program", None
        outputs = executable(*inputs)
        return None, (outputs if then is None else then(outputs))


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


def sgd_step(w: Any, x: Any) -> Any:
    # The multi-worker benchmark's idiom: parameters passed in, summed gradients, returned.
    grad = ctx().all_reduce("SUM", x * w)
    return w - 0.25 * grad, jnp.sum(grad)


def count_prepares(strategy: pd.Strategy, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runner = strategy.extended.backend._compiled
    calls: list[int] = []
    prepare = runner._prepare

    def spy(*args: Any) -> Any:
        calls.append(1)
        return prepare(*args)

    monkeypatch.setattr(runner, "_prepare", spy)
    return calls


def test_later_calls_across_processes_are_direct_and_each_agrees(
    grouped: tuple[pd.Strategy, RecordingGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first call, a step across processes is `run_direct`'s: not prepared
    again (classified, placed, looked up), but still agreed on, once per call."""
    strategy, group = grouped
    prepares = count_prepares(strategy, monkeypatch)
    w, x = jnp.ones(3), jnp.arange(3.0)
    expected = np.ones(3)
    for _ in range(4):
        w, loss = strategy.run(sgd_step, (w, x))
        grad = N * np.arange(3.0) * expected
        expected = expected - 0.25 * grad
        for part in strategy.experimental_local_results(w):
            np.testing.assert_allclose(np.asarray(part), expected, rtol=1e-6)
        for part in strategy.experimental_local_results(loss):
            assert not np.shape(part)  # rank 0 per replica, as returned
            np.testing.assert_allclose(float(part), grad.sum(), rtol=1e-6)
        w = strategy.experimental_local_results(w)[0]
    assert prepares == [1]
    assert len(group.signatures) == 4 and len(set(group.signatures)) == 1
    assert strategy.extended.backend.compile_count == 1


def test_a_direct_call_the_processes_disagree_on_runs_eagerly_without_agreeing_again(
    grouped: tuple[pd.Strategy, RecordingGroup],
) -> None:
    """A direct call whose agreement finds another program elsewhere runs eagerly (as the
    other processes do), its one agreement done: no second collective for that call."""
    strategy, group = grouped
    backend = strategy.extended.backend
    step = make_step(3, "SUM", False)
    group.disagree = {2}
    for k in range(4):
        out = strategy.run(step)
        for value in strategy.experimental_local_results(out):
            np.testing.assert_array_equal(np.asarray(value), np.arange(1, 4) * N)
        assert len(group.signatures) == k + 1  # one agreement per call
        assert backend.eager_fallback_count == (1 if k >= 2 else 0)
    assert backend.compile_count == 1


def test_one_block_global_arrays_are_checked_as_jax_checks_them() -> None:
    # `_global_array` skips JAX's own checks for a sharding with one addressable device
    # (a worker with one replica) only where the block's device and shape are right.
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    first, second = jax.devices()[:2]
    sharding = NamedSharding(Mesh(np.array([first]), ("r",)), P())
    block = jax.device_put(np.arange(4, dtype=np.float32), first)
    made = _spmd._global_array((4,), sharding, [block])
    assert made.sharding == sharding
    np.testing.assert_array_equal(np.asarray(made), [0, 1, 2, 3])
    elsewhere = jax.device_put(np.arange(4, dtype=np.float32), second)
    with pytest.raises(ValueError, match="devices do not match"):
        _spmd._global_array((4,), sharding, [elsewhere])
    with pytest.raises(ValueError, match="shape"):
        _spmd._global_array((3,), sharding, [block])
