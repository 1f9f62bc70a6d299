"""The loss-scale rule as a pure function (`kerasmp.optimizer.scale_rule`),
against PyTorch's GradScaler and DeepSpeed's hysteresis written out in plain
Python, on random overflow sequences."""

import math
import random

import numpy as np
import pytest
from keras import ops

from kerasmp.optimizer import ScaleRule
from kerasmp.optimizer import ScaleState
from kerasmp.optimizer import next_state

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)


def _rule(**kw):
    settings = dict(growth_steps=3, growth_factor=2.0, backoff_factor=0.5,
                    hysteresis=1, consecutive_hysteresis=False,
                    min_scale=1.0, max_scale=2.0**24, dynamic=True)
    settings.update(kw)
    return ScaleRule(**settings)


def _start(scale=2.0**10, hysteresis=1):
    return ScaleState(scale=ops.convert_to_tensor(np.float32(scale)),
                      counter=ops.convert_to_tensor(np.int32(0)),
                      budget=ops.convert_to_tensor(np.int32(hysteresis)),
                      total_skipped=ops.convert_to_tensor(np.int32(0)),
                      consecutive=ops.convert_to_tensor(np.int32(0)))


def _torch_grad_scaler(flags, scale, interval, growth, backoff):
    """torch/amp/grad_scaler.py `_amp_update_scale_`, step by step."""
    tracker, out = 0, []
    for finite in flags:
        if not finite:
            scale *= backoff
            tracker = 0
        elif tracker + 1 == interval:
            if math.isfinite(scale * growth):
                scale *= growth
            tracker = 0
        else:
            tracker += 1
        out.append(scale)
    return out


def _deepspeed(flags, scale, interval, hysteresis, consecutive, min_scale):
    """DeepSpeed DynamicLossScaler.update_scale (delayed_shift)."""
    budget, last_overflow, out = hysteresis, -1, []
    for i, finite in enumerate(flags):
        if not finite:
            if budget == 1:
                scale = max(scale / 2, min_scale)
            else:
                budget -= 1
            last_overflow = i
        else:
            if consecutive:
                budget = hysteresis
            if (i - last_overflow) % interval == 0:
                scale *= 2
                if not consecutive:
                    budget = hysteresis
        out.append(scale)
    return out


def _run(rule, flags, start):
    state, scales, skipped = start, [], []
    for finite in flags:
        state, _ = next_state(rule, state, ops.convert_to_tensor(finite))
        scales.append(float(ops.convert_to_numpy(state.scale)))
        skipped.append(bool(ops.convert_to_numpy(state.skipped)))
    return state, scales, skipped


@pytest.mark.parametrize("seed", range(3))
def test_matches_pytorch_grad_scaler_step_for_step(seed):
    rng = random.Random(seed)
    flags = [rng.random() > 0.3 for _ in range(60)]
    rule = _rule(min_scale=2.0**-30, max_scale=None)
    state, scales, skipped = _run(rule, flags, _start())
    assert scales == _torch_grad_scaler(flags, 2.0**10, 3, 2.0, 0.5)
    # The rule says which steps it skipped, and counts them.
    assert skipped == [not f for f in flags]
    assert int(ops.convert_to_numpy(state.total_skipped)) == flags.count(
        False)


@pytest.mark.parametrize("consecutive", [False, True])
def test_hysteresis_matches_deepspeed(consecutive):
    rng = random.Random(7)
    flags = [rng.random() > 0.4 for _ in range(80)]
    rule = _rule(hysteresis=3, consecutive_hysteresis=consecutive,
                 max_scale=None)
    _, scales, _ = _run(rule, flags, _start(hysteresis=3))
    # DeepSpeed grows on the interval counted from the last overflow,
    # which is the growth counter's rule.
    assert scales == _deepspeed(flags, 2.0**10, 3, 3, consecutive, 1.0)


def test_bounds_hold_and_static_mode_keeps_the_scale():
    rule = _rule(min_scale=4.0, max_scale=2.0**11)
    _, scales, _ = _run(rule, [False] * 20, _start())
    assert min(scales) == 4.0
    _, scales, _ = _run(rule, [True] * 20, _start())
    assert max(scales) == 2.0**11
    _, scales, skipped = _run(_rule(dynamic=False), [False, True] * 5,
                              _start())
    assert set(scales) == {2.0**10} and skipped == [True, False] * 5


def test_a_python_flag_builds_only_what_changes():
    state = _start()
    after, reset = next_state(_rule(), state, True)
    assert reset is False
    # Applied step: the total of skipped steps and the hysteresis budget
    # are the very same objects (nothing to write back); the scale may grow.
    assert set(after.changed(state)) == {"counter", "consecutive", "scale"}
    assert after.skipped is False
    after, _ = next_state(_rule(), state, False)
    assert set(after.changed(state)) == {"counter", "consecutive", "scale",
                                         "total_skipped"}
    assert after.skipped is True


def test_a_state_read_back_knows_whether_its_step_was_skipped():
    state = _start()
    for finite in (False, False, True, False):
        state, _ = next_state(_rule(), state, ops.convert_to_tensor(finite))
        values = {f: getattr(state, f) for f in
                  ("scale", "counter", "budget", "total_skipped",
                   "consecutive")}
        read = ScaleState.from_values(values)
        assert bool(ops.convert_to_numpy(read.skipped)) == (not finite)


def test_an_overflow_discards_its_accumulation_window():
    rule = _rule(accumulation_steps=4)
    state = ScaleState(**{**_start().__dict__,
                          "discard": ops.convert_to_tensor(np.int32(0)),
                          "inner_iterations": ops.convert_to_tensor(
                              np.int32(6))})
    # Micro-step 6 is position 2 of the window [4, 8): roll back to 4,
    # ignore the one micro-step left in it, drop the accumulators.
    after, reset = next_state(rule, state, ops.convert_to_tensor(False))
    assert int(ops.convert_to_numpy(after.inner_iterations)) == 4
    assert int(ops.convert_to_numpy(after.discard)) == 1
    assert bool(ops.convert_to_numpy(reset))


@pytest.mark.parametrize("peak, scale, expected", [
    (3.0, 1.0, 2048.0),      # 65504 / (8 * 3) = 2729.3
    (3.0, 4.0, 8192.0),      # unscaled 0.75: 65504 / 6 = 10917.3
    (1e-9, 1.0, 2.0**24),    # capped at max_scale
    (1e4, 1.0, 1.0),         # raised to min_scale (65504 / 8e4 < 1)
    (0.0, 16.0, 16.0),       # all-zero gradients: the scale is kept
])
def test_auto_scale_is_the_largest_power_of_two_with_the_margin(
        peak, scale, expected):
    from kerasmp.optimizer.scale_rule import auto_scale

    picked = auto_scale(_rule(), ops.convert_to_tensor(np.float32(peak)),
                        ops.convert_to_tensor(np.float32(scale)))
    assert float(ops.convert_to_numpy(picked)) == expected
