"""Loss scaling for distributed training: ``tf.nn.compute_average_loss`` and friends.

Each replica computes its loss on its own part of the global batch, and the
gradients are then *summed* across replicas. So each replica must divide its
summed per-example loss by the *global* number of examples, not by its own.

``compute_average_loss`` is TF's function, result for result. With no
``global_batch_size`` it assumes every replica has as many examples as this
one, ``local_batch * num_replicas``, which is wrong for the last, partial
batch: for ``range(10).batch(4)`` over 3 replicas (batches ``[0,1] [2,3] []``,
``[4,5] [6,7] []``, ``[8] [9] []``) the per-replica losses sum to 1.0, 3.67 and
5.67, while the means are 1.5, 5.5 and 8.5. ``compute_average_loss_exact``
divides by the true global count instead (an all-reduce of the local counts)
and gives 1.5, 5.5 and 8.5.

``synchronized_moments`` is the batch statistics of a synchronized batch
normalization (Keras' ``BatchNormalization(synchronized=True)`` under a TF
strategy): the mean and variance over every replica's examples, not this
replica's alone. ``polydist_torch`` runs ``nn.SyncBatchNorm`` through it and
``polydist_jax.nnx.SyncBatchNorm`` is built on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polydist._base.arrays import convert_to_array, describe, is_floating
from polydist._base.reduce_op import ReduceOp
from polydist._strategies import context as _context
from polydist.backend._contract import backends_owning, get_backend_for_value

__all__ = [
    "compute_average_loss",
    "compute_average_loss_exact",
    "scale_regularization_loss",
    "synchronized_moments",
]


def _namespace(value: Any) -> Any:
    """The current strategy's array namespace; outside any strategy (the default
    strategy), that of the backend owning ``value``'s type (a ``torch.Tensor``: torch)."""
    if not _context.has_strategy() and backends_owning(value):
        return get_backend_for_value(value).array_namespace()
    return _context.get_strategy().extended.array_namespace()


def _num_replicas_in_sync() -> int:
    ctx = _context.get_replica_context()
    if ctx is not None:
        return ctx.num_replicas_in_sync
    if _context.has_strategy():
        return _context.get_strategy().num_replicas_in_sync
    return 1


def _require_replica_context(name: str) -> None:
    if _context.has_strategy() and _context.in_cross_replica_context():
        raise RuntimeError(
            f"You are calling `{name}` in cross replica context, while it was expected to be "
            "called in replica context: call it inside the function given to strategy.run."
        )


def _weighted_losses(xp: Any, per_example_loss: Any, sample_weight: Any) -> Any:
    """TF's check_per_example_loss_rank and scale_losses_by_sample_weight."""
    losses = convert_to_array(per_example_loss)
    if len(losses.shape) == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least rank "
            f"1, got a scalar ({describe(losses)}). Pass one loss per example, not their mean."
        )
    if not is_floating(xp, losses.dtype):
        raise TypeError(
            f"per_example_loss must be a floating-point array, got {describe(losses)}; cast it "
            "first, e.g. to float32."
        )
    if sample_weight is None:
        return losses
    input_dtype = losses.dtype
    # As TF: multiply in float32, after squeezing or expanding the weights' last
    # dimension to the losses' rank (squeeze_or_expand_dimensions).
    weights = xp.astype(xp.asarray(convert_to_array(sample_weight)), xp.float32)
    scaled = xp.astype(losses, xp.float32)
    rank_diff = len(weights.shape) - len(scaled.shape)
    if rank_diff == 1 and weights.shape[-1] == 1:
        weights = xp.squeeze(weights, axis=-1)
    elif rank_diff == -1:
        weights = xp.expand_dims(weights, axis=-1)
    return xp.astype(scaled * weights, input_dtype)


def _div_no_nan(xp: Any, total: Any, count: Any) -> Any:
    total = xp.asarray(total)
    count = xp.asarray(count, dtype=total.dtype)
    zero = count == 0
    return xp.where(zero, xp.zeros_like(total), total / xp.where(zero, xp.ones_like(count), count))


