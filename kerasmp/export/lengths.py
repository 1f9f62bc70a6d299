"""Free lengths or the parity inputs' lengths: the input shapes of an
artifact whose converter traces the model's serving function (the
SavedModel from TensorFlow or JAX, ONNX from TensorFlow).

An artifact takes the model's own input shapes, an unknown length
included, where that traces and computes what the model does. Some models
trace only with their lengths known (Python control flow on a length:
keras-hub RWKV-7's `for t in range(T)`, Qwen3.5's GatedDeltaNet), some
convert to a program that fails when run at a free length (keras-hub
GPT-NeoX's rotary reshape in ONNX), and some trace the wrong branch
without an error (jax2tf decides `length == n` as False for a free
length). `free_or_fixed` writes the artifact with free lengths, runs it on
a few parity inputs against the model, and otherwise writes it again with
each unknown length after the batch fixed to the parity inputs' (the
batch stays free), with a warning naming the shapes and why. The TFLite
writer has its own chain (`tflite.convert`: Flex ops, the JAX batch).
"""

import re

from kerasmp.export.inputs import predict
from kerasmp.export.parity import parity
from kerasmp.export.quiet import say

CHECK_ROWS = 4
"""Parity inputs the written artifact is run on against the model."""

CHECK_BOUND = 0.1
"""max |diff| / range above which the artifact computes something else
(the TFLite route checks the same)."""


def static_specs(specs, example):
    """`specs` with each unknown dimension after the batch fixed to the
    matching dimension of `example` (the parity inputs), or None when no
    dimension is unknown or `example` is missing."""
    if example is None:
        return None
    out, changed = [], False
    for (name, shape, dtype), a in zip(specs, example):
        fixed = tuple(a.shape[i] if d is None and i > 0 else d
                      for i, d in enumerate(shape))
        changed |= fixed != tuple(shape)
        out.append((name, fixed, dtype))
    return out if changed else None


def free_or_fixed(write, run, model, specs, example, what):
    """Writes an artifact with `specs`' shapes, or the parity inputs'.

    Args:
        write: `(specs) -> None`: writes the artifact for those shapes.
        run: `(arrays, specs) -> outputs`: runs the written artifact.
        model: What it serves (its outputs are the reference).
        specs: `[(name, batch shape, dtype)]` of its inputs.
        example: The parity inputs (one array per spec), or None (then
            `write(specs)` alone).
        what: The artifact in the warning (`"SavedModel"`).

    Returns:
        The specs written.

    Raises:
        When the free lengths raise and the fixed ones fail too: the fixed
        lengths' error (the free lengths' as its cause), or the free
        lengths' when no length is unknown.
    """
    if example is None:
        write(specs)
        return specs
    failure = _checked(write, run, model, specs, example)
    if failure is None:
        return specs
    fixed = static_specs(specs, example)
    second = None if fixed is None else _checked(write, run, model, fixed,
                                                 example)
    if fixed is None or isinstance(second, Exception):
        if isinstance(failure, Exception):
            # Failing at the parity inputs' lengths too, the fixed
            # lengths' error is the one to show, the free lengths' its
            # cause.
            if isinstance(second, Exception):
                raise second from failure
            raise failure
        write(specs)  # back to the free one: parity says the rest
        return specs
    why = summary(failure) if isinstance(failure, Exception) else failure
    shown = ", ".join(f"{n}: {tuple(s)}" for n, s, _ in fixed)
    say(f"kerasmp.export: the {what} of {getattr(model, 'name', 'model')!r} "
        f"takes inputs of fixed length ({shown}; the batch may vary): with "
        f"free lengths {why}. Pass `sample=` inputs of the length you "
        "serve.")
    return fixed


def _checked(write, run, model, specs, example):
    """None when the artifact written for `specs` runs and computes what
    `model` does on the first `CHECK_ROWS` parity inputs; else the
    exception (writing or running it), or a sentence saying how far off."""
    rows = [a[:CHECK_ROWS] for a in example]
    try:
        write(specs)
        outs = run(rows, specs)
    except Exception as e:  # tracing, converting, writing or running
        return e
    p = parity(predict(model, rows), outs)
    if p["rel_diff"] <= CHECK_BOUND:
        return None
    return (f"it computes something else (max |diff| / range "
            f"{p['rel_diff']:.3g} on {len(rows[0])} inputs)")


def summary(e):
    """One line of what `e` says: an MLIR diagnostic's `error: ...` where
    there is one (TensorFlow's `XlaCallModule` failing to read what jax2tf
    wrote hides it behind a graph-execution preamble), the cause inside
    Keras's "Exception encountered when calling X.call()" with the layer's
    class, else its first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r":\d+: error: ([^\n]+)", text)
    if m:
        return f"{type(e).__name__}: {m.group(1)[:160]}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        m = re.search(r"Exception encountered when calling (\S+?)\.call",
                      line)
        cause = next((x for x in lines[i + 1:] if not x.startswith(
            ("Arguments received", "•"))), None) if m else None
        if cause:
            return f"{type(e).__name__} in {m.group(1)}: {cause[:160]}"
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:160]}"
