"""The planner against [EMJ24], cell by cell: calibrated figures follow from the published ones, every A/B/C
cell of both families stays within issue 15's error bounds, the study's lessons hold, and the committed
validation results are what the shipped inputs predict now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geotrain.planner.profiles import load_profile
from geotrain.planner.validation import (CALIBRATION, FAMILY_PROFILES, MAX_ERROR_BOUND, MEDIAN_ERROR_BOUND, SETUPS,
                                         calibrate, compare, error_statistics, lessons, load_published, predictions,
                                         shipped_inputs, t4_vm)

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "planner_validation.json"


@pytest.fixture(scope="module")
def inputs():
    return shipped_inputs()


@pytest.fixture(scope="module")
def comparisons(inputs):
    figures = load_published()
    return compare(figures, predictions(inputs, figures))


@pytest.mark.parametrize("family", sorted(FAMILY_PROFILES))
def test_shipped_profiles_hold_the_calibrated_values(inputs, family):
    profile = load_profile(FAMILY_PROFILES[family])
    gc = t4_vm(inputs.offers, "gc", "us")
    link = inputs.network.link(gc, gc)
    efficiency, overhead = calibrate(profile, *CALIBRATION[family], link.bandwidth_gbit_per_s, link.rtt_ms)
    assert profile.hivemind_efficiency == pytest.approx(efficiency, abs=1e-4)
    assert profile.round_overhead_s == pytest.approx(overhead, abs=0.01)
    assert profile.target_batch_size == 32768  # [EMJ24]'s TBS for the Fig. 7-9 runs
    assert profile.samples_per_second["T4"] == pytest.approx(CALIBRATION[family][0])


def test_every_published_cell_names_its_source_and_every_setup_is_there():
    figures = load_published()
    assert all(f.source.startswith(("[EMJ24]", "derived: [EMJ24]")) for f in figures)
    for family in FAMILY_PROFILES:
        shown = {f.setup for f in figures if f.family == family and f.quantity == "samples_per_second"}
        assert shown >= set(SETUPS), f"{family}: missing {sorted(set(SETUPS) - shown)}"
    assert not any(f.setup.startswith("D-") for f in figures)  # [EMJ24] has no D-8: its multi-cloud runs are 2+2


def test_errors_per_family_and_quantity_are_within_the_bounds(comparisons):
    stats = error_statistics(comparisons)
    for family in FAMILY_PROFILES:
        for quantity in ("samples_per_second", "usd_per_million_samples", "vm_usd_per_million_samples"):
            median, largest, count = stats[(family, quantity)]
            assert count >= 2
            assert median <= MEDIAN_ERROR_BOUND, (family, quantity, median)
            assert largest <= MAX_ERROR_BOUND, (family, quantity, largest)


def test_prices_are_the_studys(comparisons):
    """Table 1's US prices and Fig. 11b's four-region averages come out of the catalog as published."""
    prices = [c for c in comparisons if c.figure.family == "price"]
    assert len(prices) == 9
    assert all(abs(c.error) < 0.002 for c in prices), [(c.figure.key, c.error) for c in prices]


def test_costs_are_not_checked_against_the_catalog_itself(comparisons):
    """The published A-8 cost is [EMJ24]'s $1.77 (with internal egress), not the catalog's price over throughput."""
    a8 = next(c for c in comparisons if c.figure.key == "cv/A-8/gc/usd_per_million_samples")
    assert a8.figure.value == 1.77
    a2 = next(c for c in comparisons if c.figure.key == "cv/A-2/gc/samples_per_second")
    assert a2.figure.value == 70.1  # the T4 A-2 figure, not the 2xA10 range


@pytest.fixture(scope="module")
def lesson_rows(inputs):
    return lessons(inputs)


@pytest.mark.parametrize("index", range(7))
def test_the_studys_lessons_hold(lesson_rows, index):
    row = lesson_rows[index]
    assert row.holds, f"{row.lesson}: published {row.published}, planner {row.predicted}"


def test_committed_results_are_what_the_inputs_predict_now(comparisons):
    """Rerun `python benchmarks/planner_validation.py` after changing an input, and commit its JSON and table."""
    committed = json.loads(RESULT.read_text())["predictions"]
    fresh = {c.figure.key: c.predicted for c in comparisons}
    assert committed.keys() == fresh.keys()
    for key, value in fresh.items():
        assert committed[key] == pytest.approx(value, rel=1e-9), key
