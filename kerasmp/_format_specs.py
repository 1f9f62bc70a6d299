"""What each export format is, without importing Keras.

The `kerasmp` command checks `export` arguments (format, output suffix,
optional packages) against these specs before it imports TensorFlow or
loads a model; `kerasmp._export_formats.REGISTRY` adds each format's writer
and reader to the same specs, and `kerasmp.export` and the docs' format table
use that registry. One list of formats for all of them.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class FormatSpec:
    """One export format's rules.

    Attributes:
        name: The `format=` value.
        suffix: The suffix `path` must end in, or None (a folder).
        needs_tensorflow: Whether it needs `KERAS_BACKEND=tensorflow`.
        half_dtypes: The half-precision dtypes it can store.
        writes_half: True when it writes `to_float16(model)`; False when it
            writes the float32 model and converts the weights itself.
        help: One line for docs and `--help`.
        read_with: What reads the artifact (for the docs' format table).
        packages: Python packages it needs (import names).
    """

    name: str
    suffix: object
    needs_tensorflow: bool
    half_dtypes: tuple
    writes_half: bool
    help: str
    read_with: str
    packages: tuple = ()


SPECS = {s.name: s for s in (
    FormatSpec(
        name="keras", suffix=".keras", needs_tensorflow=False,
        half_dtypes=("float16", "bfloat16"), writes_half=True,
        help=".keras file: the model's config + half-precision variables",
        read_with="`keras.saving.load_model` with `kerasmp` imported",
    ),
    FormatSpec(
        name="savedmodel", suffix=None, needs_tensorflow=True,
        half_dtypes=("float16", "bfloat16"), writes_half=True,
        help="SavedModel folder, serving_default with float32 inputs",
        read_with="`tf.saved_model.load` (no Keras, no kerasmp)",
    ),
    FormatSpec(
        name="tflite", suffix=".tflite", needs_tensorflow=True,
        half_dtypes=("float16",), writes_half=False,
        help=".tflite: float32 graph with float16 weights",
        read_with="`ai_edge_litert.interpreter.Interpreter`",
    ),
    FormatSpec(
        name="onnx", suffix=".onnx", needs_tensorflow=True,
        half_dtypes=("float16",), writes_half=True,
        help=".onnx: tf2onnx of the float16 graph, float32 inputs/outputs "
             "(extra kerasmp[onnx])",
        read_with="`onnxruntime.InferenceSession`",
        packages=("tf2onnx", "onnxruntime"),
    ),
)}
