"""Tests for polydist_sim.cost_model: formulas, topologies, trace replay, sizing report."""

from __future__ import annotations

import math
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polydist.backend.tracing import CollectiveEvent
from polydist_sim import cost_model
from polydist_sim.cost_model import (
    OPS,
    TOPOLOGIES,
    Link,
    Topology,
    get_topology,
    predict,
    predict_trace,
    sizing_report,
    step_times,
)

GiB = 2**30
MiB = 2**20

A, BW = 5e-6, 1e11
T8 = Topology(name="t8", num_devices=8, devices_per_host=8, intra_host=Link(A, BW))
# Two hosts x 8 devices: fast intra links, slow shared NIC.
AI, BI, AE, BE = 1e-6, 4e11, 1e-5, 1e10
H2 = Topology(
    name="h2",
    num_devices=16,
    devices_per_host=8,
    intra_host=Link(AI, BI),
    inter_host=Link(AE, BE),
)


def approx(x: float) -> Any:
    return pytest.approx(x, rel=1e-12, abs=0.0)


# --------------------------------------------------------------------------- flat formulas


def test_ring_all_reduce_worked_example() -> None:
    # The example from the docs: 8 devices, 1 GiB, alpha=5 us, beta=100 GB/s.
    expected = 2 * 7 * 5e-6 + 2 * 7 / 8 * 2**30 / 1e11
    assert predict("all_reduce", GiB, T8, "ring") == approx(expected)
    assert expected == pytest.approx(0.01886048192, rel=1e-10)  # 70 us + 18.79 ms


def test_tree_all_reduce() -> None:
    expected = 2 * 3 * A + 2 * GiB / BW  # ceil(log2 8) = 3
    assert predict("all_reduce", GiB, T8, "tree") == approx(expected)


@pytest.mark.parametrize("nbytes", [0, 1, 4096, MiB, GiB])
def test_auto_is_min_of_ring_and_tree(nbytes: int) -> None:
    for op in OPS:
        ring = predict(op, nbytes, T8, "ring")
        tree = predict(op, nbytes, T8, "tree")
        assert predict(op, nbytes, T8, "auto") == min(ring, tree)


def test_auto_picks_tree_for_small_and_ring_for_large() -> None:
    small_ring = predict("all_reduce", 8, T8, "ring")
    small_tree = predict("all_reduce", 8, T8, "tree")
    assert small_tree < small_ring  # 6 alpha vs 14 alpha
    assert predict("all_reduce", GiB, T8, "ring") < predict("all_reduce", GiB, T8, "tree")


def test_reduce_scatter() -> None:
    expected = 7 * A + 7 / 8 * GiB / BW
    assert predict("reduce_scatter", GiB, T8, "ring") == approx(expected)
    assert predict("reduce_scatter", GiB, T8, "tree") == approx(expected)  # no tree variant


def test_all_gather() -> None:
    total = 8 * MiB  # nbytes is per participant
    assert predict("all_gather", MiB, T8, "ring") == approx(7 * A + 7 / 8 * total / BW)
    assert predict("all_gather", MiB, T8, "tree") == approx(3 * A + 7 / 8 * total / BW)


def test_broadcast_reduce_to_and_reduce() -> None:
    for op in ("broadcast", "reduce_to", "reduce"):
        assert predict(op, MiB, T8, "ring") == approx(7 * A + MiB / BW)
        assert predict(op, MiB, T8, "tree") == approx(3 * A + MiB / BW)


def test_gather() -> None:
    assert predict("gather", MiB, T8, "ring") == approx(7 * A + 7 * MiB / BW)
    assert predict("gather", MiB, T8, "tree") == approx(3 * A + 7 * MiB / BW)


def test_tree_depth_rounds_up_for_non_powers_of_two() -> None:
    assert predict("all_reduce", 0, T8, "tree", num_devices=5) == approx(2 * 3 * A)
    assert predict("all_reduce", 0, T8, "tree", num_devices=2) == approx(2 * 1 * A)
    assert predict("broadcast", 0, T8, "tree", num_devices=3) == approx(2 * A)


def test_zero_cost_cases() -> None:
    assert predict("merge_call", GiB, T8, "ring") == 0.0
    assert predict("all_reduce", GiB, T8, "ring", num_devices=1) == 0.0
    assert predict("all_reduce", 0, T8, "ring") == approx(14 * A)  # latency only


def test_num_devices_subset_of_flat_topology() -> None:
    expected = 2 * 3 * A + 2 * 3 / 4 * GiB / BW
    assert predict("all_reduce", GiB, T8, "ring", num_devices=4) == approx(expected)


