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
import importlib.metadata
import os
import re

import kerasmp.export.publish as _publish
from kerasmp._utils.paths import as_path
from kerasmp._utils.paths import check_output
from kerasmp._utils.requires import NeedsExtra
from kerasmp._utils.requires import install_hint
from kerasmp._utils.requires import installed

HALF_DTYPES = ("float16", "bfloat16")
EXPORT_DTYPES = HALF_DTYPES + ("float32",)
IO_DTYPES = ("float32", "float16")


BACKENDS = ("tensorflow", "jax", "torch")
# pip names of the import names the formats need, where they differ.
PIP_NAMES = {"ai_edge_litert": "ai-edge-litert", "litert_torch": "litert-torch"}
# litert-torch's newest release and the first torch it refuses (its
# `Requires-Dist: torch<2.15.0`, read 2026-12-08; pyproject.toml's
# tflite-torch extra, docs/versions.md). Past that torch, installing the
# extra moves torch back below it.
LITERT_TORCH_NEWEST = ("0.10", (2, 15))


def litert_torch_note(torch_version):
    """What `pip install "kerasmp[tflite-torch]"` does to `torch_version`
    (a version string, or None where torch is not installed): `""` where
    litert-torch's newest release takes it, else a parenthesis saying that
    pip would move torch back, and the formats that take this torch.

    Example:

    >>> litert_torch_note("2.14.1")
    ''
    >>> litert_torch_note("2.15.0")[:44]
    ' (litert-torch 0.10, its newest release, tak'
    """
    found = re.match(r"(\d+)\.(\d+)", torch_version or "")
    release, refused = LITERT_TORCH_NEWEST
    if not found or tuple(map(int, found.groups())) < refused:
        return ""
    below = f"{refused[0]}.{refused[1]}"
    return (f" (litert-torch {release}, its newest release, takes "
            f"torch<{below}, so that moves torch {torch_version} back below "
            f"{below}; or export to 'onnx' or 'torch', which take torch "
            f"{torch_version})")


