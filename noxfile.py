"""Sessions: lint, typecheck, tests(package), demo, docs, conformance, example_backend,
jax, torch, torch_xla, bench.

``nox`` runs the default set (everything CI needs); ``nox -s bench`` runs the
benchmarks and writes ``benchmarks/results/``. Each backend's tests run in
their own virtualenv, so jax and torch are never imported together; torch_xla's
virtualenv (torch 2.9.0 + torch-xla 2.9.0) is cached outside the checkout.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False
nox.options.sessions = [
    "lint",
    "typecheck",
    "tests",
    "conformance",
    "example_backend",
    "demo",
    "docs",
    "jax",
    "torch",
    # First run on a machine: builds a cached torch-xla virtualenv (about 3.6 GB to
    # download, under 3 minutes in all here); later runs take under a minute.
    "torch_xla",
]

CORE = "./packages/core"
SIM = "./packages/sim"
CONFORMANCE = "./conformance"
JAX = "./packages/backend-jax"
TORCH = "./packages/backend-torch"
# A third-party backend outside packages/, written against the public contract only.
EXAMPLE_BACKEND = "./examples/thirdparty_backend"
# The CPU build of torch 2.13 (a local wheel on CI machines); an unpinned torch
# would pull a multi-GB CUDA build.
TORCH_PIN = "torch==2.13.0"
# JAX sees 8 CPU devices only if this is set before it initialises.
XLA_8 = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
TEST_DEPS = ["pytest>=8", "hypothesis>=6"]
# Every Python block of docs/ and README.md runs as a test (docs/conftest.py says how);
# each block runs in the session of the backend it names (POLYDIST_DOCS_BACKEND).
DOCS_TEST_DEPS = ["pytest-markdown-docs>=0.9"]
DOCS_TEST = [
    "pytest",
    "--markdown-docs",
    "--markdown-docs-syntax=superfences",
    "-m",
    "markdown-docs",
    "docs",
    "README.md",
    "-q",
]
PY = "3.11"


# Where import-linter finds the packages: it reads their source without importing them
# (or their dependencies), so no package needs to be installed.
SOURCE_DIRS = [
    "packages/core/src",
    "packages/sim/src",
    "packages/backend-jax/src",
    "packages/backend-torch/src",
    "conformance/src",
    "examples/thirdparty_backend/src",
]


@nox.session(python=PY)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree; import-linter's contracts
    (pyproject.toml: backends import only polydist and polydist.backend.*)."""
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports", env={"PYTHONPATH": os.pathsep.join(SOURCE_DIRS)})


@nox.session(python=PY)
def typecheck(session: nox.Session) -> None:
    """mypy --strict (config in pyproject.toml) on every package without heavy deps."""
    session.install("mypy>=1.11", "types-greenlet", "nox", *TEST_DEPS, CORE, SIM, CONFORMANCE)
    session.run(
        "mypy",
        "packages/core/src/polydist",
        "packages/sim/src/polydist_sim",
        "conformance/src/polydist_conformance",
        "noxfile.py",
    )


@nox.session(python=PY)
@nox.parametrize("package", ["core", "sim", "conformance"])
def tests(session: nox.Session, package: str) -> None:
    """pytest for one package, in its own virtualenv (conformance: its own tests,
    including the mutation check that every broken sim variant is caught)."""
    # ml_dtypes (optional): these tests sum, compare and checkpoint bfloat16 and float8.
    extra = ["ml_dtypes>=0.5"]
    session.install(*TEST_DEPS, *extra, CORE, SIM, CONFORMANCE)
    where = "conformance/tests" if package == "conformance" else f"packages/{package}/tests"
    session.run("pytest", where, "-q", *session.posargs)


@nox.session(python=PY)
def conformance(session: nox.Session) -> None:
    """The conformance suite, run the way a backend author runs it, on the sim."""
    session.install("ml_dtypes>=0.5", CORE, SIM, CONFORMANCE)  # runs the bfloat16 cases
    session.run("pytest", "--pyargs", "polydist_conformance", "--polydist-backend=sim", "-q")


# Replica counts the example backend's conformance run takes: one replica (no peers), an
# odd count, the default 4, and all 8 of its devices. Under 10 s each on 2 cores.
EXAMPLE_BACKEND_REPLICAS = (1, 3, 4, 8)


