"""`kerasmp bench`: is mixed precision faster, and lighter, on this machine?

Trains a small model zoo (an MLP, a CNN and a transformer encoder, built by
`kerasmp.apps.zoo`) for a few steps under each policy, in one process, and
reports per model and policy:

- `steps_per_s`: training steps per second, the median over `repeats` timed
  `fit` calls, as `kerasmp.callbacks.PerformanceMonitor(warmup_steps=1)`
  logs it. Each timed call runs `steps` steps; the clock starts when the
  first step's logs reach the callbacks and stops at the last step's, so
  tracing/compilation (a warm-up `fit` beforehand), data-pipeline set-up and
  the first step are excluded. Logs are read every step, so every timed step
  has finished on the device.
- `activation_bytes`: the activation memory a training step keeps for the
  backward pass, estimated as the sum of the outputs of every leaf layer
  (nested layers included, such as the query/key/value projections and the
  softmax inside `MultiHeadAttention`), plus the inputs, for one training
  batch, in the dtype each layer actually outputs (read on one forward
  pass; on JAX a trace with `jax.eval_shape`, nothing computed). This is
  what mixed precision halves; weights and optimizer state stay float32.
- `peak_bytes`: the framework's own count, where it has one. TensorFlow on a
  GPU: `tf.config.experimental.get_memory_info(...)["peak"]` over the timed
  calls (after `reset_memory_stats`). JAX (any device): XLA's memory plan of
  the compiled train step, `argument + output + temp - alias` bytes from
  `jax.jit(model.train_step).lower(...).compile().memory_analysis()`
  (weights, optimizer state, batch and every temporary). JAX's
  `peak_bytes_in_use` is a process-wide high-water mark that cannot be
  reset, so it is only recorded (`device_peak_bytes_in_use`), not compared.
  TensorFlow on a CPU has no counter: None.

Policies: `float32`, `float32_highest` (float32 with TF32 matmuls disabled:
`jax_default_matmul_precision="highest"` on JAX,
`enable_tensor_float_32_execution(False)` on TensorFlow; it differs from
`float32` only on GPUs with TF32), `mixed_float16` (with
`kerasmp.optimizer.LossScaleOptimizer`), `mixed_bfloat16` and
`float8_mixed_bfloat16` (Keras's float8 training for the large
Dense/EinsumDense layers, `kerasmp.float8`; simulated on CPUs, so slower
there: its gain needs an H100/H200-class GPU, 1.25-1.4x over bfloat16 as
reported elsewhere).

The models are built in `zoo.py`; the presets' sizes, the policies and the
defaults are in `choices.py`; `kerasmp bench` parses its arguments in
`cli/bench.py`.
"""

import contextlib
import dataclasses
import datetime
import math
import statistics
import time

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.devices import jax_memory_stats
from kerasmp._utils.devices import main_device
from kerasmp._utils.devices import tf_first_gpu
from kerasmp._utils.table import render_table
from kerasmp.apps.choices import BENCH_CPU_POLICIES
from kerasmp.apps.choices import BENCH_DEFAULT_POLICIES
from kerasmp.apps.choices import BENCH_POLICIES
from kerasmp.apps.choices import BENCH_PRESETS
from kerasmp.apps.zoo import NUM_CLASSES  # noqa: F401  (re-exported)
from kerasmp.apps.zoo import ModelSpec
from kerasmp.apps.zoo import build_model
from kerasmp.apps.zoo import make_data
from kerasmp.callbacks.performance import PerformanceMonitor
from kerasmp.debug.nonfinite import record_calls
from kerasmp.float8 import float8_layers
from kerasmp.policy.handback import handoff_dtype

MEMORY_METHOD = (
    "activation_bytes: sum of the outputs of every leaf layer (nested layers "
    "included) and the inputs for one training batch, in the dtype each "
    "layer outputs (one forward pass). peak_bytes: TensorFlow GPU "
    "get_memory_info peak over the timed calls; JAX: XLA memory plan of the "
    "compiled train step (argument + output + temp - alias); TensorFlow CPU: "
    "none."
)


# `BENCH_PRESETS` with each model's sizes as a `ModelSpec`.
PRESETS = {
    name: dict(preset, models=tuple(
        ModelSpec(model, **sizes)
        for model, sizes in preset["models"].items()))
    for name, preset in BENCH_PRESETS.items()
}


