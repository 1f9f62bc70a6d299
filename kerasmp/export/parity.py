"""How an export compares with its float32 masters: the parity figures of
its outputs, its size and the bytes of the weights it stores.
"""

import os

import numpy as np

from kerasmp._utils.arrays import is_float
from kerasmp.export.half import unique_variables


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


def parity(reference, outputs):
    """Compares the artifact's outputs with the float32 reference.

    Returns:
        A dict: `max_abs_diff` (largest |difference| over all outputs),
        `rel_diff` (per output, max |difference| divided by the range of
        the float32 output, max - min, or its largest |value| when that is
        larger (a near-constant output); the worst output's value: a
        scale-free figure, the same for logits of size 30 and probabilities
        of size 1e-3), `rel_diffs` (one per output) and `top1` (fraction of
        rows with the same argmax over the last axis, for outputs with more
        than one unit; None if none). inf where the artifact gives inf/NaN.
    """
    if len(reference) != len(outputs):
        raise ValueError(
            f"The exported model returns {len(outputs)} outputs; the "
            f"original returns {len(reference)}."
        )
    worst, rels, agree = 0.0, [], []
    for r, o in zip(reference, outputs):
        r = r.astype(np.float64)
        o = np.asarray(o).astype(np.float64).reshape(r.shape)
        diff = np.abs(r - o)
        diff[~np.isfinite(diff)] = np.inf
        peak = float(diff.max()) if diff.size else 0.0
        worst = max(worst, peak)
        finite = r[np.isfinite(r)]
        span = (max(float(finite.max() - finite.min()),
                    float(np.abs(finite).max())) if finite.size else 0.0)
        rels.append(peak / span if span > 0 else (0.0 if peak == 0
                                                  else float("inf")))
        if r.ndim >= 2 and r.shape[-1] > 1:
            agree.append((r.argmax(-1) == o.argmax(-1)).ravel())
    top1 = float(np.concatenate(agree).mean()) if agree else None
    return {"max_abs_diff": worst, "rel_diff": max(rels, default=0.0),
            "rel_diffs": rels, "top1": top1}


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
