"""Size and inference latency of float32 vs float16 exports, per format.

For a CNN (Conv2D + BatchNormalization) and a transformer block
(MultiHeadAttention, LayerNormalization, GELU), exports each format
(`keras`, `savedmodel`, `tflite`) in float32 and float16 with
`kerasmp.export.export`, then times each artifact in its own runtime:

- keras: the reloaded model called in a `tf.function` (graph mode),
- savedmodel: the `serving_default` signature of `tf.saved_model.load`,
- tflite: `ai_edge_litert` `Interpreter.invoke` (XNNPACK on CPU).

Latency is the median over repeated calls after a warm-up, at batch 1 and
batch 32. Prints a table and writes JSON. Needs the TensorFlow backend.

On a CPU, float16 is not faster: CPUs have no fast float16 matmul units, so
TensorFlow either upcasts or uses slow kernels; TFLite dequantizes its
float16 weights to float32 at load. Only the size halves. Speed claims need a
GPU (tensor cores), which this script reports when it finds one.

Usage:
    KERAS_BACKEND=tensorflow python benchmarks/export_inference.py
    KERAS_BACKEND=tensorflow python benchmarks/export_inference.py --quick
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

from kerasmp import export as kx  # noqa: E402

FORMATS = (("keras", ".keras"), ("savedmodel", ""), ("tflite", ".tflite"))


def build_cnn():
    inputs = keras.Input((32, 32, 3), name="pixels")
    x = inputs
    for filters in (32, 64, 128):
        x = layers.Conv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
        x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dense(256, activation="relu")(x)
    outputs = layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="cnn")


def build_transformer():
    inputs = keras.Input((64, 128), name="tokens")
    a = layers.MultiHeadAttention(4, 32)(inputs, inputs)
    x = layers.LayerNormalization()(inputs + a)
    f = layers.Dense(512, activation="gelu")(x)
    f = layers.Dense(128)(f)
    x = layers.LayerNormalization()(x + f)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="transformer")


def _paired_median_ms(fns, x, warmup, repeats):
    """Median ms per call of each fn in `fns`, calls interleaved so that
    background load on a shared machine hits every variant alike."""
    for _ in range(warmup):
        for fn in fns:
            fn(x)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn(x)
            times[i].append(time.perf_counter() - t)
    return [1000 * statistics.median(t) for t in times]


def _runner(fmt, path):
    """Returns `run(x)` that runs the artifact on a float32 batch."""
    import tensorflow as tf

    if fmt == "keras":
        model = keras.saving.load_model(path, compile=False)
        fn = tf.function(lambda x: model(x, training=False))
        return lambda x: fn(x).numpy()
    if fmt == "savedmodel":
        serve = tf.saved_model.load(path).signatures["serving_default"]
        (name,) = serve.structured_input_signature[1]
        return lambda x: list(serve(**{name: x}).values())[0].numpy()
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    index = interpreter.get_input_details()[0]["index"]
    out = interpreter.get_output_details()[0]["index"]
    state = {"shape": None}

    def run(x):
        x = np.asarray(x)
        if state["shape"] != x.shape:
            interpreter.resize_tensor_input(index, x.shape)
            interpreter.allocate_tensors()
            state["shape"] = x.shape
        interpreter.set_tensor(index, x)
        interpreter.invoke()
        return interpreter.get_tensor(out)

    return run


def _device():
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return "GPU: " + ", ".join(g.name for g in gpus)
    return f"CPU: {platform.processor() or platform.machine()}, " \
           f"{os.cpu_count()} logical cores"


def bench(quick=False):
    rng = np.random.default_rng(0)
    repeats = {1: 10 if quick else 50, 32: 5 if quick else 20}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for build in (build_cnn, build_transformer):
            model = build()
            shape = tuple(model.inputs[0].shape[1:])
            sample = rng.standard_normal((64,) + shape).astype("float32")
            batches = {b: rng.standard_normal((b,) + shape).astype("float32")
                       for b in (1, 32)}
            for fmt, ext in FORMATS:
                reports, runners = {}, []
                for dtype in ("float32", "float16"):
                    path = os.path.join(tmp, f"{model.name}-{fmt}-{dtype}{ext}")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        reports[dtype] = kx.export(
                            model, path, format=fmt, dtype=dtype,
                            sample=sample)
                    runners.append(_runner(fmt, path))
                latency = {
                    b: _paired_median_ms(runners, x, 3, repeats[b])
                    for b, x in batches.items()
                }
                for i, dtype in enumerate(("float32", "float16")):
                    rows.append({
                        "model": model.name,
                        "params": model.count_params(),
                        "format": fmt,
                        "dtype": dtype,
                        "bytes": reports[dtype].bytes,
                        "max_abs_diff": reports[dtype].max_abs_diff,
                        "latency_ms_batch1": latency[1][i],
                        "latency_ms_batch32": latency[32][i],
                    })
                print(f"  {model.name:12s} {fmt:10s} done", file=sys.stderr)
    return rows


def _table(rows):
    by_key = {(r["model"], r["format"], r["dtype"]): r for r in rows}
    header = ("model", "format", "f32 size", "f16 size", "ratio",
              "f32 b1 ms", "f16 b1 ms", "f32 b32 ms", "f16 b32 ms",
              "f16/f32 b32", "max|diff|")
    lines = [header]
    for r in rows:
        if r["dtype"] != "float32":
            continue
        h = by_key[(r["model"], r["format"], "float16")]
        lines.append((
            r["model"], r["format"],
            f"{r['bytes'] / 1e6:.2f} MB", f"{h['bytes'] / 1e6:.2f} MB",
            f"{h['bytes'] / r['bytes']:.3f}",
            f"{r['latency_ms_batch1']:.2f}", f"{h['latency_ms_batch1']:.2f}",
            f"{r['latency_ms_batch32']:.2f}",
            f"{h['latency_ms_batch32']:.2f}",
            f"{h['latency_ms_batch32'] / r['latency_ms_batch32']:.2f}x",
            f"{h['max_abs_diff']:.1e}",
        ))
    widths = [max(len(str(row[i])) for row in lines) for i in
              range(len(header))]
    out = []
    for i, row in enumerate(lines):
        out.append("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer timing repeats")
    parser.add_argument(
        "--json", default=os.path.join(os.path.dirname(__file__), "results",
                                       "export_inference.json"),
        help="where to write the results (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        sys.exit("export_inference.py needs KERAS_BACKEND=tensorflow")
    import tensorflow as tf

    device = _device()
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = bench(args.quick)
    print(f"\nFP16 export benchmark, {started:%Y-%m-%d %H:%M} UTC, {device}, "
          f"TensorFlow {tf.__version__}, Keras {keras.__version__}")
    print(_table(rows))
    ratios = [
        h["latency_ms_batch32"] / r["latency_ms_batch32"]
        for r in rows if r["dtype"] == "float32"
        for h in rows if h["dtype"] == "float16"
        and (h["model"], h["format"]) == (r["model"], r["format"])
    ]
    median = statistics.median(ratios)
    print(
        f"\nfloat16 / float32 latency at batch 32: median {median:.2f}x, "
        f"range {min(ratios):.2f}x-{max(ratios):.2f}x (above 1 = slower)."
    )
    if device.startswith("CPU"):
        print(
            "This is a CPU: no float16 speed-up is to be expected (CPUs lack "
            "fast float16 matmul units; TFLite dequantizes float16 weights "
            "to float32). Only the size halves; speed claims need a GPU."
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({
            "date": started.isoformat(timespec="seconds"),
            "device": device,
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "command": " ".join([os.path.basename(sys.executable)]
                                + sys.argv),
            "median_f16_over_f32_latency_batch32": median,
            "rows": rows,
        }, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
