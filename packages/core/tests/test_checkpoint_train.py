"""polydist.train.Checkpoint / CheckpointManager / latest_checkpoint: TF's object-based
checkpoints (issue 19 item 3), on the formats and guarantees of polydist.checkpoint."""

from __future__ import annotations

import json
import os
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import optree
import pytest
import safetensors.numpy

import polydist as pd
from polydist.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from polydist.train import Checkpoint, CheckpointManager, latest_checkpoint, register_checkpointable

VA = pd.VariableAggregation
VS = pd.VariableSynchronization
Pair = namedtuple("Pair", ["w", "b"])


def rid() -> int:
    ctx = pd.get_replica_context()
    assert ctx is not None
    return int(ctx.replica_id_in_sync_group)


class Layer:
    """A Keras-style layer: its state is its `variables`."""

    def __init__(self, fill: float) -> None:
        self.kernel = pd.Variable(np.full((2, 3), fill, np.float32), name="kernel")
        self.bias = pd.Variable(np.full(3, fill, np.float32), name="bias")

    @property
    def variables(self) -> list[pd.Variable]:
        return [self.kernel, self.bias]


class Stateful:
    """An object with state_dict()/load_state_dict() and NumPy arrays (no framework)."""

    def __init__(self, fill: float) -> None:
        self.w = np.full(4, fill, np.float64)
        self.step = 0
        self.lr = 0.1
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "step": self.step, "hyper": {"lr": self.lr, "betas": (0.9, 0.99)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)
        self.w, self.step, self.lr = state["w"], state["step"], state["hyper"]["lr"]


def model(strategy: pd.Strategy, fill: float) -> dict[str, Any]:
    with strategy.scope():
        return {
            "dense": Layer(fill),
            "pair": Pair(
                pd.Variable(np.full(2, fill, np.float32), name="w"),
                pd.Variable(np.float32(fill), name="b"),
            ),
            "count": pd.Variable(
                np.int64(0), name="count", synchronization=VS.ON_READ, aggregation=VA.SUM
            ),
        }


def values(m: dict[str, Any]) -> dict[str, Any]:
    return {
        "kernel": m["dense"].kernel.numpy().tolist(),
        "bias": m["dense"].bias.numpy().tolist(),
        "w": m["pair"].w.numpy().tolist(),
        "b": float(m["pair"].b.numpy()),
        "count": int(m["count"].read_value()),
    }


def test_save_restore_round_trip_names_entries_by_path(tmp_path: Path) -> None:
    s = pd.MirroredStrategy(2)
    m = model(s, 1.0)
    opt = Stateful(2.0)
    s.run(lambda: m["count"].assign_add(3 + rid()))  # reads 7
    ckpt = Checkpoint(model=m, opt=opt)
    path = ckpt.save(tmp_path / "ckpt")
    assert path == os.fspath(tmp_path / "ckpt-1")
    assert int(ckpt.save_counter.numpy()) == 1
    assert latest_checkpoint(tmp_path) == path
    stored = safetensors.numpy.load_file(Path(path) / "tensors.safetensors")
    assert sorted(stored) == [
        "model/count",
        "model/dense/0",
        "model/dense/1",
        "model/pair/b",
        "model/pair/w",
        "opt/w",
        "save_counter",
    ]
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["step"] == 1
    meta = manifest["metadata"]
    assert meta["polydist_variables"]["model/count"]["aggregation"] == "SUM"
    assert "opt" in meta["polydist_checkpoint"]["state_dicts"]

    t = pd.MirroredStrategy(3)  # another replica count
    m2 = model(t, 0.0)
    opt2 = Stateful(0.0)
    ckpt2 = Checkpoint(model=m2, opt=opt2)
    status = ckpt2.restore(path)
    status.assert_consumed().assert_existing_objects_matched().assert_nontrivial_match()
    assert values(m2) == values(m)
    assert values(m2)["count"] == 7  # exact split of the SUM
    assert int(ckpt2.save_counter.numpy()) == 1
    assert opt2.w.tolist() == [2.0] * 4 and opt2.step == 0 and opt2.lr == 0.1
    assert opt2.loaded[0]["hyper"]["betas"] == (0.9, 0.99)  # tuples stay tuples
    assert ckpt2.save(tmp_path / "ckpt") == os.fspath(tmp_path / "ckpt-2")


