"""Running a model with chosen layers in float32, without rebuilding it.

A layer's dtype policy is read at each call (`kerasmp._patches`), so
`tune` moves layers by swapping their stored policies for the length of a
forward pass, as `kerasmp.policy.measure` does for a symbolic one: each
pass costs one eager forward call of the model and no build. The model is
left as it was.

- `governed_tree`: the layers a half-precision `kerasmp.Policy` governs,
  as a tree of paths (`kerasmp._utils.layers.walk`), with the containers
  above them;
- `in_float32`: those layers, by path, in float32 for a block;
- `as_float32`: the whole model in float32 (the reference), optionally
  with its weights rounded to float16 (the floor of any float16
  computation);
- `forward`: the model's flat numpy outputs on a list of batches.
"""

import contextlib

import keras
import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp.policy.measure import TUNE_RULE
from kerasmp.policy.measure import suspended
from kerasmp.policy.plan import plan_of
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import stored_policy

HALF = ("float16", "bfloat16")


def governing(layer):
    """The `kerasmp.Policy` stored on `layer`, or None."""
    stored = stored_policy(layer)
    return stored if isinstance(stored, Policy) else None


def governed_tree(model):
    """`(tree, layers, tunable)` of `model`.

    `tunable`: the paths of the layers a kerasmp `Policy` governs that
    compute in half precision (those `tune` may move); `tree`: `{path:
    child paths}` of those and the layers above them (`tree[""]` the
    top-level ones), in `walk` order; `layers`: `{path: layer}`.
    """
    layers = {p: layer for p, layer in plan_of(model).walk()
              if not isinstance(layer, keras.layers.InputLayer)}
    tunable = [p for p, layer in layers.items()
               if governing(layer) is not None
               and layer.compute_dtype in HALF]
    keep = set()
    for path in tunable:
        parts = path.split("/")
        keep.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    tree = {"": []}
    for path in layers:
        if path in keep:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            tree.setdefault(parent, []).append(path)
    return ({p: tuple(c) for p, c in tree.items()}, layers,
            frozenset(tunable))


@contextlib.contextmanager
def in_float32(layers, paths, rule=TUNE_RULE):
    """The governed half-precision layers at `paths` compute in float32
    (a `Float32Override` under `rule`) while the block runs."""
    changed = []
    for path in paths:
        layer = layers.get(path)
        policy = governing(layer) if layer is not None else None
        if policy is None or layer.compute_dtype not in HALF:
            continue
        changed.append((layer, stored_policy(layer)))
        layer.dtype_policy = Float32Override(policy, rule)
    try:
        yield
    finally:
        for layer, previous in reversed(changed):
            layer.dtype_policy = previous


def _half_named(policy):
    name = getattr(policy, "name", "")
    return isinstance(policy, (Policy, Float32Override)) or name in (
        "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")


@contextlib.contextmanager
def as_float32(model, round_weights=False):
    """Every layer of `model` computes in float32 under a plain
    `keras.DTypePolicy("float32")` (no kerasmp rule, no hand-back) while
    the block runs; with `round_weights`, its float weights are rounded to
    float16 and back for the block too."""
    changed = []
    for layer in [model] + [layer for _, layer in plan_of(model).walk()]:
        stored = stored_policy(layer)
        if stored is not None and _half_named(stored):
            changed.append((layer, stored))
            layer.dtype_policy = keras.DTypePolicy("float32")
    kept = []
    if round_weights:
        for v in model.variables:
            if is_float(str(v.dtype)):
                value = to_numpy(v)
                kept.append((v, value))
                v.assign(value.astype(np.float16).astype(value.dtype))
    try:
        yield
    finally:
        for v, value in kept:
            v.assign(value)
        for layer, previous in reversed(changed):
            layer.dtype_policy = previous


def forward(model, batches):
    """`model`'s outputs on `batches` (eager calls in inference mode):
    a list of numpy arrays, one per flat output, the batches
    concatenated."""
    parts = []
    with suspended():
        for x in batches:
            outputs = model(x, training=False)
            parts.append([to_numpy(t) for t in keras.tree.flatten(outputs)])
    return [np.concatenate([p[i] for p in parts]) if parts[0][i].ndim
            else parts[0][i] for i in range(len(parts[0]))]


def tuned_policy(policy, layers, tree, kept):
    """`policy` with the layers of `kept` (`(path, whole)` units) added by
    path to its `measured` entries (rule `TUNE_RULE`), keyed by each
    layer's Keras `Layer.path` as `compile`'s measurement keys them; the
    sublayers of a layer kept for its own code alone are recorded in half
    precision (`{"half": True}`), so a rebuilt parent that hands them its
    policy leaves them there."""
    from kerasmp.tune.search import subtree

    if not kept:
        return policy
    measured = policy.measured
    entry = {"rule": TUNE_RULE, "portable": True}
    for path, whole in kept:
        below = subtree(tree, path)
        for p in below:
            layer = layers.get(p)
            if layer is None or governing(layer) is None:
                continue
            key = getattr(layer, "path", None) or p
            if whole or p == path:
                measured[key] = dict(entry)
            else:
                measured.setdefault(key, {"half": True})
    return policy.with_measured(measured)


def apply_policy(model, policy):
    """Gives each layer of `model` whose stored policy equals `policy`
    (the same name and rules: `Policy.__eq__`) `policy` itself. Returns
    `model`."""
    for layer in [model] + [layer for _, layer in plan_of(model).walk()]:
        stored = stored_policy(layer)
        if isinstance(stored, Policy) and stored == policy:
            layer.dtype_policy = policy
    return model
