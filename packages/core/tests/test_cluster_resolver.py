"""Tests for polydist.cluster_resolver.

The TF_CONFIG cases follow TensorFlow's tfconfig_cluster_resolver_test.py and
cluster_resolver_test.py; results were cross-checked against TensorFlow 2.16.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

import polydist.cluster_resolver as cr
from polydist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    DeviceAttributes,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TPUClusterResolver,
    TPUSystemMetadata,
    UnionClusterResolver,
    UnionResolver,
    format_master_url,
    set_accelerator_device_lister,
)
from polydist.tpu import Topology

# The example from the compat.v1 TPUStrategy docs (seed 003, `cluster_resolver`).
SEED_TF_CONFIG: dict[str, Any] = {
    "cluster": {
        "worker": ["localhost:12345", "localhost:23456"],
        "ps": ["localhost:34567"],
    },
    "task": {"type": "worker", "index": 0},
}

PS_WORKER_CLUSTER = {
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
}


@pytest.fixture
def tf_config(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets TF_CONFIG (a dict is JSON-encoded) for one test."""

    def set_config(value: dict[str, Any] | str | None) -> None:
        if value is None:
            monkeypatch.delenv("TF_CONFIG", raising=False)
        else:
            monkeypatch.setenv("TF_CONFIG", value if isinstance(value, str) else json.dumps(value))

    monkeypatch.delenv("TF_CONFIG", raising=False)
    return set_config


@pytest.fixture
def device_lister() -> Iterator[Any]:
    """Installs a fake device lister for one test, restoring the previous one."""
    previous = set_accelerator_device_lister(None)

    def install(devices: Sequence[tuple[str, str]]) -> list[tuple[str, Any]]:
        calls: list[tuple[str, Any]] = []

        def lister(master: str, config_proto: Any) -> Sequence[tuple[str, str]]:
            calls.append((master, config_proto))
            return devices

        set_accelerator_device_lister(lister)
        return calls

    yield install
    set_accelerator_device_lister(previous)


def test_all_exports() -> None:
    assert sorted(cr.__all__) == sorted(
        [
            "LOCAL_TPU_ENV",
            "ClusterResolver",
            "ClusterSpec",
            "ClusterSpecLike",
            "DeviceAttributes",
            "DeviceLister",
            "GCEClusterResolver",
            "KubernetesClusterResolver",
            "KubernetesExecutableLocation",
            "SimpleClusterResolver",
            "SlurmClusterResolver",
            "TFConfigClusterResolver",
            "TPUClusterResolver",
            "TPUSystemMetadata",
            "UnionClusterResolver",
            "UnionResolver",
            "format_master_url",
            "get_accelerator_devices",
            "set_accelerator_device_lister",
        ]
    )
    for name in cr.__all__:
        assert hasattr(cr, name)
    assert UnionResolver is UnionClusterResolver


# ---------------------------------------------------------------------------
# ClusterSpec
# ---------------------------------------------------------------------------


def test_cluster_spec_dense() -> None:
    spec = ClusterSpec(PS_WORKER_CLUSTER)
    assert spec.jobs == ["ps", "worker"]
    assert spec.as_dict() == PS_WORKER_CLUSTER
    assert spec.num_tasks("worker") == 3
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_address("worker", 2) == "worker2:2222"
    assert spec.job_tasks("ps") == ["ps0:2222", "ps1:2222"]
    assert bool(spec)
    assert repr(spec) == (
        "ClusterSpec({'ps': ['ps0:2222', 'ps1:2222'], "
        "'worker': ['worker0:2222', 'worker1:2222', 'worker2:2222']})"
    )


def test_cluster_spec_keeps_job_order() -> None:
    spec = ClusterSpec({"worker": ["w:1"], "chief": ["c:1"], "ps": ["p:1"]})
    assert spec.jobs == ["worker", "chief", "ps"]


def test_cluster_spec_sparse() -> None:
    spec = ClusterSpec({"worker": {1: "w1:1", 3: "w3:1"}, "ps": ("p0:1",)})
    assert spec.as_dict() == {"worker": {1: "w1:1", 3: "w3:1"}, "ps": ["p0:1"]}
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.job_tasks("worker") == [None, "w1:1", None, "w3:1"]
    assert repr(spec) == "ClusterSpec({'ps': ['p0:1'], 'worker': {1: 'w1:1', 3: 'w3:1'}})"