# --------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------


def activation_bytes(model, x):
    """Bytes of the leaf-layer outputs (and inputs) of one forward pass.

    Runs `model(x, training=True)` once (on JAX only traced, with
    `jax.eval_shape`: nothing is computed) and adds up the size of the
    floating-point outputs of every layer that has no sublayers (nested
    layers included), in the dtype each one returns, plus `x` itself: to
    first order, the activations a training step keeps for the backward
    pass.

    Args:
        model: A built `keras.Model`.
        x: One batch of inputs.

    Returns:
        An int (bytes).
    """
    leaves = [
        layer for layer in _ki.sublayers(model)
        if not _ki.sublayers(layer)
        and not isinstance(layer, keras.layers.InputLayer)
    ]
    total = [0]

    def add(layer, outputs):
        for t in keras.tree.flatten(outputs):
            dtype = getattr(t, "dtype", None)
            if dtype is None:
                continue
            dtype = keras.backend.standardize_dtype(dtype)
            if "float" in dtype:
                # What leaves the layer: an overridden layer computes in
                # float32 and hands the compute dtype on, except the
                # model's output layer (the bench models have one, last),
                # whose float32 output is what the loss gets.
                if layer is not None and layer is not model.layers[-1]:
                    dtype = handoff_dtype(layer) or dtype
                total[0] += int(np.prod(t.shape)) * np.dtype(
                    _numpy_dtype(dtype)).itemsize

    state = []
    try:
        with record_calls(leaves, add):
            if keras.backend.backend() == "jax":
                # Shapes and dtypes only: trace, don't compute (op-by-op
                # eager JAX compiles every op).
                import jax

                def forward(trainable, non_trainable, x):
                    return model.stateless_call(
                        trainable, non_trainable, x, training=True)[0]

                jax.eval_shape(
                    forward,
                    [v.value for v in model.trainable_variables],
                    [v.value for v in model.non_trainable_variables],
                    x,
                )
            else:
                state = [(v, to_numpy(v))
                         for v in model.non_trainable_variables]
                model(x, training=True)
    finally:
        for v, value in state:
            v.assign(value)
    add(None, keras.ops.convert_to_tensor(x))
    return total[0]


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        return "float16"  # same size (2 bytes); numpy has no bfloat16
    return dtype


def accelerator():
    """`("gpu"|"tpu"|"cpu", device name)` of the active backend."""
    dev = main_device()
    return dev.kind, dev.name


@contextlib.contextmanager
def _matmul_precision(highest):
    """float32 matmuls in full precision (no TF32) inside the block."""
    if not highest:
        yield
        return
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        previous = jax.config.jax_default_matmul_precision
        jax.config.update("jax_default_matmul_precision", "highest")
        try:
            yield
        finally:
            jax.config.update("jax_default_matmul_precision", previous)
    elif backend == "tensorflow":
        import tensorflow as tf

        previous = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(False)
        try:
            yield
        finally:
            tf.config.experimental.enable_tensor_float_32_execution(previous)
    else:
        yield


def _tf_gpu_peak(reset):
    import tensorflow as tf

    gpu = tf_first_gpu()
    if gpu is None:
        return None
    if reset:
        tf.config.experimental.reset_memory_stats(gpu)
        return None
    return int(tf.config.experimental.get_memory_info(gpu)["peak"])


def _jax_step_bytes(model, x, y):
    """XLA's memory plan of the compiled train step, in bytes (or None)."""
    import jax

    state = _ki.jax_state(model)
    spec = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, (x, y))
    )
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(
        *spec).compile()
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes
               + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _jax_device_peak():
    peak = jax_memory_stats()[1].get("peak_bytes_in_use")
    return None if peak is None else int(peak)


