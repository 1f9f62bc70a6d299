"""bfloat16 on a CPU: float32 vs stock and kerasmp `mixed_bfloat16`
(and, on PyTorch, native `torch.autocast`), per backend and compile setting.

Two models, built the same way on every backend:

- `transformer`: a causal decoder of 2 keras-hub `TransformerDecoder` blocks
  (width 256, 4 heads, feed-forward 1024, sequences of 64 tokens, batch 32,
  a vocabulary of 1,024), token and position embeddings, next-token loss;
- `cnn`: 3 Conv2D (64, 64, 128 filters, 3x3) each followed by
  BatchNormalization and ReLU, max pooling after the first two, global
  average pooling and a 10-way Dense, on 32x32x3 inputs, batch 32.

Configurations, each in a fresh process (Keras's policy and kerasmp's
patches are process-wide; stock runs never import kerasmp):

- `float32`: stock Keras, float32;
- `stock_bf16`: stock Keras, `keras.config.set_dtype_policy("mixed_bfloat16")`;
- `kerasmp_bf16`: `kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))`;
- on PyTorch also `torch_fp32` and `torch_autocast`: the same architecture
  written in plain PyTorch (`nn.TransformerEncoderLayer` with a causal mask,
  post-norm like keras-hub's; `nn.Conv2d`/`nn.BatchNorm2d` in NCHW), trained
  with `torch.optim.Adam`, in float32 and under
  `torch.autocast("cpu", dtype=torch.bfloat16)`.

Settings: `default` is `compile()`'s defaults (`jit_compile="auto"`: no XLA
on a TensorFlow CPU, no `torch.compile`; JAX always compiles with XLA);
`jit` is an explicit `jit_compile=True` (TensorFlow: XLA). On JAX,
`--jax-flags` adds a setting per XLA flag string (`XLA_FLAGS`).

Timing: each process builds the model, runs a warm-up `fit` of `--warmup`
steps (tracing, compiling, building the optimizer), then `--repeats` timed
`fit` calls of `--steps` steps each; the figure is the median seconds per
step. The processes of one backend, model and setting are run in rounds
(`--rounds`), each round one process per configuration in turn, so that
drift in the machine's load falls on all of them alike; the reported figure
is the median over every timed call of every round. Two clocks: wall time
per step, and this process's CPU time per step (all its threads). With one
thread (`--threads 1`) the CPU time is the step's compute; TensorFlow's wall
time on a CPU can round a step up to a multiple of ~41 ms while its thread
waits for the next batch (measured: a CNN step of 51 ms CPU took 51.7 or
82.2 ms wall), so compare TensorFlow on CPU time. Ratios are float32's
seconds per step over the configuration's (above 1: faster than float32);
`torch_autocast`'s is over `torch_fp32`'s.

Usage:
    python benchmarks/cpu_bfloat16.py [--backends tensorflow torch jax]
        [--models transformer cnn] [--rounds 2] [--repeats 3] [--steps 10]
        [--threads N] [--json benchmarks/results/cpu_bfloat16.json]

Prints a table and writes JSON (the machine's CPU name and bfloat16 flags,
the versions, the command, every timed call).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERAS_CONFIGS = ("float32", "stock_bf16", "kerasmp_bf16")
TORCH_CONFIGS = ("torch_fp32", "torch_autocast")
SETTINGS = {"tensorflow": ("default", "jit"), "torch": ("default",),
            "jax": ("default",)}
BATCH = 32
SEQ = 64
VOCAB = 1024
WIDTH = 256
HEADS = 4
FF = 1024
BLOCKS = 2
IMAGE = 32
CLASSES = 10
FILTERS = (64, 64, 128)


# --------------------------------------------------------------------------
# Child: one configuration, one process
# --------------------------------------------------------------------------


def _data(model_name, n):
    import numpy as np

    rng = np.random.default_rng(0)
    if model_name == "transformer":
        x = rng.integers(0, VOCAB, (n, SEQ + 1)).astype("int32")
        return x[:, :-1], x[:, 1:]
    x = rng.random((n, IMAGE, IMAGE, 3), dtype="float32")
    y = rng.integers(0, CLASSES, (n,)).astype("int32")
    return x, y


def keras_model(keras, model_name):
    """The benchmark's model in Keras (the current global policy)."""
    keras.utils.set_random_seed(0)
    if model_name == "transformer":
        import keras_hub

        tokens = keras.Input((SEQ,), dtype="int32")
        x = keras_hub.layers.TokenAndPositionEmbedding(
            VOCAB, SEQ, WIDTH)(tokens)
        for _ in range(BLOCKS):
            x = keras_hub.layers.TransformerDecoder(FF, HEADS)(x)
        logits = keras.layers.Dense(VOCAB)(x)
        return keras.Model(tokens, logits)
    images = keras.Input((IMAGE, IMAGE, 3))
    x = images
    for i, filters in enumerate(FILTERS):
        x = keras.layers.Conv2D(filters, 3, padding="same",
                                use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
        if i < len(FILTERS) - 1:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    logits = keras.layers.Dense(CLASSES)(x)
    return keras.Model(images, logits)


def _set_threads(backend, threads):
    if not threads:
        return
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)


