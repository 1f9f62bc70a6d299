"""kerasmp: mixed-precision training for Keras 3 that is correct, observable
and exportable.

`import kerasmp` is cheap: it imports neither Keras nor TensorFlow/JAX. The
public names below are imported on first use (PEP 562 module `__getattr__`),
so `kerasmp --help` and `from kerasmp.apps import cli` start in a fraction
of a second. kerasmp's patches (`kerasmp/_patches.py`) and its
serializable classes are installed as soon as Keras is imported, whichever
of `kerasmp` and `keras` the program imports first, so a saved model that
names `kerasmp>Policy` or `kerasmp>LossScaleOptimizer` loads after a bare
`import kerasmp`. The hooks act only on layers governed by a
`kerasmp.Policy`.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Light (standard library only): `kerasmp.doctor()` needs no framework.
import kerasmp._utils.requires as _requires
from kerasmp.apps.doctor import doctor

__version__ = "0.1.0"

# Public name -> (module, attribute or None for the module itself).
_LAZY = {
    "callbacks": ("kerasmp.callbacks", None),
    "CheckReport": ("kerasmp.debug.findings", "CheckReport"),
    "check": ("kerasmp.debug.hazards", "check"),
    "check_workers_agree": (
        "kerasmp.policy.workers", "check_workers_agree"),
    "debug": ("kerasmp.debug", None),
    "export": ("kerasmp.export", None),
    "NonFiniteError": ("kerasmp.errors", "NonFiniteError"),
    "NonFiniteWarning": ("kerasmp.errors", "NonFiniteWarning"),
    "LossScaleMonitor": ("kerasmp.callbacks", "LossScaleMonitor"),
    "LossScaleOptimizer": ("kerasmp.optimizer", "LossScaleOptimizer"),
    "NonFiniteMonitor": ("kerasmp.callbacks", "NonFiniteMonitor"),
    "Float8Monitor": ("kerasmp.callbacks.float8", "Float8Monitor"),
    "Float8Rule": ("kerasmp.float8", "Float8Rule"),
    "plot_loss_scale": ("kerasmp.plotting", "plot_loss_scale"),
    "plot_float8": ("kerasmp.plotting", "plot_float8"),
    "DEFAULT_FLOAT32_LAYERS": ("kerasmp.policy", "DEFAULT_FLOAT32_LAYERS"),
    "Float32Override": ("kerasmp.policy", "Float32Override"),
    "Policy": ("kerasmp.policy", "Policy"),
    "float32_rule": ("kerasmp.policy", "float32_rule"),
    "global_policy": ("kerasmp.policy", "global_policy"),
    "install": ("kerasmp._patches", "install"),
    "uninstall": ("kerasmp._patches", "uninstall"),
    "stored_policy": ("kerasmp.policy", "stored_policy"),
    "policy_scope": ("kerasmp.policy", "policy_scope"),
    "set_global_policy": ("kerasmp.policy", "set_global_policy"),
    "DTypeReport": ("kerasmp.policy.report", "DTypeReport"),
    "dtype_report": ("kerasmp.policy.report", "dtype_report"),
    "TuneReport": ("kerasmp.tune.report", "TuneReport"),
    "tune": ("kerasmp.tune", None),
}

__all__ = [
    "CheckReport",
    "DEFAULT_FLOAT32_LAYERS",
    "DTypeReport",
    "Float32Override",
    "Float8Monitor",
    "Float8Rule",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "NonFiniteError",
    "NonFiniteMonitor",
    "NonFiniteWarning",
    "Policy",
    "callbacks",
    "check",
    "check_workers_agree",
    "debug",
    "doctor",
    "export",
    "dtype_report",
    "float8",
    "float32_rule",
    "global_policy",
    "install",
    "plot_float8",
    "plot_loss_scale",
    "policy_scope",
    "set_global_policy",
    "stored_policy",
    "tune",
    "TuneReport",
    "uninstall",
]

# Modules that register kerasmp's Keras-serializable classes (and install the
# policy hooks): imported as soon as Keras is.
_REGISTERING = ("kerasmp._patches", "kerasmp.export.half")


def __getattr__(name):
    if name in _LAZY:
        module_name, attr = _LAZY[name]
    elif not name.startswith("__") and importlib.util.find_spec(
            f"kerasmp.{name}") is not None:
        module_name, attr = f"kerasmp.{name}", None  # e.g. kerasmp.policy
    else:
        raise AttributeError(f"module 'kerasmp' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Keras failed to import for want of its backend's framework
        # (TensorFlow, the default, is an extra): say so in one line.
        if "keras" in sys.modules or e.name is None:
            raise
        message = _requires.backend_message(e.name.split(".")[0])
        if message is None:
            raise
        raise _requires.NeedsExtra(message, name=e.name) from None
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _register():
    # Never break `import keras`: a failure here shows again, with its
    # traceback, when the program uses kerasmp.
    try:
        for name in _REGISTERING:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001
        pass


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Imports kerasmp's registering modules once Keras is imported.

    Right after the top-level `keras` package is loaded; or, when a kerasmp
    module imported Keras (`kerasmp.set_global_policy` before any `import
    keras`), right after the outermost kerasmp import finishes: registering
    in the middle of it would import `kerasmp._patches`, which needs the
    half-imported modules, and fail. It wraps the loaders of `keras` and
    of kerasmp's submodules (found by the other finders) to see when they
    finish, and removes itself once the modules are registered.
    """

    def __init__(self):
        # How many kerasmp modules are executing right now (started, not
        # finished): nested imports count once each.
        self.depth = 0

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras" and not fullname.startswith("kerasmp."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        finder = self

        class _Loader(importlib.abc.Loader):
            def __getattr__(self, name):
                return getattr(loader, name)

            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                ours = fullname != "keras"
                finder.depth += ours
                try:
                    original(module)
                finally:
                    finder.depth -= ours
                if "keras" in sys.modules and finder.depth == 0:
                    _remove(finder)
                    _register()

        spec.loader = _Loader()
        return spec


def _remove(finder):
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


if "keras" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _AfterKerasImport())