def test_cluster_spec_json_string_keys_and_dense_dict() -> None:
    spec = ClusterSpec({"worker": {"1": "b", "0": "a"}})
    assert spec.as_dict() == {"worker": ["a", "b"]}
    assert spec == ClusterSpec({"worker": ["a", "b"]})


def test_cluster_spec_empty_and_empty_job() -> None:
    empty = ClusterSpec({})
    assert not empty
    assert empty.jobs == []
    assert empty.as_dict() == {}
    assert repr(empty) == "ClusterSpec({})"
    spec = ClusterSpec({"worker": []})
    assert bool(spec)
    assert spec.as_dict() == {"worker": {}}
    assert spec.num_tasks("worker") == 0


def test_cluster_spec_equality() -> None:
    a = ClusterSpec(PS_WORKER_CLUSTER)
    assert a == ClusterSpec(dict(PS_WORKER_CLUSTER))
    assert a == ClusterSpec(a)
    assert a != ClusterSpec({"ps": ["ps0:2222"]})
    # As in TensorFlow, a ClusterSpec equals the normalised {job: {index: address}} dict.
    assert ClusterSpec({"w": ["a"]}) == {"w": {0: "a"}}
    assert ClusterSpec({"w": ["a"]}) != {"w": ["a"]}
    assert ClusterSpec({"w": ["a"]}) != "w"
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


def test_cluster_spec_copy_is_independent() -> None:
    original = ClusterSpec({"w": ["a"]})
    copy = ClusterSpec(original)
    assert copy == original
    assert copy is not original


def test_cluster_spec_lookup_errors() -> None:
    spec = ClusterSpec(PS_WORKER_CLUSTER)
    with pytest.raises(ValueError, match=r"No such job in cluster: 'chief'\. Jobs in this cluster"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.task_indices("chief")
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.job_tasks("chief")
    with pytest.raises(ValueError, match=r"No task with index 5 in job 'worker'\. Valid indices"):
        spec.task_address("worker", 5)


@pytest.mark.parametrize(
    ("cluster", "error", "message"),
    [
        (["worker"], TypeError, "`cluster` must be a dictionary mapping"),
        ({"worker": "host:1"}, TypeError, "The tasks for job 'worker' must be a list"),
        ({"worker": [3]}, TypeError, "Task address 3 .* must be a string"),
        ({1: ["a"]}, TypeError, "Job name 1 must be a string"),
        ({"worker": {"x": "a"}}, ValueError, "Task index 'x' in job 'worker' must be an integer"),
        ({"worker": {-1: "a"}}, ValueError, "must be non-negative"),
    ],
)
def test_cluster_spec_validation(cluster: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ClusterSpec(cluster)


# ---------------------------------------------------------------------------
# TFConfigClusterResolver
# ---------------------------------------------------------------------------


def test_seed_tf_config_example(tf_config: Any) -> None:
    tf_config(SEED_TF_CONFIG)
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec(SEED_TF_CONFIG["cluster"])
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["localhost:12345", "localhost:23456"],
        "ps": ["localhost:34567"],
    }
    assert resolver.task_type == "worker"
    assert resolver.task_id == 0
    assert resolver.rpc_layer is None
    assert resolver.environment == ""
    assert resolver.master() == "localhost:12345"
    assert resolver.master("ps", 0) == "localhost:34567"
    assert resolver.master("worker", 1, rpc_layer="grpc") == "grpc://localhost:23456"
    assert isinstance(resolver, ClusterResolver)


def test_normal_cluster_spec_read(tf_config: Any) -> None:
    tf_config({"cluster": PS_WORKER_CLUSTER, "task": {"type": "ps", "index": 0}})
    spec = TFConfigClusterResolver().cluster_spec()
    assert spec.jobs == ["ps", "worker"]
    assert spec.as_dict() == PS_WORKER_CLUSTER


def test_automatic_and_specified_master(tf_config: Any) -> None:
    tf_config({"cluster": PS_WORKER_CLUSTER, "task": {"type": "ps", "index": 0}})
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "ps0:2222"
    assert resolver.master("worker", 1) == "worker1:2222"


def test_session_master_wins(tf_config: Any) -> None:
    tf_config(
        {
            "cluster": PS_WORKER_CLUSTER,
            "session_master": "sessionmaster:2222",
            "rpc_layer": "grpc",
            "task": {"type": "ps", "index": 0},
        }
    )
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "sessionmaster:2222"
    assert resolver.master("worker", 2) == "sessionmaster:2222"


def test_rpc_layer_read(tf_config: Any) -> None:
    tf_config(
        {"cluster": PS_WORKER_CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 0}}
    )
    resolver = TFConfigClusterResolver()
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")
    assert resolver.master("worker", 0, rpc_layer="other") == "other://worker0:2222"


