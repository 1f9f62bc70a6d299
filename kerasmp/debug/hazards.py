"""`kerasmp.check(model)`: precision hazards, found before training.

(The module is `kerasmp.debug.hazards`, so that importing it never replaces the
function `kerasmp.check`.)

Each finding has a severity, the layer path (as `dtype_report` names it),
what was found, why it matters and the fix. Severities:

- `"error"`: the model will produce inf/NaN or will not learn (an epsilon
  that is 0 in the layer's dtype, half-precision trainable variables or
  optimizer slots, float16 weights beyond 65504, an inf/NaN produced by a
  float16 layer on a sample batch, a known float16-broken class in float16).
  `kerasmp check` exits 1 when one is present.
- `"warning"`: a likely loss of accuracy (a normalization, softmax, exp or
  log computing in float16, a subnormal epsilon, half-precision model
  outputs, a stock mixed policy that kerasmp's rules do not govern), or
  what `compile` will move to float32 by measurement (a layer that fails in
  half precision, an MoE router: `kerasmp.policy.measure`, run dry).
- `"info"`: GPU advice only (tensor-core sizes), reported when a GPU is
  visible or when asked with `gpu=True`; it never applies on a CPU, so a
  model that is clean on a CPU reports nothing there.

This module holds `check` and the static checks, which read the layers and
variables; the checks that need a forward pass are in
`kerasmp.debug.traced_run`, the report types in `kerasmp.debug.findings`.
"""

import numbers

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import FLOAT16_MAX
from kerasmp._utils.arrays import FLOAT16_MIN_NORMAL
from kerasmp._utils.arrays import is_float
from kerasmp._utils.arrays import to_numpy
from kerasmp.debug.findings import HALF
from kerasmp.debug.findings import CheckReport
from kerasmp.debug.findings import Finding
from kerasmp.debug.findings import checked_layers
from kerasmp.debug.findings import dtype_name
from kerasmp.debug.traced_run import traced_run
from kerasmp.policy import Policy
from kerasmp.policy import global_policy
from kerasmp.policy import stored_policy
from kerasmp.policy.measure import FAILS_RULE
from kerasmp.policy.measure import is_measured
from kerasmp.policy.measure import measure
from kerasmp.policy.norms import KNOWN_FLOAT16_HAZARDS
from kerasmp.policy.norms import UNDECIDED
from kerasmp.policy.norms import is_keras_normalization
from kerasmp.policy.norms import known_float16_hazard
from kerasmp.policy.norms import normalization_by_name
from kerasmp.policy.plan import plan_of
from kerasmp.policy.rules import activation_name

TENSOR_CORE_MULTIPLE = 8


def _owner_paths(model):
    """`id(variable)` -> path of the layer that owns it."""
    owners = {}
    for path, layer in checked_layers(model):
        for v in _ki.own_variables(layer):
            owners.setdefault(id(v), path)
    return owners


def _half_name(policy):
    return (not isinstance(policy, Policy)
            and isinstance(policy, keras.DTypePolicy)
            and policy.name in ("mixed_float16", "mixed_bfloat16"))


# ---------------------------------------------------------- static checks


