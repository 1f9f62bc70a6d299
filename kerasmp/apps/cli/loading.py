"""What the commands read: Keras, model files and sample arrays.

`import_keras` imports Keras once the arguments are valid, with
TensorFlow's C++/absl start-up logs silenced unless `--verbose` is given or
`TF_CPP_MIN_LOG_LEVEL` is set. `check_model_file` checks a `.keras` file
without Keras and refuses one whose config names a module outside
Keras/kerasmp or holds a Python lambda (`unsafe_contents`), unless
`--unsafe`; `load_model` then loads it in Keras's safe mode. `load_sample`
reads a `--sample` `.npy`/`.npz` file without unpickling anything.
"""

import json
import os
import re
import sys
import zipfile

from kerasmp._utils.requires import installed
from kerasmp._utils.requires import require_backend
from kerasmp._utils.stderr import fd2_silenced
from kerasmp.apps.cli.base import UsageError

# Top-level packages a `.keras` config may name without --unsafe: Keras
# itself (which imports only these) and kerasmp.
SAFE_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp", "kerasmp",
                 "builtins")


# --------------------------------------------------------------------------
# heavy imports
# --------------------------------------------------------------------------


def _quiet_logs(verbose):
    """Silences TensorFlow's C++ logs unless asked for (or configured)."""
    if not verbose and "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        return True
    return False


def import_keras(verbose, tensorflow_too=False):
    """Imports Keras (and its backend) once the arguments are valid.

    Args:
        verbose: `--verbose`: keep TensorFlow's start-up logs.
        tensorflow_too: Whether the command will import TensorFlow on
            another backend anyway (Keras's `set_random_seed` and its saving
            code import it when it is installed): it is imported here, with
            its start-up lines (oneDNN, cuInit) silenced. Without TensorFlow
            (a `kerasmp[torch]` or `kerasmp[jax]` install) nothing is
            imported.

    Returns:
        The `keras` module.

    Raises:
        NeedsExtra: the backend's framework is not installed (Keras's
            default backend is TensorFlow, no longer a base dependency):
            one line naming the extra, instead of Keras's traceback.
    """
    require_backend()
    quiet = _quiet_logs(verbose)
    with fd2_silenced(quiet and "keras" not in sys.modules):
        import keras

        if quiet and (keras.backend.backend() == "tensorflow" or (
                tensorflow_too and installed("tensorflow"))):
            import tensorflow as tf

            tf.get_logger().setLevel("ERROR")
    return keras


# --------------------------------------------------------------------------
# model files
# --------------------------------------------------------------------------


def _read_keras_config(path, what):
    """Checks `path` is a readable `.keras` file; returns its config dict."""
    if not os.path.lexists(path):
        raise UsageError(f"{what} {path!r}: no such file (expected a .keras "
                         "model file)")
    if os.path.isdir(path):
        kind = ("a SavedModel folder" if os.path.exists(
            os.path.join(path, "saved_model.pb")) else "a folder")
        raise UsageError(f"{what} {path!r} is {kind}; expected a .keras "
                         "model file")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise UsageError(f"{what} {path!r}: cannot read it "
                         f"({e.strerror or e})") from None
    suffix = os.path.splitext(path)[1].lower()
    if head[4:8] == b"TFL3" or suffix == ".tflite":
        kind = "a TFLite model"
    elif suffix == ".onnx":
        kind = "an ONNX model"
    elif head.startswith(b"\x89HDF"):
        kind = "an HDF5 file (legacy Keras .h5)"
    else:
        kind = "not a .keras file (a zip archive with config.json)"
    if not head.startswith(b"PK"):
        raise UsageError(f"{what} {path!r} is {kind}; expected a .keras "
                         "model file")
    try:
        with zipfile.ZipFile(path) as z:
            config = json.loads(z.read("config.json"))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError):
        raise UsageError(f"{what} {path!r} is not a .keras file (a zip "
                         "archive with config.json); expected a .keras "
                         "model file") from None
    if not isinstance(config, dict):
        raise UsageError(f"{what} {path!r}: its config.json is not a Keras "
                         "model config")
    return config


def unsafe_contents(config):
    """What in a `.keras` config would import or run code when loaded.

    Args:
        config: The parsed `config.json` of a `.keras` file.

    Returns:
        A list of `(kind, name)`: `("module", "pkg.mod")` for every module
        outside `SAFE_PACKAGES` the config names that is not imported yet
        (Keras would not import it, but a `from_config` may; one already
        imported, as when `kerasmp.apps.cli.main` runs in the process that
        defined the class, runs no new code), `("lambda", layer name)` for
        `Lambda` layers and `("lambda", "__lambda__")` for other lambdas.

    Example:

    >>> unsafe_contents({"module": "mypkg.layers", "class_name": "Custom"})
    [('module', 'mypkg.layers')]
    """
    found = []

    def visit(obj):
        if isinstance(obj, dict):
            module = obj.get("module")
            if isinstance(module, str) and module:
                if (module.split(".")[0] not in SAFE_PACKAGES
                        and module not in sys.modules):
                    found.append(("module", module))
            if obj.get("class_name") == "Lambda":
                inner = obj.get("config")
                name = inner.get("name") if isinstance(inner, dict) else None
                found.append(("lambda", name or "Lambda"))
                return
            if obj.get("class_name") == "__lambda__":
                found.append(("lambda", "__lambda__"))
            for value in obj.values():
                visit(value)
        elif isinstance(obj, list):
            for value in obj:
                visit(value)

    visit(config)
    unique = []
    for item in found:
        if item not in unique:
            unique.append(item)
    return unique