@nox.session(python=PY)
def example_backend(session: nox.Session) -> None:
    """The example third-party backend (examples/thirdparty_backend, ``backend="threads"``),
    installed from its folder as a stranger's package is: mypy, its tests (one checks that
    it imports nothing private from polydist), the docs' code blocks that use it
    (``fixture:threads``: docs/extending.md's eager walkthrough), and the conformance
    suite through the pytest plugin at 1, 3, 4 and 8 replicas."""
    session.install(
        "mypy>=1.11", *TEST_DEPS, *DOCS_TEST_DEPS, "ml_dtypes>=0.5", CORE, SIM, CONFORMANCE
    )
    session.install(EXAMPLE_BACKEND)
    session.run(
        "mypy",
        "examples/thirdparty_backend/src/polydist_example_backend",
        "examples/thirdparty_backend/tests",
    )
    session.run("pytest", "examples/thirdparty_backend/tests", "-q", *session.posargs)
    session.run(*DOCS_TEST, env={"POLYDIST_DOCS_BACKEND": "threads"})
    for replicas in EXAMPLE_BACKEND_REPLICAS:
        session.run(
            "pytest",
            "--pyargs",
            "polydist_conformance",
            "--polydist-backend=threads",
            f"--polydist-replicas={replicas}",
            "-q",
        )


@nox.session(python=PY)
def demo(session: nox.Session) -> None:
    """The README's first command: install core alone (the sim ships with it) and run the demo."""
    # A reused virtualenv may hold packages of an older recipe: core alone is the point.
    session.run("python", "-m", "pip", "uninstall", "--yes", "--quiet", "polydist-sim")
    session.install(CORE)
    session.run("polydist", "demo", "--replicas", "8")


@nox.session(python=PY)
@nox.parametrize("backend", ["sim", "jax", "torch"])
def bench(session: nox.Session, backend: str) -> None:
    """Benchmarks for one backend: write benchmarks/results/*.json, print the ratios."""
    if backend == "sim":
        session.install(CORE, SIM)
        session.run("python", "benchmarks/bench_sim.py", *session.posargs)
        if Path("benchmarks/bench_input.py").exists():
            session.run("python", "benchmarks/bench_input.py")
    elif backend == "jax":
        # keras: Keras 3 DataParallel beside polydist in bench_jax.py (a benchmark-only
        # dependency, never the packages').
        session.install("jax>=0.10", "keras>=3.8", CORE, SIM, JAX)
        session.run(
            "python",
            "benchmarks/bench_jax.py",
            *session.posargs,
            env={**XLA_8, "KERAS_BACKEND": "jax"},
        )
        session.run("python", "benchmarks/bench_input.py", "--backend", "jax", env=XLA_8)
        session.run("python", "benchmarks/bench_multiworker.py", "--engine", "jax")
        session.run("python", "benchmarks/bench_multiworker_step.py", "--engine", "jax")
    else:
        # lightning, accelerate: Fabric and Accelerate beside polydist in
        # bench_peers_torch.py (benchmark-only dependencies, never the packages'; in the
        # same pip call as TORCH_PIN, so they cannot replace that torch).
        session.install(TORCH_PIN, "lightning>=2.5", "accelerate>=1.0", CORE, SIM, TORCH)
        session.run("python", "benchmarks/bench_torch.py", *session.posargs)
        session.run("python", "benchmarks/bench_peers_torch.py")
        session.run("python", "benchmarks/bench_multiworker.py", "--engine", "torch")
        session.run("python", "benchmarks/bench_multiworker_step.py", "--engine", "torch")


# The replica counts the JAX conformance suite runs at (on 8 fake CPU devices; TPUStrategy
# cases use all 8): 1 (no collectives), 3 (a MEAN whose 1/n is inexact, as at 5 and 7),
# 8. About a minute each on a 2-core machine.
JAX_CONFORMANCE_REPLICAS = (1, 3, 8)


