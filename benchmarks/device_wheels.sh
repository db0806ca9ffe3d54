#!/usr/bin/env bash
# Fills .whl/ (git-ignored locally: add "/.whl/" to .git/info/exclude) with what
# benchmarks/device_check.sh installs on the GPU machine, which reaches no package index:
# the five polydist wheels, and the dependencies its image lacks, built for its
# Python (3.12, x86-64 Linux). Run it here, then carry .whl with the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
TARGET_PY=${TARGET_PY:-3.12}
rm -rf .whl
mkdir -p .whl
$PY -m pip wheel -q --no-deps -w .whl ./packages/core ./packages/sim ./conformance \
    ./packages/backend-jax ./packages/backend-torch
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "optree>=0.13" "greenlet>=3.0" "array-api-compat>=1.9" "safetensors>=0.4"
ls .whl
