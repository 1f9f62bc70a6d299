"""GPU benchmark: float32 (highest / TF32) vs mixed_bfloat16 vs mixed_float16.

Run through `benchmarks/gpu/run.sh OUTDIR`, which sets up the environment
(JAX backend, kerasmp from the checkout, keras from wheels if needed). Uses
`kerasmp.apps.bench` with the "gpu" preset (or "smoke" with `--smoke`) and
writes `OUTDIR/table.txt` and `OUTDIR/result.json`, rewritten after each
policy so that a run stopped early keeps what it measured. Ratios are
relative to float32 with matmul precision "highest" (true float32), which
runs last because it is the slowest.
"""

import argparse
import json
import os
import sys

POLICIES = ("float32_highest", "float32", "mixed_bfloat16", "mixed_float16")
RUN_ORDER = ("float32", "mixed_bfloat16", "mixed_float16", "float32_highest")
# --float8: float8 training (kerasmp.float8) against bfloat16, the baseline
# of the reported H100/H200 gains (1.25-1.4x: torchtitan Llama3-8B 5,760 ->
# 7,186 tokens/s; Megatron 13B 0.34 -> 0.24 s/step). Simulated (slower) on
# CPUs; on Hopper XLA rewrites the quantize-dequantize pairs into FP8 GEMMs.
FLOAT8_POLICIES = ("mixed_bfloat16", "float8_mixed_bfloat16")
FLOAT8_ANCHOR = "expected on H100/H200: x1.25-1.40 steps/s over mixed_bfloat16"


def _write(out, result, command):
    from kerasmp.apps import bench

    result = dict(result, command=command,
                  tensorflow_imported="tensorflow" in sys.modules)
    table = bench.format_table(result)
    if result["device_kind"] != "gpu":
        table += ("\n\nnote: no GPU visible to JAX; these are CPU numbers "
                  "(use --smoke on a CPU).")
    if not result["complete"]:
        table += "\n\nnote: partial result (the run has not finished)."
    with open(os.path.join(out, "table.txt"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for table.txt and result.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model: the same code path on any device")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--float8", action="store_true",
                        help="float8_mixed_bfloat16 vs mixed_bfloat16")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")

    import keras

    from kerasmp.apps import bench

    if keras.backend.backend() != "jax":
        print("bench_gpu.py: set KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    command = "benchmarks/gpu/run.sh OUTDIR" + (
        " --smoke" if args.smoke else "") + (
        " --float8" if args.float8 else "") + (
        f" --batch-size {args.batch_size}" if args.batch_size else "")
    policies = FLOAT8_POLICIES if args.float8 else POLICIES
    result = bench.run_bench(
        "smoke" if args.smoke else "gpu", policies=policies,
        run_order=policies if args.float8 else RUN_ORDER,
        batch_size=args.batch_size,
        on_progress=lambda partial: _write(args.out, partial, command),
    )
    table = _write(args.out, result, command)
    if args.float8:
        table += "\n\n" + FLOAT8_ANCHOR
    print()
    print(table)
    print(f"\nwrote {args.out}/table.txt and {args.out}/result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