def test_parameter_overrides(tf_config: Any) -> None:
    tf_config(
        {"cluster": PS_WORKER_CLUSTER, "rpc_layer": "grpc", "task": {"type": "ps", "index": 1}}
    )
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)

    resolver.task_type = "worker"
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.master() == "test://worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "test")


def test_constructor_rpc_layer_and_environment_override(tf_config: Any) -> None:
    tf_config(
        {
            "cluster": PS_WORKER_CLUSTER,
            "rpc_layer": "grpc",
            "environment": "google",
            "task": {"type": "worker", "index": 2},
        }
    )
    assert TFConfigClusterResolver().environment == "google"
    resolver = TFConfigClusterResolver(rpc_layer="grpc+verbs", environment="")
    assert resolver.rpc_layer == "grpc+verbs"
    assert resolver.environment == ""
    assert resolver.master() == "grpc+verbs://worker2:2222"


def test_task_type_cast_to_string_and_index_to_int(tf_config: Any) -> None:
    tf_config(
        {
            "cluster": {"123456": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222"]},
            "task": {"type": 123456, "index": "1"},
        }
    )
    resolver = TFConfigClusterResolver()
    assert resolver.task_type == "123456"
    assert resolver.task_id == 1
    assert resolver.master() == "ps1:2222"


def test_task_index_override(tf_config: Any) -> None:
    tf_config(
        {
            "cluster": {"worker": ["worker0:2222", "worker1:2222"]},
            "task": {"type": "worker", "index": "0"},
        }
    )
    resolver = TFConfigClusterResolver(task_id=1)
    assert resolver.task_id == 1
    assert resolver.task_type == "worker"
    assert resolver.master() == "worker1:2222"


def test_master_empty_for_no_or_single_task(tf_config: Any) -> None:
    tf_config("{}")
    assert TFConfigClusterResolver().master() == ""
    tf_config({"cluster": {"worker": ["worker0:2222"]}})
    assert TFConfigClusterResolver().master() == ""
    assert TFConfigClusterResolver(rpc_layer="grpc").master() == ""
    # One job but a sparse index: job_tasks has 2 entries, so not "single task".
    tf_config({"cluster": {"worker": {"1": "w1:2222"}}, "task": {"type": "worker", "index": 1}})
    assert TFConfigClusterResolver().master() == "w1:2222"
    # Two jobs with one task each is not a single-task cluster.
    tf_config(
        {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "chief", "index": 0}}
    )
    assert TFConfigClusterResolver().master() == "c:1"


def test_missing_variable_and_missing_cluster_key(tf_config: Any) -> None:
    tf_config(None)
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec({})
    assert not resolver.cluster_spec()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
    assert resolver.master() == ""
    tf_config({"task": {"type": "worker", "index": 3}, "rpc_layer": "grpc"})
    assert resolver.cluster_spec().as_dict() == {}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 3, "grpc")
    tf_config("")
    assert resolver.cluster_spec().as_dict() == {}


def test_tf_config_is_reread_on_every_call(tf_config: Any) -> None:
    resolver = TFConfigClusterResolver()
    tf_config({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})
    assert resolver.master() == "b:1"
    tf_config({"cluster": {"worker": ["c:1", "d:1"]}, "task": {"type": "worker", "index": 0}})
    assert resolver.master() == "c:1"


def test_master_without_task_in_multi_task_cluster(tf_config: Any) -> None:
    tf_config({"cluster": {"worker": ["worker0:2222", "worker1:2222"]}})
    resolver = TFConfigClusterResolver()
    with pytest.raises(ValueError, match=r"Cannot determine the master.*task_type=None"):
        resolver.master()
    assert resolver.master("worker", 0) == "worker0:2222"
    with pytest.raises(ValueError, match="No task with index 7 in job 'worker'"):
        resolver.master("worker", 7)


@pytest.mark.parametrize(
    ("raw", "message"),
    [("{not json", "TF_CONFIG environment variable is not valid JSON"), ("[1]", "JSON object")],
)
def test_malformed_tf_config(tf_config: Any, raw: str, message: str) -> None:
    tf_config(raw)
    with pytest.raises(ValueError, match=message):
        TFConfigClusterResolver().cluster_spec()


