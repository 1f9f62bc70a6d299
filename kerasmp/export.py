"""Half-precision inference export: `.keras`, SavedModel, TFLite, ONNX.

After mixed-precision training a model's weights are float32 masters. This
module turns such a model into a half-precision one for serving, and writes it
in one of four formats (`.keras`, SavedModel, TFLite, ONNX) with a report of
what it cost (size) and what it changed (parity against the float32 master
weights):

- `to_float16(model)` returns a `HalfModel`, a Keras model holding float16
  (or bfloat16) copies of the variables that runs the original model's own
  code with them (nothing is rebuilt, so keras-hub backbones and models
  without a config round trip work), computing in half precision except the
  layers it keeps in float32: the layers the kerasmp policy computes in
  float32 (softmax and normalization, also nested ones such as the softmax
  inside `MultiHeadAttention`) plus any
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

Nothing is written at `path` unless the export succeeds (and, with
`max_diff=`, passes parity): artifacts are built in a staging folder next to
`path` and published with one atomic rename, so `path` always holds either
the complete old artifact or the complete new one; `check_target` validates
a target before any model work.

Length: the public export API (`export`, `to_float16`, `ExportReport` and
its table, `ParityError`, `check_target`, the `ExportFormat` registry) with
Keras-convention docstrings and argument checks, and the atomic publishing
that protects `path`; the engine and the writers are already apart.
"""

import argparse
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import warnings

import keras
import numpy as np

from kerasmp import _export_formats as _io
from kerasmp import _half
from kerasmp._half import DTYPES
from kerasmp._half import FLOAT16_MAX  # noqa: F401  (public constant)
from kerasmp._table import render_table

FORMATS = tuple(_io.REGISTRY)  # ("keras", "savedmodel", "tflite", "onnx")
EXPORT_DTYPES = DTYPES + ("float32",)
DEFAULT_NUM_SAMPLES = 512


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
        A `kerasmp._half.HalfModel` (a `keras.Model`): `half.weights` are
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
            in the artifact (empty for TFLite, whose graph is all float32).
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
        return "kerasmp export report\n" + render_table(None, rows,
                                                          indent="  ")

    __repr__ = __str__


