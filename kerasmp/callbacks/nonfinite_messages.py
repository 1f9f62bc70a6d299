"""The wording and the log of `kerasmp.callbacks.NonFiniteMonitor`'s events:
`message` (each event's diagnosis, one paragraph), the texts of the
monitor's own warnings, and the JSON Lines log (`jsonable`,
`append_jsonl`). Pure functions of plain values, except `append_jsonl`,
which writes the file.
"""

import json
import math


def message(event, patience, min_scale, fallback_failed=None):
    """The diagnosis of `event`, one paragraph.

    Args:
        event: the event dict (after locating, describing and acting).
        patience: the monitor's `patience`.
        min_scale: the optimizer's minimum loss scale.
        fallback_failed: why the fallback was impossible, or None.
    """
    kind = event["kind"]
    step = event["step"]
    scale = event["loss_scale"]
    nxt = event["next_loss_scale"]
    forward = event.get("overflow_in") == "forward"
    layer = event.get("layer")
    grads = ""
    if event.get("all_gradients_nonfinite"):
        grads = " Every gradient is non-finite."
    elif event.get("variable") and kind != "nonfinite_weights":
        grads = f" First non-finite gradient: {event['variable']!r}."
    where = f" First non-finite layer output: {layer!r}." if layer else ""
    if kind == "calibration":
        text = (
            f"step {step}: gradients overflowed at loss scale {scale:g}; the "
            f"step was skipped and the scale backed off to {nxt:g}. Normal: "
            "the scale starts high and backs off until scaled gradients fit "
            "in float16 (calibration)."
        )
    elif kind == "overflow":
        if forward:
            text = (
                f"step {step}: the forward pass overflowed (the loss or a "
                "layer output is not finite); the step was skipped (weights "
                f"untouched), scale now {nxt:g}. Loss scaling cannot fix a "
                "forward overflow; isolated ones come from unusual batches."
            )
        else:
            text = (
                f"step {step}: non-finite gradients at loss scale {scale:g} "
                "(the loss was finite: the backward pass overflowed); the "
                f"step was skipped (weights untouched), scale now {nxt:g}. "
                "Isolated skips are normal after the scale grows."
            )
        text += where + grads
    elif kind == "stuck":
        if event.get("at_min_scale"):
            why = f"the loss scale is at its minimum ({min_scale:g})"
        else:
            why = (
                f"{event.get('consecutive_skips')} consecutive steps were "
                f"skipped (patience {patience})"
            )
        text = f"step {step}: training is stuck: {why}."
        if forward:
            text += (
                " The forward pass overflows (the loss or a layer output is "
                "not finite), so every gradient is non-finite and no loss "
                "scale can help." + where + grads
            )
            if layer and not event.get("fallback_layers"):
                text += (
                    f" Compute {layer!r} in float32 (e.g. kerasmp.Policy("
                    "float32_layers=...)) or use NonFiniteMonitor("
                    "action='fallback'); check the range of its inputs."
                )
            elif not layer:
                text += (
                    " Check the inputs for inf/NaN or values too large for "
                    "float16, or compute the first layers in float32."
                )
        else:
            text += (
                f" The loss is finite: the backward pass overflows float16 "
                f"at loss scale {scale:g}." + where + grads
            )
            if not event.get("fallback_layers"):
                text += (
                    " Compute the layers near that gradient in float32 "
                    "(kerasmp.Policy(float32_layers=...)), keep activations "
                    "smaller (normalization, clipping), or lower the "
                    "optimizer's min_scale."
                )
    elif kind == "nonfinite_loss":
        text = (
            f"step {step}: the loss is {event['loss']} and the update was "
            "applied (no loss-scale skip)." + where + grads
        )
    else:
        text = (
            f"epoch {event['epoch']}: weights hold inf/NaN (first: "
            f"{event.get('variable')!r})." + where
        )
    if event.get("fallback_layers"):
        text += (
            f" Fallback: {', '.join(event['fallback_layers'])} now computes "
            "in float32; training continues"
        )
        if event.get("loss_scale_reset_to") is not None:
            text += (
                " with the loss scale reset to "
                f"{event['loss_scale_reset_to']:g} (its value before the "
                "skipped steps)"
            )
        text += "."
    elif fallback_failed:
        text += f" Fallback impossible ({fallback_failed}): stopping."
    return "kerasmp.NonFiniteMonitor: " + text


def log_failed_message(log_file, error):
    """The warning when the JSON Lines log cannot be written."""
    return (
        f"kerasmp.NonFiniteMonitor: cannot write to log_file="
        f"{log_file!r} ({error.strerror or error}); events are kept in "
        "`monitor.events` only from now on."
    )


def reset_failed_message(error):
    """The warning when the loss scale cannot be reset after a fallback."""
    return (
        f"kerasmp.NonFiniteMonitor: could not reset the loss scale "
        f"after the fallback ({type(error).__name__}: {error})."
    )


def jsonable(event):
    """`event` with non-finite floats as strings (`"inf"`, `"nan"`): strict
    JSON, which has no inf or NaN."""
    out = {}
    for key, value in event.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        out[key] = value
    return out


def append_jsonl(path, event):
    """Appends `event` to the file at `path` as one line of strict JSON.
    Raises `OSError` when the file cannot be written."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(jsonable(event)) + "\n")
