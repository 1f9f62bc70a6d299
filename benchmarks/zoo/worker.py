"""One model, one stage of the census, in its own process.

    python benchmarks/zoo/worker.py --stage plain --models BertBackbone \
        VGG16 --dirs /tmp/zoo/BertBackbone /tmp/zoo/VGG16
    python benchmarks/zoo/worker.py --stage kerasmp --models BertBackbone \
        VGG16 --dirs /tmp/zoo/BertBackbone /tmp/zoo/VGG16 [--no-export]
        [--no-warmup] [--only-export] [--eager] [--jit]

- `plain` runs where kerasmp cannot be imported (as on a machine without
  it): builds the model in float32 with seed 0 and writes its weights, the
  parity inputs and the float32 outputs to `--dir`; then the float32 and
  the stock `keras.mixed_precision.set_global_policy("mixed_float16")`
  columns, each from those weights.
- `kerasmp` reads them and runs the kerasmp columns under
  `kerasmp.set_global_policy("mixed_float16")`: forward and parity,
  `dtype_report` norms, `kerasmp.check`, the export formats (each reloaded
  in a process where kerasmp cannot be imported), the fit, and the
  loss-scale warm-up (2**15 against "auto").

Each model prints one `RESULT <json>` line when it is done (the census
restarts the process on the models left after a crash or a time-out).
The measuring functions (`forward`, `fit`, ...) are what
tests/test_zoo_census.py calls in-process.
"""

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.path.dirname(HERE) not in sys.path:  # run as a script
    sys.path.insert(0, os.path.dirname(HERE))

from zoo import absent  # noqa: E402

PARITY_SAMPLES = 4
FIT_BATCH = 2
FIT_STEPS = 3
WARMUP_STEPS = 10
WARMUP_SCALES = (2.0 ** 15, "auto")
FORMATS = ("keras", "savedmodel", "tflite", "onnx")
SUFFIX = {"keras": ".keras", "savedmodel": "", "tflite": ".tflite",
          "onnx": ".onnx"}
RELOAD_TIMEOUT = 600
JIT_COMPILE = False
"""`compile(jit_compile=...)` of every fit: off by default (XLA compiles
each tiny model for longer than its steps take on CPU; the census's
figures are about dtypes, not speed). `--jit` sets "auto"."""
RUN_EAGERLY = False
"""`compile(run_eagerly=...)` of every fit (`--eager`): tracing the train
step of a tiny model costs ~5x its three steps run eagerly on CPU."""