def check_model_file(path, unsafe, what="MODEL"):
    """Checks a model path without Keras; returns the modules to import.

    Args:
        path: The `.keras` file.
        unsafe: `--unsafe`: accept a file that would run code.
        what: The argument's name in the messages.

    Returns:
        The modules its config names (to import with `--unsafe`).

    Raises:
        UsageError: not a readable `.keras` file, or one that would run
            code without `unsafe`.
    """
    config = _read_keras_config(path, what)
    found = unsafe_contents(config)
    if found and not unsafe:
        kind, name = found[0]
        if kind == "module":
            what_runs = f"names the Python module {name!r}"
        else:
            what_runs = ("holds Python code (a lambda"
                         + ("" if name == "__lambda__" else f" in {name!r}")
                         + ")")
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UsageError(
            f"{what} {path!r} {what_runs}{more}; loading it would run that "
            "code, so it is refused (pass --unsafe only if you trust the "
            "file)")
    return [name for kind, name in found if kind == "module"]


def load_model(args, path, modules):
    """Loads a checked `.keras` file (`check_model_file`) with Keras.

    In Keras's safe mode, unless `args.unsafe`: then the `modules` its
    config names are imported first and the file's code may run.

    Args:
        args: The parsed arguments (`verbose`, `unsafe`, `debug`).
        path: The `.keras` file.
        modules: What `check_model_file` returned.

    Returns:
        The model, not compiled.
    """
    keras = import_keras(args.verbose)
    import kerasmp.optimizer.loss_scale_optimizer  # noqa: F401  (registers kerasmp's classes)
    import kerasmp.policy.policy  # noqa: F401

    if args.unsafe:
        import importlib

        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as e:
                if args.debug:
                    raise
                raise UsageError(
                    f"MODEL {path!r} names the module {module!r}, which "
                    f"cannot be imported ({e}); put it on PYTHONPATH"
                ) from None
    try:
        return keras.saving.load_model(path, compile=False,
                                       safe_mode=not args.unsafe)
    except (ValueError, TypeError, KeyError, OSError) as e:
        if args.debug:
            raise
        message = " ".join(str(e).split())
        if "safe_mode" in message or "unsafe" in message.lower():
            raise UsageError(
                f"MODEL {path!r} needs code execution to load (Keras safe "
                "mode refused it); pass --unsafe only if you trust the "
                "file") from None
        cut = re.split(r"(?<=[.!]) | Full object config", message)[0]
        raise UsageError(f"MODEL {path!r} cannot be loaded: "
                         f"{cut[:300]}") from None


# --------------------------------------------------------------------------
# sample arrays
# --------------------------------------------------------------------------


def load_sample(path):
    """Loads `--sample`: a .npy array or a .npz of arrays; never pickles.

    Args:
        path: The file.

    Returns:
        An array (`.npy`), a list of arrays (`.npz` of `arr_0`, `arr_1`,
        ...) or a dict of arrays keyed by input name (other `.npz`).

    Raises:
        UsageError: a missing or unreadable file, or not numeric arrays.
    """
    if not os.path.isfile(path):
        raise UsageError(
            f"--sample {path!r}: " + ("is a folder" if os.path.isdir(path)
                                      else "no such file")
            + "; expected a .npy or .npz file")
    import numpy as np

    try:
        data = np.load(path, allow_pickle=False)
    except PermissionError as e:
        raise UsageError(f"--sample {path!r}: cannot read it "
                         f"({e.strerror})") from None
    except (ValueError, OSError, EOFError):
        raise UsageError(f"--sample {path!r} is not a NumPy .npy/.npz array "
                         "file (object arrays are refused)") from None
    if isinstance(data, np.ndarray):
        return data
    others = [n for n in data.zip.namelist() if not n.endswith(".npy")]
    if others:  # a zip, but not of arrays: a .keras model, say
        data.close()
        raise UsageError(
            f"--sample {path!r} is a zip of {', '.join(others[:3])}"
            + (", ..." if len(others) > 3 else "")
            + ", not of arrays: a sample is a .npy file (one input) or a "
            ".npz file (one array per input, `numpy.savez`)")
    try:
        keys = list(data.keys())
        if not keys:
            raise UsageError(f"--sample {path!r}: the .npz holds no arrays")
        if all(re.fullmatch(r"arr_\d+", k) for k in keys):
            return [data[k] for k in sorted(keys, key=lambda k: int(k[4:]))]
        return {k: data[k] for k in keys}
    except ValueError:
        raise UsageError(f"--sample {path!r}: holds object arrays; expected "
                         "numeric arrays") from None
