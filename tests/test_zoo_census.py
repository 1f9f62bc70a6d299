"""The model-zoo census (`benchmarks/zoo_census.py`, docs/zoo.md): its fast
subset in the test process, and the census's own bookkeeping.

The fast subset (`ZooModel.fast`: BERT, Gemma, Qwen3-MoE, DINOv2, ResNet
from keras-hub, VGG16 from keras.applications) runs through the census's
own functions (`benchmarks/zoo/worker.py`): each model is built in float32
(seed 0), then under `kerasmp.set_global_policy("mixed_float16")` with the
same weights, and the kerasmp run is compared with the float32 one: it
builds, its forward pass is finite and within `PARITY_BOUND` of float32
(max |diff| / range of the float32 output), its normalization layers
compute in float32 (`kerasmp.dtype_report`), and three fit steps leave
finite losses and weights with the loss scale logged at every step. Those
are marked slow (CI's slow pass); the rest is cheap.
"""

import sys

import keras
import numpy as np
import pytest
from _helpers import ROOT
from _helpers import keras_hub_or_skip

import kerasmp

keras_hub = keras_hub_or_skip()
sys.path.insert(0, str(ROOT / "benchmarks"))

from zoo import applications  # noqa: E402
from zoo import hub  # noqa: E402
from zoo import report  # noqa: E402
from zoo import spec  # noqa: E402
from zoo import worker  # noqa: E402

MODELS = {**hub.HUB, **applications.APPLICATIONS}
FAST = [name for name, zoo in MODELS.items() if zoo.fast]
PARITY_BOUND = report.PARITY_BOUND  # 2e-2, kerasmp.export's float16 gate


# --------------------------------------------------------------------------
# The fast subset (slow: CI's slow pass)
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", FAST)
def test_kerasmp_run_matches_the_float32_run(name):
    zoo = MODELS[name]
    sets = worker.data(zoo)
    x = sets["parity"]

    keras.config.set_dtype_policy("float32")
    features32, train32 = worker.build(zoo)
    weights = train32.get_weights()
    reference = worker.predict(features32, x)
    fit32 = worker.fit(train32, *sets["fit"])
    # The reference itself: finite, and not so flat that parity is moot.
    assert np.isfinite(reference).all() and fit32["finite"], fit32
    assert np.ptp(reference) > 1e-3

    kerasmp.set_global_policy("mixed_float16")
    features, train = worker.build(zoo, weights)
    assert any(layer.compute_dtype == "float16"
               for _, layer in spec.walk(features))

    forward, _ = worker.forward(features, x, reference)
    assert forward["finite"]
    assert forward["rel_diff"] <= PARITY_BOUND, forward

    norms = worker.norms(features, kerasmp.dtype_report(features))
    assert norms["all_float32"], norms["not_float32"]
    if zoo.source == "keras-hub":
        assert norms["count"] > 0  # their norms were found (VGG16 has none)

    fit = worker.fit(train, *sets["fit"])
    assert isinstance(train.optimizer, kerasmp.LossScaleOptimizer)
    assert fit["steps"] == worker.FIT_STEPS
    assert fit["loss_scale_logged"], fit
    scales = np.asarray(fit["scales"], "float64")
    assert np.isfinite(scales).all() and (scales >= 1).all()
    assert fit["finite"], fit
    # Skipped steps are counted, and every applied step moved the loss
    # scale's record on: at most every step skipped.
    assert 0 <= fit["skipped"] <= worker.FIT_STEPS


# --------------------------------------------------------------------------
# Coverage: every backbone and family has a row, or a reason
# --------------------------------------------------------------------------


def test_every_keras_hub_backbone_has_a_row_or_a_reason():
    names = hub.backbone_names()
    assert len(names) > 70  # keras-hub 0.32 ships 78 names
    for name in names:
        assert name in hub.HUB or name in hub.NO_CONFIG, name
    for name in hub.HUB:
        if name not in hub.EXTRA:
            assert hasattr(keras_hub.models, name), name
    for alias, target in hub.ALIASES.items():
        assert getattr(keras_hub.models, alias) is getattr(
            keras_hub.models, target)


def test_every_applications_family_has_a_row():
    families = {family for _, family, _ in applications.FAMILIES}
    assert families == set(applications.family_names())
    for fn, _, _ in applications.FAMILIES:
        assert hasattr(keras.applications, fn)


