#!/usr/bin/env bash
# Runs the test suite on both Keras backends: everything under TensorFlow,
# then every test not marked `tensorflow` under JAX. Extra arguments go to
# both pytest runs. Fails if either run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
echo "== KERAS_BACKEND=tensorflow"
KERAS_BACKEND=tensorflow python -m pytest "$@"
echo "== KERAS_BACKEND=jax"
KERAS_BACKEND=jax python -m pytest -m "not tensorflow" "$@"
