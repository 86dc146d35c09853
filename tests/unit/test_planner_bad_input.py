"""Planner inputs that used to end in a traceback or a misleading message: file encodings, a budget
below every configuration, and the MILP solver's time limit."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from geotrain.planner import milp
from geotrain.planner.__main__ import main
from geotrain.errors import UserError
from geotrain.planner.errors import PlannerError, SolverTimeLimitError
from geotrain.planner.milp import Program
from geotrain.planner.model import Settings
from geotrain.planner.network import load_network
from geotrain.planner.problem import Inputs, Request
from geotrain.planner.profiles import ModelProfile
from geotrain.planner.solve import plan
from geotrain.pricing.catalog import DEFAULT_CATALOG, Offer, load_catalog
from geotrain.pricing.egress import load_egress
from geotrain.pricing.errors import InputFileError

SHIPPED = DEFAULT_CATALOG.read_text(encoding="utf-8")


# -- encodings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_without_bom_is_named_through_the_cli(tmp_path, encoding, run_cli):
    catalog = tmp_path / "instances.csv"
    catalog.write_bytes(SHIPPED.encode(encoding))
    result = run_cli("plan", "--profile", "convnext_large", "--catalog", str(catalog))
    assert result.returncode == 2, result.stderr
    assert f"geotrain plan: {catalog}: the file is UTF-16" in result.stderr
    assert 'save it as UTF-8 (in Excel: "CSV UTF-8 (comma delimited)")' in result.stderr
    assert "Traceback" not in result.stderr


def test_utf16_with_bom_and_utf8_with_bom_are_read_by_plan(tmp_path, run_cli):
    utf16 = tmp_path / "unicode.csv"
    utf16.write_bytes(SHIPPED.encode("utf-16"))  # BOM FF FE, as Windows PowerShell's `>` writes
    assert utf16.read_bytes()[:2] == b"\xff\xfe"
    utf8 = tmp_path / "excel.csv"
    utf8.write_bytes(b"\xef\xbb\xbf" + SHIPPED.replace("\n", "\r\n").encode("utf-8"))  # Excel's "CSV UTF-8"
    result = run_cli("plan", "--profile", "convnext_large", "--max-peers", "2", "--catalog", str(utf16))
    assert result.returncode == 0, result.stderr
    assert "Why #1:" in result.stdout and "Traceback" not in result.stderr
    assert main(["plan", "--profile", "convnext_large", "--max-peers", "2", "--catalog", str(utf8)]) == 0


HEADER_LINE = next(number for number, line in enumerate(SHIPPED.splitlines(), start=1) if not line.startswith("#"))
WITHOUT_COMMENTS = "".join(line for line in SHIPPED.splitlines(keepends=True) if not line.startswith("#"))


@pytest.mark.parametrize("text", [SHIPPED, WITHOUT_COMMENTS], ids=["comments first", "header first"])
@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_byte_order_marks_load_like_plain_utf8(tmp_path, text, encoding):
    plain = tmp_path / "plain.csv"
    plain.write_bytes(text.encode("utf-8"))
    path = tmp_path / "instances.csv"
    path.write_bytes(text.encode(encoding))
    offers = load_catalog(path)
    assert offers == load_catalog(plain)
    assert offers[0].cloud == "gc"  # the first column's name was read without the BOM


@pytest.mark.parametrize("data,expected", [
    (SHIPPED.replace(",", "\t").encode("utf-16"),  # Excel's "Unicode text"
     rf":{HEADER_LINE}: the header is separated by tabs, not commas"),
    (SHIPPED.encode("utf-32"), r": the file is UTF-32"),
    (SHIPPED.encode("utf-16")[:-1], r": the file starts with a UTF-16 byte-order mark but is not valid UTF-16"),
    (SHIPPED.encode("utf-8") + "gc,us-central1,us,t4-vm,T4,1,,0.5,0.1,,Preis €\n".encode("cp1252"),
     rf":{len(SHIPPED.splitlines()) + 1}: byte 0x80 \(at byte offset {len(SHIPPED.encode()) + 45}\) is not UTF-8; "
     "the file was probably saved in another encoding"),
    (b"cloud,region\nx\x00\x01,y\n", r":2: the file contains NUL bytes"),
])
def test_other_encodings_name_the_file_and_how_to_save_it(tmp_path, data, expected):
    path = tmp_path / "instances.csv"
    path.write_bytes(data)
    with pytest.raises(InputFileError) as error:
        load_catalog(path)
    assert re.search(re.escape(str(path)) + expected, str(error.value)), str(error.value)
    assert "CSV UTF-8 (comma delimited)" in str(error.value)


# -- a budget below every configuration ------------------------------------------------------------

def test_budget_below_every_configuration_gives_the_cheapest_cost(capsys, run_cli):
    result = run_cli("plan", "--profile", "convnext_large", "--budget-usd-per-hour", "0.01")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "--max-peers" not in result.stderr
    found = re.search(r"no configuration fits the budget \(--budget-usd-per-hour 0.01\): the cheapest one, "
                      r"1x \S+ \S+ (spot|on-demand) with the coordinator .*, costs \$(\d+\.\d{3})/h; "
                      r"raise --budget-usd-per-hour to at least (\d+\.\d\d)$", result.stderr.strip())
    assert found, result.stderr
    cheapest, enough = float(found.group(2)), float(found.group(3))
    assert cheapest <= enough < cheapest + 0.01
    # The suggested budget works; a cent below the cheapest does not.
    assert main(["plan", "--profile", "convnext_large", "--max-peers", "2", "--budget-usd-per-hour", str(enough)]) == 0
    assert f"{cheapest:.3f}" in capsys.readouterr().out
    assert main(["plan", "--profile", "convnext_large", "--budget-usd-per-hour", str(cheapest - 0.01)]) == 2


# -- the solver's time limit -----------------------------------------------------------------------

def knapsack(items: int = 150, constraints: int = 10) -> Program:
    """A multi-dimensional knapsack: HiGHS finds solutions at once but needs well over 10 s to prove one optimal."""
    rng = random.Random(1)
    program = Program()
    xs = [program.binary(cost=-rng.randint(100, 1000)) for _ in range(items)]
    for _ in range(constraints):
        weights = {x: float(rng.randint(100, 1000)) for x in xs}
        program.row(weights, upper=sum(weights.values()) / 2)
    return program


def test_program_tells_time_limit_from_infeasible():
    stopped = knapsack().solve(time_limit_s=1.0)
    assert stopped.status == milp.TIME_LIMIT and stopped.values is not None
    assert stopped.gap is not None and 0 < stopped.gap < 1
    nothing = knapsack().solve(time_limit_s=1e-9)
    assert nothing.status == milp.TIME_LIMIT and nothing.values is None
    infeasible = Program()
    x = infeasible.var(0, 3, integer=True)
    infeasible.row({x: 2.0}, 3, 3)  # 2x = 3 has no whole solution
    assert infeasible.solve().status == milp.INFEASIBLE
    assert infeasible.solve().values is None


PROFILE = ModelProfile(name="test", parameters=200_000_000, bytes_per_parameter=2, target_batch_size=32768,
                       samples_per_second={"T4": 80, "A10": 185}, hivemind_efficiency=0.5, round_overhead_s=20.0)
CATALOG = [Offer(cloud=cloud, region=region, continent=continent, instance_type=f"{gpu.lower()}-vm", gpu=gpu,
                 gpu_count=1, vcpus=None, price_usd_per_hour=price, spot=spot, spot_interruption_rate=None,
                 source="test", line=line)
           for line, (cloud, region, continent, gpu, price, spot) in enumerate([
               ("gc", "us-central1", "us", "T4", 0.18, True), ("gc", "us-central1", "us", "T4", 0.572, False),
               ("gc", "europe-west4", "eu", "T4", 0.15, True), ("aws", "us-east-1", "us", "A10", 0.45, True),
               ("azure", "eastus", "us", "T4", 0.40, False)], start=1)]

QUOTA_ARGS = ["--profile", "convnext_large", "--regions", "us-central1,europe-west4", "--quota", "us-central1=2",
              "--quota", "europe-west4=2", "--max-peers", "4", "--min-samples-per-second", "120"]


def test_time_limit_without_a_solution_is_not_called_infeasible(capsys, run_cli):
    # Only a MILP finds this plan (no VM type alone reaches 120 samples/s within the quotas).
    assert main(["plan", *QUOTA_ARGS]) == 0
    assert "2x gc/europe-west4 t4-vm spot + 2x gc/us-central1 t4-vm spot" in capsys.readouterr().out
    result = run_cli("plan", *QUOTA_ARGS, "--solver-time-limit", "1e-9")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.fullmatch(r"geotrain plan: the solver's time limit was reached: HiGHS stopped (\d+) of \1 MILPs at "
                        r"--solver-time-limit 1e-09 s, \1 of them before finding any solution; no configuration was "
                        r"found, so whether one exists is unknown; raise --solver-time-limit, or make the search "
                        r"smaller: lower --max-peers, or allow fewer offers \(--clouds, --regions, --continents\)",
                        result.stderr.strip()), result.stderr
    assert "out of reach" not in result.stderr
    # Truly infeasible (beyond 4 T4s) keeps naming the constraint.
    assert main(["plan", *QUOTA_ARGS[:-1], "200", "--solver-time-limit", "5"]) == 2
    assert "--min-samples-per-second 200 is out of reach" in capsys.readouterr().err


def test_time_limit_is_its_own_error_naming_the_best_plan_found_so_far(run_cli):
    result = run_cli("plan", "--profile", "convnext_large", "--max-peers", "4", "--solver-time-limit", "1e-9")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line
    found = re.fullmatch(r"geotrain plan: the solver's time limit was reached: HiGHS stopped (\d+) of (\d+) MILPs at "
                         r"--solver-time-limit 1e-09 s, \1 of them before finding any solution; best plan found so "
                         r"far, not proven best: (.+), ([\d.]+) samples/s, \$([\d.]+)/h, \$([\d.]+) per 1M samples; "
                         r"raise --solver-time-limit, .*", result.stderr.strip())
    assert found, result.stderr
    # n = 1 needs no MILP, so the one-VM plans are found; the best of them is named.
    assert found.group(3).startswith("1x ")


def test_a_time_limited_solution_is_not_passed_off_as_the_plan(monkeypatch):
    """HiGHS stopping with a solution (a gap of 5%): the error carries the plan found, and says its gap."""
    solve = Program.solve

    def stopped_early(self, time_limit_s=30.0):
        solution = solve(self, time_limit_s)
        if solution.values is None:
            return solution
        return milp.Solution(milp.TIME_LIMIT, solution.values, gap=0.05)

    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    request = Request(max_peers=5, min_samples_per_second=150, solver_time_limit_s=7)
    exact = plan(inputs, request)
    assert exact.proven_optimal
    monkeypatch.setattr(Program, "solve", stopped_early)
    with pytest.raises(SolverTimeLimitError) as error:
        plan(inputs, request)
    stopped = error.value.best_so_far
    assert isinstance(error.value, UserError) and not stopped.proven_optimal
    assert stopped.time_limited >= 1 and stopped.time_limited_unsolved == 0
    assert stopped.best.samples_per_second >= 150
    assert stopped.best.usd_per_million_samples >= exact.best.usd_per_million_samples * (1 - 1e-9)
    message = str(error.value)
    assert f"HiGHS stopped {stopped.time_limited} of {stopped.programs_solved} MILPs at --solver-time-limit 7 s " \
           "(largest MIP gap when stopped: 5.00%)" in message
    assert f"best plan found so far, not proven best: {stopped.best.describe()}" in message


def test_infeasible_request_is_still_infeasible_not_a_time_limit():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError) as error:
        plan(inputs, Request(max_peers=3, min_samples_per_second=5000))
    assert "is out of reach" in str(error.value) and "time limit" not in str(error.value)


# -- names and lines the planner used to ignore (through `geotrain`'s own entry point) --------------

def refusal(capsys, *argv: str) -> str:
    """What ``geotrain ARGV`` printed when it refused its input: one line, exit code 2."""
    from geotrain.cli import main as geotrain

    code = geotrain(list(argv), embedded=True)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("flags, expected", [
    (["--quota", "us-centrall=2"], "--quota: the catalog has no region 'us-centrall' (did you mean us-central1?)"),
    (["--regions", "us-central1,europe-wes4"],
     "--regions: the catalog has no region 'europe-wes4' (did you mean europe-west4?)"),
    (["--clouds", "gc,awz"], "--clouds: the catalog has no cloud 'awz' (did you mean aws?)"),
])
def test_a_region_or_cloud_the_catalog_lacks_is_refused_with_the_closest_name(capsys, flags, expected):
    err = refusal(capsys, "plan", "--profile", "convnext_large", "--max-peers", "2", *flags)
    assert err.startswith(f"geotrain plan: {expected}; its "), err
    assert "us-central1, " in err or "aws, " in err  # the names the catalog has


def test_a_catalog_line_written_twice_is_refused_naming_both_lines(tmp_path, capsys):
    lines = SHIPPED.splitlines()
    first = next(number for number, line in enumerate(lines, start=1) if line.startswith("gc,us-central1,us,t4-vm,"))
    catalog = tmp_path / "instances.csv"
    catalog.write_text(SHIPPED + lines[first - 1].replace("0.180", "0.120") + "\n")
    err = refusal(capsys, "plan", "--profile", "convnext_large", "--catalog", str(catalog))
    assert err.startswith(f"geotrain plan: {catalog}:{len(lines) + 1}: gc/us-central1 t4-vm is listed twice, at line "
                          f"{first} and at line {len(lines) + 1}; "), err


def test_a_profile_with_a_key_written_twice_is_refused_naming_both_lines(tmp_path, capsys):
    profile = tmp_path / "mine.yaml"
    profile.write_text("name: mine\nparameters: 1000\nbytes_per_parameter: 2\ntarget_batch_size: 64\n"
                       "samples_per_second: {cpu: 10}\nparameters: 2000000\n")
    err = refusal(capsys, "plan", "--profile", str(profile))
    assert "key 'parameters' is written twice, at line 2 and at line 6" in err, err


@pytest.mark.parametrize("flag", ["--budget-usd-per-hour", "--min-samples-per-second", "--train-samples"])
def test_an_infinite_limit_is_refused(capsys, flag):
    err = refusal(capsys, "plan", "--profile", "convnext_large", flag, "inf")
    assert err == f"geotrain plan: {flag} is inf; expected a finite number above 0"


# -- `geotrain profile`: names that are taken, and files that are no run summary -------------------

def write_summary(path: Path, **fields) -> Path:
    path.write_text(json.dumps({
        "task": "cv", "preset": "tiny", "parameters": 300_000, "target_batch_size": 256, "grad_compression": "fp16",
        "device": "cpu", "peers": [{"samples": 1024, "compute_s": 20.0, "comm_s": 4.0}], **fields}))
    return path


def test_a_shipped_profile_name_is_refused_even_with_overwrite(tmp_path, capsys):
    summary = write_summary(tmp_path / "run.json")
    for extra in ([], ["--overwrite"]):
        err = refusal(capsys, "profile", "--from-run", str(summary), "--name", "convnext_large",
                      "--profiles-dir", str(tmp_path / "profiles"), *extra)
        assert "'convnext_large' is a shipped profile" in err and "choose another --name" in err, err
    assert not (tmp_path / "profiles").exists()


def test_an_existing_profile_is_replaced_only_with_overwrite(tmp_path, capsys):
    from geotrain.cli import main as geotrain

    profiles = tmp_path / "profiles"
    first, second = write_summary(tmp_path / "a.json"), write_summary(tmp_path / "b.json", parameters=600_000)
    assert geotrain(["profile", "--from-run", str(first), "--name", "mine", "--profiles-dir", str(profiles)], embedded=True) == 0
    written = (profiles / "mine.yaml").read_text()
    err = refusal(capsys, "profile", "--from-run", str(second), "--name", "mine", "--profiles-dir", str(profiles))
    assert f"a profile named 'mine' already exists ({profiles / 'mine.yaml'}); pass --overwrite" in err, err
    assert (profiles / "mine.yaml").read_text() == written  # nothing lost
    assert geotrain(["profile", "--from-run", str(second), "--name", "mine", "--profiles-dir", str(profiles),
                     "--overwrite"], embedded=True) == 0
    assert "parameters: 600000" in (profiles / "mine.yaml").read_text()


@pytest.mark.parametrize("content, expected", [
    ({"candidates": [], "objective": "throughput"}, "key 'parameters' is missing; expected a whole number"),
    ({"parameters": "many"}, "parameters is 'many'; expected a whole number"),
    ({"parameters": 10, "target_batch_size": 8, "peers": [{"samples": 1}]},
     "peers[0]: key 'compute_s' is missing; expected a number"),
])
def test_a_json_that_is_no_run_summary_says_what_profile_expects(tmp_path, capsys, content, expected):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    err = refusal(capsys, "profile", "--from-run", str(path), "--name", "m", "--profiles-dir", str(tmp_path))
    assert err == (f"geotrain profile: {path}: {expected}; --from-run expects the JSON summary that "
                   "`geotrain local --json PATH` writes"), err
