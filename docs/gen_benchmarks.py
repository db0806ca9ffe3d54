"""The benchmark results page, rendered from ``benchmarks/results/*.json``.

Two ways to run it:

* as a mkdocs hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds the page
  ``benchmarks.md`` to the site, so nothing generated is kept in the tree;
* as a script: ``python docs/gen_benchmarks.py`` prints the page (``--out
  FILE`` writes it; ``--check`` only checks that every results file parses).

The ratios are read by ``polydist._tools.cli.bench_rows``, the same code as
``polydist bench``, so the page and the command always agree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = "benchmarks.md"

INTRO = """\
# Benchmark results

What polydist costs on top of the same computation written by hand. Each
**ratio** compares polydist with that baseline, measured in the same run on
the same machine: most are polydist's time over the baseline's (lower is
better, 1.0 means no overhead); throughput ratios are the baseline's time
over polydist's (higher is better). **target** shows the goal a benchmark set
for a row, and so which way is better; **met** whether the row reached it
("-" where no target applies, or where it has a condition the table cannot
check); **machine** and **device** what produced it, and **date** the day
(UTC) it was measured.

These numbers are generated from `benchmarks/results/*.json` when the site is
built. Run the benchmarks of a checkout and print the same table with

```bash
polydist bench            # runs benchmarks/bench_*.py, then prints the table
polydist bench --no-run   # only prints the table from the existing results
```

The GPU rows (`jax-gpu`, `torch-cuda`, `input-jax-gpu`) come from one NVIDIA
H200, measured with `benchmarks/device_check.sh`, which also runs the
conformance suite and the backends' tests there; `multiworker-cpu16` is the
multi-worker benchmark on that machine's 16 CPU cores (run with `FULL=1`), and
`multiworker-step-cpu16` the JAX training step there (1 and 4 MiB,
`BENCH_SIZES=1,4 JAX_PLATFORMS=cpu python benchmarks/bench_multiworker_step.py
--engine jax --name multiworker-step-cpu16`; `multiworker-step-pipelined-cpu16`
the same with `BENCH_PIPELINED=1`: steps in flight, each burst of steps waiting
once at its end, informational). On that machine the
timings of a 1-2 ms step varied by up to 30% between runs of the same code.