def run_keras(model_name, config, setting, steps, warmup, repeats):
    import keras

    if config == "stock_bf16":
        keras.config.set_dtype_policy("mixed_bfloat16")
    elif config == "kerasmp_bf16":
        import kerasmp

        kerasmp.set_global_policy(kerasmp.Policy("mixed_bfloat16"))
    model = keras_model(keras, model_name)
    model.compile(
        keras.optimizers.Adam(1e-4),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True if setting == "jit" else "auto",
    )
    x, y = _data(model_name, BATCH * steps)
    model.fit(x[: BATCH * warmup], y[: BATCH * warmup], batch_size=BATCH,
              epochs=1, verbose=0, shuffle=False)
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                            shuffle=False)
        times.append((time.perf_counter() - start) / steps)
        cpu.append((time.process_time() - start_cpu) / steps)
    return {
        "s_per_step": times,
        "cpu_s_per_step": cpu,
        "loss": float(history.history["loss"][-1]),
        "compute_dtype": next(
            layer.compute_dtype for layer in model.layers
            if type(layer).__name__ in ("Conv2D", "TransformerDecoder")),
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "optimizer": type(model.optimizer).__name__,
    }


def torch_model(torch, model_name):
    """The same architectures in plain PyTorch (NCHW images)."""
    nn = torch.nn
    torch.manual_seed(0)
    if model_name == "transformer":

        class Decoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.tokens = nn.Embedding(VOCAB, WIDTH)
                self.positions = nn.Embedding(SEQ, WIDTH)
                self.blocks = nn.ModuleList(
                    nn.TransformerEncoderLayer(
                        WIDTH, HEADS, FF, dropout=0.0, batch_first=True,
                        layer_norm_eps=1e-5)
                    for _ in range(BLOCKS))
                self.out = nn.Linear(WIDTH, VOCAB)
                self.register_buffer(
                    "mask", nn.Transformer.generate_square_subsequent_mask(
                        SEQ), persistent=False)

            def forward(self, tokens):
                positions = torch.arange(tokens.shape[1])
                x = self.tokens(tokens) + self.positions(positions)
                for block in self.blocks:
                    x = block(x, src_mask=self.mask, is_causal=True)
                return self.out(x)

        return Decoder()
    layers, channels = [], 3
    for i, filters in enumerate(FILTERS):
        layers += [nn.Conv2d(channels, filters, 3, padding=1, bias=False),
                   nn.BatchNorm2d(filters), nn.ReLU()]
        if i < len(FILTERS) - 1:
            layers.append(nn.MaxPool2d(2))
        channels = filters
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(),
               nn.Linear(channels, CLASSES)]
    return nn.Sequential(*layers)


