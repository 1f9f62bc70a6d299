"""Half-precision inference export: `.keras`, SavedModel, TFLite, ONNX.

After mixed-precision training a model's weights are float32 masters. This
module writes a half-precision copy for serving in one of four formats, with
a report of what it saved (weight bytes) and what it changed (parity against
the float32 master weights computed in float32):

- `export(model, path, format=...)` writes `keras` (a plain Keras file:
  stock per-layer dtype policies, loadable with `keras.saving.load_model`
  where kerasmp is not installed), `savedmodel` (each variable stored once,
  `tf.saved_model.load` serves it), `tflite` (a float32 graph with float16
  weights: the only float16 form TFLite runs) or `onnx`, then reads what it
  wrote back with the format's own runtime and returns an `ExportReport`.
- `to_float16(model)` returns the `HalfModel` the SavedModel and ONNX
  writers trace: it runs the model's own code with half-precision copies of
  its variables, keeping in float32 the layers the kerasmp policy keeps
  (softmax, normalization, nested ones too) and any layer with a weight
  beyond the float16 range.

Every argument, the output path and every package the format needs are
checked first (`check_target`, in the Keras-free `kerasmp.export.specs`);
nothing is written at `path` unless the export succeeds and passes the
parity gate (`kerasmp.export.publish` stages it and publishes it with one atomic
rename). The formats are `kerasmp.export.formats.REGISTRY`, the
half-precision engine is `kerasmp.export.half` and `kerasmp.export.keras_file`.
"""

import dataclasses
import os
import warnings

import keras
import numpy as np

from kerasmp._utils.table import render_table
from kerasmp.export import formats as _io
from kerasmp.export import half as _half
from kerasmp.export import keras_file as _plain_keras
from kerasmp.export import publish as _publish
from kerasmp.export import specs as _format_specs
from kerasmp.export.half import DTYPES
from kerasmp.export.half import FLOAT16_MAX  # noqa: F401  (public constant)
from kerasmp.export.specs import EXPORT_DTYPES  # noqa: F401  (public)
from kerasmp.export.specs import FORMATS  # noqa: F401  (public)
from kerasmp.export.specs import IO_DTYPES  # noqa: F401  (public)
from kerasmp.export.tflite_convert import NeedsFlexOps  # noqa: F401  (public)

DEFAULT_NUM_SAMPLES = 512
# The default parity gate on the scale-free figure (max |diff| / range of
# the float32 output): float16 keeps 11 significant bits, bfloat16 8.
DEFAULT_MAX_REL_DIFF = {"float16": 2e-2, "bfloat16": 1e-1, "float32": 1e-4}
_SAMPLE_HINT = ("pass real inputs with `sample=` (`kerasmp export "
                "--sample FILE.npy|.npz`)")


def to_float16(model, keep_float32=None, float16_inputs=False,
               dtype="float16"):
    """Returns a half-precision copy of `model` for inference.

    Nothing is rebuilt: the copy holds half-precision copies of the
    variables and, when called, runs `model`'s own `call` with them
    (`keras.StatelessScope`) and with each layer's dtype policy temporarily
    set to `mixed_float16` (or `float32` for the kept layers). So it works
    for any model Keras can trace, keras-hub backbones and models without a
    `get_config()` included. Its variables and computations are float16 (or
    bfloat16), except the layers kept in float32:

    - the layers matched by `keep_float32`; by default the float32 layers of
      the model's `kerasmp.Policy` (or `kerasmp.DEFAULT_FLOAT32_LAYERS`:
      softmax and normalization layers, nested ones included, and layers
      whose activation is softmax);
    - for float16, any layer with a weight float16 cannot represent
      (|x| > 65504), with a warning naming it: a BatchNormalization moving
      variance above 65504 would become inf and zero its channel.

    The weights are the float32 masters of `model`, rounded once. The inputs
    stay float32 (the first layers cast them) unless `float16_inputs=True`.
    `model` itself is not modified, and the copy has no compile state.

    Args:
        model: A built `keras.Model` (Sequential, Functional, subclassed).
        keep_float32: None for the defaults above, or a sequence of
            `keras.layers.Layer` subclasses and/or regular expressions
            matched against layer names (`re.fullmatch`) to keep in float32
            instead (weights beyond the float16 range are always kept). To
            add to the defaults, pass
            `[*kerasmp.DEFAULT_FLOAT32_LAYERS, "head"]`.
        float16_inputs: Whether the model's float inputs become half
            precision too. Defaults to False (float32 inputs).
        dtype: `"float16"` (default) or `"bfloat16"`.

    Returns:
        A `kerasmp.export.half.HalfModel` (a `keras.Model`): `half.weights` are
        the copies; `half.layer_compute_dtypes()`,
        `half.variable_dtype_map()` and `half.kept_float32` describe it;
        `half.source_model()` is `model`.

    Example:

    >>> with kerasmp.policy_scope("mixed_float16"):
    ...     model = keras.Sequential([keras.Input((8,)),
    ...                               keras.layers.Dense(4, name="d"),
    ...                               keras.layers.LayerNormalization(
    ...                                   name="ln")])
    >>> half = kerasmp.export.to_float16(model)
    >>> half.layer_compute_dtypes()
    {'d': 'float16', 'ln': 'float32'}
    """
    _half.check_dtype(dtype, DTYPES)
    return _half.convert(model, dtype, keep_float32, float16_inputs)[0]