def compute_average_loss(
    per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None
) -> Any:
    """Sums ``per_example_loss`` (times ``sample_weight``) and divides by the global batch size.

    TF's ``tf.nn.compute_average_loss``, result for result. ``global_batch_size``
    defaults to ``per_example_loss.shape[0] * num_replicas_in_sync``, which
    assumes every replica got as many examples as this one: under a partial
    last batch that mis-scales the loss (see the module doc). Pass the true
    ``global_batch_size``, or use ``compute_average_loss_exact``. A global
    batch size of 0 gives 0. Call it in replica context (inside
    ``strategy.run``) when ``global_batch_size`` is not given.
    """
    xp = _namespace(per_example_loss)
    losses = _weighted_losses(xp, per_example_loss, sample_weight)
    if global_batch_size is None:
        _require_replica_context("compute_average_loss")
        global_batch_size = int(losses.shape[0]) * _num_replicas_in_sync()
    else:
        _check_global_batch_size(global_batch_size)
    return _div_no_nan(xp, xp.sum(losses), global_batch_size)


def _check_global_batch_size(value: Any) -> None:
    if isinstance(value, bool):
        raise TypeError(f"global_batch_size must be an integer, got {value!r}.")
    if isinstance(value, int | np.integer):
        if value < 0:
            raise ValueError(f"global_batch_size must be non-negative, got {value}.")
        return
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(
            f"global_batch_size must be an integer, got {type(value).__name__} {value!r}."
        )
    if len(value.shape) != 0:
        raise ValueError(f"global_batch_size must be scalar, got {describe(value)}.")
    if not np.issubdtype(np.dtype(str(value.dtype).removeprefix("torch.")), np.integer):
        raise TypeError(f"global_batch_size must be an integer, got {describe(value)}.")


