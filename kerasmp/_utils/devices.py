"""What devices the Keras backend sees: one place for every device lookup.

`kerasmp.doctor` reports them, `PerformanceMonitor` reads the memory
counters of the first one, and `kerasmp demo` / `kerasmp bench` name the
device they ran on. Standard library only at import time (`import kerasmp`
imports this module through `kerasmp.doctor`); each function imports only
the backend it is asked about, so a JAX run never imports TensorFlow.
"""

import dataclasses
import platform


@dataclasses.dataclass
class Device:
    """An accelerator or CPU as the active backend sees it."""

    kind: str  # "gpu", "tpu" or "cpu"
    name: str
    compute_capability: tuple | None = None
    bf16_instructions: bool = False  # CPU: avx512_bf16 or amx_bf16


def cpu_name():
    """The CPU's model name (`/proc/cpuinfo`, else `platform`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags():
    """The CPU's feature flags (`/proc/cpuinfo`), or an empty set."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _parse_cc(value):
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return tuple(int(v) for v in value[:2])
    try:
        major, minor = str(value).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def visible_devices(backend):
    """The devices `backend` sees: its GPUs and TPUs, else the CPU.

    Never raises: when the accelerators cannot be queried, a `"cpu"`
    device whose name says why comes first.

    Args:
        backend: `"tensorflow"`, `"jax"` or `"torch"`.

    Returns:
        A non-empty list of `Device`s, accelerators first.
    """
    devices = []
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            for gpu in tf.config.list_physical_devices("GPU"):
                details = tf.config.experimental.get_device_details(gpu)
                devices.append(Device(
                    "gpu", details.get("device_name", gpu.name),
                    _parse_cc(details.get("compute_capability")),
                ))
            for tpu in tf.config.list_physical_devices("TPU"):
                devices.append(Device("tpu", tpu.name))
        elif backend == "jax":
            import jax

            for d in jax.devices():
                if d.platform == "gpu":
                    devices.append(Device(
                        "gpu", d.device_kind,
                        _parse_cc(getattr(d, "compute_capability", None)),
                    ))
                elif d.platform == "tpu":
                    devices.append(Device("tpu", d.device_kind))
        elif backend == "torch":
            import torch

            for i in range(torch.cuda.device_count()):
                devices.append(Device(
                    "gpu", torch.cuda.get_device_name(i),
                    tuple(torch.cuda.get_device_capability(i)),
                ))
    except Exception as e:  # never fail: report what we could not find out
        devices.append(Device("cpu", f"(could not query accelerators: {e})"))
    if not any(d.kind in ("gpu", "tpu") for d in devices):
        flags = cpu_flags()
        devices.append(Device(
            "cpu", cpu_name(),
            bf16_instructions=bool({"avx512_bf16", "amx_bf16"} & flags),
        ))
    return devices


def main_device():
    """The device Keras's active backend runs on: the first it sees.

    Returns:
        A `Device` (`kind` "gpu", "tpu" or "cpu", and `name`).
    """
    import keras

    return visible_devices(keras.backend.backend())[0]


def tf_first_gpu():
    """TensorFlow's first logical GPU, as `"GPU:0"`, or None."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name.replace("/device:", "") if gpus else None


def jax_memory_stats():
    """`(device, memory stats dict)` of JAX's first device.

    The dict is empty where the device keeps no statistics (a CPU).
    """
    import jax

    device = jax.devices()[0]
    return device, device.memory_stats() or {}


def process_index():
    """`(index, count)` of this process in a multi-process run of the
    active backend, `(0, 1)` in a single process.

    JAX: `jax.process_index()` / `jax.process_count()`; PyTorch: the rank
    and world size of an initialized `torch.distributed` process group;
    TensorFlow: the worker's task id and the worker count of the
    `tf.distribute` strategy in scope (`MultiWorkerMirroredStrategy`). Only
    a backend already imported is asked, so this never imports one.
    """
    import sys

    import keras

    backend = keras.backend.backend()
    if backend == "jax" and "jax" in sys.modules:
        jax = sys.modules["jax"]
        return jax.process_index(), jax.process_count()
    if backend == "torch" and "torch.distributed" in sys.modules:
        dist = sys.modules["torch.distributed"]
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    if backend == "tensorflow" and "tensorflow" in sys.modules:
        strategy = sys.modules["tensorflow"].distribute.get_strategy()
        resolver = getattr(strategy, "cluster_resolver", None)
        if resolver is not None:
            workers = resolver.cluster_spec().as_dict().get("worker", [])
            if len(workers) > 1:
                return int(resolver.task_id or 0), len(workers)
    return 0, 1
