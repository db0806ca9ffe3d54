"""The docs site's build helpers (docs/gen_benchmarks.py, docs/hooks.py), run as plain code."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _load(name: str) -> ModuleType:
    path = DOCS / f"{name}.py"
    if not path.exists():
        pytest.skip(f"{path} is not in this checkout")
    spec = importlib.util.spec_from_file_location(f"polydist_docs_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_page_names_device_and_machine_per_row(tmp_path: Path) -> None:
    gen = _load("gen_benchmarks")
    payload = {
        "benchmark": "a | b",
        "device": "NVIDIA H100",
        "machine": {"processor": "x86_64", "cpu_count": 16, "platform": "Linux-6.8"},
        "date": "2026-11-20",
        # A row measured on another day than the file's others says so itself.
        "rows": [
            {"replicas": 8, "ratio": 1.04},
            {"replicas": 4, "ratio": 1.5, "date": "2026-11-28"},
        ],
        "target": "ratio <= 1.05 at 8 replicas",
    }
    (tmp_path / "jax-cuda.json").write_text(json.dumps(payload), encoding="utf-8")
    page = gen.render(tmp_path)
    machine = "x86_64, 16 CPUs, Linux"
    assert (
        f"| `jax-cuda` | 8 replicas | NVIDIA H100 | 1.04 | <= 1.05 | yes | {machine} | 2026-11-20 |"
        in page
    )
    assert (
        f"| `jax-cuda` | 4 replicas | NVIDIA H100 | 1.50 | - | - | {machine} | 2026-11-28 |" in page
    )
    assert "- **`jax-cuda`** (jax-cuda.json): a | b" in page
    assert "Target: ratio <= 1.05 at 8 replicas." in page


def test_benchmark_page_without_results(tmp_path: Path) -> None:
    assert "No results yet" in _load("gen_benchmarks").render(tmp_path)


def test_benchmark_script_check_reports_a_broken_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _load("gen_benchmarks")
    (tmp_path / "bad.json").write_text("[1,", encoding="utf-8")
    assert gen.main(["--check", "--results", str(tmp_path)]) == 1
    assert "bad.json" in capsys.readouterr().err


def test_benchmark_script_check_requires_a_date_per_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gen = _load("gen_benchmarks")
    payload = {"device": "CPU", "ratios": [{"case": "step", "ratio": 1.0}]}
    (tmp_path / "sim.json").write_text(json.dumps(payload), encoding="utf-8")
    assert gen.main(["--check", "--results", str(tmp_path)]) == 1
    assert "sim: step" in capsys.readouterr().err
    payload["ratios"][0]["date"] = "yesterday"  # type: ignore[index]
    (tmp_path / "sim.json").write_text(json.dumps(payload), encoding="utf-8")
    assert gen.main(["--check", "--results", str(tmp_path)]) == 1
    payload["date"] = "2026-11-28"
    del payload["ratios"][0]["date"]  # type: ignore[attr-defined]
    (tmp_path / "sim.json").write_text(json.dumps(payload), encoding="utf-8")
    assert gen.main(["--check", "--results", str(tmp_path)]) == 0


def test_recorded_benchmark_results_are_dated() -> None:
    # Every figure of benchmarks/results/ on the page says when it was measured.
    gen = _load("gen_benchmarks")
    assert gen.undated() == []


def test_name_table_and_conditional_blocks() -> None:
    hooks = _load("hooks")
    assert hooks.resolve("polydist.MirroredStrategy.run")
    assert hooks.resolve("polydist.cluster_resolver.ClusterSpec")
    assert not hooks.resolve("polydist.NoSuchStrategy")
    assert not hooks.resolve("polydist.compat.no_such_module.X")
    page = (
        "<!-- polydist:if polydist.trace -->yes<!-- polydist:endif -->"
        "<!-- polydist:if polydist.nope -->no<!-- polydist:else -->fallback<!-- polydist:endif -->"
        "\n<!-- polydist:name-table strategies -->"
    )
    out = hooks.on_page_markdown(page, None, None, None)
    assert out.startswith("yesfallback\n| TensorFlow | polydist | status | note |")
    assert "| `tf.distribute.MirroredStrategy` | `polydist.MirroredStrategy` | available |" in out