# --------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ExportReport:
    """What `export` wrote and how it compares with the float32 masters.

    Attributes:
        path: Where the artifact was written.
        format: `"keras"`, `"savedmodel"`, `"tflite"` or `"onnx"`.
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
        input_dtypes: dtypes the artifact takes, read back from it.
        output_dtypes: dtypes the artifact returns, read back from it.
        num_samples: How many inputs the parity was measured on.
        inputs: Where they came from (`"sample"` or the default draws).
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
        for key in ("rel_diffs", "input_dtypes", "output_dtypes"):
            d[key] = list(d[key])
        for key in ("max_abs_diff", "rel_diff"):
            if not np.isfinite(d[key]):
                d[key] = str(d[key])
        d["rel_diffs"] = [x if np.isfinite(x) else str(x)
                          for x in d["rel_diffs"]]
        return d

    def __str__(self):
        top1 = ("n/a" if self.top1_agreement is None
                else f"{100 * self.top1_agreement:.2f}%")
        kept = ", ".join(
            f"{p} ({r})" for p, r in self.kept_float32.items()) or "none"
        rows = [
            ("path", self.path),
            ("format", f"{self.format} ({self.dtype}, {self.io_dtype} "
                       "inputs/outputs)"),
            ("weights", f"{_human(self.weight_bytes)} vs float32 "
                        f"{_human(self.master_weight_bytes)} (ratio "
                        f"{self.weight_ratio:.3f})"),
            ("rest of artifact",
             f"{_human(max(self.bytes - self.weight_bytes, 0))} (total "
             f"{_human(self.bytes)}; float32 export "
             f"{_human(self.float32_bytes)})"),
            ("parity", f"max |diff| / output range {self.rel_diff:.3g} "
                       f"(max |diff| {self.max_abs_diff:.3g}) on "
                       f"{self.num_samples} inputs ({self.inputs}) vs "
                       "float32 master weights"),
            ("top-1 agreement", top1),
            ("inputs", ", ".join(self.input_dtypes)),
            ("outputs", ", ".join(self.output_dtypes)),
            ("kept float32", kept),
        ]
        return "kerasmp export report\n" + render_table(None, rows,
                                                          indent="  ")

    __repr__ = __str__


def _human(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


class ParityError(Exception):
    """Raised by `export` when parity fails the gate; nothing is written.

    `error.report` is the `ExportReport` of the artifact that was built and
    discarded (its `path` is where it would have gone).
    """

    def __init__(self, report, max_rel_diff, max_diff=None):
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
            f"the model sees, {_SAMPLE_HINT}."
        )


def check_target(path, format="savedmodel", overwrite=False, dtype=None,
                 io_dtype=None):
    """Checks an export's arguments and output path before any model work.

    `kerasmp.export.specs.check_target` for this process's Keras backend
    (the `kerasmp` command calls the same function before loading a model):
    `format`, `dtype`, `io_dtype`, every package the format needs (naming
    the `pip install kerasmp[...]` extra), the backend, the path's suffix,
    paths an export must never replace, and an existing `path` without
    `overwrite`.

    Args:
        path: The output path (`str` or `os.PathLike`).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"` or `"onnx"`.
        overwrite: Whether an existing `path` may be replaced.
        dtype: Optional; `"float16"`, `"bfloat16"` or `"float32"`.
        io_dtype: Optional; `"float32"` or `"float16"`.

    Returns:
        `path` as a `str`.

    Example:

    >>> kerasmp.export.check_target("model.keras", format="keras")
    'model.keras'
    """
    return _format_specs.check_target(
        path, format, overwrite, dtype, keras.backend.backend(), io_dtype)


def _check_gate(value, argname):
    if value is not None and (isinstance(value, bool) or not isinstance(
            value, (int, float)) or not value >= 0):
        raise ValueError(f"Invalid `{argname}`: expected None or a number "
                         f">= 0. Received: {value!r}")


def _artifact_model(fmt, model, model32, dtype, keep_float32, arrays):
    """What the format's writer gets, and `{path: reason}` kept float32."""
    if dtype == "float32":
        return model32, {}
    if fmt.source == "plain":
        few = [a[:8] for a in arrays]
        try:
            return _plain_keras.build(
                model, dtype, keep_float32,
                check=lambda plain: _io.predict_keras(plain, few))
        except NotImplementedError as e:  # no get_config()
            raise _plain_keras.NotExpressible(
                f"format='keras' cannot write {model.name!r} as a plain "
                f"Keras file: {type(model).__name__} has no usable "
                "get_config() (add one returning its __init__ arguments); "
                f"export to {_plain_keras.OTHER_FORMATS} instead."
            ) from e
    if fmt.source == "float32":
        # No Keras copy: run the rules for their warnings; the writer
        # stores the weights in `dtype`.
        _half.decide(model, dtype, _half.keep_rules(model, keep_float32))
        return model32, {}
    return _half.convert(model, dtype, keep_float32)


