"""A backend from a package outside the repository, found through its entry point.

The test writes a tiny third-party package to a temporary folder: a
``pyproject.toml`` that registers two ``polydist.backends`` entry points, the
module, and the ``.dist-info`` folder that ``pip install`` would create
(``METADATA`` and ``entry_points.txt``). Putting the folder on ``PYTHONPATH``
is then the same as installing it, in milliseconds and without a network.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

# The ``python`` and ``suite`` fixtures (conftest.py) run a subprocess.
Run = Callable[..., "subprocess.CompletedProcess[str]"]


PYPROJECT = """\
[build-system]
requires = ["hatchling>=1.24"]
build-backend = "hatchling.build"

[project]
name = "polydist-ext-backend"
version = "0.3.0"
dependencies = ["polydist-sim"]

[project.entry-points."polydist.backends"]
ext-sim = "polydist_ext_backend:ExternalBackend"
ext-sim-spmd = "polydist_ext_backend:SpmdClaimingBackend"
"""

MODULE = '''\
"""A third-party polydist backend: the sim in disguise, with other capabilities."""

from dataclasses import replace

import numpy as np
from polydist.backend import EagerReplicaRunner
from polydist_sim import SimBackend


class _WideningNumpy:
    """NumPy, except that sum ignores dtype=, so int32 sums widen: a known gap."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def sum(x, axis=None, dtype=None, keepdims=False):
        return np.sum(x, axis=axis, keepdims=keepdims)


class ExternalBackend:
    """Wraps the sim: a "tree" reduction order it does not declare, no uneven gather,
    and an array namespace that widens integer sums (listed in its xfail file)."""

    name = "ext-sim"
    version = "0.3.0"

    def __init__(self):
        self._sim = SimBackend("tree", num_gpus=3)
        self.capabilities = replace(
            self._sim.capabilities, reduction_orders=(), uneven_gather=False
        )

    def array_namespace(self):
        return _WideningNumpy()

    def __getattr__(self, name):
        return getattr(self._sim, name)


class SpmdClaimingBackend(ExternalBackend):
    """Declares the SPMD model and no float64, to see the suite skip what needs them."""

    name = "ext-sim-spmd"

    def __init__(self):
        super().__init__()
        self.capabilities = replace(
            self.capabilities, execution_model="spmd", float64=False
        )

    def run_replicas(self, group, fn, per_replica_args):
        # Core calls this for an SPMD backend; a real one would compile fn here.
        return EagerReplicaRunner().run(group, fn, per_replica_args)
'''


@pytest.fixture
def external(tmp_path: Path) -> dict[str, str]:
    """Writes the package; returns the environment that has it installed."""
    project = tmp_path / "polydist-ext-backend"
    (project / "polydist_ext_backend").mkdir(parents=True)
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "polydist_ext_backend" / "__init__.py").write_text(MODULE)
    dist_info = project / "polydist_ext_backend-0.3.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: polydist-ext-backend\nVersion: 0.3.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [polydist.backends]
            ext-sim = polydist_ext_backend:ExternalBackend
            ext-sim-spmd = polydist_ext_backend:SpmdClaimingBackend
            """
        )
    )
    # The author's own list of known gaps, passed with --polydist-xfails.
    (project / "conformance-xfails.txt").write_text(
        "# Our array namespace's sum ignores dtype=, so int32 sums widen to int64.\n"
        "test_reduce.py::test_integer_sum_with_axis_stays_int32  # namespace widens int32\n"
    )
    return {"PYTHONPATH": str(project)}


def _xfails(env: dict[str, str]) -> str:
    return "--polydist-xfails=" + str(Path(env["PYTHONPATH"]) / "conformance-xfails.txt")


def test_pytest_pyargs(external: dict[str, str], outside: Path, suite: Run) -> None:
    results = outside / "results.json"
    done = suite(
        "--polydist-backend=ext-sim",
        f"--polydist-json={results}",
        _xfails(external),
        "-rs",
        cwd=outside,
        env=external,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # The header names the backend, its version and its devices.
    assert "polydist backend: ext-sim 0.3.0 (polydist_ext_backend.ExternalBackend" in output
    assert (
        "polydist devices: 3 replica(s) on /job:localhost/replica:0/task:0/device:GPU:0" in output
    )
    assert "within the floating-point error bound" in output
    report = json.loads(results.read_text())
    assert report["backend"] == "ext-sim"
    assert report["replicas"] == 3  # the backend's default device count
    outcomes = {c["outcome"] for c in report["cases"]}
    assert outcomes == {"passed", "skipped", "xfailed"}
    skipped = [c for c in report["cases"] if c["outcome"] == "skipped"]
    gather = [c for c in skipped if c["reason"].startswith("requires capability 'uneven_gather'")]
    assert len(gather) == 3
    for case in gather:
        assert "Capabilities.uneven_gather=False" in case["reason"]
    # The framework-pytree cases: this backend registers no framework (an optional hook).
    others = [c for c in skipped if c not in gather]
    assert len(others) == 2
    for case in others:
        assert "supplies no framework pytrees" in case["reason"], case


def test_main(external: dict[str, str], outside: Path, python: Run) -> None:
    done = python(
        [
            "-c",
            "import sys, polydist_conformance as c; "
            f"sys.exit(c.main('ext-sim', ['-q', '--polydist-replicas=2', {_xfails(external)!r}]))",
        ],
        cwd=outside,
        env=external,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed, 5 skipped, 1 xfailed" in done.stdout  # 3 uneven_gather, 2 framework pytrees


def test_capability_skips_name_the_capability(
    external: dict[str, str], outside: Path, suite: Run
) -> None:
    done = suite(
        "--polydist-backend=ext-sim-spmd",
        _xfails(external),
        "-rs",
        cwd=outside,
        env=external,
        targets=[
            "polydist_conformance.cases.test_errors",
            "polydist_conformance.cases.test_reduce",
            "polydist_conformance.cases.test_variables",
            "polydist_conformance.cases.test_tpu",
        ],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "requires capability 'eager' (the eager execution model): backend 'ext-sim-spmd' "
        "declares Capabilities.execution_model='spmd'"
    ) in done.stdout
    assert "requires capability 'float64': backend 'ext-sim-spmd' declares " in done.stdout
    # Capabilities derived from the execution model: left at None, False for SPMD.
    for name in ("variables_in_replica_context", "simulated_clusters"):
        assert (
            f"requires capability {name!r}: backend 'ext-sim-spmd' declares "
            f"Capabilities.{name}=None (so False with execution_model='spmd')"
        ) in done.stdout


def test_unknown_backend_is_a_usage_error(outside: Path, python: Run) -> None:
    done = python(
        ["-c", "import sys, polydist_conformance as c; sys.exit(c.main('no-such-backend'))"],
        cwd=outside,
    )
    assert done.returncode == 4, done.stdout + done.stderr
    assert "cannot load --polydist-backend=no-such-backend" in done.stderr
    assert "Installed backends: " in done.stderr
