"""One fidelity run (issue 38): one task, one policy, one seed, one backend.

`benchmarks/fidelity.py` starts this file once per configuration, each in a
fresh Python process, so that the stock-Keras runs (`float32`,
`stock_mixed_float16`) never import kerasmp: kerasmp is imported only by the
`kerasmp_*` policies. The short test (tests/fidelity/test_fidelity.py) calls
`run()` directly.

Every policy of a (task, seed) starts from the same weights: the model is
built under float32 after `keras.utils.set_random_seed(seed)`, its weights
are kept, the model is rebuilt under the run's policy and given them (their
sha256 is recorded, so two runs can be checked to have started alike). The
training batches are a fixed function of the seed (a NumPy generator, not
the backend's), so every policy sees the same data in the same order.

Tasks:

- `lm`: a decoder-only byte-level transformer (keras-hub
  `TokenAndPositionEmbedding` + `TransformerDecoder` blocks without
  cross-attention, causal mask) on `kerasmp.data.load_pycorpus` (the running
  Python's stdlib `.py` files; json/email/asyncio held out for evaluation).
  Metric: next-byte loss and accuracy on a fixed sample of held-out windows.
- `digits_cnn`: Conv2D-BatchNorm-ReLU x2, pooling, Dense on the 8x8 digits.
- `digits_transformer`: each digit image as 8 tokens of 8 pixels, two
  keras-hub `TransformerEncoder` blocks, pooling, Dense (the float8 rule
  applies to its feed-forward kernels).

Usage (normally through benchmarks/fidelity.py):
    python benchmarks/fidelity_run.py --task lm --policy float32 --seed 0 \
        --steps 5000 --out /tmp/run.json
"""

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# policy name -> (compute policy, optimizer kind, growth steps)
POLICIES = {
    "float32": ("float32", "plain", None),
    "stock_mixed_float16": ("mixed_float16", "stock_lso", 500),
    "kerasmp_mixed_float16": ("mixed_float16", "kerasmp_lso", 500),
    "kerasmp_mixed_float16_g2000": ("mixed_float16", "kerasmp_lso", 2000),
    "kerasmp_mixed_bfloat16": ("mixed_bfloat16", "plain", None),
    "kerasmp_float8": ("float8_mixed_bfloat16", "plain", None),
}
TASKS = ("lm", "digits_cnn", "digits_transformer")
DEFAULT_STEPS = {"lm": 5000, "digits_cnn": 500, "digits_transformer": 500}

# The language model's size (chosen so that 5,000 steps fit on 2 CPU cores;
# docs/fidelity.md). The test passes a smaller one.
LM_CONFIG = dict(seq_len=64, width=64, heads=4, layers=2, ff=256,
                 batch=16, eval_windows=256, lr=1e-3)


def _data_module():
    """`kerasmp.data`, loaded from its folder under another name, so that a
    stock run reads the same data without importing the kerasmp package
    (whose import installs kerasmp's hooks into Keras)."""
    import importlib.util

    name = "_fidelity_kerasmp_data"
    if name not in sys.modules:
        folder = os.path.join(ROOT, "kerasmp", "data")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"),
            submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _lm_data(seed, steps, cfg):
    importlib = __import__("importlib")
    pycorpus = importlib.import_module(_data_module().__name__ + ".pycorpus")
    train, held, meta = pycorpus.load_pycorpus()
    n = cfg["seq_len"] + 1
    rng = np.random.default_rng(seed)
    eval_rng = np.random.default_rng(12345)  # the same windows for all seeds
    starts = eval_rng.integers(0, len(held) - n, cfg["eval_windows"])
    ev = np.stack([held[s:s + n] for s in starts]).astype("int32")

    def batches():
        while True:
            s = rng.integers(0, len(train) - n, cfg["batch"])
            w = np.stack([train[i:i + n] for i in s]).astype("int32")
            yield w[:, :-1], w[:, 1:]

    info = {k: meta[k] for k in ("python_version", "sha256")}
    info.update(train_bytes=int(len(train)), eval_bytes=int(len(held)))
    return batches(), (ev[:, :-1], ev[:, 1:]), info


def _digits_data(seed, kind, batch=64):
    (x, y), (xt, yt) = _data_module().load_digits()
    if kind == "digits_transformer":
        x, xt = x.reshape(-1, 8, 8), xt.reshape(-1, 8, 8)
    rng = np.random.default_rng(seed)

    def batches():
        while True:
            order = rng.permutation(len(x))
            for i in range(0, len(x) - batch + 1, batch):
                idx = order[i:i + batch]
                yield x[idx], y[idx]

    return batches(), (xt, yt), {"train": int(len(x)), "test": int(len(xt))}


