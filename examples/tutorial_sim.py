"""TF's "Custom training with tf.distribute.Strategy" tutorial, in NumPy on the simulator.

The TF tutorial trains a small classifier on Fashion-MNIST under
``MirroredStrategy`` with a custom loop: ``experimental_distribute_dataset``,
``compute_average_loss``, ``strategy.run``, ``strategy.reduce``, Keras metrics
and ``tf.train.CheckpointManager``. Here the same program runs on polydist's
default backend, the simulator, with 4 simulated GPUs on a laptop and nothing
but NumPy:

- the data are synthetic Fashion-MNIST-shaped images (28x28, 10 classes, a
  fixed seed: no downloads), 600 training examples in global batches of 64, so
  the last batch of each epoch is partial (24 examples: 6 per replica);
- the model is a two-layer perceptron whose weights, and the Adam optimizer's
  moments and step, are ``polydist.Variable``s created under
  ``strategy.scope()`` (TF: a Keras model and optimizer built under the
  scope), with the gradients written out by hand (NumPy has no autodiff);
- each replica sums its gradients with the others' (``ctx.all_reduce``, TF's
  ``optimizer.apply_gradients``) and applies the same Adam step to its copy;
- ``polydist.metrics`` keeps the accuracy and the test loss (TF:
  ``tf.keras.metrics``): sync-on-read variables that each replica updates;
- ``polydist.train.CheckpointManager`` saves after each epoch; halfway, a fresh
  Python process restores the latest checkpoint and finishes the training;
- finally the weights are compared with the same training on one device, on
  whole batches. The program exits with status 1 if they differ by more than
  float32 rounding (the tolerance below), or if the replicas' weights are not
  bitwise identical.

    python examples/tutorial_sim.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import polydist as pd
from polydist.data import Dataset
from polydist.metrics import Mean, SparseCategoricalAccuracy
from polydist.train import Checkpoint, CheckpointManager

REPLICAS = 4
BATCH_SIZE_PER_REPLICA = 16
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * REPLICAS
TRAIN_EXAMPLES, TEST_EXAMPLES = 600, 200
EPOCHS = 4  # epochs 1-2 in this process, 3-4 in a fresh one restored from the checkpoint
HIDDEN = 64
LEARNING_RATE, BETA_1, BETA_2, EPSILON = 3e-3, 0.9, 0.999, 1e-7
# N replicas sum their gradients (correctly rounded, on the sim) where one device sums
# the whole batch in one go: only the float32 rounding differs.
RTOL, ATOL = 1e-4, 1e-5


# -- the data: Fashion-MNIST-shaped, synthetic -------------------------------------------
def make_data(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images 28x28 in [0, 1] (flattened to 784): a class's blocky pattern, plus noise."""
    patterns = np.random.default_rng(0).random((10, 7, 7)).repeat(4, 1).repeat(4, 2)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, examples)
    images = 0.6 * patterns[labels] + 0.4 * rng.random((examples, 28, 28))
    return images.reshape(examples, 784).astype(np.float32), labels.astype(np.int64)


TRAIN = make_data(TRAIN_EXAMPLES, seed=1)
TEST = make_data(TEST_EXAMPLES, seed=2)


def train_dataset(epoch: int) -> Dataset:
    # Shuffled with a seed per epoch, so a restored run and the single-device run see the
    # same batches.
    order = np.random.default_rng(100 + epoch).permutation(TRAIN_EXAMPLES)
    images, labels = TRAIN
    return Dataset.from_tensor_slices((images[order], labels[order])).batch(GLOBAL_BATCH_SIZE)


def test_dataset() -> Dataset:
    return Dataset.from_tensor_slices(TEST).batch(GLOBAL_BATCH_SIZE)


# -- the model: a 784 -> 64 -> 10 perceptron, forward and backward in NumPy -----------------
def initial_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    limit1, limit2 = np.sqrt(6 / (784 + HIDDEN)), np.sqrt(6 / (HIDDEN + 10))  # Glorot uniform
    return {
        "dense/kernel": rng.uniform(-limit1, limit1, (784, HIDDEN)).astype(np.float32),
        "dense/bias": np.zeros(HIDDEN, np.float32),
        "dense_1/kernel": rng.uniform(-limit2, limit2, (HIDDEN, 10)).astype(np.float32),
        "dense_1/bias": np.zeros(10, np.float32),
    }


