"""The cost of kerasmp in a two-process JAX run, against stock Keras.

Two JAX processes on 127.0.0.1 (`jax.distributed.initialize`, gloo CPU
collectives, one CPU device each) train the same small MLP under
`keras.distribution.DataParallel` on the same global batches (each process
feeds its half), with `train_on_batch`:

- `stock`: processes that never import kerasmp (it is made unimportable),
  `keras.mixed_precision.set_global_policy("mixed_float16")` and
  `keras.optimizers.LossScaleOptimizer(SGD)`;
- `kerasmp`: `kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))`
  and `kerasmp.LossScaleOptimizer(SGD)`; its `compile` runs the settings
  check (a key-value exchange through JAX's coordination service) and each
  step agrees on whether the global gradients are finite.

With `--float32`, the pair again under float32 (stock Keras; kerasmp's
`Policy("float32")`, no loss scaling, its compile's check still runs).

Runs of the two alternate (stock, kerasmp, kerasmp, stock, ...), each run
a fresh pair of processes, so that drift in the machine's speed hits both
alike. Reported, from process 0 (the processes meet at every step's
collective):

- `step ratio`: median time per steady step (after `--warmup` steps), all
  runs of a kind pooled, kerasmp over stock; `run ratio`: the median of the
  per-run ratios (runs paired in order), a view of the noise;
- `CPU ratio`: the same with process 0's CPU time per step (all its
  threads), which other jobs on a shared machine disturb less;
- `first ratio`: `compile` plus the first `train_on_batch` (tracing, XLA
  compilation, and kerasmp's settings check), kerasmp over stock;
- `compile ratio`: the `compile` call alone.

Usage:
    nice -n 5 python benchmarks/multiprocess_overhead.py [--runs 3] \
        [--steps 150] [--warmup 20] [--float32] [--json PATH]
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from zoo.absent import BLOCK_KERASMP  # noqa: E402

from kerasmp._utils.devices import cpu_name  # noqa: E402

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    kind, precision = sys.argv[1], sys.argv[2]
    index, port, steps = int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    if kind == "stock":
        exec(BLOCK_KERASMP)
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2,
        process_id=index, initialization_timeout=120)
    import keras
    import numpy as np

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(auto_shard_dataset=False))
    keras.utils.set_random_seed(0)
    sgd = keras.optimizers.SGD(0.01)
    if kind == "stock":
        if precision == "mixed":
            keras.mixed_precision.set_global_policy("mixed_float16")
            optimizer = keras.optimizers.LossScaleOptimizer(sgd)
        else:
            optimizer = sgd
    else:
        import kerasmp
        if precision == "mixed":
            kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
            optimizer = kerasmp.LossScaleOptimizer(sgd)
        else:
            kerasmp.set_global_policy(kerasmp.Policy("float32"))
            optimizer = sgd
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(1),
    ])
    rng = np.random.default_rng(0)  # the same global batches everywhere
    x_all = rng.normal(size=(steps, 64, 64)).astype("float32")
    y_all = x_all[..., :1] * 0.5
    half = slice(index * 32, (index + 1) * 32)
    start = time.perf_counter()
    model.compile(optimizer, "mse")
    compiled = time.perf_counter()
    times, cpu = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logs = model.train_on_batch(x_all[step, half], y_all[step, half],
                                    return_dict=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print("RESULT " + json.dumps({
        "compile_s": compiled - start,
        "first_s": compiled - start + times[0],
        "times": times,
        "cpu": cpu,
        "loss": float(logs["loss"]),
    }))
    """
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(script, kind, precision, steps, timeout):
    """Process 0's result of one two-process run."""
    port = str(free_port())
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["KERAS_BACKEND"] = "jax"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    procs = [
        subprocess.Popen(
            [sys.executable, script, kind, precision, str(i), port,
             str(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env)
        for i in range(2)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines()
                     if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"{kind} worker failed:\n{err[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results[0]


def measure(script, precision, runs, steps, warmup, timeout):
    order = []
    for r in range(runs):  # stock, kerasmp, kerasmp, stock, ...
        order += ["stock", "kerasmp"] if r % 2 == 0 else ["kerasmp", "stock"]
    got = {"stock": [], "kerasmp": []}
    for kind in order:
        result = run_pair(script, kind, precision, steps, timeout)
        got[kind].append(result)
        steady = statistics.median(result["times"][warmup:])
        cpu = statistics.median(result["cpu"][warmup:])
        print(f"  {precision:7s} {kind:8s} step {steady * 1e3:7.3f} ms  "
              f"CPU {cpu * 1e3:7.3f} ms  first {result['first_s']:6.2f} s",
              flush=True)

    def steady(result):
        return result["times"][warmup:]

    med = {k: statistics.median([t for r in got[k] for t in steady(r)])
           for k in got}
    per_run = [statistics.median(steady(m)) / statistics.median(steady(s))
               for s, m in zip(got["stock"], got["kerasmp"])]
    cpu = {k: statistics.median([t for r in got[k] for t in r["cpu"][warmup:]])
           for k in got}
    first = {k: statistics.median(r["first_s"] for r in got[k]) for k in got}
    comp = {k: statistics.median(r["compile_s"] for r in got[k]) for k in got}
    return {
        "precision": precision,
        "stock_step_ms": med["stock"] * 1e3,
        "kerasmp_step_ms": med["kerasmp"] * 1e3,
        "step_ratio": med["kerasmp"] / med["stock"],
        "run_ratios": per_run,
        "run_ratio": statistics.median(per_run),
        "stock_cpu_ms": cpu["stock"] * 1e3,
        "kerasmp_cpu_ms": cpu["kerasmp"] * 1e3,
        "cpu_ratio": cpu["kerasmp"] / cpu["stock"],
        "stock_first_all_s": [r["first_s"] for r in got["stock"]],
        "kerasmp_first_all_s": [r["first_s"] for r in got["kerasmp"]],
        "stock_first_s": first["stock"],
        "kerasmp_first_s": first["kerasmp"],
        "first_ratio": first["kerasmp"] / first["stock"],
        "stock_compile_s": comp["stock"],
        "kerasmp_compile_s": comp["kerasmp"],
        "compile_ratio": comp["kerasmp"] / comp["stock"],
        "final_loss": {k: [r["loss"] for r in got[k]] for k in got},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--float32", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=os.path.join(
        HERE, "results", "multiprocess_overhead.json"))
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise ValueError(
            f"`steps` ({args.steps}) must exceed `warmup` ({args.warmup})")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(f"BLOCK_KERASMP = {BLOCK_KERASMP!r}\n" + WORKER)
        rows = [measure(script, "mixed", args.runs, args.steps, args.warmup,
                        args.timeout)]
        if args.float32:
            rows.append(measure(script, "float32", args.runs, args.steps,
                                args.warmup, args.timeout))
    header = (f"{'policy':8s} {'stock ms':>9s} {'kerasmp ms':>10s} "
              f"{'step ratio':>10s} {'run ratio':>9s} {'CPU ratio':>9s} "
              f"{'first s':>15s} "
              f"{'first ratio':>11s} {'compile ratio':>13s}")
    print(header)
    for row in rows:
        print(f"{row['precision']:8s} {row['stock_step_ms']:9.3f} "
              f"{row['kerasmp_step_ms']:10.3f} {row['step_ratio']:10.3f} "
              f"{row['run_ratio']:9.3f} {row['cpu_ratio']:9.3f} "
              f"{row['stock_first_s']:6.2f} / {row['kerasmp_first_s']:5.2f} "
              f"{row['first_ratio']:11.3f} {row['compile_ratio']:13.3f}")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "machine": cpu_name(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "command": "python benchmarks/multiprocess_overhead.py "
                   + " ".join(sys.argv[1:]),
        "runs": args.runs, "steps": args.steps, "warmup": args.warmup,
        "processes": 2, "devices_per_process": 1,
        "global_batch": 64, "model": "MLP 64-256-256-1, SGD, mse",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