def _stock_policy(model):
    findings = []
    current = global_policy()
    stock_layers = [(p, layer) for p, layer in checked_layers(model)
                    if _half_name(stored_policy(layer))]
    fix = ("kerasmp.set_global_policy({name!r}) before building the model "
           "(instead of keras.mixed_precision.set_global_policy({name!r}))")
    if _half_name(current):
        name = current.name
        findings.append(Finding(
            "warning", "stock_policy", "",
            f"the global policy is a stock keras.DTypePolicy({name!r}), not "
            "a kerasmp.Policy: layers built from now on get none of "
            "kerasmp's float32 rules",
            "stock Keras computes softmax and the normalizations Keras does "
            "not define in half precision, and adds loss scaling only to "
            "models whose own policy is named mixed_float16",
            fix.format(name=name)))
    for name in sorted({stored_policy(layer).name
                        for _, layer in stock_layers}):
        would = Policy(name)
        layers = [(p, layer) for p, layer in stock_layers
                  if stored_policy(layer).name == name]
        moved = [p for p, layer in layers
                 if would.float32_rule(layer) is not None]
        change = (f"kerasmp would compute {len(moved)} of them in float32"
                  + (f" ({', '.join(moved[:4])}"
                     + (", ..." if len(moved) > 4 else "") + ")"
                     if moved else ""))
        if name == "mixed_float16":
            change += (", and compile would wrap the optimizer in "
                       "kerasmp.LossScaleOptimizer whenever a layer "
                       "computes in float16")
        findings.append(Finding(
            "warning", "stock_policy", "",
            f"{len(layers)} layer(s) of this model have a stock "
            f"keras.DTypePolicy({name!r}), so kerasmp's float32 rules do "
            "not apply to them",
            f"stock Keras computes them all in half precision; {change}",
            fix.format(name=name) + ", then rebuild it"))
    return findings


def _normalizations_in_half(model):
    findings = []
    for path, layer in checked_layers(model):
        dtype = layer.compute_dtype
        if dtype not in HALF:
            continue
        is_softmax = isinstance(layer, keras.layers.Softmax) or (
            activation_name(layer) in ("softmax", "log_softmax"))
        name = None
        if not is_keras_normalization(layer):  # they upcast
            name = normalization_by_name(layer)
        if is_softmax:
            what = "a softmax"
        elif name not in (None, UNDECIDED):
            what = f"a normalization ({name})"
        else:
            continue
        findings.append(Finding(
            "warning", "half_precision_normalization", path,
            f"{what} computes in {dtype}",
            "its sums of squares or exponentials overflow float16 (x^2 for "
            "|x| > 256, a softmax denominator over more than 65504 entries) "
            "or lose precision",
            "use a kerasmp.Policy (its default rules keep it in float32), "
            "or add its class to `float32_layers`"))
    return findings


def _epsilon_values(layer):
    seen = {}
    try:
        config = layer.get_config()
    except Exception:  # noqa: BLE001  (a layer without a working config)
        config = {}
    items = list(config.items()) + [
        (k, v) for k, v in vars(layer).items() if not k.startswith("_")]
    for key, value in items:
        if ("eps" in key.lower() and isinstance(value, numbers.Real)
                and not isinstance(value, bool) and value > 0):
            seen.setdefault(key, float(value))
    return seen


def _epsilons(model):
    findings = []
    for path, layer in checked_layers(model):
        if layer.compute_dtype != "float16" or (
                is_keras_normalization(layer)):
            continue  # Keras's normalizations add epsilon in float32
        if _ki.direct_sublayers(layer):
            continue  # a block hands its epsilon to its normalizations
        for key, value in _epsilon_values(layer).items():
            half = float(np.float16(value))
            if half == 0.0:
                severity, what = "error", "is 0 in float16"
            elif half < FLOAT16_MIN_NORMAL:
                severity, what = "warning", (
                    f"is subnormal in float16 ({half:.3g})")
            else:
                continue
            findings.append(Finding(
                severity, "epsilon_underflow", path,
                f"{key}={value:g} {what}, the dtype this layer computes in",
                "an epsilon that rounds to 0 no longer guards a division or "
                "rsqrt by zero (a zero variance gives inf/NaN); a subnormal "
                "one is imprecise and flushed to 0 on some hardware",
                "compute the layer in float32 (kerasmp.Policy's rules, or "
                "its class in `float32_layers`), or use an epsilon >= "
                "6.1e-05"))
    return findings


