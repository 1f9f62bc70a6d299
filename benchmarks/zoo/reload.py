"""Reads exported artifacts back where kerasmp cannot be imported.

    python benchmarks/zoo/reload.py JOB.json

`JOB.json` (written by `worker.export_all`): `artifacts` ({format: path}),
`names` (the export's input names, in order) and `folder` (holding
`flat.npz`, the inputs keyed by those names, and `parity_inputs.npz`, the
inputs as the model takes them). Each artifact is read with its own
runtime, as a user without kerasmp would: `.keras` with
`keras.saving.load_model` (keras-hub imported, which registers its
layers), the SavedModel with `tf.saved_model.load`, `.tflite` with
`ai_edge_litert`, `.onnx` with onnxruntime. Its first output is saved to
`<folder>/reloaded_<format>.npy`. Prints `RESULT {format: {"output": path}
or {"error": ...}}`.
"""

import json
import os
import re
import sys

from absent import block  # this folder (the script's) is on sys.path

block()

import numpy as np  # noqa: E402


def _order(key):
    m = re.fullmatch(r"output_(\d+)", key)
    return (0, int(m.group(1)), "") if m else (1, 0, key)


def _load(path):
    with np.load(path) as f:
        d = {k: f[k] for k in f.files}
    return d["__single__"] if list(d) == ["__single__"] else d


def read_keras(path, job):
    import keras
    import keras_hub  # noqa: F401  (registers its layers, as a user would)

    model = keras.saving.load_model(path)
    x = _load(os.path.join(job["folder"], "parity_inputs.npz"))
    n = len(next(iter(x.values())) if isinstance(x, dict) else x)
    return model.predict(x, batch_size=n, verbose=0)


def read_savedmodel(path, job, flat):
    import tensorflow as tf

    fn = tf.saved_model.load(path).signatures["serving_default"]
    spec = fn.structured_input_signature[1]
    y = fn(**{n: tf.constant(flat[n].astype(spec[n].dtype.as_numpy_dtype))
              for n in job["names"]})
    return y[sorted(y, key=_order)[0]].numpy()


def read_tflite(path, job, flat):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=path)
    runner = interpreter.get_signature_runner("serving_default")
    details = runner.get_input_details()
    outputs = sorted(
        interpreter.get_signature_list()["serving_default"]["outputs"],
        key=_order)
    names = job["names"]
    n = len(flat[names[0]])
    # A file written with a fixed batch (kerasmp's JAX route can write one)
    # takes batches of exactly that size: the last one padded.
    fixed = [int(details[k]["shape_signature"][0]) for k in names
             if len(details[k]["shape_signature"])]
    size = fixed[0] if fixed and fixed[0] > 0 else n
    parts = []
    for start in range(0, n, size):
        index = np.arange(start, start + size) % n
        y = runner(**{k: flat[k][index].astype(details[k]["dtype"])
                      for k in names})
        parts.append(np.array(y[outputs[0]])[:min(size, n - start)])
    return np.concatenate(parts)


_ONNX_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16",
               "tensor(int32)": "int32", "tensor(int64)": "int64",
               "tensor(bool)": "bool", "tensor(double)": "float64"}


def read_onnx(path, job, flat):
    import onnxruntime

    session = onnxruntime.InferenceSession(
        path, providers=["CPUExecutionProvider"])
    feed = {}
    names = job["names"]
    for i, spec in enumerate(session.get_inputs()):
        key = spec.name.split(":")[0]
        array = flat[key] if key in flat else flat[names[i]]
        feed[spec.name] = array.astype(_ONNX_TYPES.get(spec.type, "float32"))
    return session.run(None, feed)[0]


def main(job_path):
    with open(job_path) as f:
        job = json.load(f)
    flat = dict(np.load(os.path.join(job["folder"], "flat.npz")))
    result = {}
    for fmt, path in job["artifacts"].items():
        try:
            if fmt == "keras":
                y = read_keras(path, job)
            else:
                y = globals()[f"read_{fmt}"](path, job, flat)
            out = os.path.join(job["folder"], f"reloaded_{fmt}.npy")
            np.save(out, np.asarray(y, "float32"))
            result[fmt] = {"output": out}
        except Exception as e:
            message = " ".join(str(e).split())
            result[fmt] = {"error": f"{type(e).__name__}: {message[:400]}"}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
