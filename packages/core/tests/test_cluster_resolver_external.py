"""Tests for SlurmClusterResolver, KubernetesClusterResolver and GCEClusterResolver.

There is no Slurm, Kubernetes or GCE cluster here: Slurm's environment is
monkeypatched, and the Kubernetes client and Compute API are fakes with the
methods the resolvers call. The cases and values of TensorFlow's
slurm_cluster_resolver_test.py, kubernetes_cluster_resolver_test.py and
gce_cluster_resolver_test.py are reproduced (marked "TF:"), plus the
polydist-specific behaviour the module docs describe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any

import pytest

import polydist.cluster_resolver as cr
from polydist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    GCEClusterResolver,
    KubernetesClusterResolver,
    KubernetesExecutableLocation,
    SlurmClusterResolver,
    UnionResolver,
    _slurm,
)
from polydist.cluster_resolver._slurm import expand_hostlist, expand_tasks_per_node, get_num_gpus


def test_exports() -> None:
    for name in (
        "SlurmClusterResolver",
        "KubernetesClusterResolver",
        "KubernetesExecutableLocation",
        "GCEClusterResolver",
    ):
        assert name in cr.__all__
        assert issubclass(getattr(cr, name), ClusterResolver) or name.endswith("Location")
    import polydist
    import polydist.compat.v1.distribute as v1

    assert polydist.cluster_resolver.SlurmClusterResolver is SlurmClusterResolver
    assert v1.cluster_resolver.GCEClusterResolver is GCEClusterResolver
    assert KubernetesExecutableLocation.WITHIN_CLUSTER.value == 0
    assert KubernetesExecutableLocation.OFF_CLUSTER.value == 1


# ------------------------------------------------------------------------------------ Slurm


@pytest.fixture
def slurm_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Clears Slurm's and CUDA's variables; returns ``set_env(**vars)``.

    ``nvidia-smi`` is reported missing unless a test patches it.
    """
    for key in list(os.environ):
        if key.startswith("SLURM_") or key == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(key)
    monkeypatch.setattr(_slurm, "_nvidia_smi_list_gpus", lambda: None)

    def set_env(**values: str) -> None:
        for key, value in values.items():
            monkeypatch.setenv(key, value)

    return set_env


def test_expand_hostlist_tf_cases() -> None:
    # TF: test_expand_hostlist
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("n[1,3]") == ["n1", "n3"]
    assert expand_hostlist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == [
        *("n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9")
    ]


def test_expand_hostlist_keeps_padding_order_and_duplicates() -> None:
    assert expand_hostlist("node[01-03,07],other[1-2]") == [
        *("node01", "node02", "node03", "node07", "other1", "other2")
    ]
    assert expand_hostlist("n[009-011]") == ["n009", "n010", "n011"]
    assert expand_hostlist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_hostlist("b04-[09-10]") == ["b04-09", "b04-10"]
    assert expand_hostlist("t02n13,t02n41,t02n43") == ["t02n13", "t02n41", "t02n43"]
    assert expand_hostlist("a[2,1],a1") == ["a2", "a1", "a1"]
    assert expand_hostlist("[1-2]") == ["1", "2"]
    assert expand_hostlist("") == []


@pytest.mark.parametrize(
    "bad", ["n[1-3", "n1-3]", "n[[1]]", "n[1]x", "n[a-b]", "n[3-1]", "n[1-2-3]", "a,,b", "a,"]
)
def test_expand_hostlist_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match=r'^Invalid hostlist format "'):
        expand_hostlist(bad)


def test_expand_tasks_per_node() -> None:
    # TF: test_expand_tasks_per_node
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    assert expand_tasks_per_node("13(x10)") == [13] * 10
    for bad in ("", "2(x)", "x2", "2(3)", "2,,1", "-1"):
        with pytest.raises(ValueError, match=r'^Invalid tasks-per-node list format "'):
            expand_tasks_per_node(bad)


