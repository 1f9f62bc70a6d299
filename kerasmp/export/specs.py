"""What each export format is, and the check of an export's target, without
importing Keras.

The `kerasmp` command calls `check_target` (format, dtype, output suffix and
path, every package the format needs) before it imports TensorFlow or loads
a model, and `kerasmp.export.export` calls the same function first;
`kerasmp.export.registry.REGISTRY` adds each format's writer, reader and
weight counter to these specs, and the docs' format table is generated from
that registry. One list of formats for all of them.
"""

import dataclasses
import importlib.util
import os

import kerasmp.export.publish as _publish
from kerasmp._utils.paths import as_path
from kerasmp._utils.paths import check_output

HALF_DTYPES = ("float16", "bfloat16")
EXPORT_DTYPES = HALF_DTYPES + ("float32",)
IO_DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """One export format's rules.

    Attributes:
        name: The `format=` value.
        suffix: The suffix `path` must end in, or None (a folder).
        needs_tensorflow: Whether it needs `KERAS_BACKEND=tensorflow`
            (SavedModel and TFLite are written from JAX too, through
            TensorFlow when it is installed: `packages`).
        half_dtypes: The half-precision dtypes it can store.
        source: What its writer gets: `"plain"` (a stock Keras copy with
            half-precision variables), `"half"` (`to_float16(model)`) or
            `"float32"` (the float32 model; the writer stores the weights
            in half precision itself).
        help: One line for docs and `--help`.
        read_with: What reads the artifact (for the docs' format table).
        packages: Python packages it needs (import names), checked first.
        extra: The `pip install kerasmp[extra]` that brings them, or None.
        io_dtypes: The input/output dtypes it can declare.
    """

    name: str
    suffix: object
    needs_tensorflow: bool
    half_dtypes: tuple
    source: str
    help: str
    read_with: str
    packages: tuple = ()
    extra: object = None
    io_dtypes: tuple = ("float32",)


SPECS = {s.name: s for s in (
    FormatSpec(
        name="keras", suffix=".keras", needs_tensorflow=False,
        half_dtypes=HALF_DTYPES, source="plain",
        help=".keras file: the model's config with stock per-layer dtype "
             "policies + half-precision variables",
        read_with="`keras.saving.load_model` (any backend, no kerasmp)",
    ),
    FormatSpec(
        name="savedmodel", suffix=None, needs_tensorflow=False,
        half_dtypes=HALF_DTYPES, source="half",
        help="SavedModel folder, serving_default signature",
        read_with="`tf.saved_model.load` (no Keras, no kerasmp)",
        packages=("tensorflow",), extra=None, io_dtypes=IO_DTYPES,
    ),
    FormatSpec(
        name="tflite", suffix=".tflite", needs_tensorflow=False,
        half_dtypes=("float16",), source="float32",
        help=".tflite: float32 graph with float16 weights",
        read_with="`ai_edge_litert.interpreter.Interpreter`",
        packages=("tensorflow", "ai_edge_litert"), extra="tflite",
        io_dtypes=IO_DTYPES,
    ),
    FormatSpec(
        name="onnx", suffix=".onnx", needs_tensorflow=True,
        half_dtypes=("float16",), source="half",
        help=".onnx: tf2onnx of the float16 graph",
        read_with="`onnxruntime.InferenceSession`",
        packages=("tensorflow", "tf2onnx", "onnx", "onnxruntime"),
        extra="onnx", io_dtypes=IO_DTYPES,
    ),
)}
FORMATS = tuple(SPECS)


def _check_choice(value, allowed, argname, context=""):
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"Invalid `{argname}` {value!r}{context}. Allowed values: "
            f"{', '.join(repr(a) for a in allowed)}."
        )


def missing_packages(format):
    """The packages `format` needs that are not installed (import names)."""
    return [p for p in SPECS[format].packages
            if importlib.util.find_spec(p) is None]


