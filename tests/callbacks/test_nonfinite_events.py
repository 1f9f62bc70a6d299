"""The classification rules of NonFiniteMonitor
(kerasmp/callbacks/nonfinite_events.py).

Pure functions, so no model and no fit: each table row is a state and one
step's record in, and the state and event verdict out, written by hand from
the rules the `NonFiniteMonitor` docstring states (calibration while a fresh
optimizer backs off, overflow, stuck after `patience` consecutive skips or
at `min_scale`, a non-finite loss on an applied step, broken weights).
"""

import numpy as np
import pytest

from kerasmp.callbacks.nonfinite_events import Rules
from kerasmp.callbacks.nonfinite_events import SkipRun
from kerasmp.callbacks.nonfinite_events import State
from kerasmp.callbacks.nonfinite_events import Verdict
from kerasmp.callbacks.nonfinite_events import after_scale_reset
from kerasmp.callbacks.nonfinite_events import classify
from kerasmp.callbacks.nonfinite_events import classify_logged_loss
from kerasmp.callbacks.nonfinite_events import classify_weights
from kerasmp.callbacks.nonfinite_events import describe
from kerasmp.callbacks.nonfinite_events import forget_run
from kerasmp.callbacks.nonfinite_events import new_event
from kerasmp.callbacks.nonfinite_events import start
from kerasmp.callbacks.nonfinite_events import weights_event

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

RULES = Rules(patience=3, scaled=True, dynamic=True, min_scale=1.0)


def row(skipped, consecutive, scale, total, forward=False):
    """A step record as `_train_step.rows(model)` gives it."""
    return {
        "skipped": skipped,
        "consecutive": consecutive,
        "total": total,
        "scale": scale,
        "forward": forward,
    }


def skip(run_length, at_min=False, loss_finite=True):
    return (
        ("consecutive_skips", run_length),
        ("at_min_scale", at_min),
        ("loss_finite", loss_finite),
    )


LOSS = (("loss_finite", False),)

