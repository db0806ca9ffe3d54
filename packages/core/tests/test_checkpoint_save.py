"""checkpoint.save / checkpoint.restore of variables, on top of the storage layer.

Reference: "Values and variables" (checkpoints: SyncOnRead saves the aggregate,
restoring SUM divides by N) in shared/reference/tf-distribute-and-peers.md;
polydist splits a SUM exactly instead (docs/concepts/variables.md#checkpoints).
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    import ml_dtypes
except ImportError:  # optional: its tests are skipped without it
    ml_dtypes = None

import polydist as pd
from polydist import checkpoint
from polydist.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    list_checkpoints,
    read_arrays,
    read_manifest,
)

VA = pd.VariableAggregation
VS = pd.VariableSynchronization
TMP_PREFIX = ".polydist-tmp-"


def rid() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


def copies(v: Any) -> list[Any]:
    return [c.numpy().tolist() for c in v.values]


def make_model(strategy: pd.Strategy, fill: float = 0.0) -> dict[str, Any]:
    """The same variables (names, shapes, dtypes) under any strategy."""
    with strategy.scope():
        return {
            "kernel": pd.Variable(np.full((3, 2), fill, np.float32), name="dense/kernel"),
            "bias": pd.Variable(np.full(2, fill, np.float32), name="dense/bias"),
            "loss_sum": pd.Variable(
                0.0, name="metrics/loss_sum", synchronization=VS.ON_READ, aggregation=VA.SUM
            ),
            "accuracy": pd.Variable(
                0.0, name="metrics/accuracy", synchronization=VS.ON_READ, aggregation=VA.MEAN
            ),
            "first": pd.Variable(
                0,
                name="metrics/first",
                synchronization=VS.ON_READ,
                aggregation=VA.ONLY_FIRST_REPLICA,
            ),
            "step": pd.Variable(0, name="step", aggregation=VA.ONLY_FIRST_REPLICA),
        }


def trained(strategy: pd.Strategy) -> dict[str, Any]:
    model = make_model(strategy)
    model["kernel"].assign(np.arange(6, dtype=np.float32).reshape(3, 2))
    model["bias"].assign(np.array([0.5, -0.5], np.float32))
    model["step"].assign(7)

    def fn() -> None:
        model["loss_sum"].assign(np.float32(rid() + 1))  # 1, 2, 3, 4 -> SUM 10
        model["accuracy"].assign(np.float32(rid()))  # 0, 1, 2, 3 -> MEAN 1.5
        model["first"].assign(rid() + 5)  # replica 0's: 5

    strategy.run(fn)
    return model


class TestRoundTrip:
    def test_strategy_round_trip_stores_tf_values(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(4)
        model = trained(strategy)
        path = checkpoint.save(tmp_path, strategy, step=3)
        assert path == tmp_path / "ckpt-3"
        stored = read_arrays(tmp_path)
        assert list(stored) == [
            "dense/kernel",
            "dense/bias",
            "metrics/loss_sum",
            "metrics/accuracy",
            "metrics/first",
            "step",
        ]
        assert stored["metrics/loss_sum"].tolist() == 10.0  # the aggregate (TF)
        assert stored["metrics/accuracy"].tolist() == 1.5
        assert stored["metrics/first"].tolist() == 5 and stored["step"].tolist() == 7
        info = read_manifest(tmp_path).metadata["polydist_variables"]
        assert info["metrics/loss_sum"] == {  # type: ignore[index]
            "name": "metrics/loss_sum:0",
            "class": "SyncOnReadVariable",
            "synchronization": "ON_READ",
            "aggregation": "SUM",
            "replicas": 4,
        }

        fresh = pd.MirroredStrategy(4)
        restored = make_model(fresh, fill=9.0)
        manifest = checkpoint.restore(tmp_path, fresh)
        assert manifest.step == 3
        assert copies(restored["kernel"]) == [model["kernel"].numpy().tolist()] * 4
        assert copies(restored["loss_sum"]) == [10.0, -0.0, -0.0, -0.0]  # exact split
        assert float(restored["loss_sum"].read_value()) == 10.0
        assert copies(restored["accuracy"]) == [1.5] * 4
        assert copies(restored["first"]) == [5] * 4
        assert copies(restored["step"]) == [7] * 4

    @pytest.mark.parametrize("replicas", [1, 2, 8])
    def test_restore_into_another_replica_count(self, tmp_path: Path, replicas: int) -> None:
        source = pd.MirroredStrategy(4)
        model = trained(source)
        checkpoint.save(tmp_path, source)
        target = pd.MirroredStrategy(replicas)
        restored = make_model(target)
        checkpoint.restore(tmp_path, target)
        assert copies(restored["bias"]) == [[0.5, -0.5]] * replicas
        assert copies(restored["loss_sum"]) == [10.0] + [-0.0] * (replicas - 1)  # exact
        assert float(restored["loss_sum"].read_value()) == 10.0
        assert float(restored["accuracy"].read_value()) == 1.5
        assert model["kernel"].numpy().tolist() == restored["kernel"].numpy().tolist()

    def test_restore_into_one_device_and_plain_variables(self, tmp_path: Path) -> None:
        source = pd.MirroredStrategy(2)
        trained_model = trained(source)
        checkpoint.save(tmp_path, trained_model)  # a dict: keys are the dict's keys
        assert set(read_arrays(tmp_path)) == set(trained_model)
        one = make_model(pd.OneDeviceStrategy("/cpu:0"))
        checkpoint.restore(tmp_path, one)
        assert type(one["loss_sum"]) is pd.Variable
        assert float(one["loss_sum"].numpy()) == 3.0  # 1 + 2: one copy holds the sum
        plain = {"kernel": pd.Variable(np.zeros((3, 2), np.float32))}
        checkpoint.restore(tmp_path, plain)
        assert plain["kernel"].numpy().tolist() == [[0, 1], [2, 3], [4, 5]]

    def test_integer_sum_is_split_exactly(self, tmp_path: Path) -> None:
        plain = pd.Variable(np.int32(10), name="count")
        checkpoint.save(tmp_path, plain)
        strategy = pd.MirroredStrategy(3)
        with strategy.scope():
            count = pd.Variable(0, name="count", synchronization=VS.ON_READ, aggregation=VA.SUM)
        checkpoint.restore(tmp_path, count)
        assert copies(count) == [4, 3, 3]  # not TF's int(10 / 3) = 3 in each copy (9)
        assert int(count.read_value()) == 10

    @pytest.mark.parametrize("restore_replicas", [1, 2, 3, 5, 7])
    @pytest.mark.parametrize("save_replicas", [2, 3, 4])
    def test_sum_on_read_restores_bit_for_bit(
        self, tmp_path: Path, save_replicas: int, restore_replicas: int
    ) -> None:
        """Issue 22 item 2: an int64 counter that read 7 came back as 6 (TF's value / N)."""

        def counters(strategy: pd.Strategy) -> dict[str, Any]:
            kw: dict[str, Any] = {"synchronization": VS.ON_READ, "aggregation": VA.SUM}
            with strategy.scope():
                return {
                    "c": pd.Variable(np.int64(0), name="c", **kw),
                    "u": pd.Variable(np.zeros(3, np.uint8), name="u", **kw),
                    "f": pd.Variable(np.zeros(4, np.float32), name="f", **kw),
                    "z": pd.Variable(np.zeros(1, np.complex64), name="z", **kw),
                }

        s = pd.MirroredStrategy(save_replicas)
        saved = counters(s)

        def step() -> None:
            r = rid()
            saved["c"].assign_add(3 + r)
            saved["u"].assign_add(np.array([255 - r, 1, 128], np.uint8))
            # 0.1 + 0.2 + ...: sums whose division by N rounds (TF loses their last bits)
            saved["f"].assign_add(np.array([0.1, -0.0, 1e-8, 3.3], np.float32) * (r + 1))
            saved["z"].assign_add(np.array([complex(0.1 * (r + 1), -0.0)], np.complex64))

        s.run(step)
        want = {k: np.asarray(v.read_value()) for k, v in saved.items()}
        assert int(want["c"]) == sum(3 + r for r in range(save_replicas))  # 7 at 2 replicas
        checkpoint.save(tmp_path, s)
        t = s if restore_replicas == save_replicas else pd.MirroredStrategy(restore_replicas)
        restored = saved if t is s else counters(t)
        for v in restored.values():
            v.assign(np.zeros(v.shape, v.dtype))
        checkpoint.restore(tmp_path, t)
        for k, v in restored.items():
            got = np.asarray(v.read_value())
            assert (got.dtype, got.tobytes()) == (want[k].dtype, want[k].tobytes()), k

    def test_byte_order_restores_bit_for_bit(self, tmp_path: Path) -> None:
        """A big-endian variable restores into the very variable it was saved from, its
        bytes and byte order as they were (once refused: '>i4' was compared with
        'int32'); a variable of the other byte order does not take it."""
        s = pd.MirroredStrategy(2)
        init = {
            "i": np.array([1, -2, 2**30], ">i4"),
            "f": np.array([1.5, -0.0, np.inf], ">f8"),
            "h": np.array([0.1, -2.0], ">f2"),
            "z": np.array([complex(1, -0.0)], ">c16"),
            "n": np.array([3, 4], "<i4"),
        }
        with s.scope():
            vs = {k: pd.Variable(a, name=k) for k, a in init.items()}
            count = pd.Variable(
                np.array([7], ">i8"), name="count", synchronization=VS.ON_READ, aggregation=VA.SUM
            )
        total = np.asarray(count.read_value())  # 14: each copy starts at 7
        path = checkpoint.save(tmp_path, s)
        for v in [*vs.values(), count]:
            v.assign(np.zeros(v.shape, v.dtype))
        checkpoint.restore(path, s)
        for k, v in vs.items():
            for c in v.values:
                got = c.numpy()
                assert (got.dtype.str, got.tobytes()) == (init[k].dtype.str, init[k].tobytes()), k
        got = np.asarray(count.read_value())  # split exactly among the copies: '>i8' too
        assert (got.dtype.str, got.tobytes()) == (">i8", total.tobytes())
        # Checkpoint (train) compares the same way
        ck = pd.train.Checkpoint(**vs)
        saved = ck.save(tmp_path / "train" / "ckpt")
        vs["i"].assign(np.zeros(3, ">i4"))
        ck.restore(saved).assert_consumed()
        assert np.asarray(vs["i"].read_value()).tobytes() == init["i"].tobytes()
        with s.scope():
            native = pd.Variable(np.zeros(3, np.int32), name="native")
            swapped = pd.Variable(np.zeros(2, ">i4"), name="swapped")
        with pytest.raises(
            CheckpointMismatchError, match=r"is int32\[3\] but the checkpoint holds >i4\[3\]"
        ):
            checkpoint.restore(path, {"i": native})
        with pytest.raises(
            CheckpointMismatchError, match=r"is >i4\[2\] but the checkpoint holds int32"
        ):
            checkpoint.restore(path, {"n": swapped})
        with pytest.raises(CheckpointMismatchError, match=r"'i' is int32\[3\]"):
            pd.train.Checkpoint(i=native).restore(saved)
        assert not np.asarray(native.read_value()).any()

    def test_nest_keys(self, tmp_path: Path) -> None:
        a, b, c = pd.Variable(1.0), pd.Variable(2.0), pd.Variable(3.0)
        checkpoint.save(tmp_path, {"w": a, "layers": [b, (c,)]})
        assert read_arrays(tmp_path).keys() == {"w", "layers/0", "layers/1/0"}
        checkpoint.save(tmp_path / "single", pd.Variable(4.0, name="scale"))
        assert list(read_arrays(tmp_path / "single")) == ["scale"]

    def test_step_and_max_to_keep(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        v = make_model(strategy)["step"]
        for step in range(1, 5):
            v.assign(step)
            checkpoint.save(tmp_path, strategy, max_to_keep=2)
        assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-3", "ckpt-4"]
        v.assign(0)
        assert checkpoint.restore(tmp_path / "ckpt-3", strategy).step == 3
        assert copies(v) == [3, 3]


class TestErrors:
    def test_missing_shape_and_dtype_mismatch_name_each_variable(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        _model = trained(strategy)  # the strategy saves the variables that are still alive
        checkpoint.save(tmp_path, strategy)
        other = pd.MirroredStrategy(2)
        with other.scope():
            kernel = pd.Variable(np.zeros((2, 3), np.float32), name="dense/kernel")
            bias = pd.Variable(np.zeros(2, np.float64), name="dense/bias")
            typo = pd.Variable(0.0, name="dense/kernal")
        with pytest.raises(CheckpointMismatchError) as info:
            checkpoint.restore(tmp_path, other)
        message = str(info.value)
        assert (
            "'dense/kernel' (MirroredVariable 'dense/kernel:0') is float32[2, 3] but the "
            "checkpoint holds float32[3, 2]" in message
        )
        assert "'dense/bias' (MirroredVariable 'dense/bias:0') is float64[2]" in message
        assert (
            "'dense/kernal' (MirroredVariable 'dense/kernal:0') is not in the checkpoint "
            "(did you mean 'dense/kernel'" in message
        )
        assert isinstance(info.value, ValueError)
        # Nothing was written.
        assert copies(kernel) == [np.zeros((2, 3)).tolist()] * 2
        assert copies(bias) == [[0.0, 0.0]] * 2 and copies(typo) == [0.0, 0.0]

    def test_corrupt_checkpoint_names_the_variable(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        model = trained(strategy)
        path = checkpoint.save(tmp_path, strategy)
        assert path is not None
        data = path / "tensors.safetensors"
        raw = bytearray(data.read_bytes())
        n = int.from_bytes(raw[:8], "little")  # the header says where each tensor is
        start = json.loads(raw[8 : 8 + n])["dense/bias"]["data_offsets"][0]
        raw[8 + n + start] ^= 0xFF
        data.write_bytes(bytes(raw))
        model["bias"].assign(np.zeros(2, np.float32))
        with pytest.raises(CheckpointCorruptError, match=r"variable 'dense/bias' .*: checksum"):
            checkpoint.restore(tmp_path, strategy)
        assert copies(model["bias"]) == [[0.0, 0.0]] * 2
        with pytest.raises(CheckpointNotFoundError):
            checkpoint.restore(tmp_path / "nothing", strategy)

    def test_duplicate_names_and_bad_inputs(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        with pytest.raises(ValueError, match="has created no variables"):
            checkpoint.save(tmp_path, strategy)
        with strategy.scope():
            kept = [pd.Variable(1.0), pd.Variable(2.0)]  # the strategy tracks live ones only
        with pytest.raises(ValueError, match="two variables would be stored as 'Variable'"):
            checkpoint.save(tmp_path, strategy)
        checkpoint.save(tmp_path / "ok", {"a": kept[0], "b": kept[1]})
        with pytest.raises(TypeError, match="the value at x is a ndarray, not a polydist.Variable"):
            checkpoint.save(tmp_path, {"x": np.ones(2)})
        with pytest.raises(ValueError, match="no variables given"):
            checkpoint.save(tmp_path, {})
        assert [p.name for p in tmp_path.iterdir()] == ["ok"]

    def test_sync_on_read_none_cannot_be_saved(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        with strategy.scope():
            m = pd.Variable(0.0, name="m", synchronization=VS.ON_READ)
        with pytest.raises(ValueError, match="'m:0' has aggregation NONE"):
            checkpoint.save(tmp_path, [m])

    def test_not_in_replica_context(self, tmp_path: Path) -> None:
        strategy = pd.MirroredStrategy(2)
        v = make_model(strategy)
        with pytest.raises(RuntimeError, match="checkpoint.save must be called in cross-replica"):
            strategy.run(lambda: checkpoint.save(tmp_path, v))

    def test_only_the_chief_writes(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        strategy = pd.MirroredStrategy(2)
        _model = trained(strategy)  # the strategy saves the variables that are still alive
        monkeypatch.setattr(strategy.extended, "_is_chief", False, raising=False)
        assert strategy.extended.should_checkpoint is False
        assert checkpoint.save(tmp_path, strategy) is None
        assert not tmp_path.exists() or list(tmp_path.iterdir()) == []

    def test_only_the_chief_writes_a_nest_of_variables(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        strategy = pd.MirroredStrategy(2)
        v = make_model(strategy)
        monkeypatch.setattr(strategy.extended, "_is_chief", False, raising=False)
        assert checkpoint.save(tmp_path, {"v": v}) is None
        assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


# -- old checkpoints, and ml_dtypes' floats -----------------------------------------------------


def write_format_1(root: Path, step: int, arrays: dict[str, np.ndarray]) -> Path:
    """A checkpoint laid out by hand as polydist wrote it before format version 2."""
    ckpt = root / f"ckpt-{step}"
    ckpt.mkdir(parents=True)
    items = []
    for i, (name, array) in enumerate(arrays.items()):
        file = f"{i:06d}.npy"
        np.save(ckpt / file, array)
        sha = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
        items.append(
            {
                "name": name,
                "file": file,
                "shape": list(array.shape),
                "dtype": array.dtype.str,
                "nbytes": array.nbytes,
                "sha256": sha,
            }
        )
    manifest = {
        "format": "polydist.checkpoint",
        "format_version": 1,
        "step": step,
        "created_unix": 1700000000.0,
        "metadata": {"polydist_variables": {}},
        "arrays": items,
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    pointer = {
        "format": "polydist.checkpoint.pointer",
        "format_version": 1,
        "latest": ckpt.name,
        "updated_unix": 1700000000.0,
    }
    (root / "checkpoint").write_text(json.dumps(pointer, indent=1) + "\n")
    return ckpt


def test_checkpoints_of_format_1_still_restore(tmp_path: Path) -> None:
    kernel = np.arange(6, dtype=np.float32).reshape(3, 2)
    write_format_1(
        tmp_path,
        5,
        {
            "dense/kernel": kernel,
            "dense/bias": np.array([0.5, -0.5], np.float32),
            "metrics/loss_sum": np.array(10.0, np.float32),
            "metrics/accuracy": np.array(1.5, np.float32),
            "metrics/first": np.array(5, np.int32),
            "step": np.array(7, np.int32),
        },
    )
    strategy = pd.MirroredStrategy(2)
    model = make_model(strategy, fill=9.0)
    manifest = checkpoint.restore(tmp_path, strategy)
    assert (manifest.step, manifest.format_version) == (5, 1)
    assert copies(model["kernel"]) == [kernel.tolist()] * 2
    assert copies(model["bias"]) == [[0.5, -0.5]] * 2
    assert copies(model["loss_sum"]) == [10.0, -0.0]  # SUM: split exactly
    assert copies(model["accuracy"]) == [1.5, 1.5]
    assert copies(model["first"]) == [5, 5] and copies(model["step"]) == [7, 7]


needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes")
# bfloat16 bits: NaNs (quiet, negative with a payload, signalling), +inf, -inf, -0.0,
# the smallest subnormal, 1.5.
BF16_SPECIAL = np.array([0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3FC0], np.uint16)


def bits(v: Any) -> list[list[int]]:
    """The bits of each copy of a bfloat16 or float8 variable."""
    arrays = [np.asarray(c.numpy()) for c in v.values]
    return [a.view(f"u{a.dtype.itemsize}").tolist() for a in arrays]


@needs_ml_dtypes
class TestMlDtypes:
    def test_variables_round_trip_bit_for_bit(self, tmp_path: Path) -> None:
        bf16, e4m3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
        every_e4m3 = np.arange(256, dtype=np.uint8)  # each float8 value, NaNs and -0.0 too
        strategy = pd.MirroredStrategy(2)
        with strategy.scope():
            kept = [  # the strategy saves the variables that are still alive
                pd.Variable(BF16_SPECIAL.view(bf16), name="w"),
                pd.Variable(every_e4m3.view(e4m3), name="q"),
                pd.Variable(
                    BF16_SPECIAL.view(bf16),
                    name="first",
                    synchronization=VS.ON_READ,
                    aggregation=VA.ONLY_FIRST_REPLICA,
                ),
            ]
            total = pd.Variable(
                np.zeros(2, bf16), name="total", synchronization=VS.ON_READ, aggregation=VA.SUM
            )
            kept.append(pd.Variable(np.array([np.nan, -0.0, 0.1], np.float32), name="kernel"))
        strategy.run(lambda: total.assign(np.array([1.5, -2.25], bf16)))  # SUM: [3, -4.5]
        assert checkpoint.save(tmp_path, strategy) is not None
        held = {n: s.dtype.name for n, s in read_manifest(tmp_path).arrays.items()}
        assert held == {
            "w": "bfloat16",
            "q": "float8_e4m3fn",
            "first": "bfloat16",
            "total": "bfloat16",
            "kernel": "float32",
        }

        target = pd.MirroredStrategy(3)
        with target.scope():
            w2 = pd.Variable(np.ones(8, bf16), name="w")
            q2 = pd.Variable(np.ones(256, e4m3), name="q")
            first2 = pd.Variable(
                np.ones(8, bf16),
                name="first",
                synchronization=VS.ON_READ,
                aggregation=VA.ONLY_FIRST_REPLICA,
            )
            total2 = pd.Variable(
                np.ones(2, bf16), name="total", synchronization=VS.ON_READ, aggregation=VA.SUM
            )
            kernel2 = pd.Variable(np.ones(3, np.float32), name="kernel")
        checkpoint.restore(tmp_path, target)
        assert bits(w2) == [BF16_SPECIAL.tolist()] * 3
        assert bits(first2) == [BF16_SPECIAL.tolist()] * 3
        assert bits(q2) == [every_e4m3.tolist()] * 3
        assert [c.tolist() for c in map(np.asarray, copies(total2))] == [
            [3.0, -4.5],
            [-0.0, -0.0],
            [-0.0, -0.0],
        ]
        assert np.asarray(total2.read_value()).tolist() == [3.0, -4.5]  # the saved sum
        assert (
            bits(kernel2)
            == [np.array([np.nan, -0.0, 0.1], np.float32).view(np.uint32).tolist()] * 3
        )

    def test_restoring_into_another_dtype_is_refused(self, tmp_path: Path) -> None:
        bf16 = np.dtype(ml_dtypes.bfloat16)
        checkpoint.save(tmp_path / "bf16", {"w": pd.Variable(np.ones(2, bf16))})
        checkpoint.save(tmp_path / "f32", {"w": pd.Variable(np.ones(2, np.float32))})
        as_f32 = pd.Variable(np.zeros(2, np.float32), name="w")
        as_bf16 = pd.Variable(np.zeros(2, bf16), name="w")
        as_e4m3 = pd.Variable(np.zeros(2, ml_dtypes.float8_e4m3fn), name="w")
        for root, var, want, have in [
            ("bf16", as_f32, "float32", "bfloat16"),
            ("f32", as_bf16, "bfloat16", "float32"),
            ("bf16", as_e4m3, "float8_e4m3fn", "bfloat16"),
        ]:
            with pytest.raises(
                CheckpointMismatchError,
                match=re.escape(
                    f"'w' (Variable 'w:0') is {want}[2] but the checkpoint holds {have}[2]"
                ),
            ):
                checkpoint.restore(tmp_path / root, {"w": var})
            assert np.asarray(var.numpy()).astype(np.float32).tolist() == [0.0, 0.0]


# -- crash safety at the save() level ----------------------------------------------------------

CHILD = r"""
import sys, time
import numpy as np
import polydist as pd
from polydist import checkpoint
from polydist.checkpoint import _io

root, stage, detail, signal_file = sys.argv[1:]
strategy = pd.MirroredStrategy(4)
with strategy.scope():
    w = pd.Variable(np.full((512, 512), 3.0, np.float32), name="w")
    m = pd.Variable(0.0, name="m", synchronization=pd.VariableSynchronization.ON_READ,
                    aggregation=pd.VariableAggregation.SUM)
strategy.run(lambda: m.assign_add(np.float32(100.0)))

def hook(s, d):
    if s == stage and detail in ("*", d):
        with open(signal_file, "w") as f:
            f.write(s)
        time.sleep(600)  # wait here to be SIGKILLed

_io._test_hook = hook
checkpoint.save(root, strategy, step=2)
print("finished without pausing", file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("stage", "detail"),
    [("tensors-started", "*"), ("array-written", "w"), ("before-pointer", "*")],
)
def test_killed_during_save_keeps_the_previous_checkpoint(
    tmp_path: Path, stage: str, detail: str
) -> None:
    root = tmp_path / "ckpts"
    first = pd.MirroredStrategy(2)
    with first.scope():
        w = pd.Variable(np.full((512, 512), 1.0, np.float32), name="w")
        m = pd.Variable(0.0, name="m", synchronization=VS.ON_READ, aggregation=VA.SUM)
    first.run(lambda: m.assign_add(np.float32(5.0)))  # sum 10
    checkpoint.save(root, first, step=1)

    signal_file = tmp_path / "paused"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), stage, detail, str(signal_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not signal_file.exists():
            if proc.poll() is not None:
                err = proc.communicate()[1].decode(errors="replace")
                pytest.fail(f"child exited early ({proc.returncode}) before pausing:\n{err}")
            if time.monotonic() > deadline:
                pytest.fail("child did not reach the pause point in time")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)

    # The step-1 checkpoint is still the latest and restores into another replica count.
    other = pd.MirroredStrategy(3)
    with other.scope():
        w3 = pd.Variable(np.zeros((512, 512), np.float32), name="w")
        m3 = pd.Variable(0.0, name="m", synchronization=VS.ON_READ, aggregation=VA.SUM)
    assert checkpoint.restore(root, other).step == 1
    assert float(w3.values[2].numpy()[0, 0]) == 1.0 and float(m3.read_value()) == 10.0
    # The next save succeeds and cleans up what the killed writer left.
    w.assign(np.full((512, 512), 2.0, np.float32))
    assert checkpoint.save(root, first, step=2) == root / "ckpt-2"
    assert not [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    checkpoint.restore(root, other)
    assert float(w3.values[0].numpy()[0, 0]) == 2.0