def test_slurm_simple_retrieval_from_env(slurm_env: Any) -> None:
    # TF: testSimpleRetrievalFromEnv
    slurm_env(
        SLURM_PROCID="0",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_TASKS_PER_NODE="1(x3)",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
        CUDA_VISIBLE_DEVICES="0",
    )
    resolver = SlurmClusterResolver()
    assert resolver.task_type is None and resolver.task_id is None
    assert resolver.master() == ""
    spec = resolver.cluster_spec()
    assert spec == ClusterSpec({"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]})
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert resolver.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert resolver.get_task_info() == ("worker", 0)
    assert resolver.environment == ""
    assert resolver.rpc_layer == "grpc"


def _ps_worker(**kwargs: Any) -> SlurmClusterResolver:
    return SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, port_base=8888, **kwargs)


def test_slurm_simple_successful_retrieval(slurm_env: Any) -> None:
    # TF: testSimpleSuccessfulRetrieval (tasks_per_node given: only the node list is read)
    slurm_env(
        SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="t02n13,t02n41,t02n43"
    )
    resolver = _ps_worker(tasks_per_node=1, gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["t02n13:8888"],
        "worker": ["t02n41:8888", "t02n43:8888"],
    }
    assert resolver.get_task_info() == ("ps", 0)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_slurm_simple_master_retrieval(slurm_env: Any) -> None:
    # TF: testSimpleMasterRetrieval
    slurm_env(
        SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_NODELIST="t02n13,t02n41,t02n43"
    )
    resolver = _ps_worker(tasks_per_node=1, gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)
    resolver.task_type = "worker"
    resolver.task_id = 1
    assert resolver.master() == "grpc://t02n43:8888"
    resolver.rpc_layer = "ab"
    assert resolver.master("ps", 0) == "ab://t02n13:8888"
    assert resolver.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"
    # cluster_spec() (which master() calls) puts this process's task back.
    assert resolver.get_task_info() == ("ps", 0)
    resolver.rpc_layer = None
    assert resolver.master("worker", 0) == "t02n41:8888"


def test_slurm_tasks_per_node_from_env(slurm_env: Any) -> None:
    # TF: testTaskPerNodeNotSetRetrieval
    slurm_env(
        SLURM_PROCID="0",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_TASKS_PER_NODE="1(x3)",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
    )
    resolver = _ps_worker(gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["t02n13:8888"],
        "worker": ["t02n41:8888", "t02n43:8888"],
    }


_MULTI_TASK_SPEC = {
    "ps": ["t02n13:8888"],
    "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"],
}


@pytest.mark.parametrize(
    ("gpus_per_node", "gpus_per_task", "visible"),
    [(2, 1, "1"), (4, 2, "2,3")],  # TF: testMultiTaskPerNodeRetrieval, ...MultipleGpusPerTask...
)
def test_slurm_multi_task_per_node(
    slurm_env: Any, gpus_per_node: int, gpus_per_task: int, visible: str
) -> None:
    slurm_env(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="5",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
        SLURM_STEP_NODELIST="t02n13,t02n41,t02n43",
        CUDA_VISIBLE_DEVICES="",
    )
    resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4},
        port_base=8888,
        gpus_per_node=gpus_per_node,
        gpus_per_task=gpus_per_task,
        auto_set_gpu=True,
    )
    assert resolver.cluster_spec().as_dict() == _MULTI_TASK_SPEC
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible
    assert resolver.get_task_info() == ("worker", 0)
    assert resolver.num_accelerators() == {"GPU": gpus_per_task}


def test_slurm_every_rank_gets_its_own_gpus(slurm_env: Any) -> None:
    slurm_env(
        SLURM_STEP_NUM_TASKS="5",
        SLURM_STEP_TASKS_PER_NODE="2(x2),1",
        SLURM_STEP_NODELIST="t02n43,t02n13,t02n41",  # paired with the counts, then sorted
        CUDA_VISIBLE_DEVICES="0,1,2,3",
    )
    seen = []
    for rank in range(5):
        os.environ["SLURM_PROCID"] = str(rank)
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
        resolver = SlurmClusterResolver(port_base=2222)  # 4 GPUs / 2 tasks per node
        spec = resolver.cluster_spec()
        seen.append((resolver.get_task_info(), os.environ["CUDA_VISIBLE_DEVICES"]))
        assert resolver.master() == "grpc://" + spec.task_address("worker", rank)
    assert spec.as_dict() == {
        "worker": ["t02n13:2222", "t02n13:2223", "t02n41:2222", "t02n43:2222", "t02n43:2223"]
    }
    assert seen == [
        (("worker", 0), "0,1"),
        (("worker", 1), "2,3"),
        (("worker", 2), "0,1"),
        (("worker", 3), "0,1"),
        (("worker", 4), "2,3"),
    ]


