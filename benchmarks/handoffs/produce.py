"""One producer of the hand-off matrix: a model trained under kerasmp on
this process's Keras backend, and every artifact it writes.

    KERAS_BACKEND=jax python benchmarks/handoffs/produce.py --model cnn \
        --folder DIR [--artifacts save onnx-float16 ...]

Under `kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))`: builds
the model (seed 0), `compile("adam", ...)` (kerasmp's loss-scaled Adam),
`fit` for two steps with two `ModelCheckpoint`s (`checkpoint.keras`, and
`weights.weights.h5` with `save_weights_only=True`), `model.save`, then
`kerasmp.export.export` in every format, float16 and float32, on the
parity inputs. Writes into `--folder`:

- the artifacts, and `manifest.json`: `{artifact: {"path"} or
  {"refused": one line}}`, the export's input names, the layers whose
  compute dtype `compile` changed (`moved`), the `{layer path: compute
  dtype}` of the trained model (`dtypes`);
- `parity_inputs.npz` (as the model takes them), `flat.npz` (keyed by the
  export's input names), `fit.npz` (`x` and `y`, the two training steps);
- `trained.npy` (the trained model's outputs: what a reloaded training
  file must compute) and `float32.npy` (the same weights computed in
  float32: the reference of the exports, as `export`'s own parity).

Prints `RESULT <json>` (the manifest) at the end.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from handoffs import cells  # noqa: E402
from handoffs import models  # noqa: E402


def dtypes(model):
    """`{layer path: compute dtype}` of the layers that compute: those
    without sublayers, less the input layers (a container's or an input's
    dtype is what a rebuild gives it, not what the model computes in)."""
    import keras
    from zoo import spec

    return {path: layer.compute_dtype for path, layer in spec.walk(model)
            if not isinstance(layer, keras.layers.InputLayer)
            and not list(layer._flatten_layers(include_self=False,
                                               recursive=False))}


def _save_inputs(path, x):
    import numpy as np

    if isinstance(x, dict):
        np.savez(path, **x)
    else:
        np.savez(path, __single__=x)


def produce(name, folder, artifacts=cells.ARTIFACTS):
    """Trains model `name` under kerasmp on this process's backend and
    writes `artifacts` into `folder`; returns (and writes) the manifest.
    Leaves kerasmp's `mixed_float16` policy as the global policy."""
    import keras
    import numpy as np
    from zoo import worker

    import kerasmp
    from kerasmp.export import export
    from kerasmp.export.inputs import input_specs

    os.makedirs(folder, exist_ok=True)
    manifest = {"model": name, "backend": keras.backend.backend(),
                "artifacts": {}}
    data = models.data(name)
    x = data["parity"]
    fit_x, fit_y = data["fit"]

    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
    model = models.build(name)
    before = dtypes(model)
    model.compile(keras.optimizers.Adam(1e-3),
                  "sparse_categorical_crossentropy")
    after = dtypes(model)
    manifest["moved"] = {p: [before[p], d] for p, d in after.items()
                         if before.get(p) != d}
    manifest["optimizer"] = type(model.optimizer).__name__
    path = {a: os.path.join(folder, a + cells.SUFFIX[
        cells.artifact_format(a)[0]]) for a in cells.ARTIFACTS}
    callbacks = [
        keras.callbacks.ModelCheckpoint(path["checkpoint"]),
        keras.callbacks.ModelCheckpoint(path["weights"],
                                        save_weights_only=True),
    ]
    model.fit(fit_x, fit_y, batch_size=models.FIT_BATCH, epochs=1,
              shuffle=False, verbose=0, callbacks=callbacks)
    model.save(path["save"])
    manifest["dtypes"] = dtypes(model)
    trained = np.asarray(model.predict(x, verbose=0), "float32")

    keras.config.set_dtype_policy("float32")
    float32 = models.build(name)
    float32.set_weights(model.get_weights())
    reference = np.asarray(float32.predict(x, verbose=0), "float32")
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))

    names = [n for n, _, _ in input_specs(model)]
    manifest["names"] = names
    np.save(os.path.join(folder, "trained.npy"), trained)
    np.save(os.path.join(folder, "float32.npy"), reference)
    np.savez(os.path.join(folder, "flat.npz"),
             **worker._flat_inputs(model, x, names))
    _save_inputs(os.path.join(folder, "parity_inputs.npz"), x)
    fit = ({f"x_{k}": v for k, v in fit_x.items()}
           if isinstance(fit_x, dict) else {"x": fit_x})
    np.savez(os.path.join(folder, "fit.npz"), y=fit_y, **fit)

    for artifact in artifacts:
        fmt, dtype = cells.artifact_format(artifact)
        if dtype is None:
            manifest["artifacts"][artifact] = {"path": path[artifact]}
            continue
        print(f"PROGRESS export {artifact}", file=sys.stderr, flush=True)
        start = time.time()
        try:
            report = export(model, path[artifact], format=fmt, dtype=dtype,
                            sample=x, overwrite=True)
            entry = {"path": path[artifact],
                     "report_rel_diff": worker._json_float(report.rel_diff)}
        except Exception as e:  # kerasmp's refusal, or a converter's error
            entry = {"refused": "export: " + cells.one_line(e)}
        entry["seconds"] = round(time.time() - start, 1)
        manifest["artifacts"][artifact] = entry
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=cells.MODELS)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--artifacts", nargs="+", default=cells.ARTIFACTS,
                        choices=cells.ARTIFACTS)
    args = parser.parse_args(argv)
    manifest = produce(args.model, args.folder, args.artifacts)
    print("RESULT " + json.dumps(manifest), flush=True)


if __name__ == "__main__":
    main()