# (id, state before, record, rules, state after, verdict or None)
CLASSIFY = [
    (
        "applied step: nothing to record",
        State(scale=1024.0, skipped=3),
        row(False, 0, 1024.0, 3),
        RULES,
        State(scale=1024.0, skipped=3),
        None,
    ),
    (
        "applied step: the scale and count come from the record",
        State(scale=1024.0, skipped=3),
        row(False, 0, 2048.0, 3),
        RULES,
        State(scale=2048.0, skipped=3),
        None,
    ),
    (
        "applied step ends the run of skips and calibration",
        State(
            scale=256.0,
            skipped=7,
            calibrating=True,
            last_consecutive=4,
            base=2,
            run=SkipRun(start_scale=1024.0, forward=True, layer="a"),
            stuck=True,
        ),
        row(False, 0, 256.0, 7),
        RULES,
        State(scale=256.0, skipped=7),
        None,
    ),
    (
        "applied step with a non-finite loss",
        State(scale=1024.0),
        row(False, 0, 1024.0, 0, forward=True),
        RULES,
        State(scale=1024.0, loss_ok=False),
        Verdict("nonfinite_loss", 1024.0, True, True, False, LOSS),
    ),
    (
        "non-finite loss: once per epoch",
        State(scale=1024.0, loss_ok=False),
        row(False, 0, 1024.0, 0, forward=True),
        RULES,
        State(scale=1024.0, loss_ok=False),
        None,
    ),
    (
        "non-finite loss without loss scaling: no scale",
        State(),
        row(False, 0, 0.0, 0, forward=True),
        Rules(patience=3, scaled=False),
        State(loss_ok=False),
        Verdict("nonfinite_loss", None, True, True, False, LOSS),
    ),
    (
        "calibration: a fresh optimizer backs off",
        State(scale=2.0**24, calibrating=True),
        row(True, 1, 2.0**23, 1),
        RULES,
        State(
            scale=2.0**23,
            skipped=1,
            calibrating=True,
            last_consecutive=1,
            run=SkipRun(start_scale=2.0**24),
        ),
        Verdict("calibration", 2.0**24, False, False, False, skip(1)),
    ),
    (
        "calibration is not stuck past patience",
        State(
            scale=2.0**20,
            skipped=4,
            calibrating=True,
            last_consecutive=4,
            run=SkipRun(start_scale=2.0**24),
        ),
        row(True, 5, 2.0**19, 5),
        RULES,
        State(
            scale=2.0**19,
            skipped=5,
            calibrating=True,
            last_consecutive=5,
            run=SkipRun(start_scale=2.0**24),
        ),
        Verdict("calibration", 2.0**20, False, False, False, skip(5)),
    ),
    (
        "a forward overflow ends calibration",
        State(scale=2.0**24, calibrating=True),
        row(True, 1, 2.0**23, 1, forward=True),
        RULES,
        State(
            scale=2.0**23,
            skipped=1,
            last_consecutive=1,
            run=SkipRun(start_scale=2.0**24),
        ),
        Verdict(
            "overflow", 2.0**24, False, True, False, skip(1, loss_finite=False)
        ),
    ),
    (
        "calibration reaching min_scale is stuck",
        State(scale=1.0, calibrating=True),
        row(True, 1, 1.0, 1),
        RULES,
        State(
            scale=1.0,
            skipped=1,
            calibrating=True,
            last_consecutive=1,
            run=SkipRun(start_scale=1.0),
            stuck=True,
        ),
        Verdict("stuck", 1.0, True, True, True, skip(1, at_min=True)),
    ),
    (
        "first skip of a run: overflow, located",
        State(scale=1024.0, skipped=2),
        row(True, 1, 512.0, 3),
        RULES,
        State(
            scale=512.0,
            skipped=3,
            last_consecutive=1,
            run=SkipRun(start_scale=1024.0),
        ),
        Verdict("overflow", 1024.0, False, True, False, skip(1)),
    ),
    (
        "second skip of a run: overflow, not located again",
        State(
            scale=512.0,
            skipped=3,
            last_consecutive=1,
            run=SkipRun(start_scale=1024.0, layer="a"),
        ),
        row(True, 2, 256.0, 4),
        RULES,
        State(
            scale=256.0,
            skipped=4,
            last_consecutive=2,
            run=SkipRun(start_scale=1024.0, layer="a"),
        ),
        Verdict("overflow", 512.0, False, False, False, skip(2)),
    ),
    (
        "patience consecutive skips: stuck, acts, reports the run",
        State(
            scale=256.0,
            skipped=4,
            last_consecutive=2,
            run=SkipRun(start_scale=1024.0),
        ),
        row(True, 3, 128.0, 5),
        RULES,
        State(
            scale=128.0,
            skipped=5,
            last_consecutive=3,
            run=SkipRun(start_scale=1024.0),
            stuck=True,
        ),
        Verdict("stuck", 256.0, True, True, True, skip(3)),
    ),
    (
        "still stuck: recorded, acts only once",
        State(
            scale=128.0,
            skipped=5,
            last_consecutive=3,
            run=SkipRun(start_scale=1024.0),
            stuck=True,
        ),
        row(True, 4, 64.0, 6),
        RULES,
        State(
            scale=64.0,
            skipped=6,
            last_consecutive=4,
            run=SkipRun(start_scale=1024.0),
            stuck=True,
        ),
        Verdict("stuck", 128.0, False, False, True, skip(4)),
    ),
    (
        "at min_scale: stuck before patience",
        State(scale=1.0, skipped=9),
        row(True, 1, 1.0, 10),
        RULES,
        State(
            scale=1.0,
            skipped=10,
            last_consecutive=1,
            run=SkipRun(start_scale=1.0),
            stuck=True,
        ),
        Verdict("stuck", 1.0, True, True, True, skip(1, at_min=True)),
    ),
    (
        "below min_scale counts as at it",
        State(scale=0.5),
        row(True, 1, 0.5, 1),
        RULES,
        State(
            scale=0.5,
            skipped=1,
            last_consecutive=1,
            run=SkipRun(start_scale=0.5),
            stuck=True,
        ),
        Verdict("stuck", 0.5, True, True, True, skip(1, at_min=True)),
    ),
    (
        "a static scale is never at its minimum",
        State(scale=1.0),
        row(True, 1, 1.0, 1),
        Rules(patience=3, dynamic=False, min_scale=1.0),
        State(
            scale=1.0,
            skipped=1,
            last_consecutive=1,
            run=SkipRun(start_scale=1.0),
        ),
        Verdict("overflow", 1.0, False, True, False, skip(1)),
    ),
    (
        "patience 1: the first skip is stuck",
        State(scale=1024.0),
        row(True, 1, 512.0, 1),
        Rules(patience=1),
        State(
            scale=512.0,
            skipped=1,
            last_consecutive=1,
            run=SkipRun(start_scale=1024.0),
            stuck=True,
        ),
        Verdict("stuck", 1024.0, True, True, True, skip(1)),
    ),
    (
        "after a fallback the run counts from the fallback (base)",
        State(scale=256.0, skipped=5, last_consecutive=5, base=5),
        row(True, 6, 128.0, 6),
        RULES,
        State(
            scale=128.0,
            skipped=6,
            last_consecutive=6,
            base=5,
            run=SkipRun(start_scale=256.0),
        ),
        Verdict("overflow", 256.0, False, True, False, skip(1)),
    ),
    (
        "after a fallback: patience skips again make it stuck",
        State(
            scale=64.0,
            skipped=7,
            last_consecutive=7,
            base=5,
            run=SkipRun(start_scale=256.0),
        ),
        row(True, 8, 32.0, 8),
        RULES,
        State(
            scale=32.0,
            skipped=8,
            last_consecutive=8,
            base=5,
            run=SkipRun(start_scale=256.0),
            stuck=True,
        ),
        Verdict("stuck", 64.0, True, True, True, skip(3)),
    ),
    (
        "the optimizer's count restarting starts a new run (base 0)",
        State(
            scale=64.0,
            skipped=7,
            last_consecutive=7,
            base=5,
            run=SkipRun(start_scale=256.0),
        ),
        row(True, 2, 32.0, 8),
        RULES,
        State(
            scale=32.0,
            skipped=8,
            last_consecutive=2,
            run=SkipRun(start_scale=256.0),
        ),
        Verdict("overflow", 64.0, False, False, False, skip(2)),
    ),
    (
        "a run without a record of its start: first in run",
        State(scale=64.0, last_consecutive=1),
        row(True, 2, 32.0, 2),
        RULES,
        State(
            scale=32.0,
            skipped=2,
            last_consecutive=2,
            run=SkipRun(start_scale=64.0),
        ),
        Verdict("overflow", 64.0, False, True, False, skip(2)),
    ),
]


