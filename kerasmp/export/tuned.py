"""`export(..., keep_float32="tune")`: the fewest float32 layers that pass
the export's parity gate, found by `kerasmp.tune`.

`check` refuses what cannot be tuned, at the call (before any copy);
`kept_by_tune` runs `kerasmp.tune` on the export's parity inputs with the
gate as its target, and keeps the layers it finds in float32 while the
export copies the model: each is given a `Float32Override` under the rule
`"kept by kerasmp.tune"` (`kerasmp.tune.apply.in_float32`), which the
copy's plan reads as a measured move (`kerasmp.export.half.decide`), so
the report's `kept_float32` names them with that reason. The model is
left as it was.
"""

import contextlib

from kerasmp.export.inputs import PREDICT_BATCH
from kerasmp.export.inputs import pack
from kerasmp.policy.plan import plan_of
from kerasmp.tune import tune
from kerasmp.tune.apply import HALF
from kerasmp.tune.apply import governed_tree
from kerasmp.tune.apply import in_float32
from kerasmp.tune.search import expand

TUNE = "tune"


def is_tune(keep_float32):
    """Whether `keep_float32` asks for the tuned layers."""
    return isinstance(keep_float32, str) and keep_float32 == TUNE


def check(model, dtype, max_rel_diff):
    """Raises a ValueError, before any work, where `keep_float32="tune"`
    cannot apply: a float32 export, a model no half-precision kerasmp
    policy of the export's dtype governs, a gate of 0."""
    if dtype == "float32":
        raise ValueError(
            "Invalid `keep_float32`: 'tune' picks the layers a half-"
            "precision export keeps in float32; with dtype='float32' every "
            "layer is float32. Allowed values: None, layer classes and/or "
            "name patterns, or 'tune' with dtype='float16' or 'bfloat16'.")
    governing = plan_of(model).policy
    if governing is None or governing.compute_dtype not in HALF:
        raise ValueError(
            "Invalid `keep_float32`: 'tune' measures the model as kerasmp "
            "computes it, and needs one that a half-precision kerasmp."
            f"Policy governs; {model.name!r} has "
            f"{'no kerasmp policy' if governing is None else governing}. "
            "Pass None or layer classes and/or name patterns instead.")
    if governing.compute_dtype != dtype:
        raise ValueError(
            f"Invalid `keep_float32`: 'tune' measures {model.name!r} as "
            f"its policy computes it ({governing.compute_dtype}), not in "
            f"the export's dtype={dtype!r}: export with "
            f"dtype={governing.compute_dtype!r}, or pass layer classes "
            "and/or name patterns.")
    if not max_rel_diff > 0:
        raise ValueError(
            "Invalid `max_rel_diff` for keep_float32='tune': "
            f"{max_rel_diff!r}. Allowed values: a number > 0 (the target "
            "the layers are tuned for).")


@contextlib.contextmanager
def kept_by_tune(model, arrays, target, tuning):
    """Yields None unless `tuning`; else runs `kerasmp.tune(model, arrays,
    target)` and yields its `TuneReport` with the layers it keeps (and
    the sublayers of a block kept whole) in float32 while the block runs.
    Where the target is not met, nothing more is kept (the gate then
    refuses the artifact, quoting `report.reason`)."""
    if not tuning:
        yield None
        return
    report = tune(model, pack(model, arrays), target=target,
                  batch_size=PREDICT_BATCH)
    tree, layers, tunable = governed_tree(model)
    units = [(k.path, k.whole) for k in report.layers] if report.met else []
    with in_float32(layers, expand(tree, units) & tunable):
        yield report


def note(report):
    """What a `ParityError` adds for a tuned export."""
    if report is None:
        return ""
    if not report.met:
        return (" kerasmp.tune found no float32 layers that meet it: "
                f"{report.reason}.")
    kept = ", ".join(report.float32_layers) or "none"
    return (f" kerasmp.tune kept {kept} in float32, which met it on the "
            f"model ({report.after:.3g}); the artifact computes otherwise.")