def test_slurm_zero_padded_nodes_and_dict_tasks_per_node(slurm_env: Any) -> None:
    slurm_env(
        SLURM_PROCID="3", SLURM_STEP_NODELIST="node[01-02]", SLURM_STEP_TASKS_PER_NODE="2(x2)"
    )
    resolver = SlurmClusterResolver(
        jobs={"chief": 1, "worker": 3}, gpus_per_node=0, auto_set_gpu=False
    )
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["node01:8888"],
        "worker": ["node01:8889", "node02:8888", "node02:8889"],
    }
    assert resolver.get_task_info() == ("worker", 2)

    # A dict needs no node list; its hosts are sorted too.
    os.environ.pop("SLURM_STEP_NODELIST")
    os.environ["SLURM_PROCID"] = "2"
    resolver = SlurmClusterResolver(
        tasks_per_node={"b": 1, "a": 2}, jobs={"worker": 3}, gpus_per_node=0, port_base=1000
    )
    assert resolver.cluster_spec().as_dict() == {"worker": ["a:1000", "a:1001", "b:1000"]}
    assert resolver.master() == "grpc://b:1000"


def test_slurm_cpu_only_nodes(slurm_env: Any) -> None:
    slurm_env(
        SLURM_PROCID="2",
        SLURM_STEP_NUM_TASKS="4",
        SLURM_STEP_NODELIST="c[1-2]",
        SLURM_STEP_TASKS_PER_NODE="2(x2)",
        CUDA_VISIBLE_DEVICES="",  # no GPUs visible: counted as 0 (TF counts 1)
    )
    resolver = SlurmClusterResolver()
    assert resolver.num_accelerators() == {"GPU": 0}
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["c1:8888", "c1:8889", "c2:8888", "c2:8889"]
    }
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert resolver.master() == "grpc://c2:8888"


def test_slurm_gpus_per_task_defaults_to_an_even_split(slurm_env: Any) -> None:
    slurm_env(
        SLURM_PROCID="0",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_NODELIST="g[1-2]",
        SLURM_STEP_TASKS_PER_NODE="2,1",
    )
    assert SlurmClusterResolver(gpus_per_node=5).num_accelerators() == {"GPU": 2}
    assert SlurmClusterResolver(gpus_per_node=1).num_accelerators() == {"GPU": 0}


def test_get_num_gpus_sources(slurm_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_env(CUDA_VISIBLE_DEVICES="0,1,3")
    assert get_num_gpus() == 3
    slurm_env(CUDA_VISIBLE_DEVICES="")
    assert get_num_gpus() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    listing = "GPU 0: NVIDIA H100 (UUID: GPU-a)\nGPU 1: NVIDIA H100 (UUID: GPU-b)\n"
    monkeypatch.setattr(_slurm, "_nvidia_smi_list_gpus", lambda: listing)
    assert get_num_gpus() == 2

    monkeypatch.setattr(_slurm, "_nvidia_smi_list_gpus", lambda: None)  # no nvidia-smi
    slurm_env(SLURM_STEP_GPUS="4,5,6,7")
    assert get_num_gpus() == 4
    monkeypatch.delenv("SLURM_STEP_GPUS")
    with pytest.raises(RuntimeError, match="gpus_per_node="):
        get_num_gpus()


def test_nvidia_smi_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: Any, **kwargs: Any) -> str:
        raise FileNotFoundError("nvidia-smi")

    def failing(*args: Any, **kwargs: Any) -> str:
        raise subprocess.CalledProcessError(9, ["nvidia-smi"], output="NVIDIA-SMI has failed")

    monkeypatch.setattr(_slurm.subprocess, "check_output", missing)
    assert _slurm._nvidia_smi_list_gpus() is None
    monkeypatch.setattr(_slurm.subprocess, "check_output", failing)
    with pytest.raises(RuntimeError, match=r"Could not get number of GPUs from nvidia-smi\."):
        _slurm._nvidia_smi_list_gpus()


