#!/usr/bin/env bash
# GPU benchmark of kerasmp on one NVIDIA GPU, JAX backend, no TensorFlow.
#
#   benchmarks/gpu/run.sh OUTDIR [--smoke] [--float8] [--wheels DIR] [--batch-size N]
#
# A transformer encoder (token ids through an embedding of 32768 x 1024, then
# 4 blocks of d_model 1024, 16 heads, seq 512; batch 128: 64k tokens a step;
# --batch-size to change) trained under float32 with matmul precision "highest",
# float32 with the default precision (TF32 on Ampere and later),
# mixed_bfloat16 and mixed_float16 (with kerasmp's LossScaleOptimizer), in
# one process; median steps/s over 3 timed calls of 15 steps after a warm-up,
# and XLA's memory plan of each compiled train step. float32 "highest" runs
# last, and the files are rewritten after each policy, so a run cut short
# still leaves the policies it finished. Writes OUTDIR/table.txt,
# OUTDIR/result.json and OUTDIR/env.txt. Sized to take a few minutes on one
# H100/H200 (estimated from FLOPs: not yet run on a GPU); stopped after 7.5
# minutes (`timeout`) so the whole run stays under eight.
#
# Needs: python3 with a CUDA build of jax, and keras (+ its small
# pure-Python dependencies: absl-py, rich, namex, h5py, optree, ml-dtypes,
# packaging) importable. If keras is missing it is installed, without any
# network access, from a folder of wheels: --wheels DIR, else $KERASMP_WHEELS,
# else .whl/ at the repository root. Make that folder on a machine with
# network access, e.g. for Python 3.12 on x86-64:
#   python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl keras==3.15.1 namex optree
# kerasmp itself is imported from this checkout (PYTHONPATH), never
# installed; TensorFlow is never imported.
#
# --float8 compares float8_mixed_bfloat16 (kerasmp.float8: Keras's float8
# training for the large Dense/EinsumDense layers) with mixed_bfloat16
# instead; expected on H100/H200: 1.25-1.4x steps/s (the anchor printed
# under the table).
#
# --smoke runs the same code path on a tiny model (any device, seconds): the
# test suite runs it on a CPU.
set -euo pipefail

usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
out="$1"; shift
smoke=""
wheels="${KERASMP_WHEELS:-}"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke="--smoke"; shift ;;
    --float8) extra+=(--float8); shift ;;
    --wheels) [ $# -ge 2 ] || usage; wheels="$2"; shift 2 ;;
    --batch-size) [ $# -ge 2 ] || usage; extra+=(--batch-size "$2"); shift 2 ;;
    *) usage ;;
  esac
done

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

export KERAS_BACKEND=jax
export TF_CPP_MIN_LOG_LEVEL=2
export PYTHONUNBUFFERED=1
# Let XLA take the memory it needs instead of 75% of the GPU up front.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"

if ! "$python" -c "import jax" 2>/dev/null; then
  echo "run.sh: $python cannot import jax; install a CUDA build of jax." >&2
  exit 1
fi
if ! "$python" -c "import keras" 2>/dev/null; then
  [ -n "$wheels" ] || wheels="$root/.whl"
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "run.sh: keras is not installed and there are no wheels in" \
         "'$wheels' (see --wheels)." >&2
    exit 1
  fi
  site="$(mktemp -d)/site"
  echo "== installing $(ls "$wheels"/*.whl | wc -l) wheels from $wheels"
  "$python" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -a)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    2>/dev/null || echo "nvidia-smi: not available"
  "$python" - <<'PY'
import sys, jax, keras
print("python", sys.version.split()[0])
print("jax", jax.__version__, "devices", jax.devices())
print("keras", keras.__version__)
PY
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

limit=450  # seconds: the whole run stays under eight minutes
runner=()
if command -v timeout >/dev/null 2>&1; then runner=(timeout "$limit"); fi
"${runner[@]}" "$python" "$here/bench_gpu.py" "$out" $smoke "${extra[@]}"