def run_torch(model_name, config, steps, warmup, repeats):
    import torch

    model = torch_model(torch, model_name)
    optimizer = torch.optim.Adam(model.parameters(), 1e-4)
    x, y = _data(model_name, BATCH * steps)
    x = torch.from_numpy(x)
    if model_name == "cnn":
        x = x.permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(y).long()
    autocast = config == "torch_autocast"

    def step(i):
        xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(xb)
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), yb.reshape(-1))
        loss.backward()
        optimizer.step()
        return float(loss)

    model.train()
    for i in range(warmup):
        step(i)
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            loss = step(i)
        times.append((time.perf_counter() - start) / steps)
        cpu.append((time.process_time() - start_cpu) / steps)
    return {"s_per_step": times, "cpu_s_per_step": cpu, "loss": loss,
            "compute_dtype": "bfloat16" if autocast else "float32",
            "jit_compile": False, "optimizer": "torch.optim.Adam"}


def child(args):
    backend = os.environ["KERAS_BACKEND"]
    _set_threads(backend, args.threads)
    if args.config in TORCH_CONFIGS:
        out = run_torch(args.model, args.config, args.steps, args.warmup,
                        args.repeats)
    else:
        out = run_keras(args.model, args.config, args.setting, args.steps,
                        args.warmup, args.repeats)
    print("RESULT " + json.dumps(out))


# --------------------------------------------------------------------------
# Parent: rounds of child processes, the table, the JSON
# --------------------------------------------------------------------------


def _run_child(backend, model_name, config, setting, args):
    env = dict(os.environ, KERAS_BACKEND=backend,
               TF_CPP_MIN_LOG_LEVEL="3")
    if setting.startswith("xla:"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " "
                            + setting[len("xla:"):]).strip()
    if args.threads and backend == "jax":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_"
                            "thread_eigen=false intra_op_parallelism_threads="
                            f"{args.threads}").strip()
    command = [sys.executable, os.path.abspath(__file__), "--child",
               "--model", model_name, "--config", config, "--setting",
               setting, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--repeats", str(args.repeats),
               "--threads", str(args.threads or 0)]
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return {"error": " | ".join(tail) or f"exit {done.returncode}"}


def cpu_info():
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16",
              "amx_fp16", "amx_tile")
    return {"name": name, "flags": [f for f in wanted if f in flags],
            "cores": os.cpu_count()}


