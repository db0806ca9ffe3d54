"""Alpha-beta cost model for collectives: predict communication time on real clusters.

Every transfer of ``m`` bytes over one link costs ``alpha + m / beta``: ``alpha``
is the per-message (per algorithm step) latency in seconds and ``beta`` the
link bandwidth in bytes/s *per direction*. The classic formulas (``N``
devices, ``B`` = bytes per participant) are

==============  ==============================  ==================================
op              ring (pipelined ring / chain)   tree (double binary tree/binomial)
==============  ==============================  ==================================
all_reduce      ``2(N-1)a + 2(N-1)/N * B/b``    ``2*ceil(log2 N)*a + 2*B/b``
reduce_scatter  ``(N-1)a + (N-1)/N * B/b``      (no tree variant: ring)
all_gather      ``(N-1)a + (N-1)*B/b``          ``ceil(log2 N)*a + (N-1)*B/b``
broadcast       ``(N-1)a + B/b``                ``ceil(log2 N)*a + B/b``
reduce_to       ``(N-1)a + B/b``                ``ceil(log2 N)*a + B/b``
gather          ``(N-1)a + (N-1)*B/b``          ``ceil(log2 N)*a + (N-1)*B/b``
==============  ==============================  ==================================

(``(N-1)*B/b`` is ``(N-1)/N`` of the ``N*B``-byte gathered result.)

Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1), 2005 (ring/recursive-doubling
all-gather, binomial gather, reduce-scatter + all-gather all-reduce); Patarasuk
& Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 69(2), 2009 (the ring's ``2(N-1)/N * B/b`` is optimal); Jeaugey,
"Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA developer
blog, 2019 (double binary trees: logarithmic latency at full bandwidth, which
gives the pipelined ``2*B/b`` tree all-reduce term).

Multi-host GPU topologies use the hierarchical all-reduce (intra-host
reduce-scatter, inter-host all-reduce of ``1/devices_per_host`` of the data,
intra-host all-gather); TPU slices use a multi-dimensional ring on the ICI
torus/mesh. See ``docs/concepts/cost-model.md`` for the derivations, the
parameter sources and the limits of the model.

``predict_trace``/``step_times``/``sizing_report`` take any objects with
attributes ``op``, ``nbytes``, ``step`` and ``participants`` (e.g.
``polydist.backend.tracing.CollectiveEvent``) without importing them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "ALGORITHMS",
    "OPS",
    "TOPOLOGIES",
    "Algorithm",
    "EventLike",
    "Link",
    "Topology",
    "get_topology",
    "predict",
    "predict_trace",
    "sizing_report",
    "step_times",
]

Algorithm = Literal["ring", "tree", "auto"]
ALGORITHMS: tuple[str, ...] = ("ring", "tree", "auto")

#: Ops the model knows. ``reduce`` (``Strategy.reduce``) is a reduce to one
#: device, like ``reduce_to``. ``merge_call`` moves no data itself (the
#: collectives issued inside it are recorded separately) and costs 0.
OPS: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce_to",
    "reduce",
    "gather",
    "merge_call",
)


class EventLike(Protocol):
    """What :func:`predict_trace` needs from an event (duck-typed)."""

    @property
    def op(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def participants(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class Link:
    """One class of link: ``alpha`` seconds per message, ``bandwidth`` bytes/s per direction."""

    alpha: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"Link.alpha must be a finite number >= 0, got {self.alpha!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"Link.bandwidth must be a finite number > 0, got {self.bandwidth!r}")


@dataclass(frozen=True)
class Topology:
    """A cluster shape for the cost model.

    * GPU-style (``torus_dims is None``): ``intra_host`` links devices inside a
      host (NVLink through NVSwitch: any pair at full per-GPU bandwidth);
      ``inter_host`` is the network between hosts, ``bandwidth`` being the
      host's *aggregate* NIC bandwidth, shared by its ``devices_per_host``
      devices. Required when there is more than one host.
    * TPU-style (``torus_dims`` set): ICI links chips directly, across host
      boundaries, so ``intra_host`` is one ICI link (per direction) and the host
      boundary is ignored; ``wraparound[i]`` says whether dimension ``i`` has
      wraparound links (a torus ring) or not (a mesh line).
    """

    name: str
    num_devices: int
    devices_per_host: int
    intra_host: Link
    inter_host: Link | None = None
    torus_dims: tuple[int, ...] | None = None
    wraparound: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.devices_per_host < 1:
            raise ValueError(f"{self.name}: num_devices and devices_per_host must be >= 1")
        if self.torus_dims is not None:
            if math.prod(self.torus_dims) != self.num_devices or min(self.torus_dims) < 1:
                raise ValueError(
                    f"{self.name}: torus_dims {self.torus_dims} do not multiply to "
                    f"num_devices={self.num_devices}"
                )
            if self.wraparound is None:
                object.__setattr__(self, "wraparound", (False,) * len(self.torus_dims))
            elif len(self.wraparound) != len(self.torus_dims):
                raise ValueError(f"{self.name}: wraparound must have one entry per torus dim")
        else:
            if self.wraparound is not None:
                raise ValueError(f"{self.name}: wraparound needs torus_dims")
            if self.num_devices % self.devices_per_host != 0:
                raise ValueError(
                    f"{self.name}: num_devices={self.num_devices} is not a multiple of "
                    f"devices_per_host={self.devices_per_host}"
                )
            if self.num_hosts > 1 and self.inter_host is None:
                raise ValueError(f"{self.name}: {self.num_hosts} hosts need an inter_host link")

    @property
    def num_hosts(self) -> int:
        return -(-self.num_devices // self.devices_per_host)


# --------------------------------------------------------------------------- named topologies
# Every number is cited in docs/concepts/cost-model.md ("Parameters"); summary here.

# NVLink 4 on H100 SXM: 18 links x 50 GB/s bidirectional = 900 GB/s per GPU, i.e.
# 450 GB/s per direction (NVIDIA H100 datasheet / Hopper architecture brief). In an
# HGX/DGX H100 every GPU reaches every other through NVSwitch at that rate.
_NVLINK4 = Link(
    # 3.4 us: NCCL's per-ring-step NVLink latency for the Simple protocol
    # (hwLat[NVLINK][RING][SIMPLE] in src/graph/tuning.cc, recent NCCL 2.x).
    alpha=3.4e-6,
    bandwidth=450e9,
)

# 100 Gb/s Ethernet = 12.5e9 bytes/s per host. Latency: NCCL's per-step network
# latency for rings with the Simple protocol (hwLat[NET][RING][SIMPLE] = 14 us).
_ETH_100G = Link(alpha=14e-6, bandwidth=12.5e9)

# TPU ICI latency per hop is not published; the JAX scaling book uses 0.5-1 us in
# worked examples. We use 1 us (the conservative end).
_ICI_ALPHA = 1e-6

TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        Topology(name="8xH100-NVLink", num_devices=8, devices_per_host=8, intra_host=_NVLINK4),
        Topology(
            name="2x8xH100-100Gbps",
            num_devices=16,
            devices_per_host=8,
            intra_host=_NVLINK4,
            inter_host=_ETH_100G,
        ),
        # v4-32 = 32 TensorCores = 16 chips (2 per chip), topology 2x2x4, 4 chips per
        # host (Cloud TPU v4 docs). ICI: 6 links/chip; 4.5e10 B/s one-way per link
        # (JAX scaling book, "How to think about TPUs"; secondary sources quote
        # 400 Gb/s = 5e10 B/s, we use the lower figure). Wraparound links on v4 come
        # from the optical switches of full 4x4x4 cubes only, so a 2x2x4 slice is a
        # 3D *mesh* (Cloud TPU v4 docs: torus needs dims that are multiples of 4).
        Topology(
            name="tpu-v4-32",
            num_devices=16,
            devices_per_host=4,
            intra_host=Link(alpha=_ICI_ALPHA, bandwidth=4.5e10),
            torus_dims=(2, 2, 4),
            wraparound=(False, False, False),
        ),
        # v5e: 4 ICI ports per chip, 1,600 Gbps per chip (= 400 GB/s bidirectional,
        # Cloud TPU v5e docs) -> 50 GB/s one-way per port; 8 chips per host, so 4x4
        # spans 2 hosts. v5e slices only wrap around on dims of 16, so 4x4 is a mesh.
        Topology(
            name="tpu-v5e-16",
            num_devices=16,
            devices_per_host=8,
            intra_host=Link(alpha=_ICI_ALPHA, bandwidth=5e10),
            torus_dims=(4, 4),
            wraparound=(False, False),
        ),
    )
}


def get_topology(name: str | Topology) -> Topology:
    """The named topology from :data:`TOPOLOGIES` (a :class:`Topology` passes through)."""
    if isinstance(name, Topology):
        return name
    try:
        return TOPOLOGIES[name]
    except KeyError:
        known = ", ".join(sorted(TOPOLOGIES))
        raise ValueError(f"unknown topology {name!r}; known topologies: {known}") from None


# --------------------------------------------------------------------------- flat formulas


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()  # ceil(log2 n) for n >= 1


def _flat(op: str, n: int, nbytes: float, alpha: float, beta: float, algorithm: str) -> float:
    """Time of ``op`` over ``n`` devices on identical links (a switch or a ring)."""
    if n <= 1:
        return 0.0
    tree = algorithm == "tree"
    steps_log = _log2_ceil(n)
    if op == "all_reduce":
        if tree:
            return 2 * steps_log * alpha + 2 * nbytes / beta
        return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
    if op == "reduce_scatter":
        return (n - 1) * alpha + (n - 1) / n * nbytes / beta
    if op in ("all_gather", "gather"):
        total = n * nbytes
        lat = steps_log if tree else n - 1
        return lat * alpha + (n - 1) / n * total / beta
    if op in ("broadcast", "reduce_to"):
        lat = steps_log if tree else n - 1
        return lat * alpha + nbytes / beta
    raise AssertionError(op)  # pragma: no cover - filtered by predict()


# --------------------------------------------------------------------------- hierarchical


def _hierarchical(
    op: str, hosts: int, local: int, nbytes: float, intra: Link, inter: Link, algorithm: str
) -> float:
    """Two-level (intra-host, inter-host) schedule; ``algorithm`` picks the inter-host one.

    The ``local`` devices of a host run their inter-host transfers concurrently
    and share the host's NIC, so each gets ``inter.bandwidth / local``.
    """
    a_i, b_i = intra.alpha, intra.bandwidth
    a_e, b_share = inter.alpha, inter.bandwidth / local
    if op == "all_reduce":
        shard = nbytes / local
        return (
            _flat("reduce_scatter", local, nbytes, a_i, b_i, "ring")
            + _flat("all_reduce", hosts, shard, a_e, b_share, algorithm)
            + _flat("all_gather", local, shard, a_i, b_i, "ring")
        )
    if op == "reduce_scatter":
        return _flat("reduce_scatter", local, nbytes, a_i, b_i, "ring") + _flat(
            "reduce_scatter", hosts, nbytes / local, a_e, b_share, "ring"
        )
    if op == "all_gather":
        # Inter-host first (each device gathers its peers on other hosts), then
        # intra-host with ``hosts * nbytes`` per device.
        return _flat("all_gather", hosts, nbytes, a_e, b_share, algorithm) + _flat(
            "all_gather", local, hosts * nbytes, a_i, b_i, "ring"
        )
    if op in ("broadcast", "reduce_to"):
        # Whole payload crosses the root host's NIC once; phases are summed.
        return _flat(op, hosts, nbytes, a_e, inter.bandwidth, algorithm) + _flat(
            op, local, nbytes, a_i, b_i, algorithm
        )
    if op == "gather":
        # Gather to a leader per host, then leaders send local * nbytes to the root.
        return _flat("gather", local, nbytes, a_i, b_i, algorithm) + _flat(
            "gather", hosts, local * nbytes, a_e, inter.bandwidth, algorithm
        )
    raise AssertionError(op)  # pragma: no cover


# --------------------------------------------------------------------------- torus / mesh


def _sub_shape(topology: Topology, n: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """The slice shape used by ``n`` of the topology's chips (dims filled in order)."""
    assert topology.torus_dims is not None
    assert topology.wraparound is not None
    if n == topology.num_devices:
        return topology.torus_dims, topology.wraparound
    dims: list[int] = []
    wraps: list[bool] = []
    remaining = n
    for d, w in zip(topology.torus_dims, topology.wraparound):
        take = min(d, remaining)
        dims.append(take)
        wraps.append(w and take == d)
        remaining = -(-remaining // take)
    return tuple(dims), tuple(wraps)


def _torus_ring(
    op: str, n: int, dims: Sequence[int], wraps: Sequence[bool], nbytes: float, link: Link
) -> float:
    """Multi-dimensional ring schedule on a torus/mesh of ICI links.

    Latency: one ring pass per dimension, ``sum(d_i - 1)`` steps (twice for
    all-reduce). Bandwidth: the data is split into one shard per dimension and
    the shards run dimension-ordered in rotated orders, so every outgoing link
    of a chip is busy: ``2`` link-directions per wrapped dimension (two
    counter-rotating rings), ``1`` per unwrapped one (a ring folded onto a line).
    """
    if n <= 1:
        return 0.0
    active = [(d, w) for d, w in zip(dims, wraps) if d > 1]
    hops = sum(d - 1 for d, _ in active)
    directions = sum(2 if (w and d > 2) else 1 for d, w in active)
    beta_eff = link.bandwidth * directions
    alpha = link.alpha
    if op == "all_reduce":
        return 2 * hops * alpha + 2 * (n - 1) / n * nbytes / beta_eff
    if op == "reduce_scatter":
        return hops * alpha + (n - 1) / n * nbytes / beta_eff
    if op in ("all_gather", "gather"):
        return hops * alpha + (n - 1) * nbytes / beta_eff
    if op in ("broadcast", "reduce_to"):
        # Pipelined dimension-ordered chain: one outgoing link at a time.
        return hops * alpha + nbytes / link.bandwidth
    raise AssertionError(op)  # pragma: no cover


# --------------------------------------------------------------------------- public API


def _algorithm_time(op: str, nbytes: float, topology: Topology, n: int, algorithm: str) -> float:
    if topology.torus_dims is not None:
        if algorithm == "tree":
            link = topology.intra_host
            return _flat(op, n, nbytes, link.alpha, link.bandwidth, "tree")
        dims, wraps = _sub_shape(topology, n)
        return _torus_ring(op, n, dims, wraps, nbytes, topology.intra_host)
    local = min(n, topology.devices_per_host)
    hosts = -(-n // local)
    if hosts == 1:
        link = topology.intra_host
        return _flat(op, n, nbytes, link.alpha, link.bandwidth, algorithm)
    assert topology.inter_host is not None
    return _hierarchical(
        op, hosts, local, nbytes, topology.intra_host, topology.inter_host, algorithm
    )


def predict(
    op: str,
    nbytes: int | float,
    topology: Topology | str,
    algorithm: Algorithm = "ring",
    num_devices: int | None = None,
) -> float:
    """Predicted seconds for one collective.

    ``nbytes`` is the payload per participant (as in ``CollectiveEvent``): the
    tensor each device contributes to an all-reduce/all-gather/reduce, or the
    tensor being broadcast. ``num_devices`` (default: all of the topology's)
    participants are packed onto as few hosts as possible. ``algorithm="auto"``
    takes the faster of ring and tree, like NCCL's tuner does.
    """
    topo = get_topology(topology)
    if op not in OPS:
        raise ValueError(f"unknown collective op {op!r}; known ops: {', '.join(OPS)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    n = topo.num_devices if num_devices is None else num_devices
    if not 1 <= n <= topo.num_devices:
        raise ValueError(
            f"num_devices={n} is outside 1..{topo.num_devices} for topology {topo.name!r}"
        )
    if op == "merge_call" or n == 1:
        return 0.0
    canonical = "reduce_to" if op == "reduce" else op
    if algorithm == "auto":
        return min(_algorithm_time(canonical, float(nbytes), topo, n, a) for a in ("ring", "tree"))
    return _algorithm_time(canonical, float(nbytes), topo, n, algorithm)


def _scaled_devices(count: int, max_count: int, topology: Topology) -> int:
    """Device count on ``topology`` for an event with ``count`` of ``max_count`` trace devices."""
    if count >= max_count:
        return topology.num_devices
    if count <= 1:
        return 1
    return max(2, min(topology.num_devices, round(count / max_count * topology.num_devices)))


def predict_trace(
    trace_events: Iterable[EventLike], topology: Topology | str, algorithm: Algorithm = "auto"
) -> list[float]:
    """Predicted seconds for each event, re-played on ``topology``.

    A trace recorded on ``M`` (simulated) replicas is scaled to the topology's
    device count with bytes per participant held fixed: events involving all
    ``M`` replicas use all devices of the topology, events on a single replica
    cost nothing (unless the whole trace has one replica), and sub-groups are
    scaled proportionally.
    """
    topo = get_topology(topology)
    events = list(trace_events)
    max_count = max((len(e.participants) for e in events), default=1)
    return [
        predict(
            e.op,
            e.nbytes,
            topo,
            algorithm,
            num_devices=_scaled_devices(len(e.participants), max_count, topo),
        )
        for e in events
    ]


def step_times(
    events: Iterable[EventLike], topology: Topology | str, algorithm: Algorithm = "auto"
) -> dict[int, float]:
    """Predicted communication seconds per step (collectives serialised, no overlap)."""
    events = list(events)
    totals: dict[int, float] = {}
    for e, t in zip(events, predict_trace(events, topology, algorithm)):
        totals[e.step] = totals.get(e.step, 0.0) + t
    return dict(sorted(totals.items()))


def _format_seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.2f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def _format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"


def sizing_report(
    events: Iterable[EventLike],
    topologies: Iterable[Topology | str] | Mapping[str, Topology] | None = None,
    algorithm: Algorithm = "auto",
) -> str:
    """A table of predicted communication time per step on each topology.

    Rows are steps (then ``total`` and ``mean/step``); columns are topologies
    (default: every entry of :data:`TOPOLOGIES`). Use it to size a cluster from
    a laptop run of the simulator.
    """
    events = list(events)
    if topologies is None:
        topos = list(TOPOLOGIES.values())
    elif isinstance(topologies, Mapping):
        topos = list(topologies.values())
    else:
        topos = [get_topology(t) for t in topologies]
    title = f"Predicted communication time per step (alpha-beta model, algorithm={algorithm})"
    note = "Bytes per participant are held fixed; each topology uses all of its devices."
    if not events:
        return "\n".join([title, note, "(no collectives recorded)"])

    per_topo = [step_times(events, t, algorithm) for t in topos]
    steps = sorted({e.step for e in events})
    count = {s: 0 for s in steps}
    nbytes = {s: 0 for s in steps}
    for e in events:
        count[e.step] += 1
        nbytes[e.step] += e.nbytes

    header = ["step", "collectives", "bytes/device", *(t.name for t in topos)]
    sub = ["", "", "", *(f"{t.num_devices} devices" for t in topos)]
    rows: list[list[str]] = [
        [
            str(s),
            str(count[s]),
            _format_bytes(nbytes[s]),
            *(_format_seconds(p[s]) for p in per_topo),
        ]
        for s in steps
    ]
    totals = [sum(p.values()) for p in per_topo]
    total_count = len(events)
    total_bytes = sum(nbytes.values())
    rows.append(
        ["total", str(total_count), _format_bytes(total_bytes), *map(_format_seconds, totals)]
    )
    rows.append(
        [
            "mean/step",
            f"{total_count / len(steps):.1f}",
            _format_bytes(round(total_bytes / len(steps))),
            *(_format_seconds(t / len(steps)) for t in totals),
        ]
    )
    widths = [max(len(r[i]) for r in [header, sub, *rows]) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    lines = [title, note, "", fmt(header), fmt(sub), fmt(["-" * w for w in widths])]
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)
