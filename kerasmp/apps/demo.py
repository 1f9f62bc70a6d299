"""`kerasmp demo`: float32 vs mixed precision on real data, in one command.

Trains the same small CNN (`kerasmp.apps.zoo.digits_cnn`) twice on the 8x8
handwritten digits that ship with kerasmp (`kerasmp.data.load_digits`,
nothing is downloaded): once in float32, once under a `kerasmp.Policy`
("mixed_float16" by default) with `kerasmp.optimizer.LossScaleOptimizer`,
`LossScaleMonitor` and `NonFiniteMonitor`. Both runs start from the same
weights and see the batches in the same order (same seed). It then exports
the mixed-precision model in half precision with `kerasmp.export` and prints
a table: test accuracy, wall time, final loss scale, skipped steps, events,
export size ratio and parity.

Artifacts, under `--out` (default `./kerasmp-demo`):

- `history.csv`: per-epoch metrics of both runs (loss scale included),
- `loss_scale.png`: the loss scale per step with skipped steps and events
  (needs matplotlib: `pip install kerasmp[plot]`),
- `events.jsonl`: the `NonFiniteMonitor` events,
- `model.keras`: the trained mixed-precision model (float32 master weights),
- `model_fp16.keras` (and `model_fp16_savedmodel/` on TensorFlow): the
  half-precision export (`model_bf16...` with `--policy mixed_bfloat16`),
- `summary.json`: everything the table shows, and more.

A run writes into a staging folder inside `--out` (as `kerasmp.export` does
beside its path) and, once everything is written, moves its artifacts into
place and takes away what an earlier demo run left there (the names above,
`ARTIFACT_NAMES`; nothing else in the folder), so the folder and the list
the demo prints hold only what this run wrote. An interrupted run (Ctrl-C,
SIGTERM, an error) leaves the earlier run's artifacts as they were, and no
staging folder.

On PyTorch the demo trains with one CPU thread (`torch.set_num_threads(1)`
while it runs, unless `OMP_NUM_THREADS` is set): the model is so small that
synchronizing torch's intra-op threads costs more than they save, and on a
busy machine (other processes on the cores) a step took 10x longer with two
threads than with one, in stock Keras as under kerasmp (docs/benchmarks.md).
"""

import contextlib
import csv
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
import warnings

import keras
import numpy as np

from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.cpu_speed import has_bf16_instructions
from kerasmp._utils.devices import cpu_flags
from kerasmp._utils.devices import main_device
from kerasmp._utils.paths import check_output_folder
from kerasmp.apps.choices import DEMO_DEFAULT_EPOCHS
from kerasmp.apps.choices import DEMO_POLICIES
from kerasmp.apps.choices import DEMO_QUICK_EPOCHS
from kerasmp.apps.demo_report import fmt_scale
from kerasmp.apps.demo_report import format_summary
from kerasmp.apps.zoo import digits_cnn

BATCH_SIZE = 32
LEARNING_RATE = 3e-3
GROWTH_STEPS = 100
SUMMARY_VERSION = 1
# Every file or folder name the demo writes in `out`, for any policy and
# backend: a run removes these first (and only these).
ARTIFACT_NAMES = (
    "history.csv", "loss_scale.png", "events.jsonl", "model.keras",
    "model_fp16.keras", "model_bf16.keras", "model_fp16_savedmodel",
    "model_bf16_savedmodel", "summary.json",
)


