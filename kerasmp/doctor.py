"""`kerasmp doctor`: what this machine can do with mixed precision.

Reports versions, the Keras backend, the devices that backend sees, and the
policy to use here, with the reason. It never fails on a machine without an
accelerator: unknown facts are reported as unknown. The device lookup itself
lives in `kerasmp._devices` (shared with `PerformanceMonitor` and the apps).
"""

import dataclasses
import importlib.metadata
import json
import os
import platform
import sys

from kerasmp._devices import Device  # noqa: F401  (kerasmp.doctor.Device)
from kerasmp._devices import cpu_flags
from kerasmp._devices import visible_devices


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


def recommend(devices, backend="tensorflow"):
    """Returns `(policy_name, reason, warnings)` for the given devices.

    Args:
        devices: `Device`s, as `doctor()` finds them.
        backend: The Keras backend the advice is for.
    """
    warnings = []
    accel = [d for d in devices if d.kind in ("gpu", "tpu")]
    if not accel:
        if backend == "tensorflow" and any(
            d.bf16_instructions for d in devices
        ):
            warnings.append(
                "this CPU has bfloat16 instructions (AVX512_BF16/AMX) that "
                "TensorFlow's oneDNN kernels use: mixed_bfloat16 can train "
                "faster than float32 here (measured 1.4-1.5x for a CNN and a "
                "transformer, 0.94x for an MLP, on a 2-core AMD EPYC; see "
                "docs/benchmarks.md). Run `kerasmp bench` to measure your "
                "model; float16 stays slower on a CPU."
            )
        warnings.append(
            "no GPU or TPU: mixed precision is usually slower than float32 on "
            "a CPU (most CPU kernels convert float16/bfloat16 to float32 and "
            "back, so the casts are extra work); `kerasmp bench` measures it "
            "here. Use it on a CPU to test code you will run on a GPU."
        )
        return ("float32", "CPU only: float32 is the fastest policy here.",
                warnings)
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


def doctor():
    """Collects the report. Imports only the active Keras backend.

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
    }
    devices = visible_devices(backend)
    policy, reason, warnings = recommend(devices, backend)
    if "KERAS_BACKEND" not in os.environ and backend == "tensorflow":
        reason += " (backend: tensorflow, the default; set KERAS_BACKEND=jax" \
                  " to check the JAX backend)"
    return DoctorReport(versions, backend, devices, policy, reason, warnings)


def main(as_json=False):
    report = doctor()
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
    return 0