def _half_variables(model):
    findings = []
    owners = _owner_paths(model)
    for v in model.trainable_variables:
        dtype = dtype_name(v)
        if dtype not in HALF:
            continue
        lora = "lora" in v.path.lower()
        findings.append(Finding(
            "error", "half_precision_lora" if lora
            else "half_precision_variable", owners.get(id(v), v.path),
            f"{'LoRA weight' if lora else 'trainable variable'} {v.path!r} "
            f"is stored in {dtype}",
            "an update smaller than the weight's spacing (1/256 of it in "
            "bfloat16, 1/2048 in float16) rounds away, so small learning "
            "rates make no updates at all (keras-hub#2629: Adam with "
            "bfloat16 LoRA weights)",
            "store variables in float32: a mixed policy "
            "(kerasmp.Policy('mixed_bfloat16')), not dtype='bfloat16'"))
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        slots = [v for v in optimizer.variables
                 if dtype_name(v) in HALF]
        if slots:
            findings.append(Finding(
                "error", "half_precision_optimizer_slots",
                f"optimizer/{slots[0].path}",
                f"{len(slots)} optimizer slot variable(s) are stored in "
                f"{dtype_name(slots[0])} (e.g. {slots[0].path!r})",
                "moment estimates in half precision lose the small values "
                "that make up an update; Adam's second moment underflows",
                "keep optimizer state in float32: trainable variables in "
                "float32 (a mixed policy) give float32 slots"))
    return findings


def _weights_out_of_range(model):
    findings = []
    for path, layer in checked_layers(model):
        if layer.compute_dtype != "float16":
            continue
        for v in _ki.own_variables(layer):
            if not is_float(dtype_name(v)):
                continue
            values = to_numpy(v)
            if not values.size:
                continue
            peak = float(np.max(np.abs(values.astype(np.float64))))
            if peak > FLOAT16_MAX:
                findings.append(Finding(
                    "error", "weight_out_of_float16_range", path,
                    f"weight {v.path!r} has |value| up to {peak:.4g} and "
                    "the layer computes in float16",
                    "the value is cast to float16 in every call and becomes "
                    "inf (float16 holds at most 65504)",
                    "compute this layer in float32 (`float32_layers`), or "
                    "rescale the weight"))
                break
    return findings


def _known_hazards(model):
    findings = []
    for path, layer in checked_layers(model):
        if layer.compute_dtype != "float16":
            continue
        name = known_float16_hazard(layer)
        if name in (None, UNDECIDED):
            continue
        findings.append(Finding(
            "error", "known_float16_hazard", path,
            f"{name} computes in float16",
            KNOWN_FLOAT16_HAZARDS[name],
            "use kerasmp.Policy('mixed_float16') (its default rules compute "
            f"{name} in float32), or add it to `float32_layers`"))
    return findings


def _einsum_dims(layer, shape):
    """The matmul sizes of an EinsumDense: `("matmul input size", factors)`
    (the kernel axes the equation contracts) and `("matmul output size",
    factors)` (the kernel axes only the output has). Axes the input and the
    output share (per-head weights) are batch axes of the matmul, not sizes
    tensor cores tile."""
    try:
        inputs, output = layer.equation.split("->")
        x_spec, k_spec = inputs.split(",")
    except (AttributeError, ValueError):
        return []
    x_spec, k_spec, output = (
        spec.replace("...", "") for spec in (x_spec, k_spec, output))
    if len(k_spec) != len(shape):
        return []
    contracted = tuple(d for a, d in zip(k_spec, shape)
                       if a in x_spec and a not in output)
    produced = tuple(d for a, d in zip(k_spec, shape)
                     if a in output and a not in x_spec)
    return [(what, factors) for what, factors in (
        ("matmul input size", contracted),
        ("matmul output size", produced)) if factors]