class _ProgressBar(keras.callbacks.Callback):
    """One progress bar over all the steps of a run, with the loss scale.

    Redrawn in place on a terminal; elsewhere (CI logs, notebooks' captured
    output) one line per epoch.
    """

    width = 24

    def __init__(self, epochs, steps_per_epoch, verbose, stream=None):
        super().__init__()
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.total = epochs * steps_per_epoch
        self.verbose = verbose
        self.stream = stream or sys.stdout
        self.interactive = bool(getattr(self.stream, "isatty", None)
                                and self.stream.isatty())
        self._epoch = 0
        self._logs = {}
        self._start = None
        self._last_draw = 0.0

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._logs = dict(logs or {})
        now = time.perf_counter()
        if self.interactive and now - self._last_draw > 0.1:
            self._last_draw = now
            self._draw(self._epoch * self.steps_per_epoch + batch + 1, "\r")

    def on_epoch_end(self, epoch, logs=None):
        done = (epoch + 1) * self.steps_per_epoch
        if self.interactive:
            self._draw(done, "\r")
        else:
            self._draw(done, "", "\n")

    def on_train_end(self, logs=None):
        if self.interactive and self.verbose:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, step, prefix, suffix=""):
        if not self.verbose:
            return
        step = min(step, self.total)
        filled = int(self.width * step / self.total)
        bar = "=" * filled + (">" if filled < self.width else "")
        bar = bar.ljust(self.width)
        logs = self._logs
        parts = [f"[{bar}] {step:>{len(str(self.total))}}/{self.total}",
                 f"epoch {self._epoch + 1}/{self.epochs}"]
        if "loss" in logs:
            parts.append(f"loss {float(logs['loss']):.4f}")
        if "accuracy" in logs:
            parts.append(f"acc {float(logs['accuracy']):.3f}")
        if "loss_scale" in logs:
            parts.append(f"scale {fmt_scale(float(logs['loss_scale']))}")
        if "skipped_steps" in logs:
            parts.append(f"skipped {int(logs['skipped_steps'])}")
        parts.append(f"{time.perf_counter() - self._start:.1f}s")
        self.stream.write(prefix + "  ".join(parts) + suffix)
        self.stream.flush()


def _check_args(policy, epochs, seed, quick, batch_size):
    if not isinstance(policy, str) or policy not in DEMO_POLICIES:
        raise ValueError(
            f"Invalid `policy`: {policy!r}. Allowed values: "
            f"{', '.join(DEMO_POLICIES)}."
        )
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
    ):
        raise ValueError(
            f"`epochs` must be an integer >= 1 (or None). Received: {epochs!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(
            f"`seed` must be an integer >= 0. Received: seed={seed!r}"
        )
    if not isinstance(quick, bool):
        raise TypeError(f"`quick` must be True or False. Received: {quick!r}")
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise ValueError(
            f"`batch_size` must be an integer >= 1. Received: {batch_size!r}"
        )


def _train(name, policy, data, epochs, seed, batch_size, out, verbose):
    """Builds, trains and evaluates one model.

    Returns:
        `(model, run, history, nonfinite_monitor)`: `run` is the run's dict
        in the summary; the monitor is None for the float32 run.
    """
    from kerasmp.callbacks.loss_scale import LossScaleMonitor
    from kerasmp.callbacks.nonfinite import NonFiniteMonitor
    from kerasmp.callbacks.performance import PerformanceMonitor
    from kerasmp.optimizer.loss_scale_optimizer import LossScaleOptimizer
    from kerasmp.policy.policy import policy_scope

    (x, y), (x_test, y_test) = data
    steps_per_epoch = math.ceil(len(x) / batch_size)
    keras.utils.set_random_seed(seed)
    with policy_scope(policy):
        model = digits_cnn()
    schedule = keras.optimizers.schedules.CosineDecay(
        LEARNING_RATE, decay_steps=epochs * steps_per_epoch
    )
    optimizer = keras.optimizers.Adam(schedule)
    scaled = model.get_layer("conv1").compute_dtype == "float16"
    performance = PerformanceMonitor(batch_size=batch_size)
    callbacks = [performance, _ProgressBar(epochs, steps_per_epoch, verbose)]
    nonfinite = None
    if scaled:
        optimizer = LossScaleOptimizer(
            optimizer, dynamic_growth_steps=GROWTH_STEPS
        )
        callbacks.append(LossScaleMonitor())
    if name != "float32":
        events_path = os.path.join(out, "events.jsonl")
        nonfinite = NonFiniteMonitor(action="warn", log_file=events_path)
        callbacks.append(nonfinite)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=True,
        callbacks=callbacks, verbose=0,
    )
    # Training time as PerformanceMonitor measured it, epoch by epoch.
    rates = history.history["steps_per_second"]
    wall = sum(steps_per_epoch / r for r in rates if r)
    test_loss, test_accuracy = model.evaluate(
        x_test, y_test, batch_size=256, verbose=0
    )
    run = {
        "policy": policy.name,
        "compute_dtype": model.get_layer("conv1").compute_dtype,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        "train_accuracy": float(history.history["accuracy"][-1]),
        "wall_time_s": round(wall, 3),
        "steps_per_second": round(float(rates[-1]), 2),
        "samples_per_second": round(
            float(history.history["samples_per_second"][-1]), 1),
        "peak_memory_mb": round(float(history.history["peak_memory_mb"][-1]),
                                1),
        "memory_source": performance.memory_source,
        "steps": epochs * steps_per_epoch,
        "loss_scaling": scaled,
        "initial_loss_scale": None,
        "final_loss_scale": None,
        "skipped_steps": None,
        "events": None,
    }
    if scaled:
        run["initial_loss_scale"] = float(optimizer.initial_scale)
        run["final_loss_scale"] = optimizer.loss_scale
        run["skipped_steps"] = optimizer.skipped_steps
        run["dynamic_growth_steps"] = GROWTH_STEPS
    if nonfinite is not None:
        by_kind = {}
        for event in nonfinite.events:
            by_kind[event["kind"]] = by_kind.get(event["kind"], 0) + 1
        run["events"] = {"total": len(nonfinite.events), "by_kind": by_kind}
    return model, run, history, nonfinite


