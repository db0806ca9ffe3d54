"""TF's "Custom training with tf.distribute.Strategy" tutorial, in torch.nn + torch.optim.

The TF tutorial trains a small convolutional classifier on Fashion-MNIST under
``MirroredStrategy`` with a custom loop: ``experimental_distribute_dataset``,
``compute_average_loss``, ``strategy.run``, ``strategy.reduce``, Keras metrics
and ``tf.train.CheckpointManager``. Here the same program is written for PyTorch, on
polydist's torch backend with 4 virtual CPU replicas (no GPU needed):

- the data are synthetic Fashion-MNIST-shaped images (28x28, 10 classes, a
  fixed seed: no downloads), 600 training examples in global batches of 64, so
  the last batch of each epoch is partial (24 examples: 6 per replica);
- the model is an ordinary ``nn.Module`` and the optimizer an ordinary
  ``torch.optim.Adam``: ``polydist_torch.distribute_module`` and
  ``distribute_optimizer`` give each replica its own copy (TF: a Keras model
  built under ``strategy.scope()``), and ``optimizer.step()`` sums the
  gradients across replicas (TF: ``optimizer.apply_gradients``);
- ``polydist.metrics`` keeps the accuracy and the test loss (TF:
  ``tf.keras.metrics``): sync-on-read variables that each replica updates;
- ``polydist.train.CheckpointManager`` saves after each epoch; halfway, a fresh
  Python process restores the latest checkpoint and finishes the training;
- finally the weights are compared with the same training on one device that
  splits each batch into the replicas' parts and sums their gradients (the same
  arithmetic), and with training on whole batches in one go (another summation
  order: float32 rounding apart, which Adam's per-parameter scaling magnifies
  over the steps, by as much as 2e-4 on some CPUs). The program exits with
  status 1 if the first differs by more than the tolerances below, the second
  by more than the looser ones, or if the replicas' weights are not bitwise
  identical.

    python examples/tutorial_torch.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import polydist as pd
import polydist_torch
from polydist.metrics import Mean, SparseCategoricalAccuracy
from polydist.train import Checkpoint, CheckpointManager

REPLICAS = 4
BATCH_SIZE_PER_REPLICA = 16
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * REPLICAS
TRAIN_EXAMPLES, TEST_EXAMPLES = 600, 200
EPOCHS = 4  # epochs 1-2 in this process, 3-4 in a fresh one restored from the checkpoint
LEARNING_RATE = 3e-3
# N replicas sum their parts' gradients: the same arithmetic on one device agrees to
# float32 rounding (measured: bit for bit). One device computing each whole batch in one
# go sums in another order, and Adam magnifies that rounding (docs/frameworks/torch.md).
RTOL, ATOL = 1e-4, 1e-5
ONE_GO_RTOL, ONE_GO_ATOL = 1e-2, 2e-3


# -- the data: Fashion-MNIST-shaped, synthetic -------------------------------------------
def make_data(examples: int, seed: int) -> TensorDataset:
    """Images 1x28x28 in [0, 1]: a class's fixed blocky pattern, shifted, plus noise."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.rand(10, 1, 7, 7, generator=g).repeat_interleave(4, 2).repeat_interleave(4, 3)
    g.manual_seed(seed)
    labels = torch.randint(0, 10, (examples,), generator=g)
    shifts = torch.randint(-2, 3, (examples, 2), generator=g)
    images = torch.stack(
        [torch.roll(patterns[c], (int(dy), int(dx)), (1, 2)) for c, (dy, dx) in zip(labels, shifts)]
    )
    images = (0.6 * images + 0.4 * torch.rand(images.shape, generator=g)).clamp(0, 1)
    return TensorDataset(images, labels)


TRAIN = make_data(TRAIN_EXAMPLES, seed=1)
TEST = make_data(TEST_EXAMPLES, seed=2)


def train_loader(epoch: int) -> DataLoader[Any]:
    # Shuffled with a seed per epoch, so a restored run and the single-device run see the
    # same batches. The order is drawn here, not by DataLoader(shuffle=True): the
    # distributed dataset reads the loader's first batch ahead (its element spec), which
    # draws a shuffle of its own.
    order = torch.randperm(TRAIN_EXAMPLES, generator=torch.Generator().manual_seed(100 + epoch))
    return DataLoader(Subset(TRAIN, order.tolist()), batch_size=GLOBAL_BATCH_SIZE)


def test_loader() -> DataLoader[Any]:
    return DataLoader(TEST, batch_size=GLOBAL_BATCH_SIZE)


