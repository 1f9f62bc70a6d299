"""What `kerasmp.check` reports, and what every check reads.

`Finding` (one precision hazard) and `CheckReport` (the findings, as a table
or JSON); `dtype_name` and `checked_layers`, shared by the static checks
(`kerasmp.debug.hazards`) and the traced run (`kerasmp.debug.traced_run`).
"""

import dataclasses
import json

import keras

from kerasmp._utils.table import render_table
from kerasmp.policy.plan import plan_of

SEVERITIES = ("error", "warning", "info")
HALF = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One precision hazard.

    Attributes:
        severity: `"error"`, `"warning"` or `"info"`.
        code: A short stable name, e.g. `"epsilon_underflow"`.
        path: The layer's path in the model (or a variable's path, or `""`
            for the whole model).
        message: What was found.
        why: Why it matters.
        fix: What to do.
    """

    severity: str
    code: str
    path: str
    message: str
    why: str
    fix: str


class CheckReport:
    """The findings of `check`; prints as a table, iterates over findings.

    Attributes:
        findings: The `Finding`s, errors first.
        notes: What the check could not do (e.g. no sample input), if any.
    """

    def __init__(self, findings, notes=()):
        order = {s: i for i, s in enumerate(SEVERITIES)}
        self.findings = sorted(findings, key=lambda f: order[f.severity])
        self.notes = list(notes)

    def __iter__(self):
        return iter(self.findings)

    def __len__(self):
        return len(self.findings)

    @property
    def clean(self):
        """Whether there is nothing to report."""
        return not self.findings

    @property
    def has_errors(self):
        """Whether a finding has severity `"error"` (`kerasmp check` then
        exits 1)."""
        return any(f.severity == "error" for f in self.findings)

    def codes(self):
        """The set of finding codes."""
        return {f.code for f in self.findings}

    def to_dict(self):
        return {"clean": self.clean, "errors": sum(
            f.severity == "error" for f in self.findings),
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "notes": self.notes}

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self):
        if self.clean:
            lines = ["kerasmp check: no precision hazards found" + (
                " by the checks that ran (see the notes)." if self.notes
                else ".")]
        else:
            lines = [render_table(
                ("severity", "finding", "layer", "what"),
                [(f.severity, f.code, f.path or "(model)", f.message)
                 for f in self.findings],
                rule="columns", strip=True)]
            # Each finding is one row above; below, why and fix once per
            # kind of finding (one kind, many layers), and a fix per layer
            # where they differ (the padding of each size).
            groups = {}
            for f in self.findings:
                groups.setdefault((f.code, f.why), []).append(f)
            for (code, why), found in groups.items():
                where = list(dict.fromkeys(f.path or "(model)" for f in found))
                fixes = list(dict.fromkeys(
                    (f.path or "(model)", f.fix) for f in found))
                lines.append("")
                lines.append(
                    f"{code} ({found[0].severity}; "
                    + (where[0] if len(where) == 1
                       else f"{len(where)} layers") + "):")
                lines.append(f"  why: {why}")
                if len({fix for _, fix in fixes}) == 1:
                    lines.append(f"  fix: {fixes[0][1]}")
                else:
                    lines.append("  fix:")
                    lines += [f"    {path}: {fix}" for path, fix in fixes]
        if self.notes:
            lines.append("")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def dtype_name(x):
    """The standardized dtype name of `x` (a tensor or variable), or None
    when it has none Keras knows."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        return None


def checked_layers(model):
    """`(path, layer)` of every layer of `model` but its `InputLayer`s, as
    its plan lists them (`kerasmp.policy.plan.plan_of`)."""
    return [(p, layer) for p, layer in plan_of(model).walk()
            if not isinstance(layer, keras.layers.InputLayer)]