def build(task, cfg=None):
    import keras
    import keras_hub

    if task == "lm":
        c = cfg
        inp = keras.Input((c["seq_len"],), dtype="int32")
        x = keras_hub.layers.TokenAndPositionEmbedding(
            256, c["seq_len"], c["width"], name="embed")(inp)
        for i in range(c["layers"]):
            x = keras_hub.layers.TransformerDecoder(
                c["ff"], c["heads"], name=f"block{i}")(x)
        x = keras.layers.LayerNormalization(name="final_norm")(x)
        out = keras.layers.Dense(256, name="logits")(x)
        return keras.Model(inp, out)
    if task == "digits_cnn":
        inp = keras.Input((8, 8, 1))
        x = inp
        for i, filters in enumerate((32, 64)):
            x = keras.layers.Conv2D(filters, 3, padding="same",
                                    use_bias=False, name=f"conv{i}")(x)
            x = keras.layers.BatchNormalization(name=f"bn{i}")(x)
            x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Flatten()(x)
        x = keras.layers.Dense(128, activation="relu", name="dense")(x)
        out = keras.layers.Dense(10, name="logits")(x)
        return keras.Model(inp, out)
    inp = keras.Input((8, 8))
    x = keras.layers.Dense(64, name="embed")(inp)
    for i in range(2):
        x = keras_hub.layers.TransformerEncoder(
            256, 4, name=f"encoder{i}")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(10, name="logits")(x)
    return keras.Model(inp, out)


def _set_policy(name):
    import keras

    if name == "float32" or POLICIES[name][1] == "stock_lso":
        keras.config.set_dtype_policy(POLICIES[name][0])
        return
    import kerasmp

    kerasmp.set_global_policy(kerasmp.Policy(POLICIES[name][0]))


def _optimizer(name, lr, growth_steps=None):
    import keras

    inner = keras.optimizers.Adam(lr)
    kind, default_growth = POLICIES[name][1], POLICIES[name][2]
    growth = growth_steps or default_growth
    if kind == "stock_lso":
        return keras.optimizers.LossScaleOptimizer(
            inner, dynamic_growth_steps=growth)
    if kind == "kerasmp_lso":
        import kerasmp

        return kerasmp.LossScaleOptimizer(inner, dynamic_growth_steps=growth)
    return inner


