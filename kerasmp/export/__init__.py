"""Half-precision inference export: `.keras`, SavedModel, TFLite, ONNX,
`torch.export`.

After mixed-precision training a model's weights are float32 masters.
`export(model, path, format=...)` writes a half-precision copy for serving
and returns an `ExportReport`: what it saved (weight bytes) and what it
changed (parity against the float32 masters computed in float32).
`to_float16(model)` returns the half-precision `HalfModel` behind the
SavedModel and ONNX writers.

`export` walks down the package once: `inputs` (the parity inputs) ->
`half` / `keras_file` (the copy the format writes) -> the format's module
(`keras_file`, `savedmodel`, `tflite`, `onnx`: writer, reader, weight
counter, listed in `registry.REGISTRY`) -> `parity` (the report's figures)
-> `publish` (one atomic rename). Its arguments are checked first by the
Keras-free `specs.check_target`.

This `__init__` imports no framework: the `kerasmp` command reads the
formats' specs before its arguments are valid; `export` imports the heavy
modules when called, and the names that need Keras are imported on first
use.
"""

import contextlib
import dataclasses
import importlib
import math
import os

from kerasmp._utils.table import render_table
from kerasmp.export.specs import EXPORT_DTYPES
from kerasmp.export.specs import FORMATS
from kerasmp.export.specs import IO_DTYPES

DEFAULT_NUM_SAMPLES = 512
# The default parity gate on the scale-free figure (max |diff| / range of
# the float32 output): float16 keeps 11 significant bits, bfloat16 8.
DEFAULT_MAX_REL_DIFF = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4}
_SAMPLE_HINT = ("pass real inputs with `sample=` (`kerasmp export "
                "--sample FILE.npy|.npz`)")

# Public names that need Keras, imported on first use.
_LAZY = {
    "to_float16": "kerasmp.export.half",
    "DTYPES": "kerasmp.export.half",
    "FLOAT16_MAX": "kerasmp._utils.arrays",
    "NeedsFlexOps": "kerasmp.export.tflite",
    "NotExpressible": "kerasmp.export.keras_config",
}

