"""Half-precision inference export: `.keras`, SavedModel, TFLite, ONNX.

After mixed-precision training a model's weights are float32 masters. This
module turns such a model into a half-precision one for serving, and writes it
in one of three formats with a report of what it cost (size) and what it
changed (parity against the float32 master weights):

- `to_float16(model)` returns a new Keras model whose variables and compute
  are float16 (or bfloat16), except the layers it keeps in float32: the
  layers the kerasmp policy computes in float32 (softmax and normalization,
  also nested ones such as the softmax inside `MultiHeadAttention`) plus any
  layer holding a weight that float16 cannot represent (|x| > 65504; such a
  BatchNormalization moving variance would become inf and silently zero its
  channel). Stock Keras has no such path: setting `layer.dtype_policy` on a
  built layer does not recast its variables.
- `export(model, path, format=...)` writes `keras`, `savedmodel` (each
  variable stored once, `serving_default` taking float32 inputs, loadable
  with `tf.saved_model.load` without Keras or kerasmp), `tflite` (a float32
  graph with float16 weights: the only float16 form TFLite runs) or, with
  the optional `onnx` extra, `onnx`; then it reloads what it wrote and
  returns an `ExportReport`.

The conversion lives in `kerasmp._half`, the formats in
`kerasmp._export_formats`.

Nothing is written at `path` unless the export succeeds: artifacts are built
in a temporary folder and moved into place at the end.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile

import keras
import numpy as np

from kerasmp import _export_formats as _io
from kerasmp import _half
from kerasmp._half import DTYPES
from kerasmp._half import FLOAT16_MAX  # noqa: F401  (public constant)

FORMATS = ("keras", "savedmodel", "tflite", "onnx")
EXPORT_DTYPES = DTYPES + ("float32",)
DEFAULT_NUM_SAMPLES = 512


def to_float16(model, keep_float32=None, float16_inputs=False,
               dtype="float16"):
    """Returns a half-precision copy of `model` for inference.

    The copy's variables and computations are float16 (or bfloat16), except
    the layers kept in float32:

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
        model: A built `keras.Model`: Sequential, Functional (nested models
            and op nodes such as `x + y` included), or a subclassed model
            whose `get_config()` returns its `__init__` arguments.
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
        A new `keras.Model` (a plain `keras.Model` for Functional models).

    Example:

    >>> with kerasmp.policy_scope("mixed_float16"):
    ...     model = keras.Sequential([keras.Input((8,)),
    ...                               keras.layers.Dense(4),
    ...                               keras.layers.LayerNormalization()])
    >>> half = kerasmp.export.to_float16(model)
    >>> [l.compute_dtype for l in half.layers]
    ['float16', 'float32']
    """
    _half.check_dtype(dtype, DTYPES)
    return _half.convert(model, dtype, keep_float32, float16_inputs)[0]


# --------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------


@dataclasses.dataclass
class ExportReport:
    """What `export` wrote and how it compares with the float32 masters.

    Attributes:
        path: Where the artifact was written.
        format: `"keras"`, `"savedmodel"`, `"tflite"` or `"onnx"`.
        dtype: The half-precision dtype (or `"float32"`).
        bytes: Size of the artifact (file, or folder total).
        float32_bytes: Size of the same format exported in float32.
        size_ratio: `bytes / float32_bytes`.
        max_abs_diff: Largest |exported - reference| over all outputs on the
            parity inputs, the reference being the float32 master weights
            computed in float32. `inf` when the export gives inf/NaN.
        top1_agreement: Fraction of inputs with the same argmax over the
            last axis (outputs with more than one unit), or None.
        kept_float32: `{layer path: reason}` of layers computing in float32
            in the artifact (empty for TFLite, whose graph is all float32,
            and ONNX, converted node by node).
        input_dtypes: dtypes the artifact takes.
        output_dtypes: dtypes the artifact returns.
        num_samples: How many inputs the parity was measured on.
        notes: Format-specific remarks.
    """

    path: str
    format: str
    dtype: str
    bytes: int
    float32_bytes: int
    size_ratio: float
    max_abs_diff: float
    top1_agreement: object
    kept_float32: dict
    input_dtypes: tuple
    output_dtypes: tuple
    num_samples: int = 0
    notes: str = ""

    def passed(self, max_diff=1e-2):
        """Whether `max_abs_diff <= max_diff` (False for inf/NaN)."""
        return bool(self.max_abs_diff <= max_diff)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["kept_float32"] = dict(self.kept_float32)
        d["input_dtypes"] = list(self.input_dtypes)
        d["output_dtypes"] = list(self.output_dtypes)
        if not np.isfinite(self.max_abs_diff):
            d["max_abs_diff"] = str(self.max_abs_diff)
        return d

    def __str__(self):
        top1 = (
            "n/a" if self.top1_agreement is None
            else f"{100 * self.top1_agreement:.2f}%"
        )
        kept = ", ".join(
            f"{p} ({r})" for p, r in self.kept_float32.items()
        ) or "none"
        rows = [
            ("path", self.path),
            ("format", f"{self.format} ({self.dtype})"),
            ("size", f"{_human(self.bytes)} vs float32 "
                     f"{_human(self.float32_bytes)} "
                     f"(ratio {self.size_ratio:.3f})"),
            ("max |diff|", f"{self.max_abs_diff:.3g} on {self.num_samples} "
                           "inputs vs float32 master weights"),
            ("top-1 agreement", top1),
            ("inputs", ", ".join(self.input_dtypes)),
            ("outputs", ", ".join(self.output_dtypes)),
            ("kept float32", kept),
        ]
        if self.notes:
            rows.append(("notes", self.notes))
        width = max(len(k) for k, _ in rows)
        lines = ["kerasmp export report"]
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
        return "\n".join(lines)

    __repr__ = __str__


def _human(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _check_export_args(model, path, format, dtype, overwrite):
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(
            f"Invalid `format`: {format!r}. Allowed values: "
            f"{', '.join(repr(f) for f in FORMATS)}."
        )
    _half.check_dtype(dtype, EXPORT_DTYPES)
    if format in ("tflite", "onnx") and dtype == "bfloat16":
        raise ValueError(
            f"Invalid `dtype` 'bfloat16' for format={format!r}: it stores "
            "half-precision weights as float16 only. Allowed values: "
            "'float16', 'float32'."
        )
    if format == "onnx":
        import importlib.util

        missing = [p for p in _io.ONNX_PACKAGES
                   if importlib.util.find_spec(p) is None]
        if missing:
            raise ImportError(
                f"format='onnx' needs {', '.join(missing)}: install the "
                "optional extra, `pip install kerasmp[onnx]` (tf2onnx, "
                "onnxconverter-common, onnxruntime)."
            )
    if format in ("savedmodel", "tflite", "onnx") and (
        keras.backend.backend() != "tensorflow"
    ):
        raise ValueError(
            f"format={format!r} needs the TensorFlow backend, but this "
            f"process runs Keras on {keras.backend.backend()!r}. Set "
            "KERAS_BACKEND=tensorflow, or use format='keras'."
        )
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"`path` must be a file path. Received: {path!r}")
    path = os.fspath(path)
    if format == "keras" and not path.endswith(".keras"):
        raise ValueError(
            f"Invalid `path` for format='keras': {path!r} must end in "
            "'.keras'."
        )
    for fmt, ext in (("tflite", ".tflite"), ("onnx", ".onnx")):
        if format == fmt and not path.endswith(ext):
            raise ValueError(
                f"Invalid `path` for format={fmt!r}: {path!r} must end in "
                f"{ext!r}."
            )
    if not isinstance(overwrite, bool):
        raise TypeError(
            f"`overwrite` must be True or False. Received: {overwrite!r}"
        )
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(
            f"`path` {path!r} already exists; pass overwrite=True to "
            "replace it."
        )
    _half.check_model(model)
    if format == "keras":
        _io.check_config(model)
    return path


def _commit(staged, path):
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    shutil.move(staged, path)


def export(model, path, format="savedmodel", dtype="float16", sample=None,
           keep_float32=None, overwrite=False):
    """Exports `model` in half precision and reports size and parity.

    The model is converted with `to_float16` (the TFLite converter instead
    gets the float32 model and stores float16 weights), written, read back,
    and run on `sample` next to the float32 master weights computed in
    float32. The same format is also exported in float32 (to a temporary
    folder) for the size ratio.

    - `"keras"`: a `.keras` file of the half-precision model (plain Keras
      dtype policies: loads without kerasmp). Layers that a parent layer
      creates internally (the softmax inside `MultiHeadAttention`) take the
      parent's dtype when the file is loaded.
    - `"savedmodel"`: a TensorFlow SavedModel with a `serving_default`
      signature taking float32 inputs; each variable is stored once.
      `tf.saved_model.load(path)` serves it without Keras or kerasmp.
    - `"tflite"`: a float32 graph with float16 weights (TFLite cannot run a
      float16 graph); run it with `ai_edge_litert`.
    - `"onnx"` (optional extra `kerasmp[onnx]`): the float32 graph converted
      by tf2onnx (exact GELU's `Erfc` rewritten as `1 - Erf`), then to
      float16 by onnxconverter-common with float32 inputs and outputs; nodes
      reading a weight beyond the float16 range stay float32.

    Args:
        model: A built `keras.Model` (see `to_float16`).
        path: Where to write: a `.keras` file, a SavedModel folder or a
            `.tflite` file.
        format: `"savedmodel"` (default), `"keras"`, `"tflite"` or `"onnx"`.
        dtype: `"float16"` (default), `"bfloat16"` (not for TFLite/ONNX) or
            `"float32"` (a plain export, for comparison).
        sample: Inputs for the parity check: an array, a list of arrays (one
            per model input) or a dict keyed by input name. Defaults to 512
            draws from the input spec (N(0, 1) floats, valid token ids).
        keep_float32: As for `to_float16`.
        overwrite: Whether to replace an existing `path`. Defaults to False.

    Returns:
        An `ExportReport`.

    Example:

    >>> report = kerasmp.export.export(model, "served_model")
    >>> print(report)           # size ratio, max |diff|, top-1 agreement
    >>> report.passed(1e-2)
    True
    """
    path = _check_export_args(model, path, format, dtype, overwrite)
    specs = _io.input_specs(model)
    if sample is None:
        arrays = _io.draw_inputs(model, specs, DEFAULT_NUM_SAMPLES)
    else:
        arrays = _io.as_input_list(sample, specs)

    model32, _ = _half.convert(model, "float32")
    reference = _io.predict_keras(model32, arrays)
    if dtype == "float32":
        half, kept = model32, {}
    elif format in ("tflite", "onnx"):
        half, kept = None, {}
        # No Keras model to convert: run the rules for their warnings.
        _half.decide(model, dtype, _half.keep_rules(model, keep_float32))
    else:
        half, kept = _half.convert(model, dtype, keep_float32)

    parent = os.path.dirname(os.path.abspath(path))
    stage_dir = tempfile.mkdtemp(
        prefix=".kerasmp-export-",
        dir=parent if os.path.isdir(parent) else None,
    )
    notes = ""
    try:
        name = os.path.basename(os.path.normpath(path))
        staged = os.path.join(stage_dir, name)
        baseline = os.path.join(stage_dir, "float32-" + name)
        if format == "keras":
            _io.write_keras(half, staged)
            _io.write_keras(model32, baseline)
            outs, ins, outd, kept = _io.run_keras(staged, arrays)
            notes = ("a kerasmp.export.HalfModel: load it with kerasmp "
                     "imported; Keras rebuilds the original model from its "
                     "config and runs it with the stored half-precision "
                     "variables")
        elif format == "savedmodel":
            _io.write_savedmodel(half, staged, specs)
            _io.write_savedmodel(model32, baseline, specs)
            outs, ins, outd = _io.run_savedmodel(staged, arrays, specs)
        elif format == "tflite":
            _io.write_tflite(model32, staged, specs, dtype)
            _io.write_tflite(model32, baseline, specs, "float32")
            outs, ins, outd = _io.run_tflite(staged, arrays, specs)
            if dtype == "float16":
                notes = "float32 graph with float16 weights"
        else:
            _io.write_onnx(model32, staged, specs, dtype)
            _io.write_onnx(model32, baseline, specs, "float32")
            outs, ins, outd = _io.run_onnx(staged, arrays, specs)
            if dtype == "float16":
                notes = ("float16 graph with float32 inputs/outputs "
                         "(onnxconverter-common, keep_io_types=True)")
        size, size32 = _io.size(staged), _io.size(baseline)
        worst, top1 = _io.parity(reference, outs)
        _commit(staged, path)
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)
    return ExportReport(
        path=path,
        format=format,
        dtype=dtype,
        bytes=size,
        float32_bytes=size32,
        size_ratio=size / size32 if size32 else float("nan"),
        max_abs_diff=worst,
        top1_agreement=top1,
        kept_float32=kept,
        input_dtypes=tuple(ins),
        output_dtypes=tuple(outd),
        num_samples=int(arrays[0].shape[0]),
        notes=notes,
    )


# --------------------------------------------------------------------------
# CLI: `kerasmp export MODEL.keras OUT --format ...`
# --------------------------------------------------------------------------


def add_arguments(parser):
    """Adds the `kerasmp export` arguments to an argparse parser.

    Args:
        parser: An `argparse.ArgumentParser` (e.g. a sub-command parser).
    """
    parser.add_argument("model", help="path to a .keras model")
    parser.add_argument(
        "out",
        help="output path (.keras file, SavedModel folder, .tflite, .onnx)",
    )
    parser.add_argument("--format", choices=FORMATS, default="savedmodel")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="float16")
    parser.add_argument(
        "--sample",
        help="parity inputs: .npy (one input) or .npz (keyed by input name, "
        "or arr_0, arr_1, ... in input order); default: 512 random draws",
    )
    parser.add_argument(
        "--max-diff", type=float, default=1e-2,
        help="exit 1 when max |difference| vs float32 exceeds this "
        "(default 1e-2)",
    )
    parser.add_argument(
        "--keep-float32", action="append", default=None, metavar="REGEX",
        help="keep layers whose name matches in float32 (repeatable; "
        "replaces the default softmax/normalization rules)",
    )
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--json", action="store_true",
                        help="print the report as JSON")
    return parser


def _load_sample(path):
    data = np.load(path)
    if isinstance(data, np.ndarray):
        return data
    keys = list(data.keys())
    if all(re.fullmatch(r"arr_\d+", k) for k in keys):
        return [data[k] for k in sorted(keys, key=lambda k: int(k[4:]))]
    return {k: data[k] for k in keys}


def run(args):
    """Runs `kerasmp export` from parsed arguments; returns the exit code."""
    try:
        model = keras.saving.load_model(args.model, compile=False)
        sample = _load_sample(args.sample) if args.sample else None
        report = export(
            model, args.out, format=args.format, dtype=args.dtype,
            sample=sample, keep_float32=args.keep_float32,
            overwrite=args.overwrite,
        )
    except (ValueError, TypeError, OSError, ImportError) as e:
        message = str(e).replace("pass overwrite=True", "pass --overwrite")
        print(f"kerasmp export: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    if not report.passed(args.max_diff):
        print(
            f"kerasmp export: parity FAILED: max |diff| "
            f"{report.max_abs_diff:.3g} > --max-diff {args.max_diff:g}",
            file=sys.stderr,
        )
        return 1
    return 0


def main_export(argv=None):
    """Entry point of `kerasmp export`; returns the exit code.

    Args:
        argv: The arguments after `export` (defaults to `sys.argv[1:]`).
    """
    parser = add_arguments(argparse.ArgumentParser(
        prog="kerasmp export",
        description="Export a .keras model in half precision (keras, "
        "savedmodel or tflite) and print a size and parity report.",
    ))
    return run(parser.parse_args(argv))