def _write_history(path, histories):
    keys = []
    for _, history in histories:
        for k in history.history:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "epoch"] + keys)
        for run, history in histories:
            n = len(next(iter(history.history.values())))
            for epoch in range(n):
                row = [run, epoch + 1]
                for k in keys:
                    values = history.history.get(k)
                    row.append("" if values is None else float(values[epoch]))
                writer.writerow(row)


def _plot(monitor, path, title):
    """Writes the loss-scale PNG; returns None or why it was skipped."""
    if monitor is None or not monitor.trace:
        return "no loss scale in this run (bfloat16 needs no loss scaling)"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("matplotlib is not installed (pip install kerasmp[plot]); "
                "no loss-scale plot")
    from kerasmp.plotting import plot_loss_scale

    plot_loss_scale(monitor, path, title=title)
    return None


# Largest |probability difference| of a half-precision export vs float32
# that `passed` accepts: float16 keeps 11 significant bits, bfloat16 8.
PARITY_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}


def _export(model, out, dtype, x_test, y_test):
    """Exports `model` in half precision; returns a list of dicts."""
    from kerasmp.export import export

    short = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    targets = [("keras", os.path.join(out, f"model_{short}.keras"))]
    if keras.backend.backend() == "tensorflow":
        targets.append(
            ("savedmodel", os.path.join(out, f"model_{short}_savedmodel"))
        )
    results = []
    for fmt, path in targets:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = export(model, path, format=fmt, dtype=dtype,
                            sample=x_test, overwrite=True)
        entry = report.to_dict()
        entry["parity_tolerance"] = PARITY_TOLERANCE[dtype]
        entry["passed"] = report.passed(PARITY_TOLERANCE[dtype])
        entry["test_accuracy"] = _served_accuracy(fmt, path, x_test, y_test)
        results.append(entry)
    return results


def _served_accuracy(fmt, path, x_test, y_test):
    """Test accuracy of the exported artifact, loaded the way users load it."""
    if fmt == "keras":
        served = keras.saving.load_model(path, compile=False)
        probs = to_numpy(served(x_test, training=False))
    else:
        import tensorflow as tf

        serve = tf.saved_model.load(path).signatures["serving_default"]
        outputs = serve(tf.constant(x_test))
        probs = next(iter(outputs.values())).numpy()
    return float(np.mean(np.argmax(probs, axis=-1) == y_test))


def _device():
    try:
        dev = main_device()
        return f"{dev.kind}: {dev.name}"
    except Exception as e:  # the demo never fails for lack of a device name
        return f"unknown ({e})"