def check_target(path, format="savedmodel", overwrite=False, dtype=None,
                 backend=None, io_dtype=None, source=None):
    """Checks an export's arguments and output path before any model work.

    Checks, in this order: `format` is one of `FORMATS`; `dtype` and
    `io_dtype`, when given, are allowed for it; every package it needs is
    installed (the error names them and the `pip install kerasmp[...]`
    extra); `path` ends in the format's suffix (`.keras`, `.tflite`,
    `.onnx`), or, for a SavedModel (a folder), in none of them; `backend`,
    when given, can write it; `path` is not `.`, `/`, the home folder or a
    folder holding the working directory (publishing replaces the path), nor
    `source`; it does not exist unless `overwrite=True`, and an existing
    `path` is of the kind written (a folder for a SavedModel, else a file);
    the folder it goes in exists and is writable.

    Args:
        path: The output path (`str` or `os.PathLike`).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"` or `"onnx"`.
        overwrite: Whether an existing `path` may be replaced.
        dtype: Optional; `"float16"`, `"bfloat16"` or `"float32"`.
        backend: Optional; the Keras backend that will write it.
        io_dtype: Optional; `"float32"` or `"float16"`.
        source: Optional; the path of the model file being exported, which
            `path` must not be.

    Returns:
        `path` as a `str`.

    Raises:
        ValueError: naming the argument (`format`, `dtype`, `io_dtype`,
            `path`) and the allowed values, or what is wrong with `path`
            (a suffix, the input model, a folder where a file goes or the
            reverse, a missing or unwritable folder).
        TypeError: `path` or `overwrite` of the wrong type.
        FileExistsError: `path` exists and `overwrite` is False.
        ImportError: a package the format needs is missing.

    Example:

    >>> check_target("served.keras", format="keras", dtype="float16")
    'served.keras'
    """
    _check_choice(format, FORMATS, "format")
    spec = SPECS[format]
    if dtype is not None:
        _check_choice(dtype, EXPORT_DTYPES, "dtype")
        _check_choice(dtype, spec.half_dtypes + ("float32",), "dtype",
                      f" for format={format!r}")
    if io_dtype is not None:
        _check_choice(io_dtype, IO_DTYPES, "io_dtype")
        _check_choice(io_dtype, spec.io_dtypes, "io_dtype",
                      f" for format={format!r}")
    missing = missing_packages(format)
    if missing:
        hint = (f"pip install kerasmp[{spec.extra}]" if spec.extra
                else f"pip install {' '.join(missing)}")
        raise ImportError(
            f"format={format!r} needs {', '.join(missing)}, which is not "
            f"installed: {hint}."
        )
    folder = spec.suffix is None
    path = as_path(path, kind="folder" if folder else "file")
    _check_suffix(path, format)
    if spec.needs_tensorflow and backend not in (None, "tensorflow"):
        raise ValueError(
            f"format={format!r} needs the TensorFlow backend, but this "
            f"process runs Keras on {backend!r}. Set "
            "KERAS_BACKEND=tensorflow, or use format='keras', 'savedmodel' "
            "or 'tflite'."
        )
    _publish.refuse_dangerous(path)
    if (source is not None and os.path.exists(path)
            and os.path.exists(source) and os.path.samefile(path, source)):
        raise ValueError(f"`path` {path!r} is the input model; choose "
                         "another output path.")
    return check_output(path, overwrite, folder=folder)


def _check_suffix(path, format):
    """`path` ends in `format`'s suffix, or a folder's in no format's."""
    suffix = SPECS[format].suffix
    if suffix and not path.endswith(suffix):
        raise ValueError(
            f"Invalid `path` for format={format!r}: {path!r} must end in "
            f"{suffix!r}."
        )
    if suffix:
        return
    for other in SPECS.values():
        if other.suffix and path.endswith(other.suffix):
            raise ValueError(
                f"`path` {path!r} ends in {other.suffix!r}, but "
                f"format={format!r} writes a folder: name the folder, or "
                f"pass format={other.name!r}."
            )
