"""kerasmp.doctor and `kerasmp doctor`: never fails on a CPU box, advice
follows the hardware or, given a `kerasmp bench` file, the measurements."""

import json

import pytest

from kerasmp.apps.cli import main
from kerasmp.apps.doctor import Device
from kerasmp.apps.doctor import recommend


@pytest.mark.parametrize(
    "device, policy, warned",
    [
        (Device("cpu", "some cpu"), "float32", "to test code you will run"),
        (Device("gpu", "H100", (9, 0)), "mixed_bfloat16", None),
        (Device("gpu", "A100", (8, 0)), "mixed_bfloat16", None),
        (Device("gpu", "V100", (7, 0)), "mixed_float16", None),
        (Device("gpu", "T4", (7, 5)), "mixed_float16", None),
        (Device("gpu", "P100", (6, 0)), "float32", "no tensor cores"),
        (Device("tpu", "TPU v4"), "mixed_bfloat16", None),
    ],
)
def test_recommendation_follows_compute_capability(device, policy, warned):
    name, reason, warnings = recommend([device])
    assert name == policy
    assert reason
    if warned:
        assert any(warned in w for w in warnings)
    else:
        assert warnings == []


def test_cpu_with_bf16_instructions_recommends_bfloat16_unmeasured():
    # Issue 43: on a bfloat16 CPU mixed_bfloat16 trains 1.5-2x faster than
    # float32 on TensorFlow and PyTorch with compile's defaults.
    cpu = Device("cpu", "cpu", bf16_instructions=True)
    for backend in ("tensorflow", "torch"):
        policy, reason, warnings = recommend([cpu], backend=backend)
        assert policy == "mixed_bfloat16"
        assert "likely faster" in reason  # not measured on this machine
        assert "kerasmp doctor --bench bench.json" in reason  # how to check
        assert "float16 has no fast kernels" in warnings[0]
    # On TensorFlow, which setting keeps it.
    _, reason, _ = recommend([cpu], backend="tensorflow")
    assert "jit_compile=True" in reason
    # JAX: XLA's CPU dots run in float32, so no speed: float32, saying why.
    policy, reason, _ = recommend([cpu], backend="jax")
    assert policy == "float32"
    assert "XLA" in reason and "in float32" in reason
    # Without bfloat16 instructions: float32 everywhere.
    plain = Device("cpu", "cpu")
    for backend in ("tensorflow", "torch", "jax"):
        assert recommend([plain], backend=backend)[0] == "float32"


def _bench(ratios):
    """A `kerasmp bench --json` result: float32 and mixed_bfloat16 rows,
    the latter at `ratios` ({model: speed-up})."""
    rows = [{"model": m, "policy": "float32", "speedup_vs_baseline": 1.0}
            for m in ratios]
    rows += [{"model": m, "policy": "mixed_bfloat16", "speedup_vs_baseline": r}
             for m, r in ratios.items()]
    return {"baseline": "float32", "device": "a CPU", "rows": rows}


def test_doctor_recommends_on_bench_measurements():
    cpu = [Device("cpu", "cpu", bf16_instructions=True)]
    # The issue's `bench --quick`: mixed_bfloat16 1.57x and 1.15x float32.
    policy, reason, _ = recommend(
        cpu, bench=_bench({"transformer": 1.57, "mlp": 1.15}))
    assert policy == "mixed_bfloat16"
    assert "measured by kerasmp bench" in reason
    assert "mlp x1.15" in reason and "transformer x1.57" in reason
    assert "the fastest: x1.34" in reason  # geometric mean of the two
    # Faster overall, slower on one model: recommended, with the caveat.
    policy, reason, _ = recommend(
        cpu, bench=_bench({"transformer": 1.57, "mlp": 0.94}))
    assert policy == "mixed_bfloat16"
    assert "mlp x0.94" in reason and "slower than float32 on mlp" in reason
    # Slower overall: float32, saying why.
    policy, reason, _ = recommend(
        cpu, bench=_bench({"transformer": 0.98, "mlp": 0.94}))
    assert policy == "float32"
    assert "No mixed policy was faster" in reason


def test_doctor_bench_file_with_bfloat16_above_1_recommends_it(tmp_path,
                                                              capsys):
    # Issue 43: a bench whose mixed_bfloat16 ratio is above 1, as the cpu
    # preset measured on a bfloat16 CPU: the doctor recommends it, with
    # the ratio; a ratio within noise of 1 says so.
    cpu = [Device("cpu", "cpu", bf16_instructions=True)]
    bench = dict(_bench({"transformer": 1.98, "cnn": 1.52}), preset="cpu")
    policy, reason, _ = recommend(cpu, backend="torch", bench=bench)
    assert policy == "mixed_bfloat16"
    assert "x1.73 float32's steps/s" in reason
    assert "Note" not in reason
    policy, reason, _ = recommend(cpu, bench=_bench({"cnn": 1.02}))
    assert policy == "mixed_bfloat16"
    assert "may be noise" in reason
    # The quick preset's tiny models: the doctor says they are no guide.
    bench = dict(_bench({"mlp": 0.98, "cnn": 1.01}), preset="quick")
    policy, reason, _ = recommend(cpu, bench=bench)
    assert "no guide" in reason and "--preset cpu" in reason


def test_doctor_bench_flag_reads_a_bench_file(tmp_path, capsys):
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


def test_cli_doctor_json_on_this_machine(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"versions", "backend", "devices", "recommended_policy",
            "reason", "warnings"} <= set(report)
    assert report["devices"]
    assert report["versions"]["keras"].startswith("3.")


def test_cli_doctor_text(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "recommended policy:" in out


def test_one_device_lookup_for_doctor_and_the_apps():
    import keras

    import kerasmp
    from kerasmp._utils import devices as _devices

    report = kerasmp.doctor()
    assert _devices.main_device() == report.devices[0]
    assert _devices.visible_devices(keras.backend.backend()) == report.devices
    if report.devices[0].kind == "cpu":
        # The name /proc/cpuinfo gives, read here independently.
        try:
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")]
        except OSError:
            names = []
        if names:
            assert report.devices[0].name == names[0]


def test_device_helpers_fall_back_to_the_cpu(monkeypatch):
    from kerasmp._utils import devices as _devices

    devices = _devices.visible_devices("no-such-backend")
    assert [d.kind for d in devices] == ["cpu"]
    monkeypatch.setattr(_devices, "cpu_name", lambda: "test cpu")
    assert _devices.visible_devices("no-such-backend")[0].name == "test cpu"