def test_slurm_gpus_counted_from_cuda_visible_devices(slurm_env: Any) -> None:
    slurm_env(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="n1",
        SLURM_STEP_TASKS_PER_NODE="2",
        CUDA_VISIBLE_DEVICES="0,1,2,3",
    )
    resolver = SlurmClusterResolver()
    assert resolver.num_accelerators() == {"GPU": 2}
    resolver.cluster_spec()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_errors(slurm_env: Any) -> None:
    with pytest.raises(
        RuntimeError, match=r"^SLURM_PROCID not found in environment\. Not running inside"
    ):
        SlurmClusterResolver()
    slurm_env(SLURM_PROCID="0")
    with pytest.raises(RuntimeError, match="SLURM_STEP_NUM_TASKS not found"):
        SlurmClusterResolver()
    slurm_env(SLURM_STEP_NUM_TASKS="3")
    with pytest.raises(RuntimeError, match="SLURM_STEP_NODELIST not found"):
        SlurmClusterResolver(gpus_per_node=0)
    slurm_env(SLURM_STEP_NODELIST="a,b,c")
    with pytest.raises(RuntimeError, match="SLURM_STEP_TASKS_PER_NODE not found"):
        SlurmClusterResolver(gpus_per_node=0)
    slurm_env(SLURM_STEP_TASKS_PER_NODE="1(x2)")
    with pytest.raises(RuntimeError, match="lists 3 nodes but"):
        SlurmClusterResolver(gpus_per_node=0)
    slurm_env(SLURM_STEP_TASKS_PER_NODE="1(x3)")
    with pytest.raises(RuntimeError, match=r"^Requested more GPUs per node then available\."):
        SlurmClusterResolver(gpus_per_node=1, gpus_per_task=2)
    with pytest.raises(RuntimeError, match=r"^Requested 4 tasks but only 3 were assigned\.$"):
        SlurmClusterResolver(jobs={"worker": 4}, gpus_per_node=0)
    slurm_env(SLURM_PROCID="3")
    with pytest.raises(RuntimeError, match="SLURM_PROCID=3 is not a task"):
        SlurmClusterResolver(gpus_per_node=0)
    slurm_env(SLURM_PROCID="0", SLURM_STEP_NODELIST="a[1-")
    with pytest.raises(ValueError, match="Invalid hostlist format"):
        SlurmClusterResolver(gpus_per_node=0)


def test_slurm_with_union_resolver(slurm_env: Any) -> None:
    slurm_env(SLURM_PROCID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="w[1-2]")
    slurm = SlurmClusterResolver(tasks_per_node=1, gpus_per_node=0, auto_set_gpu=False)
    union = UnionResolver(slurm, cr.SimpleClusterResolver(ClusterSpec({"ps": ["p:1"]})))
    assert union.cluster_spec().as_dict() == {"worker": ["w1:8888", "w2:8888"], "ps": ["p:1"]}
    assert union.num_accelerators() == {"GPU": 0}


# ------------------------------------------------------------------------------- Kubernetes


def _pod(name: str, phase: str, host_ip: str) -> Any:
    return types.SimpleNamespace(
        metadata=types.SimpleNamespace(name=name),
        status=types.SimpleNamespace(phase=phase, host_ip=host_ip, pod_ip="192.168.0.1"),
    )