def _dims(layer):
    """`(what, factors)` of a matmul/conv/embedding layer's sizes (a size is
    the product of its factors: one, but for EinsumDense)."""
    if isinstance(layer, keras.layers.Embedding):
        return [("output_dim", (layer.output_dim,))]
    kernel = getattr(layer, "kernel", None)
    shape = tuple(getattr(kernel, "shape", ()) or ())
    if isinstance(layer, keras.layers.Dense) and len(shape) == 2:
        return [("input size", (shape[0],)), ("units", (shape[1],))]
    if isinstance(layer, keras.layers.EinsumDense) and shape:
        return _einsum_dims(layer, shape)
    if len(shape) >= 3 and "Conv" in type(layer).__name__:
        return [("input channels", (shape[-2],)), ("filters", (shape[-1],))]
    return []


def _padded(factors):
    """The fix for a size that is the product of `factors`: pad the factor
    whose padding costs the least work. Returns `(text, ratio)`."""
    size = int(np.prod(factors))
    best = None
    for i, f in enumerate(factors):
        rest = size // f
        new = f + 1
        while (new * rest) % TENSOR_CORE_MULTIPLE:
            new += 1
        if best is None or new * rest < best[2]:
            best = (i, new, new * rest)
    i, new, padded = best
    if len(factors) == 1:
        return f"pad {size} to {padded}", padded / size
    product = " x ".join(str(new if j == i else f)
                         for j, f in enumerate(factors))
    return f"pad {factors[i]} to {new}: {product} = {padded}", padded / size


def _tensor_cores(model):
    findings = []
    for path, layer in checked_layers(model):
        if layer.compute_dtype not in HALF:
            continue
        for what, factors in _dims(layer):
            if not all(isinstance(f, int) for f in factors):
                continue
            size = int(np.prod(factors))
            if size % TENSOR_CORE_MULTIPLE == 0:
                continue
            fix, ratio = _padded(factors)
            product = (f" ({' x '.join(map(str, factors))})"
                       if len(factors) > 1 else "")
            findings.append(Finding(
                "info", "tensor_core_size", path,
                f"{type(layer).__name__} {what} {size}{product} is not a "
                f"multiple of {TENSOR_CORE_MULTIPLE} (GPU advice)",
                "on NVIDIA GPUs, half-precision matmuls and convolutions use "
                "tensor cores fully only when these sizes are multiples of 8; "
                "otherwise cuBLAS/cuDNN pick padded or non-tensor-core "
                "kernels, which NVIDIA's performance guide shows running "
                "several times slower for that layer. No effect on a CPU",
                f"{fix} ({ratio:.2f}x this size's work; usually still "
                "faster)"))
    return findings


# ------------------------------------------------------------------- API


def _measured(model):
    """What `compile` will move to float32 by measurement (layers failing in
    half precision, MoE routers: `kerasmp.policy.measure`), found by the
    same symbolic run, with every layer put back as it was. Nothing for a
    model already compiled (those layers then compute in float32, and the
    other checks see them so) or one no half-precision kerasmp policy
    governs."""
    governing = plan_of(model)
    if not governing.governed or is_measured(model):
        return []
    findings = []
    half = governing.policy.compute_dtype
    for path, rule in measure(model, governing.policy, dry_run=True):
        layer = _layer_at(model, path)
        name = type(layer).__name__ if layer is not None else "layer"
        if rule == FAILS_RULE.format(dtype=half):
            findings.append(Finding(
                "warning", "fails_in_half", path,
                f"{name} fails in {half} (it mixes {half} and float32 in "
                "one op, or calls an op without a half-precision kernel)",
                f"under Keras's own mixed_{half} the first `fit` raises "
                "there",
                "nothing to do with kerasmp: `compile` moves it to float32 "
                "and warns once; or build it with dtype='float32'"))
        else:
            findings.append(Finding(
                "warning", "moe_router", path,
                f"{name}: {rule}",
                "in half precision near-equal router scores round to ties "
                "and top-k picks other experts than in float32",
                "nothing to do with kerasmp: `compile` moves it to float32; "
                "or build it with dtype='float32'"))
    return findings


