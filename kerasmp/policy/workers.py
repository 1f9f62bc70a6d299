"""Do all workers of a multi-worker run train with the same precision setup?

Under `tf.distribute.MultiWorkerMirroredStrategy`, and on JAX in a
multi-process run (`jax.distributed.initialize` /
`keras.distribution.initialize`, with a `keras.distribution`), each worker is
its own process and builds its own model. If one of them builds it under another
dtype policy, other float32 rules or another loss-scale configuration, the
all-reduced gradients mix float16 and float32 replicas, or one worker skips a
step the others apply, and the run hangs or silently diverges.
`check_workers_agree(model)` exchanges each worker's settings and, on any
difference, raises the same error on every worker, naming the field and
every worker's value.
"""

import json

import keras
import numpy as np

from kerasmp.policy.plan import plan as build_plan

_LOSS_SCALE_FIELDS = (
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


def worker_settings(model, plan=None):
    """The settings every worker must share, as `{field: str}`.

    Fields: `policy` (the model's dtype policy name), `float32_layers` (the
    float32 rules of the kerasmp policy governing the model, `"-"` without
    one), and `loss_scale` (the optimizer's loss-scaling configuration:
    class, initial scale, dynamic or static, growth and backoff, bounds;
    `"none"` without loss scaling or before `compile`).

    Args:
        model: a `keras.Model`.
        plan: Optional: its `kerasmp.policy.plan.Plan`, already made
            (compile's).
    """
    plan = build_plan(model) if plan is None else plan
    policy = plan.policy
    settings = {"policy": plan.dtype_policy}
    if policy is None:
        settings["float32_layers"] = "-"
    else:
        settings["policy"] = policy.name
        settings["float32_layers"] = json.dumps(
            policy.get_config()["float32_layers"], sort_keys=True
        )
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        config = {"class": type(optimizer).__name__}
        for name in _LOSS_SCALE_FIELDS:
            if hasattr(optimizer, name):
                value = getattr(optimizer, name)
                config[name] = value if value is None else repr(value)
        settings["loss_scale"] = json.dumps(config, sort_keys=True)
    else:
        settings["loss_scale"] = "none"
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


def _tf_gatherer(strategy):
    """`(task_id, num_workers, all_gather)` of a TensorFlow multi-worker
    strategy, or None."""
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    worker = _multi_worker(strategy)
    if worker is None:
        return None

    def all_gather(rows):
        values = strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(rows, dtype=tf.int32)
        )
        return strategy.gather(values, axis=0).numpy()

    return (*worker, all_gather)


def _jax_gatherer():
    """`(process_index, process_count, all_gather)` of a JAX multi-process
    run, or None."""
    import jax

    if jax.process_count() < 2:
        return None

    def all_gather(rows):
        from jax.experimental import multihost_utils

        return np.asarray(
            multihost_utils.process_allgather(
                np.asarray(rows, np.int32), tiled=True
            )
        )

    return jax.process_index(), jax.process_count(), all_gather


def check_workers_agree(model, strategy=None, plan=None):
    """Raises on every worker if the workers' precision settings differ.

    Exchanges `worker_settings(model)` between the workers (a collective
    all-gather: every worker must call it; kerasmp's `compile` does) of a
    `tf.distribute.MultiWorkerMirroredStrategy` on TensorFlow, or of a
    multi-process JAX run (`jax.process_count() > 1`). Does nothing in a
    single process.

    Args:
        model: the compiled `keras.Model` of this worker.
        strategy: TensorFlow only: the strategy; defaults to the one in
            scope.
        plan: Optional: the model's `Plan`, already made (compile's).

    Raises:
        ValueError: on every worker, the same message, naming each field
            that differs and every worker's value.

    Example:

    ```python
    with strategy.scope():
        model = build_model()
        model.compile(optimizer, loss)
    kerasmp.policy.workers.check_workers_agree(model, strategy)
    ```
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        gatherer = _tf_gatherer(strategy)
    elif backend == "jax":
        gatherer = _jax_gatherer()
    else:
        gatherer = None
    if gatherer is None:
        return
    task_id, num_workers, all_gather = gatherer
    payload = list(
        json.dumps(worker_settings(model, plan), sort_keys=True).encode("utf-8")
    )
    sizes = all_gather([[task_id, len(payload)]])
    width = int(sizes[:, 1].max())
    padded = [[task_id] + payload + [0] * (width - len(payload))]
    rows = all_gather(padded)
    settings = {}
    for row in rows:
        text = bytes(int(b) for b in row[1:] if b).decode("utf-8")
        settings[int(row[0])] = json.loads(text)
    problems = []
    fields = sorted({f for s in settings.values() for f in s})
    for field in fields:
        values = {w: settings[w].get(field) for w in sorted(settings)}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"worker {w}: {v}" for w, v in values.items())
            problems.append(f"`{field}` differs ({listed})")
    if problems:
        raise ValueError(
            f"kerasmp: the {num_workers} workers of this multi-worker "
            "strategy do not share the same mixed-precision settings: "
            + "; ".join(problems)
            + ". Every worker must build the model under the same dtype "
            "policy and float32 rules, and compile it with the same "
            "loss-scale settings."
        )
