"""The one place that says which `pip install "kerasmp[...]"` brings a
missing framework (standard library only).

TensorFlow is not a base dependency (a PyTorch or JAX user does not need
its 1.9 GB): the `tensorflow`, `jax` and `torch` extras bring the backends,
and a feature that needs a framework that is not installed says so in one
line naming the extra, where the feature starts:

- `require(package, feature)`: the module, or `NeedsExtra`
  (`'format='savedmodel' needs TensorFlow: pip install
  "kerasmp[tensorflow]"'`);
- `install_hint(packages, extra)`: the pip command for a list of missing
  packages (the export formats' check, `kerasmp.export.specs`);
- `keras_backend()` and `require_backend()`: the backend Keras will use,
  read as Keras reads it without importing it, and the one-line error when
  its framework is missing (Keras's default backend is TensorFlow).
"""

import importlib
import importlib.util
import json
import os
import sys

# Import name -> (what users call it, the kerasmp extra that installs it).
FRAMEWORKS = {
    "tensorflow": ("TensorFlow", "tensorflow"),
    "jax": ("JAX", "jax"),
    "torch": ("PyTorch", "torch"),
}


class NeedsExtra(ImportError):
    """A feature needs a package that is not installed; the message is one
    line naming the `pip install "kerasmp[...]"` that brings it. The
    `kerasmp` command prints it as a user error (exit status 2)."""


def installed(package):
    """Whether `package` (an import name) can be imported, without
    importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def install_hint(packages, extra=None):
    """The command that installs `packages`: `pip install "kerasmp[extra]"`,
    or the packages themselves when no extra brings them.

    Example:

    >>> install_hint(["tensorflow"], "tensorflow")
    'pip install "kerasmp[tensorflow]"'
    """
    if extra:
        return f'pip install "kerasmp[{extra}]"'
    return "pip install " + " ".join(packages)


def needs_message(feature, package, extra=None):
    """`'<feature> needs <Name>: pip install "kerasmp[<extra>]"'`."""
    name, default_extra = FRAMEWORKS.get(package, (package, None))
    return (f"{feature} needs {name}: "
            f"{install_hint([package], extra or default_extra)}")


def require(package, feature, extra=None):
    """Imports and returns `package`, or raises `NeedsExtra` naming the
    extra that installs it.

    Args:
        package: The import name (`"tensorflow"`).
        feature: What needs it, as the user asked for it
            (`"format='savedmodel'"`).
        extra: The kerasmp extra; defaults to the framework's own.

    Raises:
        NeedsExtra: `package` is not installed.
    """
    if not installed(package):
        raise NeedsExtra(needs_message(feature, package, extra),
                         name=package)
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != package:
            raise
        raise NeedsExtra(needs_message(feature, package, extra),
                         name=package) from None


def keras_backend():
    """The backend Keras uses or will use, read as Keras reads it
    (`KERAS_BACKEND`, then `~/.keras/keras.json`, else `"tensorflow"`),
    without importing Keras."""
    return _backend_and_source()[0]


def _backend_and_source():
    """`(backend, where it was set)`: `"KERAS_BACKEND"`, the keras.json
    path, or `"the default"`."""
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend(), "Keras"
    backend = os.environ.get("KERAS_BACKEND")
    if backend:
        return backend, "KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path, encoding="utf-8") as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    return (backend, path) if backend else ("tensorflow", "the default")


def backend_message(backend=None):
    """Why Keras cannot start on `backend` (default: the one it will use),
    in one line, or None when its framework is installed (or `backend` is
    not one kerasmp knows)."""
    backend, how = ((backend, "KERAS_BACKEND") if backend is not None
                    else _backend_and_source())
    if backend not in FRAMEWORKS or installed(backend):
        return None
    if backend == keras_backend():
        how = _backend_and_source()[1]
    name, extra = FRAMEWORKS[backend]
    others = [b for b in FRAMEWORKS if b != backend]
    return (f"Keras's backend is {backend} ({how}) and {name} is not "
            f"installed: {install_hint([backend], extra)}, or set "
            f"KERAS_BACKEND={' or '.join(others)} with "
            + " or ".join(f'"kerasmp[{b}]"' for b in others))


def require_backend():
    """Raises `NeedsExtra` when the framework of the backend Keras will use
    is not installed (before `import keras` fails deep inside Keras)."""
    message = backend_message()
    if message:
        raise NeedsExtra(message, name=keras_backend())