def _human(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


# --------------------------------------------------------------------------
# Target checks, staging and an atomic publish
# --------------------------------------------------------------------------


class ParityError(Exception):
    """Raised by `export(..., max_diff=...)` when parity fails the threshold.

    Nothing is written at the output path. `error.report` is the
    `ExportReport` of the artifact that was built and discarded (its `path`
    is where it would have gone).
    """

    def __init__(self, report, max_diff):
        self.report = report
        self.max_diff = max_diff
        super().__init__(
            f"Parity check failed: max |diff| {report.max_abs_diff:.3g} > "
            f"max_diff={max_diff:g} ({report.format}, {report.dtype}); "
            f"nothing was written at {report.path!r}."
        )


_STAGE_PREFIX = ".kerasmp-export-"
_STAGE_RE = re.compile(r"\.kerasmp-export-(\d+)-[A-Za-z0-9_]+")
_LOCK_PREFIX = ".kerasmp-export-lock-"

# Test hook: called as `_before_publish(staged, path)` right before the
# artifact is moved into place (tests pause or kill the process there).
_before_publish = None


def check_target(path, format="savedmodel", overwrite=False, dtype=None):
    """Checks an export's output path and format before any model work.

    `export` calls it first; a command line can call it before loading the
    model, so that a bad `--format`/output path fails in milliseconds. It
    checks: `format` is one of `FORMATS` (with its backend and, for ONNX,
    its packages); `path` ends in the format's suffix (`.keras`, `.tflite`,
    `.onnx`; a SavedModel is a folder); `path` is not `.`, `/`, the home
    folder or a folder holding the working directory (publishing replaces
    the path, so these would be destroyed); `path` does not exist unless
    `overwrite=True`; `dtype`, when given, is allowed for `format`.

    Args:
        path: The output path (`str` or `os.PathLike`).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"` or `"onnx"`.
        overwrite: Whether an existing `path` may be replaced.
        dtype: Optional; `"float16"`, `"bfloat16"` or `"float32"`.

    Returns:
        `path` as a `str`.

    Raises:
        ValueError: naming the argument (`format`, `path`, `dtype`).
        TypeError: `path` or `overwrite` of the wrong type.
        FileExistsError: `path` exists and `overwrite` is False.
        ImportError: `format="onnx"` without its packages.

    Example:

    >>> kerasmp.export.check_target("model.keras", format="keras")
    'model.keras'
    """
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(
            f"Invalid `format`: {format!r}. Allowed values: "
            f"{', '.join(repr(f) for f in FORMATS)}."
        )
    fmt = _io.REGISTRY[format]
    if dtype is not None:
        _half.check_dtype(dtype, EXPORT_DTYPES)
        allowed = fmt.half_dtypes + ("float32",)
        if dtype not in allowed:
            raise ValueError(
                f"Invalid `dtype` {dtype!r} for format={format!r}: it "
                "stores half-precision weights as "
                f"{' or '.join(fmt.half_dtypes)} only. Allowed values: "
                f"{', '.join(repr(d) for d in allowed)}."
            )
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"`path` must be a file path. Received: {path!r}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        raise TypeError(f"`path` must be a str path. Received: {path!r}")
    suffix = fmt.suffix
    if suffix and not path.endswith(suffix):
        raise ValueError(
            f"Invalid `path` for format={format!r}: {path!r} must end in "
            f"{suffix!r}."
        )
    _refuse_dangerous(path)
    if not isinstance(overwrite, bool):
        raise TypeError(
            f"`overwrite` must be True or False. Received: {overwrite!r}"
        )
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(
            f"`path` {path!r} already exists; pass overwrite=True to "
            "replace it."
        )
    if fmt.packages:
        import importlib.util

        missing = [p for p in fmt.packages
                   if importlib.util.find_spec(p) is None]
        if missing:
            raise ImportError(
                f"format={format!r} needs {', '.join(missing)}: install the "
                "optional extra, `pip install kerasmp[onnx]` (tf2onnx, "
                "onnxruntime)."
            )
    if fmt.needs_tensorflow and keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"format={format!r} needs the TensorFlow backend, but this "
            f"process runs Keras on {keras.backend.backend()!r}. Set "
            "KERAS_BACKEND=tensorflow, or use format='keras'."
        )
    return path


def _refuse_dangerous(path):
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    home = os.path.realpath(os.path.expanduser("~"))
    name = os.path.basename(os.path.normpath(path))
    reason = None
    if real == os.path.realpath(os.sep) or real == os.path.dirname(real):
        reason = "the filesystem root"
    elif real == home:
        reason = "the home folder"
    elif cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        reason = "the working directory or a folder holding it"
    elif name in ("", ".", ".."):
        reason = "not a file or folder name"
    if reason:
        raise ValueError(
            f"Invalid `path`: {path!r} is {reason}; an export replaces "
            "what is at `path`, so give it a new file or folder name "
            "(e.g. 'exported_model')."
        )


