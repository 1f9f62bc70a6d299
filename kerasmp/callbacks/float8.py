"""`Float8Monitor`: what Keras's delayed float8 scaling does, in the logs.

Every `every_n_steps` training steps the monitor reads, for each layer in
Keras's float8 mode and each of its tensors (`inputs`, `kernel`,
`outputs_grad`), the `*_scale` and `*_amax_history` variables Keras keeps,
and keeps them in `records` and, at the end of each epoch, the epoch logs
(so History, CSVLogger and TensorBoard record them):

- `float8/<layer path>/<tensor>_scale`: the scale the next step uses;
- `..._amax`: the newest step's amax (`amax_history[0]`);
- `..._amax_history_max`: the largest amax in the history (what the scale
  follows);
- `..._amax_ratio`: the largest, over the steps since the last reading, of
  a step's amax over the amax its scale came from (> 1: that step clipped
  its largest values to the float8 maximum, which the history then hides);
- `..._saturation`, `..._underflow`: the fractions of the tensor's values
  that the current scale clips to the float8 maximum, or flushes to zero.
  For the kernel they are exact (the kernel is read directly). For the
  inputs and output gradients they are measured on `data`, a batch the
  monitor replays at each reading (see `kerasmp.float8.probe`); without
  `data` these keys are left out.

Granularity: the monitor reads the state after a `fit` step when the next
step begins (and at an epoch's end), i.e. once per execution under
`steps_per_execution > 1` (Keras calls batch callbacks once per execution);
the amax ratio still covers every step in between, because the history
holds one amax per step. It has no batch-end hook, so Keras keeps
dispatching batch-end callbacks asynchronously (an empty
`on_train_batch_end` alone costs 5% fit time on JAX); the batch logs do not
carry the values. On JAX a reading takes the values from
the running `fit`'s state in place (`kerasmp.float8.jax_fit_state`: nothing is
written back) and the replay of `data` is one `jax.jit`.

The math is in `kerasmp.float8.telemetry`.
"""

import math
import weakref

import keras

from kerasmp import _keras_internals as _ki
from kerasmp._utils.arrays import to_numpy
from kerasmp._utils.warn import warn
from kerasmp.float8 import jax_fit_state as _jax_fit_state
from kerasmp.float8 import probe as _float8_probe
from kerasmp.float8 import telemetry as _tm
from kerasmp.float8.layers import fall_back
from kerasmp.float8.layers import float8_layers

ACTIONS = ("log", "warn", "fallback", "stop")


def _check_int(argname, value, minimum):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"`{argname}` must be an integer >= {minimum}. Received: {value!r}"
        )


def _variables(layer, tensors):
    """The variables a reading needs from one float8 layer, in order."""
    out = []
    for tensor in tensors:
        out.append(getattr(layer, f"{tensor}_scale"))
        out.append(getattr(layer, f"{tensor}_amax_history"))
        if tensor == "kernel":
            out.append(layer.kernel)
    return out


_READERS = weakref.WeakKeyDictionary()  # model -> {variable ids: reader}


