"""Orbax checkpoints of distributed nnx objects, through nnx's own state API
(docs/frameworks/flax.md, "Orbax"): nnx.state of a distributed model saves what a read
outside run gives, and nnx.update of a restored state writes every replica's copy."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import orbax.checkpoint as ocp  # noqa: E402  (a dependency of flax)
from flax import nnx  # noqa: E402

import polydist as pd  # noqa: E402
from polydist.backend import launch as _launch  # noqa: E402
from polydist.debugging import check_replicas_identical  # noqa: E402
from polydist_jax import nnx as pdnnx  # noqa: E402

# The workers take JAX's one CPU device each, not the tests' 8, and a cluster of their own.
_UNSET = ("TF_CONFIG", "XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "POLYDIST_PROCESS_ID")


def norm_net(rngs: nnx.Rngs) -> nnx.Sequential:
    return nnx.Sequential(nnx.Linear(4, 2, rngs=rngs), nnx.BatchNorm(2, momentum=0.5, rngs=rngs))


def build(strategy: pd.Strategy | None, seed: int) -> tuple[nnx.Sequential, Any]:
    def make() -> tuple[nnx.Sequential, Any]:
        model = norm_net(nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    if strategy is None:
        return make()
    with strategy.scope():
        model, optimizer = make()
        return pdnnx.distribute(model), pdnnx.distribute(optimizer)


def train(strategy: pd.Strategy, model: nnx.Sequential, optimizer: Any) -> None:
    def step(x: jax.Array) -> None:
        def loss_fn(model: nnx.Sequential) -> jax.Array:
            return pd.nn.compute_average_loss(jnp.sum(model(x) ** 2, axis=1))  # type: ignore[no-any-return]

        grads = nnx.grad(loss_fn)(model)
        ctx = pd.get_replica_context()
        assert ctx is not None
        optimizer.update(model, ctx.all_reduce(pd.ReduceOp.SUM, grads))

    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 8
    parts = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.split(x, strategy.num_replicas_in_sync)[ctx.replica_id_in_sync_group]
    )
    for _ in range(2):
        strategy.run(step, args=(parts,))


def leaves(state: Any) -> list[np.ndarray]:
    return [np.asarray(v) for v in jax.tree.leaves(state)]


def save(path: Path, state: Any) -> None:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)


def restore(path: Path, target: Any) -> Any:
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)


def test_a_distributed_model_saves_and_restores_with_orbax(tmp_path: Path) -> None:
    four = pd.MirroredStrategy(4, backend="jax")
    model, optimizer = build(four, seed=0)
    train(four, model, optimizer)
    means = pdnnx.variables(model)["layers/1/mean"]
    assert not np.array_equal(means.values[0].numpy(), means.values[3].numpy())  # per replica
    saved = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    # Outside run nnx.state reads the polydist variables: the weights (mirrored) and the
    # batch statistics' cross-replica mean (ON_READ MEAN, as Keras' under TF).
    np.testing.assert_allclose(
        np.asarray(saved["model"]["layers"][1]["mean"][...]),
        np.mean([c.numpy() for c in means.values], axis=0),
        rtol=1e-6,
    )
    save(tmp_path / "ckpt", saved)

    two = pd.MirroredStrategy(2, backend="jax")  # another replica count
    other, other_optimizer = build(two, seed=1)
    target = {"model": nnx.state(other), "optimizer": nnx.state(other_optimizer)}
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(target), leaves(saved)))
    restored = restore(tmp_path / "ckpt", target)
    nnx.update(other, restored["model"])
    nnx.update(other_optimizer, restored["optimizer"])
    for a, b in zip(leaves(nnx.state(other)), leaves(saved["model"])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(nnx.state(other_optimizer)), leaves(saved["optimizer"])):
        np.testing.assert_array_equal(a, b)
    # Every replica's copy took the restored value, the batch statistics' included.
    for variable in pdnnx.variables(other).values():
        first = variable.values[0].numpy()
        for copy in variable.values[1:]:
            np.testing.assert_array_equal(copy.numpy(), first)
    assert check_replicas_identical(two) > 0
    train(two, other, other_optimizer)  # and training goes on from there

    plain, _ = build(None, seed=2)  # no strategy at all: the same checkpoint
    nnx.update(plain, restore(tmp_path / "ckpt", {"model": nnx.state(plain), **target})["model"])
    for a, b in zip(leaves(nnx.state(plain)), leaves(saved["model"])):
        np.testing.assert_array_equal(a, b)


def test_an_orbax_checkpoint_of_a_plain_model_restores_into_a_distributed_one(
    tmp_path: Path,
) -> None:
    """The common case: weights trained elsewhere, saved by Orbax from plain nnx."""
    pretrained, _ = build(None, seed=3)
    save(tmp_path / "pretrained", nnx.state(pretrained))
    eight = pd.MirroredStrategy(backend="jax")
    model, _ = build(eight, seed=4)
    nnx.update(model, restore(tmp_path / "pretrained", nnx.state(model)))
    x = np.ones((8, 4), np.float32)
    pretrained.eval()
    model.eval()
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(pretrained(x)))
    for variable in pdnnx.variables(model).values():
        for copy in variable.values:
            np.testing.assert_array_equal(copy.numpy(), variable.values[0].numpy())


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")
def test_two_workers_save_and_restore_with_orbax_made_global(tmp_path: Path) -> None:
    """Under MultiWorkerMirroredStrategy (2 processes): Orbax refuses polydist's
    per-process arrays as they are, and takes them once its own
    fully_replicated_host_local_array_to_global_array made them global; every worker
    then restores what was saved, the cross-replica batch statistics included."""
    program = Path(__file__).resolve().parent / "orbax_worker.py"
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    env.update(JAX_PLATFORMS="cpu")
    for args, where in (([], tmp_path / "global"), (["plain"], tmp_path / "plain")):
        where.mkdir()
        log = io.StringIO()
        result = _launch.launch(
            2, str(program), [str(where), *args], timeout=150, stdout=log, stderr=log, env=env
        )
        assert result.exit_code == 0, log.getvalue()[-3000:]
    for w in range(2):
        said = (tmp_path / "plain" / f"error{w}.txt").read_text()
        assert "Cannot serialize host local jax.Array" in said
    workers = [dict(np.load(tmp_path / "global" / f"worker{w}.npz")) for w in range(2)]
    saved = sorted(k for k in workers[0] if k.startswith("saved"))
    assert len(saved) > 10  # the model's and the optimizer's arrays
    for k in saved:
        np.testing.assert_array_equal(workers[0][k], workers[1][k], err_msg=k)  # one state
        restored = workers[0]["restored" + k.removeprefix("saved")]
        np.testing.assert_array_equal(restored, workers[0][k], err_msg=k)
        np.testing.assert_array_equal(workers[1]["restored" + k.removeprefix("saved")], restored)
