"""kerasmp's `LossScaleOptimizer` in PyTorch `DistributedDataParallel`: two
ranks (two processes, gloo over 127.0.0.1, CPU) in the custom loop of
Keras's multi-GPU PyTorch guide (the Keras model wrapped in DDP, a torch
loop), with `scale_loss` on the loss, `backward` through DDP (which
averages the gradients over the ranks) and the optimizer applied to DDP's
averaged gradients.

The references are not the code's own output: each rank also trains the
same model in one process on the global batches (both ranks' halves
together), whose weights the DDP run must match within float16 noise; the
overflowing step must leave the weights as they were; the scale after one
skip is `initial_scale * backoff_factor`, by hand; and each settings
mismatch must name the field and both values, written out by hand.
"""

import textwrap

import keras
import numpy as np
import pytest
from _helpers import run_workers

pytestmark = [
    pytest.mark.torch,
    pytest.mark.slow,  # two fresh PyTorch processes: about 40 s
    pytest.mark.skipif(keras.backend.backend() != "torch",
                       reason="runs in the PyTorch pass of tests/run.sh"),
]

STEPS, BATCH, OVERFLOW_STEP = 6, 8, 3
INITIAL_SCALE = 2.0**10

WORKER = textwrap.dedent(
    f"""
    import json, os, sys
    rank = int(sys.argv[1])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[2].split(",")[0]
    import numpy as np
    import torch
    import keras
    import kerasmp

    torch.set_num_threads(1)
    keras.utils.set_random_seed(0)  # the same initial weights every run
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    STEPS, BATCH, OVERFLOW_STEP = {STEPS}, {BATCH}, {OVERFLOW_STEP}

    # The global batches, the same on both ranks; rank r trains on rows
    # [r * BATCH, (r + 1) * BATCH) of each. One input of rank 1's half of
    # step OVERFLOW_STEP is inf.
    rng = np.random.default_rng(0)
    X = rng.normal(size=(STEPS, 2 * BATCH, 16)).astype("float32")
    Y = rng.normal(size=(STEPS, 2 * BATCH, 1)).astype("float32")
    X[OVERFLOW_STEP, BATCH + 2, 0] = np.inf

    def build(policy="mixed_float16", scaled=True, scale={INITIAL_SCALE}):
        with kerasmp.policy_scope(kerasmp.Policy(policy)):
            model = keras.Sequential([
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1),
            ])
        optimizer = keras.optimizers.SGD(0.1)
        if scaled:
            optimizer = kerasmp.LossScaleOptimizer(
                optimizer, initial_scale=scale)
        return model, optimizer

    def step(module, model, optimizer, x, y):
        # The guide's loop, with kerasmp's loss scaling.
        outputs = module(torch.as_tensor(x))
        loss = torch.mean((outputs.float() - torch.as_tensor(y)) ** 2)
        optimizer.scale_loss(loss).backward()
        grads = [v.value.grad for v in model.trainable_variables]
        optimizer.apply(grads, model.trainable_variables)
        for v in model.trainable_variables:
            v.value.grad = None

    def weights(model):
        return [keras.ops.convert_to_numpy(v).tolist()
                for v in model.trainable_variables]

    out = {{}}
    model, optimizer = build()
    kerasmp.check_workers_agree(model, optimizer)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model)
    initial = model.get_weights()  # DDP broadcast rank 0's weights
    for s in range(STEPS):
        if s == OVERFLOW_STEP:
            out["before_overflow"] = weights(model)
        half = slice(rank * BATCH, (rank + 1) * BATCH)
        step(ddp_model, model, optimizer, X[s, half], Y[s, half])
        if s == OVERFLOW_STEP:
            out["after_overflow"] = weights(model)
    out["weights"] = weights(model)
    out["scale"] = optimizer.loss_scale
    out["skipped"] = optimizer.skipped_steps
    out["iterations"] = int(keras.ops.convert_to_numpy(
        optimizer.inner_optimizer.iterations))

    # One process, the global batches, the same initial weights.
    reference, ref_optimizer = build()
    reference.set_weights(initial)
    out["initial"] = weights(reference)
    for s in range(STEPS):
        step(reference, reference, ref_optimizer, X[s], Y[s])
    out["reference"] = weights(reference)
    out["reference_scale"] = ref_optimizer.loss_scale
    out["reference_skipped"] = ref_optimizer.skipped_steps

    # A custom loop's settings check: rank 1 differs in one field.
    for name, mine in {{
        "differ_policy": dict(
            policy=("mixed_float16", "mixed_bfloat16")[rank]),
        "differ_scale": dict(scale=(2.0**15, 2.0**10)[rank]),
        "differ_presence": dict(scaled=(True, False)[rank]),
    }}.items():
        model, optimizer = build(**mine)
        try:
            kerasmp.check_workers_agree(model, optimizer)
            out[name] = "ok"
        except ValueError as e:
            out[name] = str(e)
    torch.distributed.destroy_process_group()
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_workers(
        tmp_path_factory.mktemp("ddp"), WORKER, "torch", timeout=240
    )


def arrays(weights):
    return [np.asarray(w, "float32") for w in weights]


def test_ranks_hold_the_same_weights_and_scale_as_one_process(ranks):
    r0, r1 = ranks
    for a, b in zip(arrays(r0["weights"]), arrays(r1["weights"])):
        np.testing.assert_array_equal(a, b)  # DDP: the same update
    assert r0["scale"] == r1["scale"] == r0["reference_scale"]
    assert r0["skipped"] == r1["skipped"] == r0["reference_skipped"] == 1
    assert r0["iterations"] == r1["iterations"] == STEPS - 1
    # One process on the global batches: the same steps, summed in another
    # order (float16 products, DDP's average of two half-batch means
    # against one mean). Bound: float16's epsilon, 2**-10, absolute, on
    # weights of order 0.1-0.5; measured 5e-5. The training moved every
    # variable by more than that (the one-element output bias least: 1.2e-2
    # to 2.2e-2, 12 to 22 bounds, when the initial weights were unseeded)
    # and the largest by far more, so that the comparison is not vacuous.
    bound = 2.0**-10
    moves = []
    for got, want, start in zip(arrays(r0["weights"]),
                                arrays(r0["reference"]),
                                arrays(r0["initial"])):
        np.testing.assert_allclose(got, want, rtol=0, atol=bound)
        moves.append(np.abs(want - start).max())
    assert min(moves) > 4 * bound and max(moves) > 20 * bound, moves


def test_an_overflow_on_one_rank_skips_the_step_on_both(ranks):
    r0, r1 = ranks
    for rank in (r0, r1):
        for a, b in zip(arrays(rank["before_overflow"]),
                        arrays(rank["after_overflow"])):
            np.testing.assert_array_equal(a, b)  # the step was skipped
        assert rank["skipped"] == 1
        assert rank["scale"] == INITIAL_SCALE * 0.5  # backoff_factor 0.5


def test_different_settings_raise_the_same_error_on_both_ranks(ranks):
    r0, r1 = ranks
    expected = {
        "differ_policy": ("policy", "worker 0: mixed_float16",
                          "worker 1: mixed_bfloat16"),
        "differ_scale": ("loss_scale", "32768.0", "1024.0"),
        "differ_presence": ("loss_scale", "worker 1: none"),
    }
    for name, (field, *values) in expected.items():
        assert r0[name] == r1[name] != "ok", name
        assert f"`{field}` differs" in r0[name], (name, r0[name])
        for value in values:
            assert value in r0[name], (name, value, r0[name])
