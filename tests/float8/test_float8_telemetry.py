"""The float8 telemetry math (kerasmp/float8/telemetry.py) against hand
computations and Keras's own float8 functions."""

import math

import keras
import numpy as np
import pytest

from kerasmp.float8 import telemetry as tm

E4M3 = "float8_e4m3fn"
E5M2 = "float8_e5m2"


def test_format_maxima():
    assert tm.format_max(E4M3) == 448.0
    assert tm.format_max(E5M2) == 57344.0


def test_saturation_and_underflow_by_hand():
    # E4M3: max 448; smallest subnormal 2**-9, so |v| < 2**-10 flushes to 0.
    x = np.array([0.0, 1.0, 500.0, -449.0, 448.0, 1e-4, -6e-4, 1.5e-3,
                  np.inf, np.nan], "float32")
    # Saturated: 500, -449, inf (448 itself is representable).
    assert tm.saturation_fraction(x, 1.0, E4M3) == pytest.approx(3 / 10)
    # Flushed: 1e-4, -6e-4 (0 is not "flushed"; 1.5e-3 rounds to 2**-9).
    assert tm.underflow_fraction(x, 1.0, E4M3) == pytest.approx(2 / 10)
    # Scale 2: the values are halved first: only inf saturates, and
    # 1.5e-3 / 2 = 7.5e-4 < 2**-10 flushes too.
    assert tm.saturation_fraction(x, 2.0, E4M3) == pytest.approx(1 / 10)
    assert tm.underflow_fraction(x, 2.0, E4M3) == pytest.approx(3 / 10)
    # E5M2: max 57344, flushes below 2**-17.
    g = np.array([6e4, -57344.0, 1.0, 7e-6, 8e-6, 0.0], "float32")
    assert tm.saturation_fraction(g, 1.0, E5M2) == pytest.approx(1 / 6)
    assert tm.underflow_fraction(g, 1.0, E5M2) == pytest.approx(1 / 6)


def test_fractions_agree_with_keras_quantize_and_dequantize():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-12, 8, 4096))
         ).astype("float32")
    for fmt, scale in ((E4M3, 0.05), (E5M2, 1e-3)):
        qdq = np.asarray(keras.ops.convert_to_numpy(
            keras.quantizers.quantize_and_dequantize(x, scale, fmt,
                                                     "float32")))
        m = tm.format_max(fmt) * scale
        assert tm.saturation_fraction(x, scale, fmt) == pytest.approx(
            np.mean(np.abs(x) > m))
        # Keras clips exactly those values to +-max.
        assert np.all(np.abs(qdq[np.abs(x) > m]) == pytest.approx(m))
        assert tm.underflow_fraction(x, scale, fmt) == pytest.approx(
            np.mean((x != 0) & (qdq == 0)))


def _keras_history(amaxes, length=8):
    """The history Keras keeps after steps with these amaxes."""
    history = keras.ops.zeros((length,), "float32")
    for a in amaxes:
        history = keras.quantizers.compute_float8_amax_history(
            keras.ops.convert_to_tensor(np.array([a], "float32")), history)
    return np.asarray(keras.ops.convert_to_numpy(history))


def test_chronological_order_matches_keras_updates():
    amaxes = [1.0, 2.0, 3.0, 5.0]
    h = _keras_history(amaxes)
    assert h[0] == 5.0
    np.testing.assert_array_equal(tm.chronological(h)[-4:], amaxes)
    wrapped = [float(i) for i in range(1, 12)]
    np.testing.assert_array_equal(
        tm.chronological(_keras_history(wrapped)), wrapped[-8:])


def test_amax_ratio_by_hand():
    # Steps 1 and 2 use the initial scale 1 (amax 448); step 3 uses the
    # scale from step 1's amax (1.0), step 4 from max(1, 1) = 1.
    h = _keras_history([1.0, 1.0, 4.0, 2.0])
    ratios = tm.amax_ratios(h, 4, E4M3)
    assert ratios == pytest.approx([1 / 448, 1 / 448, 4.0, 2.0])
    stats = tm.tensor_stats(0.25, h, E4M3, steps=2)
    assert stats["amax"] == 2.0
    assert stats["amax_history_max"] == 4.0
    assert stats["amax_ratio"] == pytest.approx(4.0)
    assert "saturation" not in stats
    assert tm.tensor_stats(0.25, h, E4M3, steps=1)["amax_ratio"] == (
        pytest.approx(2.0))


def _ratio_by_definition(chrono, j, fmt):
    """Step j's amax over the largest finite amax of the steps before
    j - 1 (448 or 57344 while there is none above 0: the initial scale 1)."""
    if not math.isfinite(chrono[j]):
        return math.nan
    before = [a for a in chrono[:max(0, j - 1)] if math.isfinite(a)]
    used = max(before) if before else 0.0
    return chrono[j] / (used if used > 0 else tm.format_max(fmt))


def test_amax_ratios_match_the_definition_step_by_step():
    """Random histories with zeros, inf and NaN, every window length."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 30))
        amaxes = np.abs(rng.normal(size=n)) * rng.choice([0, 1, 1, 1], n)
        if rng.random() < 0.3:
            amaxes[rng.integers(0, n)] = rng.choice([np.inf, np.nan])
        fmt = E4M3 if rng.random() < 0.5 else E5M2
        steps = int(rng.integers(0, n + 3))
        h = _keras_history(list(amaxes))
        chrono = list(tm.chronological(h))
        expected = [_ratio_by_definition(chrono, j, fmt)
                    for j in range(len(chrono) - min(steps, len(chrono)),
                                   len(chrono))]
        got = tm.amax_ratios(h, steps, fmt)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert (math.isnan(g) and math.isnan(e)) or g == pytest.approx(
                e, rel=1e-12)


def test_classify_order_and_thresholds():
    ok = {"scale": 1.0, "amax": 1.0, "amax_history_max": 1.0,
          "amax_ratio": 1.0, "saturation": 0.0}
    assert tm.classify(ok, 0.01, 2.0) is None
    assert tm.classify({**ok, "amax": math.inf}, 0.01, 2.0)[0] == "nonfinite"
    assert tm.classify({**ok, "saturation": 0.02, "amax_ratio": 9.0},
                       0.01, 2.0) == ("saturation", 0.02, 0.01)
    assert tm.classify({**ok, "amax_ratio": 3.0}, 0.01, 2.0) == (
        "amax_spike", 3.0, 2.0)
