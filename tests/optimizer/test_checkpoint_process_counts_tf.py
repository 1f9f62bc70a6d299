"""Checkpoints cross process counts (TensorFlow): a `.keras` file written by
two `tf.distribute.MultiWorkerMirroredStrategy` workers (two processes on
127.0.0.1, `TF_CONFIG`, CPU) resumes in one process without a strategy, and
one written by a one-process run resumes in two workers, with kerasmp's
`mixed_float16` policy and its `LossScaleOptimizer` around Adam (two slots
per weight).

Each run trains STEPS global batches of 2 * B samples in two `fit` calls,
saving after the first FIRST steps; each worker feeds its half of every
global batch (`distribute_datasets_from_function`, one replica per worker),
the one-process run both halves in one batch. An inf in worker 1's half of
an early step makes `skipped_steps` 1 before the save. Only the chief
(worker 0) calls `model.save`: in Keras 3 saving reads each variable's
local copy and runs no collective, so worker 1 goes straight on to the next
`fit` (a save on worker 1 to the same path would race the chief's).

The references are the writers' own states at the save (what a resume must
hold, exactly: weights, Adam's m and v, scale, skipped count, iterations)
and the uninterrupted runs of the writing process count (what the next
steps must give). Across process counts the float16 gradients are summed in
another order (per worker, then across), so after the resume the weights
agree with the uninterrupted run within float16 reduction noise, stated as
in tests/optimizer/test_checkpoint_process_counts.py (the JAX version):
|w - w_ref| <= 2**-8 * max|w_ref - w_save| over all weights; the scale,
skipped count and iterations exactly.

Each phase's processes run at once (the two-worker and the one-process
writers, then both resumes) and are killed after a timeout: a hang fails
the test in bounded time.
"""

import textwrap

import keras
import pytest
from _helpers import assert_close_next_steps
from _helpers import assert_same_training_state
from _helpers import free_ports
from _helpers import run_scripts

pytestmark = [
    pytest.mark.tensorflow,
    pytest.mark.slow,  # six fresh TensorFlow processes, three at a time
    pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                       reason="tf.distribute strategies"),
]

B, FIRST, STEPS, OVERFLOW_STEP = 8, 4, 8, 1
TIMEOUT = 240

