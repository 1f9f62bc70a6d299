"""`jit_compile=True` on PyTorch (`torch.compile`): kerasmp vs stock Keras.

A small transformer (Embedding, MultiHeadAttention, LayerNormalization, a
Dense feed-forward block; about 4,500 parameters, sequences of 16 tokens)
is trained with `jit_compile=True` under

- `stock mixed_float16`: Keras alone (kerasmp never imported), Keras's
  `mixed_float16` policy and its LossScaleOptimizer;
- `kerasmp mixed_float16`: `kerasmp.Policy("mixed_float16")` (its float32
  rules, kerasmp's LossScaleOptimizer and train step);
- `stock float32` and `kerasmp float32` (kerasmp imported, float32: its
  train step, no loss scaling).

Each configuration runs in a fresh process (Dynamo's caches and its
per-code recompile limit are process-wide), one after another in one
invocation, alternating stock and kerasmp. Measured in each:

- `first epoch`: wall and CPU seconds of the first epoch (Dynamo and
  Inductor compile there), CPU time being this process's, all threads,
  which other processes on a shared machine disturb less;
- `steady ms/step`: the median wall time of a step in the later epochs;
- `eager ms/step`: the same model, `jit_compile=False`, for reference;
- `recompiles`: Dynamo's "Recompiling function" records
  (`TORCH_LOGS=recompiles`) over the whole fit, those whose frame or guard
  names a file of kerasmp, and the "hit config.recompile_limit" warnings;
- `graph breaks`: Dynamo's graph-break counter.

Usage:
    KERAS_BACKEND=torch python benchmarks/torch_compile.py \
        [--epochs 3] [--samples 256] [--batch-size 16] \
        [--configs stock16 kerasmp16 kerasmp32 stock32] \
        [--json benchmarks/results/torch_compile.json]
"""

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "stock16": ("stock", "mixed_float16"),
    "kerasmp16": ("kerasmp", "mixed_float16"),
    "stock32": ("stock", "float32"),
    "kerasmp32": ("kerasmp", "float32"),
}


def model(keras):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(64, 16)(tokens)
    attention = keras.layers.MultiHeadAttention(2, 8)(x, x)
    x = keras.layers.LayerNormalization()(x + attention)
    ffn = keras.layers.Dense(32, activation="gelu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(16)(ffn))
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(4, activation="softmax")(x)
    return keras.Model(tokens, outputs)


class _DynamoLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.recompiles = []
        self.limits = []

    def emit(self, record):
        message = record.getMessage()
        if "Recompiling function" in message:
            self.recompiles.append(message)
        elif "recompile_limit" in message:
            self.limits.append(message)


def child(name, args):
    """One configuration, in this process: a dict of its measurements."""
    os.environ["KERAS_BACKEND"] = "torch"
    library, policy = CONFIGS[name]
    if library == "kerasmp":
        sys.path.insert(0, ROOT)
        import kerasmp

        kerasmp.set_global_policy(kerasmp.Policy(policy))
        kerasmp_dir = os.path.dirname(kerasmp.__file__)
    else:
        import keras

        keras.config.set_dtype_policy(policy)
        kerasmp_dir = os.path.join(ROOT, "kerasmp")
    import keras
    import numpy as np
    import torch

    assert "kerasmp" in sys.modules or library == "stock"
    assert "kerasmp" not in sys.modules or library == "kerasmp"
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (args.samples, 16)).astype("int32")
    y = rng.integers(0, 4, (args.samples,))

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = []
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_start = (time.perf_counter(), time.process_time())

        def on_epoch_end(self, epoch, logs=None):
            wall, cpu = self.epoch_start
            self.epochs.append(
                (time.perf_counter() - wall, time.process_time() - cpu)
            )

        def on_train_batch_begin(self, batch, logs=None):
            self.step_start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.steps.append(time.perf_counter() - self.step_start)

    log = _DynamoLog()
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(log)
    # The recompile records go to the handler; stderr would get hundreds of
    # lines.
    for handler in logging.getLogger("torch").handlers:
        handler.setLevel(logging.ERROR)

    results = {"config": name, "library": library, "policy": policy}
    steps_per_epoch = -(-args.samples // args.batch_size)
    for jit in (True, False):
        net = model(keras)
        net.compile("adam", "sparse_categorical_crossentropy",
                    jit_compile=jit)
        clock = Clock()
        net.fit(x, y, batch_size=args.batch_size,
                epochs=args.epochs if jit else 2, verbose=0,
                callbacks=[clock])
        steady = statistics.median(clock.steps[steps_per_epoch:])
        if jit:
            from torch._dynamo.utils import counters

            results.update(
                params=int(net.count_params()),
                first_epoch_s=clock.epochs[0][0],
                first_epoch_cpu_s=clock.epochs[0][1],
                steady_ms=1000 * steady,
                recompiles=len(log.recompiles),
                recompiles_into_kerasmp=sum(
                    kerasmp_dir in r for r in log.recompiles
                ),
                recompile_limit_lines=len(log.limits),
                into_kerasmp=[r for r in log.recompiles if kerasmp_dir in r],
                limit_lines=log.limits,
                graph_breaks=sum(counters["graph_break"].values()),
                final_loss=float(net.history.history["loss"][-1]),
                recompile_frames=sorted(
                    {r.split("Recompiling function ")[1].split("\n")[0]
                     .replace(ROOT + "/", "").split("site-packages/")[-1]
                     for r in log.recompiles}
                ),
            )
            logging.getLogger("torch._dynamo").removeHandler(log)
            torch._logging.set_logs()
        else:
            results["eager_ms"] = 1000 * steady
    return results


def _run_child(name, args):
    command = [sys.executable, os.path.abspath(__file__), "--child", name,
               "--epochs", str(args.epochs), "--samples", str(args.samples),
               "--batch-size", str(args.batch_size)]
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1])
    result["process_s"] = time.perf_counter() - started
    return result


