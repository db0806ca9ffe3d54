"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", in Flax nnx + optax.

The same program as TF's tutorial, step for step, on polydist's JAX backend:

* a ``MirroredStrategy(backend="jax")`` over every JAX device (4 fake CPU
  devices here, unless ``XLA_FLAGS`` already asks for some);
* Fashion-MNIST-shaped data (28x28 grayscale images, 10 classes), made up
  with a fixed seed (no download), in ``polydist.data.Dataset`` pipelines fed
  through ``strategy.experimental_distribute_dataset``;
* the tutorial's convolutional classifier as an ``nnx.Module`` and Adam as an
  ``nnx.Optimizer``, made distributed variables under ``strategy.scope()`` by
  ``polydist_jax.nnx.distribute`` (TF: a Keras model built under the scope);
* a per-example loss averaged over the *global* batch with
  ``polydist.nn.compute_average_loss``, gradients all-reduced in one call, and
  ``strategy.run`` / ``strategy.reduce`` for the train and test steps;
* the loss and accuracy metrics from ``polydist.metrics``;
* a ``polydist.train.Checkpoint`` of the model and the optimizer, saved every
  epoch by a ``CheckpointManager``.

Then it restores the checkpoint in a fresh process (this script, run again with
``--resume``), checks that the restored model evaluates exactly as the saved
one did, trains two more epochs there, and compares the weights with the same
model trained on one device (no strategy) on the whole of every batch. It
exits non-zero if they differ by more than ``rtol=1e-4, atol=1e-5`` (float32
sums in another order), or if any replica's copy of a weight differs from
replica 0's by a single bit.

    python examples/tutorial_flax.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Fake CPU devices for the replicas: must be set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import jax
import numpy as np
import optax  # type: ignore[import-untyped]
from flax import nnx

import polydist as pd
from polydist_jax import nnx as pdnnx

SEED = 0
TRAIN_EXAMPLES = 1024  # a multiple of the global batch for 1, 2, 4 or 8 replicas
TEST_EXAMPLES = 256
BUFFER_SIZE = TRAIN_EXAMPLES
BATCH_SIZE_PER_REPLICA = 32
EPOCHS_BEFORE_RESTORE = 2
EPOCHS_AFTER_RESTORE = 2
LEARNING_RATE = 3e-3
RTOL, ATOL = 1e-4, 1e-5


# -- data --------------------------------------------------------------------------------


def fashion_mnist_like() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(train_images, train_labels), (test_images, test_labels): each class a fixed
    random pattern plus noise, as float32 in [0, 1] of shape (N, 28, 28, 1)."""
    rng = np.random.default_rng(SEED)
    patterns = rng.uniform(size=(10, 28, 28, 1)).astype(np.float32)

    def make(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, 10, size=n).astype(np.int32)
        noise = rng.normal(scale=0.35, size=(n, 28, 28, 1)).astype(np.float32)
        return np.clip(patterns[labels] + noise, 0.0, 1.0), labels

    return make(TRAIN_EXAMPLES), make(TEST_EXAMPLES)


def train_dataset(data: tuple[np.ndarray, np.ndarray], epoch: int, global_batch: int) -> Any:
    # Shuffled per epoch with a seed of its own, so that a restored run (another
    # process) sees the same batches as one that never stopped.
    return (
        pd.data.Dataset.from_tensor_slices(data)
        .shuffle(BUFFER_SIZE, seed=SEED + epoch)
        .batch(global_batch)
    )


def test_dataset(data: tuple[np.ndarray, np.ndarray], global_batch: int) -> Any:
    return pd.data.Dataset.from_tensor_slices(data).batch(global_batch)


# -- the model ---------------------------------------------------------------------------


def max_pool(x: jax.Array) -> jax.Array:
    pooled: jax.Array = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))  # type: ignore[no-untyped-call]
    return pooled


class CNN(nnx.Module):
    """The tutorial's classifier, narrower: conv-pool-conv-pool-dense-dense."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), padding="VALID", rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), padding="VALID", rngs=rngs)
        self.dense1 = nnx.Linear(5 * 5 * 16, 32, rngs=rngs)
        self.dense2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = max_pool(nnx.relu(self.conv1(x)))
        x = max_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.dense2(nnx.relu(self.dense1(x)))


