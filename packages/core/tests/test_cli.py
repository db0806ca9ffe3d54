"""The ``polydist`` command: every subcommand through ``main(argv)``."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polydist._tools import bench as bench_module
from polydist._tools.cli import bench_rows, find_benchmarks_dir, main
from polydist.backend import _contract as _backend

SIM_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    _backend._reset_registry_for_tests()
    yield
    _backend._reset_registry_for_tests()


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    assert isinstance(code, int)
    return code


# --------------------------------------------------------------------------- usage


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["launchh"], "invalid choice: 'launchh'"),
        (["demo", "--steps", "x"], "expected a positive integer, got 'x'"),
        (["demo", "--replicas", "-3"], "expected a positive integer, got -3"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["doctor", "--", "-x"], "takes no arguments after '--'"),
        (["conformance"], "the following arguments are required: BACKEND"),
        (["conformance", "sim", "-x"], "arguments to forward go after '--'"),
        (["demo", "--topology", "8xH100-NVLink"], "--topology needs --trace FILE"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: polydist" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.startswith("polydist 0.")


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("doctor", "demo", "conformance", "bench"):
        assert command in out


# --------------------------------------------------------------------------- doctor


def test_doctor_lists_sim_and_its_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("polydist 0.")
    assert f"python    {sys.version_info.major}.{sys.version_info.minor}" in out
    assert f"numpy     {importlib.metadata.version('numpy')}" in out
    # The sim ships with core: its entry point is core's own.
    assert f"sim    polydist {importlib.metadata.version('polydist')} (built in)  ok" in out
    assert f"devices (1): {SIM_CPU}" in out
    assert "simulates up to 1024 GPUs" in out
    for name, package in _backend.KNOWN_PACKAGES.items():
        if name not in _backend.available_backends():
            assert f"pip install {package}" in out


def test_doctor_reports_a_backend_that_fails_to_load(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry_points = dict(_backend._discover())
    entry_points["broken"] = importlib.metadata.EntryPoint(
        name="broken", value="polydist_no_such_module:Backend", group=_backend.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(_backend, "_entry_points", entry_points)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAILED to load: ModuleNotFoundError: No module named 'polydist_no_such_module'" in out
    assert "sim    polydist " in out  # the healthy backend is still reported


def test_doctor_lists_a_backend_without_its_optional_dependency_as_not_usable(
    fresh_registry: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The backend's package loads; its factory needs something that is not installed.
    module = types.ModuleType("polydist_fake_optional")

    def factory() -> Any:
        raise ModuleNotFoundError("needs fakelib: pip install 'fake[extra]'", name="fakelib")

    module.Backend = factory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "polydist_fake_optional", module)
    entry_points = dict(_backend._discover())
    entry_points["optional"] = importlib.metadata.EntryPoint(
        name="optional", value="polydist_fake_optional:Backend", group=_backend.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(_backend, "_entry_points", entry_points)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "not usable: needs fakelib: pip install 'fake[extra]'" in out
    assert "FAILED" not in out


def test_doctor_says_how_to_install_a_missing_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(_backend.ENV_VAR, "torch")
    if "torch" in _backend.available_backends():
        pytest.skip("torch is installed here")
    main(["doctor"])
    out = capsys.readouterr().out
    assert "default backend: torch ($POLYDIST_BACKEND)" in out
    assert "The default backend 'torch' is not installed: pip install polydist-torch" in out


# --------------------------------------------------------------------------- demo


def test_demo_prints_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--replicas", "3", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "data-parallel on 3 replicas (backend: sim, reduction: exact)" in out
    assert "step   4/4" in out  # not a terminal: one line per step
    assert "Single-device training on the full batch of 96 examples" in out
    assert out.rstrip().endswith("equals single-device training.")


def test_demo_progress_bar() -> None:
    pytest.importorskip("tqdm")
    from polydist._tools.demo import run_demo

    out = io.StringIO()
    assert run_demo(replicas=2, steps=10, out=out, progress=True)
    text = out.getvalue()
    assert "training: 100%" in text
    assert "10/10" in text
    assert "step   1/10  loss" in text  # the loss is still logged above the bar
    assert "step   3/10" not in text  # ...but only at a few steps


def test_demo_without_tqdm_falls_back_to_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from polydist._tools.demo import run_demo

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    out = io.StringIO()
    assert run_demo(replicas=2, steps=2, out=out, progress=True)
    assert "step   2/2  loss" in out.getvalue()
    assert "[####################]" in out.getvalue()


def test_demo_with_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.json"
    assert main(["demo", "--replicas", "2", "--steps", "3", "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "polydist trace: 9 collectives in 3 steps" in out
    assert "demo.py:" in out and "in replica_step" in out
    assert f"Chrome trace written to {path}" in out
    assert "'predicted' column and the trace's durations are for 8xH100-NVLink" in out
    assert "Predicted communication time per step" in out
    doc = json.loads(path.read_text(encoding="utf-8"))
    timings = {e["args"]["timing"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert timings == {"predicted"}


def test_demo_trace_with_another_topology(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.json"
    argv = ["demo", "--replicas", "2", "--steps", "1", "--trace", str(path)]
    assert main([*argv, "--topology", "tpu-v5e-16"]) == 0
    assert "durations are for tpu-v5e-16" in capsys.readouterr().out
    assert main([*argv, "--topology", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polydist demo: error: unknown topology 'nope'; known topologies:")


def test_demo_runtime_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polydist demo: error: No polydist backend named 'nope'")
    assert main(["demo", "--replicas", "2000"]) == 2
    assert "at most 1024" in capsys.readouterr().err


# --------------------------------------------------------------------------- conformance


def test_conformance_without_the_package_gives_the_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "polydist_conformance", None)
    assert main(["conformance", "sim"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polydist conformance: error: the conformance suite is not installed")
    assert "pip install polydist-conformance" in err
    assert "pip install ./conformance" in err


_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="cases.test_run" name="test_a" />
<testcase classname="cases.test_run" name="test_b"><failure message="boom" /></testcase>
<testcase classname="cases.test_gather" name="test_c" />
<testcase classname="cases.test_gather" name="test_d">
  <skipped type="pytest.skip" message="backend lacks capability uneven_gather" /></testcase>
<testcase classname="cases.test_gather" name="test_e">
  <skipped type="pytest.xfail" message="listed in xfails" /></testcase>
<testcase classname="cases.test_gather" name="test_f">
  <skipped type="pytest.skip" message="backend lacks capability uneven_gather" /></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def fake_conformance(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """A stand-in ``polydist_conformance`` whose ``main`` writes a fixed JUnit file."""
    calls: list[tuple[str, list[str]]] = []

    def fake_main(backend: str, extra_pytest_args: list[str]) -> int:
        calls.append((backend, list(extra_pytest_args)))
        for arg in extra_pytest_args:
            if arg.startswith("--junitxml="):
                Path(arg.split("=", 1)[1]).write_text(_JUNIT, encoding="utf-8")
        return 1

    module = types.ModuleType("polydist_conformance")
    module.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "polydist_conformance", module)
    return calls


def test_conformance_prints_a_summary_table(
    fake_conformance: list[tuple[str, list[str]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["conformance", "sim", "--", "-x", "-k", "gather"]) == 1
    [(backend, args)] = fake_conformance
    assert backend == "sim"
    assert args[-3:] == ["-x", "-k", "gather"]  # the user's arguments come last
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("cases"))
    assert lines[header].split() == ["cases", "passed", "failed", "skipped", "xfailed"]
    assert lines[header + 2].split() == ["gather", "1", "0", "2", "1"]
    assert lines[header + 3].split() == ["run", "1", "1", "0", "0"]
    assert lines[header + 4].split() == ["total", "2", "1", "2", "1"]
    assert "     2  backend lacks capability uneven_gather" in out
    assert "  cases.test_run::test_b" in out
    assert out.rstrip().endswith("conformance of backend 'sim': FAILED (pytest exit code 1)")


def test_conformance_unknown_backend(
    fake_conformance: list[tuple[str, list[str]]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["conformance", "nope"]) == 2
    assert "no backend named 'nope'; installed: " in capsys.readouterr().err
    assert fake_conformance == []


# --------------------------------------------------------------------------- bench

SIM_RESULTS: dict[str, Any] = {
    "benchmark": "sim vs NumPy",
    "device": "CPU (NumPy simulator)",
    "machine": {"processor": "x86_64", "cpu_count": 2, "platform": "Linux", "python": "3.11"},
    "rows": [
        {"workload": "linear", "replicas": 1, "ratio_sequential": 3.5, "plain_numpy_s": 1e-4},
        {"workload": "linear", "replicas": 8, "ratio_sequential": 2.5, "plain_numpy_s": 1e-3},
        {"workload": "mlp", "replicas": 8, "ratio_sequential": 3.25, "plain_numpy_s": 1e-2},
    ],
    "target": "ratio_sequential <= 3.0 at 8 replicas; ratio growth about 1 (linear)",
    "date": "2026-11-20",
}
EXPLICIT_RESULTS: dict[str, Any] = {
    "device": "NVIDIA H100",
    "ratios": [
        {"case": "mlp step", "ratio": 1.02, "target": "<= 1.05", "met": True, "date": "2026-11-21"}
    ],
}


def _results_dir(root: Path) -> Path:
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "sim.json").write_text(json.dumps(SIM_RESULTS), encoding="utf-8")
    (results / "jax-cuda.json").write_text(json.dumps(EXPLICIT_RESULTS), encoding="utf-8")
    return results


def test_bench_prints_the_ratio_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _results_dir(tmp_path)
    assert main(["bench", "--no-run", "--dir", str(tmp_path / "benchmarks")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("benchmark"))
    assert lines[header].split() == [
        "benchmark",
        "case",
        "device",
        "ratio",
        "target",
        "met",
        "date",
    ]
    rows = [line.split("  ") for line in lines[header + 2 :]]
    cells = [[c.strip() for c in row if c.strip()] for row in rows]
    assert cells == [
        ["jax-cuda", "mlp step", "NVIDIA H100", "1.02", "<= 1.05", "yes", "2026-11-21"],
        [
            "sim",
            "linear, 1 replica (sequential)",
            "CPU (NumPy simulator)",
            "3.50",
            "-",
            "-",
            "2026-11-20",
        ],
        [
            "sim",
            "linear, 8 replicas (sequential)",
            "CPU (NumPy simulator)",
            "2.50",
            "<= 3.0",
            "yes",
            "2026-11-20",
        ],
        [
            "sim",
            "mlp, 8 replicas (sequential)",
            "CPU (NumPy simulator)",
            "3.25",
            "<= 3.0",
            "NO",
            "2026-11-20",
        ],
    ]


def test_bench_rows_name_the_machine(tmp_path: Path) -> None:
    rows = bench_rows(_results_dir(tmp_path), only="sim")
    assert {r.machine for r in rows} == {"x86_64, 2 CPUs, Linux"}
    assert [r.met for r in rows] == [None, True, False]


def test_bench_targets_other_ratio_names_and_conditions(tmp_path: Path) -> None:
    payload = {
        "device": "CPU",
        "replicas": 8,  # file-wide, for "at 8 replicas"
        "rows": [{"features": 256, "throughput_ratio_copy": 0.95, "throughput_ratio_views": 0.1}],
        "target": "throughput_ratio_copy >= 0.9 at 8 replicas for batches of >= 1 MiB",
    }
    (tmp_path / "input.json").write_text(json.dumps(payload), encoding="utf-8")
    copy, views = bench_rows(tmp_path)
    assert (copy.case, copy.ratio) == ("features=256 (throughput_ratio_copy)", 0.95)
    # The unchecked condition is shown, and no verdict is claimed.
    assert (copy.target, copy.met) == (">= 0.9 for batches of >= 1 MiB", None)
    assert (views.target, views.met) == ("", None)
    payload["target"] = "throughput_ratio_copy >= 0.9 at 8 replicas"
    (tmp_path / "input.json").write_text(json.dumps(payload), encoding="utf-8")
    assert bench_rows(tmp_path)[0].met is True


def test_bench_runs_the_scripts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "bench_fake.py").write_text(
        textwrap.dedent(
            """
            import json, pathlib
            out = pathlib.Path(__file__).parent / "results"
            out.mkdir(exist_ok=True)
            rows = [{"replicas": 2, "ratio": 1.5}]
            payload = {"device": "cpu", "rows": rows, "target": "ratio <= 2 at 2 replicas"}
            (out / "fake.json").write_text(json.dumps(payload))
            print("fake benchmark ran")
            """
        ),
        encoding="utf-8",
    )
    (bench / "bench_broken.py").write_text("raise SystemExit(3)\n", encoding="utf-8")
    assert main(["bench", "--dir", str(bench), "--only", "fake"]) == 0
    out = capsys.readouterr().out
    assert "== running benchmarks/bench_fake.py" in out
    assert "bench_broken" not in out
    assert any(line.split() == ["fake", "2", "replicas", "cpu", "1.50", "<=", "2", "yes", "-"]
               for line in out.splitlines())  # fmt: skip
    assert main(["bench", "--dir", str(bench)]) == 1
    out = capsys.readouterr().out
    assert "== bench_broken.py failed (exit code 3)" in out
    assert out.rstrip().endswith("failed: bench_broken.py")


def test_bench_skips_scripts_of_backends_that_are_not_installed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = [n for n in ("jax", "torch") if n not in _backend.available_backends()]
    if not missing:
        pytest.skip("jax and torch are both installed")
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / f"bench_{missing[0]}.py").write_text("raise SystemExit(1)\n", encoding="utf-8")
    assert main(["bench", "--dir", str(bench)]) == 0
    out = capsys.readouterr().out
    assert f"skipped, pip install polydist-{missing[0]} first" in out
    assert "no results in" in out


def test_bench_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    results = _results_dir(tmp_path)
    bench = str(tmp_path / "benchmarks")
    assert main(["bench", "--no-run", "--dir", bench, "--only", "nope"]) == 2
    assert "no benchmark named 'nope'; known: jax-cuda, sim" in capsys.readouterr().err
    (results / "bad.json").write_text("{", encoding="utf-8")
    assert main(["bench", "--no-run", "--dir", bench]) == 1
    assert "bad.json" in capsys.readouterr().err


def test_bench_never_runs_scripts_found_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A benchmarks/ folder in the working directory (or a parent) is someone else's code:
    # `polydist bench` without --dir runs only the checkout polydist is installed from.
    planted = tmp_path / "benchmarks"
    planted.mkdir()
    marker = tmp_path / "ran"
    (planted / "bench_planted.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n", encoding="utf-8"
    )
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    found = find_benchmarks_dir()
    assert found != planted.resolve()
    # An editable install: this checkout's own benchmarks/; installed from a wheel (as nox
    # installs it): none, and `polydist bench` asks for --dir.
    module = Path(bench_module.__file__).resolve()
    editable = module.parents[4].name == "packages" and module.parents[3].name == "core"
    assert found == (module.parents[5] / "benchmarks" if editable else None)
    assert main(["bench", "--only", "planted"]) == 2
    err = capsys.readouterr().err
    assert ("no benchmark named 'planted'" if editable else "--dir PATH") in err
    assert not marker.exists()
    assert find_benchmarks_dir(tmp_path / "nowhere") is None


def test_bench_without_a_checkout_asks_for_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As if installed from a wheel: site-packages/polydist/_tools/bench.py has no checkout above.
    fake = tmp_path / "site-packages" / "polydist" / "_tools" / "bench.py"
    monkeypatch.setattr(bench_module, "__file__", str(fake))
    assert find_benchmarks_dir() is None
    assert main(["bench", "--no-run"]) == 2
    assert "--dir PATH" in capsys.readouterr().err


# --------------------------------------------------------------------------- demo on JAX


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, "--xla_force_host_platform_device_count=4"),
        (
            "--xla_cpu_enable_fast_math=false",
            "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4",
        ),
        # The user's own count wins.
        ("--xla_force_host_platform_device_count=2", "--xla_force_host_platform_device_count=2"),
    ],
)
def test_demo_gives_jax_as_many_cpu_devices_as_replicas(
    monkeypatch: pytest.MonkeyPatch, before: str | None, after: str
) -> None:
    from polydist._tools.cli import _host_devices_for_jax

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)
    monkeypatch.setenv("XLA_FLAGS", before or "")  # restored after the test
    if before is None:
        monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    _host_devices_for_jax("jax", 4)
    assert os.environ["XLA_FLAGS"] == after


def test_demo_leaves_xla_flags_alone_where_they_do_not_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polydist._tools.cli import _host_devices_for_jax

    monkeypatch.setenv("XLA_FLAGS", "")  # restored after the test
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.delenv("POLYDIST_BACKEND", raising=False)
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    _host_devices_for_jax("sim", 4)  # another backend
    _host_devices_for_jax(None, 4)  # the default (sim)
    _host_devices_for_jax("jax", 1)  # one replica needs no flag
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # no CPU platform
    _host_devices_for_jax("jax", 4)
    assert "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    monkeypatch.setenv("POLYDIST_BACKEND", "jax")  # the backend from the environment
    _host_devices_for_jax(None, 3)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