`torch-peers-cpu` (`benchmarks/bench_peers_torch.py`) trains one MLP (512 ->
512 -> 512 -> 1, batch 1024, SGD, 1 CPU replica) with polydist's torch backend
(`distribute_module` + `distribute_optimizer` in `strategy.run`), Lightning
Fabric, Hugging Face Accelerate and plain PyTorch, interleaved in one run, in
4 trials of fresh contestants made in a rotated order (where a contestant's
tensors land in memory moves its step by up to 1%). The committed
`torch-peers-cpu` results were taken on the 2-core machine at load about 1.2
after the fourth round of per-step work of issue 20: polydist 1.006x the
hand-written step, Fabric 1.009x, Accelerate 1.021x; the same contestants on a
32-wide MLP with batches of 32 (a 0.4 ms step, where the fixed cost per step
shows): polydist 1.145x, Fabric 1.162x, Accelerate 1.730x. The rounds are
described in [the torch backend's page](backends/torch.md#benchmarks).

`multiworker-step-cpu` (`benchmarks/bench_multiworker_step.py`) is a training
step across 2 worker processes (1 replica each, loopback): an MLP whose 1 to 64
MiB of gradients are all-reduced every step through `MultiWorkerMirroredStrategy`,
against hand-written engine code (torch: DDP's flat bucket or one in-place
`dist.all_reduce` per gradient, over gloo; JAX: `jit(shard_map)` over the
multi-process mesh). Its ratios are the faster hand-written step's time over
polydist's (higher is better). On torch the headline
polydist step is the idiom the torch pages give for training an `nn.Module`,
`distribute_module` + `distribute_optimizer`, whose `step()` sums the
gradients in the optimizer's own flat buffer, in place; TF's idiom
(`ctx.all_reduce` of the gradients, out of place, into `p.grad`) is an
informational row. A compiled JAX step carries the workers'
agreement on its program as its own first collective (one tiny all-gather,
the body under `lax.cond`), so it is one program and one wait per step; from
a step function's second call on it takes the JAX backend's direct path (still
agreed on in every call). Two
processes on the 2 shared cores make these the noisiest rows: see
[Running on several hosts](multi-host.md#what-is-not-bounded-and-other-limits).

The memory rows of `jax-cpu` and `torch-cpu` (`benchmarks/_memory.py`, run
alone with `--memory-only`) compare peak memory, not time: one fresh process
per contestant holds a 400 MB float32 variable (torch: and a delta of its size)
and runs 4 update steps; the ratio is polydist's peak RSS over the hand-written
code's (`jax.jit(..., donate_argnums=0)`; `x.add_(delta)`), for the whole
process and for the steps alone. On a GPU the scripts also compare the device's
peak bytes in use; no GPU figures have been recorded for memory yet.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def undated(results: Path = RESULTS) -> list[str]:
    """The rows that do not say when, or on what device, they were measured: every
    figure on the page must (``--check`` fails on any)."""
    from polydist._tools.cli import bench_rows

    if not results.is_dir():
        return []
    return [
        f"{r.benchmark}: {r.case}"
        for r in bench_rows(results)
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.date) or not r.device.strip()
    ]


def render(results: Path = RESULTS) -> str:
    """The page's markdown."""
    from polydist._tools.cli import bench_rows

    files = sorted(results.glob("*.json")) if results.is_dir() else []
    if not files:
        return INTRO + "\nNo results yet: `benchmarks/results/` has no `*.json` file.\n"
    rows = bench_rows(results)
    out = [INTRO, "## Ratios", ""]
    out.append("| benchmark | case | device | ratio | target | met | machine | date |")
    out.append("|---|---|---|---:|---|---|---|---|")
    for r in rows:
        met = "-" if r.met is None else "yes" if r.met else "**no**"
        out.append(
            f"| `{r.benchmark}` | {_cell(r.case)} | {_cell(r.device)} | {r.ratio:.2f} | "
            f"{_cell(r.target)} | {met} | {_cell(r.machine)} | {_cell(r.date)} |"
        )
    out += ["", "## What each benchmark measures", ""]
    for path in files:
        payload: Any = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(payload, dict):
            continue
        what = payload.get("benchmark", "")
        target = payload.get("target", "")
        out.append(f"- **`{path.stem}`** ({path.name}): {what}".rstrip(": "))
        if target:
            out.append(f"  Target: {target}.")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- mkdocs hook


def on_files(files: Any, config: Any) -> Any:
    """Adds the generated ``benchmarks.md`` unless the docs already have one."""
    from mkdocs.structure.files import File

    if files.get_file_from_path(PAGE) is None:
        files.append(File.generated(config, PAGE, content=render()))
    return files


# --------------------------------------------------------------------------- script


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--out", type=Path, help="write the page here instead of stdout")
    parser.add_argument("--check", action="store_true", help="only check that results parse")
    args = parser.parse_args(argv)
    try:
        page = render(args.results)
    except ValueError as e:  # a results file that does not parse, named in the message
        print(f"gen_benchmarks: error: {e}", file=sys.stderr)
        return 1
    if args.check:
        missing = undated(args.results)
        if missing:
            print(
                "gen_benchmarks: error: these rows do not name their date (YYYY-MM-DD, a "
                '"date" in the row or its file; benchmarks/_common.write_results adds it) '
                "or device:\n  " + "\n  ".join(missing),
                file=sys.stderr,
            )
            return 1
        count = len(list(args.results.glob("*.json")))
        print(f"gen_benchmarks: {count} results file(s) in {args.results} parse")
    elif args.out:
        args.out.write_text(page, encoding="utf-8")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
