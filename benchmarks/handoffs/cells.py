"""The cells of the hand-off matrix, without Keras or kerasmp.

A cell is `(producer, model, artifact, consumer)`:

- producer: the Keras backend the model is trained on under kerasmp
  (`PRODUCERS`);
- model: a name of `MODELS` (`models.py` builds them);
- artifact: what leaves kerasmp (`ARTIFACTS`): the `.keras` of
  `model.save` after `compile` and `fit`, `ModelCheckpoint`'s `.keras` and
  `.weights.h5`, and `kerasmp.export.export` in every format, float16 and
  float32;
- consumer: what reads it (`CONSUMERS`): plain Keras (kerasmp blocked) or
  kerasmp on each backend for Keras files, and each format's own runtime
  for the others (`tf.saved_model`, onnxruntime, LiteRT,
  `torch.export.load`), always where kerasmp cannot be imported.

Only meaningful pairs are cells (`consumers_of`): a SavedModel is read by
`tf.saved_model`, never by onnxruntime. An export the producer backend
cannot write is still a cell (of its runtime), `refused` with kerasmp's
one-line reason.
"""

import dataclasses

PRODUCERS = ("tensorflow", "jax", "torch")
BACKEND_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX",
                 "torch": "PyTorch"}
MODELS = ("cnn", "transformer", "gpt_oss")
MODEL_NAMES = {"cnn": "the demo's CNN", "transformer": "a small transformer",
               "gpt_oss": "keras-hub GPT-OSS (tiny)"}
FORMATS = ("keras", "savedmodel", "tflite", "onnx", "torch")
EXPORT_DTYPES = ("float16", "float32")
TRAINING = ("save", "checkpoint", "weights")
"""The training files: `model.save`, `ModelCheckpoint` (`.keras`) and
`ModelCheckpoint(save_weights_only=True)` (`.weights.h5`)."""
ARTIFACTS = TRAINING + tuple(
    f"{fmt}-{dtype}" for fmt in FORMATS for dtype in EXPORT_DTYPES)
SUFFIX = {"save": ".keras", "checkpoint": ".keras",
          "weights": ".weights.h5", "keras": ".keras", "savedmodel": "",
          "tflite": ".tflite", "onnx": ".onnx", "torch": ".pt2"}
ARTIFACT_NAMES = {
    "save": "`model.save` after `compile`",
    "checkpoint": "`ModelCheckpoint` `.keras`",
    "weights": "`ModelCheckpoint` `.weights.h5`",
}

KERAS_CONSUMERS = tuple(f"{who}-{backend}" for who in ("keras", "kerasmp")
                        for backend in PRODUCERS)
"""`keras-<backend>`: plain Keras, kerasmp blocked; `kerasmp-<backend>`:
kerasmp imported first."""
RUNTIMES = {"savedmodel": "tf.saved_model", "onnx": "onnxruntime",
            "tflite": "litert", "torch": "torch.export"}
CONSUMERS = KERAS_CONSUMERS + tuple(RUNTIMES.values())
CONSUMER_NAMES = {
    **{f"keras-{b}": f"Keras on {n}" for b, n in BACKEND_NAMES.items()},
    **{f"kerasmp-{b}": f"kerasmp on {n}" for b, n in BACKEND_NAMES.items()},
    "tf.saved_model": "`tf.saved_model`", "onnxruntime": "onnxruntime",
    "litert": "LiteRT", "torch.export": "`torch.export.load`",
}


def artifact_format(artifact):
    """`("keras", "float16")` for `"keras-float16"`; `(artifact, None)` for
    a training file."""
    if artifact in TRAINING:
        return artifact, None
    fmt, dtype = artifact.rsplit("-", 1)
    return fmt, dtype


def consumers_of(artifact):
    """The consumers that read `artifact`."""
    fmt, _ = artifact_format(artifact)
    if artifact in TRAINING or fmt == "keras":
        return KERAS_CONSUMERS
    return (RUNTIMES[fmt],)


def consumer_backend(consumer):
    """The Keras backend a consumer's process runs on."""
    if consumer in KERAS_CONSUMERS:
        return consumer.split("-", 1)[1]
    return {"torch.export": "torch"}.get(consumer, "tensorflow")


def consumer_has_kerasmp(consumer):
    return consumer.startswith("kerasmp-")


def one_line(exc, limit=240):
    """`Type: first sentence` of an exception: a cell's reason."""
    message = " ".join(str(exc).split())
    end = message.find(". ")
    if 0 < end < limit:
        message = message[:end + 1]
    elif len(message) > limit:
        message = message[:limit - 3] + "..."
    return f"{type(exc).__name__}: {message}"


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    producer: str
    model: str
    artifact: str
    consumer: str

    @property
    def key(self):
        return "/".join((self.producer, self.model, self.artifact,
                         self.consumer))

    @classmethod
    def from_key(cls, key):
        return cls(*key.split("/"))


def cells(producers=PRODUCERS, models=MODELS, artifacts=ARTIFACTS,
          consumers=CONSUMERS):
    """Every cell of the matrix (or of the given rows), in a fixed order."""
    return [Cell(p, m, a, c) for p in producers for m in models
            for a in artifacts for c in consumers_of(a) if c in consumers]


QUICK = {
    "tensorflow": (Cell("tensorflow", "cnn", "save", "keras-tensorflow"),),
    "jax": (Cell("jax", "cnn", "weights", "keras-jax"),),
    "torch": (Cell("torch", "cnn", "onnx-float16", "onnxruntime"),),
}
"""The quick cells of the default suite (tests/test_handoffs.py), one per
backend pass: the backend produces (in the test's process), a consumer
without kerasmp reads (in its own)."""

SLOW = tuple(
    [Cell(p, "cnn", a, c) for p in PRODUCERS
     for a, c in (("save", "keras-tensorflow"),
                  ("save", "kerasmp-tensorflow"),
                  ("weights", "keras-tensorflow"))]
    + [Cell(p, "cnn", f"{fmt}-float16", RUNTIMES[fmt]) for p in PRODUCERS
       for fmt in ("savedmodel", "tflite", "onnx", "torch")])
"""The subset of `--slow` (the whole matrix takes longer than CI's slow
pass allows, docs/benchmarks.md): the CNN from every backend, its compiled
`.keras` read by Keras on TensorFlow without and with kerasmp, its
`.weights.h5` without, and its float16 export in every format read by its
runtime (six consumer processes)."""
