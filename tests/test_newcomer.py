"""A newcomer's first hour (issue 19): diagnostics that agree with each other,
commands that behave like Unix tools, a demo that refuses a missing parent."""

import keras
import numpy as np
import pytest

import kerasmp
from kerasmp.debug import find_nonfinite


def _mixed_model():
    kerasmp.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    return model


@pytest.mark.parametrize("stock", [False, True])
def test_find_nonfinite_uses_the_optimizers_scale_before_the_first_fit(stock):
    model = _mixed_model()
    if stock:
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(), initial_scale=1024.0
        )
        expected = 1024.0
    else:
        optimizer = "adam"  # compile wraps it: kerasmp.LossScaleOptimizer
        expected = 2.0**15
    model.compile(optimizer, "sparse_categorical_crossentropy")
    assert not model.optimizer.built  # before the first step
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    y = np.array([0, 1, 2, 0])
    report = find_nonfinite(model, x, y)
    assert report.loss_scale == expected
    assert f"gradients of loss x {expected:.3g}" in str(report)
    # Same gradients as asking for that scale explicitly.
    explicit = find_nonfinite(model, x, y, loss_scale=expected)
    assert [r.grad_max_abs for r in report.rows] == [
        r.grad_max_abs for r in explicit.rows
    ]
    if not stock:
        assert report.loss_scale == model.optimizer.loss_scale


def _bench(ratios):
    rows = [{"model": m, "policy": "float32", "speedup_vs_baseline": 1.0}
            for m in ratios]
    rows += [{"model": m, "policy": "mixed_bfloat16", "speedup_vs_baseline": r}
             for m, r in ratios.items()]
    return {"baseline": "float32", "device": "a CPU", "rows": rows}


def test_doctor_recommends_on_bench_measurements():
    from kerasmp.doctor import Device
    from kerasmp.doctor import recommend

    cpu = [Device("cpu", "cpu", bf16_instructions=True)]
    # The issue's `bench --quick`: mixed_bfloat16 1.57x and 1.15x float32.
    policy, reason, _ = recommend(
        cpu, bench=_bench({"transformer": 1.57, "mlp": 1.15}))
    assert policy == "mixed_bfloat16"
    assert "measured by kerasmp bench" in reason
    assert "mlp x1.15" in reason and "transformer x1.57" in reason
    # Slower on one model: float32, saying why.
    policy, reason, _ = recommend(
        cpu, bench=_bench({"transformer": 1.57, "mlp": 0.94}))
    assert policy == "float32"
    assert "mlp x0.94" in reason and "No mixed policy" in reason


def test_doctor_bench_flag_reads_a_bench_file(tmp_path, capsys):
    import json

    from kerasmp.apps.cli import main

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_bench({"cnn": 1.3})))
    assert main(["doctor", "--json", "--bench", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    if not any(d["kind"] in ("gpu", "tpu") for d in report["devices"]):
        assert report["recommended_policy"] == "mixed_bfloat16"
        assert "cnn x1.30" in report["reason"]
    (tmp_path / "bad.json").write_text("[1]")
    assert main(["doctor", "--bench", str(tmp_path / "bad.json")]) == 2
    assert "--bench" in capsys.readouterr().err


def test_misspelt_flag_points_at_the_subcommands_help(capsys):
    from kerasmp.apps.cli import main

    with pytest.raises(SystemExit) as e:
        main(["doctor", "--jsn"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "kerasmp doctor: error: unrecognized arguments: --jsn" in err
    assert "did you mean --json?" in err
    assert "(see 'kerasmp doctor --help')" in err


@pytest.mark.parametrize("command", ["doctor", "inspect"])
def test_a_closed_pipe_is_quiet(command, tmp_path, monkeypatch, capsys):
    """`kerasmp ... | head`: the reader closes the pipe; the command stops
    without a traceback or an 'internal error' line."""
    import io
    import os

    from kerasmp.apps.cli import main

    argv = [command, "--json"]
    if command == "inspect":
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.save(tmp_path / "m.keras")
        argv.append(str(tmp_path / "m.keras"))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`head`) has exited
    stdout = io.TextIOWrapper(os.fdopen(write_end, "wb"), write_through=False)
    monkeypatch.setattr("sys.stdout", stdout)
    status = main(argv)
    assert status == 141
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err, err


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
    from kerasmp.apps.demo import format_summary

    lines = format_summary(_demo_summary(top1)).split("\n")
    header, rule = lines[1], lines[2]
    assert set(rule) == {"-"}
    assert header.split()[-3:] == ["mixed_float16", "vs", "float32"]
    body = lines[3:lines.index(rule, 3)]
    assert lines[lines.index(rule, 3)] == rule  # the closing rule
    widths = [len(text) for text in [header, *body]]
    assert max(widths) == len(rule)
    assert all(text == text.rstrip() for text in [header, *body])


def test_demo_refuses_a_missing_parent_folder(tmp_path):
    from kerasmp.apps.cli import main
    from kerasmp.apps.demo import run_demo

    out = tmp_path / "missing" / "x"
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    with pytest.raises(ValueError, match="does not exist"):
        run_demo(out=out, quick=True, verbose=False)
    assert not (tmp_path / "missing").exists()


@pytest.mark.tensorflow  # runs a JAX subprocess; once is enough
def test_no_tensorflow_start_up_lines_on_jax(tmp_path):
    """On JAX, Keras still imports TensorFlow when it is installed
    (`set_random_seed`, saving); its C++ start-up lines (oneDNN, cuInit)
    must stay out of `kerasmp export` as they do on TensorFlow."""
    import subprocess
    import sys

    from _helpers import ROOT
    from _helpers import subprocess_env

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.save(tmp_path / "m.keras")
    env = subprocess_env("jax")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # as a user's shell has it
    proc = subprocess.run(
        [sys.executable, "-m", "kerasmp", "export", str(tmp_path / "m.keras"),
         str(tmp_path / "h.keras"), "--format", "keras"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "kerasmp export report" in proc.stdout
    for noise in ("I0000", "E0000", "W0000", "oneDNN", "InitializeLog",
                  "cuInit"):
        assert noise not in proc.stderr, proc.stderr


def test_pyproject_spdx_license_and_jax_extra():
    """setuptools deprecates a `license` table (builds stop on 2027-02-18);
    JAX users get an extra, and the README says how to install it."""
    tomllib = pytest.importorskip("tomllib")
    from _helpers import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    assert any(r.startswith("setuptools>=77")
               for r in project["build-system"]["requires"])
    jax = project["project"]["optional-dependencies"]["jax"]
    assert any(r.split(">")[0].split("[")[0] == "jax" for r in jax)
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "kerasmp[jax]"' in readme
    assert "KERAS_BACKEND=jax kerasmp demo" in readme