def time_fit(model, x, y, batch_size, repeats):
    """Times `repeats` epochs of `model.fit(x, y)` after a warm-up.

    The warm-up `fit` (two batches) traces or compiles the train step and
    builds the optimizer; each timed `fit` is one epoch over `x`, whose
    first step is left out (`PerformanceMonitor(warmup_steps=1)`).

    Args:
        model: A compiled model.
        x: Inputs, as `fit` takes them (arrays or a dict or list of them).
        y: Targets.
        batch_size: The batch size.
        repeats: Timed `fit` calls.

    Returns:
        `(rates, loss)`: steps per second of each timed call, and the
        last call's loss.
    """
    def head(a):
        return keras.tree.map_structure(lambda t: t[: 2 * batch_size], a)

    model.fit(head(x), head(y), batch_size=batch_size, epochs=1,
              shuffle=False, verbose=0)
    if accelerator()[0] == "gpu" and keras.backend.backend() == (
            "tensorflow"):
        _tf_gpu_peak(reset=True)
    rates, loss = [], None
    for _ in range(repeats):
        monitor = PerformanceMonitor(batch_size=batch_size, warmup_steps=1)
        history = model.fit(x, y, batch_size=batch_size, epochs=1,
                            shuffle=False, verbose=0, callbacks=[monitor])
        rates.append(history.history["steps_per_second"][-1])
        loss = history.history["loss"][-1]
    return rates, loss


def measured_row(model, name, description, policy, compute_dtype,
                 batch_size, steps, rates, loss, act, peak=(None,) * 3):
    """One row of the benchmark's JSON, for `model` timed under `policy`.

    Args:
        model: The compiled model that was timed.
        name: The model's name in the table.
        description: One line on the model.
        policy: The policy's name.
        compute_dtype: The compute dtype the row reports.
        batch_size: The batch size.
        steps: Steps per timed call.
        rates: Steps per second of each timed call (`time_fit`).
        loss: The last timed call's loss.
        act: Activation bytes (`activation_bytes`), or None.
        peak: `(peak_bytes, peak_source, device_peak_bytes_in_use)`.
    """
    steps_per_s = statistics.median(rates)
    peak_bytes, peak_source, device_peak = peak
    return {
        "model": name,
        "description": description,
        "policy": policy,
        "compute_dtype": compute_dtype,
        "batch_size": batch_size,
        "params": int(model.count_params()),
        "steps": steps,
        "repeats": len(rates),
        "steps_per_s": steps_per_s,
        "steps_per_s_repeats": rates,
        "samples_per_s": steps_per_s * batch_size,
        "activation_bytes": act,
        "peak_bytes": peak_bytes,
        "peak_source": peak_source,
        "device_peak_bytes_in_use": device_peak,
        "final_loss": None if loss is None else float(loss),
        "loss_finite": loss is not None and math.isfinite(float(loss)),
        "loss_scale": getattr(model.optimizer, "loss_scale", None),
        "float8_layers": 0,
    }


def bench_one(spec, policy, steps, repeats, seed=0, learning_rate=1e-3):
    """Measures one model under one policy.

    Args:
        spec: A `ModelSpec`.
        policy: One of `BENCH_POLICIES` (`kerasmp.apps.choices`).
        steps: Steps per timed `fit` call (>= 2; the first is not timed).
        repeats: Timed `fit` calls; the median is reported.
        seed: Seed of the weights and the data.
        learning_rate: Adam's learning rate (small: the data is random).

    Returns:
        A dict: one row of the benchmark's JSON.
    """
    from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
    from kerasmp.policy.policy import Policy
    from kerasmp.policy.policy import policy_scope

    highest = policy == "float32_highest"
    name = "float32" if highest else policy
    backend = keras.backend.backend()
    kind = accelerator()[0]
    keras.backend.clear_session()
    if backend != "jax":
        # keras.utils.set_random_seed also seeds TensorFlow when it is
        # installed, i.e. imports it: not in a JAX run (GPU memory).
        keras.utils.set_random_seed(seed)
    x, y = make_data(spec, spec.batch_size * steps, seed)
    with _matmul_precision(highest):
        with policy_scope(Policy(name)):
            model = build_model(spec)
        optimizer = keras.optimizers.Adam(learning_rate)
        if name == "mixed_float16":
            optimizer = LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer,
                      loss="sparse_categorical_crossentropy")
        rates, loss = time_fit(model, x, y, spec.batch_size, repeats)
        peak = None
        peak_source = None
        device_peak = None
        if backend == "tensorflow" and kind == "gpu":
            peak = _tf_gpu_peak(reset=False)
            peak_source = "tf.config.experimental.get_memory_info peak"
        elif backend == "jax":
            batch = (x[: spec.batch_size], y[: spec.batch_size])
            peak = _jax_step_bytes(model, *batch)
            peak_source = "XLA memory_analysis of the train step"
            device_peak = _jax_device_peak()
    row = measured_row(
        model, spec.name, spec.describe(), policy,
        model.get_layer("logits").compute_dtype, spec.batch_size, steps,
        rates, loss, activation_bytes(model, x[: spec.batch_size]),
        peak=(peak, peak_source, device_peak))
    row["float8_layers"] = len(float8_layers(model))
    del model
    keras.backend.clear_session()
    return row