def forward(w: dict[str, np.ndarray], images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hidden = np.maximum(images @ w["dense/kernel"] + w["dense/bias"], 0)
    return hidden @ w["dense_1/kernel"] + w["dense_1/bias"], hidden


def per_example_loss(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Sparse categorical cross-entropy from logits, one value per example."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels]


def gradients(
    w: dict[str, np.ndarray], images: np.ndarray, labels: np.ndarray, scale: float
) -> dict[str, np.ndarray]:
    """Gradients of ``sum(per_example_loss) * scale``."""
    logits, hidden = forward(w, images)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    d_logits = probs
    d_logits[np.arange(len(labels)), labels] -= 1
    d_logits = (d_logits * scale).astype(np.float32)
    d_hidden = (d_logits @ w["dense_1/kernel"].T) * (hidden > 0)
    return {
        "dense/kernel": images.T @ d_hidden,
        "dense/bias": d_hidden.sum(axis=0),
        "dense_1/kernel": hidden.T @ d_logits,
        "dense_1/bias": d_logits.sum(axis=0),
    }


def adam_update(
    g: np.ndarray, m: np.ndarray, v: np.ndarray, step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keras's Adam: the new first and second moments, and the step to subtract."""
    m = BETA_1 * m + (1 - BETA_1) * g
    v = BETA_2 * v + (1 - BETA_2) * g * g
    lr = LEARNING_RATE * np.sqrt(1 - BETA_2**step) / (1 - BETA_1**step)
    return m, v, (lr * m / (np.sqrt(v) + EPSILON)).astype(np.float32)


# -- distributed training ----------------------------------------------------------------
class Trainer:
    def __init__(self) -> None:
        self.strategy = pd.MirroredStrategy(REPLICAS)  # 4 simulated GPUs
        with self.strategy.scope():
            # Mirrored variables: one copy per replica. Every replica applies the same
            # update to its own copy (aggregation NONE, as Keras's weights).
            self.model = {k: pd.Variable(v, name=k) for k, v in initial_weights().items()}
            zeros = {k: np.zeros_like(v) for k, v in initial_weights().items()}
            self.optimizer = {  # Adam's state: mirrored variables too
                "iterations": pd.Variable(np.int64(0), name="iterations"),
                "m": {k: pd.Variable(z, name=f"m/{k}") for k, z in zeros.items()},
                "v": {k: pd.Variable(z, name=f"v/{k}") for k, z in zeros.items()},
            }
            self.epoch = pd.Variable(np.int64(0), name="epoch")
            self.train_accuracy = SparseCategoricalAccuracy(name="train_accuracy")
            self.test_loss = Mean(name="test_loss")
            self.test_accuracy = SparseCategoricalAccuracy(name="test_accuracy")
        self.checkpoint = Checkpoint(model=self.model, optimizer=self.optimizer, epoch=self.epoch)

    def weights(self) -> dict[str, np.ndarray]:
        """The model's weights (this replica's copies, inside ``strategy.run``)."""
        return {k: v.value() for k, v in self.model.items()}

    def train_step(self, images: np.ndarray, labels: np.ndarray) -> Any:
        """Runs on every replica, on its part of the global batch."""
        ctx = pd.get_replica_context()
        w = self.weights()
        logits, _ = forward(w, images)
        # TF's compute_average_loss divides by GLOBAL_BATCH_SIZE, which is wrong for the
        # partial last batch; the _exact variant divides by the true global count.
        loss = pd.nn.compute_average_loss_exact(per_example_loss(logits, labels))
        count = ctx.all_reduce(pd.ReduceOp.SUM, np.float32(len(labels)))
        grads = ctx.all_reduce(pd.ReduceOp.SUM, gradients(w, images, labels, scale=1.0))
        grads = {k: g / count for k, g in grads.items()}  # TF: optimizer.apply_gradients
        step = int(self.optimizer["iterations"].value()) + 1
        for k, var in self.model.items():
            m, v, delta = adam_update(
                grads[k], self.optimizer["m"][k].value(), self.optimizer["v"][k].value(), step
            )
            self.optimizer["m"][k].assign(m)
            self.optimizer["v"][k].assign(v)
            var.assign_sub(delta)
        self.optimizer["iterations"].assign(np.int64(step))
        self.train_accuracy.update_state(labels, logits)
        return loss

    def test_step(self, images: np.ndarray, labels: np.ndarray) -> None:
        logits, _ = forward(self.weights(), images)
        self.test_loss.update_state(per_example_loss(logits, labels))
        self.test_accuracy.update_state(labels, logits)

    def train_epochs(self, until: int) -> None:
        strategy = self.strategy
        while int(self.epoch.numpy()) < until:
            epoch = int(self.epoch.numpy())
            total_loss, batches = 0.0, 0
            for images, labels in strategy.experimental_distribute_dataset(train_dataset(epoch)):
                per_replica = strategy.run(self.train_step, args=(images, labels))
                total_loss += float(strategy.reduce(pd.ReduceOp.SUM, per_replica, axis=None))
                batches += 1
            for images, labels in strategy.experimental_distribute_dataset(test_dataset()):
                strategy.run(self.test_step, args=(images, labels))
            self.epoch.assign_add(1)
            print(
                f"Epoch {epoch + 1}, Loss: {total_loss / batches:.4f}, "
                f"Accuracy: {100 * float(self.train_accuracy.result()):.2f}, "
                f"Test Loss: {float(self.test_loss.result()):.4f}, "
                f"Test Accuracy: {100 * float(self.test_accuracy.result()):.2f}"
            )
            for metric in (self.train_accuracy, self.test_loss, self.test_accuracy):
                metric.reset_state()
            pd.debugging.check_replicas_identical(strategy)  # raises if the copies differ


def first_half(checkpoint_dir: Path) -> None:
    trainer = Trainer()
    manager = CheckpointManager(trainer.checkpoint, checkpoint_dir, max_to_keep=2)
    for until in range(1, EPOCHS // 2 + 1):
        trainer.train_epochs(until)
        print(f"saved {manager.save()}")


def second_half(checkpoint_dir: Path, weights_out: Path) -> None:
    """A fresh process: new variables, restored from the latest checkpoint."""
    trainer = Trainer()
    manager = CheckpointManager(trainer.checkpoint, checkpoint_dir, max_to_keep=2)
    trainer.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    print(f"restored {manager.latest_checkpoint} (epoch {int(trainer.epoch.numpy())})")
    trainer.train_epochs(EPOCHS)
    manager.save()
    np.savez(weights_out, **{k: v.numpy() for k, v in trainer.model.items()})


# -- the same training on one device -----------------------------------------------------
def single_device_weights() -> dict[str, np.ndarray]:
    w = initial_weights()
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    step = 0
    for epoch in range(EPOCHS):
        for images, labels in train_dataset(epoch):
            step += 1
            grads = gradients(w, images, labels, scale=1.0)
            grads = {k: g / np.float32(len(labels)) for k, g in grads.items()}
            for k in w:
                m[k], v[k], delta = adam_update(grads[k], m[k], v[k], step)
                w[k] = w[k] - delta
    return w


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_dir, weights = Path(tmp) / "checkpoints", Path(tmp) / "weights.npz"
        first_half(checkpoint_dir)
        command = [sys.executable, __file__, "--resume", str(checkpoint_dir), str(weights)]
        subprocess.run(command, check=True)
        with np.load(weights) as saved:
            distributed = dict(saved)
    expected = single_device_weights()
    worst = max(float(np.abs(distributed[k] - v).max()) for k, v in expected.items())
    close = all(np.allclose(distributed[k], v, rtol=RTOL, atol=ATOL) for k, v in expected.items())
    print(f"largest difference from single-device training: {worst:.2e}")
    if not close:
        print(f"MISMATCH: more than float32 rounding (rtol={RTOL}, atol={ATOL})")
        return 1
    print(f"{REPLICAS} replicas match single-device training (rtol={RTOL}, atol={ATOL})")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resume", nargs=2, metavar=("CHECKPOINT_DIR", "WEIGHTS_OUT"))
    args = parser.parse_args()
    if args.resume:
        second_half(Path(args.resume[0]), Path(args.resume[1]))
    else:
        sys.exit(main())