def per_example_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    # Keras' SparseCategoricalCrossentropy(from_logits=True, reduction=NONE).
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # type: ignore[no-any-return]


def new_model_and_optimizer() -> tuple[CNN, nnx.Optimizer[CNN]]:
    model = CNN(nnx.Rngs(SEED))
    return model, nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)


# -- distributed training ------------------------------------------------------------------


class Trainer:
    """What the tutorial builds under ``strategy.scope()``, and its steps."""

    def __init__(self, strategy: pd.Strategy) -> None:
        self.strategy = strategy
        self.global_batch = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
        with strategy.scope():
            model, optimizer = new_model_and_optimizer()
            self.model = pdnnx.distribute(model)
            self.optimizer = pdnnx.distribute(optimizer)
            self.test_loss = pd.metrics.Mean(name="test_loss")
            self.train_accuracy = pd.metrics.SparseCategoricalAccuracy(name="train_accuracy")
            self.test_accuracy = pd.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    def checkpoint_manager(self, directory: Path) -> pd.train.CheckpointManager:
        checkpoint = pd.train.Checkpoint(model=self.model, optimizer=self.optimizer)
        return pd.train.CheckpointManager(checkpoint, str(directory), max_to_keep=3)

    # The replica functions: each replica runs them on its part of the global batch.
    def train_step(self, inputs: tuple[jax.Array, jax.Array]) -> jax.Array:
        images, labels = inputs

        def loss_fn(model: CNN) -> tuple[jax.Array, jax.Array]:
            logits = model(images)
            loss = pd.nn.compute_average_loss(
                per_example_loss(logits, labels), global_batch_size=self.global_batch
            )
            return loss, logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(self.model)
        ctx = pd.get_replica_context()
        assert ctx is not None
        # One all-reduce of the whole nnx.State: the sum over replicas is the gradient of
        # the global batch's mean loss.
        grads = ctx.all_reduce(pd.ReduceOp.SUM, grads)
        self.optimizer.update(self.model, grads)
        self.train_accuracy.update_state(labels, logits)
        return loss  # type: ignore[no-any-return]

    def test_step(self, inputs: tuple[jax.Array, jax.Array]) -> None:
        images, labels = inputs
        logits = self.model(images)
        self.test_loss.update_state(per_example_loss(logits, labels))
        self.test_accuracy.update_state(labels, logits)

    def distributed_train_step(self, inputs: Any) -> float:
        per_replica_losses = self.strategy.run(self.train_step, args=(inputs,))
        return float(self.strategy.reduce(pd.ReduceOp.SUM, per_replica_losses, axis=None))

    def distributed_test_step(self, inputs: Any) -> None:
        self.strategy.run(self.test_step, args=(inputs,))

    def train_epoch(self, train_data: tuple[np.ndarray, np.ndarray], epoch: int) -> float:
        dataset = train_dataset(train_data, epoch, self.global_batch)
        total_loss, num_batches = 0.0, 0
        for batch in self.strategy.experimental_distribute_dataset(dataset):
            total_loss += self.distributed_train_step(batch)
            num_batches += 1
            # Every copy of every weight the same, bit for bit (raises otherwise).
            pd.debugging.check_replicas_identical(self.strategy)
        return total_loss / num_batches

    def evaluate(self, test_data: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
        self.test_loss.reset_state()
        self.test_accuracy.reset_state()
        dataset = test_dataset(test_data, self.global_batch)
        for batch in self.strategy.experimental_distribute_dataset(dataset):
            self.distributed_test_step(batch)
        return {
            "test_loss": float(self.test_loss.result()),
            "test_accuracy": float(self.test_accuracy.result()),
        }

    def fit(
        self,
        train_data: tuple[np.ndarray, np.ndarray],
        test_data: tuple[np.ndarray, np.ndarray],
        epochs: range,
        manager: pd.train.CheckpointManager,
    ) -> dict[str, float]:
        results: dict[str, float] = {}
        for epoch in epochs:
            train_loss = self.train_epoch(train_data, epoch)
            results = self.evaluate(test_data)
            manager.save()  # the tutorial saves every 2 epochs; every one here
            print(
                f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, "
                f"Accuracy: {float(self.train_accuracy.result()) * 100:.2f}, "
                f"Test Loss: {results['test_loss']:.4f}, "
                f"Test Accuracy: {results['test_accuracy'] * 100:.2f}",
                flush=True,
            )
            self.train_accuracy.reset_state()
        return results


# -- the reference: one device, no strategy -------------------------------------------------


def single_device_weights(train_data: tuple[np.ndarray, np.ndarray], global_batch: int) -> Any:
    """The same model trained on one device, on each whole global batch."""
    model, optimizer = new_model_and_optimizer()

    @nnx.jit
    def step(model: CNN, optimizer: nnx.Optimizer[CNN], images: Any, labels: Any) -> None:
        def loss_fn(model: CNN) -> jax.Array:
            return per_example_loss(model(images), labels).mean()

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    for epoch in range(EPOCHS_BEFORE_RESTORE + EPOCHS_AFTER_RESTORE):
        for images, labels in train_dataset(train_data, epoch, global_batch).as_numpy_iterator():
            step(model, optimizer, images, labels)
    return nnx.state(model, nnx.Param)


# -- the two processes ---------------------------------------------------------------------


def first_process(workdir: Path) -> int:
    strategy = pd.MirroredStrategy(backend="jax")
    print(f"Number of devices: {strategy.num_replicas_in_sync}", flush=True)
    train_data, test_data = fashion_mnist_like()
    trainer = Trainer(strategy)
    manager = trainer.checkpoint_manager(workdir / "checkpoints")
    results = trainer.fit(train_data, test_data, range(EPOCHS_BEFORE_RESTORE), manager)
    step = int(trainer.optimizer.step[...])
    (workdir / "evaluation.json").write_text(json.dumps(results))
    print(f"Saved a checkpoint at step {step}; restoring it in a new process.", flush=True)
    resumed = subprocess.run(
        [sys.executable, __file__, "--workdir", str(workdir), "--resume"], check=False
    )
    return resumed.returncode


def resumed_process(workdir: Path) -> int:
    strategy = pd.MirroredStrategy(backend="jax")
    train_data, test_data = fashion_mnist_like()
    trainer = Trainer(strategy)  # fresh weights, as a new program has
    manager = trainer.checkpoint_manager(workdir / "checkpoints")
    if manager.latest_checkpoint is None:
        print("MISMATCH: no checkpoint was written")
        return 1
    manager.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    restored = trainer.evaluate(test_data)
    saved = json.loads((workdir / "evaluation.json").read_text())
    if restored != saved:
        print(f"MISMATCH: the restored model evaluates to {restored}, saved {saved}")
        return 1
    print(f"Restored step {int(trainer.optimizer.step[...])}: {restored}", flush=True)

    epochs = range(EPOCHS_BEFORE_RESTORE, EPOCHS_BEFORE_RESTORE + EPOCHS_AFTER_RESTORE)
    trainer.fit(train_data, test_data, epochs, manager)

    expected = single_device_weights(train_data, trainer.global_batch)
    got = nnx.state(trainer.model, nnx.Param)
    worst = 0.0
    for (path, g), (_, e) in zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree_util.tree_leaves_with_path(expected),
        strict=True,
    ):
        g, e = np.asarray(g), np.asarray(e)
        worst = max(worst, float(np.max(np.abs(g - e))))
        if not np.allclose(g, e, rtol=RTOL, atol=ATOL):
            print(f"MISMATCH with single-device training at {jax.tree_util.keystr(path)}")
            return 1
    print(f"Weights equal single-device training (largest difference {worst:.2e}).")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go")
    parser.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume:
        return resumed_process(args.workdir)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return first_process(args.workdir)
    with tempfile.TemporaryDirectory() as directory:
        return first_process(Path(directory))


if __name__ == "__main__":
    sys.exit(main())
