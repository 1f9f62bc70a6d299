"""Step-time overhead of kerasmp.LossScaleOptimizer over the stock one.

Under mixed_float16, an MLP, a small CNN and the same CNN with
BatchNormalization are trained with Adam wrapped in
`keras.optimizers.LossScaleOptimizer` (stock) and in
`kerasmp.optimizer.LossScaleOptimizer` (both with the stock settings), in the
same process. Timed blocks of steps alternate between the two (A B, B A, ...)
so that drift in the machine's speed hits both alike; the first block of
each (tracing, compilation) is excluded. Reported: the median time per step
of each and their ratio (target: at most 1.03), for

- `train step`: a whole compiled training step (`fit`, steps_per_execution
  set to the block length so Python runs once per block), and
- `apply only`: the optimizer's update alone on fixed gradients, compiled
  (`tf.function` / `jax.jit`; eager on PyTorch), the harshest view of the
  overhead.

The `CNN+BN` train step includes kerasmp's write-back of the batch-norm
moving statistics on skipped steps (see docs/monitoring.md); its
apply-only row equals the CNN's and is not run.

`ratio` is the ratio of the median wall times per step; `pair ratio` the
median (and interquartile range) of the per-pair ratios, a measure of the
noise; `CPU ratio` the same as `ratio` with this process's CPU time (all
threads), which other processes on a shared machine disturb less.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/optimizer_overhead.py \
        [--repeats 31] [--steps 10] [--models MLP CNN CNN+BN] \
        [--json results.json]
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
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kerasmp.optimizer import LossScaleOptimizer  # noqa: E402


def mlp():
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    ), ((784,), 256)


def cnn():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    ), ((28, 28, 1), 64)


def cnn_bn():
    """The CNN with BatchNormalization after each convolution: its forward
    pass assigns the moving statistics, which kerasmp's optimizer puts back
    on a skipped step (the stock one leaves the skipped step's values)."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    ), ((28, 28, 1), 64)


MODELS = {"MLP": mlp, "CNN": cnn, "CNN+BN": cnn_bn}

OPTIMIZERS = {
    "stock": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3)
    ),
    "kerasmp": lambda: LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
}


