import numpy as np
import pytest

from kerasmp.data.pycorpus import batches
from kerasmp.data.pycorpus import load_pycorpus


def test_corpus_is_deterministic_and_holds_out_eval_packages():
    train, ev, meta = load_pycorpus()
    train2, ev2, meta2 = load_pycorpus()
    assert meta["sha256"] == meta2["sha256"]
    assert meta["num_eval_files"] > 0 and len(ev) > 0
    assert len(train) > 10 * len(ev)
    # The held-out json decoder source is not in the training bytes.
    assert b"class JSONDecoder" not in train.tobytes()
    assert b"class JSONDecoder" in ev.tobytes()


def test_batches_are_seeded_next_byte_windows():
    data = np.arange(200, dtype=np.uint8)
    a = next(batches(data, 4, 16, seed=3))
    b = next(batches(data, 4, 16, seed=3))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[0][:, 1:], a[1][:, :-1])


def test_bad_max_bytes_names_argument():
    with pytest.raises(ValueError, match="max_bytes"):
        load_pycorpus(max_bytes=0)
