"""Do all workers of a multi-worker run train with the same precision setup?

Under `tf.distribute.MultiWorkerMirroredStrategy`, on JAX in a multi-process
run (`jax.distributed.initialize` / `keras.distribution.initialize`, with a
`keras.distribution`), and on PyTorch in a `torch.distributed` process group
(the `DistributedDataParallel` loop of Keras's multi-GPU PyTorch guide),
each worker is its own process and builds its own model. If one of them
builds it under another dtype policy, other float32 rules, another float8
assignment or another loss-scale configuration, the all-reduced gradients
mix float16 and float32 replicas, or one worker skips a step the others
apply, and the run hangs or silently diverges. `check_workers_agree(model)`
exchanges each worker's settings and, on any difference, raises the same
error on every worker, naming the field and every worker's value.

kerasmp's `compile` calls it first, before it creates anything: on JAX each
variable created under a distribution is itself a collective (`device_put`
checks that every process passes the same value), so a worker that made a
`LossScaleOptimizer` the others did not make would have left its collectives
out of step with theirs, and the first exchange would have paired with
another worker's variable (gloo aborts the job on the size mismatch; NCCL
can hang). The exchange itself never depends on the settings: on
TensorFlow and PyTorch one all-gather of a fixed-size digest per worker,
then, only when two digests differ, one of the settings padded to the
longest (every worker knows its length from the first); on JAX no
collective at all, the settings go through the coordination service's
key-value store, with a timeout. A custom loop, which never calls
`compile`, calls `kerasmp.check_workers_agree(model, optimizer)` itself.
"""

import hashlib
import itertools
import json

import keras
import numpy as np

from kerasmp import _keras_internals as _ki
from kerasmp.policy.plan import plan_of

DEFAULT_TIMEOUT = 300.0
"""Seconds a worker waits for the others' settings (JAX)."""

_LOSS_SCALE_FIELDS = (
    "auto",
    "initial_scale",
    "dynamic",
    "dynamic_growth_steps",
    "growth_factor",
    "backoff_factor",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
)
_DIGEST_WORDS = 8  # a sha256 as int32 words
_exchanges = itertools.count()  # this process's checks, in order


def loss_scale_settings(optimizer):
    """The loss-scaling settings of `optimizer`, as a dict of JSON values
    (its class and the fields kerasmp's `LossScaleOptimizer` takes), or
    None when it is not a loss-scale optimizer."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    return describe_loss_scale(
        type(optimizer).__name__,
        {f: getattr(optimizer, f) for f in _LOSS_SCALE_FIELDS
         if hasattr(optimizer, f)},
    )


def describe_loss_scale(class_name, values):
    """The loss-scaling settings of a `class_name` optimizer with these
    attribute values (`{name: value}`), as `loss_scale_settings` gives
    them: the class and the values of `_LOSS_SCALE_FIELDS` found."""
    settings = {"class": class_name}
    for name in _LOSS_SCALE_FIELDS:
        if name in values:
            value = values[name]
            settings[name] = value if value is None else repr(value)
    return settings


def worker_settings(model, plan=None, loss_scale=...):
    """The settings every worker must share, as `{field: str}`.

    Fields: `policy` (the model's dtype policy name), `float32_layers` (the
    float32 rules of the kerasmp policy governing the model, `"-"` without
    one), `float8` (the paths of the layers that train in float8), and
    `loss_scale` (the optimizer's loss-scaling configuration: class,
    initial scale, dynamic or static, growth and backoff, bounds; `"none"`
    without loss scaling or before `compile`).

    Args:
        model: a `keras.Model`.
        plan: Optional: its `kerasmp.policy.plan.Plan`, already made
            (compile's).
        loss_scale: Optional: the loss-scaling settings to compare
            (`loss_scale_settings` of the optimizer `compile` is about to
            use, or None for none); default: those of `model.optimizer`.
    """
    plan = plan_of(model) if plan is None else plan
    policy = plan.policy
    settings = {"policy": plan.dtype_policy}
    if policy is None:
        settings["float32_layers"] = "-"
    else:
        settings["policy"] = policy.name
        settings["float32_layers"] = json.dumps(
            policy.get_config()["float32_layers"], sort_keys=True
        )
    settings["float8"] = json.dumps(
        sorted(d.path for d in plan.float8 if d.float8)
    )
    if loss_scale is ...:
        loss_scale = loss_scale_settings(getattr(model, "optimizer", None))
    settings["loss_scale"] = (
        "none" if loss_scale is None else json.dumps(loss_scale, sort_keys=True)
    )
    return settings


def _multi_worker(strategy):
    """`(task_id, num_workers)` for a multi-worker strategy, else None."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return None
    workers = resolver.cluster_spec().as_dict().get("worker", [])
    if len(workers) < 2:
        return None
    return int(resolver.task_id), len(workers)


def _digest(text):
    """`text`'s sha256 as `_DIGEST_WORDS` int32 words."""
    return np.frombuffer(
        hashlib.sha256(text.encode("utf-8")).digest(), np.int32
    ).tolist()


def _tf_exchange(strategy, text, timeout):
    """Every TensorFlow worker's `text`, `{task_id: text}`, or None outside
    a multi-worker strategy. Each all-gather has the same shape on every
    worker: first `[task_id, length, digest]`; only if the digests differ,
    the texts padded to the longest length."""
    del timeout  # TensorFlow's collectives have their own
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    worker = _multi_worker(strategy)
    if worker is None:
        return None
    task_id, _ = worker

    def all_gather(rows):
        values = strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(rows, dtype=tf.int32)
        )
        return strategy.gather(values, axis=0).numpy()

    payload = list(text.encode("utf-8"))
    heads = all_gather([[task_id, len(payload)] + _digest(text)])
    if len({tuple(row[2:]) for row in heads}) == 1:
        return {int(row[0]): text for row in heads}
    width = int(heads[:, 1].max())
    rows = all_gather([[task_id] + payload + [0] * (width - len(payload))])
    return {
        int(row[0]): bytes(int(b) for b in row[1:] if b).decode("utf-8")
        for row in rows
    }


