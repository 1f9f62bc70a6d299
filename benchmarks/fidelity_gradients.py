"""Where the fidelity language model's gradients sit in float16's range.

Issue 38 asks for a model "large enough that float16 matters: activations
and gradients that span its range, which the run's `gradient_report`
shows". This trains the language model of `benchmarks/fidelity_run.py`
(same config, seed and data order as its float32 run) in float32 and, at a
few points of training, loads its weights into the same model built under
`kerasmp.Policy("mixed_float16")` and runs `kerasmp.debug.gradient_report`
on a training batch (loss scales 2^0 to 2^24). Per point:

- the gradients without loss scaling (scale 1): the fraction of elements
  that are nonzero in float32 and flush to zero in float16, and the
  relative error against float32;
- the first scale that overflows (the top of the range) and the scale the
  report recommends;
- the float32 gradients' magnitudes: the share of nonzero elements below
  float16's smallest subnormal (2^-24, lost), below its smallest normal
  (2^-14, kept with fewer bits), and the largest;
- the float32 activations of each block: their largest magnitude against
  float16's largest finite value (65504).

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/fidelity_gradients.py \
        [--points 0 200 2000] [--json PATH]
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import keras  # noqa: E402
from fidelity_run import LM_CONFIG  # noqa: E402
from fidelity_run import _lm_data  # noqa: E402
from fidelity_run import build  # noqa: E402

import kerasmp  # noqa: E402
from kerasmp._utils.devices import cpu_name  # noqa: E402

SMALLEST_SUBNORMAL = 2.0 ** -24
SMALLEST_NORMAL = 2.0 ** -14
FLOAT16_MAX = 65504.0


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _float32_gradients(model, x, y):
    """The float32 gradients of one batch, as NumPy arrays (any backend)."""
    from kerasmp._utils.arrays import to_numpy
    from kerasmp.debug.batch import gradients

    _, grads = gradients(model, x, y, None, _loss(), 1.0, True)
    return [to_numpy(g).astype("float64").ravel() for g in grads]


def _magnitudes(gradients):
    flat = np.concatenate(gradients)
    nonzero = np.abs(flat[flat != 0])
    return {
        "elements": int(flat.size),
        "nonzero": int(nonzero.size),
        "below_smallest_subnormal": float(
            np.mean(nonzero < SMALLEST_SUBNORMAL)),
        "below_smallest_normal": float(np.mean(nonzero < SMALLEST_NORMAL)),
        "median": float(np.median(nonzero)),
        "max": float(nonzero.max()),
    }


def _activation_peaks(model, x):
    kept = ("embed", "block", "final_norm", "logits")
    names = [layer.name for layer in model.layers
             if layer.name.startswith(kept)]
    probe = keras.Model(model.input,
                        [model.get_layer(n).output for n in names])
    outs = probe(x, training=False)
    return {n: float(np.max(np.abs(keras.ops.convert_to_numpy(o))))
            for n, o in zip(names, outs)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", type=int,
                        default=[0, 200, 2000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join(
        HERE, "results",
        f"fidelity_gradients_{keras.backend.backend()}.json"))
    args = parser.parse_args(argv)
    cfg = dict(LM_CONFIG)
    start = time.time()

    keras.utils.set_random_seed(args.seed)
    keras.config.set_dtype_policy("float32")
    model = build("lm", cfg)
    model.compile(keras.optimizers.Adam(cfg["lr"]), _loss(), jit_compile=True)
    batches, _, info = _lm_data(args.seed, max(args.points), cfg)
    probe_x, probe_y = next(_lm_data(args.seed + 1000, 1, cfg)[0])

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    mixed = build("lm", cfg)
    mixed.compile(keras.optimizers.Adam(cfg["lr"]), _loss())
    kerasmp.set_global_policy("float32")

    rows, done = [], 0
    for point in sorted(args.points):
        for _ in range(point - done):
            x, y = next(batches)
            model.train_on_batch(x, y)
        done = point
        mixed.set_weights(model.get_weights())
        report = kerasmp.debug.gradient_report(mixed, probe_x, probe_y,
                                               loss=_loss())
        at1 = report.at(1.0)
        row = {
            "step": point,
            "loss_float32": report.loss_float32,
            "unscaled_underflow": at1.underflow,
            "unscaled_rel_error": at1.rel_error,
            "first_overflow": report.first_overflow,
            "recommended_scale": report.recommended_scale,
            "float32_gradients": _magnitudes(
                _float32_gradients(model, probe_x, probe_y)),
            "activation_peaks": _activation_peaks(model, probe_x),
            "report": report.to_dict(),
        }
        rows.append(row)
        g = row["float32_gradients"]
        print(f"step {point:5d}  loss {row['loss_float32']:.3f}  "
              f"unscaled underflow {at1.underflow:.2%}  "
              f"rel err {at1.rel_error:.2e}  "
              f"first overflow {report.first_overflow}  "
              f"recommended {report.recommended_scale}  "
              f"grads <2^-24 {g['below_smallest_subnormal']:.2%} "
              f"<2^-14 {g['below_smallest_normal']:.2%} "
              f"max {g['max']:.2e}  "
              f"peak activation {max(row['activation_peaks'].values()):.1f}",
              flush=True)

    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_name()}, {os.cpu_count()} logical CPUs",
        "python": platform.python_version(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "command": "python " + " ".join(
            [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "config": cfg,
        "corpus": info,
        "seconds": round(time.time() - start, 1),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json} ({out['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
