"""The export formats: each format's rules (`kerasmp.export.specs`, Keras-free)
with its writer, reader and weight counter (one module per format), as
`REGISTRY`, and the docs' format table generated from it.
"""

import dataclasses

from kerasmp.export.keras_file import run_keras
from kerasmp.export.keras_file import weights_keras
from kerasmp.export.keras_file import write_keras
from kerasmp.export.onnx import run_onnx
from kerasmp.export.onnx import weights_onnx
from kerasmp.export.onnx import write_onnx
from kerasmp.export.pt2 import run_torch
from kerasmp.export.pt2 import weights_torch
from kerasmp.export.pt2 import write_torch
from kerasmp.export.savedmodel import run_savedmodel
from kerasmp.export.savedmodel import weights_savedmodel
from kerasmp.export.savedmodel import write_savedmodel
from kerasmp.export.specs import BACKEND_NAMES
from kerasmp.export.specs import BACKENDS
from kerasmp.export.specs import PIP_NAMES
from kerasmp.export.specs import SPECS
from kerasmp.export.specs import FormatSpec
from kerasmp.export.tflite import run_tflite
from kerasmp.export.tflite import weights_tflite
from kerasmp.export.tflite import write_tflite


@dataclasses.dataclass(frozen=True)
class ExportFormat(FormatSpec):
    """One export format: its rules (`FormatSpec`), writer, reader and
    weight counter.

    Attributes:
        write: `(model, path, specs, dtype, io_dtype, example=None) ->
            None`; `example` is the parity inputs (TFLite may fix an
            unknown length to theirs).
        run: `(path, arrays, specs) -> (outputs, input dtypes, output
            dtypes)`, read back with the format's own runtime.
        weights: `(path) -> int`, the weight bytes stored in the artifact.
    """

    write: object = None
    run: object = None
    weights: object = None


def _format(name, write, run, weights):
    spec = SPECS[name]
    fields = {f.name: getattr(spec, f.name)
              for f in dataclasses.fields(FormatSpec)}
    return ExportFormat(**fields, write=write, run=run, weights=weights)


REGISTRY = {f.name: f for f in (
    _format("keras", write_keras, run_keras, weights_keras),
    _format("savedmodel", write_savedmodel, run_savedmodel,
            weights_savedmodel),
    _format("tflite", write_tflite, run_tflite, weights_tflite),
    _format("onnx", write_onnx, run_onnx, weights_onnx),
    _format("torch", write_torch, run_torch, weights_torch),
)}


def format_table():
    """The docs' format table (Markdown), generated from `REGISTRY`.

    docs/export.md holds it between `<!-- formats:begin -->` and
    `<!-- formats:end -->`; a test checks that it is up to date.
    """
    rows = [
        "| format | path | backend | half precision | I/O dtypes "
        "| what is written | needs | read it with |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in REGISTRY.values():
        needs = _needs(f.packages, f.extra) or "keras"
        if f.torch_packages is not None:
            needs += "; on PyTorch " + _needs(f.torch_packages, f.torch_extra)
        backends = ("any" if len(f.backends) == len(BACKENDS) else ", ".join(
            BACKEND_NAMES[b] for b in f.backends))
        rows.append(
            f"| `{f.name}` | {f'`*{f.suffix}`' if f.suffix else 'a folder'} "
            f"| {backends} "
            f"| {', '.join(f.half_dtypes)} | {', '.join(f.io_dtypes)} "
            f"| {f.help} | {needs} | {f.read_with} |"
        )
    return "\n".join(rows) + "\n"


def _needs(packages, extra):
    """`"a, b (`pip install kerasmp[x]`)"`, or the pip names without an
    extra."""
    if not packages:
        return ""
    if extra:
        return f"{', '.join(packages)} (`pip install kerasmp[{extra}]`)"
    return ", ".join(packages) + " (`pip install " + " ".join(
        PIP_NAMES.get(p, p) for p in packages) + "`)"