def test_num_accelerators_filters_tasks_by_tf_config(tf_config: Any, device_lister: Any) -> None:
    tf_config(
        {
            "cluster": {
                "worker1": ["w10:2222"],
                "worker2": ["w21:2222", "w22:2222", "w23:2222", "w24:2222"],
            },
            "rpc_layer": "grpc",
            "task": {"type": "worker1", "index": "0"},
        }
    )
    calls = device_lister(
        [
            DeviceAttributes("/job:worker1/task:0/device:TPU:0", "TPU"),
            DeviceAttributes("/job:worker1/task:0/device:TPU:1", "TPU"),
            ("/job:worker1/task:0/device:GPU:0", "GPU"),
            ("/job:worker1/task:0/device:GPU:1", "GPU"),
            ("/job:worker1/task:0/device:CPU:0", "CPU"),
            ("/job:worker2/task:1/device:TPU:2", "TPU"),
            ("/job:worker2/task:2/device:TPU:3", "TPU"),
            ("/job:worker2/task:3/device:GPU:2", "GPU"),
            ("/job:worker2/task:4/device:GPU:3", "GPU"),
        ]
    )
    resolver = TFConfigClusterResolver()
    assert resolver.num_accelerators() == {"TPU": 2, "GPU": 2}
    assert resolver.num_accelerators(task_type="worker2", task_id=3) == {"GPU": 1}
    assert calls[0] == ("grpc://w10:2222", None)


def test_num_accelerators_without_device_lister_is_empty(tf_config: Any) -> None:
    tf_config(SEED_TF_CONFIG)
    assert TFConfigClusterResolver().num_accelerators() == {}


def test_num_accelerators_matches_job_exactly(device_lister: Any) -> None:
    device_lister([("/job:worker1/replica:0/task:10/device:GPU:0", "GPU")])
    resolver = SimpleClusterResolver(
        ClusterSpec({"worker": ["a:1", "b:1"], "worker1": {10: "c:1"}})
    )
    assert ClusterResolver.num_accelerators(resolver, "worker", 1) == {}
    assert ClusterResolver.num_accelerators(resolver, "worker1", 10) == {"GPU": 1}
    assert ClusterResolver.num_accelerators(resolver) == {"GPU": 1}


def test_set_accelerator_device_lister_validates() -> None:
    with pytest.raises(TypeError, match="lister must be a callable"):
        set_accelerator_device_lister(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# SimpleClusterResolver
# ---------------------------------------------------------------------------


def test_simple_cluster_resolver() -> None:
    spec = ClusterSpec({"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222"]})
    resolver = SimpleClusterResolver(
        spec,
        master="grpc://master:2222",
        task_type="worker",
        task_id=0,
        environment="google",
        num_accelerators={"GPU": 8},
    )
    assert resolver.cluster_spec() is spec
    assert resolver.master() == "grpc://master:2222"
    assert resolver.master("ps", 1) == "ps1:2222"
    assert resolver.master("ps", 1, rpc_layer="grpc") == "grpc://ps1:2222"
    assert resolver.master("ps") == "grpc://master:2222"
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 0, "google")
    assert resolver.num_accelerators() == {"GPU": 8}
    assert resolver.num_accelerators("ps", 0) == {"GPU": 8}
    assert resolver.rpc_layer is None

    resolver.task_type = "ps"
    resolver.task_id = 1
    resolver.rpc_layer = "grpc"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 1, "grpc")
    assert resolver.master("worker", 0) == "grpc://worker0:2222"
    assert resolver.master("worker", 0, rpc_layer="x") == "x://worker0:2222"


def test_simple_cluster_resolver_defaults() -> None:
    resolver = SimpleClusterResolver(ClusterSpec({}))
    assert resolver.master() == ""
    assert resolver.num_accelerators() == {}
    assert (resolver.task_type, resolver.task_id, resolver.environment) == (None, None, "")


def test_simple_cluster_resolver_type_checks() -> None:
    with pytest.raises(TypeError, match="cluster_spec must be a ClusterSpec; got dict"):
        SimpleClusterResolver({"worker": ["a:1"]})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="master must be a string"):
        SimpleClusterResolver(ClusterSpec({}), master=None)  # type: ignore[arg-type]