def describe(exc):
    """`{"error", "where", "raised_in"}`: the exception, the deepest frame
    of its traceback inside keras-hub (else kerasmp, else Keras), and the
    package whose code raised it ("other": a converter, a runtime)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for package in ("keras_hub", "kerasmp", "keras"):
        inside = [f for f in frames if f"/{package}/" in f.filename]
        if inside:
            f = inside[-1]
            path = f.filename[f.filename.index(f"/{package}/") + 1:]
            where = f"{path}:{f.lineno} in {f.name}"
            break
    message = " ".join(str(exc).split())
    raised_in = next((package for package in ("keras_hub", "kerasmp",
                                              "keras")
                      if frames and f"/{package}/" in frames[-1].filename),
                     "other")
    return {"error": f"{type(exc).__name__}: {message[:400]}",
            "where": where, "raised_in": raised_in}


def _timed(result, key, fn, *args, **kwargs):
    """Runs `fn`, stores its result (or what it raised) under `key`."""
    print(f"PROGRESS {_LAST.get('model', '')} {_LAST.get('section', '')} "
          f"{key}", file=sys.stderr, flush=True)
    start = time.time()
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # a crash costs its column, not the row
        value = {"ok": False, **describe(e)}
    if isinstance(value, dict):
        value.setdefault("ok", True)
        value["seconds"] = round(time.time() - start, 2)
    result[key] = value
    return value


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------


def zoo_model(name):
    from zoo import applications
    from zoo import hub

    models = {**hub.HUB, **applications.APPLICATIONS}
    return models[name]


def build(zoo, weights=None):
    """`(features, train)` under the global policy, seeded, with `weights`
    (a list, `train.get_weights()` order) if given."""
    import keras

    from zoo import spec

    keras.utils.set_random_seed(0)
    features, _ = spec.feature_model(zoo)
    train = spec.train_model(features)
    if weights is not None:
        train.set_weights(weights)
    return features, train


def data(zoo):
    """The parity inputs, the fit data and the warm-up data."""
    from zoo import spec

    n_fit = FIT_BATCH * FIT_STEPS
    n_warm = FIT_BATCH * WARMUP_STEPS
    return {
        "parity": spec.draw(zoo.inputs, PARITY_SAMPLES, seed=1),
        "fit": (spec.draw(zoo.inputs, n_fit, seed=2), spec.labels(n_fit, 3)),
        "warmup": (spec.draw(zoo.inputs, n_warm, seed=4),
                   spec.labels(n_warm, 5)),
    }


# --------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------


def predict(features, x):
    import numpy as np

    y = features.predict(x, batch_size=PARITY_SAMPLES, verbose=0)
    return np.asarray(y)


def forward(features, x, reference=None):
    """Forward pass: finite, output dtype, parity to `reference`."""
    import numpy as np

    from zoo import spec

    y = predict(features, x)
    out = {"finite": spec.finite([y]), "dtype": str(y.dtype),
           "shape": list(y.shape)}
    if reference is None:
        ref = np.asarray(y, "float64")
        out["range"] = float(ref.max() - ref.min()) if ref.size else 0.0
        out["absmax"] = float(np.abs(ref).max()) if ref.size else 0.0
    else:
        out["rel_diff"] = _json_float(spec.rel_diff(reference, y))
    return out, y


class Recorder:
    """Per-step logs and loss-scale state of a `fit` (a Keras callback)."""

    def __new__(cls):
        import keras

        class _Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.steps = []

            def on_train_batch_end(self, batch, logs=None):
                logs = dict(logs or {})
                row = {k: _json_float(float(logs[k])) for k in
                       ("loss", "loss_scale", "skipped_steps") if k in logs}
                optimizer = self.model.optimizer
                inner = getattr(optimizer, "inner_optimizer", None)
                if inner is not None:
                    row["applied"] = int(inner.iterations.numpy()
                                         if hasattr(inner.iterations,
                                                    "numpy")
                                         else inner.iterations)
                    scale = getattr(optimizer, "dynamic_scale", None)
                    if scale is not None and "loss_scale" not in row:
                        row["stock_scale"] = _json_float(float(
                            keras.ops.convert_to_numpy(scale)))
                self.steps.append(row)

        return _Recorder()


def fit(train, x, y, optimizer=None):
    """One epoch of `x` in batches of `FIT_BATCH`: finite losses and
    weights, the loss scale per step and the steps skipped."""
    import keras

    from zoo import spec

    train.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  jit_compile=JIT_COMPILE, run_eagerly=RUN_EAGERLY)
    recorder = Recorder()
    train.fit(x, y, batch_size=FIT_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[recorder])
    steps_logged = recorder.steps
    losses = [s.get("loss") for s in steps_logged]
    out = {
        "optimizer": type(train.optimizer).__name__,
        "steps": len(steps_logged),
        "losses": losses,
        "loss_finite": all(isinstance(v, float) for v in losses),
        "weights_finite": spec.finite(train.get_weights()),
    }
    scales = [s.get("loss_scale", s.get("stock_scale")) for s in steps_logged]
    if any(v is not None for v in scales):
        out["scales"] = scales
    out["loss_scale_logged"] = bool(steps_logged) and all(
        "loss_scale" in s for s in steps_logged)
    # Cumulative skipped steps after each step: kerasmp logs them; stock
    # Keras's LossScaleOptimizer applies its inner optimizer only on the
    # steps it does not skip.
    counts = []
    for i, s in enumerate(steps_logged):
        if "skipped_steps" in s:
            counts.append(int(s["skipped_steps"]))
        elif "applied" in s:
            counts.append(i + 1 - s["applied"])
    if counts:
        out["skipped_counts"] = counts
    out["skipped"] = counts[-1] if counts else 0
    out["finite"] = out["loss_finite"] and out["weights_finite"]
    return out


def norms(model, report=None):
    """The normalization layers (census rule, `spec.is_normalization`) and
    those not computing in float32: from `kerasmp.dtype_report` rows when
    given, else from each layer's `compute_dtype`."""
    from zoo import spec

    found = spec.normalization_layers(model)
    dtypes = dict(found)
    if report is not None:
        by_path = {row.path: row.compute_dtype for row in report}
        # The census walks the same tree as dtype_report; a path the report
        # spells differently keeps the layer's own compute dtype.
        dtypes = {p: by_path.get(p, d) for p, d in found.items()}
    half = sorted(p for p, d in dtypes.items() if d != "float32")
    return {"count": len(dtypes), "not_float32": half[:20],
            "num_not_float32": len(half), "all_float32": not half}


def _json_float(v):
    v = float(v)
    if v != v or v in (float("inf"), float("-inf")):
        return str(v)
    return v


# --------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------


def _save_inputs(path, x):
    import numpy as np

    if isinstance(x, dict):
        np.savez(path, **x)
    else:
        np.savez(path, __single__=x)