# -- the model ---------------------------------------------------------------------------
def create_model() -> nn.Module:
    """The tutorial's Conv2D / MaxPool / Dense stack, narrower so it runs in seconds."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )


# -- distributed training ----------------------------------------------------------------
class Trainer:
    def __init__(self) -> None:
        # Named CPU devices: virtual replicas even on a machine with GPUs.
        self.strategy = pd.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)], backend="torch")
        with self.strategy.scope():
            self.model = polydist_torch.distribute_module(create_model())
            self.optimizer = polydist_torch.distribute_optimizer(
                torch.optim.Adam(self.model.parameters(), lr=LEARNING_RATE)
            )
            self.epoch = pd.Variable(0, name="epoch")
            self.train_accuracy = SparseCategoricalAccuracy(name="train_accuracy")
            self.test_loss = Mean(name="test_loss")
            self.test_accuracy = SparseCategoricalAccuracy(name="test_accuracy")
        # Per-example losses: the loss is averaged over the *global* batch below.
        self.loss_object = nn.CrossEntropyLoss(reduction="none")
        self.checkpoint = Checkpoint(model=self.model, optimizer=self.optimizer, epoch=self.epoch)

    def compute_loss(self, labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        per_example_loss = self.loss_object(predictions, labels)
        # TF's compute_average_loss divides by local batch x replicas, which is wrong for
        # the partial last batch; the _exact variant divides by the true global count.
        loss: torch.Tensor = pd.nn.compute_average_loss_exact(per_example_loss)
        return loss

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> Any:
        """Runs on every replica, on its part of the global batch: plain PyTorch."""
        predictions = self.model(images)
        loss = self.compute_loss(labels, predictions)
        loss.backward()
        self.optimizer.step()  # sums the gradients across replicas, then steps
        self.optimizer.zero_grad()
        self.train_accuracy.update_state(labels, predictions.detach())
        return loss.detach()

    def test_step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.no_grad():
            predictions = self.model(images)
            self.test_loss.update_state(self.loss_object(predictions, labels))
            self.test_accuracy.update_state(labels, predictions)

    def train_epochs(self, until: int) -> None:
        strategy = self.strategy
        while int(self.epoch.numpy()) < until:
            epoch = int(self.epoch.numpy())
            total_loss, batches = 0.0, 0
            for images, labels in strategy.experimental_distribute_dataset(train_loader(epoch)):
                per_replica = strategy.run(self.train_step, args=(images, labels))
                total_loss += float(strategy.reduce(pd.ReduceOp.SUM, per_replica, axis=None))
                batches += 1
            for images, labels in strategy.experimental_distribute_dataset(test_loader()):
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
    """A fresh process: new model and optimizer, restored from the latest checkpoint."""
    trainer = Trainer()
    manager = CheckpointManager(trainer.checkpoint, checkpoint_dir, max_to_keep=2)
    trainer.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
    print(f"restored {manager.latest_checkpoint} (epoch {int(trainer.epoch.numpy())})")
    trainer.train_epochs(EPOCHS)
    manager.save()
    torch.save(trainer.model.state_dict(), weights_out)


# -- the same training on one device -----------------------------------------------------
def single_device_weights(parts: int) -> dict[str, torch.Tensor]:
    """Training on one device: each batch in ``parts`` parts as the replicas get them
    (each part's summed loss over the batch's size, the gradients summed), or whole."""
    model = create_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for epoch in range(EPOCHS):
        for images, labels in train_loader(epoch):
            for x, y in zip(images.chunk(parts), labels.chunk(parts), strict=True):
                (loss_fn(model(x), y) / len(labels)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - v).abs().max()) for k, v in b.items())


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_dir, weights = Path(tmp) / "checkpoints", Path(tmp) / "weights.pt"
        first_half(checkpoint_dir)
        command = [sys.executable, __file__, "--resume", str(checkpoint_dir), str(weights)]
        subprocess.run(command, check=True)
        distributed = torch.load(weights)
    same_parts, one_go = single_device_weights(REPLICAS), single_device_weights(1)
    print(
        "largest difference from single-device training: "
        f"{largest_difference(distributed, same_parts):.2e} on the replicas' parts, "
        f"{largest_difference(distributed, one_go):.2e} on whole batches"
    )
    for expected, rtol, atol in ((same_parts, RTOL, ATOL), (one_go, ONE_GO_RTOL, ONE_GO_ATOL)):
        if not all(
            torch.allclose(distributed[k], v, rtol=rtol, atol=atol) for k, v in expected.items()
        ):
            print(f"MISMATCH: more than float32 rounding (rtol={rtol}, atol={atol})")
            return 1
    print(
        f"{REPLICAS} replicas match single-device training (rtol={RTOL}, atol={ATOL}; "
        f"on whole batches rtol={ONE_GO_RTOL}, atol={ONE_GO_ATOL})"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resume", nargs=2, metavar=("CHECKPOINT_DIR", "WEIGHTS_OUT"))
    args = parser.parse_args()
    if args.resume:
        second_half(Path(args.resume[0]), Path(args.resume[1]))
    else:
        sys.exit(main())
