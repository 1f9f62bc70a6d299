"""kerasmp.LossScaleOptimizer under tf.distribute: every replica takes the
same branch and holds the same scale.

MirroredStrategy needs two logical CPUs, configured before TensorFlow starts,
and MultiWorkerMirroredStrategy two worker processes talking over 127.0.0.1,
so each case runs in fresh Python processes; the results come back as JSON.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import run_workers
from _helpers import script_result
from _helpers import subprocess_env

pytestmark = [
    pytest.mark.tensorflow,
    pytest.mark.slow,
    pytest.mark.skipif(
        keras.backend.backend() != "tensorflow",
        reason="tf.distribute strategies",
    ),
]

ROOT = Path(__file__).resolve().parents[2]

COMMON = textwrap.dedent(
    """
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf

    def build_and_fit(strategy, optimizer_fn, x, y, jit, epochs=1):
        import keras
        keras.config.set_dtype_policy("mixed_float16")
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ])
            optimizer = optimizer_fn(keras)
            model.compile(optimizer, "mse", jit_compile=jit)
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
        return model, optimizer

    def replica_values(variable):
        # Every replica's copy of a (mirrored) variable.
        value = variable.value
        parts = getattr(value, "values", (value,))
        return [np.asarray(p.numpy()).tolist() for p in parts]

    def summary(model, optimizer):
        return {
            "scale": replica_values(optimizer.dynamic_scale),
            "iterations": int(optimizer.iterations.numpy()),
            "skipped": getattr(optimizer, "skipped_steps", None),
            "weights": [replica_values(w) for w in model.weights],
            "finite": all(np.isfinite(w).all() for w in model.get_weights()),
        }

    def ours(keras):
        from kerasmp.optimizer import LossScaleOptimizer
        return LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            initial_scale=2.0**10,
            dynamic_growth_steps=1000,
        )

    def stock(keras):
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            initial_scale=2.0**10,
            dynamic_growth_steps=1000,
        )
    """
)

MIRRORED = COMMON + textwrap.dedent(
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    jit = sys.argv[1] == "jit"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    # Batch 0 is split 0..3 -> replica 0, 4..7 -> replica 1. Sample 6
    # overflows float16 in the second replica's shard only.
    x[6] *= 1e6
    out = {}
    if jit:
        # XLA cannot place one program's variables on two CPU devices, for
        # any model (TensorFlow's known issue "tf.Variable on a different
        # device"); record whether that holds, and run the merge-call path
        # under XLA on a one-replica MirroredStrategy.
        try:
            build_and_fit(
                tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
                lambda keras: keras.optimizers.SGD(0.01), x, y, True,
            )
            out["two_device_xla_works"] = True
        except Exception as e:
            out["two_device_xla_works"] = False
            out["two_device_xla_error"] = str(e)[-300:]
        devices = ["/cpu:0"] if not out["two_device_xla_works"] else [
            "/cpu:0", "/cpu:1"]
    else:
        devices = ["/cpu:0", "/cpu:1"]
    default = tf.distribute.get_strategy()
    for name, fn in (("ours", ours), ("stock", stock)):
        out[name + "_single"] = summary(*build_and_fit(default, fn, x, y, jit))
        mirrored = tf.distribute.MirroredStrategy(devices)
        out[name + "_mirrored"] = summary(
            *build_and_fit(mirrored, fn, x, y, jit)
        )
        out["replicas"] = mirrored.num_replicas_in_sync
    print("RESULT " + json.dumps(out))
    """
)