def _load_inputs(path):
    import numpy as np

    with np.load(path) as f:
        d = {k: f[k] for k in f.files}
    return d["__single__"] if list(d) == ["__single__"] else d


def stage_plain(zoo, folder, only_export=False):
    """float32 and stock mixed_float16 (kerasmp unimportable here); with
    `only_export`, the float32 build and forward pass alone (the weights
    and outputs the export column starts from)."""
    import keras
    import numpy as np

    result = {"stage": "plain", "backend": keras.backend.backend(),
              "float32": {}, "stock": {}}
    sets = data(zoo)
    f32 = result["float32"]
    _LAST["section"] = "float32"
    keras.config.set_dtype_policy("float32")
    built = _timed(f32, "build", lambda: _build_info(build(zoo)))
    if not built["ok"]:
        return result
    features, train = _LAST["models"]
    weights = train.get_weights()
    np.savez(os.path.join(folder, "weights.npz"),
             *[np.asarray(w) for w in weights])
    _save_inputs(os.path.join(folder, "parity.npz"), sets["parity"])
    fwd = _timed(f32, "forward", lambda: _keep(forward(features,
                                                       sets["parity"])))
    if fwd["ok"]:
        np.save(os.path.join(folder, "reference.npy"), _LAST["y"])
    if only_export:
        return result
    _timed(f32, "fit", fit, train, *sets["fit"])

    stock = result["stock"]
    _LAST["section"] = "stock"
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        built = _timed(stock, "build",
                       lambda: _build_info(build(zoo, weights)))
        if built["ok"]:
            features, train = _LAST["models"]
            ref = _LAST.get("y") if fwd["ok"] else None
            _timed(stock, "forward",
                   lambda: forward(features, sets["parity"], ref)[0])
            _timed(stock, "norms", norms, features)
            _timed(stock, "fit", fit, train, *sets["fit"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return result


_LAST = {}


def _build_info(models):
    features, train = models
    _LAST["models"] = models
    return {"params": int(train.count_params())}


def _keep(pair):
    out, y = pair
    _LAST["y"] = y
    return out


def stage_kerasmp(zoo, folder, export=True, warmup=True, only_export=False):
    """The kerasmp columns, from the plain stage's weights; with
    `only_export`, the build and the export column alone."""
    import keras
    import numpy as np

    import kerasmp

    result = {"stage": "kerasmp", "backend": keras.backend.backend(),
              "kerasmp": {}}
    out = result["kerasmp"]
    sets = data(zoo)
    with np.load(os.path.join(folder, "weights.npz")) as f:
        weights = [f[f"arr_{i}"] for i in range(len(f.files))]
    ref_path = os.path.join(folder, "reference.npy")
    reference = np.load(ref_path) if os.path.exists(ref_path) else None
    _LAST["section"] = "kerasmp"
    kerasmp.set_global_policy("mixed_float16")
    try:
        built = _timed(out, "build",
                       lambda: _build_info(build(zoo, weights)))
        if not built["ok"]:
            return result
        features, train = _LAST["models"]
        if only_export:
            _timed(out, "export", export_all, features, sets["parity"],
                   reference, folder)
            return result
        _timed(out, "forward",
               lambda: forward(features, sets["parity"], reference)[0])
        _timed(out, "norms",
               lambda: norms(features, kerasmp.dtype_report(features)))
        _timed(out, "check", run_check, features, sets["parity"])
        if export:
            _timed(out, "export", export_all, features, sets["parity"],
                   reference, folder)
        _timed(out, "fit", fit, train, *sets["fit"])
        if warmup:
            _timed(out, "warmup", warmup_study, zoo, weights, *sets["warmup"])
    finally:
        kerasmp.set_global_policy("float32")
    return result


def run_check(features, x):
    import kerasmp

    report = kerasmp.check(features, x=x, gpu=False)
    errors = [f for f in report.findings if f.severity == "error"]
    return {"errors": len(errors),
            "error_codes": sorted({f.code for f in errors}),
            "warnings": sum(f.severity == "warning" for f in report.findings),
            "codes": sorted(report.codes()) if callable(
                getattr(report, "codes", None)) else []}


def warmup_study(zoo, weights, x, y):
    """The first `WARMUP_STEPS` steps with each initial scale: the steps
    skipped and the first applied step (1-based)."""
    import keras

    import kerasmp

    out = {}
    for initial in WARMUP_SCALES:
        _, train = build(zoo, weights)
        optimizer = kerasmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3), initial_scale=initial)
        run = fit(train, x, y, optimizer=optimizer)
        key = "auto" if initial == "auto" else (
            f"2**{int(initial).bit_length() - 1}")
        out[key] = {
            "skipped": run["skipped"],
            "finite": run["finite"],
            "scales": run.get("scales"),
            "first_applied_step": _first_applied(run),
        }
    return out