@nox.session(python=PY)
def jax(session: nox.Session) -> None:
    """The JAX backend on 8 fake CPU devices: mypy, its tests, the docs' JAX code blocks,
    the conformance suite at 1, 3 and 8 replicas."""
    # The flax extra (flax, optax): polydist_jax.nnx, its tests, examples/tutorial_flax.py.
    session.install(
        "mypy>=1.11",
        *TEST_DEPS,
        *DOCS_TEST_DEPS,
        "jax>=0.10",
        CORE,
        SIM,
        CONFORMANCE,
        f"{JAX}[flax]",
    )
    session.run("mypy", "packages/backend-jax/src/polydist_jax")
    session.run("pytest", "packages/backend-jax/tests", "-q", *session.posargs, env=XLA_8)
    session.run(*DOCS_TEST, env={**XLA_8, "POLYDIST_DOCS_BACKEND": "jax"})
    for replicas in JAX_CONFORMANCE_REPLICAS:
        session.run(
            "pytest",
            "--pyargs",
            "polydist_conformance",
            "--polydist-backend=jax",
            f"--polydist-replicas={replicas}",
            "-q",
            env=XLA_8,
        )


# Replica counts the torch conformance suite runs at: one replica (no peers), an odd
# count (a MEAN's division by 3 is inexact), the default 4, and 8. About 15-25 s each
# on a 2-core machine.
TORCH_CONFORMANCE_REPLICAS = (1, 3, 4, 8)


@nox.session(python=PY)
def torch(session: nox.Session) -> None:
    """The torch backend on virtual CPU replicas: mypy, tests, conformance at 1/3/4/8.

    The conformance suite runs once per count in `TORCH_CONFORMANCE_REPLICAS`.
    """
    # ml_dtypes (optional): bfloat16/float8 tensors as NumPy arrays, and the bfloat16 cases.
    session.install(
        "mypy>=1.11",
        *TEST_DEPS,
        *DOCS_TEST_DEPS,
        TORCH_PIN,
        "numpy",
        "ml_dtypes>=0.5",
        CORE,
        SIM,
        CONFORMANCE,
        TORCH,
    )
    session.run("mypy", "packages/backend-torch/src/polydist_torch")
    session.run("pytest", "packages/backend-torch/tests", "-q", *session.posargs)
    session.run(*DOCS_TEST, env={"POLYDIST_DOCS_BACKEND": "torch"})
    for replicas in TORCH_CONFORMANCE_REPLICAS:
        session.run(
            "pytest",
            "--pyargs",
            "polydist_conformance",
            "--polydist-backend=torch",
            f"--polydist-replicas={replicas}",
            "-q",
        )


# torch-xla 2.9.0 needs torch 2.9.0 exactly, and PyPI's torch 2.9.0 is the CUDA build: the
# smallest install that imports (docs/backends/torch.md; platforms-on-cpu.md section 4) is
# about 3.6 GB to download and a 5.9 GB virtualenv. So the session keeps one virtualenv
# outside the checkout, built once per machine, and only reinstalls polydist into it.
TORCH_XLA_HEAVY = [
    "torch==2.9.0",
    "torch-xla==2.9.0",
    "nvidia-cuda-runtime-cu12==12.8.90",
    "nvidia-cuda-cupti-cu12==12.8.90",
    "nvidia-cublas-cu12==12.8.4.1",
    "nvidia-cudnn-cu12==9.10.2.21",
    "nvidia-cufft-cu12==11.3.3.83",
    "nvidia-curand-cu12==10.3.9.90",
    "nvidia-cusparse-cu12==12.5.8.93",
    "nvidia-cusparselt-cu12==0.7.1",
    "nvidia-nccl-cu12==2.27.5",
    "nvidia-nvshmem-cu12==3.3.20",
    "nvidia-nvjitlink-cu12==12.8.93",
    "nvidia-cufile-cu12==1.13.1.3",
]
# What torch and torch-xla import (installed with dependencies, next to the --no-deps pair).
TORCH_XLA_PURE = [
    "filelock",
    "typing-extensions",
    "sympy",
    "networkx",
    "jinja2",
    "fsspec",
    "absl-py",
    "numpy",
    "pyyaml",
    "requests",
    "hatchling>=1.27",  # builds the local packages without build isolation (PEP 639 license-files)
]
# polydist's own dependencies (core, sim, conformance, backend-torch) and the test tools.
POLYDIST_PURE = [
    "numpy>=2.0",
    "optree>=0.13",
    "greenlet>=3.0",
    "tqdm>=4.66",
    "safetensors>=0.4",  # checkpoints' tensors file
    "array-api-compat>=1.9",
    "ml_dtypes>=0.5",  # optional; a small wheel: the bfloat16 tests and conformance cases
    *TEST_DEPS,
    *DOCS_TEST_DEPS,
]
# The 4 XLA devices stand in for TPU cores in TPUStrategy: the conformance oracle's local
# TPU must have 4 cores too (v4-8: 4 single-device chips).
XLA_CPU_4 = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "POLYDIST_LOCAL_TPU": "v4-8"}