@pytest.mark.parametrize(
    "state, record, rules, expected_state, expected",
    [case[1:] for case in CLASSIFY],
    ids=[case[0] for case in CLASSIFY],
)
def test_classify(state, record, rules, expected_state, expected):
    new_state, verdict = classify(state, record, rules)
    assert verdict == expected
    assert new_state == expected_state


def test_classify_a_run_start_to_end():
    """Calibration, applied steps, a run of skips growing to stuck, acted on
    once, then an applied step: the kinds a fit records, step by step."""
    state = start(RULES, scale=4.0, skipped=0, fresh=True)
    records = [
        row(True, 1, 2.0, 1),  # calibration
        row(False, 0, 2.0, 1),  # applied: calibration over
        row(True, 1, 1.0, 2),  # overflow (scale 2 > min 1)
        row(True, 2, 1.0, 3),  # at min_scale: stuck, acts
        row(True, 3, 1.0, 4),  # stuck, recorded only
        row(False, 0, 1.0, 4),  # applied: the run ends
        row(True, 1, 1.0, 5),  # at min_scale: stuck, acts again
    ]
    out = []
    for record in records:
        state, verdict = classify(state, record, RULES)
        if verdict is not None:
            out.append((verdict.kind, verdict.actionable, verdict.locate))
    assert out == [
        ("calibration", False, False),
        ("overflow", False, True),
        ("stuck", True, True),
        ("stuck", False, False),
        ("stuck", True, True),
    ]
    assert state.skipped == 5 and state.stuck


