"""How an export compares with its float32 masters: the parity figures of
its outputs (`parity`, from `kerasmp._utils.parity`, which `kerasmp.tune`
shares), its size and the bytes of the weights it stores.
"""

import os

import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp._utils.parity import parity
from kerasmp.export.half import unique_variables

__all__ = ["master_weight_bytes", "measure", "parity", "size"]


def measure(reference, outputs, model, path, baseline, weights):
    """The figures of an `ExportReport` for the artifact at `path`.

    Args:
        reference: The float32 outputs (numpy, flat): the float32 master
            weights computed in float32.
        outputs: The artifact's outputs on the same inputs.
        model: The exported model (its float32 master weights).
        path: The artifact.
        baseline: The same format exported in float32.
        weights: `(path) -> int`: the format's count of the weight bytes
            stored in an artifact.

    Returns:
        A dict of the report's `bytes`, `float32_bytes`, `weight_bytes`,
        `master_weight_bytes`, `weight_ratio`, `max_abs_diff`, `rel_diff`,
        `rel_diffs` and `top1_agreement`.
    """
    p = parity(reference, outputs)
    stored = weights(path)
    master = master_weight_bytes(model)
    return dict(
        bytes=size(path), float32_bytes=size(baseline),
        weight_bytes=stored, master_weight_bytes=master,
        weight_ratio=stored / master if master else float("nan"),
        max_abs_diff=p["max_abs_diff"], rel_diff=p["rel_diff"],
        rel_diffs=tuple(p["rel_diffs"]), top1_agreement=p["top1"],
    )


def size(path):
    """Bytes of the file or folder at `path`."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )


def master_weight_bytes(model):
    """Bytes of `model`'s variables with floats as float32 (the masters)."""
    return sum(
        int(np.prod(v.shape)) * (4 if is_float(v.dtype)
                                 else np.dtype(str(v.dtype)).itemsize)
        for v in unique_variables(model)
    )