# The name the demo's staging in `out` is made for: its lock file is
# `.kerasmp-export-lock-<this>` (two demos into one folder: the second stops
# at once), its folder `.kerasmp-export-<pid>-...` (removed on every exit
# Python sees; the next run removes those of killed runs).
_STAGE_TARGET = "kerasmp-demo-run"


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM wait until the block is done (main thread only).

    The artifacts are moved into place one rename each: deferring the
    signals over those few renames means an interrupt never leaves some
    artifacts of the new run beside some of the old one.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    held = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        old = signal.getsignal(signum)
        if old in (signal.SIG_IGN, None):
            continue
        held[signum] = old
        signal.signal(signum, lambda n, frame: caught.append(n))
    try:
        yield
    finally:
        for signum, old in held.items():
            signal.signal(signum, old)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)  # now handled as it would have been


def _publish_run(stage, out, names):
    """Moves this run's artifacts (`names`, in `stage.dir`) into `out`.

    Each one replaces its earlier version with one atomic rename; earlier
    artifacts this run did not write (another policy's export, TensorFlow's
    SavedModel after a run on another backend) are moved into the staging
    folder, which goes when the staging closes.
    """
    with _signals_deferred():
        for name in names:
            stage.publish(os.path.join(stage.dir, name), True,
                          os.path.join(out, name))
        for name in ARTIFACT_NAMES:
            path = os.path.join(out, name)
            if name not in names and os.path.lexists(path):
                os.rename(path, os.path.join(stage.dir, "earlier-" + name))


def run_demo(out="kerasmp-demo", policy="mixed_float16", epochs=None,
             seed=0, quick=False, batch_size=BATCH_SIZE, verbose=True):
    """Trains the demo CNN in float32 and in mixed precision and compares.

    Args:
        out: Folder for the artifacts (created if needed; its parent
            folder must exist). The run is written into a staging folder
            there and replaces the artifacts of an earlier run
            (`ARTIFACT_NAMES`) only once it is complete, so the folder then
            holds only what this run wrote; other files are left. An
            interrupted run leaves the earlier artifacts as they were.
        policy: `"mixed_float16"` (default; with loss scaling) or
            `"mixed_bfloat16"` (no loss scaling needed).
        epochs: Training epochs of each run. Defaults to 12, or 2 with
            `quick=True`.
        seed: Seed of the weights and the batch order, the same for both
            runs. Defaults to 0.
        quick: A short run for smoke tests (2 epochs unless `epochs` is
            given). Defaults to False.
        batch_size: Training batch size. Defaults to 32.
        verbose: Print progress bars and the table. Defaults to True.

    Returns:
        The summary dict, also written to `out/summary.json`.

    Example:

    ```python
    from kerasmp.apps import demo

    summary = demo.run_demo("kerasmp-demo", epochs=12)
    summary["accuracy_diff_pp"]   # mixed minus float32 test accuracy, points
    summary["runs"]["mixed"]["final_loss_scale"]
    ```
    """
    from kerasmp.export.publish import Staging

    _check_args(policy, epochs, seed, quick, batch_size)
    out = check_output_folder(out, "out")
    os.makedirs(out, exist_ok=True)
    try:
        stage = Staging(os.path.join(out, _STAGE_TARGET)).__enter__()
    except FileExistsError:
        raise FileExistsError(
            f"Another kerasmp demo is writing into `out` {out!r} right now; "
            "nothing was changed. Wait for it or choose another --out."
        ) from None
    with contextlib.ExitStack() as closing:
        closing.push(stage.__exit__)  # the staging goes on every exit
        with _one_torch_thread():
            summary, names = _run(stage.dir, out, policy, epochs, seed, quick,
                                  batch_size, verbose)
        _publish_run(stage, out, names)
    if verbose:
        print(format_summary(summary))
    return summary


