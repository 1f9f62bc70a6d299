"""One consumer of the hand-off matrix, in its own process.

    KERAS_BACKEND=jax python benchmarks/handoffs/consume.py \
        --consumer keras-jax --jobs JOBS.json

`--consumer` is one of `cells.CONSUMERS`. Everything but `kerasmp-*` runs
where kerasmp cannot be imported (`zoo/absent.py`, before anything else is
imported), as on a machine without it. `JOBS.json` is a list of `{"key",
"artifact", "model", "path", "folder", "gate"}`: the cell, the artifact's
path, the producer's folder (`produce.py`) and the parity gate. For each
job, one `RESULT {"key", "cell", ...}` line, `cell` being `"ok"` or
`"refused: <one line>"`:

- a compiled `.keras` (`save`, `checkpoint`): `keras.saving.load_model`;
  every layer computes in the dtype it did when saved; its outputs within
  the gate of the trained model's; `fit` for two steps: finite loss,
  changed weights;
- `.weights.h5`: the model rebuilt by the user's code (`models.py`: in
  float32 for plain Keras, under `kerasmp.Policy("mixed_float16")` for
  kerasmp), compiled, `load_weights`, then the same checks;
- an export: read with its own runtime (a `.keras` export with
  `load_model`), its outputs within the gate of the same weights computed
  in float32 (the reference of `kerasmp.export`'s own parity).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "zoo"))

if __name__ == "__main__" and "--consumer" in sys.argv and not sys.argv[
        sys.argv.index("--consumer") + 1].startswith("kerasmp-"):
    from zoo.absent import block

    block()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from handoffs import cells  # noqa: E402
from handoffs import models  # noqa: E402


class Refused(Exception):
    """A cell's one-line reason."""



def _step(what, fn, *args):
    """Runs one step of a cell; anything raised refuses the cell, the step
    named."""
    try:
        return fn(*args)
    except Refused:
        raise
    except Exception as e:
        raise Refused(f"{what}: {cells.one_line(e)}") from e


def _inputs(folder):
    with np.load(os.path.join(folder, "parity_inputs.npz")) as f:
        d = {k: f[k] for k in f.files}
    return d["__single__"] if list(d) == ["__single__"] else d


def _fit_data(folder):
    with np.load(os.path.join(folder, "fit.npz")) as f:
        d = {k: f[k] for k in f.files}
    if "x" in d:
        return d["x"], d["y"]
    return {k[2:]: v for k, v in d.items() if k.startswith("x_")}, d["y"]


def _parity(y, reference, gate):
    from zoo import spec

    rel = spec.rel_diff(reference, np.asarray(y))
    if not rel <= gate:
        raise Refused(f"parity: max |diff| / output range {rel:.3g} over "
                      f"the gate {gate:g}")
    return rel


# Keras's own normalization layers compute in float32 inside whatever their
# policy (they upcast their input and cast the output back): kerasmp saves
# its float32 override of one as the governing mixed policy, which plain
# Keras reads as that (kerasmp/policy/saving.py, `portable_policy_name`).
_UPCASTING = ("BatchNormalization", "LayerNormalization",
              "GroupNormalization")


def _dtypes_kept(model, saved, plain):
    """Refuses a model whose layers compute in other dtypes than saved
    (for `plain` Keras, a Keras normalization layer saved float32 may
    compute in the half dtype: it computes in float32 inside)."""
    from zoo import spec

    from handoffs.produce import dtypes

    now = dtypes(model)
    classes = {p: type(layer).__name__ for p, layer in spec.walk(model)}
    changed = {
        p: (d, now[p]) for p, d in saved.items()
        if p in now and now[p] != d
        and not (plain and classes.get(p) in _UPCASTING and d == "float32")
    }
    if changed:
        first, (was, got) = next(iter(changed.items()))
        raise Refused(f"dtypes: {len(changed)} layer(s) compute in other "
                      f"dtypes than saved, e.g. {first.split('/')[-1]} in "
                      f"{got}, saved in {was}")


# A dynamic loss scale skips the steps whose scaled gradients overflow and
# halves itself each time (stock Keras and kerasmp alike, as PyTorch's
# GradScaler does): a model whose gradients overflow at the saved scale
# trains on only after that warm-up. The tiny GPT-OSS does: its producer's
# two steps were both skipped (32768, 16384), and a reload skips two more
# (8192, 4096) before its steps apply at 2048.
WARMUP_FITS = 8


def _trains_on(model, folder):
    """`fit` on the two saved steps until one applies: a finite loss and
    changed weights. Steps skipped by the loss scale's warm-up are allowed
    (at most `WARMUP_FITS` fits, each of two steps) when the history
    shows them skipped; returns the loss and the steps skipped."""
    x, y = _fit_data(folder)
    before = [np.array(w) for w in model.get_weights()]
    skipped = 0
    for _ in range(WARMUP_FITS):
        history = _step("fit", lambda: model.fit(
            x, y, batch_size=models.FIT_BATCH, epochs=1, shuffle=False,
            verbose=0))
        loss = history.history.get("loss", [float("nan")])[-1]
        after = model.get_weights()
        if not all(np.array_equal(a, b) for a, b in zip(before, after)):
            if not np.isfinite(loss):
                raise Refused(f"fit: loss {loss}")
            return float(loss), skipped
        counted = history.history.get("skipped_steps")
        if counted is None or counted[-1] <= skipped:
            # No step was counted as skipped: a step that ran and left
            # every weight as it was.
            raise Refused("fit: no weight changed in two steps")
        skipped = int(counted[-1])
    raise Refused(f"fit: no weight changed in {2 * WARMUP_FITS} steps, "
                  f"{skipped} skipped by the loss scale")


