"""The suite passes on the sim, with any replica count, and stays out of other pytest runs."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

# The ``python`` and ``suite`` fixtures (conftest.py) run a subprocess.
Run = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.mark.parametrize("replicas", [None, 1, 3])
def test_the_sim_passes_everything(outside: Path, replicas: int | None, python: Run) -> None:
    args = ["-q"] + ([f"--polydist-replicas={replicas}"] if replicas else [])
    done = python(
        ["-c", f"import sys, polydist_conformance as c; sys.exit(c.main('sim', {args!r}))"],
        cwd=outside,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " failed" not in done.stdout
    passed = int(done.stdout.split(" passed")[0].rsplit("\n", 1)[-1].split()[-1])
    assert passed >= 130


def test_header_names_backend_version_and_devices(outside: Path, suite: Run) -> None:
    done = suite("--polydist-backend=sim", "--collect-only", cwd=outside)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # The sim ships with core (polydist._sim); polydist_sim re-exports it.
    assert any(line.startswith("polydist backend: sim 0.1.0 (polydist._sim.") for line in lines)
    assert any(
        "4 replica(s) on /job:localhost/replica:0/task:0/device:GPU:0" in line for line in lines
    )
    assert any(line.startswith("polydist xfails: ") and "sim.txt" in line for line in lines)


def test_the_plugin_stays_out_of_other_pytest_runs(outside: Path, python: Run) -> None:
    (outside / "test_unrelated.py").write_text("def test_one():\n    assert True\n")
    done = python(["-m", "pytest", "-p", "no:cacheprovider", "test_unrelated.py"], cwd=outside)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "polydist backend" not in done.stdout
    assert "1 passed" in done.stdout


def test_main_where_warnings_are_errors(outside: Path, python: Run) -> None:
    """Callers import polydist_conformance before pytest starts; that must not warn."""
    code = (
        "import sys, polydist_conformance as c; "
        "sys.exit(c.main('sim', ['-q', '-W', 'error', '-k', 'contexts']))"
    )
    done = python(["-c", code], cwd=outside)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 passed" in done.stdout