def _versions():
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("keras", "tensorflow", "jax", "jaxlib", "torch",
                 "keras-hub"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _ratio(a, b):
    return a / b if a and b else None


def summarize(cells):
    """Median s/step per cell (wall and this process's CPU time) and each
    configuration's ratios to float32."""
    rows = []
    for key, runs in cells.items():
        backend, model_name, setting, config = key
        wall = [t for r in runs for t in r.get("s_per_step", ())]
        cpu = [t for r in runs for t in r.get("cpu_s_per_step", ())]
        errors = [r["error"] for r in runs if "error" in r]
        rows.append({
            "backend": backend, "model": model_name, "setting": setting,
            "config": config,
            "s_per_step": statistics.median(wall) if wall else None,
            "cpu_s_per_step": statistics.median(cpu) if cpu else None,
            "s_per_step_all": wall, "cpu_s_per_step_all": cpu,
            "error": errors[0] if errors else None,
            "loss": runs[-1].get("loss"),
            "compute_dtype": runs[-1].get("compute_dtype"),
            "jit_compile": runs[-1].get("jit_compile"),
        })
    by_key = {(r["backend"], r["model"], r["setting"], r["config"]): r
              for r in rows}
    for r in rows:
        base = "torch_fp32" if r["config"] in TORCH_CONFIGS else "float32"
        # The torch-native rows have one setting: compare in it; every
        # Keras row is compared with float32 under its own setting and
        # under compile's defaults.
        own = by_key.get((r["backend"], r["model"], r["setting"], base)) or {}
        default = by_key.get((r["backend"], r["model"], "default",
                              base)) or {}
        stock = by_key.get((r["backend"], r["model"], r["setting"],
                            "stock_bf16")) or {}
        for clock, prefix in (("s_per_step", ""), ("cpu_s_per_step",
                                                    "cpu_")):
            r[prefix + "speedup"] = _ratio(own.get(clock), r[clock])
            r[prefix + "speedup_vs_default_float32"] = _ratio(
                default.get(clock), r[clock])
            r[prefix + "kerasmp_over_stock_time"] = (
                _ratio(r[clock], stock.get(clock))
                if r["config"] == "kerasmp_bf16" else None)
    return rows


def format_table(rows):
    def fmt(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    lines = [f"{'backend':<11} {'model':<12} {'setting':<8} "
             f"{'config':<15} {'wall ms':>8} {'vs f32':>7} {'vs f32 dflt':>11}"
             f" {'cpu ms':>8} {'vs f32':>7}  note"]
    for r in rows:
        note = r["error"] or ""
        if r["kerasmp_over_stock_time"] is not None:
            note = (f"kerasmp/stock time: wall "
                    f"{r['kerasmp_over_stock_time']:.3f}, cpu "
                    f"{fmt(r['cpu_kerasmp_over_stock_time'], '.3f')}")
        lines.append(
            f"{r['backend']:<11} {r['model']:<12} {r['setting']:<8} "
            f"{r['config']:<15} {fmt(r['s_per_step'], '8.1f', 1e3)} "
            f"{fmt(r['speedup'], '7.2f')} "
            f"{fmt(r['speedup_vs_default_float32'], '11.2f')} "
            f"{fmt(r['cpu_s_per_step'], '8.1f', 1e3)} "
            f"{fmt(r['cpu_speedup'], '7.2f')}  {note}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+",
                        default=["tensorflow", "torch", "jax"],
                        choices=("tensorflow", "torch", "jax"))
    parser.add_argument("--models", nargs="+",
                        default=["transformer", "cnn"],
                        choices=("transformer", "cnn"))
    parser.add_argument("--configs", nargs="+", default=None,
                        choices=KERAS_CONFIGS + TORCH_CONFIGS,
                        help="default: all that apply to the backend")
    parser.add_argument("--settings", nargs="+", default=None,
                        choices=("default", "jit"),
                        help="default: default and jit on TensorFlow, "
                        "default elsewhere")
    parser.add_argument("--jax-flags", nargs="*", default=[],
                        help="extra JAX settings, each an XLA_FLAGS string")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads (0: the framework's default)")
    parser.add_argument("--json", default=None)
    # Child mode.
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    plan = []
    for backend in args.backends:
        settings = list(args.settings or SETTINGS[backend])
        if backend == "jax":
            settings += ["xla:" + f for f in args.jax_flags]
        configs = [c for c in args.configs or KERAS_CONFIGS + TORCH_CONFIGS
                   if c in KERAS_CONFIGS or backend == "torch"]
        for model_name in args.models:
            for setting in settings:
                row = [c for c in configs
                       if setting == "default" or c in KERAS_CONFIGS]
                plan.append((backend, model_name, setting, row))
    started = datetime.datetime.now(datetime.timezone.utc)
    cells = {}
    for backend, model_name, setting, configs in plan:
        for round_ in range(args.rounds):
            for config in configs:
                key = (backend, model_name, setting, config)
                t = time.perf_counter()
                out = _run_child(backend, model_name, config, setting, args)
                cells.setdefault(key, []).append(out)
                got = out.get("error") or "wall ms/step " + ", ".join(
                    f"{1e3 * s:.1f}" for s in out["s_per_step"]) + (
                    "; cpu " + ", ".join(f"{1e3 * s:.1f}"
                                         for s in out["cpu_s_per_step"]))
                print(f"  {backend:<10} {model_name:<11} {setting:<8} "
                      f"{config:<14} round {round_ + 1}: {got} "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
    rows = summarize(cells)
    print()
    print(format_table(rows))
    result = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)]
                            + sys.argv),
        "cpu": cpu_info(),
        "versions": _versions(),
        "load_average_at_start": os.getloadavg(),
        "settings": vars(args),
        "rows": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)),
                    exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
