"""`kerasmp.tune(model, x, target)`: the fewest layers that must compute in
float32 for an accuracy target, found by forward passes.

How: the float32 reference (every layer in float32, same weights), then
`kerasmp.tune.search.search_tree` over the layers a half-precision
`kerasmp.Policy` governs, each candidate set measured by one eager forward
pass with those layers' policies swapped (`kerasmp.tune.apply`: no
rebuild, no training). The error of a set is the parity figure of the
census and of `kerasmp.export`'s report (max |diff| / range of the
float32 output, `kerasmp._utils.parity.parity`) or, in the metric mode,
the metric's drop against float32 on labelled data.
"""

import time

import keras
import numpy as np

from kerasmp._utils.instrument import running_layers
from kerasmp._utils.parity import parity
from kerasmp.policy.measure import measure_once
from kerasmp.policy.plan import plan_of
from kerasmp.tune.apply import HALF
from kerasmp.tune.apply import as_float32
from kerasmp.tune.apply import forward
from kerasmp.tune.apply import governed_tree
from kerasmp.tune.apply import in_float32
from kerasmp.tune.apply import tuned_policy
from kerasmp.tune.flops import flop_share
from kerasmp.tune.flops import own_flops
from kerasmp.tune.report import BeforeAfter
from kerasmp.tune.report import KeptLayer
from kerasmp.tune.report import TuneReport
from kerasmp.tune.search import expand
from kerasmp.tune.search import search_tree

METRICS = ("accuracy",)


def _is_batch(x):
    return isinstance(x, (np.ndarray, list, tuple, dict)) or (
        keras.ops.is_tensor(x))


def _batches(x, y, batch_size):
    """`(list of input batches, labels or None)`."""
    if not _is_batch(x):
        try:
            items = list(x)
        except TypeError:
            raise TypeError(
                "`x` must be a sample batch (a numpy array or tensor, or a "
                "list/dict of them) or an iterable of batches (a "
                f"tf.data.Dataset). Received: {type(x).__name__}") from None
        xs, ys = [], []
        for item in items:
            if isinstance(item, tuple) and len(item) > 1:
                xs.append(item[0])
                ys.append(np.asarray(item[1]))
            else:
                xs.append(item)
        if not xs:
            raise ValueError("`x` holds no batch.")
        return xs, (np.concatenate(ys) if ys and y is None else y)
    if batch_size is None:
        return [x], y
    n = int(keras.tree.flatten(x)[0].shape[0])
    return [keras.tree.map_structure(lambda t: t[i:i + batch_size], x)
            for i in range(0, n, batch_size)], y


def _accuracy(y, outputs):
    pred = np.asarray(outputs[0])
    if pred.ndim < 2 or pred.shape[-1] < 2:
        raise ValueError(
            "metric='accuracy' needs a model whose first output has one "
            f"score per class (last axis > 1); it has shape {pred.shape}. "
            "Pass a callable `metric(y, outputs)` instead.")
    y = np.asarray(y)
    if y.ndim == pred.ndim and y.shape[-1] == pred.shape[-1]:
        y = y.argmax(-1)
    return float((pred.argmax(-1) == y.reshape(pred.shape[:-1])).mean())


def _check(model, target, metric, max_drop, y, batch_size):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model (Sequential, Functional or a "
            f"subclass). Received: {type(model).__name__}")
    if not model.built:
        raise ValueError(
            f"`model` ({model.name!r}) is not built: call it on a batch or "
            "`model.build(input_shape)` first.")
    if metric is None:
        if not (isinstance(target, (int, float)) and target > 0):
            raise ValueError(
                f"Invalid `target`: {target!r}. Allowed values: a number > "
                "0, the largest max |diff| / range against float32.")
        if max_drop is not None:
            raise ValueError("`max_drop` is for the metric mode: pass "
                             "`metric` too, or leave `max_drop` out.")
    else:
        if not (metric in METRICS or callable(metric)):
            raise ValueError(
                f"Invalid `metric`: {metric!r}. Allowed values: None (the "
                f"parity figure), {', '.join(map(repr, METRICS))}, or a "
                "callable `metric(y, outputs) -> float` (higher is better).")
        if not (isinstance(max_drop, (int, float)) and max_drop >= 0):
            raise ValueError(
                f"Invalid `max_drop`: {max_drop!r}. Allowed values: a "
                "number >= 0, the largest drop of the metric against "
                "float32 (0.005: half a percentage point of accuracy).")
    if batch_size is not None and not (isinstance(batch_size, int)
                                       and batch_size > 0):
        raise ValueError(f"Invalid `batch_size`: {batch_size!r}. Allowed "
                         "values: None (the whole sample at once), an int "
                         "> 0.")
    governing = plan_of(model).policy
    if governing is None or governing.compute_dtype not in HALF:
        raise ValueError(
            "kerasmp.tune needs a model that a half-precision "
            "kerasmp.Policy governs (built under "
            "kerasmp.set_global_policy('mixed_float16') or "
            f"'mixed_bfloat16'); {model.name!r} has "
            f"{'no kerasmp policy' if governing is None else governing}.")
    return governing


