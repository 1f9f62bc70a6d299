"""`kerasmp demo`: mixed precision matches float32 on real data.

The main test runs the README's command exactly (`kerasmp demo`, no
arguments, in a fresh folder) and checks what it promises against
independent references: the float32 run of the same seed (accuracy within
one percentage point), PyTorch's GradScaler rule replayed over the skipped
steps it logged (the final loss scale), the files it wrote (CSV, PNG, event
log, exported model reloaded with plain Keras) and the summary's fields.
"""

import csv
import json
import math
import os

import keras
import numpy as np
import pytest
from _helpers import slow_on

from kerasmp.apps import cli
from kerasmp.apps import demo
from kerasmp.apps.choices import DEMO_DEFAULT_EPOCHS
from kerasmp.apps.choices import DEMO_QUICK_EPOCHS
from kerasmp.data import load_digits

SUMMARY_KEYS = {
    "summary_version", "date", "kerasmp_version", "keras_version",
    "backend", "device", "command", "dataset", "model", "config", "runs",
    "accuracy_diff_pp", "accuracy_parity", "time_ratio", "exports",
    "artifacts", "notes", "total_time_s",
}
RUN_KEYS = {
    "policy", "compute_dtype", "test_accuracy", "test_loss",
    "train_accuracy", "wall_time_s", "steps", "loss_scaling",
    "initial_loss_scale", "final_loss_scale", "skipped_steps", "events",
}
EXPORT_KEYS = {
    "path", "format", "dtype", "bytes", "float32_bytes", "size_ratio",
    "max_abs_diff", "top1_agreement", "passed", "test_accuracy",
}
SKIP_KINDS = ("calibration", "overflow", "stuck")


def _pytorch_scale(steps, skipped, initial, growth_steps, min_scale=1.0,
                   max_scale=2.0**24):
    """torch.amp.GradScaler.update, step by step, given the skipped steps."""
    scale, tracker = initial, 0
    for step in range(steps):
        if step in skipped:
            scale, tracker = max(scale * 0.5, min_scale), 0
        elif tracker + 1 == growth_steps:
            scale, tracker = min(scale * 2.0, max_scale), 0
        else:
            tracker += 1
    return scale