def _torch_world():
    """`(rank, world_size)` in an initialized `torch.distributed` process
    group of two processes or more, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() < 2:
        return None
    return dist.get_rank(), dist.get_world_size()


def _torch_exchange(text, timeout):
    """Every `torch.distributed` rank's `text`, `{rank: text}`. Each
    all-gather has the same shape on every rank, as on TensorFlow.

    Raises:
        TimeoutError: a rank did not reach the check within `timeout`
            seconds.
    """
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = _torch_world()

    def all_gather(row):
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(world)]
        work = dist.all_gather(rows, mine, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise TimeoutError(
                f"kerasmp: not every rank reached the mixed-precision "
                f"settings check within {timeout:g} s (this is rank {rank} "
                f"of {world}): every rank must build and compile the same "
                f"model, or call `kerasmp.check_workers_agree` ({e})"
            ) from None
        return torch.stack(rows).numpy()

    payload = list(text.encode("utf-8"))
    heads = all_gather([rank, len(payload)] + _digest(text))
    if len({tuple(row[2:]) for row in heads}) == 1:
        return {int(row[0]): text for row in heads}
    width = int(heads[:, 1].max())
    rows = all_gather([rank] + payload + [0] * (width - len(payload)))
    return {
        int(row[0]): bytes(int(b) for b in row[1:] if b).decode("utf-8")
        for row in rows
    }


def _jax_exchange(text, timeout):
    """Every JAX process's `text`, `{process_index: text}`, through the
    coordination service's key-value store (no collective), or None in a
    single process.

    Raises:
        TimeoutError: a process did not publish its text within `timeout`
            seconds.
    """
    import jax

    if jax.process_count() < 2:
        return None
    client = _ki.jax_coordination_client()
    me, count = jax.process_index(), jax.process_count()
    prefix = f"kerasmp/compile_settings/{next(_exchanges)}"
    client.key_value_set(f"{prefix}/{me}", text)
    texts = {me: text}
    for other in range(count):
        if other == me:
            continue
        try:
            texts[other] = client.blocking_key_value_get(
                f"{prefix}/{other}", int(timeout * 1000)
            )
        except Exception as e:  # JaxRuntimeError: DEADLINE_EXCEEDED
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            raise TimeoutError(
                f"kerasmp: process {other} did not reach `compile` within "
                f"{timeout:g} s (this is process {me} of {count}), so the "
                "workers' mixed-precision settings could not be compared. "
                "Every process must build and compile the same model: on "
                "JAX each variable a process creates under a distribution "
                "is a collective, so a process that created other variables "
                "before `compile` (a `kerasmp.LossScaleOptimizer` made on "
                "some processes only) waits in JAX's collectives instead."
            ) from None
    return texts


def gather_on_first(tag, text, timeout=60.0):
    """Each JAX process's `text`, gathered on process 0 through the
    coordination service's key-value store (no collective, so it never
    pairs with another collective, and only process 0 waits).

    Process 0 returns `{process_index: text or None}` (None: that process
    did not publish `tag` within `timeout` seconds); every other process
    publishes its `text` and returns None at once. Outside a multi-process
    JAX run: `{0: text}`. Every process must call it with the same `tag`
    (once per tag).

    Args:
        tag: str, the same on every process, unique to this exchange.
        text: str, this process's part.
        timeout: seconds process 0 waits for each other process.
    """
    if keras.backend.backend() != "jax":
        return {0: text}
    import jax

    if jax.process_count() < 2:
        return {0: text}
    client = _ki.jax_coordination_client()
    me, count = jax.process_index(), jax.process_count()
    key = f"kerasmp/gather/{tag}"
    if me != 0:
        client.key_value_set(f"{key}/{me}", text)
        return None
    texts = {0: text}
    for other in range(1, count):
        try:
            texts[other] = client.blocking_key_value_get(
                f"{key}/{other}", int(timeout * 1000))
        except Exception as e:  # JaxRuntimeError: DEADLINE_EXCEEDED
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            texts[other] = None
    return texts


def check_workers_agree(model, optimizer=None, strategy=None, plan=None,
                        loss_scale=..., timeout=DEFAULT_TIMEOUT):
    """Raises on every worker if the workers' precision settings differ.

    Exchanges `worker_settings(model)` between the workers of a
    `tf.distribute.MultiWorkerMirroredStrategy` on TensorFlow (a collective:
    every worker must call it; kerasmp's `compile` does), of a
    multi-process JAX run (`jax.process_count() > 1`, through the
    coordination service: no collective), or of a `torch.distributed`
    process group on PyTorch (a collective: two all-gathers at most, of a
    fixed size, then of the settings padded alike). Does nothing in a
    single process. A custom training loop (no `compile`) calls it once,
    after building the model and its optimizer, before the first step.

    Args:
        model: this worker's `keras.Model`.
        optimizer: Optional: the optimizer whose loss-scaling settings to
            compare (a custom loop's); default: `model.optimizer`'s.
        strategy: TensorFlow only: the strategy; defaults to the one in
            scope.
        plan: Optional: the model's `Plan`, already made (compile's).
        loss_scale: Optional: the loss-scaling settings to compare, as
            `worker_settings` takes them; default: `model.optimizer`'s.
        timeout: JAX and PyTorch: seconds to wait for the other processes.

    Raises:
        ValueError: on every worker, the same message, naming each field
            that differs and every worker's value.
        TimeoutError: JAX and PyTorch: a process did not reach the check
            in time.

    Example (a PyTorch `DistributedDataParallel` loop, once per rank):

    ```python
    model = build_model()
    optimizer = kerasmp.LossScaleOptimizer(keras.optimizers.SGD())
    kerasmp.check_workers_agree(model, optimizer)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    ```
    """
    if optimizer is not None and loss_scale is ...:
        loss_scale = loss_scale_settings(optimizer)
    backend = keras.backend.backend()
    if backend == "torch":
        if _torch_world() is None:
            return
    elif backend == "jax":
        import jax

        if jax.process_count() < 2:
            return
    elif backend != "tensorflow":
        return
    elif _multi_worker(_tf_strategy(strategy)) is None:
        return
    text = json.dumps(worker_settings(model, plan, loss_scale), sort_keys=True)
    if backend == "tensorflow":
        texts = _tf_exchange(strategy, text, timeout)
    elif backend == "torch":
        texts = _torch_exchange(text, timeout)
    else:
        texts = _jax_exchange(text, timeout)
    settings = {w: json.loads(t) for w, t in texts.items()}
    problems = []
    fields = sorted({f for s in settings.values() for f in s})
    for field in fields:
        values = {w: settings[w].get(field) for w in sorted(settings)}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"worker {w}: {v}" for w, v in values.items())
            problems.append(f"`{field}` differs ({listed})")
    if problems:
        raise ValueError(
            f"kerasmp: the {len(settings)} workers of this multi-worker "
            "run do not share the same mixed-precision settings: "
            + "; ".join(problems)
            + ". Every worker must build the model under the same dtype "
            "policy, float32 rules and float8 assignment, and compile it "
            "with the same loss-scale settings."
        )


def _tf_strategy(strategy):
    import tensorflow as tf

    return strategy or tf.distribute.get_strategy()