def _load_all(path):
    """`load_model(path)`, refused where Keras skips loading saved state
    (an optimizer whose variables do not match: a resumed run would start
    its moments again)."""
    import warnings

    import keras

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.saving.load_model(path)
    for w in caught:
        text = " ".join(str(w.message).split())
        if text.startswith("Skipping variable loading"):
            raise Refused("load: " + text.split(", because")[0] + " ("
                          + text.split(", because ")[-1].rstrip(". ")
                          + ")")
    return model


def training_file(job, manifest, kerasmp):
    import keras

    if job["model"] == "gpt_oss":
        import keras_hub  # noqa: F401  (registers its layers)
    folder = job["folder"]
    out = {}
    if job["artifact"] == "weights":
        if kerasmp is not None:
            kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))
        else:
            keras.config.set_dtype_policy("float32")
        model = _step("build", models.build, job["model"])
        _step("compile", model.compile, keras.optimizers.Adam(1e-3),
              "sparse_categorical_crossentropy")
        _step("load", model.load_weights, job["path"])
    else:
        model = _step("load", _load_all, job["path"])
        if model.optimizer is None:
            raise Refused("load: loaded without its compile state")
    out["optimizer"] = type(model.optimizer).__name__
    if kerasmp is not None or job["artifact"] != "weights":
        _dtypes_kept(model, manifest["dtypes"], plain=kerasmp is None)
    y = _step("run", model.predict, _inputs(folder), 0, 0)
    reference = np.load(os.path.join(folder, "trained.npy"))
    out["rel_diff"] = _parity(y, reference, job["gate"])
    out["loss"], out["skipped_steps"] = _trains_on(model, folder)
    return out


def keras_export(job, manifest, kerasmp):
    import keras

    if job["model"] == "gpt_oss":
        import keras_hub  # noqa: F401
    model = _step("load", keras.saving.load_model, job["path"])
    y = _step("run", model.predict, _inputs(job["folder"]), 0, 0)
    return {"rel_diff": _parity(y, _reference(job), job["gate"])}


def _reference(job):
    return np.load(os.path.join(job["folder"], "float32.npy"))


def runtime_export(job, manifest):
    import reload  # benchmarks/zoo/reload.py: the census's readers

    fmt, _ = cells.artifact_format(job["artifact"])
    flat = dict(np.load(os.path.join(job["folder"], "flat.npz")))
    where = {"names": manifest["names"], "folder": job["folder"]}
    read = read_torch if fmt == "torch" else getattr(reload, f"read_{fmt}")
    y = _step("load and run", read, job["path"], where, flat)
    return {"rel_diff": _parity(y, _reference(job), job["gate"])}


def read_torch(path, job, flat):
    import torch

    program = torch.export.load(path)
    names = program.graph_signature.user_inputs
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    dtypes = [nodes[n].meta["val"].dtype for n in names]
    module = program.module()
    with torch.no_grad():
        y = module(*[torch.from_numpy(np.ascontiguousarray(flat[k])).to(d)
                     for k, d in zip(job["names"], dtypes)])
    return y[0].detach().cpu().numpy()


def run_cell(job, kerasmp):
    with open(os.path.join(job["folder"], "manifest.json")) as f:
        manifest = json.load(f)
    fmt, _ = cells.artifact_format(job["artifact"])
    if job["artifact"] in cells.TRAINING:
        return training_file(job, manifest, kerasmp)
    if fmt == "keras":
        return keras_export(job, manifest, kerasmp)
    return runtime_export(job, manifest)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--consumer", required=True, choices=cells.CONSUMERS)
    parser.add_argument("--jobs", required=True)
    args = parser.parse_args(argv)
    kerasmp = None
    if cells.consumer_has_kerasmp(args.consumer):
        import kerasmp
    with open(args.jobs) as f:
        jobs = json.load(f)
    for job in jobs:
        print(f"PROGRESS {job['key']}", file=sys.stderr, flush=True)
        start = time.time()
        try:
            result = {"cell": "ok", **run_cell(job, kerasmp)}
        except Refused as e:
            result = {"cell": f"refused: {e}"}
        except Exception as e:  # what no step named
            result = {"cell": f"refused: {cells.one_line(e)}"}
        # `model`: the key the census's process runner files results under.
        result.update(key=job["key"], model=job["key"],
                      seconds=round(time.time() - start, 1))
        print("RESULT " + json.dumps(result), flush=True)
        if kerasmp is not None:
            kerasmp.set_global_policy("float32")
        import keras

        keras.config.set_dtype_policy("float32")
        keras.backend.clear_session()


if __name__ == "__main__":
    main()