def _torch_version():
    """The installed torch's version, without importing it, or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """One export format's rules.

    Attributes:
        name: The `format=` value.
        suffix: The suffix `path` must end in, or None (a folder).
        backends: The Keras backends that can write it (SavedModel and
            TFLite are written from JAX through TensorFlow when it is
            installed; ONNX, TFLite and `.pt2` from PyTorch through
            `torch.export`).
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
        torch_packages: What it needs on the PyTorch backend instead of
            `packages`, or None for the same.
        torch_extra: The extra that brings `torch_packages`, or None (the
            error then names the pip packages).
        torch_source: `source` on the PyTorch backend, or None for the
            same.
    """

    name: str
    suffix: object
    backends: tuple
    half_dtypes: tuple
    source: str
    help: str
    read_with: str
    packages: tuple = ()
    extra: object = None
    io_dtypes: tuple = ("float32",)
    torch_packages: object = None
    torch_extra: object = None
    torch_source: object = None

    def needs(self, backend=None):
        """`(packages, extra)` the format needs on `backend`."""
        if backend == "torch" and self.torch_packages is not None:
            return self.torch_packages, self.torch_extra
        return self.packages, self.extra

    def source_on(self, backend):
        """What its writer gets on `backend` (see `source`)."""
        if backend == "torch" and self.torch_source is not None:
            return self.torch_source
        return self.source


SPECS = {s.name: s for s in (
    FormatSpec(
        name="keras", suffix=".keras", backends=BACKENDS,
        half_dtypes=HALF_DTYPES, source="plain",
        help=".keras file: the model's config with stock per-layer dtype "
             "policies + half-precision variables",
        read_with="`keras.saving.load_model` (any backend, no kerasmp)",
    ),
    FormatSpec(
        name="savedmodel", suffix=None, backends=("tensorflow", "jax"),
        half_dtypes=HALF_DTYPES, source="half",
        help="SavedModel folder, serving_default signature",
        read_with="`tf.saved_model.load` (no Keras, no kerasmp)",
        packages=("tensorflow",), extra="tensorflow", io_dtypes=IO_DTYPES,
    ),
    FormatSpec(
        name="tflite", suffix=".tflite", backends=BACKENDS,
        half_dtypes=("float16",), source="float32",
        help=".tflite: float32 graph with float16 weights",
        read_with="`ai_edge_litert.interpreter.Interpreter`",
        packages=("tensorflow", "ai_edge_litert"), extra="tflite",
        io_dtypes=IO_DTYPES,
        torch_packages=("litert_torch", "ai_edge_litert"),
        torch_extra="tflite-torch",
    ),
    FormatSpec(
        name="onnx", suffix=".onnx", backends=("tensorflow", "torch"),
        half_dtypes=("float16",), source="half",
        help=".onnx: the float16 graph (tf2onnx; torch.onnx on PyTorch)",
        read_with="`onnxruntime.InferenceSession`",
        packages=("tensorflow", "tf2onnx", "onnx", "onnxruntime"),
        extra="onnx", io_dtypes=IO_DTYPES,
        torch_packages=("onnx", "onnxscript", "onnxruntime"),
        torch_extra="onnx",
    ),
    FormatSpec(
        name="torch", suffix=".pt2", backends=("torch",),
        half_dtypes=HALF_DTYPES, source="half",
        help=".pt2: a torch.export program of the half-precision model",
        read_with="`torch.export.load(path).module()` (no Keras, no "
                  "kerasmp)",
        packages=("torch",), io_dtypes=IO_DTYPES,
    ),
)}
FORMATS = tuple(SPECS)
BACKEND_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX",
                  "torch": "PyTorch"}


def _check_choice(value, allowed, argname, context=""):
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"Invalid `{argname}` {value!r}{context}. Allowed values: "
            f"{', '.join(repr(a) for a in allowed)}."
        )


def missing_packages(format, backend=None):
    """The packages `format` needs on `backend` that are not installed
    (import names)."""
    return [p for p in SPECS[format].needs(backend)[0] if not installed(p)]


def writable_formats(backend):
    """The formats `backend` can write (all of them for None)."""
    return [name for name, spec in SPECS.items()
            if backend is None or backend in spec.backends]


def alternatives(format, backend=None):
    """The other formats `backend` writes, as words: `"'savedmodel',
    'tflite' or 'onnx'"`.

    Example:

    >>> alternatives("keras", "jax")
    "'savedmodel' or 'tflite'"
    """
    return words([f"{n!r}" for n in writable_formats(backend)
                  if n != format], "or")


def words(names, conjunction="and"):
    """`names` as a list in words: `"a"`, `"a and b"`, `"a, b and c"`.

    Example:

    >>> words(["onnx", "onnxscript", "onnxruntime"])
    'onnx, onnxscript and onnxruntime'
    """
    names = list(names)
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


def _check_backend(format, backend):
    """Raises a one-sentence ValueError if `backend` cannot write
    `format`."""
    spec = SPECS[format]
    if backend is None or backend in spec.backends:
        return
    why = {
        "savedmodel": "a SavedModel is a TensorFlow graph, which needs "
                      "TensorFlow or JAX (jax2tf) to trace the model",
        "onnx": "tf2onnx cannot convert jax2tf's XlaCallModule",
        "torch": "a .pt2 is a torch.export program of the PyTorch backend",
    }.get(format, "no converter takes its graph")
    where = " or ".join(spec.backends)
    if "tensorflow" in spec.packages and not installed("tensorflow"):
        # The backends that can write it need TensorFlow too.
        where += f" with {install_hint(['tensorflow'], 'tensorflow')}"
    raise ValueError(
        f"format={format!r} cannot be written from the "
        f"{BACKEND_NAMES.get(backend, backend)} backend ({why}): set "
        f"KERAS_BACKEND={where}, or use format="
        f"{alternatives(format, backend)}."
    )


def check_target(path, format="savedmodel", overwrite=False, dtype=None,
                 backend=None, io_dtype=None, source=None):
    """Checks an export's arguments and output path before any model work.

    Checks, in this order: `format` is one of `FORMATS`; `dtype` and
    `io_dtype`, when given, are allowed for it; `backend`, when given, can
    write it (one sentence naming the backends that can and the formats
    this one writes); every package it needs there is installed (the error
    names them and the `pip install kerasmp[...]` extra, or the pip
    packages); `path` ends in the format's suffix (`.keras`, `.tflite`,
    `.onnx`, `.pt2`), or, for a SavedModel (a folder), in none of them;
    `path` is not `.`, `/`, the home folder or a
    folder holding the working directory (publishing replaces the path), nor
    `source`; it does not exist unless `overwrite=True`, and an existing
    `path` is of the kind written (a folder for a SavedModel, else a file);
    the folder it goes in exists and is writable.

    Args:
        path: The output path (`str` or `os.PathLike`).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"`, `"onnx"`
            or `"torch"`.
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
    _check_backend(format, backend)
    missing = missing_packages(format, backend)
    if missing:
        _, extra = spec.needs(backend)
        hint = install_hint([PIP_NAMES.get(m, m) for m in missing], extra)
        if backend == "torch" and "litert_torch" in missing:
            hint += litert_torch_note(_torch_version())
        on = (" on the PyTorch backend" if backend == "torch"
              and spec.torch_packages is not None else "")
        verb = "is" if len(missing) == 1 else "are"
        raise NeedsExtra(
            f"format={format!r}{on} needs {words(missing)}, which {verb} "
            f"not installed: {hint}", name=missing[0])
    folder = spec.suffix is None
    path = as_path(path, kind="folder" if folder else "file")
    _check_suffix(path, format)
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
