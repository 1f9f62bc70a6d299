"""Small data sets that ship with kerasmp, so demos never download anything.

`load_digits()` returns the 1797 8x8 handwritten digits (the UCI "Optical
Recognition of Handwritten Digits" test set, CC BY 4.0, as shipped by
scikit-learn; see README.md and LICENSE in this folder).
"""

import importlib.resources

import numpy as np

NUM_DIGITS = 1797


def load_digits(test_fraction=0.2, seed=0):
    """Loads the vendored 8x8 digits, split into train and test sets.

    The split is stratified (the same fraction of each digit goes to the
    test set) and depends only on `seed`, so two runs with the same seed see
    the same images. Images are float32 in [0, 1] with a channel axis.

    Args:
        test_fraction: Fraction of the images held out for testing, in
            (0, 1). Defaults to 0.2 (359 test images).
        seed: Seed of the split. Defaults to 0.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: images of shape
        `(n, 8, 8, 1)` (float32) and labels of shape `(n,)` (int32).

    Example:

    >>> (x, y), (x_test, y_test) = kerasmp.data.load_digits()
    >>> x.shape, x_test.shape
    ((1438, 8, 8, 1), (359, 8, 8, 1))
    """
    if (
        isinstance(test_fraction, bool)
        or not isinstance(test_fraction, (int, float))
        or not 0 < test_fraction < 1
    ):
        raise ValueError(
            "`test_fraction` must be a number in (0, 1). Received: "
            f"test_fraction={test_fraction!r}"
        )
    images, labels = _load_arrays()
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), dtype=bool)
    for digit in range(10):
        idx = np.flatnonzero(labels == digit)
        n_test = int(round(test_fraction * len(idx)))
        test[rng.choice(idx, size=n_test, replace=False)] = True
    x = (images.astype("float32") / 16.0)[..., None]
    y = labels.astype("int32")
    train_idx = rng.permutation(np.flatnonzero(~test))
    test_idx = np.flatnonzero(test)
    return (x[train_idx], y[train_idx]), (x[test_idx], y[test_idx])


def _load_arrays():
    resource = importlib.resources.files(__name__).joinpath("digits.npz")
    with resource.open("rb") as f, np.load(f) as data:
        images, labels = data["images"], data["labels"]
    if images.shape != (NUM_DIGITS, 8, 8) or labels.shape != (NUM_DIGITS,):
        raise RuntimeError(
            "kerasmp/data/digits.npz is damaged: expected images (1797, 8, 8) "
            f"and labels (1797,), found {images.shape} and {labels.shape}."
        )
    return images, labels
