"""Backend selection: explicit argument, then $POLYDIST_BACKEND, then sim."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from typing import Any

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
    assert f"from a polydist checkout: pip install ./packages/backend-{name}" in message


def test_core_registers_the_sim_itself() -> None:
    (ep,) = [
        e for e in importlib.metadata.entry_points(group="polydist.backends") if e.name == "sim"
    ]
    assert ep.value == "polydist._sim:SimBackend"
    assert ep.dist is not None and ep.dist.name == "polydist"


# polydist_sim (and any package above core) cannot be imported: what `pip install polydist`
# alone gives.
_CORE_ALONE = """
import sys

# As if not installed: imports fail and importlib.util.find_spec gives None.
sys.modules["polydist_sim"] = None
sys.modules["polydist_conformance"] = None
"""


def test_core_alone_runs_mirrored_strategy_on_the_sim() -> None:
    code = _CORE_ALONE + (
        "import numpy as np, polydist as pd\n"
        "strategy = pd.MirroredStrategy()\n"
        "assert strategy.extended.backend.name == 'sim'\n"
        "eight = pd.MirroredStrategy(8)\n"
        "out = eight.run(lambda: pd.get_replica_context().all_reduce('SUM', np.float32(1.5)))\n"
        "assert float(eight.reduce('MEAN', out, axis=None)) == 12.0\n"
        "assert sys.modules['polydist_sim'] is None\n"
        "print(type(eight.extended.backend).__module__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "polydist._sim._backend"


def test_core_alone_runs_the_demo_with_an_unpriced_trace(tmp_path: Any) -> None:
    trace = tmp_path / "trace.json"
    argv = ["demo", "--replicas", "2", "--steps", "2", "--trace", str(trace)]
    code = _CORE_ALONE + f"from polydist._tools.cli import main\nraise SystemExit(main({argv!r}))\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "polydist trace: 6 collectives in 2 steps" in done.stdout
    # No cost model: the trace is not priced, and the output says where the model is.
    assert "Predicted communication time" not in done.stdout
    assert "no predicted times: the sim's cost model is in polydist-sim" in done.stdout
    assert trace.is_file()


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


# -- batch_all_reduce and pack_by_size ---------------------------------------------------


def test_pack_by_size_follows_tfs_group_by_size() -> None:
    from polydist.backend import pack_by_size

    assert pack_by_size([4, 8, 16], 0) == [[0, 1, 2]]  # 0: one pack
    assert pack_by_size([], 0) == []
    # A new pack starts once the last one holds more than bytes_per_pack.
    assert pack_by_size([4, 4, 4, 4, 100, 1], 8) == [[0, 1, 2], [3, 4], [5]]
    assert pack_by_size([100, 100], 1) == [[0], [1]]
    with pytest.raises(ValueError, match="bytes_per_pack must be >= 0, got -1"):
        pack_by_size([1], -1)


class _Summing:
    """The two list collectives a `batch_all_reduce` caller needs, over NumPy arrays."""

    name = "summing"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_reduce(self, values: Any, destinations: Any) -> list[Any]:
        self.calls.append("all_reduce")
        total = sum(values[1:], values[0])
        return [total.copy() for _ in destinations]


class _Batching(_Summing):
    def __init__(self, results: int | None = None) -> None:
        super().__init__()
        self.results = results
        self.packs: list[int] = []

    def batch_all_reduce(self, columns: Any, destinations: Any, bytes_per_pack: int) -> Any:
        self.packs.append(bytes_per_pack)
        out = [self.all_reduce(c, destinations) for c in columns]
        return out if self.results is None else out[: self.results]


def test_batch_all_reduce_uses_the_backends_method_for_several_arrays() -> None:
    from polydist.backend import batch_all_reduce

    columns = [[np.ones(2), np.ones(2)], [np.arange(3.0), np.arange(3.0)]]
    plain = _Summing()
    sums = batch_all_reduce(plain, columns, ["/cpu:0"], 64)  # type: ignore[arg-type]
    assert [s[0].tolist() for s in sums] == [[2.0, 2.0], [0.0, 2.0, 4.0]]
    batching = _Batching()
    batched = batch_all_reduce(batching, columns, ["/cpu:0", "/cpu:1"], 64)  # type: ignore[arg-type]
    assert [len(s) for s in batched] == [2, 2] and batching.packs == [64]
    assert batched[1][1].tolist() == [0.0, 2.0, 4.0]
    batching = _Batching()
    batch_all_reduce(batching, columns[:1], ["/cpu:0"], 64)  # type: ignore[arg-type]
    assert batching.packs == [] and batching.calls == ["all_reduce"]  # one array: as is
    with pytest.raises(RuntimeError, match="batch_all_reduce returned 1 results for 2 columns"):
        batch_all_reduce(_Batching(results=1), columns, ["/cpu:0"], 0)  # type: ignore[arg-type]


def test_pack_by_dtype_packs_each_dtype_in_order_of_first_appearance() -> None:
    from polydist.backend import pack_by_dtype

    dtypes = ["f4", "i4", "f4", None, "i4", "f4"]
    sizes = [4, 8, 4, 4, 8, 100]
    assert pack_by_dtype(dtypes, sizes, 0) == [[0, 2, 5], [1, 4], [3]]
    # Within a dtype, TF's group_by_size: a new pack once the last holds more than 6 bytes.
    assert pack_by_dtype(dtypes, sizes, 6) == [[0, 2], [5], [1], [4], [3]]
    assert pack_by_dtype([], [], 0) == []
    with pytest.raises(ValueError, match="got 2 dtypes and 1 sizes; pass one of each"):
        pack_by_dtype(["f4", "f4"], [4], 0)


# -- optional features: checked once, never probed by name --------------------------------

_OPTIONAL_METHODS = (
    "batch_all_reduce",
    "place_per_replica",
    "placed_dtype",
    "store_variable",
    "with_reduction_order",
    "with_cross_device_ops",
    "local_tpu_system",
    "is_symbolic",
)


def test_features_of_the_sim_are_frozen_and_cached() -> None:
    import dataclasses

    from polydist.backend import Features, features

    sim = get_backend("sim")
    found = features(sim)
    assert found is features(sim)
    assert found == Features(
        cluster=True, reduction_order=True, simulated_devices=True, replica_runner=True
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.batch_all_reduce = True  # type: ignore[misc]
    assert features(_Batching()).batch_all_reduce and not features(_Summing()).batch_all_reduce


def test_core_checks_optional_features_once_not_per_call() -> None:
    from polydist_sim import SimBackend

    asked: list[str] = []

    class Watched(SimBackend):
        def __getattribute__(self, name: str) -> Any:
            if name in _OPTIONAL_METHODS:
                asked.append(name)
            return super().__getattribute__(name)

    strategy = pd.MirroredStrategy(2, backend=Watched())
    with strategy.scope():
        v = pd.Variable(1.0)

    def step() -> Any:
        ctx = pd.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce(pd.ReduceOp.SUM, (np.float32(1.0), np.float32(2.0)))

    def steps() -> Any:
        a, b = strategy.run(step)
        v.assign(2.0)
        strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2))
        return a, b

    steps()
    checked = list(asked)  # the backend's features, checked when it was first used
    for _ in range(3):
        a, b = steps()
    assert float(strategy.experimental_local_results(a)[0]) == 2.0
    assert float(strategy.experimental_local_results(b)[1]) == 4.0
    assert float(v.numpy()) == 2.0
    assert asked == checked, f"optional methods probed again: {asked[len(checked) :]}"


def test_local_tpu_system_reads_the_feature() -> None:
    from polydist.backend import local_tpu_system
    from polydist.tpu import LocalTPUSystem
    from polydist_sim import SimBackend

    assert local_tpu_system(SimBackend()) is None

    class Wrong(SimBackend):
        def local_tpu_system(self) -> LocalTPUSystem:
            return "not a system"  # type: ignore[return-value]

    with pytest.raises(TypeError, match="must return a polydist.tpu.LocalTPUSystem"):
        local_tpu_system(Wrong())


def test_tracing_kit_tells_variable_creation_and_replica_writes() -> None:
    from polydist.backend.eager import EagerReplicaRunner
    from polydist.backend.tracing import is_variable_creation, replica_writes
    from polydist_sim import SimBackend

    seen: list[bool] = []

    class Watching:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def all_reduce(self, reduce_op: Any, values: Any) -> Any:
            return self.inner.all_reduce(reduce_op, values)

        def all_gather(self, values: Any, axis: int) -> Any:
            return self.inner.all_gather(values, axis)

        def merge_call(self, merge_fn: Any, args: Any, kwargs: Any) -> Any:
            seen.append(is_variable_creation(merge_fn))
            return self.inner.merge_call(merge_fn, args, kwargs)

    backend = SimBackend()
    backend.replica_runner = EagerReplicaRunner(
        wrap_channel=lambda channel, index: Watching(channel)
    )
    strategy = pd.MirroredStrategy(2, backend=backend)
    with strategy.scope():
        kept = pd.Variable(0.0, aggregation=pd.VariableAggregation.NONE)

    def step() -> None:
        pd.Variable(1.0)  # created once, in a merge_call
        ctx = pd.get_replica_context()
        assert ctx is not None
        ctx.merge_call(lambda s: None)
        kept.assign(1.0)  # a NONE-aggregated write in replica context

    written: list[tuple[int, ...]] = []

    def step_and_look() -> None:
        step()
        written.append(replica_writes(strategy.extended))

    strategy.run(step_and_look)
    assert seen == [True, True, False, False]
    assert written[-1] == (id(kept),)
