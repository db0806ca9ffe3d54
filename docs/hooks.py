"""mkdocs hooks: pages other people are still writing, and the tf.distribute name table.

* ``on_files``: the nav lists pages that other work streams own (the JAX and
  PyTorch guides, the backend author's guide, ...). Until such a file exists,
  a short "in progress" page stands in for it, so the strict build passes and
  the links resolve; the real file replaces it as soon as it lands.
* ``on_page_markdown``: ``<!-- polydist:name-table SECTION -->`` in a page
  becomes a table of TF names and their polydist equivalents, each marked
  *available* or *in progress* by importing polydist at build time, so the
  migration guide never claims more than the code has. Likewise a block
  between ``<!-- polydist:if NAME -->`` and ``<!-- polydist:endif -->`` is
  kept only where ``NAME`` (e.g. ``polydist.debugging.check_replicas_identical``)
  exists, and ``<!-- polydist:else -->`` gives the text for where it does not.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# --------------------------------------------------------------------------- name table

# (TF name, polydist name, note). The polydist name is resolved at build time.
NAME_TABLE: dict[str, list[tuple[str, str, str]]] = {
    "strategies": [
        ("tf.distribute.MirroredStrategy", "polydist.MirroredStrategy", ""),
        ("tf.distribute.OneDeviceStrategy", "polydist.OneDeviceStrategy", ""),
        ("tf.distribute.MultiWorkerMirroredStrategy", "polydist.MultiWorkerMirroredStrategy", ""),
        ("tf.distribute.TPUStrategy", "polydist.TPUStrategy", ""),
        (
            "tf.distribute.experimental.ParameterServerStrategy",
            "polydist.experimental.ParameterServerStrategy",
            "",
        ),
        (
            "tf.distribute.experimental.CentralStorageStrategy",
            "polydist.experimental.CentralStorageStrategy",
            "",
        ),
        (
            "tf.distribute.experimental.MultiWorkerMirroredStrategy",
            "polydist.experimental.MultiWorkerMirroredStrategy",
            "the deprecated alias",
        ),
        ("tf.distribute.Strategy", "polydist.Strategy", "the base class"),
        ("tf.distribute.StrategyExtended", "polydist.StrategyExtended", "`strategy.extended`"),
    ],
    "methods": [
        ("Strategy.run", "polydist.Strategy.run", ""),
        ("Strategy.scope", "polydist.Strategy.scope", ""),
        ("Strategy.reduce", "polydist.Strategy.reduce", "with `axis`, exact for partial batches"),
        ("Strategy.gather", "polydist.Strategy.gather", ""),
        ("Strategy.experimental_local_results", "polydist.Strategy.experimental_local_results", ""),
        (
            "Strategy.experimental_distribute_dataset",
            "polydist.Strategy.experimental_distribute_dataset",
            "",
        ),
        (
            "Strategy.distribute_datasets_from_function",
            "polydist.Strategy.distribute_datasets_from_function",
            "",
        ),
        (
            "Strategy.experimental_distribute_values_from_function",
            "polydist.Strategy.experimental_distribute_values_from_function",
            "",
        ),
        ("StrategyExtended.reduce_to", "polydist.StrategyExtended.reduce_to", ""),
        ("StrategyExtended.batch_reduce_to", "polydist.StrategyExtended.batch_reduce_to", ""),
        ("ReplicaContext.all_reduce", "polydist.ReplicaContext.all_reduce", ""),
        ("ReplicaContext.all_gather", "polydist.ReplicaContext.all_gather", ""),
        ("ReplicaContext.merge_call", "polydist.ReplicaContext.merge_call", ""),
    ],
    "functions": [
        ("tf.distribute.get_strategy", "polydist.get_strategy", ""),
        ("tf.distribute.has_strategy", "polydist.has_strategy", ""),
        ("tf.distribute.get_replica_context", "polydist.get_replica_context", ""),
        ("tf.distribute.in_cross_replica_context", "polydist.in_cross_replica_context", ""),
        ("tf.distribute.experimental_set_strategy", "polydist.experimental_set_strategy", ""),
        ("tf.distribute.ReplicaContext", "polydist.ReplicaContext", ""),
        ("tf.distribute.ReduceOp", "polydist.ReduceOp", 'or the strings `"SUM"`, `"MEAN"`'),
        ("tf.distribute.DistributedValues", "polydist.DistributedValues", ""),
        ("PerReplica / Mirrored (tf.types.experimental)", "polydist.PerReplica", "and `Mirrored`"),
        ("tf.distribute.DistributedDataset", "polydist.DistributedDataset", ""),
        (
            "DistributedDataset.cardinality",
            "polydist.DistributedDataset.cardinality",
            "the input's cardinality, as TF",
        ),
        ("tf.distribute.DistributedIterator", "polydist.DistributedIterator", ""),
        ("tf.distribute.InputContext", "polydist.InputContext", ""),
        ("tf.distribute.InputOptions", "polydist.InputOptions", ""),
        ("tf.distribute.InputReplicationMode", "polydist.InputReplicationMode", ""),
        ("tf.distribute.RunOptions", "polydist.RunOptions", "accepted; changes nothing"),
        ("tf.distribute.experimental.ValueContext", "polydist.experimental.ValueContext", ""),
        ("tf.nn.compute_average_loss", "polydist.nn.compute_average_loss", ""),
        ("tf.nn.scale_regularization_loss", "polydist.nn.scale_regularization_loss", ""),
    ],
    "variables": [
        ("tf.Variable (created under strategy.scope())", "polydist.Variable", ""),
        ("MirroredVariable", "polydist.MirroredVariable", ""),
        ("SyncOnReadVariable", "polydist.SyncOnReadVariable", ""),
        ("tf.VariableSynchronization", "polydist.VariableSynchronization", ""),
        ("tf.VariableAggregation", "polydist.VariableAggregation", ""),
        ("tf.IndexedSlices", "polydist.IndexedSlices", "`values`, `indices`, `dense_shape`"),
        (
            "Variable.scatter_add / _sub / _mul / _div / _min / _max / _update",
            "polydist.Variable.scatter_add",
            "TF's rules on distributed variables",
        ),
        ("Variable.batch_scatter_update", "polydist.Variable.batch_scatter_update", ""),
        (
            "Variable.scatter_nd_add / _sub / _update",
            "polydist.Variable.scatter_nd_update",
            "single-copy variables (TF)",
        ),
        ("StrategyExtended.update", "polydist.StrategyExtended.update", ""),
        ("StrategyExtended.colocate_vars_with", "polydist.StrategyExtended.colocate_vars_with", ""),
        ("tf.train.Checkpoint", "polydist.train.Checkpoint", "torch modules and optimizers too"),
        ("tf.train.CheckpointManager", "polydist.train.CheckpointManager", ""),
        ("tf.train.latest_checkpoint", "polydist.train.latest_checkpoint", ""),
        ("tf.keras.metrics.Mean", "polydist.metrics.Mean", "sync-on-read variables"),
        ("tf.keras.metrics.Sum", "polydist.metrics.Sum", ""),
        (
            "tf.keras.metrics.SparseCategoricalAccuracy",
            "polydist.metrics.SparseCategoricalAccuracy",
            "",
        ),
        ("tf.keras.metrics.CategoricalAccuracy", "polydist.metrics.CategoricalAccuracy", ""),
    ],
    "cross_device": [
        ("tf.distribute.CrossDeviceOps", "polydist.CrossDeviceOps", ""),
        ("tf.distribute.NcclAllReduce", "polydist.NcclAllReduce", ""),
        ("tf.distribute.HierarchicalCopyAllReduce", "polydist.HierarchicalCopyAllReduce", ""),
        ("tf.distribute.ReductionToOneDevice", "polydist.ReductionToOneDevice", ""),
        (
            "tf.distribute.experimental.CommunicationOptions",
            "polydist.experimental.CommunicationOptions",
            "",
        ),
        (
            "tf.distribute.experimental.CommunicationImplementation",
            "polydist.experimental.CommunicationImplementation",
            "",
        ),
        (
            "tf.distribute.experimental.CollectiveCommunication",
            "polydist.experimental.CollectiveCommunication",
            "the deprecated name",
        ),
    ],
    "modules": [
        ("tf.distribute.cluster_resolver", "polydist.cluster_resolver", ""),
        ("tf.train.ClusterSpec", "polydist.cluster_resolver.ClusterSpec", ""),
        (
            "tf.distribute.cluster_resolver.TFConfigClusterResolver",
            "polydist.cluster_resolver.TFConfigClusterResolver",
            "",
        ),
        (
            "tf.distribute.cluster_resolver.SimpleClusterResolver",
            "polydist.cluster_resolver.SimpleClusterResolver",
            "",
        ),
        (
            "tf.distribute.cluster_resolver.UnionResolver",
            "polydist.cluster_resolver.UnionResolver",
            "",
        ),
        (
            "tf.distribute.cluster_resolver.TPUClusterResolver",
            "polydist.cluster_resolver.TPUClusterResolver",
            "simulated slices, or a backend's own cores",
        ),
        (
            "tf.distribute.cluster_resolver.SlurmClusterResolver",
            "polydist.cluster_resolver.SlurmClusterResolver",
            "reads the Slurm step's environment",
        ),
        (
            "tf.distribute.cluster_resolver.KubernetesClusterResolver",
            "polydist.cluster_resolver.KubernetesClusterResolver",
            "needs `kubernetes` unless given `override_client`",
        ),
        (
            "tf.distribute.cluster_resolver.KubernetesExecutableLocation",
            "polydist.cluster_resolver.KubernetesExecutableLocation",
            "",
        ),
        (
            "tf.distribute.cluster_resolver.GCEClusterResolver",
            "polydist.cluster_resolver.GCEClusterResolver",
            "needs `googleapiclient` unless given `service`",
        ),
        ("tf.data.Dataset", "polydist.data.Dataset", "over NumPy arrays"),
        ("tf.data.Options", "polydist.data.Options", ""),
        ("tf.data.experimental.AutoShardPolicy", "polydist.data.AutoShardPolicy", ""),
        ("tf.tpu.experimental.Topology", "polydist.tpu.Topology", ""),
        ("tf.tpu.experimental.DeviceAssignment", "polydist.tpu.DeviceAssignment", ""),
        (
            "tf.tpu.experimental.initialize_tpu_system",
            "polydist.tpu.initialize_tpu_system",
            "returns the slice's `Topology`",
        ),
        (
            "tf.tpu.experimental.shutdown_tpu_system",
            "polydist.tpu.shutdown_tpu_system",
            "`run` fails until initialized again",
        ),
        (
            "tf.config.experimental_connect_to_cluster",
            "polydist.config.experimental_connect_to_cluster",
            "records the cluster; no remote eager context",
        ),
        ("tf.errors", "polydist.errors", "the same error classes"),
    ],
    "compat": [
        ("tf.compat.v1.distribute.MirroredStrategy", "polydist.compat.v1.MirroredStrategy", ""),
        (
            "tf.compat.v1.distribute.OneDeviceStrategy",
            "polydist.compat.v1.OneDeviceStrategy",
            "",
        ),
        (
            "tf.compat.v1.distribute.experimental.TPUStrategy",
            "polydist.compat.v1.TPUStrategy",
            "also `polydist.compat.v1.distribute.experimental.TPUStrategy`",
        ),
        (
            "tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy",
            "polydist.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy",
            "",
        ),
        ("tf.compat.v1.distribute.Strategy", "polydist.compat.v1.Strategy", "the base class"),
        (
            "tf.compat.v1.distribute.StrategyExtended",
            "polydist.compat.v1.StrategyExtended",
            "`strategy.extended`",
        ),
        (
            "StrategyV1.experimental_run",
            "polydist.compat.v1.Strategy.experimental_run",
            "`run` with one `get_next()` of an iterator",
        ),
        (
            "StrategyV1.make_dataset_iterator",
            "polydist.compat.v1.Strategy.make_dataset_iterator",
            "`initialize()` restarts it and returns `[]`",
        ),
        (
            "StrategyV1.make_input_fn_iterator",
            "polydist.compat.v1.Strategy.make_input_fn_iterator",
            "",
        ),
        (
            "StrategyV1.experimental_make_numpy_dataset",
            "polydist.compat.v1.Strategy.experimental_make_numpy_dataset",
            "",
        ),
        (
            "StrategyV1.update_config_proto",
            "polydist.compat.v1.Strategy.update_config_proto",
            "on a dict of `ConfigProto` fields",
        ),
        ("StrategyV1.reduce", "polydist.compat.v1.Strategy.reduce", "`axis=None` by default"),
        (
            "StrategyExtendedV1.experimental_run_steps_on_iterator",
            "polydist.compat.v1.StrategyExtended.experimental_run_steps_on_iterator",
            "returns a `MultiStepContext`",
        ),
        (
            "StrategyExtended.call_for_each_replica",
            "polydist.StrategyExtended.call_for_each_replica",
            "the v1 way to run",
        ),
        (
            "Strategy.experimental_run_v2",
            "polydist.Strategy.experimental_run_v2",
            "old name of run",
        ),
    ],
    "contrib": [
        (
            "tf.contrib.distribute.MirroredStrategy",
            "polydist.contrib.distribute.MirroredStrategy",
            "",
        ),
        (
            "tf.contrib.distribute.OneDeviceStrategy",
            "polydist.contrib.distribute.OneDeviceStrategy",
            "",
        ),
        ("tf.contrib.distribute.TPUStrategy", "polydist.contrib.distribute.TPUStrategy", ""),
        (
            "tf.contrib.distribute.DistributionStrategy",
            "polydist.contrib.distribute.DistributionStrategy",
            "the tower-era base class",
        ),
        (
            "DistributionStrategy.call_for_each_tower",
            "polydist.contrib.distribute.DistributionStrategy.call_for_each_tower",
            "",
        ),
        (
            "DistributionStrategy.run_steps_on_dataset",
            "polydist.contrib.distribute.DistributionStrategy.run_steps_on_dataset",
            "",
        ),
        ("tf.contrib.distribute.TowerContext", "polydist.contrib.distribute.TowerContext", ""),
        (
            "tf.get_tower_context / tf.contrib.distribute.get_tower_context",
            "polydist.contrib.distribute.get_tower_context",
            "",
        ),
        (
            "tf.contrib.distribute.get_cross_tower_context",
            "polydist.contrib.distribute.get_cross_tower_context",
            "",
        ),
        (
            "tf.contrib.distribute.CollectiveAllReduceStrategy",
            "polydist.contrib.distribute.CollectiveAllReduceStrategy",
            "",
        ),
        (
            "tf.contrib.distribute.ParameterServerStrategy",
            "polydist.contrib.distribute.ParameterServerStrategy",
            "",
        ),
    ],
}

_MARKER = re.compile(r"<!--\s*polydist:name-table\s+(\w+)\s*-->")
_IF = re.compile(
    r"<!--\s*polydist:if\s+([\w.]+)\s*-->(.*?)"
    r"(?:<!--\s*polydist:else\s*-->(.*?))?<!--\s*polydist:endif\s*-->",
    re.S,
)


def resolve(dotted: str) -> bool:
    """Whether ``polydist.a.b.C.method`` exists: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def name_table(section: str) -> str:
    rows = NAME_TABLE[section]
    lines = ["| TensorFlow | polydist | status | note |", "|---|---|---|---|"]
    for tf_name, pd_name, note in rows:
        status = "available" if resolve(pd_name) else "*in progress*"
        lines.append(f"| `{tf_name}` | `{pd_name}` | {status} | {note} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = _IF.sub(lambda m: m.group(2) if resolve(m.group(1)) else m.group(3) or "", markdown)
    return _MARKER.sub(lambda m: name_table(m.group(1)), markdown)


# --------------------------------------------------------------------------- placeholders


def _status(*names: str) -> str:
    return "\n".join(f"- `{n}`: {'available' if resolve(n) else 'in progress'}" for n in names)


def _placeholders() -> dict[str, str]:
    return {
        "backends/jax.md": f"""# JAX backend

!!! note "This guide is being written"
    The JAX backend (`polydist-jax`, in `packages/backend-jax/`) is under
    active development; this page will become its getting-started guide.

What it does: `strategy.run` traces the replica function once and compiles it
with `jax.jit` over `jax.shard_map` on a one-axis `"replica"` mesh;
`ReplicaContext.all_reduce` becomes `lax.psum`, `all_gather` becomes
`lax.all_gather`, and `merge_call` runs inside the trace.

```bash
pip install ./packages/core ./packages/backend-jax   # from a checkout
XLA_FLAGS=--xla_force_host_platform_device_count=8 polydist doctor
polydist demo --backend jax --replicas 8
polydist conformance jax
```

On a laptop, `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before
JAX is imported) gives JAX 8 CPU devices to run on. See the
[support matrix](support-matrix.md) for what passes today.

Installed here: {"yes" if resolve("polydist_jax") else "no"}.
""",
        "backends/torch.md": f"""# PyTorch backend

!!! note "This guide is being written"
    The PyTorch backend (`polydist-torch`, in `packages/backend-torch/`) is
    under active development; this page will become its getting-started guide.

What it does: replicas run eagerly, one at a time, on their own threads;
collectives use torch's own primitives (`torch.cuda.comm` on CUDA, a sum in
replica order on CPU) and are differentiable: the gradient of `all_reduce` is
the `all_reduce` (SUM) of the upstream gradients, as in TF.

```bash
pip install ./packages/core ./packages/backend-torch   # from a checkout
polydist doctor
polydist demo --backend torch --replicas 4
polydist conformance torch
```

See the [support matrix](support-matrix.md) for what passes today.

Installed here: {"yes" if resolve("polydist_torch") else "no"}.
""",
        "backends/support-matrix.md": """# Backend support matrix

!!! note "Not generated yet"
    The conformance suite generates this page:
    `python -m polydist_conformance.matrix --out docs/backends/support-matrix.md`.

Until then, run the suite yourself: `polydist conformance BACKEND`.
""",
        "extending.md": """# Writing a backend

!!! note "This guide is being written"
    The backend author's guide is in progress.

Until it lands: a backend implements the `Backend` protocol of
[`polydist.backend`](api/backend.md), registers a factory under the
`polydist.backends` entry-point group, and proves itself with the
conformance suite: `polydist conformance NAME` (see the
[support matrix](backends/support-matrix.md)).
""",
        "concepts/input.md": f"""# Input pipelines and partial batches

!!! note "This page is being written"

What exists now:

{
            _status(
                "polydist.Strategy.experimental_distribute_dataset",
                "polydist.Strategy.distribute_datasets_from_function",
                "polydist.data.Dataset",
                "polydist.PartialBatchWarning",
            )
        }

The rule to remember: when the data run out unevenly, some replicas get a
smaller (or empty) last batch. Reduce per-example values with
`strategy.reduce("MEAN", value, axis=0)`, which divides by the true number of
examples; see [Reductions](reductions.md#partial-batches).
""",
        "concepts/variables.md": f"""# Distributed variables

!!! note "This page is being written"

TF's distributed variables — `MirroredVariable` (one synchronized copy per
replica) and `SyncOnReadVariable` (per-replica copies, aggregated when read),
created under `strategy.scope()` — in polydist:

{
            _status(
                "polydist.Variable",
                "polydist.MirroredVariable",
                "polydist.SyncOnReadVariable",
                "polydist.VariableAggregation",
                "polydist.VariableSynchronization",
                "polydist.ReplicaDivergenceWarning",
            )
        }

The [API reference](../api/polydist.md) documents what is available.
""",
        "concepts/tpu-and-multi-worker.md": f"""# TPU and multi-worker

!!! note "This page is being written"

{
            _status(
                "polydist.MultiWorkerMirroredStrategy",
                "polydist.TPUStrategy",
                "polydist.cluster_resolver.TFConfigClusterResolver",
                "polydist.cluster_resolver.TPUClusterResolver",
                "polydist.tpu.Topology",
            )
        }

The [cost model](cost-model.md) already prices collectives on TPU slices.
""",
        "concepts/conformance.md": """# Conformance

!!! note "This page is being written"

Every backend is checked against the simulator by the conformance suite
(`polydist-conformance`): `polydist conformance BACKEND`. The results per
backend are in the [support matrix](../backends/support-matrix.md).
""",
    }


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, content in _placeholders().items():
        if files.get_file_from_path(path) is None:
            files.append(File.generated(config, path, content=content))
    return files
