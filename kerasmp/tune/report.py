"""`TuneReport`: what `kerasmp.tune` found, as a table or JSON."""

import collections
import dataclasses
import json

from kerasmp._utils.table import render_table

BeforeAfter = collections.namedtuple("BeforeAfter", ("before", "after"))
BeforeAfter.__doc__ = "A figure before tuning and after it."


@dataclasses.dataclass(frozen=True)
class KeptLayer:
    """One layer (or block) `tune` keeps in float32.

    Attributes:
        path: Its path in the model (`kerasmp.dtype_report`'s naming).
        whole: True for a layer kept with all its sublayers, False for its
            own code only.
        error_alone: The error with only this layer (with its sublayers)
            in float32, every other governed layer in half precision; None
            when the search did not rank it alone.
        flop_share: The share of the model's matmul/conv FLOPs it (with
            its sublayers, when `whole`) computes.
    """

    path: str
    whole: bool
    error_alone: object
    flop_share: float


@dataclasses.dataclass(frozen=True)
class TuneReport:
    """What `kerasmp.tune` found.

    Attributes:
        float32_layers: The paths of the layers kept in float32 (a block
            kept whole stands for its sublayers too: see `layers`).
        layers: A `KeptLayer` per entry of `float32_layers`.
        policy: The model's `kerasmp.Policy` with these layers added by
            path (its `measured` entries, rule `"kept by kerasmp.tune"`):
            it serializes and loads like any other; `apply(model)` gives
            it to the model.
        target: The target (the parity figure, or the metric's drop).
        before: The output's max |diff| / range against float32 (the same
            weights computed in float32) as the model is.
        after: The same with `float32_layers` in float32.
        float32_flop_share: `BeforeAfter` of the share of matmul/conv FLOPs
            computed in float32.
        passes: The forward passes spent (each over the whole sample).
        seconds: The time spent.
        met: Whether the target is met.
        reason: Why no set of float32 layers meets the target, or None.
        floor: The parity figure of the float32 model with its weights
            rounded to float16 (the floor of any float16 computation), when
            measured (the target was not met), else None.
        metric: The metric's name in the metric mode, else None.
        metric_values: `{"float32", "before", "after"}` of the metric in
            the metric mode, else None.
    """

    float32_layers: tuple
    layers: tuple
    policy: object
    target: float
    before: float
    after: float
    float32_flop_share: BeforeAfter
    passes: int
    seconds: float
    met: bool
    reason: object = None
    floor: object = None
    metric: object = None
    metric_values: object = None

    def apply(self, model):
        """Gives `model` (the tuned model, or one built like it) the tuned
        policy: each layer whose stored policy is the model's kerasmp
        policy gets `policy`, so the kept layers compute in float32 and a
        saved file keeps them so. Returns `model`."""
        from kerasmp.tune.apply import apply_policy

        return apply_policy(model, self.policy)

    def to_dict(self):
        return {
            "float32_layers": list(self.float32_layers),
            "layers": [dataclasses.asdict(k) for k in self.layers],
            "policy": self.policy.get_config(),
            "target": self.target, "before": self.before,
            "after": self.after,
            "float32_flop_share": {
                "before": self.float32_flop_share.before,
                "after": self.float32_flop_share.after},
            "passes": self.passes, "seconds": round(self.seconds, 3),
            "met": self.met, "reason": self.reason, "floor": self.floor,
            "metric": self.metric, "metric_values": self.metric_values,
        }

    def to_json(self):
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self):
        figure = (f"{self.metric} drop" if self.metric
                  else "max |diff| / range against float32")
        if self.metric:
            v = self.metric_values
            head = (f"kerasmp tune: {self.metric} {v['before']:.4g} -> "
                    f"{v['after']:.4g} (float32: {v['float32']:.4g}; "
                    f"allowed drop {self.target:g})")
        else:
            head = (f"kerasmp tune: {figure} {self.before:.3g} -> "
                    f"{self.after:.3g} (target {self.target:g})")
        lines = [head]
        share = self.float32_flop_share
        lines.append(
            f"float32 share of matmul/conv FLOPs: {share.before:.1%} -> "
            f"{share.after:.1%}; {self.passes} forward passes, "
            f"{self.seconds:.1f} s")
        if self.layers:
            lines.append("")
            lines.append(render_table(
                ("layer kept in float32", "whole layer",
                 "error with only it in float32", "FLOP share"),
                [(k.path, "yes" if k.whole else "no",
                  "-" if k.error_alone is None else f"{k.error_alone:.3g}",
                  f"{k.flop_share:.1%}") for k in self.layers],
                rule="columns", strip=True))
        elif self.met:
            lines.append("no layer needs float32: the target is met as "
                         "the model is")
        if self.reason:
            lines.append(f"not met: {self.reason}")
        return "\n".join(lines)

    __repr__ = __str__
