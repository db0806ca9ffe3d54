"""Nests: dicts, OrderedDicts, namedtuples, lists and a framework's pytrees keep their types.

A nest flows through ``strategy.run`` arguments and results,
``ReplicaContext.all_reduce`` and ``all_gather``, ``strategy.reduce`` (``axis=None``
and an axis), ``strategy.gather`` and
``experimental_distribute_values_from_function``, coming back with the same
container types and structure. A backend whose framework has a pytree registry
(``nnx.State``, optax states, classes registered with ``jax.tree_util`` or
``torch.utils._pytree``) supplies samples through the entry point group
``polydist_conformance.pytrees`` (see ``docs/extending.md``); these cases run them too,
and are skipped for a backend that supplies none.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest

import polydist as pd
from polydist import checkpoint
from polydist.backend import nest as _nest
from polydist_conformance import Conformance
from polydist_conformance.cases._helpers import replica_context


class Batch(NamedTuple):
    features: Any
    labels: Any


def _leaf(replica: int, i: int) -> np.ndarray:
    return np.full((2,), (replica + 1) * (i + 1), np.float32)


def _nest_of(leaf: Callable[[], Any]) -> Any:
    """Every kind of nest ``tf.nest`` and ``torch.utils._pytree`` agree on."""
    return {
        "layer": OrderedDict(kernel=leaf(), bias=leaf()),
        "batch": Batch(leaf(), {"weights": [leaf(), (leaf(),)]}),
    }


def _counter(xp: Any, replica: int) -> Callable[[], Any]:
    count = iter(range(1_000))
    return lambda: xp.asarray(_leaf(replica, next(count)))


def _host(replica: int) -> Any:
    return _nest_of(_counter(np, replica))


def _leaves(nest: Any) -> list[Any]:
    return _nest.flatten(nest)[0]


def _expected(
    n: int, per_replica: Callable[[int, int], np.ndarray], always_wrap: bool = False
) -> Any:
    """The nest with leaf ``i`` (in flattening order) the distributed value of
    ``per_replica(r, i)``."""
    spec = _nest.flatten(_host(0))[1]
    leaves = []
    for i in range(spec.num_leaves):
        values = [per_replica(r, i) for r in range(n)]
        leaves.append(pd.PerReplica(values) if always_wrap or n > 1 else values[0])
    return _nest.unflatten(spec, leaves)


def _distributed(strategy: pd.Strategy, xp: Any, build: Callable[..., Any]) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: build(_counter(xp, ctx.replica_id_in_sync_group))
    )


def test_values_from_function_and_run_keep_the_types(conformance: Conformance) -> None:
    n = conformance.replicas

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        value = _distributed(strategy, xp, _nest_of)

        def step(nest: Any) -> Any:
            return _nest.map_structure(lambda x: x * 2, nest)

        return {"given": value, "returned": strategy.run(step, args=(value,))}

    rows = [_leaves(_host(r)) for r in range(n)]
    conformance.check(
        program,
        expected={
            "given": _expected(n, lambda r, i: rows[r][i], always_wrap=True),
            "returned": _expected(n, lambda r, i: rows[r][i] * 2),
        },
    )


def test_all_reduce_and_all_gather(conformance: Conformance) -> None:
    n = conformance.replicas
    rows = [_leaves(_host(r)) for r in range(n)]
    total = [sum(row[i] for row in rows) for i in range(5)]
    gathered = [np.concatenate([row[i] for row in rows]) for i in range(5)]

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        value = _distributed(strategy, xp, _nest_of)

        def step(nest: Any) -> Any:
            ctx = replica_context()
            return ctx.all_reduce("SUM", nest), ctx.all_gather(nest, axis=0)

        return strategy.run(step, args=(value,))

    conformance.check(
        program,
        expected=(
            _expected(n, lambda r, i: total[i]),
            _expected(n, lambda r, i: gathered[i]),
        ),
    )


def test_reduce_and_gather_in_cross_replica_context(conformance: Conformance) -> None:
    n = conformance.replicas
    rows = [_leaves(_host(r)) for r in range(n)]
    stacked = [np.concatenate([row[i] for row in rows]) for i in range(len(rows[0]))]
    spec = _nest.flatten(_host(0))[1]

    def program(strategy: pd.Strategy, xp: Any) -> Any:
        value = _distributed(strategy, xp, _nest_of)
        return {
            "axis_none": strategy.reduce("SUM", value, axis=None),
            "axis_0": strategy.reduce("MEAN", value, axis=0),
            "gather": strategy.gather(value, axis=0),
        }

    conformance.check(
        program,
        expected={
            "axis_none": _nest.unflatten(spec, [sum(row[i] for row in rows) for i in range(5)]),
            "axis_0": _nest.unflatten(spec, [np.float32(s.mean()) for s in stacked]),
            "gather": _nest.unflatten(spec, stacked),
        },
    )


# -- a framework's pytrees, from the backend's optional hook -----------------------------------


def _framework(conformance: Conformance) -> dict[str, Any]:
    samples = conformance.framework_pytrees
    if not samples:
        pytest.skip(
            f"backend {conformance.backend.name!r} supplies no framework pytrees (entry point "
            "group polydist_conformance.pytrees)"
        )
    return samples


def _describe(tree: Any, template: Any) -> dict[str, Any]:
    """A framework pytree as plain data: whether its type and structure are the
    template's (its spec: node types, keys, static fields), and its leaves."""
    leaves, spec = _nest.flatten(tree)
    return {
        "type": type(tree).__qualname__,
        "same_structure": spec == _nest.flatten(template)[1],
        "leaves": leaves,
    }