class FakeCoreV1Api:
    """``list_pod_for_all_namespaces(label_selector=...)`` over fixed pod lists."""

    def __init__(self, pods_by_selector: dict[str, list[tuple[str, str, str]]]) -> None:
        self.pods = {s: [_pod(*p) for p in pods] for s, pods in pods_by_selector.items()}
        self.selectors: list[str] = []

    def list_pod_for_all_namespaces(self, *, label_selector: str) -> Any:
        self.selectors.append(label_selector)
        return types.SimpleNamespace(items=list(self.pods[label_selector]))


@pytest.fixture
def no_kubernetes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("kubernetes", "kubernetes.config", "kubernetes.client"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError


@pytest.fixture
def fake_kubernetes(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in ``kubernetes`` package recording the configuration calls."""
    calls: list[str] = []
    client_api = FakeCoreV1Api({"job-name=tensorflow": [("tf-0", "Running", "10.0.0.9")]})
    config = types.ModuleType("kubernetes.config")
    config.load_kube_config = lambda: calls.append("load_kube_config")  # type: ignore[attr-defined]
    config.load_incluster_config = lambda: calls.append("load_incluster_config")  # type: ignore[attr-defined]
    client = types.ModuleType("kubernetes.client")
    client.CoreV1Api = lambda: client_api  # type: ignore[attr-defined]
    package = types.ModuleType("kubernetes")
    package.config = config  # type: ignore[attr-defined]
    package.client = client  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kubernetes", package)
    monkeypatch.setitem(sys.modules, "kubernetes.config", config)
    monkeypatch.setitem(sys.modules, "kubernetes.client", client)
    return calls


def test_kubernetes_single_item(no_kubernetes: None) -> None:
    # TF: testSingleItemSuccessfulRetrieval(InCluster): override_client needs no kubernetes
    client = FakeCoreV1Api({"job-name=tensorflow": [("tensorflow-abc123", "Running", "10.1.2.3")]})
    for location in KubernetesExecutableLocation:
        resolver = KubernetesClusterResolver(override_client=client, executable_location=location)
        assert resolver.cluster_spec() == ClusterSpec({"worker": ["10.1.2.3:8470"]})
    assert client.selectors == ["job-name=tensorflow", "job-name=tensorflow"]
    assert resolver.task_type is None and resolver.task_id is None
    assert resolver.rpc_layer == "grpc"
    assert resolver.environment == ""
    assert resolver.master() == ""


def test_kubernetes_sorted_by_pod_name() -> None:
    # TF: testSuccessfulRetrievalWithSort (sorted by name, addresses are the host IPs)
    client = FakeCoreV1Api(
        {
            "job-name=tensorflow": [
                ("tensorflow-abc123", "Running", "10.1.2.3"),
                ("tensorflow-def456", "Running", "10.1.2.4"),
                ("tensorflow-999999", "Running", "10.1.2.5"),
            ]
        }
    )
    resolver = KubernetesClusterResolver(override_client=client)
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["10.1.2.5:8470", "10.1.2.3:8470", "10.1.2.4:8470"]
    }


def test_kubernetes_master_with_override_parameters() -> None:
    # TF: testGetMasterWithOverrideParameters
    client = FakeCoreV1Api(
        {
            "job-name=tensorflow": [
                ("worker-0", "Running", "10.1.2.3"),
                ("worker-1", "Running", "10.1.2.4"),
                ("worker-2", "Running", "10.1.2.5"),
            ]
        }
    )
    resolver = KubernetesClusterResolver(override_client=client)
    resolver.task_type = "worker"
    resolver.task_id = 0
    assert resolver.task_type == "worker"
    assert resolver.task_id == 0
    assert resolver.master() == "grpc://10.1.2.3:8470"
    assert resolver.master("worker", 2) == "grpc://10.1.2.5:8470"
    assert resolver.master("worker", 1, rpc_layer="ab") == "ab://10.1.2.4:8470"
    resolver.rpc_layer = ""
    assert resolver.master() == "10.1.2.3:8470"


def test_kubernetes_non_running_pod() -> None:
    # TF: testNonRunningPod
    client = FakeCoreV1Api({"job-name=tensorflow": [("tensorflow-abc123", "Failed", "10.1.2.3")]})
    resolver = KubernetesClusterResolver(override_client=client)
    with pytest.raises(
        RuntimeError, match='^Pod "tensorflow-abc123" is not running; phase: "Failed"'
    ):
        resolver.cluster_spec()


def test_kubernetes_multiple_selectors_and_jobs() -> None:
    # TF: testMultiplePodSelectorsAndWorkers (each selector's pods sorted on their own)
    client = FakeCoreV1Api(
        {
            "job-name=worker1": [
                ("tensorflow-abc123", "Running", "10.1.2.3"),
                ("tensorflow-def456", "Running", "10.1.2.4"),
                ("tensorflow-999999", "Running", "10.1.2.5"),
            ],
            "job-name=worker2": [
                ("tensorflow-abc124", "Running", "10.1.2.6"),
                ("tensorflow-def457", "Running", "10.1.2.7"),
                ("tensorflow-999990", "Running", "10.1.2.8"),
            ],
            "job-name=ps": [
                ("tensorflow-ps-1", "Running", "10.1.2.1"),
                ("tensorflow-ps-2", "Running", "10.1.2.2"),
            ],
        }
    )
    resolver = KubernetesClusterResolver(
        job_to_label_mapping={
            "worker": ["job-name=worker1", "job-name=worker2"],
            "ps": ["job-name=ps"],
        },
        tf_server_port=8470,
        override_client=client,
    )
    assert resolver.cluster_spec().as_dict() == {
        "worker": [
            *("10.1.2.5:8470", "10.1.2.3:8470", "10.1.2.4:8470"),
            *("10.1.2.8:8470", "10.1.2.6:8470", "10.1.2.7:8470"),
        ],
        "ps": ["10.1.2.1:8470", "10.1.2.2:8470"],
    }
    # A single selector string is one selector.
    resolver = KubernetesClusterResolver({"ps": "job-name=ps"}, 2222, override_client=client)
    assert resolver.cluster_spec().as_dict() == {"ps": ["10.1.2.1:2222", "10.1.2.2:2222"]}


def test_kubernetes_missing_client(no_kubernetes: None) -> None:
    with pytest.raises(ImportError, match=r"^The Kubernetes Python client must be installed"):
        KubernetesClusterResolver()


def test_kubernetes_loads_configuration(fake_kubernetes: list[str]) -> None:
    resolver = KubernetesClusterResolver()
    assert fake_kubernetes == ["load_incluster_config"]
    resolver = KubernetesClusterResolver(
        executable_location=KubernetesExecutableLocation.OFF_CLUSTER
    )
    assert fake_kubernetes == ["load_incluster_config", "load_kube_config"]
    # cluster_spec() uses kubernetes.client.CoreV1Api() without loading the config again.
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.9:8470"]}
    assert fake_kubernetes == ["load_incluster_config", "load_kube_config"]
    # TF: testValueErrorRaisedOnInvalidExecutableLocation
    with pytest.raises(ValueError, match="^The executable location provided is invalid"):
        KubernetesClusterResolver(executable_location=None)  # type: ignore[arg-type]
    assert fake_kubernetes == ["load_incluster_config", "load_kube_config"]


# -------------------------------------------------------------------------------------- GCE


class FakeRequest:
    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result

    def execute(self) -> dict[str, Any]:
        return self.result


class FakeComputeService:
    """The parts of ``discovery.build("compute", "v1")`` the resolver calls.

    ``pages``: lists of instance names, one list per page of ``listInstances``.
    """

    def __init__(self, ips: dict[str, str], pages: list[list[str]] | None = None) -> None:
        self.ips = ips
        self.pages = pages if pages is not None else [list(ips)]
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def instanceGroups(self) -> FakeComputeService:
        return self

    def instances(self) -> Any:
        return types.SimpleNamespace(get=self._get)

    def _page(self, index: int) -> FakeRequest:
        items = [{"instance": f"https://gce.example.com/res/{name}"} for name in self.pages[index]]
        request = FakeRequest({"items": items} if items else {})
        request.page = index  # type: ignore[attr-defined]
        return request

    def listInstances(self, **kwargs: Any) -> FakeRequest:
        self.calls.append(("listInstances", kwargs))
        return self._page(0)

    def listInstances_next(
        self, previous_request: Any, previous_response: Any
    ) -> FakeRequest | None:
        following = previous_request.page + 1
        return self._page(following) if following < len(self.pages) else None

    def _get(self, *, project: str, zone: str, instance: str) -> FakeRequest:
        self.calls.append(("get", {"project": project, "zone": zone, "instance": instance}))
        if instance not in self.ips:
            raise RuntimeError(f"Instance {instance} not found!")
        return FakeRequest({"networkInterfaces": [{"networkIP": self.ips[instance]}]})


THREE_INSTANCES = {"instance1": "10.1.2.3", "instance2": "10.2.3.4", "instance3": "10.3.4.5"}


def _gce(service: Any, **kwargs: Any) -> GCEClusterResolver:
    kwargs.setdefault("port", 8470)
    return GCEClusterResolver(
        project="test-project",
        zone="us-east1-d",
        instance_group="test-instance-group",
        credentials=None,
        service=service,
        **kwargs,
    )


def test_gce_simple_retrieval_and_api_calls() -> None:
    # TF: testSimpleSuccessfulRetrieval
    service = FakeComputeService({"gce-instance-1": "10.123.45.67"})
    resolver = _gce(service)
    assert resolver.cluster_spec() == ClusterSpec({"worker": ["10.123.45.67:8470"]})
    assert service.calls == [
        (
            "listInstances",
            {
                "project": "test-project",
                "zone": "us-east1-d",
                "instanceGroup": "test-instance-group",
                "body": {"instanceState": "RUNNING"},
                "orderBy": "name",
            },
        ),
        ("get", {"project": "test-project", "zone": "us-east1-d", "instance": "gce-instance-1"}),
    ]
    assert resolver.task_type == "worker"
    assert resolver.task_id == 0
    assert resolver.rpc_layer == "grpc"
    assert resolver.environment == ""


def test_gce_master_retrieval() -> None:
    # TF: testMasterRetrieval, testMasterRetrievalWithCustomTasks
    assert (
        _gce(FakeComputeService({"gce-instance-1": "10.123.45.67"}), task_id=0).master()
        == "grpc://10.123.45.67:8470"
    )
    resolver = _gce(FakeComputeService(THREE_INSTANCES))
    assert resolver.master("worker", 2, "test") == "test://10.3.4.5:8470"


def test_gce_override_parameters() -> None:
    # TF: testOverrideParameters
    resolver = _gce(FakeComputeService(THREE_INSTANCES), task_type="testworker")
    resolver.task_id = 1
    resolver.rpc_layer = "test"
    assert resolver.task_type == "testworker"
    assert resolver.task_id == 1
    assert resolver.rpc_layer == "test"
    assert resolver.master() == "test://10.2.3.4:8470"
    resolver.rpc_layer = None
    assert resolver.master() == "10.2.3.4:8470"
    with pytest.raises(RuntimeError, match="^You cannot reset the task_type of the GCEClusterRes"):
        resolver.task_type = "ps"
    assert resolver.task_type == "testworker"


def test_gce_override_parameters_with_zero_or_empty() -> None:
    # TF: testOverrideParametersWithZeroOrEmpty
    resolver = _gce(FakeComputeService(THREE_INSTANCES), task_type="", task_id=1)
    assert resolver.master(task_type="", task_id=0) == "grpc://10.1.2.3:8470"


def test_gce_custom_job_name_and_port() -> None:
    # TF: testCustomJobNameAndPortRetrieval
    resolver = _gce(
        FakeComputeService({"gce-instance-1": "10.123.45.67"}), task_type="custom", port=2222
    )
    assert resolver.cluster_spec().as_dict() == {"custom": ["10.123.45.67:2222"]}


def test_gce_multiple_instances_pages_and_sorting() -> None:
    # TF: testMultipleInstancesRetrieval; addresses are sorted, pages are followed.
    assert _gce(FakeComputeService(THREE_INSTANCES)).cluster_spec().as_dict() == {
        "worker": ["10.1.2.3:8470", "10.2.3.4:8470", "10.3.4.5:8470"]
    }
    service = FakeComputeService(
        {"a": "10.0.0.9", "b": "10.0.0.10", "c": "10.0.0.1"}, pages=[["a"], [], ["b", "c"]]
    )
    assert _gce(service).cluster_spec().as_dict() == {
        "worker": ["10.0.0.10:8470", "10.0.0.1:8470", "10.0.0.9:8470"]  # string order, as TF
    }
    empty = _gce(FakeComputeService({}, pages=[[]])).cluster_spec()  # no "items" in the response
    assert empty.jobs == ["worker"]
    assert empty.num_tasks("worker") == 0


def test_gce_union_of_groups() -> None:
    # TF: testUnionMultipleInstanceRetrieval
    worker1 = _gce(FakeComputeService(THREE_INSTANCES), task_type="worker")
    worker2 = _gce(
        FakeComputeService(
            {"instance4": "10.4.5.6", "instance5": "10.5.6.7", "instance6": "10.6.7.8"}
        ),
        task_type="worker",
    )
    ps = _gce(
        FakeComputeService({"ps1": "10.100.1.2", "ps2": "10.100.2.3"}), task_type="ps", port=2222
    )
    union = UnionResolver(worker1, worker2, ps)
    assert union.cluster_spec().as_dict() == {
        "worker": [
            *("10.1.2.3:8470", "10.2.3.4:8470", "10.3.4.5:8470"),
            *("10.4.5.6:8470", "10.5.6.7:8470", "10.6.7.8:8470"),
        ],
        "ps": ["10.100.1.2:2222", "10.100.2.3:2222"],
    }


def test_gce_missing_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "googleapiclient", None)
    monkeypatch.setitem(sys.modules, "googleapiclient.discovery", None)
    with pytest.raises(
        ImportError, match="^googleapiclient must be installed before using the GCE"
    ):
        GCEClusterResolver("p", "z", "g", 8470)


def test_gce_builds_the_compute_service(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[Any, ...]] = []
    service = FakeComputeService({"vm": "10.9.9.9"})

    def build(name: str, version: str, *, credentials: Any) -> Any:
        built.append((name, version, credentials))
        return service

    discovery = types.ModuleType("googleapiclient.discovery")
    discovery.build = build  # type: ignore[attr-defined]
    package = types.ModuleType("googleapiclient")
    package.discovery = discovery  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "googleapiclient", package)
    monkeypatch.setitem(sys.modules, "googleapiclient.discovery", discovery)
    monkeypatch.setitem(sys.modules, "oauth2client", None)
    monkeypatch.setitem(sys.modules, "oauth2client.client", None)

    resolver = GCEClusterResolver("p", "z", "g", 2222)  # default credentials, no oauth2client
    assert resolver.master() == "grpc://10.9.9.9:2222"
    token = object()
    GCEClusterResolver("p", "z", "g", 2222, credentials=token)

    oauth_client = types.ModuleType("oauth2client.client")
    adc = object()
    oauth_client.GoogleCredentials = types.SimpleNamespace(  # type: ignore[attr-defined]
        get_application_default=lambda: adc
    )
    monkeypatch.setitem(sys.modules, "oauth2client", types.ModuleType("oauth2client"))
    monkeypatch.setitem(sys.modules, "oauth2client.client", oauth_client)
    GCEClusterResolver("p", "z", "g", 2222)
    assert built == [("compute", "v1", None), ("compute", "v1", token), ("compute", "v1", adc)]


def test_slurm_resolver_drives_multi_worker_mirrored_strategy(slurm_env: Any) -> None:
    import polydist as pd

    slurm_env(
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="n[01-02]",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
    )
    strategy = pd.MultiWorkerMirroredStrategy(
        cluster_resolver=SlurmClusterResolver(gpus_per_node=0)
    )
    assert strategy.num_replicas_in_sync == 2
    assert strategy.cluster_resolver.task_type == "worker"
    assert strategy.cluster_resolver.task_id == 1
