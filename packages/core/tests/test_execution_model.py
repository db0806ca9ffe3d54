"""Core owns the execution model: it runs an eager backend's replicas itself, and a
compiled backend's ``run_replicas`` gets a frozen `ReplicaGroup`, not StrategyExtended."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import polydist as pd
from polydist.backend import (
    NOT_HANDLED,
    Backend,
    Capabilities,
    EagerReplicaRunner,
    ReplicaChannel,
    ReplicaGroup,
    SupportsCompiledRun,
    SupportsDirectRun,
    SupportsPreparedRun,
    SupportsReplicaRunner,
    features,
    replica_group,
)
from polydist.backend.tracing import note_replica_write, swap_storage
from polydist.experimental import CommunicationOptions
from polydist_sim import SimBackend

Args = Sequence[tuple[tuple[Any, ...], dict[str, Any]]]


class EagerOnly:
    """An eager backend of devices, placement and collectives only: no run_replicas."""

    name = "eager-only"
    version = "1.0"

    def __init__(self) -> None:
        self._sim = SimBackend()
        self.capabilities = Capabilities(execution_model="eager")

    def array_namespace(self) -> Any:
        return np

    def list_devices(self) -> tuple[str, ...]:
        return self._sim.list_devices()

    def replica_devices(self, count: int | None) -> tuple[str, ...]:
        return self._sim.replica_devices(count)

    def validate_devices(self, devices: Sequence[str]) -> None:
        self._sim.validate_devices(devices)

    def device_scope(self, device: str) -> Any:
        return self._sim.device_scope(device)

    def place(self, value: Any, device: str) -> Any:
        return np.asarray(value)

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    def all_reduce(self, values: Sequence[Any], destinations: Sequence[str]) -> list[Any]:
        return self._sim.all_reduce(values, destinations)

    def reduce_to(self, values: Sequence[Any], destination: str) -> Any:
        return self._sim.reduce_to(values, destination)

    def all_gather(
        self, values: Sequence[Any], axis: int, destinations: Sequence[str]
    ) -> list[Any]:
        return self._sim.all_gather(values, axis, destinations)

    def broadcast(self, value: Any, destinations: Sequence[str]) -> list[Any]:
        return self._sim.broadcast(value, destinations)


class CountingRunner(EagerReplicaRunner):
    """Core's runner, recording the group of each run."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[ReplicaGroup] = []

    def run(self, group: ReplicaGroup, fn: Callable[..., Any], per_replica_args: Args) -> list[Any]:
        self.groups.append(group)
        return super().run(group, fn, per_replica_args)