def _first_applied(run):
    """1-based index of the first step not skipped, from the cumulative
    skipped counts; None when every step was skipped."""
    counts = run.get("skipped_counts") or []
    previous = 0
    for i, c in enumerate(counts):
        if c == previous:
            return i + 1
        previous = c
    return None


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------


def export_all(features, x, reference, folder):
    """Every format: `kerasmp.export.export` (float16), then one process
    where kerasmp cannot be imported reads every artifact back; parity of
    what it computes against the float32 outputs."""
    import subprocess

    import numpy as np

    from kerasmp.export import export
    from kerasmp.export.inputs import input_specs
    from zoo import spec

    names = [name for name, _, _ in input_specs(features)]
    flat = _flat_inputs(features, x, names)
    out = {}
    written = {}
    for fmt in FORMATS:
        path = os.path.join(folder, "artifact_" + fmt + SUFFIX[fmt])
        start = time.time()
        try:
            report = export(features, path, format=fmt, dtype="float16",
                            sample=x, overwrite=True)
            out[fmt] = {"written": True,
                        "report_rel_diff": _json_float(report.rel_diff),
                        "weight_ratio": _json_float(report.weight_ratio),
                        "kept_float32": len(report.kept_float32)}
            written[fmt] = path
        except Exception as e:
            out[fmt] = {"written": False, **describe(e)}
        out[fmt]["export_seconds"] = round(time.time() - start, 2)
    if not written:
        return out
    np.savez(os.path.join(folder, "flat.npz"), **flat)
    _save_inputs(os.path.join(folder, "parity_inputs.npz"), x)
    job = {"artifacts": written, "names": names, "folder": folder}
    with open(os.path.join(folder, "reload.json"), "w") as f:
        json.dump(job, f)
    start = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "reload.py"),
             os.path.join(folder, "reload.json")],
            capture_output=True, text=True, timeout=RELOAD_TIMEOUT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        lines = [ln for ln in proc.stdout.splitlines()
                 if ln.startswith("RESULT ")]
        loaded = json.loads(lines[-1][7:]) if lines else {
            fmt: {"error": "the reload process printed no result: "
                           + proc.stderr.strip()[-300:]} for fmt in written}
    except subprocess.TimeoutExpired:
        loaded = {fmt: {"error": f"reload timed out ({RELOAD_TIMEOUT} s)"}
                  for fmt in written}
    reload_seconds = round(time.time() - start, 2)
    for fmt in written:
        info = loaded.get(fmt, {"error": "not read back"})
        row = out[fmt]
        row["reload_seconds"] = reload_seconds
        if "error" in info:
            row.update(reloaded=False, reload_error=info["error"][:400])
            continue
        y = np.load(info["output"])
        row["reloaded"] = True
        row["rel_diff"] = (_json_float(spec.rel_diff(reference, y))
                           if reference is not None else None)
    return out


def _flat_inputs(features, x, names):
    """The parity inputs keyed by the export's input names."""
    import keras

    if not isinstance(x, dict):
        return {names[0]: x}
    keys = list(keras.tree.flatten(
        {k: k for k in features.input}
        if isinstance(features.input, dict) else list(x)))
    return {name: x[key] for name, key in zip(names, keys)}


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=("plain", "kerasmp"),
                        required=True)
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--dirs", nargs="+", required=True,
                        help="one folder per model, in order")
    parser.add_argument("--no-export", action="store_true")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--only-export", action="store_true",
                        help="the export column alone (float32 build and "
                             "forward, then kerasmp's build and export)")
    parser.add_argument("--eager", action="store_true",
                        help="fit with run_eagerly=True")
    parser.add_argument("--jit", action="store_true",
                        help='fit with jit_compile="auto" (default False)')
    args = parser.parse_args(argv)
    if len(args.models) != len(args.dirs):
        parser.error("--models and --dirs: one folder per model")
    global JIT_COMPILE, RUN_EAGERLY
    JIT_COMPILE = "auto" if args.jit else False
    RUN_EAGERLY = args.eager
    if args.stage == "plain":
        absent.block()
    import keras

    # Several models, one after the other, in one process (the imports
    # cost more than a tiny model): one RESULT line each.
    for name, folder in zip(args.models, args.dirs):
        keras.backend.clear_session()
        _LAST.clear()
        _LAST["model"] = name
        os.makedirs(folder, exist_ok=True)
        zoo = zoo_model(name)
        if args.stage == "plain":
            result = stage_plain(zoo, folder, only_export=args.only_export)
        else:
            result = stage_kerasmp(zoo, folder, export=not args.no_export,
                                   warmup=not args.no_warmup,
                                   only_export=args.only_export)
        result["model"] = name
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
