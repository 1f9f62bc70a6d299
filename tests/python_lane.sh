#!/usr/bin/env bash
# The Python lane: `bash tests/run.sh --python 3.12 [--slow|--all] [pytest
# args]` (or `bash tests/python_lane.sh 3.12 ...`) runs the suite's
# TensorFlow and JAX passes on another Python, with the versions pip picks
# there (Python 3.12 and 3.13 get JAX 0.11+, which 3.11 cannot install).
#
# It finds that Python (pyenv's newest `<version>.*`, else `python<version>`
# on PATH), makes a throwaway virtual environment in /tmp, installs this
# checkout there with the extras a JAX or TensorFlow user needs
# (jax, tensorflow, plot, onnx, tflite) and the `dev` extra's test tools,
# but no PyTorch (torch and litert-torch are several GB; run.sh then skips
# the PyTorch pass, saying so), prints the versions installed, runs
# tests/run.sh with that Python, and deletes the environment. Set
# KERASMP_PYTHON_VENV=/path to reuse (and keep) an environment instead.
# Not part of CI (it needs the network, and on two busy shared cores its
# JAX pass alone took about an hour with Python 3.12: docs/versions.md).
set -uo pipefail
cd "$(dirname "$0")/.."
version="${1:-}"
if [[ ! "$version" =~ ^3\.[0-9]+$ ]]; then
    echo "tests/python_lane.sh: error: --python needs a version such as" \
        "3.12 (got '${version}'): bash tests/run.sh --python 3.12" >&2
    exit 2
fi
shift
base=""
pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
for candidate in $(ls -d "$pyenv_root/versions/$version".* 2>/dev/null \
        | sort -V -r); do
    if [[ -x "$candidate/bin/python" ]]; then
        base="$candidate/bin/python"
        break
    fi
done
if [[ -z "$base" ]]; then
    base="$(command -v "python$version" || true)"
fi
if [[ -z "$base" ]]; then
    echo "tests/python_lane.sh: error: no Python $version found (neither" \
        "$pyenv_root/versions/$version.* nor python$version on PATH):" \
        "install it (pyenv install $version) or pick another version" >&2
    exit 2
fi
venv="${KERASMP_PYTHON_VENV:-}"
if [[ -z "$venv" ]]; then
    tmp="$(mktemp -d "/tmp/kerasmp-python-$version.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    venv="$tmp/venv"
fi
if [[ ! -x "$venv/bin/python" ]]; then
    "$base" -m venv "$venv" || exit 1
fi
# The dev extra's test tools, less PyTorch (and what needs it) and the
# backends, which the extras below bring.
tools="$("$venv/bin/python" - <<'PY'
import re, tomllib
dev = tomllib.load(open("pyproject.toml", "rb"))["project"][
    "optional-dependencies"]["dev"]
skip = {"torch", "litert-torch", "tensorflow", "jax"}
print(" ".join(d for d in dev
               if re.split(r"[\[<>=!~ ]", d)[0] not in skip))
PY
)" || exit 1
# shellcheck disable=SC2086  # one argument per requirement
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -e ".[jax,tensorflow,plot,onnx,tflite]" $tools || exit 1
echo "== $("$venv/bin/python" - <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
def said(name):
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"no {name}"
names = ["keras", "jax", "jaxlib", "tensorflow", "numpy", "keras-hub"]
print(f"Python {sys.version.split()[0]}: "
      + ", ".join(said(n) for n in names) + " (no torch)")
PY
) (in $venv)"
# This checkout's kerasmp, and the environment's `python` first on PATH:
# run.sh runs `python`.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PATH="$venv/bin:$PATH" bash tests/run.sh "$@"
