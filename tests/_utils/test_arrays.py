"""kerasmp._utils.arrays.gathered_to_numpy in one process: what `to_numpy`
gives, with no collective (the multi-process gather runs in
tests/policy/test_multiprocess_fit.py, where a `NonFiniteMonitor` replays
a batch split across two JAX processes)."""

import keras
import numpy as np

from kerasmp._utils.arrays import gathered_to_numpy


def test_gathered_to_numpy_reads_variables_tensors_and_arrays():
    values = np.arange(6, dtype="float32").reshape(2, 3)
    for x in (keras.Variable(values), keras.ops.convert_to_tensor(values),
              values):
        got = gathered_to_numpy(x)
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, values)
