"""The ``polydist`` command: doctor, demo, conformance, bench, launch, checkpoint.

Each subcommand is one ``_add_<name>(subparsers)`` function that builds its
parser and sets ``handler`` (``(args) -> exit code``); adding a command (e.g.
issue 9's ``launch``) is one more such function in :data:`_COMMANDS`. A
command that forwards arguments to another tool sets ``passthrough=True`` and
gets everything after ``--`` in ``args.passthrough_args``.

Exit codes: 0 success; 1 the work ran and failed (a demo that disagrees, a
failing benchmark script, a backend that does not load); 2 bad usage or
something missing (argparse errors, unknown backend, package not installed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from polydist._tools.bench import BenchRow as BenchRow
from polydist._tools.bench import (
    _add_bench,
)
from polydist._tools.bench import bench_rows as bench_rows
from polydist._tools.bench import find_benchmarks_dir as find_benchmarks_dir
from polydist._tools.common import (
    _table,
    _UsageError,
)

__all__ = ["BenchRow", "bench_rows", "find_benchmarks_dir", "main"]

#: Topology the demo's trace is priced on when ``--topology`` is not given.
DEFAULT_TOPOLOGY = "8xH100-NVLink"
#: How many device names ``doctor`` prints per backend before it abbreviates.
_MAX_DEVICES_SHOWN = 4


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- doctor


def _add_doctor(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="show installed backends, their devices, and what is missing",
        description="Installed backends with versions and devices, what is missing and how "
        "to install it, and the Python/NumPy versions. Exits 1 if an installed backend "
        "fails to load.",
    )
    p.set_defaults(handler=_cmd_doctor, parser=p)


def _requirement_versions(dist: importlib.metadata.Distribution | None) -> list[str]:
    """Installed versions of a backend's own dependencies (jax, torch), not polydist's."""
    if dist is None:
        return []
    found = []
    for req in dist.requires or ():
        if "extra ==" in req:
            continue
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]
        if not name or name.startswith("polydist") or name in ("numpy", "optree", "greenlet"):
            continue
        version = _dist_version(name)
        found.append(f"{name} {version}" if version else f"{name} (not installed)")
    return found


def _device_line(label: str, devices: Sequence[str]) -> str:
    shown = ", ".join(devices[:_MAX_DEVICES_SHOWN])
    more = len(devices) - _MAX_DEVICES_SHOWN
    if more > 0:
        shown += f", ... ({more} more)"
    return f"{label} ({len(devices)}): {shown}"


def _cmd_doctor(args: argparse.Namespace) -> int:
    import numpy as np

    from polydist import __version__
    from polydist.backend._contract import (
        DEFAULT_BACKEND,
        ENV_VAR,
        KNOWN_PACKAGES,
        SupportsSimulatedDevices,
        _discover,
        features,
        get_backend,
        install_hint,
    )

    env_backend = os.environ.get(ENV_VAR)
    default = env_backend or DEFAULT_BACKEND
    print(f"polydist {__version__}")
    print(f"  python    {platform.python_version()} ({sys.executable})")
    print(f"  numpy     {np.__version__}")
    print(f"  platform  {platform.platform()}")
    source = f"${ENV_VAR}" if env_backend else f"${ENV_VAR} is not set"
    print(f"  default backend: {default} ({source})")

    entry_points = _discover()
    failed = 0
    print("\nInstalled backends:")
    if not entry_points:
        print("  none")
    for name in sorted(entry_points):
        ep = entry_points[name]
        dist = ep.dist
        label = f"{dist.name} {dist.version}" if dist is not None else ep.value
        builtin = dist is not None and dist.name == "polydist"  # the sim ships with core
        deps = [] if builtin else _requirement_versions(dist)
        if builtin:
            label += " (built in)"
        if deps:
            label += f" ({', '.join(deps)})"
        loaded = False
        try:
            ep.load()
            loaded = True
            backend = get_backend(name)
            devices = backend.list_devices()
            default_devices = backend.replica_devices(None)
        except Exception as e:  # a broken backend is reported, never fatal
            if loaded and isinstance(e, ModuleNotFoundError):
                # The backend's package loads but its factory lacks an optional dependency
                # (torch_xla without torch-xla): not usable here, which is not a failure.
                print(f"  {name:<6} {label}")
                print(f"         not usable: {str(e).splitlines()[0] if str(e) else e.name}")
                continue
            failed += 1
            reason = str(e).splitlines()[0] if str(e) else ""
            print(f"  {name:<6} {label}")
            print(f"         FAILED to load: {type(e).__name__}: {reason}")
            continue
        caps = backend.capabilities
        flags = [
            f
            for f in ("autodiff", "multi_worker", "tpu", "float64", "dynamic_shapes")
            if caps.has(f)
        ]
        print(f"  {name:<6} {label}  ok")
        print(f"         {_device_line('devices', devices)}")
        print(f"         {_device_line('MirroredStrategy() uses', default_devices)}")
        if features(backend).simulated_devices:
            # The sim's GPUs are virtual: any /gpu:K that a program names exists.
            limit = cast(SupportsSimulatedDevices, backend).max_simulated_devices
            if limit:
                print(
                    f"         simulates up to {limit} GPUs: MirroredStrategy(8) uses "
                    "/gpu:0 ... /gpu:7 ($POLYDIST_SIM_GPUS sets what MirroredStrategy() uses)"
                )
        print(f"         {caps.execution_model}; {', '.join(flags) or 'no optional capabilities'}")

    missing = [n for n in KNOWN_PACKAGES if n not in entry_points]
    if missing:
        print("\nNot installed:")
        for name in missing:
            print(f"  {name:<6} {install_hint(name)}")
    if default not in entry_points:
        print(f"\nThe default backend {default!r} is not installed: {install_hint(default)}")

    print("\nTools:")
    conformance = _dist_version("polydist-conformance")
    print(
        f"  polydist-conformance {conformance} (polydist conformance BACKEND)"
        if conformance
        else "  polydist-conformance not installed: pip install polydist-conformance "
        "(from a checkout: pip install ./conformance)"
    )
    sim_version = _dist_version("polydist-sim")
    print(
        f"  polydist-sim {sim_version} (the sim's cost model: polydist demo --trace)"
        if sim_version
        else "  polydist-sim not installed (the sim's cost model, for polydist demo --trace): "
        "pip install polydist-sim (from a checkout: pip install ./packages/sim)"
    )
    tqdm_version = _dist_version("tqdm")
    print(f"  tqdm {tqdm_version or 'not installed'} (progress bars)")
    return 1 if failed or not entry_points else 0


# --------------------------------------------------------------------------- demo


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train data-parallel and compare with single-device training",
        description="Linear regression trained data-parallel on N replicas, compared at the "
        "end with the same training on one device. Exits 1 if they disagree.",
    )
    p.add_argument(
        "--backend",
        metavar="B",
        default=None,
        help="backend name (default: $POLYDIST_BACKEND or sim)",
    )
    p.add_argument(
        "--replicas",
        metavar="N",
        type=_positive_int,
        default=8,
        help="number of replicas (default 8)",
    )
    p.add_argument(
        "--steps", metavar="S", type=_positive_int, default=20, help="SGD steps (default 20)"
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        default=None,
        help="write the run's collectives as a Chrome trace (open in ui.perfetto.dev) and "
        "print a per-step summary; on the sim, also a cost-model sizing report",
    )
    p.add_argument(
        "--topology",
        metavar="NAME",
        default=None,
        help=f"sim: price the traced collectives on this cluster (default {DEFAULT_TOPOLOGY}; "
        "see polydist_sim.cost_model.TOPOLOGIES); needs --trace",
    )
    p.set_defaults(handler=_cmd_demo, parser=p)


def _cmd_demo(args: argparse.Namespace) -> int:
    from polydist._collectives import trace as _trace
    from polydist._tools.demo import run_demo
    from polydist.backend._contract import features, get_backend

    if args.topology is not None and args.trace is None:
        args.parser.error("--topology needs --trace FILE")
    _host_devices_for_jax(args.backend, args.replicas)
    try:
        backend = get_backend(args.backend)
    except ValueError as e:  # unknown backend name: BackendNotFoundError
        raise _UsageError(str(e)) from e
    except Exception as e:
        print(
            f"polydist demo: error: backend {args.backend!r} failed to load: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1
    # Simulated devices: collective times come from the cost model, not a clock.
    is_sim = features(backend).simulated_devices
    if args.topology is not None and not is_sim:
        raise _UsageError("--topology prices simulated traces: use it with --backend sim")
    # The cost model is polydist-sim's: without it (core alone) a sim trace is recorded
    # unpriced, unless --topology asks for prices (then trace() says what to install).
    priced = is_sim and (args.topology is not None or _has_cost_model())
    topology = (args.topology or DEFAULT_TOPOLOGY) if priced and args.trace else None
    recording: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if args.trace is not None:
        try:
            recording = _trace.trace(topology=topology)
        except (ValueError, ImportError) as e:
            raise _UsageError(str(e)) from e
    try:
        with recording as t:
            ok = run_demo(replicas=args.replicas, steps=args.steps, backend=args.backend)
    except ValueError as e:  # e.g. more replicas than the backend has devices
        raise _UsageError(str(e)) from e
    if t is not None:
        _report_trace(t, args.trace, priced)
        if is_sim and not priced:
            print(
                "\n(no predicted times: the sim's cost model is in polydist-sim; pip install "
                "polydist-sim, or from a checkout pip install ./packages/sim)"
            )
    return 0 if ok else 1


XLA_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _host_devices_for_jax(backend: str | None, replicas: int) -> None:
    """Gives JAX's CPU platform ``replicas`` devices, as ``XLA_FLAGS`` would.

    JAX reads ``XLA_FLAGS`` once, when it starts, and by default its CPU
    platform has one device; this command is its own process, so it can set
    the flag before JAX starts. It appends ``--xla_force_host_platform_device_count=N``
    unless the flag is already there (the user's setting wins), JAX is already
    imported, or ``$JAX_PLATFORMS`` leaves out the CPU. The flag only sizes the
    CPU platform: on GPUs and TPUs it changes nothing.
    """
    from polydist.backend._contract import DEFAULT_BACKEND, ENV_VAR

    name = backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    if name != "jax" or replicas < 2 or "jax" in sys.modules:
        return
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.lower().split(","):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if XLA_DEVICE_COUNT_FLAG in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} {XLA_DEVICE_COUNT_FLAG}={replicas}".strip()


def _has_cost_model() -> bool:
    return importlib.util.find_spec("polydist_sim") is not None


def _report_trace(t: Any, path: str, is_sim: bool) -> None:
    try:
        t.save_chrome_trace(path)
    except OSError as e:
        raise _UsageError(f"cannot write the trace to {path!r}: {e}") from e
    print(f"\n{t.summary()}")
    print(f"\nChrome trace written to {path} (open it in https://ui.perfetto.dev)")
    if is_sim:
        from polydist_sim import cost_model

        if t.topology:
            print(f"(the 'predicted' column and the trace's durations are for {t.topology})")
        print(f"\n{cost_model.sizing_report(t.events)}")


# --------------------------------------------------------------------------- conformance

_CONFORMANCE_HINT = (
    "the conformance suite is not installed. Install it: pip install polydist-conformance "
    "(from a polydist checkout: pip install ./conformance)"
)


def _add_conformance(sub: Any) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite against a backend",
        description="Runs the polydist-conformance suite on BACKEND (every case is checked "
        "against the sim) and prints a summary table. Arguments after -- go to pytest, e.g. "
        "polydist conformance jax -- -x --polydist-replicas=8. Exits with pytest's code.",
    )
    p.add_argument("backend", metavar="BACKEND", help="installed backend name (e.g. sim, jax)")
    p.set_defaults(handler=_cmd_conformance, parser=p, passthrough=True)


def _cmd_conformance(args: argparse.Namespace) -> int:
    try:
        # By name: the suite is an optional package the core must not depend on.
        conformance = importlib.import_module("polydist_conformance")
    except ImportError:
        raise _UsageError(_CONFORMANCE_HINT) from None
    from polydist.backend._contract import available_backends, install_hint

    name: str = args.backend
    installed = available_backends()
    if name not in installed and not name.startswith("mutant:"):
        raise _UsageError(
            f"no backend named {name!r}; installed: {', '.join(installed) or 'none'}. "
            f"To use it, {install_hint(name)}"
        )
    extra: list[str] = list(args.passthrough_args)
    own_junit = not any(a.startswith(("--junitxml", "--junit-xml")) for a in extra)
    with tempfile.TemporaryDirectory(prefix="polydist-conformance-") as tmp:
        junit = Path(tmp) / "results.xml"
        # The suite is imported before pytest starts (by the import above), which
        # pytest reports as a warning; a project's filterwarnings=error must not
        # turn that into a crash.
        pytest_args = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
        if own_junit:
            pytest_args.append(f"--junitxml={junit}")
        code = int(conformance.main(name, [*pytest_args, *extra]))
        print()
        if own_junit and junit.exists():
            print("\n".join(_conformance_summary(junit, name)))
        elif own_junit:
            print(f"polydist conformance: no results recorded (pytest exit code {code})")
    verdict = "passed" if code == 0 else f"FAILED (pytest exit code {code})"
    print(f"conformance of backend {name!r}: {verdict}")
    return code


def _conformance_summary(junit: Path, backend: str) -> list[str]:
    """A per-module table of outcomes, the reasons cases were skipped, and the failures."""
    root = ET.parse(junit).getroot()
    columns = ("passed", "failed", "skipped", "xfailed")
    groups: dict[str, dict[str, int]] = {}
    skip_reasons: dict[str, int] = {}
    failures: list[str] = []
    for case in root.iter("testcase"):
        group = case.get("classname", "").rsplit(".", 1)[-1].removeprefix("test_") or "?"
        counts = groups.setdefault(group, dict.fromkeys(columns, 0))
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failures.append(f"{case.get('classname')}::{case.get('name')}")
            continue
        skipped = case.find("skipped")
        if skipped is None:
            counts["passed"] += 1
        elif skipped.get("type") == "pytest.xfail":
            counts["xfailed"] += 1
        else:
            counts["skipped"] += 1
            reason = (skipped.get("message") or "").removeprefix("Skipped: ")
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
    rows = [[g, *(str(c[k]) for k in columns)] for g, c in sorted(groups.items())]
    totals = [str(sum(c[k] for c in groups.values())) for k in columns]
    lines = [f"Conformance of backend {backend!r} against the sim:"]
    lines += _table(["cases", *columns], [*rows, ["total", *totals]], right={1, 2, 3, 4})
    if skip_reasons:
        lines.append("\nSkipped:")
        lines += [f"  {n:4d}  {r}" for r, n in sorted(skip_reasons.items(), key=lambda x: -x[1])]
    if failures:
        lines.append("\nFailed:")
        lines += [f"  {f}" for f in failures[:20]]
        if len(failures) > 20:
            lines.append(f"  ... and {len(failures) - 20} more")
    return lines


# --------------------------------------------------------------------------- bench
# --------------------------------------------------------------------------- launch


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _add_launch(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script as N local worker processes of a cluster",
        description="Starts N processes of 'python SCRIPT ARGS...' on 127.0.0.1, each with "
        "TF_CONFIG (its worker index), torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/"
        "MASTER_PORT and JAX_COORDINATOR_ADDRESS/POLYDIST_NUM_PROCESSES/POLYDIST_PROCESS_ID. "
        "Output lines are prefixed with [worker i]. If a worker fails or the timeout expires, "
        "every worker is stopped (SIGTERM, then SIGKILL after --grace) and the exit code is "
        "the failed worker's (124 on timeout).",
    )
    p.add_argument(
        "-n", "--num-workers", type=_positive_int, required=True, metavar="N", help="workers"
    )
    p.add_argument("--backend", help="set POLYDIST_BACKEND for the workers (sim, torch, jax)")
    p.add_argument(
        "--port",
        type=_positive_int,
        metavar="P",
        help="worker i listens on port P+i (default: free ports); worker 0's is the rendezvous",
    )
    p.add_argument(
        "--timeout",
        type=_nonnegative_float,
        metavar="S",
        help="stop every worker after S seconds (default, or 0: no limit)",
    )
    p.add_argument(
        "--gpus-per-worker",
        type=_positive_int,
        metavar="G",
        help="give worker i its own GPUs i*G..i*G+G-1 through CUDA_VISIBLE_DEVICES (of the "
        "launcher's list if set): workers on one machine must not share a GPU",
    )
    p.add_argument(
        "--grace",
        type=_nonnegative_float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)",
    )
    p.add_argument("script", nargs="?", metavar="SCRIPT", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(handler=_cmd_launch, parser=p, passthrough=True)


def _cmd_launch(args: argparse.Namespace) -> int:
    from polydist._distributed import launch as _launch

    if args.timeout == 0:
        args.timeout = None
    try:
        return _launch.main(args)
    except (ValueError, FileNotFoundError) as e:
        raise _UsageError(str(e)) from None


# --------------------------------------------------------------------------- main


def _add_checkpoint(sub: Any) -> None:
    from polydist.checkpoint._cli import add_parser  # its commands live with the checkpoints

    add_parser(sub)


_COMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_doctor,
    _add_demo,
    _add_conformance,
    _add_bench,
    _add_launch,
    _add_checkpoint,
)


def _parser() -> argparse.ArgumentParser:
    from polydist import __version__

    parser = argparse.ArgumentParser(
        prog="polydist",
        description="tf.distribute's Strategy API on JAX, PyTorch and a simulator.",
        epilog="Run 'polydist COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"polydist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


@contextlib.contextmanager
def _no_broken_pipe() -> Iterator[None]:
    # `polydist doctor | head` closes stdout early: that is not an error.
    try:
        yield
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``polydist`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" belongs to the tool a command forwards to.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    forwards = getattr(args, "passthrough", False)
    command_parser: argparse.ArgumentParser = args.parser  # its usage line, in errors
    if unknown:
        hint = " (arguments to forward go after '--')" if forwards else ""
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if passthrough and not forwards:
        command_parser.error("takes no arguments after '--'")
    args.passthrough_args = passthrough
    with _no_broken_pipe():
        try:
            return int(args.handler(args))
        except _UsageError as e:
            print(f"polydist {args.command}: error: {e}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