def test_the_fast_subset_is_small_and_varied():
    assert 5 <= len(FAST) <= 8
    assert {MODELS[n].source for n in FAST} == {"keras-hub",
                                                 "keras.applications"}


def test_every_row_names_its_inputs():
    for name, zoo in MODELS.items():
        x = spec.draw(zoo.inputs, 3, seed=0)
        arrays = x.values() if isinstance(x, dict) else [x]
        assert all(len(a) == 3 for a in arrays), name


# --------------------------------------------------------------------------
# The census's bookkeeping
# --------------------------------------------------------------------------


def _run(forward_finite=True, fit_finite=True, rel=1e-3, error=None):
    run = {"build": {"ok": True},
           "forward": {"ok": True, "finite": forward_finite,
                       "rel_diff": rel},
           "fit": {"ok": True, "finite": fit_finite,
                   "loss_finite": fit_finite, "skipped": 0}}
    if error:
        run["fit"] = {"ok": False, "error": error, "where": "x.py:1"}
    return run


def test_verdicts_and_counts():
    rows = {
        "works": {"float32": _run(), "stock": _run(), "kerasmp": _run()},
        "fixed": {"float32": _run(),
                  "stock": _run(error="TypeError: float16 x float32"),
                  "kerasmp": _run()},
        "nan": {"float32": _run(), "stock": _run(forward_finite=False),
                "kerasmp": _run(forward_finite=False, rel="inf")},
        "hung": {"float32": _run(), "stock": _run(),
                 "kerasmp": {"timeout": "over 900 s in kerasmp fit"}},
        "off": {"float32": _run(), "stock": _run(rel=0.5),
                "kerasmp": _run(rel=0.5)},
    }
    assert report.verdict(rows["fixed"]["stock"])[0] == "fit"
    assert report.verdict(rows["nan"]["kerasmp"]) == (
        "forward", "non-finite output")
    assert report.verdict(rows["hung"]["kerasmp"])[0] == "timeout"
    counts = report.counts(rows)
    assert counts["float32_trains"] == 5
    assert counts["stock_breaks"] == ["fixed", "nan"]
    assert counts["kerasmp_fixes"] == ["fixed"]
    assert counts["kerasmp_fails"] == ["hung", "nan"]
    assert counts["kerasmp_breaks_stock_ok"] == ["hung"]
    assert counts["kerasmp_parity_off"] == ["off"]
    assert "| works | tf | ok | ok | ok |" in report.markdown_rows(
        {"tensorflow": {"rows": rows}})


def test_parity_figure():
    ref = np.array([0.0, 1.0, 3.0])
    assert spec.rel_diff(ref, ref + 0.03) == pytest.approx(0.01)
    assert spec.rel_diff(ref, np.array([0.0, np.nan, 3.0])) == float("inf")
    assert spec.rel_diff(np.zeros(3), np.full(3, 0.5)) == 0.5


def test_rounded_weights_are_float16_values_and_other_arrays_untouched():
    import zoo_rounding

    weights = [np.array([1.0 + 2.0 ** -12, 1.0 + 2.0 ** -10, 1e-8, 7e4],
                        "float32"), np.arange(3, dtype="int32")]
    rounded = zoo_rounding.round_to_half(weights)
    # float16 keeps 10 bits after the leading one: 1 + 2**-12 rounds to 1,
    # 1 + 2**-10 is kept, 1e-8 underflows to 0, 7e4 overflows to inf.
    np.testing.assert_array_equal(
        rounded[0], np.array([1.0, 1.0 + 2.0 ** -10, 0.0, np.inf], "float32"))
    assert rounded[0].dtype == np.float32
    assert rounded[1] is weights[1]