def add_ratios(rows, baseline):
    base = {r["model"]: r for r in rows if r["policy"] == baseline}
    for r in rows:
        b = base.get(r["model"])
        r["speedup_vs_baseline"] = (
            r["steps_per_s"] / b["steps_per_s"] if b else None
        )
        r["activation_ratio_vs_baseline"] = (
            r["activation_bytes"] / b["activation_bytes"] if b else None
        )
        r["peak_ratio_vs_baseline"] = (
            r["peak_bytes"] / b["peak_bytes"]
            if b and r["peak_bytes"] and b["peak_bytes"] else None
        )
    return rows


def default_policies(device_kind):
    """The policies `run_bench` compares when none are given: on a CPU
    those a CPU can run fast (`BENCH_CPU_POLICIES`), elsewhere float32,
    mixed_float16 and mixed_bfloat16."""
    if device_kind == "cpu":
        return BENCH_CPU_POLICIES
    return BENCH_DEFAULT_POLICIES


def checked_policies(policies, device_kind):
    """`policies` as a tuple (None: `default_policies(device_kind)`),
    checked: distinct values from `BENCH_POLICIES`."""
    policies = tuple(default_policies(device_kind) if policies is None
                     else policies)
    bad = [p for p in policies if p not in BENCH_POLICIES]
    if bad or not policies or len(set(policies)) != len(policies):
        raise ValueError(f"Invalid `policies` {bad or policies}: distinct "
                         f"values from {', '.join(BENCH_POLICIES)}.")
    return policies


def check_counts(**counts):
    """Raises a ValueError naming the argument unless each of `steps`
    (>= 2), `repeats` and `batch_size` (>= 1) given is None or an int."""
    lows = {"steps": 2, "repeats": 1, "batch_size": 1}
    for arg, value in counts.items():
        low = lows[arg]
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, int) or value < low):
            raise ValueError(f"`{arg}` must be an integer >= {low}. "
                             f"Received: {value!r}")


