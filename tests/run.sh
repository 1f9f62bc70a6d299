#!/usr/bin/env bash
# Runs the test suite on the three Keras backends: everything under
# TensorFlow, then every test not marked `tensorflow` under JAX, then the
# tests marked `torch` under PyTorch (the train step, optimizer, policy,
# monitors, diagnostics, export and the docs' `backend: any` blocks: the
# PyTorch backend is newer, and a PyTorch step on a CPU is several times
# slower, so it gets a representative subset; `jit=True` cases run there
# only in the tests marked `torch_jit`, tests/conftest.py: torch.compile
# takes 15-40 s a toy model), each on two pytest-xdist workers (see below).
# Extra arguments go to every pytest run. Every run always happens; the
# script fails if any failed (exit status 1, after naming the failed
# backends). A PyTorch-less environment skips the third run, saying so.
#
# The few tests marked `slow` (the full demo, ResNet-50, multi-process
# distribution...) are left out, so the suite takes under 15 minutes on two
# cores. `bash tests/run.sh --slow` runs only them and `--all` runs
# everything; CI (.ci/run) runs the default suite, then `--slow`.
#
# `bash tests/run.sh --keras-nightly [pytest args]` runs the same passes
# against the newest Keras on PyPI, with the `python` this script would use
# otherwise (a virtual environment's or the base interpreter) and every
# package it sees: `pip install --no-deps --target DIR keras-nightly` puts
# the nightly alone in a throwaway folder in /tmp (TensorFlow, JAX, PyTorch
# and keras-hub stay as installed), and DIR goes first on PYTHONPATH, ahead
# of site-packages and its Keras, for the pytest runs and every subprocess
# they start. (Not a virtual environment made with --system-site-packages:
# that one sees the base interpreter's packages, not those of a virtual
# environment this script was called from, so from a venv it ran without
# the venv's TensorFlow, JAX and kerasmp dependencies.) Before the passes
# the script imports keras the way they will and stops, printing the
# version and file it got, unless that is the nightly it just installed
# from DIR. Then it runs the suite with this checkout's kerasmp and deletes
# DIR. Set KERASMP_NIGHTLY_DIR=/path to reuse (update) and keep a folder
# instead. Not part of CI (it needs the network and doubles the time); run
# it before raising the Keras upper bound in pyproject.toml.
# docs/versions.md has the last results.
#
# `bash tests/run.sh --python 3.12 [--slow|--all] [pytest args]` runs the
# TensorFlow and JAX passes on another Python (pyenv's or PATH's), in a
# throwaway virtual environment with this checkout and the extras a JAX or
# TensorFlow user needs, without PyTorch (tests/python_lane.sh; set
# KERASMP_PYTHON_VENV=/path to reuse and keep one). Not part of CI.
set -uo pipefail
cd "$(dirname "$0")/.."
selection="not slow"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
if [[ "${1:-}" == "--python" ]]; then
    shift
    exec bash tests/python_lane.sh "$@"
fi
if [[ "${1:-}" == "--keras-nightly" ]]; then
    shift
    nightly="${KERASMP_NIGHTLY_DIR:-}"
    if [[ -z "$nightly" ]]; then
        nightly="$(mktemp -d /tmp/kerasmp-keras-nightly.XXXXXX)"
        trap 'rm -rf "$nightly"' EXIT
    fi
    python -m pip install --quiet --disable-pip-version-check --no-deps \
        --upgrade --target "$nightly" keras-nightly || exit 1
    # This checkout's kerasmp (not an installed copy), after the nightly.
    export PYTHONPATH="$nightly:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # The Keras the passes will import must be the nightly just installed.
    KERASMP_NIGHTLY_DIR="$nightly" python - <<'PY' || exit 1
import importlib.metadata as metadata
import os
import sys

import keras

folder = os.path.realpath(os.environ["KERASMP_NIGHTLY_DIR"])
found = [d.version for d in metadata.distributions(path=[folder])
         if d.metadata["Name"] == "keras-nightly"]
where = os.path.realpath(keras.__file__)
print(f"== keras {keras.__version__} from {where} (keras-nightly "
      f"{found[0] if found else 'missing'}, in {folder})")
if not found or keras.__version__ != found[0] or not where.startswith(
        folder + os.sep):
    sys.exit(f"== not the nightly: {sys.executable} imports keras "
             f"{keras.__version__} from {where}, not the keras-nightly in "
             f"{folder}")
PY
fi
case "${1:-}" in
    --slow) selection="slow"; shift ;;
    --all) selection=""; shift ;;
esac
# Two pytest-xdist workers (a dev extra) that share out the tests and take
# over each other's queue when idle (`--dist worksteal`: a module-scoped
# fixture may be built once per worker), unless the arguments choose
# (`-n 0` runs in one process) or xdist is not installed.
# KERASMP_TEST_WORKERS=N sets the count.
parallel=()
case " $* " in
    *" -n "*|*" -n="*|*" --numprocesses"*|*" -p no:xdist "*) ;;
    *)
        if python -c "import xdist" 2>/dev/null; then
            parallel=(-n "${KERASMP_TEST_WORKERS:-2}" --dist worksteal)
        fi
        ;;
esac
set -- "${parallel[@]}" "$@"
failed=()
# A `-m` among the arguments comes last, so it wins over these.
tf_marks=()
if [[ -n "$selection" ]]; then tf_marks=(-m "$selection"); fi
jax_marks="not tensorflow${selection:+ and ($selection)}"
torch_marks="torch and not tensorflow${selection:+ and ($selection)}"
# pytest's status 5 (no test selected) is not a failure.
run_pass() {
    local backend="$1"
    shift
    KERAS_BACKEND="$backend" python -m pytest "$@"
    local rc=$?
    if ((rc != 0 && rc != 5)); then failed+=("$backend"); fi
}
echo "== KERAS_BACKEND=tensorflow${selection:+ (-m \"$selection\")}"
run_pass tensorflow "${tf_marks[@]}" "$@"
echo "== KERAS_BACKEND=jax (-m \"$jax_marks\")"
run_pass jax -m "$jax_marks" "$@"
ran="tensorflow and jax"
if python -c "import torch" 2>/dev/null; then
    ran="tensorflow, jax and torch"
    echo "== KERAS_BACKEND=torch (-m \"$torch_marks\")"
    run_pass torch -m "$torch_marks" "$@"
else
    echo "== KERAS_BACKEND=torch: skipped, PyTorch is not installed" \
        "(pip install -e \".[dev]\" installs it)"
fi
if ((${#failed[@]})); then
    echo "== FAILED on: ${failed[*]}" >&2
    exit 1
fi
echo "== passed on $ran"