def _reader(model, variables):
    """A function returning the values of `variables` as numpy arrays.

    On TensorFlow one `tf.function` reads them all (one dispatch instead of
    one eager read per variable, which dominated the cost of a reading),
    traced once per model and set of variables (kept with the model, so the
    next fit's monitor reuses it). On JAX the variables' positions in the
    trainer's state are located once, and each reading takes the values
    from a running `fit`'s newest state in place (no `jax_state_sync`,
    which would write the whole state back: `kerasmp.float8.jax_fit_state`), in
    one transfer.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        where = _jax_fit_state.locate(model, variables)
        return lambda: [to_numpy(a) for a in jax.device_get(
            _jax_fit_state.values(model, variables, where))]
    if backend != "tensorflow":
        return lambda: [to_numpy(v) for v in variables]
    import tensorflow as tf

    key = tuple(id(v) for v in variables)
    cached = _READERS.setdefault(model, {})
    if key not in cached:
        read = tf.function(lambda: [v.value for v in variables])
        cached[key] = lambda: [to_numpy(t) for t in read()]
    return cached[key]


class Float8Monitor(keras.callbacks.Callback):
    """Logs per-layer float8 scaling telemetry; warns or falls back.

    Args:
        every_n_steps: Read every this many training steps (an integer
            >= 1). Default 10; 1 reads every step (about 4 ms a reading
            for 12 float8 layers on a CPU: see docs/benchmarks.md).
        data: A small batch replayed at each reading to measure the
            saturation and underflow of the float8 layers' inputs: `x`, or
            `(x, y)` to also measure the output gradients (needs a model
            compiled with a single loss). None (default): kernel fractions
            only.
        saturation_threshold: A measured saturation fraction above this is
            a `"saturation"` event. Default 0.01.
        spike_ratio: An `amax_ratio` above this is an `"amax_spike"` event
            (a step's values were clipped). Default 4.0: per-batch
            gradient amaxes vary by 2x in ordinary training.
        warmup_steps: No events during the first this many steps (the
            telemetry is still logged): a fresh layer's scale is 1 for two
            steps, then follows a history of a few amaxes, and the first
            steps' gradients move fast. Default 10.
        action: What an event does: `"log"` (record it in `events` only),
            `"warn"` (default: also a warning), `"fallback"` (move only the
            offending layer off float8, to its policy's base dtype, and
            continue the fit), or `"stop"` (warn and stop training).
        tensors: The tensors to report, a subset of
            `("inputs", "kernel", "outputs_grad")`. Default all.

    Attributes:
        events: One dict per event: `step`, `layer`, `tensor`, `kind`
            (`"nonfinite"`, `"saturation"`, `"amax_spike"`), `value`,
            `threshold`, `action`, `message`, and `fallback` (the dtype the
            layer moved to) when it fell back.
        records: One dict per reading: `step` and the logged values.
        fallbacks: The paths of the layers moved off float8.

    Example:

    >>> monitor = kerasmp.callbacks.Float8Monitor(every_n_steps=10)
    >>> model.fit(x, y, callbacks=[monitor])  # doctest: +SKIP
    >>> monitor.records[-1]                    # doctest: +SKIP
    """

    def __init__(self, every_n_steps=10, data=None, saturation_threshold=0.01,
                 spike_ratio=4.0, warmup_steps=10, action="warn",
                 tensors=_tm.TENSORS):
        super().__init__()
        _check_int("every_n_steps", every_n_steps, 1)
        _check_int("warmup_steps", warmup_steps, 0)
        if not (isinstance(saturation_threshold, (int, float))
                and 0 <= saturation_threshold < 1):
            raise ValueError(
                "`saturation_threshold` must be a fraction in [0, 1). "
                f"Received: {saturation_threshold!r}"
            )
        if not (isinstance(spike_ratio, (int, float)) and spike_ratio >= 1):
            raise ValueError(
                "`spike_ratio` must be a number >= 1. Received: "
                f"{spike_ratio!r}"
            )
        if action not in ACTIONS:
            raise ValueError(
                f"Invalid `action`: {action!r}. Allowed values: "
                f"{', '.join(map(repr, ACTIONS))}."
            )
        if isinstance(tensors, str):
            tensors = (tensors,)
        tensors = tuple(tensors)
        bad = [t for t in tensors if t not in _tm.TENSORS]
        if bad or not tensors:
            raise ValueError(
                f"Invalid `tensors`: {bad or tensors!r}. Allowed values: "
                f"{', '.join(map(repr, _tm.TENSORS))} (one or more)."
            )
        if data is not None:
            if isinstance(data, (tuple, list)):
                if len(data) not in (1, 2):
                    raise ValueError(
                        "`data` must be x or (x, y). Received a sequence of "
                        f"length {len(data)}."
                    )
                x, y = data[0], (data[1] if len(data) == 2 else None)
            else:
                x, y = data, None
            data = (x, y)
        self.every_n_steps = every_n_steps
        self.data = data
        self.saturation_threshold = float(saturation_threshold)
        self.spike_ratio = float(spike_ratio)
        self.warmup_steps = warmup_steps
        self.action = action
        self.tensors = tensors
        self.events = []
        self.records = []
        self.fallbacks = []
        self._latest = {}
        self._stats = {}
        self._layers = None
        self._layers_model = None
        self._read = None
        self._probe_cache = {}
        self._step = 0
        self._epoch_base = 0
        self._last_read = 0

    # ------------------------------------------------------------ reading

    def measure(self, steps=1):
        """Reads the model's float8 state now; returns `{key: value}`.

        Args:
            steps: Steps since the previous reading (for `amax_ratio`).
        """
        # Not `self.model`: on JAX that property syncs the running fit's
        # whole state back into the variables, the cost this reading avoids.
        model = _ki.callback_model(self)
        layers = self._float8_layers()
        probes = [{} for _ in layers]
        if self.data is not None and layers and (
                "inputs" in self.tensors or "outputs_grad" in self.tensors):
            x, y = self.data
            probes = _float8_probe.record(
                model, [l for _, l in layers], x,
                y if "outputs_grad" in self.tensors else None,
                cache=self._probe_cache)
        if self._read is None:
            self._read = _reader(model, [v for _, layer in layers
                                  for v in _variables(layer, self.tensors)])
        read = iter(self._read())
        values = {}
        self._stats = {}
        for (path, _), probe in zip(layers, probes):
            for tensor in self.tensors:
                scale, history = float(next(read)), next(read)
                x = next(read) if tensor == "kernel" else probe.get(tensor)
                stats = _tm.tensor_stats(scale, history, _tm.FORMATS[tensor],
                                         steps=steps, x=x)
                self._stats[path, tensor] = stats
                for stat, v in stats.items():
                    values[f"float8/{path}/{tensor}_{stat}"] = v
        return values

    def _float8_layers(self):
        """The model's float8 layers (cached until a fallback)."""
        model = _ki.callback_model(self)
        if self._layers is None or self._layers_model is not model:
            self._layers = float8_layers(model)
            self._layers_model = model
            self._read = None
            self._probe_cache = {}
        return self._layers

    def _forget_layers(self):
        self._layers = None
        self._read = None
        self._probe_cache = {}

    # ---------------------------------------------------------- callbacks

    # No `on_train_batch_end`: a callback with one makes Keras turn every
    # step's logs into Python numbers on the main thread (it dispatches
    # batch-end callbacks asynchronously only when none has one), a wait
    # for the device at every step: +5% fit time on JAX for an empty hook.
    # The state after step n is read when step n + 1 begins, or at the
    # epoch's end; the values go to `records` and the epoch logs.

    def on_train_begin(self, logs=None):
        self._forget_layers()  # the model may have changed since
        self._step = 0
        self._epoch_base = 0
        self._last_read = 0
        self._last_begin = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_base = self._step
        self._last_begin = 0

    def on_train_batch_begin(self, batch, logs=None):
        # `batch` is the first step of this execution: `batch` steps of
        # the epoch are done.
        self._last_begin = batch
        self._step = self._epoch_base + batch
        self._maybe_read()

    def on_epoch_end(self, epoch, logs=None):
        self._step = self._epoch_base + self._epoch_steps()
        self._maybe_read()
        if logs is not None:
            logs.update(self._latest)

    def _epoch_steps(self):
        """The steps the epoch that just ended ran."""
        model = _ki.callback_model(self)
        steps = (self.params or {}).get("steps")
        execution = max(1, int(getattr(model, "steps_per_execution", 1)
                               or 1))
        last = self._last_begin + execution  # the last execution's end
        if not steps or getattr(model, "stop_training", False):
            return last if not steps else min(int(steps), last)
        return int(steps)

    def _maybe_read(self):
        steps = self._step - self._last_read
        if steps < self.every_n_steps or steps <= 0:
            return
        self._last_read = self._step
        values = self.measure(steps=steps)
        self._latest = values
        self.records.append({"step": self._step, **values})
        if self._step > self.warmup_steps:
            self._check(values)

    # ------------------------------------------------------------- events

    def _check(self, values):
        for path, layer in list(self._float8_layers()):
            for tensor in self.tensors:
                stats = self._stats.get((path, tensor))
                if not stats:
                    continue
                found = _tm.classify(stats, self.saturation_threshold,
                                     self.spike_ratio)
                if found is None:
                    continue
                kind, value, threshold = found
                self._event(path, layer, tensor, kind, value, threshold)
                if self.action in ("fallback", "stop"):
                    break  # one event per layer and reading

    def _event(self, path, layer, tensor, kind, value, threshold):
        event = {"step": self._step, "layer": path, "tensor": tensor,
                 "kind": kind, "value": value, "threshold": threshold,
                 "action": self.action}
        if self.action == "fallback":
            reason = (f"{tensor} {kind} {value:.3g} at step {self._step}"
                      if math.isfinite(value) else f"{tensor} {kind}")
            # The layer's policy changes and the train function is rebuilt:
            # the variables must hold the running fit's values first.
            _ki.jax_state_sync(self.model)
            try:
                fall_back(layer, reason)
            except ValueError as e:
                event["fallback_failed"] = str(e)
            else:
                event["fallback"] = layer.dtype_policy.name
                self.fallbacks.append(path)
                self._forget_layers()
                self.model.make_train_function(force=True)
        event["message"] = _tm.message(event)
        self.events.append(event)
        if self.action != "log":
            warn(event["message"])
        if self.action == "stop":
            self.model.stop_training = True