def test_cluster_resolver_is_abstract() -> None:
    with pytest.raises(TypeError, match="abstract"):
        ClusterResolver()  # type: ignore[abstract]


def test_format_master_url() -> None:
    assert format_master_url("h:1") == "h:1"
    assert format_master_url("h:1", "") == "h:1"
    assert format_master_url("h:1", "grpc") == "grpc://h:1"


# ---------------------------------------------------------------------------
# UnionResolver
# ---------------------------------------------------------------------------


def _simple(cluster: dict[str, Any], **kwargs: Any) -> SimpleClusterResolver:
    return SimpleClusterResolver(ClusterSpec(cluster), **kwargs)


def test_union_single_resolver() -> None:
    base = _simple(
        {"ps": ["ps0:2222"], "worker": ["w0:2222", "w1:2222"]},
        master="m:2222",
        task_type="worker",
        task_id=1,
        rpc_layer="grpc",
        environment="google",
        num_accelerators={"TPU": 8},
    )
    union = UnionResolver(base)
    assert union.cluster_spec() == base.cluster_spec()
    assert union.master() == "grpc://m:2222"
    assert union.master(rpc_layer="x") == "x://m:2222"
    assert union.master("worker", 0) == "w0:2222"
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 1, "grpc")
    assert union.environment == "google"
    assert union.num_accelerators() == {"TPU": 8}