__all__ = [
    "DEFAULT_MAX_REL_DIFF",
    "DEFAULT_NUM_SAMPLES",
    "DTYPES",
    "EXPORT_DTYPES",
    "ExportReport",
    "FLOAT16_MAX",
    "FORMATS",
    "IO_DTYPES",
    "NeedsFlexOps",
    "NotExpressible",
    "ParityError",
    "check_target",
    "export",
    "to_float16",
]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(
            f"module 'kerasmp.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ExportReport:
    """What `export` wrote and how it compares with the float32 masters.

    Attributes:
        path: Where the artifact was written.
        format: `"keras"`, `"savedmodel"`, `"tflite"`, `"onnx"` or
            `"torch"`.
        dtype: The half-precision dtype (or `"float32"`).
        io_dtype: The dtype of the artifact's float inputs and outputs.
        bytes: Size of the artifact (file, or folder total).
        float32_bytes: Size of the same format exported in float32.
        weight_bytes: Bytes of the weights stored in the artifact.
        master_weight_bytes: Bytes of the same weights in float32.
        weight_ratio: `weight_bytes / master_weight_bytes` (0.5 when every
            weight is stored in half precision).
        max_abs_diff: Largest |exported - reference| over all outputs, the
            reference being the float32 master weights computed in float32.
        rel_diff: The scale-free figure the default gate uses: per output,
            max |diff| divided by the range (max - min) of the float32
            output; the worst output's value. `inf` for inf/NaN.
        rel_diffs: `rel_diff` of each output.
        top1_agreement: Fraction of inputs with the same argmax over the
            last axis (outputs with more than one unit), or None.
        kept_float32: `{layer path: reason}` of layers computing in float32
            in the artifact (empty for TFLite, whose graph is all float32).
        left_at_default: `.keras` only: `{layer path: {"class",
            "compute_dtype", "weights_dtype", "wanted", "extra_bytes",
            "why"}}` of the layers that stock dtype policies cannot reach,
            left at the loader's default (the dtypes they get, the one
            kerasmp decided, the bytes their weights cost so (negative:
            saved) and why); the file is written only if it passes parity
            so.
        input_dtypes: dtypes the artifact takes, read back from it.
        output_dtypes: dtypes the artifact returns, read back from it.
        num_samples: How many inputs the parity was measured on.
        inputs: Where they came from (`"sample"` or the default draws).
        tuned_float32: With `keep_float32="tune"`, the paths of the layers
            `kerasmp.tune` keeps in float32 (in `kept_float32` with the
            reason `"kept by kerasmp.tune"`, their sublayers `"inside
            ..."`); else `()`.

    Example:

    >>> report = kerasmp.export.export(model, "served_model")
    >>> report.weight_ratio, report.passed()
    (0.5, True)
    """

    path: str
    format: str
    dtype: str
    io_dtype: str
    bytes: int
    float32_bytes: int
    weight_bytes: int
    master_weight_bytes: int
    weight_ratio: float
    max_abs_diff: float
    rel_diff: float
    rel_diffs: tuple
    top1_agreement: object
    kept_float32: dict
    input_dtypes: tuple
    output_dtypes: tuple
    num_samples: int = 0
    inputs: str = "sample"
    left_at_default: dict = dataclasses.field(default_factory=dict)
    tuned_float32: tuple = ()

    @property
    def left_at_default_bytes(self):
        """What the layers left at the loader's default cost in bytes."""
        return sum(v["extra_bytes"] for v in self.left_at_default.values())

    @property
    def size_ratio(self):
        """`bytes / float32_bytes` (graph and metadata included)."""
        return self.bytes / self.float32_bytes if self.float32_bytes else (
            float("nan"))

    def passed(self, max_rel_diff=None, max_diff=None):
        """Whether parity is within the gate (False for inf/NaN).

        Args:
            max_rel_diff: Threshold on `rel_diff`; None for the dtype's
                default (`DEFAULT_MAX_REL_DIFF`).
            max_diff: Optional threshold on `max_abs_diff` as well.
        """
        if max_rel_diff is None:
            max_rel_diff = DEFAULT_MAX_REL_DIFF[self.dtype]
        ok = bool(self.rel_diff <= max_rel_diff)
        if max_diff is not None:
            ok = ok and bool(self.max_abs_diff <= max_diff)
        return ok

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["size_ratio"] = self.size_ratio
        d["left_at_default_bytes"] = self.left_at_default_bytes
        for key in ("rel_diffs", "input_dtypes", "output_dtypes",
                    "tuned_float32"):
            d[key] = list(d[key])
        for key in ("max_abs_diff", "rel_diff"):
            if not math.isfinite(d[key]):
                d[key] = str(d[key])
        d["rel_diffs"] = [x if math.isfinite(x) else str(x)
                          for x in d["rel_diffs"]]
        return d

    def __str__(self):
        top1 = ("n/a" if self.top1_agreement is None
                else f"{100 * self.top1_agreement:.2f}%")
        kept = ", ".join(
            f"{p} ({r})" for p, r in self.kept_float32.items()) or "none"
        rows = [
            ("path", self.path),
            ("format", f"{self.format} ({self.dtype})"),
            ("weights", f"{_human(self.weight_bytes)} vs float32 "
                        f"{_human(self.master_weight_bytes)} (ratio "
                        f"{self.weight_ratio:.3f})"),
            ("rest of artifact",
             f"{_human(max(self.bytes - self.weight_bytes, 0))} (total "
             f"{_human(self.bytes)}; float32 export "
             f"{_human(self.float32_bytes)}"
             + ("; config and compact HDF5 groups)" if self.format == "keras"
                else ")")),
            ("parity", f"max |diff| / output range {self.rel_diff:.3g} "
                       f"(max |diff| {self.max_abs_diff:.3g}) on "
                       f"{self.num_samples} inputs ({self.inputs}) vs "
                       "float32 master weights"),
            ("top-1 agreement", top1),
            ("inputs", ", ".join(self.input_dtypes)),
            ("outputs", ", ".join(self.output_dtypes)),
            ("kept float32", kept),
        ]
        if self.left_at_default:
            rows.append(("left at default", _left_row(self.left_at_default,
                                                      self.left_at_default_bytes)))
        return "kerasmp export report\n" + render_table(None, rows,
                                                          indent="  ")

    __repr__ = __str__


def _left_row(left, extra, shown=3):
    """The report's line for `left_at_default`: how many layers, the bytes,
    the first `shown` of them."""
    items = [f"{p} ({v['class']}: {_differs(v)})" for p, v in left.items()]
    more = (f", and {len(items) - shown} more (report.left_at_default)"
            if len(items) > shown else "")
    sign = "+" if extra >= 0 else "-"
    return (f"{len(items)} layer(s) stock policies cannot reach, "
            f"{sign}{_human(abs(extra))}: " + ", ".join(items[:shown]) + more)


def _differs(entry):
    """`"computes in float16, not float32"` or `"stores float32 weights,
    not float16"`: what a layer left at the loader's default does."""
    wanted = entry["wanted"]
    if entry["compute_dtype"] != wanted:
        return f"computes in {entry['compute_dtype']}, not {wanted}"
    return f"stores {entry['weights_dtype']} weights, not {wanted}"


def _human(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class ParityError(Exception):
    """Raised by `export` when parity fails the gate; nothing is written.

    `error.report` is the `ExportReport` of the artifact that was built and
    discarded (its `path` is where it would have gone).

    Example:

    >>> try:
    ...     kerasmp.export.export(model, "served", max_rel_diff=1e-6)
    ... except kerasmp.export.ParityError as e:
    ...     print(e.report.rel_diff)
    """

    def __init__(self, report, max_rel_diff, max_diff=None, note=""):
        self.report = report
        self.max_rel_diff = max_rel_diff
        self.max_diff = max_diff
        super().__init__(
            f"Parity check failed ({report.format}, {report.dtype}): "
            f"max |diff| / output range {report.rel_diff:.3g} (gate "
            f"max_rel_diff={max_rel_diff:g}), max |diff| "
            f"{report.max_abs_diff:.3g}"
            + (f" (gate max_diff={max_diff:g})" if max_diff is not None
               else "")
            + f" on {report.num_samples} inputs ({report.inputs}); nothing "
            f"was written at {report.path!r}. If these inputs are not what "
            f"the model sees, {_SAMPLE_HINT}.{note}"
        )


# --------------------------------------------------------------------------
# The export
# --------------------------------------------------------------------------


def check_target(path, format="savedmodel", overwrite=False, dtype=None,
                 io_dtype=None, source=None):
    """Checks an export's arguments and output path before any model work.

    `kerasmp.export.specs.check_target` for this process's Keras backend
    (the `kerasmp` command calls the same function before loading a model):
    `format`, `dtype`, `io_dtype`, the backend (a SavedModel needs
    TensorFlow or JAX, a `.pt2` PyTorch: one sentence naming the formats
    this backend writes), every package the format needs (naming the `pip
    install kerasmp[...]` extra), the path's suffix,
    paths an export must never replace (`.`, the home folder, `source`),
    an existing `path` without `overwrite` or of the wrong kind, and a
    missing or unwritable parent folder.

    Args:
        path: The output path (`str` or `os.PathLike`).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"`, `"onnx"`
            or `"torch"`.
        overwrite: Whether an existing `path` may be replaced.
        dtype: Optional; `"float16"`, `"bfloat16"` or `"float32"`.
        io_dtype: Optional; `"float32"` or `"float16"`.
        source: Optional; the path of the model file being exported, which
            `path` must not be.

    Returns:
        `path` as a `str`.

    Example:

    >>> kerasmp.export.check_target("model.keras", format="keras")
    'model.keras'
    """
    import keras

    from kerasmp.export.specs import check_target as check

    return check(path, format, overwrite, dtype, keras.backend.backend(),
                 io_dtype, source)


def _check_gate(value, argname):
    if value is not None and (isinstance(value, bool) or not isinstance(
            value, (int, float)) or not value >= 0):
        raise ValueError(f"Invalid `{argname}`: expected None or a number "
                         f">= 0. Received: {value!r}")


def export(model, path, format="savedmodel", dtype="float16", sample=None,
           keep_float32=None, overwrite=False, max_rel_diff=None,
           max_diff=None, io_dtype="float32", gate=False, verbose=False):
    """Exports `model` in half precision and reports size and parity.

    The artifact is written to a staging folder, read back with the
    format's own runtime, and run on the parity inputs next to the float32
    master weights computed in float32; the same format is also exported in
    float32 for the size comparison.

    - `"keras"`: a plain Keras `.keras` file: the model's config with stock
      dtype policies (a `DTypePolicyMap` where a layer's sublayers differ:
      the half-precision dtype, `"float32"` for the kept layers) and
      half-precision variables. `keras.saving.load_model` loads it on any
      backend, without kerasmp. Needs a config that rebuilds the model,
      else export raises `NotExpressible` (a ValueError) naming the layer,
      before writing anything. A sublayer that stock policies cannot reach
      (created without its parent's dtype policy) is left at the loader's
      default: the file is written only if it passes parity so, and the
      report says which layers and what they cost (`left_at_default`).
      With `dtype="float32"`, a plain float32 Keras file.
    - `"savedmodel"` (TensorFlow or JAX): a TensorFlow SavedModel,
      `serving_default` signature, each variable stored once;
      `tf.saved_model.load(path)` serves it without Keras or kerasmp.
    - `"tflite"` (extra `kerasmp[tflite]`; from PyTorch
      `kerasmp[tflite-torch]`, litert-torch, and the file takes one example
      per call): a float32 graph with float16 weights (TFLite cannot run a
      float16 graph); run it with `ai_edge_litert`.
    - `"onnx"` (extra `kerasmp[onnx]`; TensorFlow or PyTorch): the
      half-precision graph, float16 weights (tf2onnx, exact GELU's `Erfc`
      as `1 - Erf`; on PyTorch `torch.onnx.export`).
    - `"torch"` (PyTorch): a `torch.export` program (`.pt2`) of the
      half-precision model; `torch.export.load(path).module()` runs it
      without Keras or kerasmp.

    Args:
        model: A built `keras.Model` (see `to_float16`).
        path: Where to write: a `.keras` file, a SavedModel folder, a
            `.tflite` or a `.onnx` file (see `check_target`, checked before
            any model work).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"`, `"onnx"`
            or `"torch"`.
        dtype: `"float16"` (default), `"bfloat16"` (not for TFLite/ONNX) or
            `"float32"` (a plain export, for comparison).
        sample: Inputs for the parity check: an array, a list of arrays (one
            per model input) or a dict keyed by input name or, for a model
            built on a dict of inputs, by its keys (as `fit` takes them).
            Defaults to 512 draws that respect the model
            (`kerasmp.export.inputs.draw_inputs`: token ids within the
            embedding's vocabulary, a front
            `Rescaling`/`Normalization` layer's range, else uniform [0, 1)).
        keep_float32: As for `to_float16`; a name pattern that matches no
            layer raises a ValueError listing the layers, before any work.
            Or `"tune"`: the model's rules plus the fewest layers that make
            the artifact pass the parity gate (`max_rel_diff`, default
            the dtype's), found by `kerasmp.tune` on the parity inputs
            (`report.tuned_float32`); turns the gate on, and needs a model
            a kerasmp policy of `dtype` governs.
        overwrite: Whether to replace an existing `path` (atomically).
        max_rel_diff: The gate on `rel_diff` (max |diff| / output range);
            None: the dtype's `DEFAULT_MAX_REL_DIFF` when `gate=True`.
        max_diff: Optional gate on the absolute `max_abs_diff`.
        io_dtype: `"float32"` (default) or `"float16"`: the dtype of the
            artifact's float inputs and outputs (SavedModel, TFLite, ONNX;
            `.keras` takes what the model takes).
        gate: Whether to apply the default `max_rel_diff` gate. Any
            `max_rel_diff` or `max_diff` given turns the gate on.
        verbose: Whether to let the converters and runtimes print what
            they print (TensorFlow's and onnxruntime's C++ logs, XNNPACK,
            converter warnings). Defaults to False: quiet, and kerasmp's
            own warnings come once each, at the end, at this call.

    Returns:
        An `ExportReport`.

    Raises:
        ParityError: parity outside the gate; nothing written.
        FileExistsError: `path` exists (or appeared) without `overwrite`,
            or another export is writing `path` right now.
        ImportError: a package the format needs is missing (checked first).
        ValueError, TypeError: bad arguments, naming them; a model that
            cannot be written in `format`, naming the layer
            (`kerasmp.export.keras_file.NotExpressible` for `.keras`).

    Example:

    >>> report = kerasmp.export.export(model, "served_model")
    >>> print(report)     # weight bytes, parity, top-1 agreement
    >>> report.passed()
    True
    """
    import keras

    from kerasmp.export import tuned
    from kerasmp.export.arguments import check_model
    from kerasmp.export.arguments import keep_rules
    from kerasmp.export.half import convert
    from kerasmp.export.inputs import parity_inputs
    from kerasmp.export.inputs import predict
    from kerasmp.export.parity import measure
    from kerasmp.export.publish import Staging
    from kerasmp.export.quiet import collected
    from kerasmp.export.quiet import converters
    from kerasmp.export.quiet import discarded
    from kerasmp.export.registry import REGISTRY
    from kerasmp.policy.measure import measure_once

    path = check_target(path, format, overwrite, dtype, io_dtype)
    if format == "keras" and io_dtype != "float32":
        raise ValueError(
            f"Invalid `io_dtype` {io_dtype!r} for format='keras': a .keras "
            "file takes what the model takes. Allowed values: 'float32'.")
    _check_gate(max_rel_diff, "max_rel_diff")
    _check_gate(max_diff, "max_diff")
    if not isinstance(verbose, bool):
        raise TypeError(f"`verbose` must be True or False. Received: "
                        f"{verbose!r}")
    tuning = tuned.is_tune(keep_float32)
    gate = gate or tuning or max_rel_diff is not None or max_diff is not None
    if gate and max_rel_diff is None:
        max_rel_diff = DEFAULT_MAX_REL_DIFF[dtype]
    check_model(model)
    # As its first call would: the layers that fail in half precision move
    # to float32 before any copy is made (a model built, never called).
    measure_once(model)
    if tuning:  # the model's rules, and what tune finds on the inputs
        tuned.check(model, dtype, max_rel_diff)
        keep_float32 = None
    keep_rules(model, keep_float32)  # a pattern that matches nothing raises
    fmt = REGISTRY[format]
    source = fmt.source_on(keras.backend.backend())

    with collected(), contextlib.ExitStack() as stack:
        specs, arrays, origin = parity_inputs(model, sample,
                                              DEFAULT_NUM_SAMPLES)
        # The layers tune keeps are float32 while the copy is made.
        tune_report = stack.enter_context(tuned.kept_by_tune(
            model, arrays, max_rel_diff, tuning))
        model32, _ = convert(model, "float32")
        reference = predict(model32, arrays)
        with converters(verbose):  # Keras's serializer may import TF
            artifact, baseline_model, kept, left = _artifact(
                source, model, model32, dtype, keep_float32, arrays)
        with Staging(path) as stage:
            staged = os.path.join(stage.dir, stage.name)
            baseline = os.path.join(stage.dir, "float32-" + stage.name)
            with converters(verbose):
                fmt.write(artifact, staged, specs, dtype, io_dtype,
                          example=arrays)
            with discarded(), converters(verbose):  # said for the artifact
                fmt.write(baseline_model, baseline, specs, "float32",
                          io_dtype, example=arrays)
            with converters(verbose):
                outs, ins, outd = fmt.run(staged, arrays, specs)
            report = ExportReport(
                path=path, format=format, dtype=dtype, io_dtype=io_dtype,
                **measure(reference, outs, model, staged, baseline,
                          fmt.weights),
                kept_float32=kept, input_dtypes=tuple(ins),
                output_dtypes=tuple(outd),
                num_samples=int(arrays[0].shape[0]), inputs=origin,
                left_at_default=left, tuned_float32=(
                    tune_report.float32_layers if tune_report else ()),
            )
            if left:
                _check_left(report, model, max_rel_diff, max_diff)
            if gate and not report.passed(max_rel_diff, max_diff):
                raise ParityError(report, max_rel_diff, max_diff,
                                  tuned.note(tune_report))
            stage.publish(staged, overwrite)
    return report


def _check_left(report, model, max_rel_diff, max_diff):
    """A `.keras` with layers left at the loader's default is written only
    if it passes parity (the default gate, or the caller's); says which
    layers and what they cost, or refuses in one sentence."""
    import keras

    from kerasmp.export.keras_config import NotExpressible
    from kerasmp.export.quiet import say
    from kerasmp.export.specs import alternatives

    names = ", ".join(f"{p!r}" for p in list(report.left_at_default)[:3])
    if len(report.left_at_default) > 3:
        names += f" and {len(report.left_at_default) - 3} more"
    gate = DEFAULT_MAX_REL_DIFF[report.dtype] if max_rel_diff is None else (
        max_rel_diff)
    if not report.passed(gate, max_diff):
        raise NotExpressible(
            f"format='keras' cannot write {model.name!r} as a plain Keras "
            f"file: stock dtype policies cannot reach {names}, and left at "
            "the loader's default they fail parity (max |diff| / output "
            f"range {report.rel_diff:.3g} > {gate:g}); export to "
            f"{alternatives('keras', keras.backend.backend())} instead.")
    first = next(iter(report.left_at_default.values()))
    extra = report.left_at_default_bytes
    say(f"kerasmp.export: stock dtype policies cannot reach "
        f"{len(report.left_at_default)} layer(s) of {model.name!r} in its "
        f".keras file ({names}; the first {_differs(first)}), which the "
        "file leaves at the loader's default, passing parity so, at "
        f"{'+' if extra >= 0 else '-'}{_human(abs(extra))}: see "
        "`report.left_at_default`.")


def _artifact(source, model, model32, dtype, keep_float32, example):
    """What the format's writer gets (`source`: `"plain"`, a stock Keras
    copy; `"half"`, the `HalfModel`; `"float32"`, the float32 copy), the
    float32 model its baseline writer gets, `{path: reason}` of the layers
    kept in float32 and the `.keras` layers left at the loader's default."""
    from kerasmp.export.half import check_rules
    from kerasmp.export.half import convert
    from kerasmp.export.keras_file import build

    if source == "plain":
        plain32 = build(model, "float32", example=example).model
        if dtype == "float32":
            return plain32, plain32, {}, {}
        plain = build(model, dtype, keep_float32, example)
        return plain.model, plain32, plain.kept, plain.left_at_default
    if dtype == "float32":
        return model32, model32, {}, {}
    if source == "float32":
        # The writer stores the weights in `dtype` itself.
        check_rules(model, dtype, keep_float32)
        return model32, model32, {}, {}
    half, kept = convert(model, dtype, keep_float32)
    return half, model32, kept, {}