@pytest.mark.parametrize(
    "rules, scale, skipped, fresh, expected",
    [
        (RULES, 1024.0, 0, True, State(scale=1024.0, calibrating=True)),
        # Skips already counted: the optimizer calibrated before.
        (RULES, 1024.0, 2, True, State(scale=1024.0, skipped=2)),
        # Updated before (a second fit): no calibration.
        (RULES, 1024.0, 0, False, State(scale=1024.0)),
        # A static scale never calibrates.
        (Rules(patience=3, dynamic=False), 8.0, 0, True, State(scale=8.0)),
    ],
)
def test_start(rules, scale, skipped, fresh, expected):
    assert start(rules, scale, skipped, fresh) == expected


@pytest.mark.parametrize(
    "state, loss, expected_state, expected",
    [
        (
            State(scale=8.0),
            float("nan"),
            State(scale=8.0, loss_ok=False),
            Verdict("nonfinite_loss", 8.0, True, True, False, LOSS),
        ),
        (
            State(),
            float("-inf"),
            State(loss_ok=False),
            Verdict("nonfinite_loss", None, True, True, False, LOSS),
        ),
        (
            State(),
            np.float64("inf"),  # a float subclass
            State(loss_ok=False),
            Verdict("nonfinite_loss", None, True, True, False, LOSS),
        ),
        (State(), 0.25, State(), None),
        (State(), None, State(), None),  # no loss in the logs
        (State(loss_ok=False), float("nan"), State(loss_ok=False), None),
    ],
)
def test_classify_logged_loss(state, loss, expected_state, expected):
    new_state, verdict = classify_logged_loss(state, loss)
    assert verdict == expected
    assert new_state == expected_state


@pytest.mark.parametrize(
    "state, variable, expected_state, expected",
    [
        (
            State(scale=4.0),
            "dense/kernel",
            State(scale=4.0, weights_bad=True),
            Verdict(
                "nonfinite_weights",
                4.0,
                True,
                True,
                False,
                (("variable", "dense/kernel"),),
            ),
        ),
        (State(scale=4.0), None, State(scale=4.0), None),
        # Reported once per fit.
        (State(weights_bad=True), "d/kernel", State(weights_bad=True), None),
    ],
)
def test_classify_weights(state, variable, expected_state, expected):
    new_state, verdict = classify_weights(state, variable)
    assert verdict == expected
    assert new_state == expected_state


def _located(**keys):
    event = {"loss_finite": True, "layer": None, "variable": None}
    event.update(keys)
    return event


# (id, run, event, merge_run, run after, fields)
DESCRIBE = [
    (
        "backward overflow, nothing located",
        SkipRun(start_scale=8.0),
        _located(),
        False,
        SkipRun(start_scale=8.0),
        {"overflow_in": "backward", "all_gradients_nonfinite": None},
    ),
    (
        "non-finite loss: forward, every gradient non-finite",
        SkipRun(start_scale=8.0),
        _located(loss_finite=False, variable="d/kernel"),
        False,
        SkipRun(
            start_scale=8.0,
            forward=True,
            variable="d/kernel",
            all_nonfinite=True,
        ),
        {
            "overflow_in": "forward",
            "all_gradients_nonfinite": True,
            "variable": None,
        },
    ),
    (
        "a located layer means the forward pass",
        SkipRun(start_scale=8.0),
        _located(
            layer="sm", variable="d/kernel", all_gradients_nonfinite=False
        ),
        False,
        SkipRun(
            start_scale=8.0,
            forward=True,
            layer="sm",
            variable="d/kernel",
            all_nonfinite=False,
        ),
        {"overflow_in": "forward", "all_gradients_nonfinite": False},
    ),
    (
        "the run keeps its first layer and gradient",
        SkipRun(start_scale=8.0, layer="a", variable="a/kernel"),
        _located(layer="b", variable="b/kernel"),
        False,
        SkipRun(start_scale=8.0, forward=True, layer="a", variable="a/kernel"),
        {"overflow_in": "forward", "all_gradients_nonfinite": None},
    ),
    (
        "stuck: the event says what the run showed (forward)",
        SkipRun(start_scale=8.0, forward=True, layer="sm", all_nonfinite=True),
        _located(),
        True,
        SkipRun(start_scale=8.0, forward=True, layer="sm", all_nonfinite=True),
        {
            "loss_finite": False,
            "layer": "sm",
            "overflow_in": "forward",
            "all_gradients_nonfinite": True,
            "variable": None,
        },
    ),
    (
        "stuck: the event says what the run showed (backward)",
        SkipRun(start_scale=8.0, variable="d/kernel", all_nonfinite=False),
        _located(),
        True,
        SkipRun(start_scale=8.0, variable="d/kernel", all_nonfinite=False),
        {
            "variable": "d/kernel",
            "overflow_in": "backward",
            "all_gradients_nonfinite": False,
        },
    ),
    (
        "stuck: its own located layer wins over the run's",
        SkipRun(start_scale=8.0, forward=True, layer="a"),
        _located(layer="b", all_gradients_nonfinite=True),
        True,
        SkipRun(start_scale=8.0, forward=True, layer="a", all_nonfinite=True),
        {
            "loss_finite": False,
            "overflow_in": "forward",
            "all_gradients_nonfinite": True,
            "variable": None,
        },
    ),
    (
        "no run",
        None,
        _located(loss_finite=False),
        True,
        None,
        {
            "overflow_in": "forward",
            "all_gradients_nonfinite": True,
            "variable": None,
        },
    ),
]