def _pid_alive(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _clean_stale(parent):
    """Removes staging folders of exports whose process is gone.

    A folder holding `previous` is an overwrite killed between its two
    renames (the fallback without `renameat2`): if its target is missing,
    the previous artifact is put back first. Returns what was removed.
    """
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for entry in entries:
        if entry.startswith(_LOCK_PREFIX) and _drop_stale_lock(
            os.path.join(parent, entry)
        ):
            removed.append(os.path.join(parent, entry))
            continue
        m = _STAGE_RE.fullmatch(entry)
        stage = os.path.join(parent, entry)
        if not m or not os.path.isdir(stage) or _pid_alive(int(m.group(1))):
            continue
        previous = os.path.join(stage, "previous")
        try:
            with open(os.path.join(stage, "target")) as f:
                target = os.path.join(parent, f.read().strip())
        except OSError:
            target = None
        if target and os.path.lexists(previous) and not os.path.lexists(
            target
        ):
            os.rename(previous, target)
            warnings.warn(
                f"kerasmp.export: restored {target!r} from {stage!r}, left "
                "by an export killed while replacing it.",
                stacklevel=4,
            )
        shutil.rmtree(stage, ignore_errors=True)
        removed.append(stage)
    if removed:
        warnings.warn(
            "kerasmp.export: removed staging folders left by killed exports"
            f": {', '.join(removed)}",
            stacklevel=4,
        )
    return removed


def _drop_stale_lock(lock_path):
    """Removes a lock file that no process holds (its export was killed)."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # held: an export is running
    try:
        os.unlink(lock_path)
    except OSError:
        pass
    os.close(fd)
    return True


class _Terminated(BaseException):
    """SIGTERM during an export, raised so that the staging is removed."""


class _Staging:
    """A staging folder next to `path`, removed on every exit Python sees.

    Holds an exclusive lock on `path` (a `.kerasmp-export-lock-<name>` file
    in the same folder) so a concurrent export to the same path fails at
    once, cleans up stale staging folders of killed exports, and turns
    SIGTERM into an exception while it is open (the main thread only) so
    the staging folder is removed before the signal takes effect.
    """

    def __init__(self, path):
        self.path = path
        self.parent = os.path.dirname(os.path.abspath(path))
        self.name = os.path.basename(os.path.normpath(path))
        self.dir = None
        self._lock = None
        self._old_handler = None

    def __enter__(self):
        os.makedirs(self.parent, exist_ok=True)
        self._acquire_lock()
        try:
            _clean_stale(self.parent)
            self.dir = tempfile.mkdtemp(
                prefix=f"{_STAGE_PREFIX}{os.getpid()}-", dir=self.parent
            )
            with open(os.path.join(self.dir, "target"), "w") as f:
                f.write(self.name)
            self._install_sigterm()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, kind, exc, tb):
        self._release()
        if kind is _Terminated:
            handler = self._old_handler
            if callable(handler):
                handler(signal.SIGTERM, None)
                raise SystemExit(128 + signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # default action now
        return False

    def _acquire_lock(self):
        try:
            import fcntl
        except ImportError:  # not POSIX: the publish still never clobbers
            return
        lock_path = os.path.join(self.parent, _LOCK_PREFIX + self.name)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileExistsError(
                f"Another export is writing `path` {self.path!r} right now "
                f"(it holds {lock_path!r}); nothing was written. Wait for "
                "it or choose another path."
            ) from None
        self._lock = (fd, lock_path)

    def _install_sigterm(self):
        if threading.current_thread() is not threading.main_thread():
            return
        old = signal.getsignal(signal.SIGTERM)
        if old is signal.SIG_IGN or old is None:
            return

        def on_sigterm(signum, frame):
            raise _Terminated()

        self._old_handler = old
        signal.signal(signal.SIGTERM, on_sigterm)

    def _release(self):
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._lock is not None:
            fd, lock_path = self._lock
            self._lock = None
            try:
                os.unlink(lock_path)
            except OSError:
                pass
            os.close(fd)

    def publish(self, staged, overwrite):
        """Moves `staged` to `path` atomically; see `_publish`."""
        if _before_publish is not None:
            _before_publish(staged, self.path)
        _publish(staged, self.path, overwrite,
                 os.path.join(self.dir, "previous"))


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_renameat2_fn = None


def _renameat2(src, dst, flags):
    """Linux renameat2(2). Returns False where unavailable/unsupported."""
    global _renameat2_fn
    if _renameat2_fn is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            _renameat2_fn = (libc.renameat2, ctypes)
        except (OSError, AttributeError):
            _renameat2_fn = False
    if not _renameat2_fn:
        return False
    fn, ctypes = _renameat2_fn
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
          flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _appeared(path):
    return FileExistsError(
        f"`path` {path!r} appeared while exporting (another export or "
        "process wrote it); it was left as it is and nothing was written. "
        "Pass overwrite=True to replace it."
    )


def _publish(staged, path, overwrite, backup):
    """Moves `staged` to `path` so that `path` never holds a partial state.

    Without `overwrite`: a rename that fails if `path` exists
    (`RENAME_NOREPLACE`; else a hard link for a file, or reserving `path`
    with mkdir and renaming onto that empty folder). With `overwrite`: an
    atomic swap of old and new (`RENAME_EXCHANGE`, or `os.replace` for a
    file); the old artifact lands in the staging folder and goes with it.
    Where neither works (a folder, no renameat2), two renames: the old
    artifact to `backup` in the staging folder, then the new one into place;
    a kill between them leaves the complete old artifact in `backup`, which
    the next export to this folder puts back.
    """
    if not overwrite or not os.path.lexists(path):
        try:
            if _renameat2(staged, path, _RENAME_NOREPLACE):
                return
            if os.path.isdir(staged):
                os.mkdir(path)
                try:
                    os.rename(staged, path)
                except OSError:
                    os.rmdir(path)
                    raise
            else:
                os.link(staged, path)
                os.unlink(staged)
            return
        except FileExistsError:
            if not overwrite:
                raise _appeared(path) from None
    if _renameat2(staged, path, _RENAME_EXCHANGE):
        return
    if not os.path.isdir(staged) and not os.path.isdir(path):
        os.replace(staged, path)
        return
    os.rename(path, backup)
    os.rename(staged, path)


def export(model, path, format="savedmodel", dtype="float16", sample=None,
           keep_float32=None, overwrite=False, max_diff=None):
    """Exports `model` in half precision and reports size and parity.

    The model is converted with `to_float16` (the TFLite converter instead
    gets the float32 model and stores float16 weights), written, read back,
    and run on `sample` next to the float32 master weights computed in
    float32. The same format is also exported in float32 (to a temporary
    folder) for the size ratio.

    - `"keras"`: a `.keras` file of `to_float16(model)`: the original
      model's config plus only the half-precision variables. Load it with
      kerasmp imported; it needs the model's get_config()/from_config()
      round trip (else the read-back fails and nothing is written).
    - `"savedmodel"`: a TensorFlow SavedModel with a `serving_default`
      signature taking float32 inputs; each variable is stored once.
      `tf.saved_model.load(path)` serves it without Keras or kerasmp.
    - `"tflite"`: a float32 graph with float16 weights (TFLite cannot run a
      float16 graph); run it with `ai_edge_litert`.
    - `"onnx"` (optional extra `kerasmp[onnx]`): the half-precision graph
      (as for SavedModel) converted by tf2onnx, float16 weights, float32
      inputs and outputs (exact GELU's `Erfc` rewritten as `1 - Erf`).

    Args:
        model: A built `keras.Model` (see `to_float16`).
        path: Where to write: a `.keras` file, a SavedModel folder, a
            `.tflite` or a `.onnx` file (see `check_target` for the rules,
            checked before any model work).
        format: `"savedmodel"` (default), `"keras"`, `"tflite"` or
            `"onnx"`.
        dtype: `"float16"` (default), `"bfloat16"` (not for TFLite/ONNX) or
            `"float32"` (a plain export, for comparison).
        sample: Inputs for the parity check: an array, a list of arrays (one
            per model input) or a dict keyed by input name. Defaults to 512
            draws from the input spec (N(0, 1) floats, valid token ids).
        keep_float32: As for `to_float16`.
        overwrite: Whether to replace an existing `path`. Defaults to False.
            The replacement is atomic (old and new swapped in one rename);
            without it, an artifact that appears at `path` during the export
            is kept and the export fails.
        max_diff: None (default) or a threshold: when the parity
            `max_abs_diff` exceeds it, raise `ParityError` (carrying the
            report) and write nothing at `path`.

    Returns:
        An `ExportReport`.

    Raises:
        ParityError: parity above `max_diff`; nothing written.
        FileExistsError: `path` exists (or appeared) without `overwrite`,
            or another export is writing `path` right now.
        ValueError, TypeError: bad arguments, naming them.

    Example:

    >>> report = kerasmp.export.export(model, "served_model")
    >>> print(report)           # size ratio, max |diff|, top-1 agreement
    >>> report.passed(1e-2)
    True
    """
    path = check_target(path, format, overwrite, dtype)
    if max_diff is not None and (
        isinstance(max_diff, bool)
        or not isinstance(max_diff, (int, float))
        or not max_diff >= 0
    ):
        raise ValueError(
            "Invalid `max_diff`: expected None or a number >= 0. "
            f"Received: {max_diff!r}"
        )
    _half.check_model(model)
    if format == "keras":
        _io.check_config(model)
    specs = _io.input_specs(model)
    if sample is None:
        arrays = _io.draw_inputs(model, specs, DEFAULT_NUM_SAMPLES)
    else:
        arrays = _io.as_input_list(sample, specs)

    fmt = _io.REGISTRY[format]
    model32, _ = _half.convert(model, "float32")
    reference = _io.predict_keras(model32, arrays)
    if dtype == "float32":
        half, kept = model32, {}
    elif not fmt.writes_half:
        half, kept = model32, {}  # the writer stores the weights in `dtype`
        # No Keras model to convert: run the rules for their warnings.
        _half.decide(model, dtype, _half.keep_rules(model, keep_float32))
    else:
        half, kept = _half.convert(model, dtype, keep_float32)

    with _Staging(path) as stage:
        staged = os.path.join(stage.dir, stage.name)
        baseline = os.path.join(stage.dir, "float32-" + stage.name)
        fmt.write(half, staged, specs, dtype)
        fmt.write(model32, baseline, specs, "float32")
        outs, ins, outd, read_kept = fmt.run(staged, arrays, specs)
        if read_kept is not None:
            kept = read_kept
        notes = fmt.notes(dtype) if fmt.notes else ""
        size, size32 = _io.size(staged), _io.size(baseline)
        worst, top1 = _io.parity(reference, outs)
        report = ExportReport(
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
        if max_diff is not None and not report.passed(max_diff):
            raise ParityError(report, max_diff)
        stage.publish(staged, overwrite)
    return report


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
    parser.add_argument(
        "--format", choices=FORMATS, default="savedmodel",
        help="; ".join(f"{f.name}: {f.help}" for f in _io.REGISTRY.values()),
    )
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="float16")
    parser.add_argument(
        "--sample",
        help="parity inputs: .npy (one input) or .npz (keyed by input name, "
        "or arr_0, arr_1, ... in input order); default: 512 random draws",
    )
    parser.add_argument(
        "--max-diff", type=float, default=1e-2,
        help="exit 1, writing nothing, when max |difference| vs float32 "
        "exceeds this (default 1e-2)",
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
    """Runs `kerasmp export` from parsed arguments; returns the exit code.

    0: exported and parity within `--max-diff`; 1: parity above it (nothing
    written); 2: an error (bad arguments, existing output, ...).
    """
    try:
        check_target(args.out, args.format, args.overwrite, args.dtype)
        model = keras.saving.load_model(args.model, compile=False)
        sample = _load_sample(args.sample) if args.sample else None
        report = export(
            model, args.out, format=args.format, dtype=args.dtype,
            sample=sample, keep_float32=args.keep_float32,
            overwrite=args.overwrite, max_diff=args.max_diff,
        )
    except ParityError as e:
        _print_report(e.report, args.json)
        print(
            f"kerasmp export: parity FAILED: max |diff| "
            f"{e.report.max_abs_diff:.3g} > --max-diff {args.max_diff:g}; "
            f"nothing was written at {args.out!r}",
            file=sys.stderr,
        )
        return 1
    except (ValueError, TypeError, OSError, ImportError) as e:
        message = str(e).replace("pass overwrite=True", "pass --overwrite")
        print(f"kerasmp export: error: {message}", file=sys.stderr)
        return 2
    _print_report(report, args.json)
    return 0


def _print_report(report, as_json):
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)


def main_export(argv=None):
    """Entry point of `kerasmp export`; returns the exit code.

    Args:
        argv: The arguments after `export` (defaults to `sys.argv[1:]`).
    """
    parser = add_arguments(argparse.ArgumentParser(
        prog="kerasmp export",
        description="Export a .keras model in half precision (keras, "
        "savedmodel, tflite or onnx) and print a size and parity report.",
    ))
    return run(parser.parse_args(argv))
