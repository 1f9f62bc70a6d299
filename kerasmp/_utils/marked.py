"""What kerasmp's per-layer policies share: they remember who set them.

`Float32Override` (`kerasmp.policy`), `Float8Assignment` and
`Float8Fallback` (`kerasmp.float8`) are Keras dtype policies that a
`kerasmp.Policy` gives single layers. Each carries that `Policy` and one
short text saying why the layer has it, so that a saved model reloads with
the same dtypes and `dtype_report` can say why. `Marked` holds the config,
equality, hash and repr all three share; a class names its text attribute
in `WHY` ("rule" or "reason") and keeps that name in its config.

Example:

```python
class Float32Override(Marked, keras.DTypePolicy):
    WHY = "rule"

    def __init__(self, policy, rule):
        super().__init__("float32")
        self.policy = policy
        self.rule = rule
```
"""

import keras


class Marked:
    """Mixin for a dtype policy set on a layer by a `kerasmp.Policy`.

    A subclass sets `policy` (the `kerasmp.Policy`) and the attribute
    named by `WHY` (a short text) in its `__init__(policy, why)`, and lists
    `Marked` before the Keras policy class it extends.
    """

    WHY = "rule"

    def why(self):
        """The text saying why the layer has this policy."""
        return getattr(self, self.WHY)

    def get_config(self):
        return {
            "policy": keras.saving.serialize_keras_object(self.policy),
            self.WHY: self.why(),
        }

    @classmethod
    def from_config(cls, config):
        policy = keras.saving.deserialize_keras_object(config["policy"])
        return cls(policy, config[cls.WHY])

    def __eq__(self, other):
        return (
            type(other) is type(self)
            and other.why() == self.why()
            and other.policy == self.policy
        )

    def __hash__(self):
        return hash((type(self).__name__, self.why()))

    def __repr__(self):
        return f'<kerasmp.{type(self).__name__} "{self.name}" ({self.why()})>'