def _torch_xla_venv() -> Path:
    """``$POLYDIST_TORCH_XLA_VENV``, else ``$XDG_CACHE_HOME/polydist/venv-torch-xla-2.9.0``."""
    override = os.environ.get("POLYDIST_TORCH_XLA_VENV")
    if override:
        return Path(override).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "polydist" / "venv-torch-xla-2.9.0"


@nox.session(venv_backend="none")
def torch_xla(session: nox.Session) -> None:
    """torch-xla SPMD on 4 XLA:CPU devices: its tests and the conformance suite.

    Runs in a cached virtualenv outside the checkout (see ``_torch_xla_venv``). The
    first run on a machine builds it: torch 2.9.0 + torch-xla 2.9.0 and the CUDA
    libraries torch needs to import (about 3.6 GB downloaded, 1.5 to 2 minutes on a
    fast link); a marker file records a finished build, so an interrupted one starts
    over. Every run then reinstalls polydist (core, sim, conformance, backend-torch)
    into it with --no-deps --force-reinstall.
    """
    venv = _torch_xla_venv()
    python = str(venv / "bin" / "python")
    marker = venv / ".polydist-complete"
    recipe = "\n".join([*TORCH_XLA_HEAVY, "--", *TORCH_XLA_PURE]) + "\n"
    if not marker.is_file() or marker.read_text() != recipe:
        session.log(f"Building the torch-xla virtualenv in {venv} (about 3.6 GB to download)")
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        interpreter = shutil.which(f"python{PY}") or sys.executable
        session.run(interpreter, "-m", "venv", str(venv), external=True)
        pip = [python, "-m", "pip", "install", "--no-cache-dir"]
        session.run(*pip, "--no-deps", *TORCH_XLA_HEAVY, external=True)
        session.run(*pip, *TORCH_XLA_PURE, external=True)
        marker.write_text(recipe)
    else:
        session.log(f"Reusing the torch-xla virtualenv in {venv}")
    pip = [python, "-m", "pip", "install", "--quiet"]
    session.run(*pip, *POLYDIST_PURE, external=True)
    session.run(
        *pip,
        "--no-deps",
        "--force-reinstall",
        "--no-build-isolation",
        CORE,
        SIM,
        CONFORMANCE,
        TORCH,
        external=True,
    )
    pytest = [python, "-m", "pytest"]
    session.run(
        *pytest,
        "packages/backend-torch/tests/test_xla.py",
        "-q",
        *session.posargs,
        env=XLA_CPU_4,
        external=True,
    )
    session.run(
        python,
        "-m",
        *DOCS_TEST,
        env={**XLA_CPU_4, "POLYDIST_DOCS_BACKEND": "torch_xla"},
        external=True,
    )
    session.run(
        *pytest,
        "--pyargs",
        "polydist_conformance",
        "--polydist-backend=torch_xla",
        "--polydist-replicas=4",
        "-q",
        env=XLA_CPU_4,
        external=True,
    )


# mkdocstrings formats the API reference's signatures with ruff.
DOCS_DEPS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff>=0.6"]


@nox.session(python=PY)
def docs(session: nox.Session) -> None:
    """Every Python block of docs/ and README.md that needs no real backend runs first
    (docs/conftest.py); then the docs site is built strictly (broken links and
    docstring warnings fail).

    ``docs/gen_benchmarks.py`` runs as a mkdocs hook and renders the benchmark
    page from ``benchmarks/results/*.json``; it also runs here first so that a
    broken results file fails with its own message.
    """
    packages = [CORE, SIM]
    # Installed where the checkout has it; the API reference reads its source from conformance/.
    if Path("conformance/pyproject.toml").exists():
        packages.append("./conformance")
    session.install(*DOCS_DEPS, *TEST_DEPS, *DOCS_TEST_DEPS, *packages)
    session.run(*DOCS_TEST, env={"POLYDIST_DOCS_BACKEND": "sim"})
    session.run("python", "docs/gen_benchmarks.py", "--check")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})
