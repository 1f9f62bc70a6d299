"""Fit time with LossScaleMonitor + NonFiniteMonitor over fit time without.

The CPU CNN of `benchmarks/optimizer_overhead.py` (28x28x1: Conv16-pool-
Conv32-pool-Dense64-Dense10, batch 64) trains on synthetic data under
`kerasmp.Policy("mixed_float16")` with `kerasmp.optimizer.LossScaleOptimizer`
(Adam), on the CPU, one step per call (`steps_per_execution=1`, where the
per-step callback work weighs most).

Four copies of the model start from the same weights: "plain" (no callbacks),
"monitors" (`LossScaleMonitor()` and `NonFiniteMonitor()`, defaults, new
instances for every fit), "sync" (a no-op
`LambdaCallback(on_train_batch_end=...)`: what any batch-end callback costs by
turning off Keras's asynchronous callback dispatch, as `NonFiniteMonitor` and
`TerminateOnNaN` do) and "performance" (`kerasmp.callbacks.performance.
PerformanceMonitor()` alone, default arguments). Each is warmed up (traced)
once, then fits of `--epochs` epochs cycle through the configurations, starting
with a different one each trial, in one process. Reported: the median over
trials of the wall-time ratio to "plain", the ratio of median process CPU times
(less sensitive to other processes on a shared machine), and the host-side
Python cost of the monitors per step, timed alone. Target: monitors/plain <=
1.02 and performance/plain <= 1.02.

What the monitors cost per step: kerasmp's train step (installed by
`compile`, so in every configuration: two extra scalars in the logs, a
five-number record of the step, the skipped-step undo) is the same with and
without them; they add reading the record (one transfer), a reference to
the batch (kept on the device for `locate`: `NonFiniteMonitor(locate=True)`
turns it on), a few Python comparisons in
`NonFiniteMonitor.on_train_batch_end`, and synchronous rather than
thread-pooled dispatch of batch callbacks (any callback with
`on_train_batch_end` does that). Nothing is located unless an event happens.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/callback_overhead.py
    KERAS_BACKEND=jax python benchmarks/callback_overhead.py --trials 5
    python benchmarks/callback_overhead.py --jit-compile  # TF under XLA
    python benchmarks/callback_overhead.py --quick
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import optimizer_overhead  # noqa: E402  (this directory: the same CNN)

from kerasmp.callbacks import LossScaleMonitor  # noqa: E402
from kerasmp.callbacks import NonFiniteMonitor  # noqa: E402
from kerasmp.callbacks.performance import PerformanceMonitor  # noqa: E402
from kerasmp.optimizer import LossScaleOptimizer  # noqa: E402
from kerasmp.policy import Policy  # noqa: E402
from kerasmp.policy import set_global_policy  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build_cnn():
    """The CPU CNN of benchmarks/optimizer_overhead.py (28x28x1, logits)."""
    model, _ = optimizer_overhead.cnn()
    return model


def data(samples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    return x, y


def make_model(weights, jit_compile="auto"):
    model = build_cnn()
    model.set_weights(weights)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


CONFIGS = ("plain", "monitors", "sync", "performance")


def callbacks(config):
    """The callbacks of one configuration (new instances for every fit)."""
    if config == "monitors":
        return [LossScaleMonitor(), NonFiniteMonitor()]
    if config == "sync":
        # Any callback with a batch-end hook makes Keras dispatch batch
        # callbacks synchronously; this one does nothing else.
        return [keras.callbacks.LambdaCallback(on_train_batch_end=_noop)]
    if config == "performance":
        return [PerformanceMonitor()]
    return []


def _noop(batch, logs):
    pass


def timed_fit(model, x, y, batch_size, epochs, config):
    """(wall seconds, process CPU seconds) of one fit."""
    wall, cpu = time.perf_counter(), time.process_time()
    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=callbacks(config),
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert "loss_scale" in history.history  # logged by compile's step
    assert ("steps_per_second" in history.history) == (
        config == "performance"
    )
    return wall, cpu


def host_cost_per_step(model, x, y, batch_size, repeats=2000):
    """Seconds of Python the monitors add per step, measured alone.

    Replays, on the host only, what the monitors do after each step: the
    train function's wrapper (installed by compile) popping the batch
    reference and the step's record from the step's logs, and both
    monitors' `on_train_batch_end` on logs holding the same values Keras
    would pass (the step itself is not run). Wall-clock noise from other
    processes barely touches a loop this short.
    """
    from kerasmp import train_step as _train_step
    from kerasmp.train_step import logs as _logs

    lsm, nfm = LossScaleMonitor(), NonFiniteMonitor()
    params = {"epochs": 1, "steps": repeats, "verbose": 0}
    for cb in (lsm, nfm):
        cb.set_model(model)
        cb.set_params(params)
        cb.on_train_begin()
        cb.on_epoch_begin(0)
    steps = model.__dict__[_train_step._ATTR]
    batch = tuple(
        keras.ops.convert_to_tensor(a) for a in (x[:batch_size], y[:batch_size])
    )
    logs = {"loss": 2.3, "loss_scale": 32768.0, "skipped_steps": 0}
    step_logs = {
        "loss": keras.ops.convert_to_tensor(2.3),
        "loss_scale": keras.ops.convert_to_tensor(32768.0),
        "skipped_steps": keras.ops.convert_to_tensor(0),
        _logs.BATCH_KEY: batch,
        # The step's record: not skipped, counters 0, scale 2**15, finite.
        _logs.ROW_KEY: keras.ops.convert_to_tensor(
            np.array([0.0, 0.0, 0.0, 32768.0, 0.0], "float32")
        ),
    }
    start = time.perf_counter()
    for i in range(repeats):
        if hasattr(steps, "_take"):  # TensorFlow's train function
            steps._take(dict(step_logs))
        else:  # JAX's and PyTorch's host loop
            records = []
            steps.take_record(dict(step_logs), records)
            steps.finish(records)
        for cb in (lsm, nfm):
            cb.on_train_batch_begin(i)
            cb.on_train_batch_end(i, logs)
    elapsed = time.perf_counter() - start
    return elapsed / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--quick", action="store_true", help="3 trials on 512 samples"
    )
    parser.add_argument(
        "--jit-compile", action="store_true",
        help="compile every configuration's train step with XLA; on CPUs "
        "whose TensorFlow float16 kernels are slow without it",
    )
    parser.add_argument(
        "--out", default=os.path.join(RESULTS, "callback_overhead.json")
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.samples = 3, 512

    set_global_policy(Policy("mixed_float16"))
    keras.utils.set_random_seed(0)
    weights = build_cnn().get_weights()
    x, y = data(args.samples)
    steps = args.epochs * -(-args.samples // args.batch_size)

    # One model per configuration, same initial weights, warmed up (traced)
    # with its own callbacks; then fits cycle through the configurations,
    # starting at a different one each trial, so that load drift hits all.
    models = {}
    for name in CONFIGS:
        keras.utils.set_random_seed(0)
        models[name] = make_model(weights, args.jit_compile or "auto")
        warm = 2 * args.batch_size
        timed_fit(models[name], x[:warm], y[:warm], args.batch_size, 1, name)

    wall = {name: [] for name in CONFIGS}
    cpu = {name: [] for name in CONFIGS}
    for t in range(args.trials):
        k = t % len(CONFIGS)
        order = CONFIGS[k:] + CONFIGS[:k]
        for name in order:
            w, c = timed_fit(
                models[name], x, y, args.batch_size, args.epochs, name
            )
            wall[name].append(w)
            cpu[name].append(c)
        print(
            f"trial {t + 1}/{args.trials}: "
            + " ".join(f"{n} {wall[n][-1]:.3f}s" for n in CONFIGS)
            + " (wall)",
            flush=True,
        )

    host = host_cost_per_step(models["monitors"], x, y, args.batch_size)

    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(wall[a], wall[b]))

    ratio = paired("monitors", "plain")
    ratio_cpu = med_cpu["monitors"] / med_cpu["plain"]
    step_s = med["plain"] / steps
    print()
    print(f"{'config':<12} {'wall s':>8} {'ms/step':>8} {'CPU s':>8}")
    for name in CONFIGS:
        print(
            f"{name:<12} {med[name]:>8.3f} {med[name] / steps * 1e3:>8.2f} "
            f"{med_cpu[name]:>8.3f}"
        )
    print(
        f"monitors/plain: {ratio:.3f} wall (median of per-trial ratios), "
        f"{ratio_cpu:.3f} CPU time; target <= 1.02"
    )
    print(
        f"sync/plain (a no-op batch callback): {paired('sync', 'plain'):.3f} "
        f"wall, {med_cpu['sync'] / med_cpu['plain']:.3f} CPU; "
        f"monitors/sync: {paired('monitors', 'sync'):.3f} wall, "
        f"{med_cpu['monitors'] / med_cpu['sync']:.3f} CPU"
    )
    print(
        f"performance/plain (PerformanceMonitor): "
        f"{paired('performance', 'plain'):.3f} wall, "
        f"{med_cpu['performance'] / med_cpu['plain']:.3f} CPU; "
        "target <= 1.02"
    )
    print(
        f"host-side cost of the monitors alone: {host * 1e6:.1f} us/step = "
        f"{host / step_s:.5f} of a plain step ({step_s * 1e3:.1f} ms)"
    )

    result = {
        "benchmark": "callback_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "command": " ".join(
            ["KERAS_BACKEND=" + keras.backend.backend(), "python"] + sys.argv
        ),
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "policy": "kerasmp.Policy('mixed_float16')",
        "model": "CNN of benchmarks/optimizer_overhead.py: 28x28x1 Conv16-pool-"
        "Conv32-pool-Dense64-Dense10 (logits)",
        "samples": args.samples,
        "batch_size": args.batch_size,
        "epochs_per_fit": args.epochs,
        "steps_per_fit": steps,
        "trials": args.trials,
        "jit_compile": args.jit_compile or "auto",
        "configs": {
            "plain": "no callbacks",
            "monitors": "LossScaleMonitor() + NonFiniteMonitor()",
            "sync": "a no-op LambdaCallback(on_train_batch_end=...)",
            "performance": "PerformanceMonitor()",
        },
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "median_wall_s": med,
        "median_cpu_s": med_cpu,
        "ratio_wall_median_of_trials": ratio,
        "ratio_wall_of_medians": med["monitors"] / med["plain"],
        "ratio_cpu": ratio_cpu,
        "ratio_sync_wall": paired("sync", "plain"),
        "ratio_sync_cpu": med_cpu["sync"] / med_cpu["plain"],
        "ratio_monitors_over_sync_wall": paired("monitors", "sync"),
        "ratio_monitors_over_sync_cpu": med_cpu["monitors"] / med_cpu["sync"],
        "ratio_performance_wall": paired("performance", "plain"),
        "ratio_performance_cpu": med_cpu["performance"] / med_cpu["plain"],
        "host_cost_us_per_step": host * 1e6,
        "host_cost_fraction_of_plain_step": host / step_s,
        "target_ratio": 1.02,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
