"""Per-layer dtype report: what each layer computes in, and why."""

import dataclasses

import keras

from kerasmp._utils.layers import walk
from kerasmp._utils.table import render_table
from kerasmp.float8.layers import report_reason
from kerasmp.policy.handback import FALLBACK_RULE
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import global_policy
from kerasmp.policy.policy import stored_policy


@dataclasses.dataclass(frozen=True)
class DTypeRow:
    """One layer of a `DTypeReport`."""

    path: str
    layer_class: str
    compute_dtype: str
    variable_dtype: str
    reason: str


class DTypeReport:
    """Rows of `dtype_report`; prints as a table, iterates over rows."""

    def __init__(self, rows):
        self.rows = list(rows)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, path):
        """Returns the row whose path is `path`.

        A bare layer name is accepted when exactly one row ends with it.

        Raises:
            KeyError: No row has that path or name, or several rows end
                with that name (the message lists their paths).
        """
        for row in self.rows:
            if row.path == path:
                return row
        matches = [r for r in self.rows if r.path.rsplit("/", 1)[-1] == path]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise KeyError(
                f"{path!r} is ambiguous: it names {len(matches)} layers "
                f"({', '.join(r.path for r in matches)}). Use the full path."
            )
        raise KeyError(path)

    def to_dict(self):
        return [dataclasses.asdict(r) for r in self.rows]

    def __str__(self):
        return render_table(
            ("path", "class", "compute", "variables", "why"),
            [(r.path, r.layer_class, r.compute_dtype, r.variable_dtype,
              r.reason) for r in self.rows],
            rule="columns", strip=True,
        )

    __repr__ = __str__


def _reason(layer, global_now, from_file):
    float8_reason = report_reason(layer)
    if float8_reason is not None:
        return float8_reason
    resolved = layer.dtype_policy
    if isinstance(resolved, Float32Override):
        if resolved.rule == FALLBACK_RULE:
            return "float32 by NonFiniteMonitor fallback"
        return f"kerasmp override: {resolved.rule}"
    stored = stored_policy(layer)
    if from_file and isinstance(stored, Policy):
        return f"kerasmp policy {stored.name} (saved in the file)"
    if stored == global_now:
        return "global policy"
    if isinstance(stored, Policy):
        # Built under another global policy (`policy_scope`), handed its
        # parent's policy, or loaded from a file: the policy is kerasmp's,
        # whoever set it.
        return f"kerasmp policy {stored.name} (not the global policy now)"
    if getattr(stored, "name", "").startswith("mixed_"):
        # Keras's own mixed policy (`keras.mixed_precision`), global when
        # the layer was built or saved with it: `kerasmp check` warns.
        return f"stock Keras policy {stored.name} (no float32 rules)"
    return "explicit dtype"


def dtype_report(model, from_file=False):
    """Returns the compute and variable dtype of every layer of `model`.

    Args:
        model: A `keras.Model` or `keras.layers.Layer`. Nested layers are
            listed after their parent. Each row's `path` is the layer's path
            from the model root (`kerasmp._utils.layers.walk`), the same
            path the other kerasmp reports use, unique within the model.
        from_file: Whether `model` was just loaded from a file (as
            `kerasmp inspect` does): a layer's kerasmp policy is then
            reported as what the file holds, "kerasmp policy <name> (saved
            in the file)", not against this process's global policy.
            Defaults to False.

    Returns:
        A `DTypeReport`: one `DTypeRow` per layer with `path`, `layer_class`,
        `compute_dtype`, `variable_dtype` and `reason`: "global policy";
        "kerasmp override: <rule>" where the rule says which kind matched
        ("Keras class (LayerNormalization)", "normalization by name
        (T5LayerNorm)", "known float16 hazard (T5MultiHeadAttention)",
        "user rule (name~'head')"); "float32 by NonFiniteMonitor fallback";
        "kerasmp policy <name> (not the global policy now)" for a layer
        built under another kerasmp policy (`policy_scope`, a parent's
        policy, a loaded file); "kerasmp policy <name> (saved in the
        file)" with `from_file=True`; "stock Keras policy <name> (no float32
        rules)" for a layer under Keras's own mixed policy; or "explicit
        dtype". `print()` it for a table.

    Example:

    >>> kerasmp.set_global_policy("mixed_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
    ...                           keras.layers.Softmax()])
    >>> print(kerasmp.dtype_report(model))
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            "`model` must be a keras.Model or keras.layers.Layer. "
            f"Received: {model!r}"
        )
    if not isinstance(from_file, bool):
        raise ValueError(
            f"Invalid `from_file`: {from_file!r}. Allowed values: True, "
            "False.")
    current = global_policy()
    rows = []
    for path, layer in walk(model):
        if isinstance(layer, keras.layers.InputLayer):
            continue
        rows.append(
            DTypeRow(
                path=path,
                layer_class=type(layer).__name__,
                compute_dtype=layer.compute_dtype,
                variable_dtype=layer.variable_dtype,
                reason=_reason(layer, current, from_file),
            )
        )
    return DTypeReport(rows)
