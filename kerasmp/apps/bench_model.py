"""`kerasmp bench --model FILE`: the user's own model under each policy.

The zoo's models (`kerasmp.apps.bench`) say what a policy does on this
machine for models of their sizes; a user's model says it for that model.
`run_model_bench` rebuilds the model from its config under each
`kerasmp.Policy` (every stored dtype policy replaced, so kerasmp's float32
rules apply as in a model built under the policy), copies its weights, and
times `fit` as the zoo's benchmark does (`bench.time_fit`). The inputs are
the user's sample (`--sample`, repeated to fill the timed steps) or draws
that respect the model (`kerasmp.export.inputs.draw_inputs`, as `kerasmp
export` makes them). The loss is a stand-in, the mean squared output
against zeros, since a sample carries no labels: the step still runs the
model's forward pass, its backward pass and the optimizer's update, which
is where a policy's time goes. The result has the zoo benchmark's form, so
`format_table` prints it and `kerasmp doctor --bench` reads it.
"""

import datetime
import time

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp.apps.bench import MEMORY_METHOD
from kerasmp.apps.bench import accelerator
from kerasmp.apps.bench import activation_bytes
from kerasmp.apps.bench import add_ratios
from kerasmp.apps.bench import advice_for
from kerasmp.apps.bench import check_counts
from kerasmp.apps.bench import checked_policies
from kerasmp.apps.bench import kerasmp_version
from kerasmp.apps.bench import measured_row
from kerasmp.apps.bench import time_fit
from kerasmp.export.inputs import pack
from kerasmp.export.inputs import parity_inputs
from kerasmp.export.keras_config import replace_policies
from kerasmp.policy.plan import plan_of

DEFAULT_BATCH = 32


def under_policy(model, name):
    """A copy of `model` built under `kerasmp.Policy(name)`, with its
    weights.

    Every dtype policy in the model's config is replaced by the kerasmp
    policy, so each layer resolves its dtype as it would had the model been
    built under `kerasmp.set_global_policy(name)`: softmax and
    normalization layers in float32, the rest in the policy's dtype.

    Args:
        model: A built `keras.Model` with a config (`get_config`).
        name: A policy name, e.g. `"mixed_bfloat16"`.

    Returns:
        The copy.

    Example:

    >>> copy = under_policy(model, "mixed_bfloat16")
    >>> copy.layers[1].compute_dtype
    'bfloat16'
    """
    from kerasmp.policy.policy import Policy
    from kerasmp.policy.policy import policy_scope

    policy = Policy(name)
    config = replace_policies(keras.saving.serialize_keras_object(model),
                              keras.saving.serialize_keras_object(policy))
    with policy_scope(policy):
        copy = keras.saving.deserialize_keras_object(config)
    try:
        copy.set_weights(model.get_weights())
    except ValueError:
        pass  # a model whose copy holds other variables: its own weights
    return copy


def _rows(a):
    return len(keras.tree.flatten(a)[0])


def _repeat(arrays, n):
    """Each array's rows repeated (cycled) to `n` rows."""
    return [np.take(a, np.arange(n) % len(a), axis=0) for a in arrays]


def _head(x, n):
    return keras.tree.map_structure(lambda a: a[:n], x)


def _compute_dtype(model):
    """The compute dtype of the model's largest layer (most parameters,
    counting its own weights only): where most of a step's time goes."""
    layers = _weighted_layers(model)
    if not layers:
        return None
    return max(layers, key=lambda layer: sum(
        int(np.prod(w.shape)) for w in layer.weights)).compute_dtype


def _weighted_layers(model):
    return [layer for _, layer in plan_of(model).walk()
            if layer.weights and not _ki.direct_sublayers(layer)]