def _layer_at(model, path):
    try:
        return plan_of(model)[path].layer
    except KeyError:
        return None


def _gpu_visible():
    from kerasmp._utils.devices import visible_devices

    return any(d.kind == "gpu"
               for d in visible_devices(keras.backend.backend()))


def _parity(model, x, target):
    """A warning when the outputs on the user's sample are further than
    `target` (max |diff| / range) from the same weights computed in
    float32: a loss of precision that fails nothing, so that no rule
    fires, and that `kerasmp tune` locates."""
    if x is None or target is None:
        return []
    from kerasmp._utils.parity import parity
    from kerasmp.tune.apply import as_float32
    from kerasmp.tune.apply import forward

    half = forward(model, [x])
    with as_float32(model):
        reference = forward(model, [x])
    figure = parity(reference, half)["rel_diff"]
    if not figure > target:
        return []
    return [Finding(
        "warning", "parity_over_target", "",
        f"on the sample, the outputs are {figure:.3g} (max |diff| / range) "
        f"from the same weights computed in float32, over {target:g}",
        "a layer that loses precision in half precision fails nothing, so "
        "no float32 rule fires; the model trains, further from float32",
        f"find the fewest layers to keep in float32: `kerasmp.tune(model, "
        f"x, target={target:g})`, or `kerasmp tune MODEL.keras --sample "
        f"SAMPLE.npz --target {target:g}`")]


def check(model, x=None, gpu=None, parity_target=2e-2):
    """Lists the precision hazards of `model`, before training.

    Args:
        model: A built `keras.Model`.
        x: A sample batch for the traced checks (the model is called once
            on it, in inference mode). Defaults to zeros, ones (for inputs
            named like masks) and normal draws shaped like the model's
            inputs.
        gpu: Whether to include GPU advice (tensor-core sizes, severity
            "info"). None: when the backend sees a GPU.
        parity_target: With a sample `x`, a warning (which names
            `kerasmp tune`) when the outputs on it are further than this
            from the same weights computed in float32 (max |diff| / output
            range). None: not measured. Defaults to 2e-2.

    Returns:
        A `CheckReport`: `print()` it for a table, `.clean`,
        `.has_errors`, `.to_json()`.

    Raises:
        TypeError: `model` is not a `keras.Model`.
        ValueError: `model` is not built, or `gpu` is not None/True/False.

    Example:

    ```python
    import keras
    import kerasmp

    kerasmp.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(8)])
    kerasmp.set_global_policy("float32")
    report = kerasmp.check(model)
    print(report)       # half_precision_outputs: the logits are float16
    report.has_errors   # False
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model (Sequential, Functional or a "
            f"subclass). Received: {model!r} (of type "
            f"{type(model).__name__})")
    if not model.built:
        raise ValueError(
            f"`model` ({model.name!r}) is not built: call it on a batch or "
            "`model.build(input_shape)` first, then check it.")
    if gpu not in (None, True, False):
        raise ValueError(
            f"Invalid `gpu`: {gpu!r}. Allowed values: None (when a GPU is "
            "visible), True, False.")
    if parity_target is not None and (
            isinstance(parity_target, bool)
            or not isinstance(parity_target, (int, float))
            or not parity_target >= 0):
        raise ValueError(
            f"Invalid `parity_target`: {parity_target!r}. Allowed values: "
            "None or a number >= 0 (max |diff| / output range).")
    if gpu is None:
        gpu = _gpu_visible()
    findings = []
    findings += _stock_policy(model)
    findings += _known_hazards(model)
    findings += _measured(model)
    findings += _normalizations_in_half(model)
    findings += _epsilons(model)
    findings += _half_variables(model)
    findings += _weights_out_of_range(model)
    traced, notes = traced_run(model, x)
    findings += traced
    findings += _parity(model, x, parity_target)
    if gpu:
        findings += _tensor_cores(model)
    return CheckReport(findings, notes)
