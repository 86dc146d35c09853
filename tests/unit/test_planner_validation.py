"""The shipped profiles' calibrated figures follow from the published ones, and predictions stay near [EMJ24]."""

from __future__ import annotations

import pytest

from geotrain.pricing.catalog import load_catalog
from geotrain.planner.network import load_network
from geotrain.planner.profiles import load_profile
from geotrain.planner.validation import calibrate_convnext, calibrate_roberta, rows


def same_zone_gc():
    gc = next(o for o in load_catalog() if o.cloud == "gc")
    link = load_network().link(gc, gc)
    return link.bandwidth_gbit_per_s, link.rtt_ms


def test_shipped_profiles_hold_the_calibrated_values():
    cv, nlp = load_profile("convnext_large"), load_profile("roberta_xlm")
    efficiency, overhead = calibrate_convnext(cv, *same_zone_gc())
    assert cv.hivemind_efficiency == pytest.approx(efficiency, abs=1e-4)
    assert cv.round_overhead_s == pytest.approx(overhead, abs=0.01)
    nlp_efficiency, t4 = calibrate_roberta(nlp, cv.round_overhead_s, *same_zone_gc())
    assert nlp.hivemind_efficiency == pytest.approx(nlp_efficiency, abs=1e-4)
    assert nlp.samples_per_second["T4"] == pytest.approx(t4, abs=0.05)


def test_predictions_of_uncalibrated_setups_stay_close_to_published():
    table = {(r.setup, r.metric): r for r in rows()}
    percent = lambda r: float(r.error.rstrip("%"))  # noqa: E731
    points = lambda r: float(r.error.split()[0])  # noqa: E731
    assert abs(percent(table[("CV B-8 (US+EU)", "samples/s")])) < 3
    assert abs(percent(table[("CV C-8 (US/EU/ASIA/AUS)", "samples/s")])) < 3
    assert abs(percent(table[("CV C-8", "granularity")])) < 5
    assert table[("CV D-8 (GC+AWS+Azure, US)", "change vs A-8")].error == "within"
    assert abs(points(table[("NLP B-8 (US+EU)", "change vs A-8")])) < 3
    assert abs(points(table[("NLP C-8 (US/EU/ASIA/AUS)", "change vs A-8")])) < 3
    assert table[("NLP C-8 on GC spot", "egress share of cost")].error == "within"
