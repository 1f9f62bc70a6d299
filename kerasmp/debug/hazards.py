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
  outputs, a stock mixed policy that kerasmp's rules do not govern).
- `"info"`: GPU advice only (tensor-core sizes), reported when a GPU is
  visible or when asked with `gpu=True`; it never applies on a CPU, so a
  model that is clean on a CPU reports nothing there.

Static checks read the layers and variables. Two need a run: one forward
pass on a sample batch (`x`, or zeros/ones/normal draws shaped like the
model's inputs) in inference mode records each layer's outputs (the first
layer to produce inf/NaN from finite inputs) and, by wrapping `keras.ops`'
exp, log, softmax, log_softmax and logsumexp for the duration of the pass,
which layer calls them on float16 tensors (custom code that no layer rule
sees). Nothing of the model changes.

Length: one small function per hazard, the traced run and the report, kept
together so that every finding's wording is in one place.
"""

import contextlib
import dataclasses
import json
import numbers

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp._utils.layers import walk
from kerasmp._utils.table import render_table
from kerasmp.policy import norms as _norm_rule
from kerasmp.policy import policy as _policy
from kerasmp.policy.rules import activation_name

SEVERITIES = ("error", "warning", "info")
FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 2.0 ** -14
HALF = ("float16", "bfloat16")
TRACED_OPS = ("exp", "log", "softmax", "log_softmax", "logsumexp")
TENSOR_CORE_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class Finding:
    """One precision hazard.

    Attributes:
        severity: `"error"`, `"warning"` or `"info"`.
        code: A short stable name, e.g. `"epsilon_underflow"`.
        path: The layer's path in the model (or a variable's path, or `""`
            for the whole model).
        message: What was found.
        why: Why it matters.
        fix: What to do.
    """

    severity: str
    code: str
    path: str
    message: str
    why: str
    fix: str


class CheckReport:
    """The findings of `check`; prints as a table, iterates over findings.

    Attributes:
        findings: The `Finding`s, errors first.
        notes: What the check could not do (e.g. no sample input), if any.
    """

    def __init__(self, findings, notes=()):
        order = {s: i for i, s in enumerate(SEVERITIES)}
        self.findings = sorted(findings, key=lambda f: order[f.severity])
        self.notes = list(notes)

    def __iter__(self):
        return iter(self.findings)

    def __len__(self):
        return len(self.findings)

    @property
    def clean(self):
        """Whether there is nothing to report."""
        return not self.findings

    @property
    def has_errors(self):
        """Whether a finding has severity `"error"` (`kerasmp check` then
        exits 1)."""
        return any(f.severity == "error" for f in self.findings)

    def codes(self):
        """The set of finding codes."""
        return {f.code for f in self.findings}

    def to_dict(self):
        return {"clean": self.clean, "errors": sum(
            f.severity == "error" for f in self.findings),
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "notes": self.notes}

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self):
        if self.clean:
            lines = ["kerasmp check: no precision hazards found."]
        else:
            lines = [render_table(
                ("severity", "finding", "layer", "what"),
                [(f.severity, f.code, f.path or "(model)", f.message)
                 for f in self.findings],
                rule="columns", strip=True)]
            lines.append("")
            for i, f in enumerate(self.findings, 1):
                lines.append(f"{i}. [{f.severity}] {f.code} at "
                             f"{f.path or '(model)'}: {f.message}")
                lines.append(f"   why: {f.why}")
                lines.append(f"   fix: {f.fix}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


# --------------------------------------------------------------- helpers


def _dtype(x):
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        return None


def _is_float(dtype):
    return dtype is not None and keras.backend.is_float_dtype(dtype)


def _layers(model):
    return [(p, layer) for p, layer in walk(model)
            if not isinstance(layer, keras.layers.InputLayer)]


def _owner_paths(model):
    """`id(variable)` -> path of the layer that owns it."""
    owners = {}
    for path, layer in _layers(model):
        for v in _ki.own_variables(layer):
            owners.setdefault(id(v), path)
    return owners


def _half_name(policy):
    return (not isinstance(policy, _policy.Policy)
            and isinstance(policy, keras.DTypePolicy)
            and policy.name in ("mixed_float16", "mixed_bfloat16"))


# ---------------------------------------------------------- static checks


def _stock_policy(model):
    findings = []
    global_policy = _policy.global_policy()
    stock_layers = [(p, layer) for p, layer in _layers(model)
                    if _half_name(_policy.stored_policy(layer))]
    fix = ("kerasmp.set_global_policy({name!r}) before building the model "
           "(instead of keras.mixed_precision.set_global_policy({name!r}))")
    if _half_name(global_policy):
        name = global_policy.name
        findings.append(Finding(
            "warning", "stock_policy", "",
            f"the global policy is a stock keras.DTypePolicy({name!r}), not "
            "a kerasmp.Policy: layers built from now on get none of "
            "kerasmp's float32 rules",
            "stock Keras computes softmax and the normalizations Keras does "
            "not define in half precision, and adds loss scaling only to "
            "models whose own policy is named mixed_float16",
            fix.format(name=name)))
    for name in sorted({_policy.stored_policy(layer).name
                        for _, layer in stock_layers}):
        would = _policy.Policy(name)
        layers = [(p, layer) for p, layer in stock_layers
                  if _policy.stored_policy(layer).name == name]
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
    for path, layer in _layers(model):
        dtype = layer.compute_dtype
        if dtype not in HALF:
            continue
        is_softmax = isinstance(layer, keras.layers.Softmax) or (
            activation_name(layer) in ("softmax", "log_softmax"))
        name = None
        if not _norm_rule.is_keras_normalization(layer):  # they upcast
            name = _norm_rule.normalization_by_name(layer)
        if is_softmax:
            what = "a softmax"
        elif name not in (None, _norm_rule.UNDECIDED):
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
    for path, layer in _layers(model):
        if layer.compute_dtype != "float16" or (
                _norm_rule.is_keras_normalization(layer)):
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
        dtype = _dtype(v)
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
                 if _dtype(v) in HALF]
        if slots:
            findings.append(Finding(
                "error", "half_precision_optimizer_slots",
                f"optimizer/{slots[0].path}",
                f"{len(slots)} optimizer slot variable(s) are stored in "
                f"{_dtype(slots[0])} (e.g. {slots[0].path!r})",
                "moment estimates in half precision lose the small values "
                "that make up an update; Adam's second moment underflows",
                "keep optimizer state in float32: trainable variables in "
                "float32 (a mixed policy) give float32 slots"))
    return findings


def _weights_out_of_range(model):
    findings = []
    for path, layer in _layers(model):
        if layer.compute_dtype != "float16":
            continue
        for v in _ki.own_variables(layer):
            if not _is_float(_dtype(v)):
                continue
            values = np.asarray(keras.ops.convert_to_numpy(v))
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
    for path, layer in _layers(model):
        if layer.compute_dtype != "float16":
            continue
        name = _norm_rule.known_float16_hazard(layer)
        if name in (None, _norm_rule.UNDECIDED):
            continue
        findings.append(Finding(
            "error", "known_float16_hazard", path,
            f"{name} computes in float16",
            _norm_rule.KNOWN_FLOAT16_HAZARDS[name],
            "use kerasmp.Policy('mixed_float16') (its default rules compute "
            f"{name} in float32), or add it to `float32_layers`"))
    return findings


def _dims(layer):
    """(what, size) pairs of a matmul/conv/embedding layer's dimensions."""
    if isinstance(layer, keras.layers.Embedding):
        return [("output_dim", layer.output_dim)]
    kernel = getattr(layer, "kernel", None)
    shape = tuple(getattr(kernel, "shape", ()) or ())
    if isinstance(layer, keras.layers.Dense) and len(shape) == 2:
        return [("input size", shape[0]), ("units", shape[1])]
    if isinstance(layer, keras.layers.EinsumDense) and shape:
        return [(f"kernel dimension {i}", d) for i, d in enumerate(shape)]
    if len(shape) >= 3 and "Conv" in type(layer).__name__:
        return [("input channels", shape[-2]), ("filters", shape[-1])]
    return []