class Compiled(SimBackend):
    """Declares the SPMD model; its run_replicas records what it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities, execution_model="spmd")
        self.name = "compiled"
        self.received: list[Any] = []

    def run_replicas(self, group: ReplicaGroup, fn: Callable[..., Any], args: Args) -> list[Any]:
        self.received.append(group)
        return EagerReplicaRunner().run(group, fn, args)  # a compiled backend's fallback


def _sum_of_ids() -> Any:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce("SUM", ctx.replica_id_in_sync_group)


def test_core_runs_an_eager_backend_without_run_replicas() -> None:
    backend = EagerOnly()
    assert isinstance(backend, Backend) and not isinstance(backend, SupportsCompiledRun)
    strategy = pd.MirroredStrategy(3, backend=backend)
    out = strategy.run(_sum_of_ids)
    assert [int(v) for v in strategy.experimental_local_results(out)] == [3, 3, 3]


def test_an_eager_backend_configures_the_runner() -> None:
    backend = SimBackend()
    runner = CountingRunner()
    backend.replica_runner = runner
    assert isinstance(backend, SupportsReplicaRunner)
    strategy = pd.MirroredStrategy(2, backend=backend)
    strategy.run(_sum_of_ids)
    strategy.run(_sum_of_ids)
    assert len(runner.groups) == 2
    assert runner.groups[0] is runner.groups[1]  # built once per strategy, not per run
    assert runner.groups[0] is replica_group(strategy)


def test_a_compiled_backend_gets_the_replica_group() -> None:
    backend = Compiled()
    strategy = pd.MirroredStrategy(4, backend=backend)
    out = strategy.run(_sum_of_ids)
    assert [int(v) for v in strategy.experimental_local_results(out)] == [6] * 4
    strategy.run(_sum_of_ids)
    first, second = backend.received
    assert isinstance(first, ReplicaGroup) and first is second
    assert first.strategy is strategy and first.backend is backend
    assert first.devices == strategy.extended.worker_devices
    assert first.num_replicas_in_sync == first.size == 4
    assert first.replica_offset == 0 and not first.across_processes
    assert first.communication_options is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.size = 2  # type: ignore[misc]


class Direct(Compiled):
    """A compiled backend with a fast path: it answers the calls of ``answered`` alone."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: dict[Any, Any] = {}
        self.direct: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def run_direct(
        self, group: ReplicaGroup, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        self.direct.append((fn, args, kwargs))
        return self.answered.get(fn, NOT_HANDLED)


def test_a_direct_run_answers_or_leaves_the_call_to_core() -> None:
    backend = Direct()
    assert isinstance(backend, SupportsDirectRun) and features(backend).direct_run
    strategy = pd.MirroredStrategy(2, backend=backend)
    out = strategy.run(_sum_of_ids, kwargs={})  # NOT_HANDLED: core's usual path
    assert [int(v) for v in strategy.experimental_local_results(out)] == [1, 1]
    assert len(backend.received) == 1 and backend.direct == [(_sum_of_ids, (), {})]
    backend.answered[_sum_of_ids] = "answered"
    assert strategy.run(_sum_of_ids) == "answered"
    assert len(backend.received) == 1  # run_replicas not called


def test_a_direct_run_is_not_asked_while_tracing() -> None:
    backend = Direct()
    backend.answered[_sum_of_ids] = "answered"
    strategy = pd.MirroredStrategy(2, backend=backend)
    with pd.trace() as trace:
        out = strategy.run(_sum_of_ids)
    assert [int(v) for v in strategy.experimental_local_results(out)] == [1, 1]
    assert backend.direct == [] and trace.steps == 1
    assert [e.op for e in trace.events] == ["all_reduce"]


def test_core_checks_divergence_after_a_direct_run() -> None:
    backend = Direct()
    strategy = pd.MirroredStrategy(2, backend=backend)
    with strategy.scope():
        v = pd.Variable(0.0)

    def diverge() -> None:
        # What a compiled program's replicas would have done: each wrote its own copy.
        swap_storage(v, [np.float32(0.0), np.float32(1.0)])
        note_replica_write(v)

    class Answer:
        def get(self, fn: Any, default: Any) -> Any:
            diverge()
            return None

    backend.answered = Answer()  # type: ignore[assignment]
    with pytest.warns(pd.ReplicaDivergenceWarning, match="now holds different values"):
        assert strategy.run(lambda: None) is None
    assert backend.received == []  # answered directly; core's after-run check warned


class Prepared(Direct):
    """A direct run that also prepares calls: ``prepare_direct`` answers from
    ``ready`` (None while absent); each prepared call records its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ready: dict[Any, Any] = {}
        self.asked: list[Any] = []
        self.prepared_calls: list[tuple[Any, ...]] = []

    def prepare_direct(self, group: ReplicaGroup, fn: Callable[..., Any]) -> Any:
        self.asked.append(fn)
        answer = self.ready.get(fn)
        if answer is None:
            return None

        def call(args: tuple[Any, ...]) -> Any:
            self.prepared_calls.append(args)
            return answer(*args)

        return call


def test_a_prepared_call_is_asked_for_after_a_direct_answer_and_then_taken_first() -> None:
    backend = Prepared()
    assert isinstance(backend, SupportsPreparedRun) and features(backend).prepared_run
    strategy = pd.MirroredStrategy(2, backend=backend)
    fn = _sum_of_ids
    strategy.run(fn)  # core's usual path: not asked
    assert backend.asked == []
    backend.answered[fn] = "direct"
    assert strategy.run(fn) == "direct"
    assert backend.asked == [fn]  # asked after the direct answer; none yet
    backend.ready[fn] = lambda *a: ("prepared", a)
    assert strategy.run(fn) == "direct"  # asked again: ready from now on
    assert backend.asked == [fn, fn]
    direct_calls = len(backend.direct)
    assert strategy.run(fn, (1, 2)) == ("prepared", (1, 2))
    assert strategy.run(fn, [3]) == "direct"  # a list of arguments: the usual path
    with strategy.scope():  # directly in its own scope: taken
        assert strategy.run(fn, (4,)) == ("prepared", (4,))
    assert backend.prepared_calls == [(1, 2), (4,)]
    assert len(backend.direct) == direct_calls + 1 and backend.asked == [fn, fn]
    # Keyword arguments, a collective trace, another strategy's scope: never prepared.
    assert strategy.run(fn, (5,), {"k": 1}) == "direct"
    with pd.trace():
        out = strategy.run(fn)
    assert [int(v) for v in strategy.experimental_local_results(out)] == [1, 1]
    other = pd.MirroredStrategy(2, backend=backend)
    with other.scope(), pytest.raises(RuntimeError, match="Mixing different"):
        strategy.run(fn, (6,))
    assert backend.prepared_calls == [(1, 2), (4,)]


def test_a_prepared_call_that_declines_is_forgotten() -> None:
    backend = Prepared()
    strategy = pd.MirroredStrategy(2, backend=backend)
    fn = _sum_of_ids
    backend.answered[fn] = "direct"
    backend.ready[fn] = lambda *a: NOT_HANDLED
    assert strategy.run(fn) == "direct"  # asked: prepared
    assert strategy.run(fn, (1,)) == "direct"  # it declined: the direct answer, asked again
    assert backend.prepared_calls == [(1,)] and backend.asked == [fn, fn]


def test_core_asks_a_few_times_only() -> None:
    backend = Prepared()
    strategy = pd.MirroredStrategy(2, backend=backend)
    fn = _sum_of_ids
    backend.answered[fn] = "direct"
    for _ in range(10):
        assert strategy.run(fn) == "direct"
    assert backend.asked == [fn] * 4


def test_a_strategy_with_its_own_run_gets_no_prepared_call() -> None:
    # Its own checks are what a prepared call would skip: core never asks.
    class Logged(pd.MirroredStrategy):
        calls = 0

        def run(self, fn: Any, args: Any = (), kwargs: Any = None, options: Any = None) -> Any:
            Logged.calls += 1
            return super().run(fn, args, kwargs, options)

    backend = Prepared()
    strategy = Logged(2, backend=backend)
    fn = _sum_of_ids
    backend.answered[fn] = "direct"
    backend.ready[fn] = lambda *a: "prepared"
    assert [strategy.run(fn) for _ in range(3)] == ["direct"] * 3
    assert backend.asked == [] and backend.prepared_calls == [] and Logged.calls == 3


def test_inside_a_replica_context_a_prepared_call_is_not_taken() -> None:
    backend = Prepared()
    strategy = pd.MirroredStrategy(2, backend=backend)
    fn = _sum_of_ids
    backend.answered[fn] = "direct"
    backend.ready[fn] = lambda *a: "prepared"
    strategy.run(fn)
    assert strategy.run(fn, ()) == "prepared"

    def nested() -> Any:
        return strategy.run(fn, ())

    backend.answered.pop(fn)  # (the outer call runs its replicas)
    with pytest.raises(RuntimeError, match="replica context"):
        strategy.run(nested)


def test_a_multi_worker_group_is_a_cache_key() -> None:
    # Hashed by identity: its CommunicationOptions (a mutable dataclass) has no hash.
    strategy = pd.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions())
    group = replica_group(strategy)
    assert {group: 1}[replica_group(strategy)] == 1
    assert group != dataclasses.replace(group)


def test_a_compiled_backend_without_run_replicas_is_a_clear_error() -> None:
    backend = EagerOnly()
    backend.capabilities = Capabilities(execution_model="spmd")
    strategy = pd.MirroredStrategy(2, backend=backend)
    with pytest.raises(TypeError, match=r"execution_model='spmd' but has no run_replicas"):
        strategy.run(_sum_of_ids)


def test_a_simulated_cluster_runs_every_workers_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tf_config = {
        "cluster": {"worker": ["w0:1", "w1:1"]},
        "task": {"type": "worker", "index": 1},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    backend = SimBackend(num_gpus=2)
    runner = CountingRunner()
    backend.replica_runner = runner
    options = CommunicationOptions(timeout_seconds=30)
    strategy = pd.MultiWorkerMirroredStrategy(backend=backend, communication_options=options)
    out = strategy.run(_sum_of_ids)
    assert [int(v) for v in strategy.experimental_local_results(out)] == [6, 6]
    [group] = runner.groups
    assert group.size == 4 and group.replica_offset == 0
    assert [d.split("/")[1] for d in group.devices] == ["job:worker"] * 4
    assert [d.split("/")[3] for d in group.devices] == ["task:0"] * 2 + ["task:1"] * 2
    assert group.communication_options is options
    assert strategy.extended.worker_devices == group.devices[2:]  # this worker's


def test_the_runner_names_each_replica_by_its_id_among_all_workers() -> None:
    seen: list[int] = []

    def channel(inner: ReplicaChannel, replica: int) -> ReplicaChannel:
        seen.append(replica)
        return inner

    strategy = pd.MirroredStrategy(2)
    group = dataclasses.replace(replica_group(strategy), replica_offset=4)
    runner = EagerReplicaRunner("thread", wrap_channel=channel)
    assert runner.run(group, lambda: 1, [((), {})] * 2) == [1, 1]
    assert sorted(seen) == [4, 5]  # worker 2's replicas of 2 are replicas 4 and 5


def test_a_reduction_group_cannot_run() -> None:
    group = ReplicaGroup(SimBackend(), ("/cpu:0",), 1)
    with pytest.raises(ValueError, match="needs the ReplicaGroup of a run"):
        EagerReplicaRunner().run(group, lambda: 1, [((), {})])


def test_a_copied_strategy_has_its_own_group() -> None:
    strategy = pd.MirroredStrategy(2)
    group = replica_group(strategy)
    copied = copy.deepcopy(strategy)
    assert replica_group(copied).strategy is copied
    assert replica_group(copied).backend is group.backend  # the engine is shared
    assert replica_group(strategy) is group
