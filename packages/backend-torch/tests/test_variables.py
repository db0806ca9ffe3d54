"""polydist.Variable on torch: the sim's semantics bit for bit, torch.optim, checkpoints.

Every semantics program runs three ways and must give the same bits, the same
warnings and the same errors:

* ``sim``: ``SimBackend("sequential")``, the oracle;
* ``torch``: ``TorchBackend("sequential")`` on 3 virtual CPU replicas;
* ``torch+parameters``: the same, after ``polydist_torch.parameters`` made
  every copy's storage a ``torch.nn.Parameter`` (writes then copy in place).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import polydist as pd
import polydist_torch
from polydist.checkpoint import read_arrays
from polydist.debugging import check_replicas_identical
from polydist_sim import SimBackend
from polydist_torch import TorchBackend

N = 3
MODES = ("sim", "torch", "torch+parameters")
AGG = pd.VariableAggregation
SYNC = pd.VariableSynchronization
ON_WRITE_AGGREGATIONS = (AGG.NONE, AGG.SUM, AGG.MEAN, AGG.ONLY_FIRST_REPLICA)
UPDATES = ("assign", "assign_add", "assign_sub")

# A program builds its variables under ``strategy.scope()``, hands them to
# ``ready(...)`` (which makes them torch parameters in "torch+parameters" mode),
# and returns what should be compared.
Program = Callable[[pd.Strategy, Any, Callable[..., None]], Any]


def strategy_for(mode: str, n: int = N) -> pd.MirroredStrategy:
    if mode == "sim":
        return pd.MirroredStrategy(n, backend=SimBackend("sequential"))
    # Named CPU devices: virtual CPU replicas even on a machine with CUDA.
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(n)], backend=TorchBackend("sequential"))


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


def wide(seed: int, shape: tuple[int, ...], n: int = N) -> list[np.ndarray]:
    """Per-replica float32 values over many magnitudes: any change of rounding shows."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(np.float32)
        for _ in range(n)
    ]


def distribute(strategy: pd.Strategy, xp: Any, values: list[np.ndarray]) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda c: xp.asarray(values[c.replica_id_in_sync_group])
    )