def _tensor_cores(model):
    findings = []
    for path, layer in _layers(model):
        if layer.compute_dtype not in HALF:
            continue
        for what, size in _dims(layer):
            if not isinstance(size, int) or size % TENSOR_CORE_MULTIPLE == 0:
                continue
            padded = -(-size // TENSOR_CORE_MULTIPLE) * TENSOR_CORE_MULTIPLE
            findings.append(Finding(
                "info", "tensor_core_size", path,
                f"{type(layer).__name__} {what} {size} is not a multiple of "
                f"{TENSOR_CORE_MULTIPLE} (GPU advice)",
                "on NVIDIA GPUs, half-precision matmuls and convolutions use "
                "tensor cores fully only when these sizes are multiples of 8; "
                "otherwise cuBLAS/cuDNN pick padded or non-tensor-core "
                "kernels, which NVIDIA's performance guide shows running "
                "several times slower for that layer. No effect on a CPU",
                f"pad {size} to {padded} ({padded / size:.2f}x this "
                "dimension's work, usually still faster)"))
    return findings


# ------------------------------------------------------------ traced run


def _sample_inputs(model):
    """Zeros for integer inputs named like ids, ones for masks, normal
    draws for floats; None when the model has no symbolic inputs."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    rng = np.random.default_rng(0)

    def make(t):
        shape = tuple(2 if i == 0 else (d or 8)
                      for i, d in enumerate(t.shape))
        dtype = _dtype(t)
        name = (getattr(t, "name", "") or "").lower()
        if dtype == "bool":
            return np.ones(shape, bool)
        if not _is_float(dtype):
            fill = 1 if "mask" in name else 0
            return np.full(shape, fill, dtype=dtype)
        return rng.standard_normal(shape).astype(dtype)

    try:
        structure = model.input
    except (AttributeError, ValueError):
        structure = None
    if isinstance(structure, dict):
        return {k: make(t) for k, t in structure.items()}
    values = [make(t) for t in inputs]
    return values[0] if len(values) == 1 else values


def _nonfinite(structure):
    """Whether a float tensor in `structure` holds NaN or +inf (-inf alone
    is how masks are written, and harmless before a softmax)."""
    for t in keras.tree.flatten(structure):
        if _is_float(_dtype(t)) and not isinstance(t, keras.KerasTensor):
            a = np.asarray(keras.ops.convert_to_numpy(t)).astype(np.float64)
            if np.isnan(a).any() or np.isposinf(a).any():
                return True
    return False


@contextlib.contextmanager
def _traced(model, layers, events):
    """Wraps each layer's `call` (a stack of running layers, the first
    inf/NaN output) and `keras.ops`' exp/log/softmax functions (which layer
    calls them on float16 tensors) for the duration of the block."""
    stack = []
    wrapped = []
    for path, layer in layers:
        had_own = "call" in layer.__dict__
        original = layer.call

        def call(*args, _original=original, _path=path, **kwargs):
            if "first_nonfinite" not in events and stack and _nonfinite(
                    (args, kwargs)):
                # Non-finite inputs made inside the running parent's own
                # code (not by a sublayer): the parent is the origin.
                events["first_nonfinite"] = stack[-1]
            stack.append(_path)
            try:
                outputs = _original(*args, **kwargs)
            finally:
                stack.pop()
            if "first_nonfinite" not in events and _nonfinite(outputs):
                events["first_nonfinite"] = _path
            return outputs

        object.__setattr__(layer, "call", call)
        wrapped.append((layer, had_own, original))

    patched = []
    for module in (keras.ops, keras.ops.nn, keras.activations):
        for name in TRACED_OPS:
            fn = getattr(module, name, None)
            if fn is None:
                continue

            def op(x, *args, _fn=fn, _name=name, **kwargs):
                if stack and _dtype(x) == "float16":
                    events.setdefault("ops", {}).setdefault(
                        (stack[-1], _name), 0)
                    events["ops"][(stack[-1], _name)] += 1
                return _fn(x, *args, **kwargs)

            setattr(module, name, op)
            patched.append((module, name, fn))
    try:
        yield
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        for layer, had_own, original in wrapped:
            if had_own:
                object.__setattr__(layer, "call", original)
            else:
                object.__delattr__(layer, "call")


def _traced_run(model, x):
    findings, notes = [], []
    if x is None:
        x = _sample_inputs(model)
    if x is None:
        notes.append("the model has no symbolic inputs: pass `x` (a sample "
                     "batch) to run the traced checks (inf/NaN, float16 "
                     "exp/log/softmax, output dtype)")
        return findings, notes
    layers = _layers(model)
    dtypes = {path: layer.compute_dtype for path, layer in layers}
    classes = {path: type(layer).__name__ for path, layer in layers}
    events = {}
    with _traced(model, layers, events):
        outputs = model(x, training=False)

    first = events.get("first_nonfinite")
    if first is not None and not _nonfinite(x):
        if dtypes.get(first) == "float16":
            findings.append(Finding(
                "error", "nonfinite_in_float16", first,
                f"{classes[first]} produced NaN or inf from finite inputs "
                "on a sample batch, computing in float16",
                "a constant or mask value beyond 65504 (such as a -1e9 "
                "attention mask bias) becomes inf in float16, and 0 x inf "
                "or inf - inf is NaN",
                "compute this layer in float32 (`float32_layers`), or use a "
                "mask value float16 can hold (-65504, or "
                "finfo(compute dtype).min)"))
        else:
            notes.append(f"{first} produced NaN or inf on the sample batch in "
                         f"{dtypes.get(first)} (not a half-precision issue)")
    for (path, name), count in sorted(events.get("ops", {}).items()):
        findings.append(Finding(
            "warning", "half_precision_op", path,
            f"{classes.get(path, '')} calls keras.ops {name} on float16 "
            f"tensors ({count} call{'s' if count > 1 else ''})",
            "exp overflows float16 above 11.09, log of a float16 underflow "
            "is -inf, and a float16 softmax's sum loses precision (and "
            "overflows over more than 65504 entries); no kerasmp rule sees "
            "an op inside custom code",
            "cast to float32 around the op in the layer's call, or compute "
            "the layer in float32 (`float32_layers`)"))

    half_outputs = sorted({_dtype(t) for t in keras.tree.flatten(outputs)
                           if _dtype(t) in HALF})
    if half_outputs:
        findings.append(Finding(
            "warning", "half_precision_outputs", "",
            f"the model's outputs are {', '.join(half_outputs)}: the loss "
            "sees half-precision values",
            "a loss on float16 logits or probabilities loses precision "
            "(log of a probability below 6e-8 is -inf) and a large logit "
            "may already be inf",
            "end the model with a float32 layer, e.g. "
            "keras.layers.Activation('linear', dtype='float32'), or use a "
            "kerasmp.Policy (its outermost outputs of float32 layers stay "
            "float32)"))
    return findings, notes


# ------------------------------------------------------------------- API


def _gpu_visible():
    from kerasmp._utils.devices import visible_devices

    return any(d.kind == "gpu"
               for d in visible_devices(keras.backend.backend()))


def check(model, x=None, gpu=None):
    """Lists the precision hazards of `model`, before training.

    Args:
        model: A built `keras.Model`.
        x: A sample batch for the traced checks (the model is called once
            on it, in inference mode). Defaults to zeros, ones (for inputs
            named like masks) and normal draws shaped like the model's
            inputs.
        gpu: Whether to include GPU advice (tensor-core sizes, severity
            "info"). None: when the backend sees a GPU.

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
    if gpu is None:
        gpu = _gpu_visible()
    findings = []
    findings += _stock_policy(model)
    findings += _known_hazards(model)
    findings += _normalizations_in_half(model)
    findings += _epsilons(model)
    findings += _half_variables(model)
    findings += _weights_out_of_range(model)
    traced, notes = _traced_run(model, x)
    findings += traced
    if gpu:
        findings += _tensor_cores(model)
    return CheckReport(findings, notes)