def _machine():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True,
                             check=False).stdout
        model_name = next(ln.split(":", 1)[1].strip()
                          for ln in out.splitlines()
                          if ln.startswith("Model name"))
    except (OSError, StopIteration):
        model_name = platform.processor()
    return f"{model_name}, {os.cpu_count()} logical CPUs"


def _ratios(results):
    by = {r["config"]: r for r in results}
    ratios = {}
    for bits in ("16", "32"):
        ours, stock = by.get("kerasmp" + bits), by.get("stock" + bits)
        if ours is None or stock is None:
            continue
        ratios["float" + bits] = {
            key: ours[key] / stock[key]
            for key in ("first_epoch_s", "first_epoch_cpu_s", "steady_ms",
                        "eager_ms")
        }
    return ratios


def _table(results, ratios):
    head = ("config", "first epoch s", "CPU s", "steady ms/step",
            "eager ms/step", "recompiles", "in kerasmp", "limit lines",
            "graph breaks")
    rows = [head] + [
        (r["config"], f"{r['first_epoch_s']:.1f}",
         f"{r['first_epoch_cpu_s']:.1f}", f"{r['steady_ms']:.1f}",
         f"{r['eager_ms']:.1f}", str(r["recompiles"]),
         str(r["recompiles_into_kerasmp"]), str(r["recompile_limit_lines"]),
         str(r["graph_breaks"]))
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths))
             for row in rows]
    for policy, values in ratios.items():
        lines.append(
            f"kerasmp/stock {policy}: first epoch "
            f"{values['first_epoch_s']:.3f} (CPU "
            f"{values['first_epoch_cpu_s']:.3f}), steady step "
            f"{values['steady_ms']:.3f}, eager step {values['eager_ms']:.3f}"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                        default=["stock16", "kerasmp16", "kerasmp32",
                                 "stock32"])
    parser.add_argument("--json")
    parser.add_argument("--child", choices=sorted(CONFIGS),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    started = datetime.datetime.now(datetime.timezone.utc)
    results = [_run_child(name, args) for name in args.configs]
    ratios = _ratios(results)
    print(_table(results, ratios))
    import keras
    import torch

    record = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "load_average_after": os.getloadavg(),
        "command": "KERAS_BACKEND=torch python benchmarks/torch_compile.py "
        + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "keras": keras.__version__,
        "torch": torch.__version__,
        "results": results,
        "kerasmp_over_stock": ratios,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
