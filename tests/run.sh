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
# `bash tests/run.sh --keras-nightly [pytest args]` runs the same two passes
# against the newest Keras on PyPI: it creates a throwaway virtual
# environment in /tmp that sees this Python's packages
# (--system-site-packages), installs `keras-nightly` into it with --no-deps
# (so TensorFlow, JAX and the rest stay as installed), runs the suite with
# this checkout's kerasmp, and deletes the environment. Set
# KERASMP_NIGHTLY_VENV=/path to reuse (and keep) an environment instead.
# Not part of CI (it needs the network and doubles the time); run it before
# raising the Keras upper bound in pyproject.toml.
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
python=python
if [[ "${1:-}" == "--python" ]]; then
    shift
    exec bash tests/python_lane.sh "$@"
fi
if [[ "${1:-}" == "--keras-nightly" ]]; then
    shift
    venv="${KERASMP_NIGHTLY_VENV:-}"
    if [[ -z "$venv" ]]; then
        tmp="$(mktemp -d /tmp/kerasmp-keras-nightly.XXXXXX)"
        trap 'rm -rf "$tmp"' EXIT
        venv="$tmp/venv"
    fi
    if [[ ! -x "$venv/bin/python" ]]; then
        python -m venv --system-site-packages "$venv" || exit 1
    fi
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-deps --upgrade keras-nightly || exit 1
    python="$venv/bin/python"
    # This checkout's kerasmp, not an installed copy.
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "== keras $("$python" -c 'import keras; print(keras.__version__)' \
        2>/dev/null) (keras-nightly, in $venv)"
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
        if "$python" -c "import xdist" 2>/dev/null; then
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
    KERAS_BACKEND="$backend" "$python" -m pytest "$@"
    local rc=$?
    if ((rc != 0 && rc != 5)); then failed+=("$backend"); fi
}
echo "== KERAS_BACKEND=tensorflow${selection:+ (-m \"$selection\")}"
run_pass tensorflow "${tf_marks[@]}" "$@"
echo "== KERAS_BACKEND=jax (-m \"$jax_marks\")"
run_pass jax -m "$jax_marks" "$@"
ran="tensorflow and jax"
if "$python" -c "import torch" 2>/dev/null; then
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
