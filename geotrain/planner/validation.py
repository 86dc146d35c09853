"""The planner's predictions next to the measurements [EMJ24] published, and the calibration they rest on.

Two figures per model are calibrated, both on the single-zone 8-VM run (A-8), and everything else is
predicted: ConvNextLarge's A-8 throughput (262 samples/s) and granularity (5.19) fix the hivemind
efficiency and the per-round overhead; RoBERTa-XLM's A-8 speedup (2.75x) and granularity (1.15) fix
its efficiency and compute time per round. The rows below that are not marked "calibration" are
predictions of setups the calibration never saw: other continents, other clouds, other GPUs, sizes.

``python -m geotrain.planner.validation`` prints the table that docs/planning.md shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.pricing.catalog import Offer, load_catalog
from geotrain.pricing.egress import load_egress
from geotrain.planner.model import Prediction, Settings, evaluate, transfer_s
from geotrain.planner.network import load_network
from geotrain.planner.profiles import ModelProfile, load_profile

# [EMJ24] figures used here (reference facts: throughput, granularity, costs).
CV_A1_SPS, CV_A8_SPS, CV_A8_G, CV_C8_G = 80.0, 262.0, 5.19, 3.33
NLP_A8_SPEEDUP, NLP_A8_G, NLP_C8_G = 2.75, 1.15, 0.4
PEERS = 8


@dataclass
class Row:
    setup: str
    metric: str
    published: str
    predicted: str
    error: str
    note: str = ""


def calibrate_convnext(profile: ModelProfile, same_zone_gbit_per_s: float, same_zone_rtt_ms: float) -> tuple[float, float]:
    """(hivemind_efficiency, round_overhead_s) from CV A-8: 262 SPS at G = 5.19 on 8 T4 VMs in one zone."""
    round_s = profile.target_batch_size / CV_A8_SPS
    comm_s = round_s / (1 + CV_A8_G)
    compute_s = round_s - comm_s
    efficiency = profile.target_batch_size / (PEERS * compute_s) / CV_A1_SPS
    overhead = comm_s - transfer_s(profile, PEERS, same_zone_gbit_per_s, same_zone_rtt_ms)
    return efficiency, overhead


def calibrate_roberta(profile: ModelProfile, overhead_s: float, same_zone_gbit_per_s: float,
                      same_zone_rtt_ms: float) -> tuple[float, float]:
    """(hivemind_efficiency, T4 samples/s) from NLP A-8: speedup 2.75x over one VM at G = 1.15."""
    efficiency = NLP_A8_SPEEDUP * (1 + NLP_A8_G) / (PEERS * NLP_A8_G)
    comm_s = overhead_s + transfer_s(profile, PEERS, same_zone_gbit_per_s, same_zone_rtt_ms)
    compute_s = NLP_A8_G * comm_s
    t4 = profile.target_batch_size / (PEERS * compute_s * efficiency)
    return efficiency, t4


def _find(offers: list[Offer], cloud: str, region: str, instance_type: str, spot: bool) -> Offer:
    return next(o for o in offers if (o.cloud, o.region, o.instance_type, o.spot) == (cloud, region, instance_type, spot))


def _pct(predicted: float, published: float) -> str:
    return f"{(predicted / published - 1) * 100:+.1f}%"


def rows() -> list[Row]:
    offers, network, egress = load_catalog(), load_network(), load_egress()
    settings = Settings(spot_interruption_rate=0.0)  # [EMJ24]'s runs had no interruptions
    cv, nlp = load_profile("convnext_large"), load_profile("roberta_xlm")

    def t4(region: str, cloud: str = "gc") -> Offer:
        return _find(offers, cloud, region, "t4-vm", True)

    def run(profile: ModelProfile, counts: dict[Offer, int]) -> Prediction:
        return evaluate(counts, profile, network, egress, settings)

    us, eu, asia, oce = t4("us-central1"), t4("europe-west4"), t4("asia-east1"), t4("australia-southeast1")
    setups = {
        "A-1": {us: 1}, "A-2": {us: 2}, "A-8": {us: 8}, "B-8": {us: 4, eu: 4},
        "C-8": {us: 2, eu: 2, asia: 2, oce: 2},
        "D-8": {us: 3, t4("us-east-1", "aws"): 3, t4("eastus", "azure"): 2},
    }
    cvp = {name: run(cv, counts) for name, counts in setups.items()}
    nlpp = {name: run(nlp, counts) for name, counts in setups.items() if name in ("A-1", "A-8", "B-8", "C-8")}
    a10 = run(cv, {_find(offers, "lambda", "us-lambda", "gpu_1x_a10", False): 8})
    dgx = run(cv, {_find(offers, "onprem", "onprem-us", "dgx-2", True): 1})

    table = []
    a8 = cvp["A-8"].samples_per_second
    table += [
        Row("CV A-8 (8xT4, one zone)", "samples/s", "262", f"{a8:.1f}", _pct(a8, 262), "calibration"),
        Row("CV A-8", "granularity", "5.19", f"{cvp['A-8'].granularity:.2f}", _pct(cvp["A-8"].granularity, 5.19),
            "calibration"),
        Row("CV A-8 vs A-1", "speedup", "3.2x", f"{a8 / cvp['A-1'].samples_per_second:.2f}x",
            _pct(a8 / cvp["A-1"].samples_per_second, 3.2)),
        Row("CV A-2", "per-GPU speedup", "0.48-0.78", f"{cvp['A-2'].samples_per_second / 2 / CV_A1_SPS:.2f}",
            _pct(cvp["A-2"].samples_per_second / 2 / CV_A1_SPS, 0.48), "error against the low end"),
        Row("CV B-8 (US+EU)", "samples/s", "256.8 (A-8 -2%)", f"{cvp['B-8'].samples_per_second:.1f}",
            _pct(cvp["B-8"].samples_per_second, 262 * 0.98)),
        Row("CV C-8 (US/EU/ASIA/AUS)", "samples/s", "243.7 (A-8 -7%)", f"{cvp['C-8'].samples_per_second:.1f}",
            _pct(cvp["C-8"].samples_per_second, 262 * 0.93)),
        Row("CV C-8", "granularity", "3.33", f"{cvp['C-8'].granularity:.2f}", _pct(cvp["C-8"].granularity, 3.33)),
        Row("CV D-8 (GC+AWS+Azure, US)", "change vs A-8", "-1% to -2%",
            f"{(cvp['D-8'].samples_per_second / a8 - 1) * 100:+.1f}%", "within" if
            -2.0 <= (cvp["D-8"].samples_per_second / a8 - 1) * 100 <= -1.0 else "outside", "3+3+2 VMs assumed"),
        Row("CV 8xA10 (LambdaLabs)", "samples/s", "621", f"{a10.samples_per_second:.1f}",
            _pct(a10.samples_per_second, 621), "same-zone link of unmeasured clouds"),
    ]
    a8_cost = cvp["A-8"].usd_per_million_samples
    published_a8_cost = 8 * us.price_usd_per_hour / (262 * 3600) * 1e6
    published_c8_cost = 8 * us.price_usd_per_hour / (262 * 0.93 * 3600) * 1e6
    c8_vm_cost = cvp["C-8"].vm_usd_per_hour / (cvp["C-8"].samples_per_second * 3600) * 1e6
    table += [
        Row("CV A-8 on GC spot", "$ per 1M samples", f"{published_a8_cost:.3f}", f"{a8_cost:.3f}",
            _pct(a8_cost, published_a8_cost), "calibration; published: Table 1 price / measured SPS"),
        Row("CV C-8 on GC spot", "VM $ per 1M samples", f"{published_c8_cost:.3f}", f"{c8_vm_cost:.3f}",
            _pct(c8_vm_cost, published_c8_cost),
            f"egress adds ${cvp['C-8'].egress_usd_per_hour:.2f}/h (${cvp['C-8'].usd_per_million_samples:.2f} per 1M in all)"),
        Row("CV 8xT4 spot vs DGX-2 spot", "$ per sample", "-58%",
            f"{(a8_cost / dgx.usd_per_million_samples - 1) * 100:+.0f}%",
            f"{(a8_cost / dgx.usd_per_million_samples - 1) * 100 + 58:+.0f} pts"),
    ]
    n_a8 = nlpp["A-8"].samples_per_second
    table += [
        Row("NLP A-8 vs A-1", "speedup", "2.75x", f"{n_a8 / nlpp['A-1'].samples_per_second:.2f}x",
            _pct(n_a8 / nlpp["A-1"].samples_per_second, 2.75), "calibration"),
        Row("NLP A-8", "granularity", "1.15", f"{nlpp['A-8'].granularity:.2f}", _pct(nlpp["A-8"].granularity, 1.15),
            "calibration"),
        Row("NLP B-8 (US+EU)", "change vs A-8", "-22%", f"{(nlpp['B-8'].samples_per_second / n_a8 - 1) * 100:+.1f}%",
            f"{(nlpp['B-8'].samples_per_second / n_a8 - 1) * 100 + 22:+.1f} pts"),
        Row("NLP C-8 (US/EU/ASIA/AUS)", "change vs A-8", "-41%",
            f"{(nlpp['C-8'].samples_per_second / n_a8 - 1) * 100:+.1f}%",
            f"{(nlpp['C-8'].samples_per_second / n_a8 - 1) * 100 + 41:+.1f} pts"),
        Row("NLP C-8", "granularity", "0.4", f"{nlpp['C-8'].granularity:.2f}", _pct(nlpp["C-8"].granularity, 0.4)),
        Row("NLP C-8 on GC spot", "egress share of cost", "over 90%",
            f"{nlpp['C-8'].egress_usd_per_hour / nlpp['C-8'].usd_per_hour * 100:.0f}%",
            "within" if nlpp["C-8"].egress_usd_per_hour / nlpp["C-8"].usd_per_hour > 0.9 else "outside"),
    ]
    return table


def markdown(table: list[Row]) -> str:
    lines = ["| setup [EMJ24] | metric | published | predicted | error | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.setup} | {r.metric} | {r.published} | {r.predicted} | {r.error} | {r.note} |" for r in table]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
