#!/usr/bin/env bash
# The GPU checks, as run on a lent one-GPU machine (docs/backends/jax.md "On a GPU",
# docs/backends/torch.md "CUDA").
#
# Expects the five polydist wheels and their missing dependencies in .whl/ (made on the
# developer's machine by benchmarks/device_wheels.sh), and the machine's own torch and
# jax: run it as `bash benchmarks/device_check.sh` with .whl carried along. Phase 1
# runs, side by side: the torch backend's tests (CUDA tests included; the multi-worker
# ones run gloo on CPU, as everywhere), the conformance suite
# on the torch and JAX backends with one replica on the GPU, and JAX's own tests on 8 fake
# CPU devices (the machine's jax version). Phase 2 runs the benchmarks one at a time on
# the quiet machine: the JAX and torch ones on the GPU (torch beside Lightning Fabric and
# Accelerate too: torch-peers-cuda.json); with FULL=1 also the input pipeline
# and the multi-worker one on its CPUs (multiworker-cpu16.json), which need no GPU and
# outrun a lease's 15 minutes together with the rest. Everything lands in $OUT:
# summary.txt and logs.tgz (every log and results file).
set -u
OUT=${OUT:-/tmp/polydist-device}
LOGS=/tmp/polydist-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
PHASE1_S=${PHASE1_S:-150}
FULL=${FULL:-0}

{
    date -u
    nvidia-smi -L
    $PY -c "import sys; print(sys.version)"
    $PY -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
    $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
} >"$LOGS/env.txt" 2>&1

$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$LOGS/install.txt" 2>&1 || {
    cp "$LOGS/install.txt" "$OUT/summary.txt"
    exit 1
}
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # (the polydist command)

# Several processes share the GPU: JAX must not take 75% of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T="timeout -k 5 $PHASE1_S"
PYTEST="$PY -m pytest -q -p no:cacheprovider -p no:benchmark --timeout=120"
TT=packages/backend-torch/tests
# xdist: on one process they outran the phase (150 s) there.
$T $PYTEST -n 4 $TT >"$LOGS/torch-tests.log" 2>&1 &
$T $PYTEST --pyargs polydist_conformance --polydist-backend=torch --polydist-replicas=1 \
    --polydist-json="$LOGS/conformance-torch-cuda.json" >"$LOGS/torch-conformance.log" 2>&1 &
$T $PYTEST --pyargs polydist_conformance --polydist-backend=jax --polydist-replicas=1 \
    --polydist-json="$LOGS/conformance-jax-gpu.json" >"$LOGS/jax-conformance.log" 2>&1 &
# xdist: a crashed worker (a segfault in XLA) is reported and replaced, not the end.
JAX_PLATFORMS=cpu $T $PYTEST -n 6 packages/backend-jax/tests >"$LOGS/jax-tests-cpu.log" 2>&1 &
wait
unset XLA_PYTHON_CLIENT_PREALLOCATE

timeout -k 5 120 $PY benchmarks/bench_jax.py --rounds 300 >"$LOGS/bench-jax.log" 2>&1
timeout -k 5 90 $PY benchmarks/bench_torch.py --replicas 1 --repeats 41 >"$LOGS/bench-torch.log" 2>&1
# Beside Lightning Fabric and Accelerate (the machine's image has both) on the GPU.
timeout -k 5 150 $PY benchmarks/bench_peers_torch.py --device cuda --rounds 400 --small-rounds 2000 \
    >"$LOGS/bench-peers-torch.log" 2>&1
if [ "$FULL" = 1 ]; then
    timeout -k 5 60 $PY benchmarks/bench_input.py --backend jax >"$LOGS/bench-input-jax.log" 2>&1
    for engine in torch jax; do
        CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu timeout -k 5 170 $PY benchmarks/bench_multiworker.py \
            --engine $engine --name multiworker-cpu16 >"$LOGS/bench-multiworker-$engine.log" 2>&1
    done
fi
cp benchmarks/results/*-gpu.json benchmarks/results/*-cuda.json \
    benchmarks/results/multiworker-cpu16.json "$LOGS/" 2>/dev/null

{
    cat "$LOGS/env.txt"
    for f in "$LOGS"/*.log; do
        echo "=== $(basename "$f")"
        grep -E "^(FAILED|ERROR)" "$f" | head -40
        case "$f" in  # a benchmark's every row (each program's compile and lane too)
            */bench-*) tail -n 20 "$f" ;;
            *) tail -n 4 "$f" ;;
        esac
    done
} >"$OUT/summary.txt" 2>&1
tar czf "$OUT/logs.tgz" -C "$LOGS" .