@contextlib.contextmanager
def _one_torch_thread():
    """One intra-op CPU thread on PyTorch while the demo runs (see above)."""
    if keras.backend.backend() != "torch" or os.environ.get(
        "OMP_NUM_THREADS"
    ):
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(work, out, policy, epochs, seed, quick, batch_size, verbose):
    """The demo, written into `work`; the summary names paths in `out`.

    Returns:
        `(summary, names)`: `names` are the artifacts written in `work`.
    """
    from kerasmp.data import load_digits
    from kerasmp.policy.policy import Policy

    if epochs is None:
        epochs = DEMO_QUICK_EPOCHS if quick else DEMO_DEFAULT_EPOCHS
    data = load_digits(seed=0)
    (x, _), (x_test, y_test) = data
    say = print if verbose else (lambda *a, **k: None)
    backend = keras.backend.backend()
    say(f"kerasmp demo: 8x8 digits ({len(x)} train / {len(x_test)} test "
        f"images), CNN, {epochs} epochs, seed {seed}, backend {backend}")

    started = time.perf_counter()
    runs, histories = {}, []
    say("\n[1/2] float32")
    _, runs["float32"], history32, _ = _train(
        "float32", keras.DTypePolicy("float32"), data, epochs, seed,
        batch_size, work, verbose,
    )
    histories.append(("float32", history32))
    say(f"\n[2/2] {policy} (kerasmp.Policy"
        + (f" + LossScaleOptimizer(dynamic_growth_steps={GROWTH_STEPS}:"
           f" the scale may grow every {GROWTH_STEPS} good steps in this "
           "short run; the default is 2000)"
           if policy == "mixed_float16" else "")
        + " + monitors)")
    model, runs["mixed"], history_mp, monitor = _train(
        policy, Policy(policy), data, epochs, seed, batch_size, work,
        verbose,
    )
    histories.append((policy, history_mp))
    say("")

    artifacts = {}
    notes = []
    _write_history(os.path.join(work, "history.csv"), histories)
    artifacts["history_csv"] = "history.csv"
    why_not = _plot(monitor if runs["mixed"]["loss_scaling"] else None,
                    os.path.join(work, "loss_scale.png"),
                    f"kerasmp demo: {policy} loss scale")
    artifacts["loss_scale_png"] = None if why_not else "loss_scale.png"
    if why_not:
        notes.append(f"loss_scale.png skipped: {why_not}")
    artifacts["events_jsonl"] = "events.jsonl"
    model.save(os.path.join(work, "model.keras"))
    artifacts["model"] = "model.keras"

    say("exporting the mixed-precision model in half precision ...")
    dtype = "float16" if policy == "mixed_float16" else "bfloat16"
    exports = _export(model, work, dtype, x_test, y_test)
    for e in exports:
        e["path"] = os.path.join(out, os.path.basename(e["path"]))
        artifacts[f"export_{e['format']}"] = os.path.basename(e["path"])
    artifacts["summary_json"] = "summary.json"
    names = [name for name in artifacts.values() if name]
    artifacts = {key: name and os.path.join(out, name)
                 for key, name in artifacts.items()}

    diff = 100.0 * (runs["mixed"]["test_accuracy"]
                    - runs["float32"]["test_accuracy"])
    summary = {
        "summary_version": SUMMARY_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "kerasmp_version": _kerasmp_version(),
        "keras_version": keras.__version__,
        "backend": backend,
        "device": _device(),
        "cpu_bf16_instructions": has_bf16_instructions(cpu_flags()),
        "command": "kerasmp demo " + " ".join(
            [f"--policy {policy}", f"--epochs {epochs}", f"--seed {seed}"]
            + (["--quick"] if quick else [])),
        "dataset": {"name": "digits-8x8 (UCI, CC BY 4.0)",
                    "train": int(len(x)), "test": int(len(x_test))},
        "model": {"name": "digits_cnn", "params": int(model.count_params())},
        "config": {"policy": policy, "epochs": epochs, "seed": seed,
                   "quick": quick, "batch_size": batch_size,
                   "learning_rate": LEARNING_RATE,
                   "schedule": "cosine decay to 0"},
        "runs": runs,
        "accuracy_diff_pp": round(diff, 4),
        "accuracy_parity": abs(diff) <= 1.0,
        "time_ratio": round(runs["mixed"]["wall_time_s"]
                            / runs["float32"]["wall_time_s"], 3),
        "exports": exports,
        "artifacts": artifacts,
        "notes": notes,
        "total_time_s": round(time.perf_counter() - started, 3),
    }
    with open(os.path.join(work, "summary.json"), "w",
              encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary, names


def _kerasmp_version():
    import kerasmp

    return kerasmp.__version__
