"""`kerasmp doctor`: what this machine can do with mixed precision.

Reports versions, the Keras backend, the devices that backend sees, and the
policy to use here, with the reason. It never fails on a machine without an
accelerator: unknown facts are reported as unknown. The device lookup itself
lives in `kerasmp._utils.devices` (shared with `PerformanceMonitor` and the
apps).
"""

import dataclasses
import importlib.metadata
import json
import os
import platform
import sys

from kerasmp._utils.cpu_speed import WHERE
from kerasmp._utils.cpu_speed import measured
from kerasmp._utils.devices import Device  # noqa: F401  (a doctor's Device)
from kerasmp._utils.devices import cpu_flags
from kerasmp._utils.devices import visible_devices
from kerasmp._utils.requires import require_backend


@dataclasses.dataclass
class DoctorReport:
    """Result of `doctor()`. `str()` is the human report, `to_dict()` JSON."""

    versions: dict
    backend: str
    devices: list
    recommended_policy: str
    reason: str
    warnings: list

    def to_dict(self):
        d = dataclasses.asdict(self)
        for dev in d["devices"]:
            cc = dev["compute_capability"]
            dev["compute_capability"] = ".".join(map(str, cc)) if cc else None
        return d

    def __str__(self):
        lines = ["kerasmp doctor", ""]
        for k, v in self.versions.items():
            lines.append(f"  {k:<12} {v}")
        lines.append(f"  {'backend':<12} {self.backend}")
        lines.append("")
        lines.append("devices:")
        for dev in self.devices:
            cc = dev.compute_capability
            extra = f" (compute capability {cc[0]}.{cc[1]})" if cc else ""
            lines.append(f"  {dev.kind}: {dev.name}{extra}")
            lines.append(f"       {_tensor_cores(dev)}")
        lines.append("")
        lines.append(f"recommended policy: {self.recommended_policy}")
        lines.append(f"  why: {self.reason}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _tensor_cores(dev):
    if dev.kind == "tpu":
        return "bfloat16 matrix units"
    if dev.kind == "cpu":
        flags = cpu_flags()
        bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
        fp16 = "amx_fp16" in flags or "avx512_fp16" in flags
        if bf16 or fp16:
            kinds = "/".join(k for k, ok in (("bf16", bf16), ("fp16", fp16))
                             if ok)
            used = ("TensorFlow's oneDNN and PyTorch's kernels use the "
                    "bf16 ones for matrix products and convolutions (not "
                    "XLA's, so not JAX's)" if bf16 else
                    "few framework kernels use them")
            return f"CPU with {kinds} instructions (AMX/AVX-512); {used}"
        return "no float16/bfloat16 matrix units"
    cc = dev.compute_capability
    if cc is None:
        return "tensor cores: unknown (compute capability not reported)"
    if cc >= (8, 0):
        return "float16 and bfloat16 tensor cores"
    if cc >= (7, 0):
        return "float16 tensor cores (no bfloat16)"
    return "no tensor cores"


# Below this speed-up over float32 a measured difference may be noise: the
# recommendation stands, with a caveat.
NOISE_MARGIN = 1.05
_TINY_PRESETS = ("quick", "smoke")


def _geomean(values):
    values = list(values)
    product = 1.0
    for v in values:
        product *= v
    return product ** (1.0 / len(values))


def from_bench(bench):
    """`(policy, reason)` from a `kerasmp bench` result, or None.

    The recommendation is the policy that measured fastest: the highest
    speed-up over float32 (its geometric mean over the benchmark's models),
    if that is above 1; else float32. The reason gives each policy's ratios,
    and says when the best one is within `NOISE_MARGIN` of float32, slower
    on one of the models, or measured on the tiny `quick`/`smoke` models
    only. None when the result has no float32 baseline.

    Args:
        bench: The dict `kerasmp.apps.bench.run_bench` returns (or its
            `--json` file, loaded).

    Example:

    >>> rows = [{"model": "cnn", "policy": "float32",
    ...          "speedup_vs_baseline": 1.0},
    ...         {"model": "cnn", "policy": "mixed_bfloat16",
    ...          "speedup_vs_baseline": 1.4}]
    >>> from_bench({"baseline": "float32", "rows": rows})[0]
    'mixed_bfloat16'
    """
    rows = bench.get("rows") or []
    if bench.get("baseline") != "float32":
        return None
    by_policy = {}
    for row in rows:
        ratio = row.get("speedup_vs_baseline")
        if row.get("policy") != "float32" and ratio is not None:
            by_policy.setdefault(row["policy"], {})[row["model"]] = ratio
    if not by_policy:
        return None

    def speeds(policy):
        return ", ".join(f"{m} x{r:.2f}"
                         for m, r in sorted(by_policy[policy].items()))

    best = max(by_policy, key=lambda p: _geomean(by_policy[p].values()))
    ratio = _geomean(by_policy[best].values())
    measured = "; ".join(f"{p}: {speeds(p)}" for p in sorted(by_policy))
    device = bench.get("device") or "this device"
    source = f"measured by kerasmp bench on {device}"
    caveats = []
    if bench.get("preset") in _TINY_PRESETS and not bench.get("user_model"):
        caveats.append(
            f"the {bench['preset']!r} preset's models are tiny and no guide "
            "to a real model's speed: `kerasmp bench --preset cpu` (a "
            "width-256 transformer and a CNN) or `kerasmp bench --model "
            "model.keras` measures one")
    if ratio <= 1.0:
        return "float32", (
            f"{source}, steps/s vs float32: {measured}. No mixed policy was "
            "faster than float32." + "".join(f" Note: {c}." for c in caveats))
    slower = sorted(m for m, r in by_policy[best].items() if r < 1.0)
    if slower:
        caveats.append(f"{best} was slower than float32 on "
                       f"{', '.join(slower)}")
    if ratio < NOISE_MARGIN:
        caveats.append(f"within {NOISE_MARGIN - 1:.0%} of float32, which "
                       "may be noise: rerun with more --repeats")
    return best, (f"{source}, steps/s vs float32: {measured}. {best} was "
                  f"the fastest: x{ratio:.2f} float32's steps/s"
                  + (" (geometric mean over the models)"
                     if len(by_policy[best]) > 1 else "") + "."
                  + "".join(f" Note: {c}." for c in caveats))


def _cpu_advice(devices, backend):
    """`(policy, reason, warnings)` for a CPU-only machine, unmeasured."""
    bf16 = any(d.bf16_instructions for d in devices)
    check = ("To decide on this machine's numbers: `kerasmp bench --preset "
             "cpu --json bench.json` (or `--model model.keras` for your "
             "own), then `kerasmp doctor --bench bench.json`.")
    half = ("float16 has no fast kernels on a CPU: use mixed_float16 here "
            "only to test code you will run on a GPU.")
    if not bf16:
        return "float32", (
            "CPU only, without bfloat16 instructions (no avx512_bf16 or "
            "amx_bf16 in /proc/cpuinfo): float32 is the fastest here, as "
            "most CPU kernels convert float16/bfloat16 to float32 and back. "
            "`kerasmp bench` measures it."), [half]
    tf_row = measured("tensorflow")
    if backend == "jax":
        jax_row = measured("jax")
        return "float32", (
            "CPU with bfloat16 instructions (AVX512_BF16/AMX), but on JAX "
            "XLA's CPU compiler computes bfloat16 matrix products in float32"
            f", so mixed_bfloat16 gains nothing: measured "
            f"{jax_row.describe()}. The TensorFlow backend trained "
            f"{tf_row.describe()} ({WHERE}). " + check), [half]
    row = measured(backend) or tf_row
    reason = (
        "CPU with bfloat16 instructions (AVX512_BF16/AMX), which "
        + ("TensorFlow's oneDNN kernels" if backend == "tensorflow"
           else "PyTorch's CPU kernels")
        + " use for bfloat16 matrix products and convolutions: "
        f"mixed_bfloat16 is likely faster than float32 here. Measured "
        f"with compile's defaults: {row.describe()} ({WHERE}). " + check)
    if backend == "tensorflow":
        jit = measured("tensorflow", "jit")
        reason += (" Keep compile's default jit_compile: jit_compile=True "
                   "(XLA) computes bfloat16 products in float32, measured "
                   f"{jit.describe()}.")
    return "mixed_bfloat16", reason, [half]


def recommend(devices, backend="tensorflow", bench=None):
    """Returns `(policy_name, reason, warnings)` for the given devices.

    Without `bench`, the advice rests on the devices alone, and on a CPU on
    kerasmp's recorded measurements (`kerasmp._utils.cpu_speed`); with a
    `kerasmp bench` result it rests on those measurements.

    Args:
        devices: `Device`s, as `doctor()` finds them.
        backend: The Keras backend the advice is for.
        bench: Optional `kerasmp bench` result (dict) measured here.
    """
    warnings = []
    accel = [d for d in devices if d.kind in ("gpu", "tpu")]
    measured_here = from_bench(bench) if bench else None
    if not accel:
        if measured_here is not None:
            return measured_here[0], measured_here[1], warnings
        return _cpu_advice(devices, backend)
    if measured_here is not None:
        return measured_here[0], measured_here[1], warnings
    dev = accel[0]
    if dev.kind == "tpu":
        return ("mixed_bfloat16", "TPU matrix units run bfloat16 natively; "
                "bfloat16 needs no loss scaling.", warnings)
    cc = dev.compute_capability
    if cc is None:
        warnings.append("GPU compute capability unknown; assuming tensor "
                        "cores are present.")
        return ("mixed_float16", "GPU of unknown generation: float16 with "
                "dynamic loss scaling works on every GPU.", warnings)
    if cc >= (8, 0):
        return ("mixed_bfloat16", f"{dev.name} (compute capability "
                f"{cc[0]}.{cc[1]}) has bfloat16 tensor cores; bfloat16 has "
                "float32's range, so it needs no loss scaling.", warnings)
    if cc >= (7, 0):
        return ("mixed_float16", f"{dev.name} (compute capability "
                f"{cc[0]}.{cc[1]}) has float16 tensor cores but no bfloat16; "
                "kerasmp adds dynamic loss scaling.", warnings)
    warnings.append(
        f"{dev.name} (compute capability {cc[0]}.{cc[1]}) is below 7.0: no "
        "tensor cores, so mixed precision saves memory but not time."
    )
    return ("float32", "GPU without tensor cores: float32 is as fast.",
            warnings)


def doctor(bench=None):
    """Collects the report. Imports only the active Keras backend.

    Args:
        bench: Optional result of `kerasmp bench` on this machine (the dict,
            or the path of its `--json` file): the recommendation then rests
            on those measurements.

    Returns:
        A `DoctorReport`.

    Example:

    >>> print(kerasmp.doctor())
    """
    require_backend()  # one line naming the extra, not Keras's traceback
    import keras

    backend = keras.backend.backend()
    versions = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "kerasmp": _version("kerasmp"),
        "keras": keras.__version__,
        "tensorflow": _version("tensorflow"),
        "jax": _version("jax"),
        "torch": _version("torch"),
    }
    if isinstance(bench, (str, os.PathLike)):
        with open(bench, encoding="utf-8") as f:
            bench = json.load(f)
    devices = visible_devices(backend)
    policy, reason, warnings = recommend(devices, backend, bench)
    if "KERAS_BACKEND" not in os.environ and backend == "tensorflow":
        reason += (" Backend: tensorflow, the default; set KERAS_BACKEND=jax"
                   " or torch to check the JAX or PyTorch backend.")
    return DoctorReport(versions, backend, devices, policy, reason, warnings)


def main(as_json=False, bench=None):
    report = doctor(bench)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return 0