class _Recorder:
    """Per-step loss scale and skipped count (kerasmp logs them each step);
    for Keras's own LossScaleOptimizer, which logs neither, the scale and
    the inner optimizer's applied steps are read at each evaluation."""

    def __init__(self):
        import keras

        rec = self

        class CB(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if logs and "loss_scale" in logs:
                    rec.trace.append((float(logs["loss_scale"]),
                                      int(logs.get("skipped_steps", 0))))

            def on_epoch_end(self, epoch, logs=None):
                rec.times.append(time.perf_counter())
                progress = os.environ.get("FIDELITY_PROGRESS")
                if progress:  # a long run's progress, for whoever waits
                    with open(progress, "a", encoding="utf-8") as f:
                        f.write(f"{time.strftime('%H:%M:%S')} epoch "
                                f"{epoch + 1} val_loss "
                                f"{float(logs['val_loss']):.4f}\n")
                rec.evals.append((float(logs["val_loss"]),
                                  float(logs["val_accuracy"])))
                opt = self.model.optimizer
                if isinstance(opt, keras.optimizers.LossScaleOptimizer) \
                        and not rec.trace_is_per_step:
                    applied = int(np.asarray(opt.inner_optimizer.iterations))
                    rec.coarse.append((float(np.asarray(opt.dynamic_scale)),
                                       applied))

        self.callback = CB()
        self.trace, self.coarse, self.times, self.evals = [], [], [], []
        self.trace_is_per_step = False


def _scale_summary(rec, steps, eval_every, initial_scale):
    """Range, growths, back-offs and skipped steps of the loss scale."""
    if rec.trace:  # kerasmp: every step
        scales = [initial_scale] + [s for s, _ in rec.trace]
        skipped_total = [k for _, k in rec.trace]
        skip_steps = [i for i in range(len(skipped_total))
                      if skipped_total[i] > (skipped_total[i - 1] if i else 0)]
        per_step = True
    else:  # stock: sampled at each evaluation
        scales = [initial_scale] + [s for s, _ in rec.coarse]
        skip_steps, per_step = None, False
    growths = sum(b > a for a, b in zip(scales, scales[1:]))
    backoffs = sum(b < a for a, b in zip(scales, scales[1:]))
    out = {"scale_min": min(scales), "scale_max": max(scales),
           "scale_final": scales[-1], "per_step_trace": per_step}
    if per_step:
        # Warm-up: the steps up to the first applied one (the scale's
        # descent from its initial value to one the gradients fit under).
        warm = next((i for i in range(len(rec.trace))
                     if i not in set(skip_steps)), len(rec.trace))
        out.update(growths=growths, backoffs=backoffs,
                   skipped=len(skip_steps), warmup_steps=warm,
                   skipped_after_warmup=sum(s > warm for s in skip_steps),
                   skip_steps=skip_steps,
                   scale_trace=[s for s, _ in rec.trace])
    else:
        # Keras's scale halves on every overflow (and each one skips its
        # step) and doubles after `growth` clean steps: the skipped count
        # is steps - applied, back-offs = skipped, growths from the net.
        applied = rec.coarse[-1][1] if rec.coarse else steps
        skipped = steps - applied
        net = int(round(np.log2(scales[-1] / initial_scale)))
        first = rec.coarse[0][1] if rec.coarse else eval_every
        warm_skips = eval_every - first  # all within the first interval
        out.update(growths=skipped + net, backoffs=skipped, skipped=skipped,
                   warmup_steps=None,
                   skipped_after_warmup=skipped - warm_skips,
                   scale_samples=[s for s, _ in rec.coarse])
    return out


def run(task, policy, seed, steps, eval_every=100, lm_config=None,
        growth_steps=None):
    """Trains one configuration; returns its record (a JSON-able dict).

    Args:
        task: one of `TASKS`.
        policy: one of `POLICIES`.
        seed: the seed of the initial weights and of the data order.
        steps: training steps (a multiple of `eval_every`).
        eval_every: steps between two evaluations.
        lm_config: the language model's size (default `LM_CONFIG`).
        growth_steps: overrides the policy's `dynamic_growth_steps`.
    """
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}; received {task!r}")
    if policy not in POLICIES:
        raise ValueError(
            f"`policy` must be one of {tuple(POLICIES)}; received {policy!r}")
    if steps % eval_every:
        raise ValueError(f"`steps` ({steps}) must be a multiple of "
                         f"`eval_every` ({eval_every}).")
    import keras

    cfg = dict(LM_CONFIG, **(lm_config or {}))
    if task == "lm":
        batches, val, info = _lm_data(seed, steps, cfg)
        lr = cfg["lr"]
    else:
        batches, val, info = _digits_data(seed, task)
        lr = 1e-3
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    keras.config.set_dtype_policy("float32")
    weights = build(task, cfg).get_weights()
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights))
    _set_policy(policy)
    try:
        model = build(task, cfg)
        model.set_weights(weights)
        opt = _optimizer(policy, lr, growth_steps)
        backend = keras.backend.backend()
        model.compile(
            optimizer=opt,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=backend != "torch",
        )
        initial_scale = (float(opt.initial_scale)
                         if isinstance(opt, keras.optimizers.LossScaleOptimizer)
                         else None)
        rec = _Recorder()
        callbacks = [rec.callback]
        if POLICIES[policy][1] == "kerasmp_lso":
            rec.trace_is_per_step = True
        start = time.perf_counter()
        model.fit(batches, steps_per_epoch=eval_every,
                  epochs=steps // eval_every, validation_data=val,
                  validation_batch_size=64, verbose=0, callbacks=callbacks,
                  shuffle=False)
        total = time.perf_counter() - start
        float8_layers = []
        if policy == "kerasmp_float8":
            from kerasmp import float8

            float8_layers = [p for p, _ in float8.float8_layers(model)]
    finally:
        keras.config.set_dtype_policy("float32")
    losses = [loss for loss, _ in rec.evals]
    record = {
        "task": task, "policy": policy, "seed": seed, "steps": steps,
        "backend": backend, "eval_every": eval_every,
        "growth_steps": (growth_steps or POLICIES[policy][2]),
        "initial_weights_sha256": digest.hexdigest()[:16],
        "final_eval_loss": losses[-1], "best_eval_loss": min(losses),
        "final_eval_accuracy": rec.evals[-1][1],
        "best_eval_accuracy": max(a for _, a in rec.evals),
        "eval_loss_curve": losses,
        "seconds": total,
        # Without the first interval (compilation).
        "steady_seconds": (rec.times[-1] - rec.times[0]
                           if len(rec.times) > 1 else total),
        "data": info, "float8_layers": float8_layers,
    }
    if task == "lm":
        record["lm_config"] = cfg
    if initial_scale is not None:
        record["loss_scale"] = _scale_summary(rec, steps, eval_every,
                                              initial_scale)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, choices=TASKS)
    p.add_argument("--policy", required=True, choices=tuple(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        record = run(a.task, a.policy, a.seed, a.steps, a.eval_every)
    except Exception as e:  # recorded as the run's result, not hidden
        import keras

        record = {"task": a.task, "policy": a.policy, "seed": a.seed,
                  "steps": a.steps, "backend": keras.backend.backend(),
                  "error": f"{type(e).__name__}: {str(e)[:300]}"}
    record["kerasmp_imported"] = "kerasmp" in sys.modules
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(record, f)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    main()
