#!/usr/bin/env bash
# Runs the test suite on both Keras backends: everything under TensorFlow,
# then every test not marked `tensorflow` under JAX. Extra arguments go to
# both pytest runs. Both runs always happen; the script fails if either
# failed (exit status 1, after naming the failed backends).
set -uo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
failed=()
echo "== KERAS_BACKEND=tensorflow"
KERAS_BACKEND=tensorflow python -m pytest "$@" || failed+=(tensorflow)
echo "== KERAS_BACKEND=jax"
KERAS_BACKEND=jax python -m pytest -m "not tensorflow" "$@" || failed+=(jax)
if ((${#failed[@]})); then
    echo "== FAILED on: ${failed[*]}" >&2
    exit 1
fi
echo "== passed on tensorflow and jax"
