"""`kerasmp bench` and the GPU benchmark script, on a CPU.

No timing is asserted (speed belongs to the benchmark's own output): the
tests check the shape of the result, that the numbers are measurements
(finite, positive, losses finite), the activation memory against a hand
count, and that the GPU script runs without TensorFlow.
"""

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import keras
import pytest
from _helpers import slow_on

from kerasmp.apps import bench
from kerasmp.apps import cli
from kerasmp.apps.choices import BENCH_DEFAULT_POLICIES
from kerasmp.apps.choices import BENCH_MODELS

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPUTE = {"float32": "float32", "mixed_float16": "float16",
           "mixed_bfloat16": "bfloat16", "float32_highest": "float32"}


def _mlp_activation_bytes(spec, half):
    """Hand count for the MLP: input, hidden layers, logits, softmax."""
    b = spec.batch_size
    hidden = b * (spec.depth * spec.width + bench.NUM_CLASSES)
    return (4 * b * spec.input_size          # the float32 input batch
            + (2 if half else 4) * hidden    # dense layers, compute dtype
            + 4 * b * bench.NUM_CLASSES)     # softmax: float32 always


# `bench --quick` on both backends' passes is 2-3 minutes; JAX's in the
# default suite, TensorFlow's in CI's slow pass.
@slow_on("tensorflow")
def test_quick_json_has_a_row_per_model_and_policy(tmp_path, capsys):
    path = tmp_path / "out.json"
    # All three policies (on a CPU the default leaves float16 out).
    assert cli.main(["bench", "--quick", "--json", str(path), "--policies",
                     *BENCH_DEFAULT_POLICIES]) == 0
    printed = capsys.readouterr().out
    result = json.loads(path.read_text())

    assert result["backend"] == keras.backend.backend()
    assert result["preset"] == "quick" and result["baseline"] == "float32"
    pairs = [(r["model"], r["policy"]) for r in result["rows"]]
    assert sorted(pairs) == sorted(
        (m, p) for m in BENCH_MODELS for p in BENCH_DEFAULT_POLICIES)
    for r in result["rows"]:
        assert r["compute_dtype"] == COMPUTE[r["policy"]]
        assert len(r["steps_per_s_repeats"]) == r["repeats"] == 3
        assert all(math.isfinite(v) and v > 0
                   for v in r["steps_per_s_repeats"])
        assert min(r["steps_per_s_repeats"]) <= r["steps_per_s"] <= max(
            r["steps_per_s_repeats"])
        assert r["samples_per_s"] == pytest.approx(
            r["steps_per_s"] * r["batch_size"])
        assert r["loss_finite"], r
        assert r["params"] > 0
        if r["policy"] == "mixed_float16":
            assert r["loss_scale"] >= 1.0
        else:
            assert r["loss_scale"] is None

    rows = {(r["model"], r["policy"]): r for r in result["rows"]}
    spec = next(s for s in bench.PRESETS["quick"]["models"]
                if s.name == "mlp")
    assert rows["mlp", "float32"]["activation_bytes"] == \
        _mlp_activation_bytes(spec, half=False)
    for policy in ("mixed_float16", "mixed_bfloat16"):
        assert rows["mlp", policy]["activation_bytes"] == \
            _mlp_activation_bytes(spec, half=True)
    for model in BENCH_MODELS:
        base = rows[model, "float32"]
        assert base["speedup_vs_baseline"] == 1.0
        for policy in ("mixed_float16", "mixed_bfloat16"):
            r = rows[model, policy]
            # Half-precision activations between layers; float32 only
            # for the inputs and the probabilities the loss gets. The MLP
            # is counted exactly above; its float32 share is larger.
            ratio = r["activation_ratio_vs_baseline"]
            assert 0.5 <= ratio <= (0.65 if model == "mlp" else 0.55), (
                model, policy, ratio)
            assert r["speedup_vs_baseline"] == pytest.approx(
                r["steps_per_s"] / base["steps_per_s"])
            assert r["params"] == base["params"]

    if keras.backend.backend() == "jax":
        # XLA's memory plan holds at least the float32 weights.
        for r in result["rows"]:
            assert r["peak_bytes"] >= 4 * r["params"]
            assert r["peak_source"].startswith("XLA")
    else:
        assert all(r["peak_bytes"] is None for r in result["rows"])
    # On a CPU: doctor's advice, in the JSON and printed.
    assert result["device_kind"] == "cpu"
    # The advice rests on this run's own measurements (issue 19: doctor
    # recommended float32 "as the fastest" while bench measured bfloat16
    # faster), and the printed reason has no doubled brackets.
    from kerasmp.apps.doctor import from_bench

    expected, reason = from_bench(result)
    assert result["advice"]["recommended_policy"] == expected
    assert result["advice"]["reason"].startswith(reason)
    assert f"doctor: recommended policy here: {expected}: measured" in printed
    assert "))" not in printed
    for header in ("steps/s", "act MiB", "peak MiB", "vs f32"):
        assert header in printed
    assert "memory: activation_bytes" in printed


@pytest.mark.parametrize(
    "kwargs, argname",
    [
        ({"preset": "huge"}, "preset"),
        ({"policies": ["float32", "float32"]}, "policies"),
        ({"run_order": ["float32"]}, "run_order"),
        ({"models": ["resnet"]}, "models"),
        ({"policies": ["float8"]}, "policies"),
        ({"steps": 1}, "steps"),
        ({"repeats": 0}, "repeats"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, argname):
    with pytest.raises(ValueError, match=argname):
        bench.run_bench(**{"preset": "quick", **kwargs}, verbose=False)


@pytest.mark.slow  # a minute: benchmarks/gpu in a TensorFlow-free process
def test_gpu_script_runs_without_tensorflow(tmp_path):
    """benchmarks/gpu/run.sh --smoke: the GPU code path at CPU size.

    TensorFlow is made unimportable (a stub package that raises ImportError
    first on the path), as on a machine with only JAX installed.
    """
    if keras.backend.backend() != "jax":
        pytest.skip("the GPU script runs the JAX backend (JAX test run)")
    pytest.importorskip("jax")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    stub = tmp_path / "no_tensorflow" / "tensorflow"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ImportError('tensorflow is not installed (test stub)')\n")
    out = tmp_path / "gpu"
    env = dict(os.environ)
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(stub.parent)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), str(out),
         "--smoke"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["tensorflow_imported"] is False
    assert result["complete"] is True
    assert result["backend"] == "jax"
    assert result["baseline"] == "float32_highest"
    assert [r["policy"] for r in result["rows"]] == [
        "float32_highest", "float32", "mixed_bfloat16", "mixed_float16"]
    assert all(r["model"] == "transformer" and r["loss_finite"]
               for r in result["rows"])
    table = (out / "table.txt").read_text()
    assert "vs f32_highest" in table and "mixed_bfloat16" in table
    assert "jax" in (out / "env.txt").read_text()


def test_gpu_preset_is_gpu_scale():
    spec, = bench.PRESETS["gpu"]["models"]
    assert spec.name == "transformer" and spec.width >= 1024
    assert spec.dropout == 0.0  # the fused attention path on a GPU