@pytest.mark.parametrize(
    "run, event, merge_run, expected_run, expected",
    [case[1:] for case in DESCRIBE],
    ids=[case[0] for case in DESCRIBE],
)
def test_describe(run, event, merge_run, expected_run, expected):
    before = dict(event)
    new_run, fields = describe(run, event, merge_run=merge_run)
    assert fields == expected
    assert new_run == expected_run
    assert event == before  # pure: the caller applies the fields


def test_states_after_a_fallback():
    state = State(
        scale=64.0,
        skipped=9,
        calibrating=False,
        last_consecutive=4,
        base=1,
        run=SkipRun(start_scale=512.0, forward=True),
        stuck=True,
    )
    forgotten = forget_run(state)
    assert forgotten == State(scale=64.0, skipped=9, last_consecutive=4, base=4)
    assert after_scale_reset(forgotten, 512.0) == State(
        scale=512.0, skipped=9, calibrating=True, last_consecutive=4, base=4
    )


def test_new_event_keys_and_order():
    """The keys every event (and every JSON line) starts with, in order,
    then the verdict's own."""
    state = State(scale=512.0, skipped=3)
    verdict = Verdict("overflow", 1024.0, False, True, False, skip(1))
    event = new_event(
        verdict, step=7, epoch=1, batch=2, state=state, rules=RULES, loss=0.5
    )
    assert event == {
        "step": 7,
        "epoch": 1,
        "batch": 2,
        "kind": "overflow",
        "loss_scale": 1024.0,
        "next_loss_scale": 512.0,
        "skipped_steps": 3,
        "loss": 0.5,
        "layer": None,
        "variable": None,
        "action": None,
        "consecutive_skips": 1,
        "at_min_scale": False,
        "loss_finite": True,
    }
    assert list(event)[:4] == ["step", "epoch", "batch", "kind"]
    assert list(event)[-3:] == [
        "consecutive_skips",
        "at_min_scale",
        "loss_finite",
    ]
    unscaled = new_event(
        verdict,
        step=np.int64(7),
        epoch=np.int64(0),
        batch=None,
        state=State(),
        rules=Rules(patience=3, scaled=False),
        loss=None,
    )
    assert unscaled["skipped_steps"] is None
    assert type(unscaled["step"]) is int and type(unscaled["epoch"]) is int


def test_weights_event_follows_a_nonfinite_loss():
    loss_event = {
        "step": 3,
        "kind": "nonfinite_loss",
        "layer": "proj",
        "variable": None,
        "weights_finite": False,
        "message": "m",
    }
    weights = weights_event(loss_event, "proj/kernel")
    assert weights == {
        "step": 3,
        "kind": "nonfinite_weights",
        "layer": "proj",
        "variable": "proj/kernel",
        "message": "m",
    }
    assert loss_event["kind"] == "nonfinite_loss"  # a copy