WORKER = textwrap.dedent(
    f"""
    import json, os, sys
    mode, out = sys.argv[1], sys.argv[2]
    index = int(sys.argv[3])  # one of two workers; -1: on its own
    if index >= 0:
        os.environ["TF_CONFIG"] = json.dumps({{
            "cluster": {{"worker": [f"127.0.0.1:{{p}}"
                                   for p in sys.argv[4].split(",")]}},
            "task": {{"type": "worker", "index": index}},
        }})
    import numpy as np
    import tensorflow as tf
    import keras
    import kerasmp

    B, FIRST, STEPS, K = {B}, {FIRST}, {STEPS}, {OVERFLOW_STEP}
    if index >= 0:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        assert strategy.num_replicas_in_sync == 2
    else:
        strategy = tf.distribute.get_strategy()
    kerasmp.set_global_policy(kerasmp.Policy("mixed_float16"))

    def local(v):
        # The variable's value in this process (a mirrored variable's
        # local copy), as a list.
        return np.asarray(v.numpy()).tolist()

    def state(model):
        opt = model.optimizer
        return {{
            "weights": [local(v) for v in model.weights],
            # A loaded model's slots drop the model's name from their
            # paths, as on JAX.
            "optimizer": {{v.path.replace("/sequential_", "/"): local(v)
                          for v in opt.variables}},
            "scale": float(opt.loss_scale),
            "skipped": int(opt.skipped_steps),
            "iterations": int(opt.iterations.numpy()),
        }}

    rng = np.random.default_rng(0)
    parts = rng.normal(size=(2, STEPS * B, 16)).astype("float32")
    parts[1, K * B + 3, 2] = np.inf  # worker 1's half of step K
    targets = np.where(np.isfinite(parts[..., :1]), parts[..., :1], 0.0) * 0.5

    def fit(model, steps):
        # `steps` (a range of global steps) of fit on this process's data.
        start, stop = steps.start * B, steps.stop * B
        if index < 0:  # global batch s = worker 0's half, then worker 1's
            x = np.concatenate([parts[:, s * B:(s + 1) * B].reshape(2 * B, 16)
                                for s in steps])
            y = np.concatenate([targets[:, s * B:(s + 1) * B]
                                .reshape(2 * B, 1) for s in steps])
            model.fit(x, y, batch_size=2 * B, shuffle=False, verbose=0)
            return
        x, y = parts[index, start:stop], targets[index, start:stop]

        def halves(context):  # this worker's half of each global batch
            assert context.input_pipeline_id == index
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(B)

        data = strategy.distribute_datasets_from_function(halves)
        # Keras 3.15's fit under MultiWorkerMirroredStrategy needs the
        # workarounds of tests/optimizer/test_optimizer_distributed.py
        # (a built model, the strategy taken from the scope).
        model._distribute_strategy = None
        with strategy.scope():
            model.fit(data, verbose=0)

    from keras.src.backend.tensorflow import trainer as tf_trainer
    _reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        # Keras 3.15 reduces scalar logs with axis=0 under a multi-worker
        # strategy (an error); with axis=None it works.
        if reduction == "auto" and (
            tf_trainer._collective_all_reduce_multi_worker(strategy)
        ):
            return tf.nest.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None), values
            )
        return _reduce(values, strategy, reduction)

    tf_trainer.reduce_per_replica = reduce_per_replica

    if mode == "write":
        init = np.random.default_rng(1)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu", name="hidden"),
                keras.layers.Dense(1, name="head"),
            ])
            # The same initial weights in every run.
            for v in model.weights:
                v.assign(init.normal(size=v.shape).astype("float32") * 0.3)
            model.compile(kerasmp.LossScaleOptimizer(
                keras.optimizers.Adam(0.01), initial_scale=1024.0), "mse")
            model.optimizer.build(model.trainable_variables)
    else:  # resume the other process count's checkpoint
        name = "one.keras" if index >= 0 else "two.keras"
        with strategy.scope():
            model = keras.models.load_model(os.path.join(out, name))
    result = {{}}
    if mode == "write":
        fit(model, range(FIRST))
        # The chief alone saves (no collective in Keras 3's save).
        if index <= 0:
            model.save(os.path.join(out, "one.keras" if index < 0
                                    else "two.keras"))
    result["saved"] = state(model)
    fit(model, range(FIRST, STEPS))
    result["final"] = state(model)
    print("RESULT " + json.dumps(result))
    """
)


def _run(tmp_path, mode):
    """Runs `mode` ("write" or "resume") in two workers and in one process at
    once; returns ([worker 0's, worker 1's result], the one process's)."""
    script = tmp_path / f"{mode}.py"
    script.write_text(WORKER)
    ports = ",".join(map(str, free_ports(2)))
    results = run_scripts(
        script, [[mode, tmp_path, i, ports] for i in (0, 1, -1)],
        "tensorflow", TIMEOUT)
    return results[:2], results[2]


def test_checkpoints_resume_across_process_counts(tmp_path):
    # The writers: two workers (the chief writes two.keras) and one process
    # (one.keras).
    two, one = _run(tmp_path, "write")
    assert_same_training_state(two[0]["saved"], two[1]["saved"])
    assert_same_training_state(two[0]["final"], two[1]["final"])
    for run in two[0], one:  # the inf skipped one step before the save
        assert run["saved"]["skipped"] == 1
        assert run["saved"]["iterations"] == FIRST - 1
        assert run["final"]["iterations"] == STEPS - 1
    assert {p.split("/")[-1] for p in one["saved"]["optimizer"]} >= {
        "hidden_kernel_momentum", "hidden_kernel_velocity"}

    # Run at once: the two workers resume one.keras, one process two.keras.
    back, resumed = _run(tmp_path, "resume")

    assert_same_training_state(resumed["saved"], two[0]["saved"])
    assert_close_next_steps(resumed["final"], two[0]["final"], two[0]["saved"])

    assert_same_training_state(back[0]["final"], back[1]["final"])
    assert_same_training_state(back[0]["saved"], one["saved"])
    assert_same_training_state(back[1]["saved"], one["saved"])
    assert_close_next_steps(back[0]["final"], one["final"], one["saved"])