def test_union_concatenates_lists_in_order() -> None:
    union = UnionResolver(
        _simple({"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}),
        _simple({"worker": ["w2:1"], "chief": ["c0:1"]}),
    )
    spec = union.cluster_spec()
    assert spec.as_dict() == {
        "worker": ["w0:1", "w1:1", "w2:1"],
        "ps": ["p0:1"],
        "chief": ["c0:1"],
    }
    assert spec.jobs == ["worker", "ps", "chief"]


def test_union_merges_dicts_without_overlap() -> None:
    union = UnionResolver(
        _simple({"worker": {3: "w3:1"}}),
        _simple({"worker": ["w0:1", "w1:1"]}),
    )
    assert union.cluster_spec().as_dict() == {"worker": {0: "w0:1", 1: "w1:1", 3: "w3:1"}}
    assert union.master("worker", 3) == "w3:1"


def test_union_conflicting_sparse_keys_raise_key_error() -> None:
    union = UnionResolver(
        _simple({"worker": {0: "a:1", 5: "b:1"}}),
        _simple({"worker": {5: "c:1"}}),
    )
    with pytest.raises(
        KeyError, match=r"Duplicate keys detected when merging two ClusterSpecs: \{5\}"
    ):
        union.cluster_spec()


def test_union_list_and_dict_overlap_raise_key_error() -> None:
    union = UnionResolver(_simple({"worker": ["w0:1", "w1:1"]}), _simple({"worker": {1: "x:1"}}))
    with pytest.raises(KeyError, match=r"\{1\}.*job 'worker'"):
        union.cluster_spec()


def test_union_first_resolver_wins_and_overrides() -> None:
    first = _simple({"worker": ["w0:1"]}, master="m0", task_type="worker", task_id=0)
    second = _simple(
        {"ps": ["p0:1"]}, master="m1", task_type="ps", task_id=0, num_accelerators={"GPU": 1}
    )
    union = UnionResolver(first, second)
    assert union.master() == "m0"
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 0, None)
    assert union.num_accelerators() == {}

    overridden = UnionResolver(first, second, task_type="ps", task_id=0, rpc_layer="grpc")
    assert (overridden.task_type, overridden.task_id, overridden.rpc_layer) == ("ps", 0, "grpc")
    assert overridden.master("ps", 0) == "grpc://p0:1"
    assert overridden.master("ps", 0, rpc_layer="x") == "x://p0:1"

    union.task_type = "chief"
    union.task_id = 4
    union.rpc_layer = "r"
    assert (union.task_type, union.task_id, union.rpc_layer) == ("chief", 4, "r")


def test_union_task_id_zero_override() -> None:
    # TensorFlow's `self._task_id or ...` drops an override of 0; polydist keeps it.
    union = UnionResolver(_simple({"worker": ["a", "b"]}, task_type="worker", task_id=1), task_id=0)
    assert union.task_id == 0


def test_union_gpu_override_example(tf_config: Any) -> None:
    # The example from TensorFlow's UnionClusterResolver docstring.
    tf_config(SEED_TF_CONFIG)
    tf_resolver = TFConfigClusterResolver()
    gpu_override = SimpleClusterResolver(tf_resolver.cluster_spec(), num_accelerators={"GPU": 1})
    union = UnionResolver(gpu_override, tf_resolver)
    assert union.num_accelerators() == {"GPU": 1}
    assert union.cluster_spec().as_dict() == {
        "worker": [
            "localhost:12345",
            "localhost:23456",
            "localhost:12345",
            "localhost:23456",
        ],
        "ps": ["localhost:34567", "localhost:34567"],
    }


def test_union_argument_validation() -> None:
    with pytest.raises(ValueError, match="At least one ClusterResolver is required"):
        UnionResolver()
    with pytest.raises(TypeError, match="All arguments must be a sub-class of `ClusterResolver`"):
        UnionResolver(ClusterSpec({}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unexpected kwargs provided"):
        UnionResolver(_simple({}), master="x")


# ---------------------------------------------------------------------------
# TPUClusterResolver (simulated slices)
# ---------------------------------------------------------------------------


@pytest.fixture
def no_tpu_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", cr.LOCAL_TPU_ENV):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_tpu_resolver_v4_32(no_tpu_env: pytest.MonkeyPatch) -> None:
    resolver = TPUClusterResolver(tpu="v4-32")
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["v4-32-w-0:8470", "v4-32-w-1:8470", "v4-32-w-2:8470", "v4-32-w-3:8470"]
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    assert resolver.master() == "grpc://v4-32-w-0:8470"
    assert resolver.get_master() == "grpc://v4-32-w-0:8470"
    assert resolver.master("worker", 2) == "grpc://v4-32-w-2:8470"
    assert resolver.master(rpc_layer="ignored") == "grpc://v4-32-w-0:8470"
    assert resolver.num_accelerators() == {"TPU": 4}
    assert resolver.environment == ""
    assert resolver.rpc_layer == "grpc"  # TF's outside Google (audit F4: it was None)
    assert resolver.get_job_name() == "worker"
    assert resolver.get_coordination_service_leader() == "/job:worker/task:0"
    assert resolver.slice_spec.name == "v4-32"


@pytest.mark.parametrize(
    ("name", "hosts", "cores_per_host", "cores"),
    [
        ("v2-8", 1, 8, 8),
        ("v3-8", 1, 8, 8),
        ("v3-32", 4, 8, 32),
        ("v4-8", 1, 4, 4),
        ("v4-32", 4, 4, 16),
        ("v5e-8", 1, 8, 8),
        ("v5e-16", 4, 4, 16),
        ("v5litepod-16", 4, 4, 16),
    ],
)
def test_tpu_resolver_numbers(
    no_tpu_env: pytest.MonkeyPatch, name: str, hosts: int, cores_per_host: int, cores: int
) -> None:
    resolver = TPUClusterResolver(name)
    assert resolver.cluster_spec().num_tasks("worker") == hosts
    assert resolver.num_accelerators() == {"TPU": cores_per_host}
    metadata = resolver.get_tpu_system_metadata()
    assert isinstance(metadata, TPUSystemMetadata)
    assert (metadata.num_cores, metadata.num_hosts, metadata.num_of_cores_per_host) == (
        cores,
        hosts,
        cores_per_host,
    )
    assert isinstance(metadata.topology, Topology)
    assert metadata.topology.num_tasks == hosts
    assert metadata.topology.num_tpus_per_task == cores_per_host
    assert len(metadata.devices) == hosts * (cores_per_host + 2)


def test_tpu_system_metadata_devices(no_tpu_env: pytest.MonkeyPatch) -> None:
    metadata = TPUClusterResolver("v4-16").get_tpu_system_metadata()
    assert metadata.devices == (
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:TPU:0",
        "/job:worker/replica:0/task:0/device:TPU:1",
        "/job:worker/replica:0/task:0/device:TPU:2",
        "/job:worker/replica:0/task:0/device:TPU:3",
        "/job:worker/replica:0/task:0/device:TPU_SYSTEM:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:1/device:TPU:0",
        "/job:worker/replica:0/task:1/device:TPU:1",
        "/job:worker/replica:0/task:1/device:TPU:2",
        "/job:worker/replica:0/task:1/device:TPU:3",
        "/job:worker/replica:0/task:1/device:TPU_SYSTEM:0",
    )


def test_tpu_resolver_job_name_and_coordinator(no_tpu_env: pytest.MonkeyPatch) -> None:
    resolver = TPUClusterResolver(
        "v3-32",
        job_name="tpu_worker",
        coordinator_name="coordinator",
        coordinator_address="10.0.0.9:8470",
    )
    assert resolver.cluster_spec().as_dict() == {
        "tpu_worker": [
            "v3-32-w-0:8470",
            "v3-32-w-1:8470",
            "v3-32-w-2:8470",
            "v3-32-w-3:8470",
        ],
        "coordinator": ["10.0.0.9:8470"],
    }
    assert resolver.task_type == "tpu_worker"
    assert resolver.master() == "grpc://v3-32-w-0:8470"
    assert resolver.master("coordinator", 0) == "grpc://10.0.0.9:8470"
    resolver.task_id = 3
    assert resolver.master() == "grpc://v3-32-w-3:8470"
    assert resolver.get_tpu_system_metadata().devices[0] == (
        "/job:tpu_worker/replica:0/task:0/device:CPU:0"
    )
    local_coordinator = TPUClusterResolver("v3-8", coordinator_name="coordinator")
    assert local_coordinator.cluster_spec().as_dict()["coordinator"] == ["127.0.0.1:0"]
    # An address without a name is not added, as in TensorFlow.
    no_name = TPUClusterResolver("v3-8", coordinator_address="10.0.0.9:8470")
    assert no_name.cluster_spec().jobs == ["worker"]


def test_tpu_resolver_local(no_tpu_env: pytest.MonkeyPatch) -> None:
    resolver = TPUClusterResolver(tpu="local")
    assert resolver.cluster_spec() == ClusterSpec({})
    assert resolver.master() == ""
    assert resolver.rpc_layer == "grpc"
    assert resolver.num_accelerators() == {"TPU": 8}
    metadata = resolver.get_tpu_system_metadata()
    assert (metadata.num_cores, metadata.num_hosts, metadata.num_of_cores_per_host) == (8, 1, 8)
    assert metadata.devices[1] == "/job:localhost/replica:0/task:0/device:TPU:0"

    no_tpu_env.setenv(cr.LOCAL_TPU_ENV, "v4-8")
    assert TPUClusterResolver("local").num_accelerators() == {"TPU": 4}
    no_tpu_env.setenv(cr.LOCAL_TPU_ENV, "v4-32")
    with pytest.raises(ValueError, match=r"must have one host; POLYDIST_LOCAL_TPU='v4-32' has 4"):
        TPUClusterResolver("local")


def test_tpu_resolver_name_from_environment(no_tpu_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="Please provide a TPU name") as info:
        TPUClusterResolver()
    assert "v3-8" in str(info.value)
    no_tpu_env.setenv("TPU_NAME", "v5e-16")
    assert TPUClusterResolver().num_accelerators() == {"TPU": 4}
    assert TPUClusterResolver("").slice_spec.name == "v5e-16"
    no_tpu_env.setenv("KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "v2-8")
    assert TPUClusterResolver().slice_spec.name == "v2-8"


def test_tpu_resolver_rejects_real_tpus(no_tpu_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ValueError, match=r"tpu='my-tpu' is not a known simulated TPU slice"
    ) as info:
        TPUClusterResolver("my-tpu", zone="us-central1-b", project="proj")
    assert "no network access" in str(info.value)
    assert "v4-32" in str(info.value)
    with pytest.raises(ValueError, match=r"is a TPU worker address"):
        TPUClusterResolver("grpc://10.240.1.2:8470")


def test_tpu_resolver_list_argument(no_tpu_env: pytest.MonkeyPatch) -> None:
    assert TPUClusterResolver(["v3-8"]).slice_spec.name == "v3-8"
    with pytest.raises(ValueError, match="At least one TPU must be specified"):
        TPUClusterResolver([])
    with pytest.raises(NotImplementedError, match="multiple TPUs"):
        TPUClusterResolver(["v3-8", "v4-8"])


def test_tpu_resolver_connect(no_tpu_env: pytest.MonkeyPatch) -> None:
    plain = TPUClusterResolver("v3-8")
    assert plain.tpu_topology is None
    resolver = TPUClusterResolver.connect("v3-32")
    assert isinstance(resolver, TPUClusterResolver)
    topology = resolver.tpu_topology
    assert topology is not None
    assert topology.mesh_shape.tolist() == [4, 4, 1, 2]
    assert topology.num_tasks == 4
    with resolver as entered:
        assert entered is resolver