def test_warmup_counts():
    def warm(a, b):
        return {"ok": True,
                "2**15": {"skipped": a, "finite": True,
                          "first_applied_step": a + 1 if a < 10 else None},
                "auto": {"skipped": b, "finite": True,
                         "first_applied_step": b + 1 if b < 10 else None}}

    rows = {}
    for name, (a, b) in {"m1": (0, 0), "m2": (3, 1), "m3": (10, 2),
                         "m4": (1, 4)}.items():
        rows[name] = {"float32": _run(), "stock": _run(),
                      "kerasmp": {**_run(), "warmup": warm(a, b)}}
    counts = report.counts(rows)
    assert counts["warmup_2**15"]["skipped_median"] == 2
    assert counts["warmup_2**15"]["skipped_max"] == 10
    assert counts["warmup_2**15"]["never_applied"] == 1
    assert counts["warmup_auto"]["skipped_median"] == 1.5
    assert counts["warmup_auto_worse"] == ["m4"]
    assert counts["warmup_auto_better"] == ["m2", "m3"]
    assert "| m3 | tf | 10 | - | 2 | 3 |" in report.warmup_rows(
        {"tensorflow": {"rows": rows}})


def test_export_verdicts():
    def cell(**kw):
        return {"kerasmp": {"export": {"ok": True, "keras": kw}}}

    def word(**kw):
        return report.export_verdict(cell(**kw)["kerasmp"], "keras")[0]

    assert word(written=True, reloaded=True, rel_diff=1e-3) == "ok"
    assert word(written=True, reloaded=True, rel_diff=0.5) == "parity"
    assert word(written=True, reloaded=False) == "reload"
    # kerasmp's own sentence is a refusal ...
    assert word(written=False, error="ValueError: format='onnx' cannot "
                "be written from the JAX backend", raised_in="kerasmp"
                ) == "refused"
    assert word(written=False, error="NotExpressible: layer 'x' ...",
                raised_in="kerasmp") == "refused"
    assert word(written=False, error="ParityError: 0.5 > 0.02",
                raised_in="kerasmp") == "parity"
    # ... a ValueError from a runtime or a converter is a crash.
    assert word(written=False, error="ValueError: Required inputs "
                "(['Mul/y:0']) are missing", raised_in="other") == "crash"
    assert word(written=False, error="KeyError: 'x'",
                raised_in="kerasmp") == "crash"
    # A row whose export-only run built nothing: no verdict, its reason kept.
    row = {"kerasmp": {"export": {"not_run": "kerasmp build: TypeError"}}}
    assert report.export_verdict(row["kerasmp"], "keras") == ("-", None)


def test_describe_says_which_package_raised():
    def raise_here():
        raise ValueError("no")

    try:
        raise_here()
    except ValueError as e:
        described = worker.describe(e)
    assert described["error"] == "ValueError: no"
    assert described["raised_in"] == "other"  # this test file


def test_an_export_off_on_a_flat_output_is_flat_and_counted_per_format():
    def row(f32_range, rel):
        run = _run()
        run["export"] = {"ok": True,
                         "keras": {"written": True, "reloaded": True,
                                   "rel_diff": rel},
                         "onnx": {"written": False, "raised_in": "other",
                                  "error": "ValueError: onnxruntime ..."}}
        f32 = _run()
        f32["forward"]["range"] = f32_range
        return {"float32": f32, "stock": _run(), "kerasmp": run}

    rows = {"flat": row(1e-9, 3.0), "wide": row(2.0, 3.0),
            "fine": row(2.0, 1e-3)}
    counts = report.counts(rows)
    assert counts["exports"]["keras"] == 1
    assert counts["exports_run"] == 3
    assert counts["exports_not_ok"]["keras"] == {"flat": "flat",
                                                 "wide": "parity"}
    assert counts["exports_not_ok"]["onnx"] == {
        "flat": "crash", "wide": "crash", "fine": "crash"}


def test_zoo_md_tune_table_is_generated_from_the_json():
    """docs/zoo.md's `kerasmp.tune` table is `zoo_tune.py --report` of the
    recorded JSON (issue 37 item 5), and each finished row meets 2e-2 or
    says why not."""
    import json

    import zoo_tune

    text = (ROOT / "docs" / "zoo.md").read_text(encoding="utf-8")
    begin, end = "<!-- zoo-tune:begin -->\n", "<!-- zoo-tune:end -->"
    block = text[text.index(begin) + len(begin):text.index(end)]
    assert block.strip() == zoo_tune.report().strip()
    for backend in ("tensorflow", "jax"):
        path = ROOT / "benchmarks" / "results" / f"zoo_tune_{backend}.json"
        for name, row in json.loads(path.read_text())["rows"].items():
            if "error" not in row:
                assert row["after"] <= 2e-2 or row["reason"], name
