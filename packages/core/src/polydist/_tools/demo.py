"""The README demo: data-parallel training that equals single-device training."""

from __future__ import annotations

import sys
from typing import Any, TextIO, cast

import numpy as np

from polydist._base.reduce_op import ReduceOp
from polydist._strategies.context import get_replica_context
from polydist._strategies.mirrored import MirroredStrategy
from polydist.backend._contract import SupportsReductionOrder, features

FEATURES = 16
PER_REPLICA_BATCH = 32
LEARNING_RATE = 0.1


def _data(global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch, FEATURES)).astype(np.float32)
    true_w = rng.normal(size=(FEATURES,)).astype(np.float32)
    y = (x @ true_w + 0.1 * rng.normal(size=global_batch)).astype(np.float32)
    return x, y


def _sgd_step(xp: Any, w: Any, b: Any, x: Any, y: Any, global_batch: int) -> tuple[Any, Any, Any]:
    """Linear least squares; gradients are sums over examples scaled by the global batch."""
    err = x @ w + b - y
    grad_w = 2.0 * (x.T @ err) / global_batch
    grad_b = 2.0 * xp.sum(err) / global_batch
    loss_sum = xp.sum(err * err)
    return grad_w, grad_b, loss_sum


def _progress_bar(steps: int, out: TextIO) -> Any:
    """A tqdm bar on ``out``, or None without tqdm (imported only here: the library needs none)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=steps, desc="training", unit="step", file=out, leave=True, ncols=80)


def _log_step(step: int, steps: int) -> bool:
    """With a bar, about five loss lines are enough to see the loss fall."""
    return step in (1, steps) or step % max(1, steps // 5) == 0


def run_demo(
    replicas: int = 8,
    steps: int = 20,
    backend: str | None = None,
    out: TextIO | None = None,
    *,
    progress: bool | None = None,
) -> bool:
    """Trains on ``replicas`` replicas and on one device; returns True when they agree.

    ``progress`` shows a live tqdm progress bar on ``out`` (tqdm comes with the
    ``polydist`` command) and logs the loss at a few steps. Otherwise every
    step prints one line with a text bar, which reads better in logs. The
    default is a live bar when ``out`` is a terminal.
    """
    out = sys.stdout if out is None else out
    if progress is None:
        progress = out.isatty()
    strategy = MirroredStrategy(replicas, backend=backend)
    xp = strategy.extended.array_namespace()
    backend_obj = strategy.extended.backend
    order = (
        cast(SupportsReductionOrder, backend_obj).reduction_order
        if features(backend_obj).reduction_order
        else None
    )
    global_batch = PER_REPLICA_BATCH * replicas
    x_all, y_all = _data(global_batch)

    def shard(array: np.ndarray) -> Any:
        def value_fn(ctx: Any) -> Any:
            r = ctx.replica_id_in_sync_group
            return xp.asarray(array[r * PER_REPLICA_BATCH : (r + 1) * PER_REPLICA_BATCH])

        return strategy.experimental_distribute_values_from_function(value_fn)

    x_dist, y_dist = shard(x_all), shard(y_all)

    def replica_step(w: Any, b: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        grads = _sgd_step(xp, w, b, x, y, global_batch)
        ctx = get_replica_context()
        assert ctx is not None  # run() always provides one
        grad_w, grad_b, loss_sum = ctx.all_reduce(ReduceOp.SUM, grads)
        return w - LEARNING_RATE * grad_w, b - LEARNING_RATE * grad_b, loss_sum / global_batch

    title = f"backend: {backend_obj.name}" + (f", reduction: {order}" if order else "")
    print(
        f"polydist demo: linear regression, data-parallel on {replicas} replicas ({title})",
        file=out,
    )
    print(
        f"global batch {global_batch} = {replicas} replicas x {PER_REPLICA_BATCH} examples, "
        f"{steps} SGD steps",
        file=out,
    )
    w: Any = xp.zeros(FEATURES, dtype=xp.float32)
    b: Any = xp.asarray(0.0, dtype=xp.float32)
    identical = True
    bar = _progress_bar(steps, out) if progress else None
    for step in range(1, steps + 1):
        w_pr, b_pr, loss = strategy.run(replica_step, args=(w, b, x_dist, y_dist))
        ws = strategy.experimental_local_results(w_pr)
        identical &= all(
            np.array_equal(backend_obj.to_numpy(v), backend_obj.to_numpy(ws[0])) for v in ws
        )
        w, b = ws[0], strategy.experimental_local_results(b_pr)[0]
        loss_value = float(backend_obj.to_numpy(strategy.experimental_local_results(loss)[0]))
        line = f"step {step:3d}/{steps}  loss {loss_value:10.6f}"
        if bar is None:
            text_bar = "#" * (20 * step // steps)
            print(f"{line}  [{text_bar:<20}]", file=out)
            continue
        bar.set_postfix_str(f"loss {loss_value:.4f}", refresh=False)
        bar.update()
        if _log_step(step, steps):
            bar.write(line, file=out)  # printed above the bar, which stays at the bottom
    if bar is not None:
        bar.close()

    # The same training on one device, on the full global batch.
    w_single = np.zeros(FEATURES, dtype=np.float32)
    b_single = np.float32(0.0)
    for _ in range(steps):
        grad_w, grad_b, _ = _sgd_step(np, w_single, b_single, x_all, y_all, global_batch)
        w_single = w_single - np.float32(LEARNING_RATE) * grad_w
        b_single = b_single - np.float32(LEARNING_RATE) * grad_b
    final_loss_single = float(np.mean((x_all @ w_single + b_single - y_all) ** 2))
    w_dp = backend_obj.to_numpy(w)
    final_loss_dp = float(np.mean((x_all @ w_dp + backend_obj.to_numpy(b) - y_all) ** 2))
    diff = float(np.max(np.abs(w_dp - w_single)))
    scale = float(np.max(np.abs(w_single)))
    agree = bool(np.allclose(w_dp, w_single, rtol=1e-5, atol=1e-6))
    print(f"\nSingle-device training on the full batch of {global_batch} examples:", file=out)
    print(
        f"  final loss      data-parallel {final_loss_dp:.6f}   "
        f"single-device {final_loss_single:.6f}",
        file=out,
    )
    print(
        f"  max |w_dp - w_single| = {diff:.2e} (max |w| = {scale:.3f}; float32 eps = "
        f"{np.finfo(np.float32).eps:.1e}: the two differ only in the order of float32 additions)",
        file=out,
    )
    print(
        f"  all replicas hold bitwise-identical weights: {'yes' if identical else 'NO'}", file=out
    )
    verdict = "equals" if agree and identical else "DOES NOT equal"
    print(
        f"Result: data-parallel training on {replicas} replicas {verdict} single-device training.",
        file=out,
    )
    return agree and identical