# The full demo: about 2 minutes on TensorFlow (float16 convolutions without
# XLA), 20 s on JAX; CI also runs the README's `kerasmp demo` on TensorFlow.
@slow_on("tensorflow")
def test_readme_command_mixed_matches_float32(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "kerasmp-demo"
    summary = json.loads((out / "summary.json").read_text())

    # The summary holds what the issue asks for.
    assert SUMMARY_KEYS <= set(summary)
    f32, mp = summary["runs"]["float32"], summary["runs"]["mixed"]
    assert RUN_KEYS <= set(f32) and RUN_KEYS <= set(mp)
    assert summary["backend"] == keras.backend.backend()
    assert summary["config"]["policy"] == "mixed_float16"
    assert summary["config"]["epochs"] == DEMO_DEFAULT_EPOCHS
    assert summary["dataset"]["train"] + summary["dataset"]["test"] == 1797
    assert f32["compute_dtype"] == "float32"
    assert mp["compute_dtype"] == "float16" and mp["loss_scaling"]

    # Accuracy: both runs learn (chance is 10%), and mixed precision is
    # within one point of the float32 run with the same seed.
    assert f32["test_accuracy"] > 0.95 and mp["test_accuracy"] > 0.95
    diff = 100 * (mp["test_accuracy"] - f32["test_accuracy"])
    assert abs(diff) <= 1.0, diff
    assert summary["accuracy_diff_pp"] == pytest.approx(diff, abs=1e-3)
    assert summary["accuracy_parity"] is True

    # The event log has one line per event; every skipped step is one.
    lines = (out / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    assert len(events) == mp["events"]["total"]
    skipped = {e["step"] for e in events if e["kind"] in SKIP_KINDS}
    assert len(skipped) == mp["skipped_steps"]
    assert not any(e["kind"] in ("stuck", "nonfinite_weights")
                   for e in events)

    # The final scale is PyTorch's GradScaler rule replayed over those steps.
    expected = _pytorch_scale(mp["steps"], skipped, mp["initial_loss_scale"],
                              mp["dynamic_growth_steps"])
    assert mp["final_loss_scale"] == expected
    assert mp["initial_loss_scale"] == 2.0**15

    # history.csv: one row per epoch and run, the scale logged by epoch.
    with open(out / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    epochs = summary["config"]["epochs"]
    assert [r["run"] for r in rows] == (["float32"] * epochs
                                        + ["mixed_float16"] * epochs)
    assert rows[0]["loss_scale"] == ""
    assert float(rows[-1]["loss_scale"]) == mp["final_loss_scale"]
    assert float(rows[-1]["skipped_steps"]) == mp["skipped_steps"]
    assert math.isclose(float(rows[-1]["accuracy"]), mp["train_accuracy"],
                        rel_tol=1e-6)

    # The loss-scale plot.
    pytest.importorskip("matplotlib")
    png = out / "loss_scale.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["artifacts"]["loss_scale_png"] == str(
        png.relative_to(tmp_path))

    # The float16 export: half the size, same predictions, loads in Keras.
    formats = {e["format"]: e for e in summary["exports"]}
    expected_formats = {"keras"}
    if keras.backend.backend() == "tensorflow":
        expected_formats.add("savedmodel")
        assert (out / "model_fp16_savedmodel" / "saved_model.pb").exists()
    assert set(formats) == expected_formats
    for e in formats.values():
        assert EXPORT_KEYS <= set(e)
        assert e["dtype"] == "float16"
        assert e["size_ratio"] < 0.75
        assert float(e["max_abs_diff"]) < 1e-2 and e["passed"]
        assert float(e["rel_diff"]) < 2e-2 and e["weight_ratio"] <= 0.52
        assert e["top1_agreement"] >= 0.99
        assert abs(e["test_accuracy"] - mp["test_accuracy"]) <= 0.01
    # A plain Keras model (docs/export.md): float16 variables, the softmax
    # and batch norm in float32 through stock per-layer dtype policies.
    served = keras.saving.load_model(out / "model_fp16.keras", compile=False)
    assert served.get_layer("conv1").kernel.dtype == "float16"
    assert served.get_layer("softmax").compute_dtype == "float32"
    assert served.get_layer("bn").compute_dtype == "float32"
    (_, _), (x_test, y_test) = load_digits()
    accuracy = np.mean(
        np.argmax(keras.ops.convert_to_numpy(served(x_test)), -1) == y_test)
    assert accuracy == pytest.approx(formats["keras"]["test_accuracy"])

    # The table.
    for label in ("test accuracy", "train wall time", "final loss scale",
                  "skipped steps", "events", "export keras (float16)"):
        assert label in printed
    assert "within 1 point of float32" in printed


@pytest.mark.tensorflow  # backend-independent logic; the JAX run is long
def test_quick_bfloat16_has_no_loss_scale(tmp_path, capsys):
    out = tmp_path / "bf16"
    # What an earlier mixed_float16 run left in the same folder, and a file
    # of the user's: the rerun replaces the former and keeps the latter.
    out.mkdir()
    earlier = ["model_fp16.keras", "loss_scale.png", "events.jsonl",
               "summary.json"]
    for name in earlier:
        (out / name).write_text("earlier run\n")
    (out / "model_fp16_savedmodel").mkdir()
    (out / "model_fp16_savedmodel" / "saved_model.pb").write_text("x")
    (out / "my_notes.txt").write_text("mine\n")
    code = cli.main(["demo", "--quick", "--policy", "mixed_bfloat16",
                     "--seed", "3", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    mp = summary["runs"]["mixed"]
    config = summary["config"]
    assert (config["policy"], config["epochs"], config["seed"],
            config["quick"]) == ("mixed_bfloat16", DEMO_QUICK_EPOCHS, 3, True)
    assert mp["compute_dtype"] == "bfloat16"
    assert mp["loss_scaling"] is False
    assert mp["final_loss_scale"] is None and mp["skipped_steps"] is None
    assert summary["artifacts"]["loss_scale_png"] is None
    assert not (out / "loss_scale.png").exists()
    assert any("bfloat16 needs no loss scaling" in n for n in summary["notes"])
    assert {e["dtype"] for e in summary["exports"]} == {"bfloat16"}
    assert (out / "model_bf16.keras").exists()
    printed = capsys.readouterr().out
    assert "final loss scale" in printed
    # The closing line tells this run's truth: its own time ratio (from the
    # two runs' wall times), and what this CPU has.
    ratio = (summary["runs"]["mixed"]["wall_time_s"]
             / summary["runs"]["float32"]["wall_time_s"])
    assert f"trained in x{ratio:.2f} float32's time" in printed
    assert "usually slower" not in printed
    with open("/proc/cpuinfo") as f:
        bf16 = any(flag in f.read() for flag in ("avx512_bf16", "amx_bf16"))
    assert summary["cpu_bf16_instructions"] == bf16
    assert ("has no bfloat16 instructions" in printed) == (not bf16)
    # The folder holds what this run wrote (all of it listed) and the
    # user's file; nothing of the earlier run survives.
    listed = {os.path.basename(p) for p in summary["artifacts"].values()
              if p}
    assert set(os.listdir(out)) == listed | {"my_notes.txt"}
    assert (out / "my_notes.txt").read_text() == "mine\n"
    assert "fp16" not in printed.split("artifacts:")[1]
    for name in ("events.jsonl", "summary.json"):
        assert (out / name).read_text() != "earlier run\n"


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_staging_left(*folders):
    for folder in folders:
        left = [n for n in os.listdir(folder) if n.startswith(".kerasmp")]
        assert not left, left


@pytest.mark.tensorflow  # backend-independent logic
def test_interrupted_rerun_keeps_the_earlier_run(tmp_path, monkeypatch,
                                                 capsys):
    out = tmp_path / "demo"
    demo.run_demo(out, epochs=1, verbose=False)
    (out / "my_notes.txt").write_text("mine\n")
    before = _files(out)
    assert "events.jsonl" in before and "model_fp16.keras" in before

    # Ctrl-C on the third step of the rerun's mixed-precision fit, after
    # the float32 run and once the event log has been opened.
    fits = []

    def on_train_begin(self, logs=None):
        fits.append(0)
        self._start = 0.0

    def on_train_batch_end(self, batch, logs=None):
        fits[-1] += 1
        if len(fits) == 2 and fits[-1] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(demo._ProgressBar, "on_train_begin", on_train_begin)
    monkeypatch.setattr(demo._ProgressBar, "on_train_batch_end",
                        on_train_batch_end)
    assert cli.main(["demo", "--epochs", "1", "--seed", "5", "--out",
                     str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert len(fits) == 2 and fits[-1] == 3
    # Every artifact of the first run, byte for byte; nothing else.
    assert _files(out) == before
    _no_staging_left(out, tmp_path)


@pytest.mark.tensorflow  # backend-independent logic
def test_signal_while_publishing_waits_for_the_whole_run(tmp_path,
                                                         monkeypatch):
    import signal

    from kerasmp.export import publish

    out = tmp_path / "demo"
    demo.run_demo(out, epochs=1, verbose=False)
    (out / "model_fp16_savedmodel").mkdir(exist_ok=True)
    published = []

    def interrupt_first(staged, path):
        if os.path.dirname(path) == str(out):  # not the export's own
            if not published:
                signal.raise_signal(signal.SIGINT)
            published.append(os.path.basename(path))

    monkeypatch.setattr(publish, "_before_publish", interrupt_first)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(out, epochs=1, seed=7, verbose=False)
    # The SIGINT came at the first rename and took effect after the last:
    # the folder holds the whole second run, no artifact of the first.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["seed"] == 7
    assert set(published) == {os.path.basename(p)
                              for p in summary["artifacts"].values() if p}
    assert set(os.listdir(out)) == set(published)
    _no_staging_left(out, tmp_path)


@pytest.mark.torch
def test_pytorch_demo_trains_on_one_cpu_thread(tmp_path, monkeypatch):
    """The demo's tiny model on 2 busy cores: one torch thread, not two
    (docs/benchmarks.md); the caller's setting is back afterwards."""
    if keras.backend.backend() != "torch":
        pytest.skip("the PyTorch setting")
    import torch

    class Stop(Exception):
        pass

    seen = []

    def train(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise Stop

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(demo, "_train", train)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(Stop):
            demo.run_demo(tmp_path / "d", verbose=False)
        assert seen == [1] and torch.get_num_threads() == 2
        # A user's explicit OMP_NUM_THREADS is left alone.
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        with pytest.raises(Stop):
            demo.run_demo(tmp_path / "d", verbose=False)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "kwargs, argname",
    [
        ({"policy": "float16"}, "policy"),
        ({"policy": "mixed_float16", "epochs": 0}, "epochs"),
        ({"policy": "mixed_float16", "seed": -1}, "seed"),
        ({"policy": "mixed_float16", "batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, argname, tmp_path):
    with pytest.raises(ValueError, match=argname):
        demo.run_demo(out=tmp_path / "x", verbose=False, **kwargs)
    assert not (tmp_path / "x").exists()


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    for args, flag in ((["--epochs", "0"], "--epochs"),
                       (["--policy", "float16"], "--policy")):
        with pytest.raises(SystemExit) as e:
            cli.main(["demo", *args, "--out", str(tmp_path / "x")])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_demo_refuses_a_missing_parent_folder(tmp_path):
    out = tmp_path / "missing" / "x"
    assert cli.main(["demo", "--quick", "--out", str(out)]) == 2
    with pytest.raises(ValueError, match="does not exist"):
        demo.run_demo(out=out, quick=True, verbose=False)
    assert not (tmp_path / "missing").exists()


def _demo_summary(top1=1.0):
    run = {"test_accuracy": 0.99, "test_loss": 0.02, "wall_time_s": 2.0,
           "final_loss_scale": None, "skipped_steps": None, "steps": 540}
    mixed = dict(run, final_loss_scale=2.0**20, initial_loss_scale=2.0**15,
                 skipped_steps=0, events={"total": 0, "by_kind": {}})
    return {
        "runs": {"float32": run, "mixed": mixed},
        "config": {"policy": "mixed_float16"},
        "accuracy_diff_pp": 0.0, "time_ratio": 2.0, "accuracy_parity": True,
        "device": "cpu: x", "notes": [], "artifacts": {},
        "exports": [{"format": "keras", "dtype": "float16", "size_ratio": 0.6,
                     "max_abs_diff": 2e-3, "top1_agreement": top1,
                     "test_accuracy": 0.99}],
    }


@pytest.mark.parametrize("top1", [1.0, None])
def test_demo_table_has_a_header_per_column_and_a_rule_as_wide_as_it(top1):
    lines = demo.format_summary(_demo_summary(top1)).split("\n")
    header, rule = lines[1], lines[2]
    assert set(rule) == {"-"}
    assert header.split()[-3:] == ["mixed_float16", "vs", "float32"]
    body = lines[3:lines.index(rule, 3)]
    assert lines[lines.index(rule, 3)] == rule  # the closing rule
    widths = [len(text) for text in [header, *body]]
    assert max(widths) == len(rule)
    assert all(text == text.rstrip() for text in [header, *body])


def test_vendored_digits_match_scikit_learn():
    (x, y), (x_test, y_test) = load_digits()
    assert x.shape == (1438, 8, 8, 1) and x_test.shape == (359, 8, 8, 1)
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert 0.0 <= x.min() and x.max() == 1.0
    counts = np.bincount(y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # stratified
    # Same split for the same seed, another for another seed.
    (x2, _), _ = load_digits()
    np.testing.assert_array_equal(x, x2)
    (x3, _), _ = load_digits(seed=1)
    assert not np.array_equal(x, x3)
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    reference = sklearn_datasets.load_digits()
    ours = np.concatenate([x, x_test])[..., 0] * 16.0
    labels = np.concatenate([y, y_test])

    def rows(images, targets):
        flat = np.concatenate([images.reshape(len(images), -1),
                               targets[:, None]], axis=1)
        return flat[np.lexsort(flat.T[::-1])]

    np.testing.assert_array_equal(
        rows(ours, labels), rows(reference.images, reference.target))


def test_load_digits_rejects_bad_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.5)


def _speed(policy, ratio, bf16, backend="tensorflow", device="cpu: x"):
    summary = _demo_summary()
    summary.update(config={"policy": policy}, time_ratio=ratio,
                   cpu_bf16_instructions=bf16, backend=backend,
                   device=device)
    return demo.format_summary(summary)


def test_demo_closing_line_follows_policy_cpu_and_measurement():
    # Issue 43: "on a CPU mixed precision is usually slower" was said even
    # where bfloat16 is faster.
    text = _speed("mixed_bfloat16", 0.8, bf16=True)
    assert "x0.80 float32's time: faster than float32" in text
    assert "This CPU has bfloat16 instructions" in text
    text = _speed("mixed_bfloat16", 1.1, bf16=True)
    assert "x1.10 float32's time: no faster than float32" in text
    assert "--preset cpu" in text
    assert "no bfloat16 instructions" in _speed("mixed_bfloat16", 1.3, False)
    assert "XLA" in _speed("mixed_bfloat16", 1.0, True, backend="jax")
    text = _speed("mixed_float16", 2.0, bf16=True)
    assert "float16 has no fast kernels on a CPU" in text
    assert "x2.00 float32's time" in _speed("mixed_float16", 2.0, True)
    # On a GPU the table's ratio says it all.
    assert "float32's time" not in _speed("mixed_float16", 0.5, True,
                                          device="gpu: H100")


def test_demo_table_says_the_growth_interval_with_the_scale():
    # Issue 44 item 9: dynamic_growth_steps=100 was only in summary.json.
    summary = _demo_summary()
    summary["runs"]["mixed"]["dynamic_growth_steps"] = 100
    text = demo.format_summary(summary)
    scale_row = next(line for line in text.split("\n")
                     if line.startswith("final loss scale"))
    assert "growth every 100 steps" in scale_row
