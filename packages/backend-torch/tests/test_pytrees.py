"""torch pytrees are polydist nests: OrderedDict state dicts, namedtuples and classes
registered with torch.utils._pytree flow through run, all_reduce, reduce, all_gather,
gather, experimental_distribute_values_from_function and checkpoints, keeping their
types."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils._pytree as torch_pytree

import polydist as pd
from polydist import checkpoint
from polydist_torch import TorchBackend, parameters

N = 4


class Moments:
    """An optimizer-state-like class registered with torch's pytree (with keys)."""

    def __init__(self, mu: Any, nu: Any, step: int = 0) -> None:
        self.mu, self.nu, self.step = mu, nu, step


torch_pytree.register_pytree_node(
    Moments,
    lambda m: ([m.mu, m.nu], m.step),
    lambda children, step: Moments(*children, step=step),
    flatten_with_keys_fn=lambda m: (
        [(torch_pytree.GetAttrKey("mu"), m.mu), (torch_pytree.GetAttrKey("nu"), m.nu)],
        m.step,
    ),
)


class Bag:
    """Registered without keys: its children are named by position."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items


torch_pytree.register_pytree_node(
    Bag, lambda b: (list(b.items), None), lambda children, _: Bag(list(children))
)


class Batch(NamedTuple):
    x: Any
    y: Any


def _state_dict() -> Any:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 3).state_dict()


TEMPLATES: dict[str, Callable[[], Any]] = {
    "state_dict": _state_dict,
    "moments": lambda: Moments({"w": torch.zeros(2, 2)}, [torch.zeros(3)], step=7),
    "bag": lambda: Bag([torch.zeros(2), torch.zeros(1, 2, dtype=torch.int32)]),
    "namedtuple": lambda: Batch(torch.zeros(2, 3), OrderedDict(b=torch.zeros(1))),
}
KINDS = sorted(TEMPLATES)


def build(kind: str, replica: int) -> Any:
    leaves, spec = torch_pytree.tree_flatten(TEMPLATES[kind]())
    filled = [torch.full_like(x, (replica + 1) * (i + 1)) for i, x in enumerate(leaves)]
    return torch_pytree.tree_unflatten(filled, spec)


def assert_tree(got: Any, kind: str, want: list[torch.Tensor]) -> None:
    """``got`` has the template's exact torch structure (types, keys, contexts)."""
    leaves, spec = torch_pytree.tree_flatten(got)
    assert spec == torch_pytree.tree_structure(TEMPLATES[kind]())
    assert len(leaves) == len(want)
    for g, w in zip(leaves, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def expected_sum(kind: str) -> list[torch.Tensor]:
    parts = [torch_pytree.tree_leaves(build(kind, r)) for r in range(N)]
    return [sum(p[i] for p in parts) for i in range(len(parts[0]))]  # type: ignore[misc]


def ctx() -> pd.ReplicaContext:
    c = pd.get_replica_context()
    assert c is not None
    return c


@pytest.fixture
def strategy() -> pd.Strategy:
    return pd.MirroredStrategy([f"/cpu:{i}" for i in range(N)], backend=TorchBackend())


def distributed(strategy: pd.Strategy, kind: str) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda c: build(kind, c.replica_id_in_sync_group)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_all_reduce_in_run(strategy: pd.Strategy, kind: str) -> None:
    value = distributed(strategy, kind)
    assert type(value) is type(TEMPLATES[kind]())

    def step(tree: Any) -> Any:
        assert type(tree) is type(TEMPLATES[kind]())
        return ctx().all_reduce("SUM", tree)

    out = strategy.run(step, args=(value,))
    assert type(out) is type(TEMPLATES[kind]())
    for local in strategy.experimental_local_results(out):
        assert_tree(local, kind, expected_sum(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_reduce_and_gather(strategy: pd.Strategy, kind: str) -> None:
    value = distributed(strategy, kind)
    assert_tree(strategy.reduce("SUM", value, axis=None), kind, expected_sum(kind))
    rows = [torch_pytree.tree_leaves(build(kind, r)) for r in range(N)]
    stacked = [torch.cat([row[i] for row in rows]) for i in range(len(rows[0]))]
    assert_tree(
        strategy.reduce("SUM", value, axis=0), kind, [s.sum(0, dtype=s.dtype) for s in stacked]
    )
    assert_tree(strategy.gather(value, axis=0), kind, stacked)
    out = strategy.run(lambda tree: ctx().all_gather(tree, axis=0), args=(value,))
    for local in strategy.experimental_local_results(out):
        assert_tree(local, kind, stacked)


def test_state_dict_of_variables_checkpoints_and_gives_parameters(
    strategy: pd.Strategy, tmp_path: Path
) -> None:
    with strategy.scope():
        state = Moments(
            OrderedDict(weight=pd.Variable(torch.ones(2, 2)), bias=pd.Variable(torch.ones(2))),
            [pd.Variable(torch.full((3,), 2.0))],
            step=3,
        )
    assert len(parameters(state)) == N  # one list per replica ...
    assert all(len(p) == 3 for p in parameters(state))  # ... of the three variables
    checkpoint.save(tmp_path, state)
    # Restored into plain dicts keyed by torch's paths, on another replica count.
    other = pd.MirroredStrategy(["/cpu:0", "/cpu:1"], backend=TorchBackend())
    with other.scope():
        plain = {
            "mu": {"weight": pd.Variable(torch.zeros(2, 2)), "bias": pd.Variable(torch.zeros(2))},
            "nu": [pd.Variable(torch.zeros(3))],
        }
        bag = Bag([pd.Variable(torch.ones(1)), pd.Variable(torch.zeros(1))])
        by_position = [pd.Variable(torch.zeros(1)), pd.Variable(torch.ones(1))]
    checkpoint.restore(tmp_path, plain)
    assert plain["mu"]["weight"].numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert plain["nu"][0].numpy().tolist() == [2.0, 2.0, 2.0]
    checkpoint.save(tmp_path / "bag", bag)
    checkpoint.restore(tmp_path / "bag", by_position)
    assert [v.numpy().tolist() for v in by_position] == [[1.0], [0.0]]
