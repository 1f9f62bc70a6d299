"""Fit time with Float8Monitor over fit time without, on a float8 fit.

The digits transformer of `float8_accuracy.py` (keras-hub TransformerEncoder
x2, 12 float8 layers) under `kerasmp.Policy("float8_mixed_bfloat16")`, batch
64, 22 steps per epoch. Configurations, from the same weights, each warmed
up (traced) once, then cycled through `--trials` times in one process,
starting with a different one each trial:

- `plain`: no callback;
- `monitor`: `Float8Monitor()` (defaults: every 10 steps, no replayed
  batch: scale, amax, history max, amax ratio of all three tensors and the
  kernel fractions of every float8 layer);
- `monitor_every_step`: the same every step (`every_n_steps=1`);
- `monitor_data`: `Float8Monitor(every_n_steps=20, data=(x[:64], y[:64]))`
  (also the inputs' and output gradients' fractions, one replayed batch
  every 20 steps).

Reported: the median over trials of each configuration's wall time over
plain's, and the ratio of total process CPU times. Target: monitor / plain
<= 1.05.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/float8_overhead.py --trials 7
    KERAS_BACKEND=jax python benchmarks/float8_overhead.py
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

import float8_accuracy  # noqa: E402  (this directory: the same model)
import keras  # noqa: E402

import kerasmp  # noqa: E402
from kerasmp.callbacks import Float8Monitor  # noqa: E402
from kerasmp.data import load_digits  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    (x, y), _ = load_digits()
    x = x.reshape(-1, 8, 8)
    keras.utils.set_random_seed(0)
    kerasmp.set_global_policy("float8_mixed_bfloat16")
    configs = {
        "plain": lambda: [],
        "monitor": lambda: [Float8Monitor()],
        "monitor_every_step": lambda: [Float8Monitor(every_n_steps=1)],
        "monitor_data": lambda: [Float8Monitor(every_n_steps=20,
                                               data=(x[:64], y[:64]))],
    }
    models = {}
    for name in configs:
        model = float8_accuracy.build("transformer")
        model.compile(keras.optimizers.Adam(1e-3),
                      "sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=64, epochs=1, verbose=0,
                  callbacks=configs[name]())  # warm-up: trace
        models[name] = model
    walls = {n: [] for n in configs}
    cpus = {n: 0.0 for n in configs}
    names = list(configs)
    for trial in range(args.trials):
        order = names[trial % len(names):] + names[:trial % len(names)]
        for name in order:
            callbacks = configs[name]()
            w0, c0 = time.perf_counter(), time.process_time()
            models[name].fit(x, y, batch_size=64, epochs=args.epochs,
                             verbose=0, callbacks=callbacks)
            walls[name].append(time.perf_counter() - w0)
            cpus[name] += time.process_time() - c0
    ratios = {}
    for name in names[1:]:
        per_trial = [a / b for a, b in zip(walls[name], walls["plain"])]
        ratios[name] = {
            "wall_ratio_median": statistics.median(per_trial),
            "cpu_time_ratio": cpus[name] / cpus["plain"],
        }
    steps = args.epochs * -(-len(x) // 64)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc)
        .isoformat(timespec="seconds"),
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "trials": args.trials, "steps_per_fit": steps,
        "plain_ms_per_step": 1000 * statistics.median(walls["plain"]) / steps,
        "ratios": ratios, "walls": walls,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "walls"},
                     indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