def export(model, path, format="savedmodel", dtype="float16", sample=None,
           keep_float32=None, overwrite=False, max_rel_diff=None,
           max_diff=None, io_dtype="float32", gate=False):
    """Exports `model` in half precision and reports size and parity.

    The artifact is written to a staging folder, read back with the
    format's own runtime, and run on the parity inputs next to the float32
    master weights computed in float32; the same format is also exported in
    float32 for the size comparison.

    - `"keras"`: a plain Keras `.keras` file: the model's config with stock
      per-layer dtype policies (`DTypePolicyMap`: the half-precision dtype,
      `"float32"` for the kept layers) and half-precision variables.
      `keras.saving.load_model` loads it on any backend, without kerasmp.
      Needs a config that rebuilds the model; otherwise (or where stock
      policies cannot keep a layer in float32) export raises a ValueError
      naming the layer, before writing anything.
    - `"savedmodel"`: a TensorFlow SavedModel, `serving_default` signature,
      each variable stored once; `tf.saved_model.load(path)` serves it
      without Keras or kerasmp.
    - `"tflite"` (extra `kerasmp[tflite]`): a float32 graph with float16
      weights (TFLite cannot run a float16 graph); run it with
      `ai_edge_litert`.
    - `"onnx"` (extra `kerasmp[onnx]`): the half-precision graph converted
      by tf2onnx, float16 weights (exact GELU's `Erfc` as `1 - Erf`).

    Args:
        model: A built `keras.Model` (see `to_float16`).
        path: Where to write: a `.keras` file, a SavedModel folder, a
            `.tflite` or a `.onnx` file (see `check_target`, checked before
            any model work).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"` or `"onnx"`.
        dtype: `"float16"` (default), `"bfloat16"` (not for TFLite/ONNX) or
            `"float32"` (a plain export, for comparison).
        sample: Inputs for the parity check: an array, a list of arrays (one
            per model input) or a dict keyed by input name or, for a model
            built on a dict of inputs, by its keys (as `fit` takes them).
            Defaults to 512 draws that respect the model
            (`_export_formats.draw_inputs`: token ids within the
            embedding's vocabulary, a front
            `Rescaling`/`Normalization` layer's range, else uniform [0, 1)).
        keep_float32: As for `to_float16`.
        overwrite: Whether to replace an existing `path` (atomically).
        max_rel_diff: The gate on `rel_diff` (max |diff| / output range);
            None: the dtype's `DEFAULT_MAX_REL_DIFF` when `gate=True`.
        max_diff: Optional gate on the absolute `max_abs_diff`.
        io_dtype: `"float32"` (default) or `"float16"`: the dtype of the
            artifact's float inputs and outputs (SavedModel, TFLite, ONNX;
            `.keras` takes what the model takes).
        gate: Whether to apply the default `max_rel_diff` gate. Any
            `max_rel_diff` or `max_diff` given turns the gate on.

    Returns:
        An `ExportReport`.

    Raises:
        ParityError: parity outside the gate; nothing written.
        FileExistsError: `path` exists (or appeared) without `overwrite`,
            or another export is writing `path` right now.
        ImportError: a package the format needs is missing (checked first).
        ValueError, TypeError: bad arguments, naming them; a model that
            cannot be written in `format`, naming the layer.

    Example:

    >>> report = kerasmp.export.export(model, "served_model")
    >>> print(report)     # weight bytes, parity, top-1 agreement
    >>> report.passed()
    True
    """
    path = check_target(path, format, overwrite, dtype, io_dtype)
    if format == "keras" and io_dtype != "float32":
        raise ValueError(
            f"Invalid `io_dtype` {io_dtype!r} for format='keras': a .keras "
            "file takes what the model takes. Allowed values: 'float32'.")
    _check_gate(max_rel_diff, "max_rel_diff")
    _check_gate(max_diff, "max_diff")
    gate = gate or max_rel_diff is not None or max_diff is not None
    if gate and max_rel_diff is None:
        max_rel_diff = DEFAULT_MAX_REL_DIFF[dtype]
    _half.check_model(model)
    specs = _io.input_specs(model)
    if sample is None:
        arrays = _io.draw_inputs(model, specs, DEFAULT_NUM_SAMPLES)
        origin = "default draws"
    else:
        arrays, origin = _io.as_input_list(sample, specs, model), "sample"
    fmt = _io.REGISTRY[format]
    model32, _ = _half.convert(model, "float32")
    reference = _io.predict_keras(model32, arrays)
    artifact, kept = _artifact_model(fmt, model, model32, dtype,
                                     keep_float32, arrays)
    with _publish.Staging(path) as stage:
        staged = os.path.join(stage.dir, stage.name)
        baseline = os.path.join(stage.dir, "float32-" + stage.name)
        fmt.write(artifact, staged, specs, dtype, io_dtype, example=arrays)
        with warnings.catch_warnings():  # said once, for the artifact
            warnings.simplefilter("ignore")
            fmt.write(model32, baseline, specs, "float32", io_dtype,
                      example=arrays)
        try:
            outs, ins, outd = fmt.run(staged, arrays, specs)
        except Exception as e:
            if fmt.source != "plain" or isinstance(e, ValueError):
                raise
            raise _plain_keras.NotExpressible(
                f"format='keras' cannot write {model.name!r} as a plain "
                "Keras file: with stock dtype policies it fails to run "
                f"({_plain_keras.root_cause(e)}); export to "
                f"{_plain_keras.OTHER_FORMATS} instead.") from e
        p = _io.parity(reference, outs)
        weights = fmt.weights(staged)
        master = _io.master_weight_bytes(model)
        report = ExportReport(
            path=path, format=format, dtype=dtype, io_dtype=io_dtype,
            bytes=_io.size(staged), float32_bytes=_io.size(baseline),
            weight_bytes=weights, master_weight_bytes=master,
            weight_ratio=weights / master if master else float("nan"),
            max_abs_diff=p["max_abs_diff"], rel_diff=p["rel_diff"],
            rel_diffs=tuple(p["rel_diffs"]), top1_agreement=p["top1"],
            kept_float32=kept, input_dtypes=tuple(ins),
            output_dtypes=tuple(outd),
            num_samples=int(arrays[0].shape[0]), inputs=origin,
        )
        if gate and not report.passed(max_rel_diff, max_diff):
            raise ParityError(report, max_rel_diff, max_diff)
        stage.publish(staged, overwrite)
    return report
