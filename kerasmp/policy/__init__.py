"""Mixed-precision dtype policies: `kerasmp.Policy` and its float32 rules.

- `policy`: `Policy`, `Float32Override`, the global-policy helpers and the
  float32 hand-back (`hand_back`, `handoff_dtype`).
- `rules`: parsing and saving the float32 rules; `norms`: which layers are
  normalizations and known float16 hazards.
- `saving`: how kerasmp policies are saved and loaded.
- `plan`: the model's one precision plan (`plan_of`: per layer its policy,
  float32 rule, measured move and float8 decision; what `compile`,
  `export`, `check` and `tune` read); `workers`: do all workers of a
  multi-worker job agree on it.
- `report`: `dtype_report`; `stock`: the warning for Keras's own mixed
  policy.

The patches that make Keras honour a `Policy` are in `kerasmp._patches`.
"""

from kerasmp.policy.handback import hand_back
from kerasmp.policy.handback import handoff_dtype
from kerasmp.policy.policy import DEFAULT_FLOAT32_LAYERS
from kerasmp.policy.policy import KNOWN_FLOAT16_HAZARDS
from kerasmp.policy.policy import NORMALIZATION_BY_NAME
from kerasmp.policy.policy import Float32Override
from kerasmp.policy.policy import Policy
from kerasmp.policy.policy import float32_rule
from kerasmp.policy.policy import global_policy
from kerasmp.policy.policy import policy_scope
from kerasmp.policy.policy import set_global_policy
from kerasmp.policy.policy import stored_policy
from kerasmp.policy.rules import parse_rule
from kerasmp.policy.saving import policy_from_saved
from kerasmp.policy.saving import portable_policy_name

__all__ = [
    "DEFAULT_FLOAT32_LAYERS",
    "Float32Override",
    "KNOWN_FLOAT16_HAZARDS",
    "NORMALIZATION_BY_NAME",
    "Policy",
    "float32_rule",
    "global_policy",
    "hand_back",
    "handoff_dtype",
    "parse_rule",
    "policy_from_saved",
    "policy_scope",
    "portable_policy_name",
    "set_global_policy",
    "stored_policy",
]