def test_topology_by_name() -> None:
    assert predict("all_reduce", GiB, "8xH100-NVLink") == predict(
        "all_reduce", GiB, TOPOLOGIES["8xH100-NVLink"]
    )


# --------------------------------------------------------------------------- hierarchical


def test_hierarchical_all_reduce_ring() -> None:
    b = GiB
    intra_rs = 7 * AI + 7 / 8 * b / BI
    # Inter-host ring all-reduce over 2 hosts of b/8 per device, 8 devices sharing BE.
    inter = 2 * 1 * AE + 2 * 1 / 2 * (b / 8) / (BE / 8)
    intra_ag = 7 * AI + 7 / 8 * b / BI
    assert predict("all_reduce", b, H2, "ring") == approx(intra_rs + inter + intra_ag)
    # Closed form: the NIC carries 2(H-1)/H * b in total.
    assert inter == approx(2 * AE + b / BE)


def test_hierarchical_all_reduce_tree_uses_tree_between_hosts() -> None:
    b = GiB
    intra = 2 * (7 * AI + 7 / 8 * b / BI)
    inter = 2 * 1 * AE + 2 * (b / 8) / (BE / 8)
    assert predict("all_reduce", b, H2, "tree") == approx(intra + inter)


def test_hierarchical_other_ops() -> None:
    b = MiB
    # all_gather: inter-host first (b per device, NIC shared by 8), then intra-host of 2*b.
    ag = (AE + 1 / 2 * (2 * b) / (BE / 8)) + (7 * AI + 7 / 8 * (8 * 2 * b) / BI)
    assert predict("all_gather", b, H2, "ring") == approx(ag)
    # reduce_scatter: intra-host, then inter-host on b/8.
    rs = (7 * AI + 7 / 8 * b / BI) + (AE + 1 / 2 * (b / 8) / (BE / 8))
    assert predict("reduce_scatter", b, H2, "ring") == approx(rs)
    # broadcast / reduce_to: the payload crosses the NIC once, then the host.
    bc = (AE + b / BE) + (7 * AI + b / BI)
    assert predict("broadcast", b, H2, "ring") == approx(bc)
    assert predict("reduce_to", b, H2, "ring") == approx(bc)
    # gather: to a leader per host, then 8*b from the other host's leader to the root.
    ga = (7 * AI + 7 * b / BI) + (AE + 1 / 2 * (2 * 8 * b) / BE)
    assert predict("gather", b, H2, "ring") == approx(ga)


def test_hierarchical_within_one_host_is_flat() -> None:
    flat8 = Topology(name="f", num_devices=8, devices_per_host=8, intra_host=Link(AI, BI))
    for op in OPS:
        assert predict(op, GiB, H2, "ring", num_devices=8) == predict(op, GiB, flat8, "ring")


def test_named_gpu_topologies() -> None:
    nv_a, nv_b = 3.4e-6, 450e9
    single = 2 * 7 * nv_a + 2 * 7 / 8 * GiB / nv_b
    assert predict("all_reduce", GiB, "8xH100-NVLink", "ring") == approx(single)
    two_hosts = 2 * (7 * nv_a + 7 / 8 * GiB / nv_b) + 2 * 14e-6 + GiB / 12.5e9
    assert predict("all_reduce", GiB, "2x8xH100-100Gbps", "ring") == approx(two_hosts)


# --------------------------------------------------------------------------- torus / mesh


def test_tpu_v4_32_mesh_ring() -> None:
    # 2x2x4 mesh: 1+1+3 = 5 ring steps per pass; 3 link-directions busy (no wraparound).
    b = GiB
    expected = 2 * 5 * 1e-6 + 2 * 15 / 16 * b / (3 * 4.5e10)
    assert predict("all_reduce", b, "tpu-v4-32", "ring") == approx(expected)


def test_tpu_v5e_16_mesh_ring() -> None:
    b = GiB
    expected = 2 * 6 * 1e-6 + 2 * 15 / 16 * b / (2 * 5e10)
    assert predict("all_reduce", b, "tpu-v5e-16", "ring") == approx(expected)


def test_wraparound_doubles_ring_bandwidth() -> None:
    link = Link(1e-6, 1e10)
    torus = Topology("torus", 16, 4, link, torus_dims=(4, 4), wraparound=(True, True))
    mesh = Topology("mesh", 16, 4, link, torus_dims=(4, 4))
    b = GiB
    assert predict("all_reduce", b, torus, "ring") == approx(12e-6 + 2 * 15 / 16 * b / 4e10)
    assert predict("all_reduce", b, mesh, "ring") == approx(12e-6 + 2 * 15 / 16 * b / 2e10)
    # A wrapped dimension of size 2 is still one link: 1 + 2 directions.
    small = Topology("t24", 8, 8, link, torus_dims=(2, 4), wraparound=(True, True))
    assert predict("reduce_scatter", b, small, "ring") == approx(4e-6 + 7 / 8 * b / 3e10)