def bench_policy(model, name, inputs, batch_size, repeats, label,
                 learning_rate=1e-4):
    """Measures `model` under one policy: one row of the result.

    Args:
        model: The user's model (float32 weights).
        name: The policy.
        inputs: The arrays of the timed steps, in `input_specs` order.
        batch_size: The batch size.
        repeats: Timed `fit` calls; the median is reported.
        label: The model's name in the row.
        learning_rate: Adam's learning rate.
    """
    keras.backend.clear_session()
    copy = under_policy(model, name)
    x = pack(copy, inputs)
    outputs = copy(_head(x, batch_size), training=False)
    n = _rows(x)
    y = keras.tree.map_structure(
        lambda t: np.zeros((n,) + tuple(t.shape[1:]), "float32"), outputs)
    loss = keras.tree.map_structure(lambda _: "mean_squared_error", outputs)
    copy.compile(keras.optimizers.Adam(learning_rate), loss=loss)
    rates, final = time_fit(copy, x, y, batch_size, repeats)
    try:
        act = activation_bytes(copy, _head(x, batch_size))
    except Exception:  # noqa: BLE001 (a model the layer count cannot read)
        act = None
    row = measured_row(
        copy, label, f"the user's model, {copy.count_params():,} "
        f"parameters, batch {batch_size}", name, _compute_dtype(copy),
        batch_size, n // batch_size, rates, final, act)
    del copy
    keras.backend.clear_session()
    return row


def run_model_bench(model, sample=None, policies=None, steps=10, repeats=3,
                    batch_size=None, label=None, verbose=True):
    """Times the user's `model` under each policy; the `run_bench` form.

    Args:
        model: A built `keras.Model` (e.g. `keras.saving.load_model(...)`).
        sample: None (draws that respect the model), an array, a list of
            arrays or a dict keyed by input name: one batch or more,
            repeated to fill the timed steps.
        policies: Policies from `BENCH_POLICIES`; ratios are relative to
            the first. Defaults to `bench.default_policies` of the device.
        steps: Steps per timed `fit` call (>= 2).
        repeats: Timed `fit` calls per policy (>= 1).
        batch_size: The batch size (default: the sample's rows, at most
            32; 32 without a sample).
        label: The model's name in the table (default `model.name`).
        verbose: Print a line per policy.

    Returns:
        A dict with `rows` and the metadata, as `run_bench` returns.

    Example:

    ```python
    from kerasmp.apps import bench, bench_model

    result = bench_model.run_model_bench(model, steps=4, repeats=1)
    print(bench.format_table(result))
    ```
    """
    kind, device_name = accelerator()
    policies = checked_policies(policies, kind)
    check_counts(steps=steps, repeats=repeats, batch_size=batch_size)
    label = label or model.name
    if batch_size is None:
        batch_size = DEFAULT_BATCH if sample is None else min(
            DEFAULT_BATCH, _rows(sample))
    _, arrays, origin = parity_inputs(model, sample, batch_size * steps)
    inputs = _repeat(arrays, batch_size * steps)
    started = time.perf_counter()
    rows = []
    for name in policies:
        if verbose:
            print(f"  {label:<12} {name:<16}", end="", flush=True)
        t = time.perf_counter()
        rows.append(bench_policy(model, name, inputs, batch_size, repeats,
                                 label))
        if verbose:
            print(f" {rows[-1]['steps_per_s']:9.2f} steps/s "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "kerasmp_version": kerasmp_version(),
        "keras_version": keras.__version__,
        "backend": keras.backend.backend(),
        "device_kind": kind,
        "device": device_name,
        "preset": None,
        "user_model": label,
        "inputs": origin,
        "steps": steps,
        "repeats": repeats,
        "baseline": policies[0],
        "timing": "median over repeats of (steps - 1) / time from the end "
                  "of the first step to the end of the last, after a "
                  "warm-up fit; loss: mean squared output (a stand-in)",
        "memory_method": MEMORY_METHOD,
        "models": {label: rows[0]["description"]},
        "complete": True,
        "rows": add_ratios(rows, policies[0]),
        "total_time_s": round(time.perf_counter() - started, 3),
    }
    if kind == "cpu":
        result["advice"] = advice_for(result)
    return result