def tune(model, x, target=1e-2, *, y=None, metric=None, max_drop=None,
         batch_size=None):
    """Finds the fewest layers that must compute in float32 to meet a target.

    Forward passes only (no training, no rebuild): the error with no layer
    moved and with every governed layer in float32; each top-level layer's
    (or block's) contribution, the error with only it in float32; the
    shortest prefix of that ranking that meets the target, by bisection;
    then each kept layer that the others make unneeded is dropped. Inside a
    kept block the same search runs over the block's own code and its
    sublayers, so a block is kept whole only when all its parts are needed.
    The passes grow as n log n in the number of governed layers at most
    (about 2 n + log2 n per level in practice).

    Args:
        model: A built `keras.Model` that a half-precision `kerasmp.Policy`
            governs.
        x: A sample batch (array, tensor, list or dict of them), or an
            iterable of batches (`(x, y)` tuples give the labels).
        target: The largest max |diff| / range of the output against the
            same weights computed in float32 (the census's figure).
            Defaults to 1e-2.
        y: The labels of `x`, for the metric mode.
        metric: None (the parity figure), `"accuracy"` (argmax of the first
            output against `y`) or a callable `metric(y, outputs) -> float`
            (`outputs`: the list of the model's numpy outputs; higher is
            better). With a metric the target is `max_drop`.
        max_drop: The largest drop of `metric` against float32, e.g. 0.005
            (half a percentage point of accuracy).
        batch_size: Run `x` in batches of this size. Defaults to None
            (one call).

    Returns:
        A `TuneReport` (`print()` it for a table).

    Example:

    ```python
    import keras
    import numpy as np
    import kerasmp

    kerasmp.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8),
                              keras.layers.Dense(2)])
    kerasmp.set_global_policy("float32")
    report = kerasmp.tune(model, np.ones((4, 8), "float32"), target=1e-2)
    report.float32_layers  # (): float16 meets 1e-2 here
    ```
    """
    start = time.perf_counter()
    governing = _check(model, target, metric, max_drop, y, batch_size)
    measure_once(model)  # what its first call or compile would move
    governing = plan_of(model).policy
    batches, y = _batches(x, y, batch_size)
    if metric is not None and y is None:
        raise ValueError("The metric mode needs labels: pass `y`, or `x` "
                         "as batches of `(x, y)`.")
    score = (_accuracy if metric == "accuracy" else metric)
    tree, layers, tunable = governed_tree(model)
    passes = [0]

    def run(paths=()):
        passes[0] += 1
        with in_float32(layers, paths):
            return forward(model, batches)

    with as_float32(model):
        passes[0] += 1
        reference = forward(model, batches)
    flops = {}

    def around(path, call, args, kwargs):
        outputs = call(*args, **kwargs)
        if path in layers:
            flops.setdefault(path, own_flops(layers[path], args, kwargs,
                                             outputs))
        return outputs

    with running_layers(list(layers.items()), around):
        outputs = {frozenset(): run()}
    flops = {p: n for p, n in flops.items() if n}

    def outputs_for(paths):
        key = frozenset(paths) & tunable
        if key not in outputs:
            outputs[key] = run(key)
        return outputs[key]

    def figure(outs):
        return parity(reference, outs)["rel_diff"]

    if metric is None:
        goal = float(target)

        def error(paths):
            return figure(outputs_for(paths))
    else:
        goal = float(max_drop)
        best = score(y, reference)

        def error(paths):
            return best - score(y, outputs_for(paths))

    found = search_tree(tree, error, goal)
    before = figure(outputs[frozenset()])
    share_before = flop_share(flops, layers)
    total = sum(flops.values())
    reason = floor = None
    kept = found.kept or ()
    moved = expand(tree, kept) & tunable
    after = figure(outputs_for(moved))
    met = found.kept is not None
    if not met:
        with as_float32(model, round_weights=True):
            passes[0] += 1
            floor = figure(forward(model, batches))
        reason = _reason(found.error, goal, floor, reference, metric)
        after = before
        moved = frozenset()
    rows = tuple(
        KeptLayer(path, whole, found.contributions.get(path),
                  sum(flops.get(p, 0) for p in expand(tree, [(path, whole)]))
                  / total if total else 0.0)
        for path, whole in kept)
    metric_values = None
    if metric is not None:
        metric_values = {"float32": best,
                         "before": score(y, outputs[frozenset()]),
                         "after": score(y, outputs_for(moved))}
    return TuneReport(
        float32_layers=tuple(r.path for r in rows), layers=rows,
        policy=tuned_policy(governing, layers, tree, kept),
        target=goal, before=before, after=after,
        float32_flop_share=BeforeAfter(
            share_before, flop_share(flops, layers, moved)),
        passes=passes[0], seconds=time.perf_counter() - start, met=met,
        reason=reason, floor=floor,
        metric=(None if metric is None else
                metric if isinstance(metric, str) else
                getattr(metric, "__name__", "metric")),
        metric_values=metric_values)


def _reason(error, goal, floor, reference, metric):
    what = "the metric's drop" if metric else "the output"
    text = (f"with every governed layer in float32 {what} is still "
            f"{error:.3g} off float32 (target {goal:g})")
    if floor is not None and floor > goal and metric is None:
        text += (f"; the float32 model with its weights rounded to float16 "
                 f"is already {floor:.3g} off (the floor of any float16 "
                 "computation)")
    elif not any(np.issubdtype(r.dtype, np.floating) for r in reference):
        text += "; the output is discrete (no float output)"
    else:
        text += ("; the difference comes from the half-precision hand-offs "
                 "between float32 layers or from layers outside the "
                 "policy (a discrete choice such as top-k or argmax on near "
                 "ties flips)")
    return text
