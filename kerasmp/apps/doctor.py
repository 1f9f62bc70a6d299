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

from kerasmp._utils.devices import Device  # noqa: F401  (a doctor's Device)
from kerasmp._utils.devices import cpu_flags
from kerasmp._utils.devices import visible_devices


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
            return (f"CPU with {kinds} instructions (AMX/AVX-512); few "
                    "framework kernels use them")
        return "no float16/bfloat16 matrix units"
    cc = dev.compute_capability
    if cc is None:
        return "tensor cores: unknown (compute capability not reported)"
    if cc >= (8, 0):
        return "float16 and bfloat16 tensor cores"
    if cc >= (7, 0):
        return "float16 tensor cores (no bfloat16)"
    return "no tensor cores"


# A mixed policy is recommended on measurements only when it is at least
# this much faster than float32 on every model the benchmark ran.
MEASURED_MARGIN = 1.05


def from_bench(bench):
    """`(policy, reason)` from a `kerasmp bench` result, or None.

    The recommendation is the policy with the highest smallest speed-up over
    float32 across the benchmark's models, if that is at least
    `MEASURED_MARGIN`; else float32. None when the result has no float32
    baseline.

    Args:
        bench: The dict `kerasmp.apps.bench.run_bench` returns (or its
            `--json` file, loaded).
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

    best = max(by_policy, key=lambda p: min(by_policy[p].values()))
    measured = "; ".join(f"{p}: {speeds(p)}" for p in sorted(by_policy))
    device = bench.get("device") or "this device"
    source = f"measured by kerasmp bench on {device}"
    if min(by_policy[best].values()) >= MEASURED_MARGIN:
        return best, (f"{source}, steps/s vs float32: {measured}. {best} "
                      "was the fastest on every model.")
    return "float32", (f"{source}, steps/s vs float32: {measured}. No mixed "
                       f"policy was at least {MEASURED_MARGIN:g}x faster on "
                       "every model.")


def recommend(devices, backend="tensorflow", bench=None):
    """Returns `(policy_name, reason, warnings)` for the given devices.

    Without `bench`, the advice rests on the devices alone (and says so);
    with a `kerasmp bench` result it rests on those measurements.

    Args:
        devices: `Device`s, as `doctor()` finds them.
        backend: The Keras backend the advice is for.
        bench: Optional `kerasmp bench` result (dict) measured here.
    """
    warnings = []
    accel = [d for d in devices if d.kind in ("gpu", "tpu")]
    measured = from_bench(bench) if bench else None
    if not accel:
        if measured is not None:
            return measured[0], measured[1], warnings
        reason = ("CPU only, nothing measured here: float32 is the safe "
                  "default, as mixed precision is usually slower than "
                  "float32 on a CPU (most CPU kernels convert "
                  "float16/bfloat16 to float32 and back).")
        if backend == "tensorflow" and any(
            d.bf16_instructions for d in devices
        ):
            reason += (
                " This CPU has bfloat16 instructions (AVX512_BF16/AMX) that "
                "TensorFlow's oneDNN kernels use, where mixed_bfloat16 has "
                "trained faster than float32: 1.4-1.5x for a CNN and a "
                "transformer, 0.94x for an MLP, on another machine "
                "(docs/benchmarks.md). To decide on this machine's numbers: "
                "`kerasmp bench --quick --json bench.json`, then `kerasmp "
                "doctor --bench bench.json`."
            )
        else:
            reason += " `kerasmp bench` measures it here."
        warnings.append(
            "no GPU or TPU: use mixed precision on a CPU to test code you "
            "will run on a GPU; float16 stays slower on a CPU."
        )
        return ("float32", reason, warnings)
    if measured is not None:
        return measured[0], measured[1], warnings
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
