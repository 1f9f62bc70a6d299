"""`PerformanceMonitor`: training speed and peak memory in the epoch logs.

Each epoch it adds `steps_per_second`, `samples_per_second` and
`peak_memory_mb` to the logs, hence to the progress bar, `History.history`
and any `CSVLogger`/`TensorBoard` placed after it. The clock runs from the
start of the epoch to the end of its training steps (the start of the
validation pass, if any, or the end of the epoch), so the numbers agree with
the wall time of the epoch's training part, tracing and compilation of the
first epoch included.
"""

import inspect
import resource
import sys
import threading
import time

import keras

from kerasmp._utils.devices import jax_memory_stats
from kerasmp._utils.devices import tf_first_gpu
from kerasmp._utils.warn import warn

MIB = 2**20


def _rss_peak_bytes():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


class PerformanceMonitor(keras.callbacks.Callback):
    """Logs training speed and peak memory at the end of each epoch.

    Adds to the epoch logs (progress bar, `History.history`, and the
    `CSVLogger`/`TensorBoard` callbacks placed after it in the list):

    - `steps_per_second`: training steps of the epoch divided by the wall
      time from the start of the epoch to the end of its last training step
      (validation excluded; the first epoch includes tracing/compilation).
    - `samples_per_second`: the same for samples (steps times the batch
      size, the last partial batch counted at its size when known).
    - `peak_memory_mb`: peak memory in MiB (2^20 bytes), from the best
      source available, named in `memory_source`:
      - TensorFlow on a GPU: `tf.config.experimental.get_memory_info` peak
        of the device, reset at the start of each epoch (per-epoch peak);
      - JAX on a GPU/TPU: `device.memory_stats()["peak_bytes_in_use"]`
        (a process-wide high-water mark: it never goes down);
      - otherwise (a CPU): the process's peak resident memory,
        `resource.getrusage(RUSAGE_SELF).ru_maxrss` (also a high-water
        mark).

    The per-step work is one integer update, run with Keras's asynchronous
    batch-callback dispatch left on (with `warmup_steps=0`); the rest
    happens once per epoch.

    Args:
        batch_size: the batch size, for `samples_per_second`. None: read from
            the `fit` call's data (arrays, `tf.data` datasets with a static
            batch dimension, PyDataset); if it cannot be found,
            `samples_per_second` is not logged (with a warning).
        warmup_steps: steps at the start of each epoch left out of the
            timing; 0 times the whole epoch. Above 0, the clock runs from
            the end of the last warm-up step to the end of the epoch's last
            step (each step's end being when its logs reach the callbacks:
            batch callbacks are then dispatched synchronously, so that both
            ends are on time), which leaves out the epoch's set-up and
            end-of-epoch work too: the steady-state speed.

    Attributes:
        memory_source: where `peak_memory_mb` comes from (a string), set at
            the start of training.
        epochs: one dict per epoch with `steps`, `samples`, `seconds` (the
            timed ones, warm-up steps left out) and the logged values.

    Example:

    ```python
    monitor = kerasmp.callbacks.PerformanceMonitor()
    history = model.fit(x, y, epochs=3, callbacks=[monitor])
    history.history["steps_per_second"], monitor.memory_source
    ```
    """

    def __init__(self, batch_size=None, warmup_steps=0):
        super().__init__()
        if not _is_int(warmup_steps, 0):
            raise ValueError(
                "PerformanceMonitor: `warmup_steps` must be an integer >= 0. "
                f"Received: {warmup_steps!r}"
            )
        self.warmup_steps = warmup_steps
        # Keras reads this per instance: async dispatch could run the
        # batch-end hook late, and starting the clock late.
        self.async_safe = warmup_steps == 0
        if batch_size is not None and not _is_int(batch_size, 1):
            raise ValueError(
                "PerformanceMonitor: `batch_size` must be a positive integer "
                f"or None (read from fit's data). Received: {batch_size!r}"
            )
        self.batch_size = batch_size
        self.memory_source = None
        self.epochs = []
        self._lock = threading.Lock()
        self._steps = 0
        self._start = None
        self._end = None
        self._in_epoch = False
        self._fit_batch = None
        self._partial = None
        self._num_batches = None
        self._tf_device = None
        self._jax_peak = False
        self._warm_end = None
        self._last_end = None
        self._warm_steps = 0

    # ---------------------------------------------------------- callbacks

    def on_train_begin(self, logs=None):
        self._fit_batch, self._partial, self._num_batches = _fit_batching(
            self.model
        )
        if self.batch_size is None and self._fit_batch is None:
            warn(
                "PerformanceMonitor: the batch size of this fit's data is "
                "not known (a dataset without a static batch dimension, or a "
                "generator); `samples_per_second` will not be logged. Pass "
                "PerformanceMonitor(batch_size=...) to log it."
            )
        backend = keras.backend.backend()
        self._tf_device = None
        self._jax_peak = False
        if backend == "tensorflow" and tf_first_gpu() is not None:
            self._tf_device = tf_first_gpu()
            self.memory_source = (
                f"tf.config.experimental.get_memory_info('{self._tf_device}')"
                "['peak'] (per epoch)"
            )
        elif backend == "jax" and "peak_bytes_in_use" in (
            jax_memory_stats()[1]
        ):
            self._jax_peak = True
            device = jax_memory_stats()[0]
            self.memory_source = (
                f"jax {device} memory_stats()['peak_bytes_in_use'] "
                "(process high-water mark)"
            )
        else:
            self.memory_source = (
                "resource.getrusage(RUSAGE_SELF).ru_maxrss: peak resident "
                "memory of the process (high-water mark)"
            )

    def on_epoch_begin(self, epoch, logs=None):
        if self._tf_device is not None:
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats(self._tf_device)
        with self._lock:
            self._steps = 0
            self._warm_end = None
            self._last_end = None
            self._warm_steps = 0
        self._end = None
        self._in_epoch = True
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the last step run (several per call with
        # steps_per_execution > 1).
        with self._lock:
            if batch + 1 > self._steps:
                self._steps = batch + 1
            if self.warmup_steps:
                now = time.perf_counter()
                if self._warm_end is None:
                    if self._steps >= self.warmup_steps:
                        self._warm_end = now
                        self._warm_steps = self._steps
                else:
                    self._last_end = now

    def on_test_begin(self, logs=None):
        # Validation inside fit: the epoch's training steps are done.
        if self._in_epoch and self._end is None:
            self._end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        end = self._end if self._end is not None else time.perf_counter()
        self._in_epoch = False
        with self._lock:
            steps = self._steps
            start = self._start
            if self.warmup_steps:
                if self._warm_end is None or steps <= self._warm_steps:
                    raise ValueError(
                        f"PerformanceMonitor: the epoch ran {steps} steps, "
                        f"not more than `warmup_steps`={self.warmup_steps}: "
                        "no step left to time."
                    )
                start = self._warm_end
                end = self._last_end
                steps -= self._warm_steps
        seconds = end - start
        values = {"steps_per_second": steps / seconds if seconds > 0 else 0.0}
        samples = self._samples(steps)
        if samples is not None:
            values["samples_per_second"] = (
                samples / seconds if seconds > 0 else 0.0
            )
        values["peak_memory_mb"] = self._peak_bytes() / MIB
        if logs is not None:
            logs.update(values)
        self.epochs.append(
            {"epoch": epoch, "steps": steps, "samples": samples,
             "seconds": seconds, **values}
        )

    # ------------------------------------------------------------ helpers

    def _samples(self, steps):
        size = self.batch_size or self._fit_batch
        if size is None:
            return None
        if (
            self.batch_size is None
            and self._partial
            and self._num_batches is not None
            and steps + self._warm_steps == self._num_batches
        ):
            return (steps - 1) * size + self._partial
        return steps * size

    def _peak_bytes(self):
        if self._tf_device is not None:
            import tensorflow as tf

            return tf.config.experimental.get_memory_info(self._tf_device)[
                "peak"
            ]
        if self._jax_peak:
            return jax_memory_stats()[1]["peak_bytes_in_use"]
        return _rss_peak_bytes()


def _fit_batching(model):
    """(batch size, partial last batch size, batches per epoch) of the fit.

    Read from the data adapter of the `fit` call that is running `model`
    (its `epoch_iterator` local): Keras hands callbacks no batch size. Any
    of the three is None when unknown (e.g. a generator).
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if (
                frame.f_code.co_name == "fit"
                and frame.f_locals.get("self") is model
            ):
                iterator = frame.f_locals.get("epoch_iterator")
                adapter = getattr(iterator, "data_adapter", None)
                if adapter is None:
                    return None, None, None
                return tuple(
                    _safe_attr(adapter, name)
                    for name in ("batch_size", "partial_batch_size",
                                 "num_batches")
                )
            frame = frame.f_back
    finally:
        del frame
    return None, None, None


def _safe_attr(obj, name):
    try:
        value = getattr(obj, name)
    except Exception:  # an adapter that cannot tell (NotImplementedError)
        return None
    return value if isinstance(value, int) and value > 0 else None


def _is_int(value, low):
    """Whether `value` is a Python int (not a bool) of at least `low`."""
    return (
        not isinstance(value, bool) and isinstance(value, int) and value >= low
    )
