"""A byte-level language-modeling corpus from the running Python's stdlib.

Every machine with Python has it, so long fidelity runs (issue 38) need no
download. Files are read in sorted path order; `site-packages`,
`dist-packages`, test folders (`test`, `tests`, `idlelib/idle_test`) and
`__pycache__` are left out. The files of `EVAL_PACKAGES` are held out for
evaluation. The metadata records the Python version and a sha256 of the
bytes, so two recordings can tell whether they trained on the same corpus.

Example:

>>> train, eval_, meta = load_pycorpus(max_bytes=10_000)
>>> train.dtype.name, meta["python_version"][:1]
('uint8', '3')
"""

import hashlib
import os
import platform
import sysconfig

import numpy as np

EVAL_PACKAGES = ("json", "email", "asyncio")
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test",
     "__pycache__"}
)


def _stdlib_files(root):
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(
            os.path.join(dirpath, f) for f in filenames if f.endswith(".py")
        )
    return sorted(files)


def load_pycorpus(eval_packages=EVAL_PACKAGES, max_bytes=None):
    """Loads the stdlib `.py` corpus as (train, eval) uint8 byte arrays.

    Args:
        eval_packages: Top-level stdlib packages whose files are held out.
            Defaults to `EVAL_PACKAGES`.
        max_bytes: If set, a positive int capping each split's size (the
            first bytes in file order). Defaults to `None` (everything).

    Returns:
        `(train_bytes, eval_bytes, metadata)`; metadata holds
        `python_version`, `sha256`, `num_train_files`, `num_eval_files`,
        `eval_packages`.
    """
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
        or max_bytes <= 0
    ):
        raise ValueError(
            "`max_bytes` must be None or a positive int. Received: "
            f"max_bytes={max_bytes!r}"
        )
    root = sysconfig.get_paths()["stdlib"]
    held = tuple(eval_packages)
    train, held_out = [], []
    n_train = n_eval = 0
    digest = hashlib.sha256()
    for path in _stdlib_files(root):
        rel = os.path.relpath(path, root)
        with open(path, "rb") as f:
            data = f.read()
        digest.update(rel.encode() + b"\0" + data)
        if rel.split(os.sep)[0] in held:
            held_out.append(data)
            n_eval += 1
        else:
            train.append(data)
            n_train += 1
    train_bytes = np.frombuffer(b"".join(train), dtype=np.uint8)
    eval_bytes = np.frombuffer(b"".join(held_out), dtype=np.uint8)
    if max_bytes is not None:
        train_bytes = train_bytes[:max_bytes]
        eval_bytes = eval_bytes[:max_bytes]
    meta = {
        "python_version": platform.python_version(),
        "sha256": digest.hexdigest(),
        "num_train_files": n_train,
        "num_eval_files": n_eval,
        "eval_packages": list(held),
    }
    return train_bytes, eval_bytes, meta


def batches(data, batch_size, seq_len, seed=0):
    """Yields seeded `(x, y)` next-byte windows of `data`, forever.

    Args:
        data: 1-D uint8 array from `load_pycorpus`.
        batch_size: Windows per batch.
        seq_len: Bytes per window; `y` is `x` shifted by one byte.
        seed: Seed of the window order. Same seed, same batches.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"`seq_len` must be < len(data) - 1. Received: seq_len={seq_len}"
        )
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        windows = data[starts[:, None] + offsets].astype("int32")
        yield windows[:, :-1], windows[:, 1:]