def test_torus_other_ops_and_tree() -> None:
    link = Link(1e-6, 1e10)
    torus = Topology("torus", 16, 4, link, torus_dims=(4, 4), wraparound=(True, True))
    b = MiB
    assert predict("all_gather", b, torus, "ring") == approx(6e-6 + 15 * b / 4e10)
    assert predict("gather", b, torus, "ring") == approx(6e-6 + 15 * b / 4e10)
    assert predict("broadcast", b, torus, "ring") == approx(6e-6 + b / 1e10)
    assert predict("reduce_to", b, torus, "ring") == approx(6e-6 + b / 1e10)
    assert predict("all_reduce", b, torus, "tree") == approx(2 * 4 * 1e-6 + 2 * b / 1e10)


def test_torus_sub_slice() -> None:
    b = GiB
    # 8 of tpu-v4-32's chips: a 2x2x2 mesh.
    expected = 2 * 3 * 1e-6 + 2 * 7 / 8 * b / (3 * 4.5e10)
    assert predict("all_reduce", b, "tpu-v4-32", "ring", num_devices=8) == approx(expected)
    # A sub-slice that cuts a wrapped dimension loses its wraparound.
    link = Link(1e-6, 1e10)
    torus = Topology("torus", 16, 4, link, torus_dims=(4, 4), wraparound=(True, True))
    # 8 chips -> 4x2: dim 0 keeps its wrap (2 directions), dim 1 is a line (1).
    assert predict("all_reduce", b, torus, "ring", num_devices=8) == approx(
        2 * 4 * 1e-6 + 2 * 7 / 8 * b / 3e10
    )


# --------------------------------------------------------------------------- properties

_sizes = st.integers(min_value=0, max_value=2**40)
_ops = st.sampled_from(OPS)
_algs = st.sampled_from(["ring", "tree", "auto"])
_topos = st.sampled_from([*TOPOLOGIES.values(), T8, H2])


@settings(max_examples=300, deadline=None)
@given(op=_ops, alg=_algs, topo=_topos, a=_sizes, b=_sizes)
def test_monotone_in_bytes(op: str, alg: Any, topo: Topology, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert predict(op, lo, topo, alg) <= predict(op, hi, topo, alg)


@settings(max_examples=300, deadline=None)
@given(
    op=_ops,
    alg=st.sampled_from(["ring", "tree"]),
    nbytes=_sizes,
    n=st.integers(min_value=1, max_value=7),
)
def test_flat_monotone_in_devices(op: str, alg: Any, nbytes: int, n: int) -> None:
    assert predict(op, nbytes, T8, alg, num_devices=n) <= predict(
        op, nbytes, T8, alg, num_devices=n + 1
    )


@settings(max_examples=200, deadline=None)
@given(
    op=_ops,
    alg=_algs,
    nbytes=_sizes,
    alpha=st.floats(min_value=0, max_value=1e-3),
    beta=st.floats(min_value=1e6, max_value=1e13),
    factor=st.floats(min_value=1.0, max_value=100.0),
)
def test_monotone_in_link_parameters(
    op: str, alg: Any, nbytes: int, alpha: float, beta: float, factor: float
) -> None:
    def topo(a: float, b: float) -> Topology:
        return Topology("p", 8, 8, Link(a, b))

    base = predict(op, nbytes, topo(alpha, beta), alg)
    assert predict(op, nbytes, topo(alpha, beta * factor), alg) <= base * (1 + 1e-12)
    assert predict(op, nbytes, topo(alpha * factor, beta), alg) >= base * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(op=_ops, topo=_topos, nbytes=_sizes)
def test_auto_never_slower_and_all_nonnegative(op: str, topo: Topology, nbytes: int) -> None:
    ring = predict(op, nbytes, topo, "ring")
    tree = predict(op, nbytes, topo, "tree")
    auto = predict(op, nbytes, topo, "auto")
    assert auto == min(ring, tree)
    assert auto >= 0.0
    assert math.isfinite(auto)


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(min_value=1, max_value=2**40), n=st.integers(min_value=2, max_value=8))
def test_ring_all_reduce_bandwidth_term_is_below_two_b_over_beta(nbytes: int, n: int) -> None:
    t = predict("all_reduce", nbytes, T8, "ring", num_devices=n)
    latency = 2 * (n - 1) * A
    assert 0 < t - latency <= 2 * nbytes / BW * (1 + 1e-12)