def _block(run, steps):
    """Wall and CPU (all threads of this process) seconds per step."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return (
        (time.perf_counter() - wall) / steps,
        (time.process_time() - cpu) / steps,
    )


def _interleaved(runners, repeats, steps):
    """Times `repeats` blocks of each runner, alternating the order."""
    names = list(runners)
    for name in names:  # warm-up: tracing and compilation, not counted
        runners[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(_block(runners[name], steps))
    return times


def train_step_runners(build, steps, jit_compile="auto"):
    runners = {}
    (model0, (shape, batch)) = build()
    weights = model0.get_weights()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps,) + shape).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    for name, make in OPTIMIZERS.items():
        model, _ = build()
        model.set_weights(weights)
        model.compile(
            make(),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            # Keras runs one step per call on PyTorch (it refuses more).
            steps_per_execution=(
                1 if keras.backend.backend() == "torch" else steps),
            jit_compile=jit_compile,
        )
        runners[name] = lambda model=model: model.fit(
            x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False
        )
    return runners


def apply_only_runners(build, steps):
    runners = {}
    model, _ = build()
    rng = np.random.default_rng(1)
    grads = [
        keras.ops.convert_to_tensor(rng.normal(size=w.shape).astype("float32"))
        for w in model.trainable_weights
    ]
    backend = keras.backend.backend()
    for name, make in OPTIMIZERS.items():
        variables = [keras.Variable(w) for w in model.get_weights()]
        opt = make()
        opt.build(variables)
        if backend == "tensorflow":
            import tensorflow as tf

            def make_run(opt, variables):
                @tf.function
                def run():
                    for _ in range(steps):  # unrolled: one call per block
                        opt.apply(grads, variables)

                return run

            runners[name] = make_run(opt, variables)
        elif backend == "jax":
            import jax

            def loop(state, opt=opt):
                def body(_, s):
                    return opt.stateless_apply(s[1], grads, s[0])

                return jax.lax.fori_loop(0, steps, body, state)

            loop = jax.jit(loop)
            state = (
                [v.value for v in variables],
                [v.value for v in opt.variables],
            )
            runners[name] = lambda loop=loop, state=state: (
                jax.block_until_ready(loop(state))
            )
        elif backend == "torch":
            # Eager, as Keras's own PyTorch train step (no jit_compile).
            def run(opt=opt, variables=variables):
                for _ in range(steps):
                    opt.apply(grads, variables)

            runners[name] = run
        else:
            raise SystemExit(f"unsupported backend: {backend}")
    return runners


def summarize(times):
    wall = {name: [t[0] for t in ts] for name, ts in times.items()}
    cpu = {name: [t[1] for t in ts] for name, ts in times.items()}
    med = {name: statistics.median(t) for name, t in wall.items()}
    cpu_med = {name: statistics.median(t) for name, t in cpu.items()}
    pair_ratios = [k / s for k, s in zip(wall["kerasmp"], wall["stock"])]
    q = statistics.quantiles(pair_ratios, n=4)
    return {
        "stock_ms": med["stock"] * 1e3,
        "kerasmp_ms": med["kerasmp"] * 1e3,
        "ratio": med["kerasmp"] / med["stock"],
        "pair_ratio_median": statistics.median(pair_ratios),
        "pair_ratio_iqr": [q[0], q[2]],
        "cpu_ratio": cpu_med["kerasmp"] / cpu_med["stock"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS)
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--jit-compile", action="store_true",
        help="compile the train steps with XLA (both optimizers); on CPUs "
        "whose TensorFlow float16 kernels are slow without it",
    )
    args = parser.parse_args(argv)

    keras.config.set_dtype_policy("mixed_float16")
    rows = []
    for model_name in args.models:
        build = MODELS[model_name]
        for kind, make_runners in (
            ("train step", train_step_runners),
            ("apply only", apply_only_runners),
        ):
            if model_name == "CNN+BN" and kind == "apply only":
                continue  # the same optimizer update as the CNN's
            if kind == "train step":
                runners = make_runners(build, args.steps,
                                       jit_compile=args.jit_compile or "auto")
            else:
                runners = make_runners(build, args.steps)
            times = _interleaved(runners, args.repeats, args.steps)
            rows.append({"model": model_name, "what": kind, **summarize(times)})

    header = (
        f"{'model':<6} {'what':<11} {'stock ms':>9} {'kerasmp ms':>11} "
        f"{'ratio':>6} {'pair ratio (IQR)':>24} {'CPU ratio':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        iqr = (
            f"{r['pair_ratio_median']:.3f} ({r['pair_ratio_iqr'][0]:.3f}-"
            f"{r['pair_ratio_iqr'][1]:.3f})"
        )
        print(
            f"{r['model']:<6} {r['what']:<11} {r['stock_ms']:>9.3f} "
            f"{r['kerasmp_ms']:>11.3f} {r['ratio']:>6.3f} {iqr:>24} "
            f"{r['cpu_ratio']:>9.3f}"
        )
    train = [r["ratio"] for r in rows if r["what"] == "train step"]
    print(f"\nworst train-step ratio: {max(train):.3f} (target <= 1.03)")

    if args.json:
        import tensorflow as tf

        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "backend": keras.backend.backend(),
            "policy": "mixed_float16",
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "devices": [d.name for d in tf.config.list_physical_devices()],
            },
            "versions": {
                "python": platform.python_version(),
                "keras": keras.__version__,
                "tensorflow": tf.__version__,
            },
            "repeats": args.repeats,
            "steps_per_block": args.steps,
            "rows": rows,
            "target_ratio": 1.03,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