def compute_average_loss_exact(per_example_loss: Any, sample_weight: Any = None) -> Any:
    """Like ``compute_average_loss``, but divides by the true global number of examples.

    The global count is the all-reduced sum of every replica's
    ``per_example_loss.shape[0]``, so the per-replica results of one step sum
    to the exact mean loss even when the last batch is partial or some
    replicas got empty batches (those return 0). A polydist extension.

    It is a collective: call it inside ``strategy.run`` on every replica (as
    every replica runs the same function, that is the normal use).
    """
    _require_replica_context("compute_average_loss_exact")
    xp = _namespace(per_example_loss)
    losses = _weighted_losses(xp, per_example_loss, sample_weight)
    ctx = _context.get_replica_context()
    local_count = np.asarray(losses.shape[0], dtype=np.int32)
    global_count = local_count if ctx is None else ctx.all_reduce(ReduceOp.SUM, local_count)
    return _div_no_nan(xp, xp.sum(losses), global_count)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Sums ``regularization_loss`` and divides by ``num_replicas_in_sync`` (TF's function).

    Summed over the replicas, the regularization term then counts once.
    """
    _require_replica_context("scale_regularization_loss")
    xp = _namespace(regularization_loss)
    total = xp.asarray(xp.sum(convert_to_array(regularization_loss)))
    return total / xp.asarray(_num_replicas_in_sync(), dtype=total.dtype)


def _axes(axes: Any, ndim: int) -> tuple[int, ...]:
    items = (axes,) if isinstance(axes, int | np.integer) else tuple(axes)
    out: list[int] = []
    for a in items:
        if isinstance(a, bool) or not isinstance(a, int | np.integer):
            raise TypeError(f"synchronized_moments: axes must be integers, got {axes!r}.")
        if not -ndim <= a < ndim:
            raise ValueError(
                f"synchronized_moments: axis {a} is out of range for an array of rank {ndim} "
                f"(axes={axes!r})."
            )
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"synchronized_moments: axes {axes!r} repeat an axis.")
    return tuple(sorted(out))


def _divide_or_nan(xp: Any, total: Any, count: Any) -> Any:
    """``total / count``, NaN where ``count`` is 0 (``tf.nn.moments`` of no elements),
    without NumPy's 0/0 warning."""
    empty = count == 0
    return xp.where(empty, xp.full_like(total, float("nan")), total / xp.where(empty, 1, count))


def synchronized_moments(
    x: Any,
    axes: Any,
    *,
    keepdims: bool = False,
    mask: Any = None,
    return_count: bool = False,
) -> Any:
    """The mean and variance of ``x`` over ``axes`` and over every replica in sync.

    A polydist extension (TF computes the same inside Keras'
    ``BatchNormalization(synchronized=True)``; ``tf.nn.moments`` is this
    replica's alone). In replica context each replica passes its own part of
    the batch, and every replica gets the moments of the whole global batch:
    what ``tf.nn.moments(x, axes)`` gives on one device holding all of it.
    Replicas may hold different numbers of examples, none included (the last,
    partial batch). Outside replica context (cross-replica context, or no
    strategy), and with one replica in sync, they are ``x``'s own moments, as
    Keras' layer does.

    It is one collective (an ``all_gather`` of each replica's count, mean and
    sum of squared deviations, combined with Chan et al.'s pairwise formula,
    so no cancellation of ``E[x**2] - E[x]**2``), so call it on every replica.
    It is differentiable on the backends whose collectives are (TF's rule: a
    gradient flows to every replica's examples). The variance is the biased
    (population) one. Floating inputs narrower than 32 bits are computed, and
    returned, in float32 (as Keras and Flax compute batch statistics).

    Args:
      x: a floating array, this replica's examples.
      axes: the axes to reduce (an int or a sequence of ints), e.g. ``[0]`` for
        a dense layer's batch, ``[0, 1, 2]`` for NHWC images.
      keepdims: keep the reduced axes with size 1.
      mask: ``None``, or a boolean array broadcastable to ``x``: only the
        ``True`` elements count (Flax's ``BatchNorm(mask=...)``).
      return_count: also return the global number of elements each statistic
        counts (an array of the statistics' shape and dtype), e.g. for the
        unbiased variance ``var * n / (n - 1)`` that ``torch.nn.BatchNorm``
        keeps in its running statistics.

    Returns:
      ``(mean, variance)``, or ``(mean, variance, count)`` with
      ``return_count=True``. Where the global count is 0 both are NaN.
    """
    xp = _namespace(x)
    x = convert_to_array(x)
    if not is_floating(xp, x.dtype):
        raise TypeError(
            f"synchronized_moments needs a floating array, got {describe(x)}: cast it first "
            "(x.astype(float32))."
        )
    reduced = _axes(axes, len(x.shape))
    if getattr(x.dtype, "itemsize", 4) < 4:
        x = xp.astype(x, xp.float32)
    if mask is None:
        size = 1
        for i in reduced:
            size *= int(x.shape[i])
        total = xp.sum(x, axis=reduced, keepdims=True)
        count = xp.full_like(total, float(size))  # on x's device
        local_mean = total / count if size else xp.zeros_like(total)
        deviation = x - local_mean
        squares = xp.sum(deviation * deviation, axis=reduced, keepdims=True)
    else:
        weight = xp.astype(xp.broadcast_to(xp.asarray(mask), x.shape), x.dtype)
        count = xp.sum(weight, axis=reduced, keepdims=True)
        total = xp.sum(x * weight, axis=reduced, keepdims=True)
        local_mean = _div_no_nan(xp, total, count)
        deviation = (x - local_mean) * weight
        squares = xp.sum(deviation * deviation, axis=reduced, keepdims=True)
    ctx = _context.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        mean = _divide_or_nan(xp, total, count)
        variance = _divide_or_nan(xp, squares, count)
    else:
        # One collective: every replica's (count, mean, M2), combined exactly as one
        # device's two-pass moments would be (Chan, Golub & LeVeque's pairwise update).
        packed = xp.stack([count, local_mean, squares])
        gathered = ctx.all_gather(xp.expand_dims(packed, axis=0), axis=0)
        counts, means, m2s = gathered[:, 0, ...], gathered[:, 1, ...], gathered[:, 2, ...]
        count = xp.sum(counts, axis=0)
        mean = _divide_or_nan(xp, xp.sum(counts * means, axis=0), count)
        spread = means - xp.expand_dims(mean, axis=0)
        m2 = xp.sum(m2s, axis=0) + xp.sum(counts * spread * spread, axis=0)
        variance = _divide_or_nan(xp, m2, count)
    if not keepdims:
        mean = xp.squeeze(mean, axis=reduced)
        variance = xp.squeeze(variance, axis=reduced)
        count = xp.squeeze(count, axis=reduced)
    return (mean, variance, count) if return_count else (mean, variance)