# --------------------------------------------------------------------------- errors


def test_unknown_topology_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown topology 'dgx-9000'") as info:
        get_topology("dgx-9000")
    msg = str(info.value)
    for name in TOPOLOGIES:
        assert name in msg
    assert msg.endswith("known topologies: 2x8xH100-100Gbps, 8xH100-NVLink, tpu-v4-32, tpu-v5e-16")
    with pytest.raises(ValueError, match="unknown topology"):
        predict("all_reduce", 1, "nope")


def test_get_topology_passes_topology_through() -> None:
    assert get_topology(T8) is T8
    assert get_topology("tpu-v4-32") is TOPOLOGIES["tpu-v4-32"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown collective op 'all_to_all'"):
        predict("all_to_all", 1, T8)
    with pytest.raises(ValueError, match="unknown algorithm"):
        predict("all_reduce", 1, T8, "butterfly")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes"):
        predict("all_reduce", -1, T8)
    with pytest.raises(ValueError, match="nbytes"):
        predict("all_reduce", float("nan"), T8)
    with pytest.raises(ValueError, match="num_devices=9"):
        predict("all_reduce", 1, T8, num_devices=9)
    with pytest.raises(ValueError, match="num_devices=0"):
        predict("all_reduce", 1, T8, num_devices=0)


def test_topology_validation() -> None:
    link = Link(1e-6, 1e9)
    with pytest.raises(ValueError, match="inter_host"):
        Topology("x", 16, 8, link)
    with pytest.raises(ValueError, match="multiple"):
        Topology("x", 12, 8, link, inter_host=link)
    with pytest.raises(ValueError, match="torus_dims"):
        Topology("x", 16, 4, link, torus_dims=(4, 3))
    with pytest.raises(ValueError, match="wraparound"):
        Topology("x", 16, 4, link, torus_dims=(4, 4), wraparound=(True,))
    with pytest.raises(ValueError, match="wraparound needs torus_dims"):
        Topology("x", 8, 8, link, wraparound=(True,))
    with pytest.raises(ValueError, match=">= 1"):
        Topology("x", 0, 8, link)
    with pytest.raises(ValueError, match="alpha"):
        Link(-1.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0, 0.0)
    assert Topology("x", 16, 4, link, torus_dims=(4, 4)).wraparound == (False, False)


def test_named_topologies_are_consistent() -> None:
    assert set(TOPOLOGIES) == {"8xH100-NVLink", "2x8xH100-100Gbps", "tpu-v4-32", "tpu-v5e-16"}
    for name, topo in TOPOLOGIES.items():
        assert topo.name == name
    assert TOPOLOGIES["8xH100-NVLink"].num_hosts == 1
    assert TOPOLOGIES["2x8xH100-100Gbps"].num_hosts == 2
    assert TOPOLOGIES["tpu-v4-32"].torus_dims == (2, 2, 4)
    assert TOPOLOGIES["tpu-v4-32"].num_hosts == 4
    assert TOPOLOGIES["tpu-v5e-16"].torus_dims == (4, 4)
    assert TOPOLOGIES["tpu-v5e-16"].num_hosts == 2


# --------------------------------------------------------------------------- trace replay


def _ev(op: str, nbytes: int, step: int, n: int) -> CollectiveEvent:
    return CollectiveEvent(
        step=step,
        op=op,
        reduce_op="SUM" if op != "broadcast" else None,
        dtype="float32",
        nbytes=nbytes,
        shape=(nbytes // 4,),
        participants=tuple(f"/sim:{i}" for i in range(n)),
        source="t.py:1 in f",
        backend="sim",
        start_time=0.0,
    )


def test_predict_trace_scales_to_topology_device_count() -> None:
    events = [
        _ev("all_reduce", MiB, 0, 2),  # all replicas -> all 8 devices
        _ev("broadcast", 1024, 0, 1),  # one replica of two -> local, free
        _ev("all_gather", 4096, 1, 2),
    ]
    got = predict_trace(events, T8, "ring")
    assert got == [
        predict("all_reduce", MiB, T8, "ring"),
        0.0,
        predict("all_gather", 4096, T8, "ring"),
    ]


def test_predict_trace_single_replica_trace_scales_up() -> None:
    events = [_ev("all_reduce", MiB, 0, 1)]
    assert predict_trace(events, T8, "ring") == [predict("all_reduce", MiB, T8, "ring")]


def test_predict_trace_subgroups_scale_proportionally() -> None:
    events = [_ev("all_reduce", MiB, 0, 4), _ev("all_reduce", MiB, 0, 2)]
    got = predict_trace(events, H2, "ring")
    assert got == [
        predict("all_reduce", MiB, H2, "ring"),
        predict("all_reduce", MiB, H2, "ring", num_devices=8),
    ]


def test_predict_trace_accepts_duck_typed_events() -> None:
    events = [SimpleNamespace(op="all_reduce", nbytes=MiB, step=3, participants=["a", "b"])]
    assert predict_trace(events, "8xH100-NVLink") == [
        predict("all_reduce", MiB, "8xH100-NVLink", "auto")
    ]
    assert predict_trace([], T8) == []


def test_step_times_sums_per_step() -> None:
    events = [
        _ev("all_reduce", MiB, 1, 2),
        _ev("broadcast", 1024, 0, 2),
        _ev("all_reduce", MiB, 1, 2),
    ]
    times = step_times(events, T8, "ring")
    assert list(times) == [0, 1]
    assert times[0] == approx(predict("broadcast", 1024, T8, "ring"))
    assert times[1] == approx(2 * predict("all_reduce", MiB, T8, "ring"))


def test_module_does_not_import_trace_types() -> None:
    # Duck typing: the cost model never names polydist's trace module.
    src = pathlib.Path(cost_model.__file__).read_text(encoding="utf-8")
    assert "polydist.backend.tracing" not in src.replace(
        "``polydist.backend.tracing.CollectiveEvent``", ""
    )


# --------------------------------------------------------------------------- sizing report


def test_sizing_report_exact() -> None:
    a = Topology("a", 4, 4, Link(1e-6, 1e9))
    b = Topology("b-slow", 2, 2, Link(1e-5, 1e8))
    events = [
        _ev("all_reduce", MiB, 0, 2),
        _ev("broadcast", 1024, 0, 2),
        _ev("all_reduce", MiB, 1, 2),
    ]
    # a (4 devices, ring):  all_reduce = 6e-6 + 1.5 * 2**20 / 1e9 = 1.578864 ms
    #                       broadcast  = 3e-6 + 1024 / 1e9        = 4.024 us
    #   step 0 = 1.582888 ms, step 1 = 1.578864 ms, total 3.161752 ms, mean 1.580876 ms
    # b-slow (2 devices):   all_reduce = 2e-5 + 2**20 / 1e8       = 10.50576 ms
    #                       broadcast  = 1e-5 + 1024 / 1e8        = 20.24 us
    #   step 0 = 10.526 ms, step 1 = 10.50576 ms, total 21.03176 ms, mean 10.51588 ms
    expected = "\n".join(
        [
            "Predicted communication time per step (alpha-beta model, algorithm=ring)",
            "Bytes per participant are held fixed; each topology uses all of its devices.",
            "",
            "step       collectives  bytes/device          a     b-slow",
            "                                      4 devices  2 devices",
            "---------  -----------  ------------  ---------  ---------",
            "0                    2      1.00 MiB    1.58 ms   10.53 ms",
            "1                    1      1.00 MiB    1.58 ms   10.51 ms",
            "total                3      2.00 MiB    3.16 ms   21.03 ms",
            "mean/step          1.5      1.00 MiB    1.58 ms   10.52 ms",
        ]
    )
    assert sizing_report(events, [a, b], algorithm="ring") == expected
    assert sizing_report(events, {"a": a, "b-slow": b}, algorithm="ring") == expected


def test_sizing_report_defaults_and_names() -> None:
    events = [_ev("all_reduce", GiB, 0, 2)]
    report = sizing_report(events)
    header = report.splitlines()[3].split()
    assert header == ["step", "collectives", "bytes/device", *TOPOLOGIES]
    assert "algorithm=auto" in report.splitlines()[0]
    by_name = sizing_report(events, ["tpu-v5e-16"])
    assert by_name.splitlines()[3].split()[-1] == "tpu-v5e-16"
    row = by_name.splitlines()[6].split()
    assert row[:4] == ["0", "1", "1.00", "GiB"]
    assert " ".join(row[4:]) == "20.14 ms"
    with pytest.raises(ValueError, match="unknown topology"):
        sizing_report(events, ["nope"])


def test_sizing_report_empty() -> None:
    assert sizing_report([]).splitlines()[-1] == "(no collectives recorded)"


def test_formatting_units() -> None:
    f = cost_model._format_seconds
    assert [f(0.0), f(4.024e-6), f(1.5e-3), f(2.5)] == ["0 s", "4.02 us", "1.50 ms", "2.500 s"]
    g = cost_model._format_bytes
    assert [g(0), g(1023), g(1024), g(3 * MiB), g(5 * GiB)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "3.00 MiB",
        "5.00 GiB",
    ]
