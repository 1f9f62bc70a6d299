"""The choices and defaults of `kerasmp demo` and `kerasmp bench`.

Standard library only: the `kerasmp` command offers them before it imports
Keras, and `demo.py`, `bench.py` and `zoo.py` take them from here. The export
formats and dtypes live with the formats, in `kerasmp.export.specs`.
"""

DEMO_POLICIES = ("mixed_float16", "mixed_bfloat16")
DEMO_DEFAULT_EPOCHS = 12
DEMO_QUICK_EPOCHS = 2

BENCH_MODELS = ("mlp", "cnn", "transformer")
BENCH_POLICIES = ("float32", "float32_highest", "mixed_float16",
                  "mixed_bfloat16", "float8_mixed_bfloat16")
BENCH_DEFAULT_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# On a CPU: the policies a CPU can run fast. float16 has no fast CPU kernels
# (PyTorch's float16 matmuls 35-70x slower than float32, TensorFlow's
# float16 convolutions 100x+): `--policies` still asks for it.
BENCH_CPU_POLICIES = ("float32", "mixed_bfloat16")

# Each preset: its models with their sizes (the fields of
# `kerasmp.apps.zoo.ModelSpec` after `name`), steps per timed call and timed
# calls per model and policy.
BENCH_PRESETS = {
    # CPU smoke run: the whole zoo in well under two minutes on 2 cores.
    "quick": dict(
        models={
            "mlp": dict(batch_size=64, width=256, depth=2, input_size=128),
            "cnn": dict(batch_size=16, width=16, depth=2, input_size=16),
            "transformer": dict(batch_size=8, width=64, depth=1,
                                input_size=32, heads=4, dropout=0.1),
        },
        steps=10, repeats=3,
    ),
    # Default: a few minutes on a laptop CPU, seconds on a GPU.
    "default": dict(
        models={
            "mlp": dict(batch_size=256, width=1024, depth=3, input_size=784),
            "cnn": dict(batch_size=64, width=32, depth=3, input_size=32),
            "transformer": dict(batch_size=16, width=256, depth=2,
                                input_size=128, heads=8, dropout=0.1,
                                vocab=8192),
        },
        steps=20, repeats=5,
    ),
    # A CPU, at the widths of real models (bfloat16's speed on a CPU with
    # AVX512_BF16/AMX shows there; the quick preset's tiny models measure
    # their overhead): a 2-block transformer of width 256 and a CNN of
    # 64-128-256 filters on 32x32 images: a few minutes on 2 cores.
    "cpu": dict(
        models={
            "transformer": dict(batch_size=32, width=256, depth=2,
                                input_size=64, heads=4, vocab=1024),
            "cnn": dict(batch_size=32, width=64, depth=3, input_size=32),
        },
        steps=10, repeats=3,
    ),
    # One GPU: a transformer encoder that keeps the chip busy (64k tokens a
    # step, ~22 TFLOP per step: about half a second in float32 "highest" on
    # an H100/H200, well under a tenth in bfloat16).
    "gpu": dict(
        models={
            "transformer": dict(batch_size=128, width=1024, depth=4,
                                input_size=512, heads=16, vocab=32768),
        },
        steps=15, repeats=3,
    ),
    # The gpu preset's code path at CPU size (tests of benchmarks/gpu).
    "smoke": dict(
        models={
            "transformer": dict(batch_size=4, width=64, depth=1,
                                input_size=16, heads=4, dropout=0.1,
                                vocab=128),
        },
        steps=3, repeats=2,
    ),
}