def test_restore_without_a_strategy_and_nested_checkpoints(tmp_path: Path) -> None:
    s = pd.MirroredStrategy(2)
    m = model(s, 3.0)
    inner = Checkpoint(layer=m["dense"])
    path = Checkpoint(inner=inner, pair=m["pair"]).save(tmp_path / "c")
    plain = model(pd.get_strategy(), 0.0)  # the default strategy: plain variables
    status = Checkpoint(inner=Checkpoint(layer=plain["dense"]), pair=plain["pair"]).restore(path)
    status.assert_consumed()
    assert plain["dense"].kernel.numpy().tolist() == [[3.0] * 3] * 2
    assert float(plain["pair"].b.numpy()) == 3.0


def test_write_and_read(tmp_path: Path) -> None:
    v = pd.Variable(np.float32(1.5), name="v")
    ckpt = Checkpoint(v=v)
    path = ckpt.write(tmp_path / "my_checkpoint")
    assert path == os.fspath(tmp_path / "my_checkpoint")
    assert latest_checkpoint(tmp_path) is None  # write() does not update the pointer
    v.assign(np.float32(0.0))
    ckpt.read(path).assert_consumed()
    assert float(v.numpy()) == 1.5
    # TF: restore() expects save_counter, which write() did not store
    with pytest.raises(AssertionError, match="Object not assigned a value.*save_counter"):
        Checkpoint(v=v).restore(path).expect_partial().assert_consumed()


def test_partial_restores_assert_and_warn(tmp_path: Path) -> None:
    a, b = pd.Variable(1.0, name="a"), pd.Variable(2.0, name="b")
    path = Checkpoint(a=a, b=b).save(tmp_path / "ckpt")
    only_a = Checkpoint(a=pd.Variable(0.0, name="a"))
    status = only_a.restore(path)
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match="Unresolved object in checkpoint.*'?b"):
        status.assert_consumed()
    with pytest.warns(UserWarning, match=r"expect_partial\(\).*could not be found.*b"):
        del status  # dropped with a value left: TF warns alike
    only_a.restore(path).expect_partial()  # silenced: no warning (warnings are errors here)
    more = Checkpoint(a=a, b=b, c=pd.Variable(5.0, name="c"))
    status = more.restore(path)
    with pytest.raises(AssertionError, match="Object not assigned a value from checkpoint.*c"):
        status.assert_existing_objects_matched()
    status.expect_partial()
    nothing = Checkpoint(x=pd.Variable(0.0)).restore(path).expect_partial()
    with pytest.raises(AssertionError, match="Nothing except the root object matched"):
        nothing.assert_nontrivial_match()
    init = Checkpoint(a=a).restore(None)
    with pytest.raises(AssertionError, match=r"No checkpoint specified \(save_path=None\)"):
        init.assert_consumed()


def test_mismatch_and_corruption_change_nothing(tmp_path: Path) -> None:
    a, opt = pd.Variable(np.ones(3, np.float32), name="a"), Stateful(1.0)
    path = Checkpoint(a=a, opt=opt).save(tmp_path / "ckpt")
    wrong = pd.Variable(np.zeros(4, np.float32), name="a")
    opt2 = Stateful(0.0)
    with pytest.raises(CheckpointMismatchError, match=r"'a' is float32\[4\].*float32\[3\]"):
        Checkpoint(a=wrong, opt=opt2).restore(path)
    assert opt2.loaded == []  # nothing was loaded
    opt3 = Stateful(0.0)
    opt3.w = np.zeros(5)
    b = pd.Variable(np.zeros(3, np.float32), name="a")
    with pytest.raises(CheckpointMismatchError, match=r"'opt/w' is float64\[5\]"):
        Checkpoint(a=b, opt=opt3).restore(path)
    assert b.numpy().tolist() == [0.0] * 3
    tensors = Path(path) / "tensors.safetensors"
    raw = bytearray(tensors.read_bytes())
    raw[-1] ^= 1
    tensors.write_bytes(bytes(raw))
    c, opt4 = pd.Variable(np.zeros(3, np.float32), name="a"), Stateful(0.0)
    with pytest.raises(CheckpointCorruptError):
        Checkpoint(a=c, opt=opt4).restore(path)
    assert c.numpy().tolist() == [0.0] * 3 and opt4.loaded == []


def test_what_a_checkpoint_refuses() -> None:
    with pytest.raises(ValueError, match="was expecting 'x' to be a trackable object"):
        Checkpoint(x=3)
    with pytest.raises(ValueError, match="'save' is the name of a Checkpoint attribute"):
        Checkpoint(save=pd.Variable(1.0))
    opt = Stateful(1.0)
    with pytest.raises(ValueError, match="the same Stateful is reachable as 'a' and 'b/0'"):
        Checkpoint(a=opt, b=[opt]).save("unused")
    empty: tuple[()] = ()
    Checkpoint(a=empty, b=(), c={"d": ()})  # shared empty containers are fine
    with pytest.raises(ValueError, match="names a directory"):
        Checkpoint(v=pd.Variable(1.0)).save("ckpts/")


