"""`kerasmp.tune`: find, by measurement, the fewest layers that must
compute in float32 for an accuracy target (issue 37).

The package is callable: `kerasmp.tune(model, x, target=1e-2)` is
`kerasmp.tune.tune(...)`, so importing its modules never hides the
function.

- `tuner.py`: `tune`, the passes and the report;
- `search.py`: the search, pure (rank, bisect, prune, down a layer tree);
- `apply.py`: layers in float32 by path for one pass, the float32
  reference, the tuned policy;
- `flops.py`: each layer's matmul/conv FLOPs;
- `report.py`: `TuneReport`.
"""

import sys
import types

from kerasmp.tune.report import KeptLayer
from kerasmp.tune.report import TuneReport
from kerasmp.tune.tuner import tune

__all__ = ["KeptLayer", "TuneReport", "tune"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
