"""NonFiniteMonitor's wording and JSON Lines log
(kerasmp/callbacks/nonfinite_events.py): the exact diagnosis of each kind
of event, and strict JSON lines appended to the log."""

import json
import math

import pytest

from kerasmp.callbacks.nonfinite_events import append_jsonl
from kerasmp.callbacks.nonfinite_events import jsonable
from kerasmp.callbacks.nonfinite_events import log_failed_message
from kerasmp.callbacks.nonfinite_events import message
from kerasmp.callbacks.nonfinite_events import reset_failed_message

pytestmark = pytest.mark.torch  # also in the PyTorch pass (conftest.py)

PREFIX = "kerasmp.NonFiniteMonitor: "


def _event(kind, **keys):
    event = {
        "step": 12,
        "epoch": 1,
        "kind": kind,
        "loss_scale": 1024.0,
        "next_loss_scale": 512.0,
        "loss": 0.5,
        "layer": None,
        "variable": None,
    }
    event.update(keys)
    return event


# (id, event, fallback_failed, expected text after the prefix)
MESSAGES = [
    (
        "calibration",
        _event("calibration"),
        None,
        "step 12: gradients overflowed at loss scale 1024; the step was "
        "skipped and the scale backed off to 512. Normal: the scale starts "
        "high and backs off until scaled gradients fit in float16 "
        "(calibration).",
    ),
    (
        "overflow in the forward pass, located",
        _event(
            "overflow",
            overflow_in="forward",
            layer="sm",
            all_gradients_nonfinite=True,
        ),
        None,
        "step 12: the forward pass overflowed (the loss or a layer output "
        "is not finite); the step was skipped (weights untouched), scale "
        "now 512. Loss scaling cannot fix a forward overflow; isolated ones "
        "come from unusual batches. First non-finite layer output: 'sm'. "
        "Every gradient is non-finite.",
    ),
    (
        "overflow in the backward pass",
        _event("overflow", overflow_in="backward", variable="d/kernel"),
        None,
        "step 12: non-finite gradients at loss scale 1024 (the loss was "
        "finite: the backward pass overflowed); the step was skipped "
        "(weights untouched), scale now 512. Isolated skips are normal "
        "after the scale grows. First non-finite gradient: 'd/kernel'.",
    ),
    (
        "stuck after patience, forward, located",
        _event(
            "stuck",
            overflow_in="forward",
            consecutive_skips=10,
            at_min_scale=False,
            layer="sm",
        ),
        None,
        "step 12: training is stuck: 10 consecutive steps were skipped "
        "(patience 10). The forward pass overflows (the loss or a layer "
        "output is not finite), so every gradient is non-finite and no "
        "loss scale can help. First non-finite layer output: 'sm'. Compute "
        "'sm' in float32 (e.g. kerasmp.Policy(float32_layers=...)) or use "
        "NonFiniteMonitor(action='fallback'); check the range of its "
        "inputs.",
    ),
    (
        "stuck at min_scale, forward, not located",
        _event("stuck", overflow_in="forward", at_min_scale=True),
        None,
        "step 12: training is stuck: the loss scale is at its minimum (2). "
        "The forward pass overflows (the loss or a layer output is not "
        "finite), so every gradient is non-finite and no loss scale can "
        "help. Check the inputs for inf/NaN or values too large for "
        "float16, or compute the first layers in float32.",
    ),
    (
        "stuck, backward",
        _event("stuck", overflow_in="backward", consecutive_skips=10),
        None,
        "step 12: training is stuck: 10 consecutive steps were skipped "
        "(patience 10). The loss is finite: the backward pass overflows "
        "float16 at loss scale 1024. Compute the layers near that gradient "
        "in float32 (kerasmp.Policy(float32_layers=...)), keep activations "
        "smaller (normalization, clipping), or lower the optimizer's "
        "min_scale.",
    ),
    (
        "stuck, fallback done with the scale reset",
        _event(
            "stuck",
            overflow_in="forward",
            consecutive_skips=10,
            layer="sm",
            fallback_layers=["sm"],
            loss_scale_reset_to=2048.0,
        ),
        None,
        "step 12: training is stuck: 10 consecutive steps were skipped "
        "(patience 10). The forward pass overflows (the loss or a layer "
        "output is not finite), so every gradient is non-finite and no "
        "loss scale can help. First non-finite layer output: 'sm'. "
        "Fallback: sm now computes in float32; training continues with the "
        "loss scale reset to 2048 (its value before the skipped steps).",
    ),
    (
        "stuck, fallback impossible",
        _event("stuck", overflow_in="backward", consecutive_skips=10),
        "the weights are already non-finite",
        "step 12: training is stuck: 10 consecutive steps were skipped "
        "(patience 10). The loss is finite: the backward pass overflows "
        "float16 at loss scale 1024. Compute the layers near that gradient "
        "in float32 (kerasmp.Policy(float32_layers=...)), keep activations "
        "smaller (normalization, clipping), or lower the optimizer's "
        "min_scale. Fallback impossible (the weights are already "
        "non-finite): stopping.",
    ),
    (
        "non-finite loss",
        _event("nonfinite_loss", loss=float("nan"), layer="proj"),
        None,
        "step 12: the loss is nan and the update was applied (no "
        "loss-scale skip). First non-finite layer output: 'proj'.",
    ),
    (
        "non-finite weights: the gradient is not repeated",
        _event("nonfinite_weights", variable="proj/kernel", layer="proj"),
        None,
        "epoch 1: weights hold inf/NaN (first: 'proj/kernel'). First "
        "non-finite layer output: 'proj'.",
    ),
]


@pytest.mark.parametrize(
    "event, fallback_failed, expected",
    [case[1:] for case in MESSAGES],
    ids=[case[0] for case in MESSAGES],
)
def test_message(event, fallback_failed, expected):
    text = message(
        event, patience=10, min_scale=2.0, fallback_failed=fallback_failed
    )
    assert text == PREFIX + expected


def test_warning_texts():
    error = OSError(28, "No space left on device")
    assert log_failed_message("/x/e.jsonl", error) == (
        PREFIX + "cannot write to log_file='/x/e.jsonl' (No space left on "
        "device); events are kept in `monitor.events` only from now on."
    )
    assert reset_failed_message(ValueError("bad")) == (
        PREFIX + "could not reset the loss scale after the fallback "
        "(ValueError: bad)."
    )


def test_jsonable_spells_nonfinite_floats():
    event = {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1.5, "e": 3}
    assert jsonable(event) == {
        "a": "inf",
        "b": "-inf",
        "c": "nan",
        "d": 1.5,
        "e": 3,
    }
    assert list(jsonable(event)) == list(event)
    assert event["a"] == math.inf  # a copy


def test_append_jsonl_appends_strict_json_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    append_jsonl(path, {"step": 1, "loss": math.nan, "layer": None})
    append_jsonl(str(path), {"step": 2, "loss": 0.25})

    def strict(constant):
        raise ValueError(f"not strict JSON: {constant}")

    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line, parse_constant=strict) for line in lines] == [
        {"step": 1, "loss": "nan", "layer": None},
        {"step": 2, "loss": 0.25},
    ]
    assert lines[0] == '{"step": 1, "loss": "nan", "layer": null}'
    with pytest.raises(OSError):
        append_jsonl(tmp_path, {"step": 3})  # a directory