def test_framework_pytrees_through_run_and_collectives(conformance: Conformance) -> None:
    samples = _framework(conformance)
    n = conformance.replicas

    for name, build in samples.items():
        template = build(lambda: np.zeros((2,), np.float32))
        count = len(_leaves(template))

        def program(
            strategy: pd.Strategy, xp: Any, build: Any = build, template: Any = template
        ) -> Any:
            value = _distributed(strategy, xp, build)

            def step(tree: Any) -> Any:
                ctx = replica_context()
                return tree, ctx.all_reduce("SUM", tree), ctx.all_gather(tree, axis=0)

            given, summed, gathered = strategy.run(step, args=(value,))
            local = strategy.experimental_local_results
            return {
                "given": [_describe(t, template) for t in local(given)],
                "summed": [_describe(t, template) for t in local(summed)],
                "gathered": [_describe(t, template) for t in local(gathered)],
                "reduced": _describe(strategy.reduce("SUM", value, axis=None), template),
                "reduced_axis_0": _describe(strategy.reduce("SUM", value, axis=0), template),
                "gather": _describe(strategy.gather(value, axis=0), template),
            }

        kind = type(template).__qualname__
        rows = [_leaves(build(_counter(np, r))) for r in range(n)]
        total = [sum(row[i] for row in rows) for i in range(count)]
        stacked = [np.concatenate([row[i] for row in rows]) for i in range(count)]

        def described(leaves: list[Any], kind: str = kind) -> dict[str, Any]:
            return {"type": kind, "same_structure": True, "leaves": leaves}

        try:
            conformance.check(
                program,
                expected={
                    "given": [described(rows[r]) for r in range(n)],
                    "summed": [described(total)] * n,
                    "gathered": [described(stacked)] * n,
                    "reduced": described(total),
                    "reduced_axis_0": described([np.float32(t.sum()) for t in stacked]),
                    "gather": described(stacked),
                },
            )
        except BaseException as e:
            e.add_note(f"framework pytree {name!r} ({kind})")
            raise


def test_framework_pytree_of_variables_checkpoints(conformance: Conformance) -> None:
    samples = _framework(conformance)

    for name, build in samples.items():

        def program(strategy: pd.Strategy, xp: Any, build: Any = build) -> Any:
            count = iter(range(1_000))
            with strategy.scope():
                tree = build(lambda: pd.Variable(xp.asarray(_leaf(0, next(count)))))
            variables = _leaves(tree)
            with tempfile.TemporaryDirectory() as directory:
                checkpoint.save(directory, tree)
                for v in variables:
                    v.assign(xp.zeros((2,), dtype=xp.float32))
                checkpoint.restore(directory, tree)
            return [v.read_value() for v in variables]

        try:
            conformance.check(program, expected=_leaves(build(_counter(np, 0))))
        except BaseException as e:
            e.add_note(f"framework pytree {name!r}")
            raise