def observe(strategy: pd.Strategy, value: Any) -> Any:
    """A host record of a result: variables as (class, each copy's value), arrays as NumPy."""
    backend = strategy.extended.backend
    if isinstance(value, pd.Variable):
        parts = value.values if isinstance(value, pd.DistributedValues) else (value,)
        return (
            "variable",
            type(value).__name__,
            tuple(observe(strategy, c.value()) for c in parts),
        )
    if isinstance(value, pd.DistributedValues):
        return (type(value).__name__, tuple(observe(strategy, v) for v in value.values))
    if isinstance(value, dict):
        return {k: observe(strategy, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(observe(strategy, v) for v in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return np.asarray(backend.to_numpy(value))
    return value


def assert_bitwise(a: Any, b: Any, path: str = "result") -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{path}: {a!r} vs {b!r}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a!r} vs {b!r}"
        assert a.tobytes() == b.tobytes(), f"{path}: values differ:\n{a!r}\n{b!r}"
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _ready(mode: str) -> Callable[..., None]:
    def ready(*variables: Any) -> None:
        if mode == "torch+parameters":
            polydist_torch.parameters(list(variables))

    return ready


def run_program(mode: str, program: Program) -> tuple[Any, list[str], BaseException | None]:
    strategy = strategy_for(mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = observe(
                strategy, program(strategy, strategy.extended.array_namespace(), _ready(mode))
            )
            error = None
        except Exception as e:
            result, error = None, e
    assert not pd.has_strategy()
    return result, [f"{w.category.__name__}: {w.message}" for w in caught], error


def _message(error: BaseException | None) -> str:
    # Messages that show a value show NumPy's or torch's repr of it: compare the rest.
    return re.sub(r"(array|tensor)\(.*?\)", "<value>", str(error), flags=re.DOTALL)


def same_everywhere(program: Program) -> tuple[Any, list[str], BaseException | None]:
    """Runs ``program`` in every mode; all must agree bitwise. Returns the sim's outcome."""
    want = run_program("sim", program)
    for mode in MODES[1:]:
        got = run_program(mode, program)
        if want[2] is not None or got[2] is not None:
            assert type(got[2]) is type(want[2]), f"{mode}: {got[2]!r} vs sim {want[2]!r}"
            assert _message(got[2]) == _message(want[2]), mode
        assert got[1] == want[1], f"{mode} warned {got[1]}, sim warned {want[1]}"
        assert_bitwise(got[0], want[0], mode)
    return want


# -- creation and placement ------------------------------------------------------------------


@pytest.mark.parametrize("synchronization", [SYNC.AUTO, SYNC.ON_WRITE, SYNC.ON_READ])
def test_components_are_torch_tensors_on_the_replica_devices(synchronization: Any) -> None:
    s = strategy_for("torch")
    with s.scope():
        v = pd.Variable(
            np.arange(6, dtype=np.float32).reshape(2, 3), synchronization=synchronization
        )
    assert len(v.values) == N
    expected_class = (
        pd.SyncOnReadVariable if synchronization is SYNC.ON_READ else pd.MirroredVariable
    )
    assert type(v) is expected_class
    for r, c in enumerate(v.values):
        stored = c._read_storage()
        assert type(stored) is torch.Tensor and stored.dtype == torch.float32
        assert stored.device == torch.device("cpu") and c.device == s.extended.worker_devices[r]
        assert not stored.requires_grad
    storages = [c._read_storage() for c in v.values]
    assert len({id(t) for t in storages}) == N  # every replica has its own copy
    assert len({t.data_ptr() for t in storages}) == N
    assert [c.name for c in v.values] == [
        "Variable:0",
        "Variable/replica_1:0",
        "Variable/replica_2:0",
    ]


def test_creation_matches_the_sim() -> None:
    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            made = {
                "f32": pd.Variable(1.5),
                "i32": pd.Variable(7),
                "f64": pd.Variable(np.linspace(0, 1, 5), dtype="float64"),
                "cast": pd.Variable(np.arange(3), dtype=np.float32),
                "callable": pd.Variable(lambda: np.full((2, 2), 0.1, np.float32)),
                "from_var": None,
                "on_read": pd.Variable(
                    2.0, synchronization=SYNC.ON_READ, aggregation=AGG.MEAN, trainable=True
                ),
            }
            made["from_var"] = pd.Variable(made["f32"])
        ready(*[v for v in made.values() if v is not None])
        return {
            k: (
                v,
                v.name,
                v.trainable,
                v.synchronization,
                v.aggregation,
                v.shape,
                str(v.dtype).split(".")[-1],
            )
            for k, v in made.items()
        }

    same_everywhere(program)


def test_synchronization_none_and_int_mean_are_refused_as_on_the_sim() -> None:
    def none(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            return pd.Variable(1.0, synchronization=SYNC.NONE)

    def int_mean(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            return pd.Variable(1, aggregation=AGG.MEAN)

    assert isinstance(same_everywhere(none)[2], ValueError)
    assert isinstance(same_everywhere(int_mean)[2], ValueError)


# -- ON_WRITE (MirroredVariable) --------------------------------------------------------------


@pytest.mark.parametrize("update", UPDATES)
@pytest.mark.parametrize("aggregation", ON_WRITE_AGGREGATIONS, ids=lambda a: a.name)
def test_mirrored_update_in_replica_context(aggregation: Any, update: str) -> None:
    init = wide(1, (5,), 1)[0]
    deltas = wide(2, (5,))

    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(init, name="v", aggregation=aggregation)
        ready(v)

        def step(x: Any) -> Any:
            # What the update returns (a copy of the new value, or for an aggregated
            # update what merge_call hands back), then reads in replica context.
            returned = getattr(v, update)(x)
            return returned, v.read_value(), v.value() * 1, v + 0

        results = s.run(step, args=(distribute(s, xp, deltas),))
        return {
            "results": results,
            "v": v,
            "cross_replica_read": v.read_value(),
            "numpy": v.numpy(),
        }

    _, warned, error = same_everywhere(program)
    assert error is None
    divergent = aggregation is AGG.NONE
    assert any("ReplicaDivergenceWarning" in w for w in warned) == divergent


@pytest.mark.parametrize(
    "aggregation", [AGG.SUM, AGG.MEAN, AGG.ONLY_FIRST_REPLICA], ids=lambda a: a.name
)
def test_mirrored_table_values(aggregation: Any) -> None:
    # docs/concepts/variables.md: three replicas each write id + 1.
    expected = {AGG.SUM: 6.0, AGG.MEAN: 2.0, AGG.ONLY_FIRST_REPLICA: 1.0}[aggregation]

    def write(v: Any) -> Any:
        return v.assign(torch.tensor(float(int(ctx().replica_id_in_sync_group) + 1)))

    for mode in MODES[1:]:
        s = strategy_for(mode)
        with s.scope():
            v = pd.Variable(0.0, aggregation=aggregation)
        _ready(mode)(v)
        s.run(write, args=(v,))
        assert [float(c.numpy()) for c in v.values] == [expected] * N


def test_mirrored_none_update_diverges_and_warns_once() -> None:
    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(0.0, name="w")
        ready(v)
        s.run(lambda: v.assign(xp.astype(ctx().replica_id_in_sync_group, xp.float32) + 1))
        s.run(lambda: v.assign_add(xp.astype(ctx().replica_id_in_sync_group, xp.float32)))
        return v, v.read_value()

    result, warned, _ = same_everywhere(program)
    assert [w.split(":")[0] for w in warned] == ["ReplicaDivergenceWarning"]
    assert [float(c) for c in result[0][2]] == [1.0, 3.0, 5.0]


def test_several_updates_in_one_run_and_mixed_aggregations() -> None:
    a, b = wide(3, (4,)), wide(4, (4,))

    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            total = pd.Variable(np.zeros(4, np.float32), aggregation=AGG.SUM)
            mean = pd.Variable(np.ones(4, np.float32), aggregation=AGG.MEAN)
            first = pd.Variable(np.zeros(4, np.float32), aggregation=AGG.ONLY_FIRST_REPLICA)
            count = pd.Variable(0, aggregation=AGG.SUM)
        ready(total, mean, first, count)

        def step(x: Any, y: Any) -> Any:
            total.assign_add(x)
            total.assign_sub(y)
            mean.assign(mean * x + y)
            first.assign_add(total.value() * y)
            count.assign_add(xp.asarray(1, dtype=xp.int32) + ctx().replica_id_in_sync_group)
            return total.read_value() + mean.read_value()

        out = [s.run(step, args=(distribute(s, xp, a), distribute(s, xp, b))) for _ in range(2)]
        return out, total, mean, first, count

    same_everywhere(program)


def test_shared_values_sum_raises_and_mean_is_the_value() -> None:
    def summed(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(1.0, aggregation=AGG.SUM)
        ready(v)
        return s.run(lambda: v.assign(5.0))

    def averaged(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(1.0, aggregation=AGG.MEAN)
        ready(v)
        s.run(lambda: v.assign_add(2.5))
        return v

    assert isinstance(same_everywhere(summed)[2], ValueError)
    assert same_everywhere(averaged)[2] is None


def test_writes_check_shape_and_kind_as_on_the_sim() -> None:
    for bad in (np.zeros(3, np.float32), np.zeros((2, 2), np.float32)):

        def shape(s: pd.Strategy, xp: Any, ready: Callable[..., None], bad: Any = bad) -> Any:
            with s.scope():
                v = pd.Variable(np.zeros(2, np.float32))
            ready(v)
            return v.assign_add(bad)

        assert same_everywhere(shape)[2] is not None

    def kind(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(np.zeros(2, np.int32))
        ready(v)
        return v.assign(np.ones(2, np.float32))

    assert isinstance(same_everywhere(kind)[2], TypeError)


# -- MirroredVariable in cross-replica context ---------------------------------------------------


def test_mirrored_cross_replica_writes_and_reads() -> None:
    init, x = wide(5, (2, 3), 1)[0], wide(6, (2, 3), 1)[0]

    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(init, aggregation=AGG.MEAN)
        ready(v)
        out: dict[str, Any] = {}
        with s.scope():
            out["assign"] = v.assign(xp.asarray(x))
            out["assign_add"] = v.assign_add(xp.asarray(x), read_value=False)
            out["after_add"] = v.read_value()
        out["assign_sub"] = v.assign_sub(xp.asarray(x) * 0.5)  # outside any scope too (TF)
        out["value"] = v.value() + 0
        out["ops"] = (
            v + 1,
            v * v,
            -v,
            v @ xp.ones((3, 1), dtype=xp.float32),
            v[0] * 1,
            float(v.numpy()[0, 0]),
        )
        out["update"] = s.extended.update(v, lambda c, d: c.assign_add(d), args=(xp.asarray(x),))
        out["reduce_to"] = s.extended.reduce_to("MEAN", v.values[0].read_value(), v)
        return out, v

    same_everywhere(program)


# -- ON_READ (SyncOnReadVariable) ---------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ON_WRITE_AGGREGATIONS, ids=lambda a: a.name)
def test_sync_on_read_local_writes_and_aggregated_reads(aggregation: Any) -> None:
    deltas = wide(7, (4,))

    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(
                np.full(4, 0.25, np.float32), synchronization=SYNC.ON_READ, aggregation=aggregation
            )
        ready(v)

        def step(x: Any) -> Any:
            v.assign_add(x)
            v.assign_sub(x * 0.5)
            local = v.read_value()
            v.assign(v * 2)
            return local, v.value() + 0

        results = s.run(step, args=(distribute(s, xp, deltas),))
        out: dict[str, Any] = {"results": results, "v": v}
        out["locals"] = s.experimental_local_results(v)
        if aggregation is not AGG.NONE:
            out["read"] = v.read_value()
            out["reduce"] = s.reduce(
                aggregation.name if aggregation is not AGG.ONLY_FIRST_REPLICA else "SUM",
                v,
                axis=None,
            )
        return out

    assert same_everywhere(program)[2] is None


def test_sync_on_read_none_has_no_cross_replica_value() -> None:
    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.NONE)
        ready(v)
        return v.read_value()

    assert isinstance(same_everywhere(program)[2], ValueError)


@pytest.mark.parametrize(
    "aggregation", [AGG.SUM, AGG.MEAN, AGG.ONLY_FIRST_REPLICA], ids=lambda a: a.name
)
@pytest.mark.parametrize("update", UPDATES)
def test_sync_on_read_cross_replica_writes(aggregation: Any, update: str) -> None:
    x = wide(8, (3,), 1)[0]

    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            v = pd.Variable(
                np.ones(3, np.float32), synchronization=SYNC.ON_READ, aggregation=aggregation
            )
            # TF refuses integer MEAN variables at creation.
            int_aggregation = AGG.SUM if aggregation is AGG.MEAN else aggregation
            i = pd.Variable(
                np.ones(3, np.int32), synchronization=SYNC.ON_READ, aggregation=int_aggregation
            )
        ready(v, i)
        with s.scope():
            returned = getattr(v, update)(xp.asarray(x))
            int_returned = None
            if update == "assign" or int_aggregation is not AGG.SUM:
                int_returned = getattr(i, update)(xp.asarray([7, 8, 10], dtype=xp.int32))
        return returned, int_returned, v, i

    _, _, error = same_everywhere(program)
    # SUM: assign stores x / N in every copy; assign_add/sub raise (TF).
    assert (error is not None) == (aggregation is AGG.SUM and update != "assign")


def test_sync_on_read_sum_counts_the_initial_value_once_per_replica() -> None:
    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            seen = pd.Variable(2.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        ready(seen)
        for _ in range(3):
            s.run(lambda: seen.assign_add(1.0))
        return seen, seen.read_value(), seen.numpy()

    result = same_everywhere(program)[0]
    assert float(result[2]) == N * 2.0 + 3 * N


def test_all_reduce_and_reduce_to_of_variables() -> None:
    def program(s: pd.Strategy, xp: Any, ready: Callable[..., None]) -> Any:
        with s.scope():
            m = pd.Variable(np.arange(3, dtype=np.float32), aggregation=AGG.SUM)
            r = pd.Variable(
                np.ones(3, np.float32), synchronization=SYNC.ON_READ, aggregation=AGG.SUM
            )
        ready(m, r)

        def step() -> Any:
            r.assign_add(xp.astype(ctx().replica_id_in_sync_group, xp.float32) / 3)
            return ctx().all_reduce("SUM", r), ctx().all_reduce("MEAN", m)

        out = s.run(step)
        return (
            out,
            s.extended.reduce_to("MEAN", r, m),
            s.extended.read_var(r),
            s.reduce("SUM", r, None),
        )

    same_everywhere(program)


# -- storage rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES[1:])
def test_stored_values_never_carry_autograd_history(mode: str) -> None:
    s = strategy_for(mode)
    with s.scope():
        v = pd.Variable(np.zeros(3, np.float32))
    _ready(mode)(v)
    leaf = torch.ones(3, requires_grad=True)
    with s.scope():
        v.assign(leaf * 2)
    for c in v.values:
        stored = c._read_storage()
        assert stored.grad_fn is None
        assert stored.requires_grad == (mode == "torch+parameters")
    assert v.numpy().tolist() == [2.0, 2.0, 2.0]


def test_plain_storage_is_replaced_like_the_sims() -> None:
    # Without parameters, a write stores a new tensor, so an earlier value() keeps its
    # value, exactly as on the sim.
    s = strategy_for("torch")
    with s.scope():
        v = pd.Variable(np.zeros(2, np.float32))
        before = v.value()
        v.assign_add(np.ones(2, np.float32))
    assert before.tolist() == [0.0, 0.0] and v.numpy().tolist() == [1.0, 1.0]


def test_swap_storage_swaps_parameters_without_copying() -> None:
    # swap_storage (the functionalization hook) swaps, never copies in place.
    from polydist.backend.tracing import swap_storage

    s = strategy_for("torch")
    with s.scope():
        v = pd.Variable(np.zeros(2, np.float32))
    params = polydist_torch.parameters(v)
    new = [torch.full((2,), float(r)) for r in range(N)]
    old = swap_storage(v, new)
    assert [o is p[0] for o, p in zip(old, params)] == [True] * N
    assert [c._read_storage() is t for c, t in zip(v.values, new)] == [True] * N
    assert [o.tolist() for o in old] == [[0.0, 0.0]] * N  # untouched


# -- polydist_torch.parameters -----------------------------------------------------------------


def test_parameters_are_the_storage_and_writes_are_in_place() -> None:
    s = strategy_for("torch")
    with s.scope():
        w = pd.Variable(np.arange(4, dtype=np.float32), name="w", aggregation=AGG.MEAN)
        snapshot = w.value()
    params = polydist_torch.parameters(w)
    assert len(params) == N and all(len(p) == 1 for p in params)
    for r, (p,) in enumerate(params):
        assert type(p) is torch.nn.Parameter and p.requires_grad and p.is_leaf
        assert p is w.values[r]._read_storage()
    again = polydist_torch.parameters(w)  # the same objects again
    assert all(p[0] is q[0] for p, q in zip(again, params))
    assert snapshot is not params[0][0]  # the parameter is a copy: the snapshot stays
    with s.scope():
        w.assign(np.full(4, 5.0, np.float32))
    assert [p[0] is w.values[r]._read_storage() for r, p in enumerate(params)] == [True] * N
    assert [p[0].tolist() for p in params] == [[5.0] * 4] * N
    assert snapshot.tolist() == [0.0, 1.0, 2.0, 3.0]
    # An optimizer's in-place update is the variable's new value.
    with torch.no_grad():
        for (p,) in params:
            p.sub_(1.0)
    assert w.numpy().tolist() == [4.0] * 4
    # In replica context the variable is the replica's parameter.
    seen = s.run(lambda: w.value())
    assert [x is p[0] for x, p in zip(s.experimental_local_results(seen), params)] == [True] * N


def test_parameters_of_a_strategy() -> None:
    s = strategy_for("torch")
    with s.scope():
        a = pd.Variable(np.zeros((2, 2), np.float32), name="a")
        pd.Variable(0, name="step")  # integer: not a parameter of the strategy
        pd.Variable(0.0, name="frozen", trainable=False)
        pd.Variable(0.0, name="metric", synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        b = pd.Variable(np.zeros(2, np.float64), name="b")
    params = polydist_torch.parameters(s)
    assert [[p.shape for p in ps] for ps in params] == [[(2, 2), (2,)]] * N
    for r in range(N):
        assert params[r][0] is a.values[r]._read_storage()
        assert params[r][1] is b.values[r]._read_storage()
    assert params[0][1].dtype == torch.float64
    # Explicit non-trainable or integer variables become parameters without gradients.
    with s.scope():
        step = pd.Variable(0, name="step2")
    (p,) = polydist_torch.parameters([step])[0]
    assert type(p) is torch.nn.Parameter and not p.requires_grad and p.dtype == torch.int32
    with s.scope():
        step.assign_add(3)
    assert p.item() == 3


def test_parameters_of_a_strategy_without_variables() -> None:
    assert polydist_torch.parameters(strategy_for("torch")) == [[], [], []]
    assert polydist_torch.parameters([]) == []


def test_parameters_of_one_device_and_plain_variables() -> None:
    s = pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend())
    with s.scope():
        v = pd.Variable(np.ones(2, np.float32))
    ((p,),) = polydist_torch.parameters(s)
    assert p is v._read_storage()
    with s.scope():
        v.assign_add(np.ones(2, np.float32))
    assert p.tolist() == [2.0, 2.0]


def test_parameters_refusals() -> None:
    s = strategy_for("torch")
    with s.scope():
        v = pd.Variable(np.zeros(2, np.float32), name="v")
    one = pd.OneDeviceStrategy("/cpu:0", backend=TorchBackend())
    with one.scope():
        single = pd.Variable(0.0, name="single")
    with pytest.raises(RuntimeError, match="outside strategy.run"):
        s.run(lambda: polydist_torch.parameters(v))
    with pytest.raises(ValueError, match="different numbers of copies"):
        polydist_torch.parameters([v, single])
    with pytest.raises(
        TypeError, match=r"nest \(list/tuple/dict/state dict/torch pytree\) of variables"
    ):
        polydist_torch.parameters([v, np.zeros(2)])
    sim = strategy_for("sim")
    with sim.scope():
        on_sim = pd.Variable(0.0, name="on_sim")
    with pytest.raises(TypeError, match="only variables of the torch backend"):
        polydist_torch.parameters(on_sim)
    # Once they are parameters, asking again inside the run is fine.
    params = polydist_torch.parameters({"v": v})
    got = s.run(lambda: polydist_torch.parameters(v)[int(ctx().replica_id_in_sync_group)][0])
    assert list(s.experimental_local_results(got)) == [p[0] for p in params]


def test_read_value_of_a_parameter_is_differentiable_without_warnings() -> None:
    s = strategy_for("torch")
    with s.scope():
        w = pd.Variable(np.array([1.0, 2.0], np.float32))
    params = polydist_torch.parameters(w)

    def step() -> Any:
        loss = (w.read_value() * 3).sum() + (w * w).sum()
        loss.backward()
        return loss.detach()

    s.run(step)
    assert [p[0].grad.tolist() for p in params] == [[5.0, 7.0]] * N  # type: ignore[union-attr]


# -- torch.optim --------------------------------------------------------------------------------

GLOBAL_BATCH = 24
FEATURES = 5
LR = 0.05


def regression_data(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    true_w = rng.standard_normal((FEATURES, 1)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
        y = (x @ true_w + 0.1 * rng.standard_normal((GLOBAL_BATCH, 1))).astype(np.float32)
        out.append((x, y))
    return out


def shard_loss(w: Any, b: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # TF's compute_average_loss: per-example losses over the global batch size.
    return ((x @ w + b - y) ** 2).sum() / GLOBAL_BATCH


@pytest.mark.parametrize("replicas", [1, 4])
def test_sgd_on_per_replica_parameters_matches_a_hand_written_step(replicas: int) -> None:
    steps = 6
    data = regression_data(steps)
    s = strategy_for("torch", replicas)
    w0 = np.linspace(-1, 1, FEATURES, dtype=np.float32).reshape(FEATURES, 1)
    with s.scope():
        w = pd.Variable(w0, name="w")
        b = pd.Variable(np.zeros(1, np.float32), name="b")
    params = polydist_torch.parameters(s)
    optimizers = [torch.optim.SGD(p, lr=LR) for p in params]

    def step(x: Any, y: Any) -> Any:
        r = int(ctx().replica_id_in_sync_group)
        optimizers[r].zero_grad()
        loss = shard_loss(w, b, x, y)  # the variables are this replica's parameters
        loss.backward()
        mine = params[r]
        for p, g in zip(mine, ctx().all_reduce("SUM", [p.grad for p in mine])):
            p.grad = g
        optimizers[r].step()
        return loss.detach()

    for x, y in data:
        xs = pd.PerReplica(list(torch.from_numpy(x).chunk(replicas)))
        ys = pd.PerReplica(list(torch.from_numpy(y).chunk(replicas)))
        s.run(step, args=(xs, ys))

    # The copies stay bitwise identical, and the variables are the parameters.
    assert check_replicas_identical(s) == 2
    for r, (pw, pb) in enumerate(params):
        assert pw is w.values[r]._read_storage() and pb is b.values[r]._read_storage()

    # By hand: per-shard gradients, summed in replica order, then p - lr * g.
    w_ref = torch.from_numpy(w0.copy())
    b_ref = torch.zeros(1)
    for x, y in data:
        grads = []
        for xs, ys in zip(torch.from_numpy(x).chunk(replicas), torch.from_numpy(y).chunk(replicas)):
            wl, bl = w_ref.clone().requires_grad_(), b_ref.clone().requires_grad_()
            shard_loss(wl, bl, xs, ys).backward()
            grads.append((wl.grad, bl.grad))
        gw, gb = grads[0][0].clone(), grads[0][1].clone()  # type: ignore[union-attr]
        for dw, db in grads[1:]:
            gw = gw + dw
            gb = gb + db
        w_ref = w_ref.add(gw, alpha=-LR)  # what SGD's step does: param.add_(grad, alpha=-lr)
        b_ref = b_ref.add(gb, alpha=-LR)
    assert w.numpy().tobytes() == w_ref.numpy().tobytes()
    assert b.numpy().tobytes() == b_ref.numpy().tobytes()


def test_optimizer_and_polydist_writes_share_the_storage() -> None:
    s = strategy_for("torch")
    with s.scope():
        w = pd.Variable(np.ones(3, np.float32), name="w", aggregation=AGG.MEAN)
    params = polydist_torch.parameters(s)
    optimizers = [torch.optim.SGD(p, lr=0.5, momentum=0.9) for p in params]

    def step() -> Any:
        r = int(ctx().replica_id_in_sync_group)
        optimizers[r].zero_grad()
        (w * w).sum().backward()  # grad 2w
        optimizers[r].step()
        return w.read_value()

    s.run(step)
    assert w.numpy().tolist() == [0.0, 0.0, 0.0]  # 1 - 0.5 * 2
    # A polydist write in cross-replica context lands in the optimizers' parameters...
    with s.scope():
        w.assign(np.full(3, 2.0, np.float32))
    assert [p[0].tolist() for p in params] == [[2.0] * 3] * N
    # ...and the optimizers go on with their momentum buffers for the same objects.
    assert all(p[0] in o.state for p, o in zip(params, optimizers))
    s.run(step)
    # buf = 0.9 * 2 + 4 = 5.8; w = 2 - 0.5 * 5.8 = -0.9
    np.testing.assert_allclose(w.numpy(), [-0.9] * 3, rtol=1e-6)
    # An aggregated polydist update inside run (MEAN of per-replica deltas) too.
    s.run(lambda: w.assign_sub(xp_float(ctx().replica_id_in_sync_group)))
    np.testing.assert_allclose([p[0].tolist() for p in params], [[-1.9] * 3] * N, rtol=1e-6)
    assert check_replicas_identical(s) == 1


def xp_float(x: Any) -> torch.Tensor:
    return torch.full((3,), float(x))


# -- checkpoints --------------------------------------------------------------------------------


def _train_a_little(s: pd.Strategy, mode: str) -> dict[str, Any]:
    xp = s.extended.array_namespace()
    with s.scope():
        made = {
            "dense/kernel": pd.Variable(
                np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3),
                name="dense/kernel",
                aggregation=AGG.MEAN,
            ),
            "seen": pd.Variable(
                0.0, name="seen", synchronization=SYNC.ON_READ, aggregation=AGG.SUM
            ),
            "avg": pd.Variable(
                np.zeros(2, np.float64),
                name="avg",
                synchronization=SYNC.ON_READ,
                aggregation=AGG.MEAN,
            ),
            "steps": pd.Variable(0, name="steps", aggregation=AGG.ONLY_FIRST_REPLICA),
        }
    _ready(mode)(*made.values())
    deltas = wide(9, (2, 3), s.num_replicas_in_sync)

    def step(x: Any) -> None:
        made["dense/kernel"].assign_sub(x * 0.01)
        made["seen"].assign_add(1.0)
        made["avg"].assign_add(
            xp.ones(2, dtype=xp.float64) * xp.astype(ctx().replica_id_in_sync_group, xp.float64) / 7
        )
        made["steps"].assign_add(1)

    for _ in range(2):
        s.run(step, args=(distribute(s, xp, deltas),))
    return made


@pytest.mark.parametrize("mode", MODES[1:])
def test_checkpoint_round_trip(tmp_path: Path, mode: str) -> None:
    sim = strategy_for("sim")
    _sim_variables = _train_a_little(sim, "sim")  # the strategy saves the live variables
    pd.checkpoint.save(tmp_path / "sim", sim, step=2)

    s = strategy_for(mode)
    made = _train_a_little(s, mode)
    path = pd.checkpoint.save(tmp_path / "torch", s, step=2)
    assert path is not None
    saved, want = read_arrays(path), read_arrays(tmp_path / "sim")
    assert saved.keys() == want.keys()
    for k in saved:
        assert (saved[k].dtype, saved[k].tobytes()) == (want[k].dtype, want[k].tobytes()), k

    # Restore into a fresh torch strategy with another replica count, and into the sim.
    for target_mode, n in ((mode, 2), ("sim", 4)):
        other = strategy_for(target_mode, n)
        with other.scope():
            fresh = {
                "dense/kernel": pd.Variable(
                    np.zeros((2, 3), np.float32), name="dense/kernel", aggregation=AGG.MEAN
                ),
                "seen": pd.Variable(
                    0.0, name="seen", synchronization=SYNC.ON_READ, aggregation=AGG.SUM
                ),
                "avg": pd.Variable(
                    np.zeros(2, np.float64),
                    name="avg",
                    synchronization=SYNC.ON_READ,
                    aggregation=AGG.MEAN,
                ),
                "steps": pd.Variable(0, name="steps", aggregation=AGG.ONLY_FIRST_REPLICA),
            }
        params = (
            polydist_torch.parameters(list(fresh.values()))
            if target_mode == "torch+parameters"
            else None
        )
        pd.checkpoint.restore(tmp_path / "torch", other)
        for k, v in fresh.items():
            assert v.numpy().tobytes() == made[k].numpy().tobytes(), (target_mode, k)
        if params is not None:
            # Restored in place: the parameters are still the variables' storage.
            assert params[1][0] is fresh["dense/kernel"].values[1]._read_storage()
            assert params[1][0].tolist() == made["dense/kernel"].numpy().tolist()


# bfloat16 bits: NaNs (quiet, negative with a payload, signalling), +-inf, -0.0, the
# smallest subnormal, 1.5.
BF16_SPECIAL = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3FC0], np.uint16)


def test_checkpoint_bfloat16_bit_for_bit(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    tensor = torch.from_numpy(BF16_SPECIAL.view(np.int16)).view(torch.bfloat16)
    s = strategy_for("torch")
    with s.scope():
        _w = pd.Variable(tensor, name="w")  # the strategy saves the live variables
    assert pd.checkpoint.save(tmp_path, s) is not None
    saved = read_arrays(tmp_path)["w"]
    assert saved.dtype == np.dtype(ml_dtypes.bfloat16)
    assert saved.view(np.uint16).tolist() == BF16_SPECIAL.tolist()

    # Into 2 torch replicas (bfloat16 tensors) and 4 sim ones (ml_dtypes arrays).
    for target_mode, n in (("torch", 2), ("sim", 4)):
        other = strategy_for(target_mode, n)
        with other.scope():
            w2 = pd.Variable(np.zeros(8, ml_dtypes.bfloat16), name="w")
        pd.checkpoint.restore(tmp_path, other)
        for c in w2.values:
            stored = c._read_storage()
            if target_mode == "torch":
                assert stored.dtype == torch.bfloat16
                stored = stored.view(torch.int16).numpy().view(np.uint16)
            assert stored.view(np.uint16).tolist() == BF16_SPECIAL.tolist(), target_mode


def test_checkpoint_bfloat16_without_ml_dtypes_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polydist_torch import _low_precision

    s = strategy_for("torch")
    with s.scope():
        w = pd.Variable(torch.tensor([1.5, 2.0], dtype=torch.bfloat16), name="w")
    # Without ml_dtypes, to_numpy widens bfloat16 to float32: that would not restore.
    monkeypatch.setattr(_low_precision, "_ml_dtypes", lambda: None)
    with pytest.raises(TypeError, match=r"'w:0' has dtype bfloat16.*pip install ml_dtypes"):
        pd.checkpoint.save(tmp_path, {"w": w})
    assert not tmp_path.joinpath("checkpoint").exists()


@pytest.mark.parametrize("sync", [SYNC.ON_WRITE, SYNC.ON_READ])
def test_every_copy_keeps_a_dtype_numpy_lacks(sync: pd.VariableSynchronization) -> None:
    # Copies 1.. are made through NumPy, which has no bfloat16 of its own (ml_dtypes adds it).
    cpus = [f"/cpu:{i}" for i in range(N)]
    strategy = pd.MirroredStrategy(cpus, backend=TorchBackend("sequential"))
    with strategy.scope():
        v = pd.Variable(
            torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
            synchronization=sync,
            aggregation=AGG.SUM if sync is SYNC.ON_READ else AGG.NONE,
        )
    copies = strategy.experimental_local_results(v)
    assert [c.dtype for c in copies] == [torch.bfloat16] * N
    assert [c.read_value().tolist() for c in copies] == [[1.5, 2.0]] * N
