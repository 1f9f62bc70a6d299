"""Accuracy of float8 training vs bfloat16 vs float32 (CPU is fine).

Two models on the vendored 8x8 digits (`kerasmp.data.load_digits`, 1438
train / 359 test images), each trained under `float32`,
`mixed_bfloat16` and `kerasmp.Policy("float8_mixed_bfloat16")` (default
`Float8Rule`: Dense/EinsumDense kernels of at least 4096 elements, first and
last matmul excluded), from the same initial weights per seed:

- `mlp`: 64 -> 256 -> 256 -> 256 -> 10 (the two 256x256 layers are float8).
- `transformer`: each image as 8 tokens of 8 pixels, a Dense projection to
  64, keras-hub's `TransformerEncoder` x2 (64 wide, 4 heads, feed-forward
  256: query/key/value/output and both feed-forward kernels float8),
  average pooling, Dense(10). Built from scratch (no weights downloaded).

Reported per model and policy: test accuracy and final training loss,
mean (and min-max) over `--seeds` seeds, the number of float8 layers, and
seconds per epoch (CPU: float8 is simulated, quantize-dequantize, so it is
*slower* here; its speed needs a Hopper-class GPU).

Usage:
    python benchmarks/float8_accuracy.py [--seeds 3] [--epochs 30]
        [--out benchmarks/results/float8_accuracy_tensorflow.json]
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

import keras  # noqa: E402

import kerasmp  # noqa: E402
from kerasmp import float8  # noqa: E402
from kerasmp.data import load_digits  # noqa: E402

POLICIES = ("float32", "mixed_bfloat16", "float8_mixed_bfloat16")


def build(kind):
    if kind == "mlp":
        inp = keras.Input((64,))
        x = keras.layers.Dense(256, activation="relu", name="in")(inp)
        x = keras.layers.Dense(256, activation="relu", name="hidden1")(x)
        x = keras.layers.Dense(256, activation="relu", name="hidden2")(x)
        out = keras.layers.Dense(10, activation="softmax", name="logits")(x)
        return keras.Model(inp, out)
    import keras_hub

    inp = keras.Input((8, 8))
    x = keras.layers.Dense(64, name="embed")(inp)
    for i in range(2):
        x = keras_hub.layers.TransformerEncoder(
            intermediate_dim=256, num_heads=4, name=f"encoder{i}")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    out = keras.layers.Dense(10, activation="softmax", name="logits")(x)
    return keras.Model(inp, out)


def run(kind, policy, seed, epochs, data):
    (x, y), (xt, yt) = data
    if kind == "mlp":
        x, xt = x.reshape(-1, 64), xt.reshape(-1, 64)
    else:
        x, xt = x.reshape(-1, 8, 8), xt.reshape(-1, 8, 8)
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    kerasmp.set_global_policy("float32")
    weights = build(kind).get_weights()  # the same start for every policy
    kerasmp.set_global_policy(kerasmp.Policy(policy))
    model = build(kind)
    model.set_weights(weights)
    model.compile(keras.optimizers.Adam(1e-3),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0,
                        shuffle=True)
    seconds = time.perf_counter() - start
    loss, acc = model.evaluate(xt, yt, verbose=0)
    row = {
        "model": kind, "policy": policy, "seed": seed,
        "test_accuracy": float(acc), "test_loss": float(loss),
        "train_loss": float(history.history["loss"][-1]),
        "float8_layers": [p for p, _ in float8.float8_layers(model)],
        "seconds_per_epoch": seconds / epochs,
    }
    kerasmp.set_global_policy("float32")
    return row


def summarize(rows):
    out = []
    for kind in dict.fromkeys(r["model"] for r in rows):
        for policy in POLICIES:
            rs = [r for r in rows if r["model"] == kind
                  and r["policy"] == policy]
            if not rs:
                continue
            accs = [r["test_accuracy"] for r in rs]
            out.append({
                "model": kind, "policy": policy, "seeds": len(rs),
                "test_accuracy_mean": statistics.mean(accs),
                "test_accuracy_min": min(accs),
                "test_accuracy_max": max(accs),
                "train_loss_mean": statistics.mean(r["train_loss"]
                                                   for r in rs),
                "float8_layers": len(rs[0]["float8_layers"]),
                "seconds_per_epoch": statistics.median(
                    r["seconds_per_epoch"] for r in rs),
            })
    return out


def table(summary):
    lines = ["| model | policy | test accuracy, mean (min-max) | train loss | "
             "float8 layers | s/epoch (CPU) |", "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['model']} | {s['policy']} | "
            f"{s['test_accuracy_mean']:.4f} ({s['test_accuracy_min']:.4f}-"
            f"{s['test_accuracy_max']:.4f}) | {s['train_loss_mean']:.4f} | "
            f"{s['float8_layers']} | {s['seconds_per_epoch']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"],
                        choices=["mlp", "transformer"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    data = load_digits()
    rows = []
    for kind in args.models:
        for seed in range(args.seeds):
            for policy in POLICIES:
                rows.append(run(kind, policy, seed, args.epochs, data))
                r = rows[-1]
                print(f"{kind} {policy} seed {seed}: acc "
                      f"{r['test_accuracy']:.4f} loss {r['train_loss']:.4f} "
                      f"{r['seconds_per_epoch']:.2f} s/epoch", flush=True)
    summary = summarize(rows)
    print(table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({
                "date": datetime.datetime.now(datetime.timezone.utc)
                .isoformat(timespec="seconds"),
                "backend": keras.backend.backend(),
                "keras": keras.__version__,
                "machine": platform.processor() or platform.machine(),
                "load_average": os.getloadavg(),
                "epochs": args.epochs, "summary": summary, "rows": rows,
            }, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