def run_bench(preset="default", models=None, policies=None,
              steps=None, repeats=None, batch_size=None, verbose=True,
              run_order=None, on_progress=None):
    """Runs the benchmark and returns its result dict.

    Args:
        preset: `"quick"`, `"default"`, `"gpu"` or `"smoke"` (sizes, steps
            and repeats; see `kerasmp.apps.choices.BENCH_PRESETS`).
        models: Names of the models to run, a subset of the preset's.
            Defaults to all of them.
        policies: Policies to compare, from `BENCH_POLICIES`, in the order
            of the table. Ratios are relative to the first one (the
            baseline). Defaults to `default_policies` of the device: on a
            CPU float32 and mixed_bfloat16.
        steps: Steps per timed call (overrides the preset; >= 2).
        repeats: Timed calls per model and policy (overrides the preset).
        batch_size: Batch size for every model (overrides the preset).
        verbose: Print progress lines.
        run_order: The same policies in the order to run them (e.g. the
            slowest last), or None for `policies`' order.
        on_progress: Called with the result so far after each row (e.g. to
            save partial results of a run that may be cut short), or None.

    Returns:
        A dict with `rows` (one per model and policy) and the metadata.

    Example:

    ```python
    from kerasmp.apps import bench

    result = bench.run_bench("quick")
    print(bench.format_table(result))
    [(r["model"], r["policy"], r["speedup_vs_baseline"])
     for r in result["rows"]]
    ```
    """
    if preset not in PRESETS:
        raise ValueError(f"Invalid `preset`: {preset!r}. Allowed values: "
                         f"{', '.join(PRESETS)}.")
    specs = PRESETS[preset]["models"]
    if models is not None:
        unknown = [m for m in models if m not in {s.name for s in specs}]
        if unknown:
            raise ValueError(
                f"Invalid `models` {unknown}: the {preset!r} preset has "
                f"{', '.join(s.name for s in specs)}."
            )
        specs = tuple(s for s in specs if s.name in models)
    kind, device_name = accelerator()
    policies = checked_policies(policies, kind)
    run_order = policies if run_order is None else tuple(run_order)
    if sorted(run_order) != sorted(policies):
        raise ValueError(f"Invalid `run_order` {run_order}: it must hold the "
                         f"same policies as `policies` {policies}.")
    steps = PRESETS[preset]["steps"] if steps is None else steps
    repeats = PRESETS[preset]["repeats"] if repeats is None else repeats
    check_counts(steps=steps, repeats=repeats, batch_size=batch_size)
    if batch_size is not None:
        specs = tuple(dataclasses.replace(s, batch_size=batch_size)
                      for s in specs)
    started = time.perf_counter()
    meta = {
        "kerasmp_version": kerasmp_version(),
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "device_kind": kind,
        "device": device_name,
        "preset": preset,
        "steps": steps,
        "repeats": repeats,
        "baseline": policies[0],
        "timing": "median over repeats of (steps - 1) / time from the end "
                  "of the first step to the end of the last, after a "
                  "warm-up fit",
        "memory_method": MEMORY_METHOD,
        "models": {s.name: s.describe() for s in specs},
    }
    rows = []

    def result(complete):
        ordered = sorted(
            (dict(r) for r in rows),
            key=lambda r: ([s.name for s in specs].index(r["model"]),
                           policies.index(r["policy"])),
        )
        out = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            **meta,
            "complete": complete,
            "rows": add_ratios(ordered, policies[0]),
            "total_time_s": round(time.perf_counter() - started, 3),
        }
        if kind == "cpu":
            out["advice"] = advice_for(out)
        return out

    for spec in specs:
        for policy in run_order:
            if verbose:
                print(f"  {spec.name:<12} {policy:<16}", end="", flush=True)
            t = time.perf_counter()
            rows.append(bench_one(spec, policy, steps, repeats))
            if verbose:
                print(f" {rows[-1]['steps_per_s']:9.2f} steps/s "
                      f"({time.perf_counter() - t:.1f} s)", flush=True)
            if on_progress is not None:
                on_progress(result(complete=False))
    return result(complete=True)


def kerasmp_version():
    import kerasmp

    return kerasmp.__version__


def advice_for(result):
    """doctor's advice, resting on this benchmark's own measurements."""
    from kerasmp.apps.doctor import doctor

    report = doctor(bench=result)
    return {"recommended_policy": report.recommended_policy,
            "reason": report.reason, "warnings": report.warnings}


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.2f}"


def _ratio(r):
    return "-" if r is None else f"x{r:.2f}"


def format_table(result):
    """The benchmark result as a text table.

    Args:
        result: The dict `run_bench` returns.

    Returns:
        A multi-line string.
    """
    vs = "vs " + result["baseline"].replace("float32", "f32")
    header = ("model", "policy", "steps/s", vs, "act MiB", vs, "peak MiB",
              vs, "loss")
    rows = []
    for r in result["rows"]:
        rows.append((
            r["model"], r["policy"], f"{r['steps_per_s']:.2f}",
            _ratio(r["speedup_vs_baseline"]), _mib(r["activation_bytes"]),
            _ratio(r["activation_ratio_vs_baseline"]), _mib(r["peak_bytes"]),
            _ratio(r["peak_ratio_vs_baseline"]),
            "ok" if r["loss_finite"] else "NON-FINITE",
        ))
    lines = [
        f"kerasmp bench: backend {result['backend']}, {result['device_kind']}"
        f": {result['device']}, "
        + (f"model {result['user_model']}, " if result.get("user_model")
           else f"preset {result['preset']}, ")
        + f"{result['steps']} steps x {result['repeats']} repeats (median)",
    ]
    for name, desc in result["models"].items():
        lines.append(f"  {name}: {desc}")
    lines.append("")
    lines.append(render_table(header, rows, align="<<>>>>>>>", rule="full"))
    lines.append("")
    lines.append("steps/s: " + result["timing"] + ".")
    lines.append("memory: " + result["memory_method"])
    advice = result.get("advice")
    if advice:
        lines.append("")
        lines.append(f"doctor: recommended policy here: "
                     f"{advice['recommended_policy']}: {advice['reason']}")
        for w in advice["warnings"]:
            lines.append(f"doctor: {w}")
    return "\n".join(lines)