class Box:
    """A framework object that is none of the above: registered."""

    def __init__(self, fill: float, var: pd.Variable | None = None) -> None:
        self.params = {"w": np.full(2, fill, np.float32), "b": np.float32(fill)}
        self.var = var


def test_register_checkpointable(tmp_path: Path) -> None:
    register_checkpointable(
        Box,
        to_nest=lambda box: box.params,
        from_nest=lambda box, nest: setattr(box, "params", nest),
    )
    path = Checkpoint(box=Box(4.0)).save(tmp_path / "ckpt")
    assert sorted(safetensors.numpy.load_file(Path(path) / "tensors.safetensors")) == [
        "box/b",
        "box/w",
        "save_counter",
    ]
    fresh = Box(0.0)
    Checkpoint(box=fresh).restore(path).assert_consumed()
    assert fresh.params["w"].tolist() == [4.0, 4.0] and float(fresh.params["b"]) == 4.0

    class VarBox:
        def __init__(self, v: pd.Variable) -> None:
            self.v = v

    register_checkpointable(VarBox, to_nest=lambda o: {"v": o.v})  # in place
    p2 = Checkpoint(vb=VarBox(pd.Variable(7.0, name="v"))).save(tmp_path / "vb")
    target = VarBox(pd.Variable(0.0, name="v"))
    Checkpoint(vb=target).restore(p2).assert_consumed()
    assert float(target.v.numpy()) == 7.0
    with pytest.raises(TypeError, match="must be a class"):
        register_checkpointable(Box(1.0), to_nest=lambda o: o)  # type: ignore[arg-type]


class Grown:
    """A registered object that gained a leaf since its checkpoint was saved."""

    def __init__(self, fill: float, *, head: bool) -> None:
        self.params = {"w": np.full(2, fill, np.float32)}
        if head:
            self.params["head"] = np.full(3, fill, np.float32)


def test_registered_objects_restore_partially(tmp_path: Path) -> None:
    """A leaf missing from the checkpoint (a layer added since) is unmatched, as in TF;
    the others are still restored (before, the whole object silently kept its values)."""
    register_checkpointable(
        Grown,
        to_nest=lambda g: g.params,
        from_nest=lambda g, nest: setattr(g, "params", nest),
    )
    path = Checkpoint(g=Grown(4.0, head=False)).save(tmp_path / "ckpt")
    grown = Grown(0.0, head=True)
    status = Checkpoint(g=grown).restore(path)
    with pytest.raises(AssertionError, match="not assigned a value.*g/head"):
        status.assert_existing_objects_matched()
    status.expect_partial()
    assert grown.params["w"].tolist() == [4.0, 4.0]
    assert grown.params["head"].tolist() == [0.0, 0.0, 0.0]  # its own value, kept

    class VarGrown:  # every leaf a Variable: only the stored ones are written
        def __init__(self, leaves: dict[str, pd.Variable]) -> None:
            self.leaves = leaves

    def refuse(v: VarGrown, nest: Any) -> None:
        raise AssertionError("the Variables are assigned in place")

    register_checkpointable(VarGrown, to_nest=lambda v: v.leaves, from_nest=refuse)
    strategy = pd.MirroredStrategy(2)
    with strategy.scope():
        w = pd.Variable(np.full(2, 5.0, np.float32), name="w")
        saved = pd.Variable(np.int64(0), name="n", synchronization=VS.ON_READ, aggregation=VA.SUM)
    saved.assign(7)
    path = Checkpoint(v=VarGrown({"w": w, "n": saved})).save(tmp_path / "vars")
    with strategy.scope():
        w2 = pd.Variable(np.zeros(2, np.float32), name="w2")
        n2 = pd.Variable(np.int64(0), name="n2", synchronization=VS.ON_READ, aggregation=VA.SUM)
        new = pd.Variable(
            np.float32(0), name="new", synchronization=VS.ON_READ, aggregation=VA.MEAN
        )
    strategy.run(lambda: new.assign(np.float32(rid())))  # per-replica values 0 and 1
    Checkpoint(v=VarGrown({"w": w2, "n": n2, "new": new})).restore(path).expect_partial()
    assert w2.numpy().tolist() == [5.0, 5.0] and int(n2.read_value()) == 7
    assert [float(c.numpy()) for c in new.values] == [0.0, 1.0]  # untouched


