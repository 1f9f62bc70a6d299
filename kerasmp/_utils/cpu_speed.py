"""How fast bfloat16 trains on a CPU, as measured, and which settings lose it.

CPUs with bfloat16 instructions (`avx512_bf16` or `amx_bf16` in
`/proc/cpuinfo`: AMD Zen 4 and later, Intel Xeon since Cooper Lake) run
bfloat16 matrix products and convolutions faster than float32 in
TensorFlow's oneDNN kernels and PyTorch's. XLA's CPU compiler does not: it
computes bfloat16 dots in float32 and converts around them, so a compiled
graph (JAX always; TensorFlow with `jit_compile=True`) gets no speed from
bfloat16 and pays for the conversions.

The figures are ratios of steps per second, mixed_bfloat16 (kerasmp) over
float32, from one run of `benchmarks/cpu_bfloat16.py` per CPU family
(docs/benchmarks.md, "bfloat16 on a CPU"): a 2-block causal transformer of
width 256 and a 3-convolution CNN with batch norm. `kerasmp doctor` and the
compile warning (`kerasmp.policy.speed`) quote them; `kerasmp bench`
measures the user's own machine and model.

Standard library only: `kerasmp doctor` imports it before any framework.
"""

import dataclasses

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
BENCHMARK = "benchmarks/cpu_bfloat16.py"
WHERE = "benchmarks/cpu_bfloat16.py; kerasmp's docs/benchmarks.md"


@dataclasses.dataclass(frozen=True)
class Speedup:
    """mixed_bfloat16's steps/s over float32's, measured on one CPU.

    Attributes:
        backend: `"tensorflow"`, `"torch"` or `"jax"`.
        setting: `"default"` (`compile()`'s defaults) or `"jit"`
            (`jit_compile=True`).
        transformer: The ratio on the width-256 transformer.
        cnn: The ratio on the CNN with batch norm.
        cpu: The CPU it was measured on.
    """

    backend: str
    setting: str
    transformer: float
    cnn: float
    cpu: str

    def describe(self):
        return (f"{self.transformer:.2f}x on a width-256 transformer and "
                f"{self.cnn:.2f}x on a CNN with batch norm ({self.cpu})")

    def pair(self):
        return (f"{self.transformer:.2f}x (transformer) and "
                f"{self.cnn:.2f}x (CNN)")


_XEON = "Intel Xeon with AMX, 2026-12-07"

# One row per backend and setting, from `benchmarks/cpu_bfloat16.py
# --threads 1` (CPU time per step; kerasmp's mixed_bfloat16 over float32).
MEASURED = (
    Speedup("tensorflow", "default", 1.85, 1.15, _XEON),
    Speedup("tensorflow", "jit", 0.89, 0.96, _XEON),
    Speedup("torch", "default", 1.42, 1.19, _XEON),
    Speedup("jax", "default", 0.91, 0.93, _XEON),
)


def has_bf16_instructions(flags):
    """Whether CPU `flags` (a set of `/proc/cpuinfo` flags) include
    bfloat16 instructions."""
    return any(flag in flags for flag in BF16_FLAGS)


def measured(backend, setting="default"):
    """The `Speedup` recorded for `backend` and `setting`, or None."""
    for row in MEASURED:
        if row.backend == backend and row.setting == setting:
            return row
    return None


def slow_setting(backend, jit_compile, compute_dtypes, device_kind, flags):
    """Why this compile setting loses bfloat16's speed on this CPU, or None.

    Today one setting does: an explicit `jit_compile=True` on TensorFlow
    (XLA) on a CPU with bfloat16 instructions, for a model that computes in
    bfloat16. Keras's own default (`jit_compile="auto"`) turns XLA off on a
    machine without an accelerator, which is the fast setting there.

    Args:
        backend: The Keras backend.
        jit_compile: The model's resolved `jit_compile` (after `compile`).
        compute_dtypes: The compute dtypes of the model's layers.
        device_kind: `"cpu"`, `"gpu"` or `"tpu"`: the device it runs on.
        flags: The CPU's feature flags.

    Returns:
        A sentence for the user, or None when nothing is lost.

    Example:

    >>> slow_setting("tensorflow", True, {"bfloat16"}, "cpu",
    ...              {"avx512_bf16"}) is not None
    True
    """
    if (backend != "tensorflow" or jit_compile is not True
            or "bfloat16" not in set(compute_dtypes) or device_kind != "cpu"
            or not has_bf16_instructions(flags)):
        return None
    fast, slow = measured("tensorflow"), measured("tensorflow", "jit")
    return (
        "jit_compile=True compiles this mixed_bfloat16 model with XLA, whose "
        "CPU compiler computes bfloat16 matrix products in float32. "
        f"Measured on an {fast.cpu} ({BENCHMARK}), mixed_bfloat16 trained "
        f"at {slow.pair()} float32's speed with jit_compile=True, against "
        f"{fast.pair()} with jit_compile=False. For bfloat16's speed on a "
        "CPU, compile with jit_compile=False or leave compile's default "
        "('auto': no XLA on a CPU). kerasmp keeps jit_compile=True, as "
        "asked."
    )
