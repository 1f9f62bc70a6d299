"""Half-precision inference export: `.keras`, SavedModel, TFLite, ONNX.

`export(model, path, format=...)` writes a half-precision copy of a trained
model and returns an `ExportReport` (size and parity against the float32
masters); `to_float16(model)` returns the half-precision `HalfModel` behind
the SavedModel and ONNX writers. See `kerasmp.export.api`.

This package's `__init__` imports no framework: the `kerasmp` command reads
the formats' specs (`kerasmp.export.specs`, Keras-free) before its
arguments are valid, and the public names below are imported on first use.
"""

import importlib

_LAZY = {
    "export": "kerasmp.export.api",
    "to_float16": "kerasmp.export.api",
    "check_target": "kerasmp.export.api",
    "ExportReport": "kerasmp.export.api",
    "ParityError": "kerasmp.export.api",
    "DEFAULT_NUM_SAMPLES": "kerasmp.export.api",
    "DEFAULT_MAX_REL_DIFF": "kerasmp.export.api",
    "DTYPES": "kerasmp.export.half",
    "FLOAT16_MAX": "kerasmp.export.half",
    "NeedsFlexOps": "kerasmp.export.tflite_convert",
    "EXPORT_DTYPES": "kerasmp.export.specs",
    "FORMATS": "kerasmp.export.specs",
    "IO_DTYPES": "kerasmp.export.specs",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(
            f"module 'kerasmp.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