WORKER = COMMON + textwrap.dedent(
    """
    index = int(sys.argv[1])
    ports = sys.argv[2].split(",")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": index},
    })
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    # Keras 3.15's fit under MultiWorkerMirroredStrategy fails for any model
    # (a plain SGD one too), in two places unrelated to loss scaling:
    # - `_maybe_symbolic_build` reduces a PerReplica data batch eagerly,
    #   which raises "Attempt to convert a value (PerReplica...)";
    # - `reduce_per_replica` reduces scalar logs with axis=0, which raises
    #   "Invalid reduction dimension 0 for input with 0 dimensions".
    # Work around both: build before fit, leave `_distribute_strategy` unset
    # (fit then takes the strategy from the scope), reduce logs with axis=None.
    from keras.src.backend.tensorflow import trainer as tf_trainer
    _reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction == "auto" and (
            tf_trainer._collective_all_reduce_multi_worker(strategy)
        ):
            return tf.nest.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None), values
            )
        return _reduce(values, strategy, reduction)

    tf_trainer.reduce_per_replica = reduce_per_replica

    rng = np.random.default_rng(index)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    if index == 1:
        x[:8] *= 1e6  # the first batch overflows on worker 1 only
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
    )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    data = data.with_options(options)
    out = {"replicas": strategy.num_replicas_in_sync}
    # (No stock control here: with the stock optimizer one worker applies
    # and the other skips, so their collectives no longer pair up and the
    # run hangs.)
    for name, fn in (("ours", ours),):
        import keras
        keras.config.set_dtype_policy("mixed_float16")
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ])
            optimizer = fn(keras)
            model.compile(optimizer, "mse")
            optimizer.build(model.trainable_variables)
        model._distribute_strategy = None
        with strategy.scope():
            model.fit(data, epochs=2, verbose=0)
        out[name] = summary(model, optimizer)
    print("RESULT " + json.dumps(out))
    """
)


def _run_script(tmp_path, source, *args, timeout=600):
    script = tmp_path / "script.py"
    script.write_text(source)
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=subprocess_env("tensorflow"),
        timeout=timeout,
    )
    return script_result(proc.stdout, proc.stderr, proc.returncode)


def _same_on_every_replica(summary):
    assert len(set(summary["scale"])) == 1, summary["scale"]
    for copies in summary["weights"]:
        first = np.asarray(copies[0])
        for other in copies[1:]:
            np.testing.assert_array_equal(np.asarray(other), first)


def _weights(summary):
    return [np.asarray(copies[0]) for copies in summary["weights"]]


def test_mirrored_overflow_on_one_replica_skips_on_all(tmp_path):
    out = _run_script(tmp_path, MIRRORED, "nojit")
    assert out["replicas"] == 2
    single, mirrored = out["ours_single"], out["ours_mirrored"]

    # Both replicas skipped the step: same count, same scale, same weights
    # on every replica, and the weights of a single-device run.
    assert mirrored["skipped"] == single["skipped"] == 1
    assert mirrored["iterations"] == single["iterations"] == 7
    assert mirrored["scale"] == single["scale"] * 2 == [512.0, 512.0]
    _same_on_every_replica(mirrored)
    assert mirrored["finite"]
    # float16 sums over 4 samples per replica instead of 8: the same
    # difference as between stock single and mirrored runs without the
    # overflow (about 1e-5), not bitwise.
    for a, b in zip(_weights(mirrored), _weights(single)):
        np.testing.assert_allclose(a, b, atol=5e-5)

    # Reported, not asserted (a later Keras may fix it): Keras 3.15's
    # optimizer applies the all-reduced inf on replica 0.
    print(f"[stock LossScaleOptimizer, mirrored: weights finite = "
          f"{out['stock_mirrored']['finite']}]")


def test_mirrored_with_jit_compile(tmp_path):
    out = _run_script(tmp_path, MIRRORED, "jit")
    if not out["two_device_xla_works"]:
        # Not ours to fix: a plain SGD model fails the same way.
        assert "tfvariable_on_a_different_device" in out["two_device_xla_error"]
    mirrored, single = out["ours_mirrored"], out["ours_single"]
    assert mirrored["skipped"] == single["skipped"] == 1
    assert mirrored["iterations"] == single["iterations"] == 7
    assert mirrored["finite"]
    _same_on_every_replica(mirrored)
    tolerance = 5e-5 if out["replicas"] > 1 else 0
    for a, b in zip(_weights(mirrored), _weights(single)):
        np.testing.assert_allclose(a, b, atol=tolerance, rtol=0)


def test_multi_worker_mirrored_two_processes(tmp_path):
    results = run_workers(tmp_path, WORKER, "tensorflow", timeout=600)
    w0, w1 = results
    assert w0["replicas"] == w1["replicas"] == 2
    ours0, ours1 = w0["ours"], w1["ours"]
    # fit completed on both, with the same scale, counters and weights.
    assert ours0["scale"] == ours1["scale"]
    assert ours0["skipped"] == ours1["skipped"] >= 1
    assert ours0["iterations"] == ours1["iterations"] == 16 - ours0["skipped"]
    assert ours0["finite"] and ours1["finite"]
    for a, b in zip(_weights(ours0), _weights(ours1)):
        np.testing.assert_array_equal(a, b)