def test_manager_keeps_max_to_keep_and_restores(tmp_path: Path) -> None:
    v = pd.Variable(0.0, name="v")
    ckpt = Checkpoint(v=v)
    manager = CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    paths = []
    for i in range(1, 5):
        v.assign(float(i))
        paths.append(manager.save())
    assert paths == [os.fspath(tmp_path / f"ckpt-{i}") for i in range(1, 5)]
    assert manager.checkpoints == paths[2:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ckpt-3", "ckpt-4"]
    assert manager.latest_checkpoint == paths[-1] == latest_checkpoint(tmp_path)
    assert manager.save(checkpoint_number=100) == os.fspath(tmp_path / "ckpt-100")
    assert int(ckpt.save_counter.numpy()) == 5  # incremented even with a number given

    # a new manager (a restarted program) recovers the state and restores the latest
    v2 = pd.Variable(0.0, name="v")
    again = CheckpointManager(Checkpoint(v=v2), tmp_path, max_to_keep=2)
    assert again.checkpoints == [paths[-1], os.fspath(tmp_path / "ckpt-100")]
    assert again.restore_or_initialize() == os.fspath(tmp_path / "ckpt-100")
    assert float(v2.numpy()) == 4.0

    called: list[int] = []
    empty = CheckpointManager(
        Checkpoint(v=v2), tmp_path / "none", max_to_keep=1, init_fn=lambda: called.append(1)
    )
    assert empty.restore_or_initialize() is None and called == [1]


def test_manager_interval_and_errors(tmp_path: Path) -> None:
    step = pd.Variable(np.int64(0), name="step")
    ckpt = Checkpoint(step=step)
    manager = CheckpointManager(
        ckpt, tmp_path, max_to_keep=None, step_counter=step, checkpoint_interval=10
    )
    saved = []
    for s in range(0, 35, 5):
        step.assign(np.int64(s))
        saved.append(manager.save())
    assert [p is not None for p in saved] == [True, False, True, False, True, False, True]
    assert manager.save(check_interval=False) is None  # same step as the last save
    step.assign(np.int64(31))
    assert manager.save(check_interval=False) is not None
    with pytest.raises(ValueError, match="positive integer or `None` for `max_to_keep`"):
        CheckpointManager(ckpt, tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="`step_counter` should be passed"):
        CheckpointManager(ckpt, tmp_path, max_to_keep=1, checkpoint_interval=5)


def test_a_failed_manager_save_changes_nothing_but_the_counter(tmp_path: Path) -> None:
    step = pd.Variable(np.int64(10), name="step")
    ckpt = Checkpoint(step=step)
    manager = CheckpointManager(
        ckpt, tmp_path, max_to_keep=2, step_counter=step, checkpoint_interval=10
    )
    first = manager.save(checkpoint_number=7)
    assert first is not None and manager.checkpoints == [first]
    step.assign(np.int64(20))
    with pytest.raises(pd.checkpoint.CheckpointError, match="ckpt-7 already exists"):
        manager.save(checkpoint_number=7)  # the latest: never replaced
    assert manager.checkpoints == [first]
    assert manager.latest_checkpoint == first
    assert int(ckpt.save_counter.numpy()) == 2  # incremented before the write, as TF
    again = manager.save()  # the same step: the failed save did not count
    assert again is not None and again.endswith("ckpt-3")
    assert manager.checkpoints == [first, again]


def test_manager_keep_checkpoint_every_n_hours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("polydist.train._manager.time.time", lambda: clock[0])
    v = pd.Variable(0.0, name="v")
    manager = CheckpointManager(
        Checkpoint(v=v), tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1
    )
    for hours in (0.5, 1.0, 1.5, 2.5):
        clock[0] = 1000.0 + hours * 3600
        manager.save()
    # ckpt-1 (0.5 h) is deleted; ckpt-2 (1 h after the start) and ckpt-4 (2.5 h) are
    # an hour apart from the previous kept one; ckpt-3 is not
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert kept == ["ckpt-2", "ckpt-4"]
    assert manager.checkpoints == [os.fspath(tmp_path / "ckpt-4")]


def test_a_manager_adopts_what_checkpoint_save_wrote(tmp_path: Path) -> None:
    ckpt = Checkpoint(v=pd.Variable(1.0, name="v"))
    first = ckpt.save(tmp_path / "ckpt")
    manager = CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    assert manager.latest_checkpoint == first and manager.checkpoints == [first]
    second = manager.save()
    assert second == os.fspath(tmp_path / "ckpt-2")
    assert not Path(first).exists() and manager.checkpoints == [second]


class Tree:
    """A pytree node registered with optree (as a framework registers its containers)."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b


optree.register_pytree_node(
    Tree,
    lambda t: ((t.a, t.b), None, ("a", "b")),
    lambda _, children: Tree(*children),
    # optree's global registry (what _pytree_node sees); its name is private to optree
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)


def test_registered_pytrees_are_nests(tmp_path: Path) -> None:
    tree = Tree(pd.Variable(1.0, name="x"), [pd.Variable(2.0, name="y")])
    path = Checkpoint(t=tree).save(tmp_path / "ckpt")
    assert sorted(safetensors.numpy.load_file(Path(path) / "tensors.safetensors")) == [
        "save_counter",
        "t/a",
        "t/b/0",
    ]
    fresh = Tree(pd.Variable(0.0, name="x"), [pd.Variable(0.0, name="y")])
    Checkpoint(t=fresh).restore(path).assert_consumed()
    assert (float(fresh.a.numpy()), float(fresh.b[0].numpy())) == (1.0, 2.0)
    # and inside a registered object's nest, rebuilt with the node's own type
    register_checkpointable(
        Box, to_nest=lambda b: Tree(b.params["w"], b.params["b"]), from_nest=_set_tree
    )
    try:
        p2 = Checkpoint(box=Box(3.0)).save(tmp_path / "box")
        target = Box(0.0)
        Checkpoint(box=target).restore(p2).assert_consumed()
        assert target.params["w"].tolist() == [3.0, 3.0]
    finally:
        register_checkpointable(
            Box,
            to_nest=lambda box: box.params,
            from_nest=lambda box, nest: setattr(box, "params", nest),
        )


def _set_tree(box: Box, nest: Any) -> None:
    assert isinstance(nest, Tree)
    box.params = {"w": nest.a, "b": nest.b}


MANAGER_CHILD = r"""
import sys
from pathlib import Path
import numpy as np
import polydist as pd

root, ready = sys.argv[1:]
w = pd.Variable(np.zeros((256, 256)), name="w")
manager = pd.train.CheckpointManager(pd.train.Checkpoint(w=w), root, max_to_keep=2)
manager.restore_or_initialize()
Path(ready).write_text("ready")
while True:
    w.assign(w.numpy() + 1.0)
    manager.save()
"""


def test_a_manager_killed_at_random_moments_keeps_a_good_latest(tmp_path: Path) -> None:
    import random
    import subprocess
    import sys
    import time

    root = tmp_path / "ckpts"
    rng = random.Random(7)
    for round_ in range(5):
        ready = tmp_path / f"ready{round_}"
        proc = subprocess.Popen(
            [sys.executable, "-c", MANAGER_CHILD, str(root), str(ready)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.5))
            assert proc.poll() is None, proc.communicate()[1].decode(errors="replace")
        finally:
            proc.kill()
            proc.communicate(timeout=60)
        w = pd.Variable(np.zeros((256, 256)), name="w")
        ckpt = Checkpoint(w=w)
        latest = latest_checkpoint(root)
        if latest is None:
            continue
        ckpt.restore(latest).assert_consumed()
        # every save adds 1 to every entry, and the counter counts the saves
        assert np.all(w.numpy() == float(ckpt.save_counter.numpy()))
    manager = CheckpointManager(Checkpoint(w=pd.Variable(np.zeros((256, 256)))), root, 2)
    manager.restore_or_initialize()  # numbering goes on from the restored save_counter
    assert manager.save() is not None
    assert not [p for p in root.iterdir() if p.name.startswith(".polydist-tmp-")]


def test_the_restore_check_finds_the_strategy_of_a_distributed_module() -> None:
    # A checkpoint of framework modules and optimizers alone, restored outside the scope:
    # the workers' restore check finds the strategy through their `strategy`/`_strategy`.
    strategy = pd.MirroredStrategy(2)
    module, optimizer = Stateful(1.0), Stateful(2.0)
    module.strategy = strategy  # type: ignore[attr-defined]
    optimizer._strategy = strategy  # type: ignore[attr-defined]
    found = Checkpoint(model=module, optimizer=optimizer)._strategies()
    assert found == [strategy, strategy]
    assert Checkpoint(model=Stateful(3.0))._strategies() == []
