"""``SyncBatchNorm``: Flax's ``nnx.BatchNorm`` with the batch statistics of every replica.

Re-exported by ``polydist_jax.nnx``; see ``SyncBatchNorm``'s docstring.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import normalization as _flax_norm

import polydist as pd

# Flax's own helpers (untyped), so that the normalization and the axes are nnx.BatchNorm's.
_normalize: Any = _flax_norm._normalize
_canonicalize_axes: Any = _flax_norm._canonicalize_axes


class SyncBatchNorm(nnx.BatchNorm):
    """``flax.nnx.BatchNorm`` whose batch statistics span every replica in sync.

    The Flax twin of Keras' ``BatchNormalization(synchronized=True)`` (and of
    ``torch.nn.SyncBatchNorm``): the same constructor, call and state
    (``mean``, ``var``, ``scale``, ``bias``) as ``nnx.BatchNorm``, so swapping
    the class is the only change, and the weights of one load into the other.

    In training mode (``use_running_average=False``) inside ``strategy.run``,
    the mean and variance are those of the global batch over all replicas,
    ``polydist.nn.synchronized_moments`` over every axis but ``axis`` (one
    ``all_gather`` per call, in compiled and eager runs, with partial batches,
    and across workers), with ``mask`` passed through. The running statistics
    are updated with ``nnx.BatchNorm``'s formula from those, so they stay
    identical on every replica, and one device on the whole batch computes
    the same. The variance is the two-pass one combined across replicas
    (Chan's formula), whatever ``use_fast_variance`` says. In eval mode
    (``use_running_average=True``), and where there is nothing to synchronize
    (no strategy, outside ``run``, one replica in sync), it is
    ``nnx.BatchNorm``, call for call.

    ``axis_name`` and ``axis_index_groups`` are refused: polydist does the
    synchronization, over all replicas (a mesh axis name does not exist in
    eager runs, and spans one worker only).
    """

    def __init__(
        self,
        num_features: int,
        *,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        **kwargs: Any,
    ) -> None:
        if axis_name is not None or axis_index_groups is not None:
            raise ValueError(
                "polydist_jax.nnx.SyncBatchNorm synchronizes its statistics over every "
                "replica of the strategy itself; it takes no axis_name or axis_index_groups "
                f"(got axis_name={axis_name!r}, axis_index_groups={axis_index_groups!r}). "
                "Drop them."
            )
        super().__init__(num_features, **kwargs)

    def __call__(
        self,
        x: Any,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Normalizes ``x`` (see ``nnx.BatchNorm.__call__``)."""
        running = self.use_running_average if use_running_average is None else use_running_average
        ctx = pd.get_replica_context()
        if running is None or running or ctx is None or ctx.num_replicas_in_sync == 1:
            # Eval mode, and nothing to synchronize (no strategy, cross-replica context,
            # one replica): nnx.BatchNorm's own call, use_fast_variance and its error when
            # no mode is set included (as torch's SyncBatchNorm falls back to BatchNorm).
            return super().__call__(x, use_running_average, mask=mask)  # type: ignore[no-any-return]

        # As nnx.BatchNorm.__call__, with synchronized_moments for _compute_stats.
        feature_axes = _canonicalize_axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, _, _, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
        )
        # _compute_stats' dtype: at least float32, the layer's dtype if set, else x's.
        stats_dtype = jnp.promote_types(
            jnp.result_type(x) if self.dtype is None else self.dtype, jnp.float32
        )
        mean, var = pd.nn.synchronized_moments(
            jnp.asarray(x, stats_dtype), reduction_axes, mask=mask
        )
        stop_gradient: Any = (
            jax.lax.stop_gradient
            if self.mean._can_update or self.var._can_update
            else (lambda value: value)
        )
        self.mean[...] = stop_gradient(self.momentum * self.mean[...] + (1 - self.momentum) * mean)
        self.var[...] = stop_gradient(self.momentum * self.var[...] + (1 - self.momentum) * var)
        return _normalize(  # type: ignore[no-any-return]
            x, mean, var, scale, bias, reduction_axes, feature_axes, self.dtype, self.epsilon
        )
