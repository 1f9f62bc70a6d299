"""The parity figure: how far outputs are from a float32 reference.

Pure numpy, shared by `kerasmp.export` (its report and gate) and
`kerasmp.tune` (the error of a set of float32 layers), so that `tune`,
which `export(keep_float32="tune")` calls, imports nothing of `export`.
"""

import numpy as np


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
