"""The offline bundle and benchmarks/gpu/run.sh: the GPU benchmark on a machine with no package index.

Proven here the way the GPU machine uses them: the bundle is built for this machine's Python by
benchmarks/gpu/wheelhouse.py (it reaches the package index, as `make wheelhouse` does), then a fresh virtualenv
that has only what the GPU machine has (the packages of benchmarks/gpu/target-packages.txt, taken from this
test's own environment: torch, timm, transformers, torchaudio, numpy, ... but no hivemind) installs it with
run.sh and runs the benchmark's CPU smoke mode, in a network namespace with nothing but loopback when root.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from swarm_helpers import processes_mentioning, wait_for

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "benchmarks" / "gpu" / "wheelhouse.py"
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
TARGET_PACKAGES = ROOT / "benchmarks" / "gpu" / "target-packages.txt"
COMMITTED_RESULTS = ROOT / "benchmarks" / "results" / "gpu_throughput.json"
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def target_distributions(names: set[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions of ``names`` and everything they require, as pip would have installed them."""
    found: dict[str, importlib.metadata.Distribution] = {}
    queue = list(names)
    while queue:
        name = canonicalize_name(queue.pop())
        if name in found:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # the GPU machine has it, this one does not; nothing here needs it
        found[name] = distribution
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append(requirement.name)
    return list(found.values())


def emulate_target(directory: Path) -> Path:
    """A fresh virtualenv holding only the GPU machine's packages (linked from this environment); its python."""
    names = set()
    for line in TARGET_PACKAGES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(line)
    site = directory / "target-site"
    site.mkdir()
    for distribution in target_distributions(names):
        base = Path(distribution.locate_file(""))
        for entry in {Path(str(file)).parts[0] for file in distribution.files or ()}:
            if entry.startswith("..") or entry == "__pycache__" or (site / entry).exists():
                continue
            if (base / entry).exists():
                (site / entry).symlink_to(base / entry)
    environment = directory / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "gpu-machine-packages.pth").write_text(f"{site}\n")
    return python


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse") / "bundle"
    result = subprocess.run([sys.executable, str(WHEELHOUSE), "--python-version", PYTHON_VERSION, "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the bundle did not build:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.fixture(scope="module")
def target_python(tmp_path_factory) -> Path:
    return emulate_target(tmp_path_factory.mktemp("gpu-machine"))


def run_offline(arguments: list[str], directory: Path, python: Path, wheelhouse: Path,
                timeout_s: float = 400) -> subprocess.CompletedProcess:
    """run.sh with ARGUMENTS: as root in a network namespace of its own (loopback only), else plainly."""
    environment = {**os.environ, "PYTHON": str(python), "WHEELHOUSE": str(wheelhouse), "TMPDIR": str(directory),
                   "GEOTRAIN_SITE": str(directory / "site")}
    environment.pop("PYTHONPATH", None)
    command = ["bash", str(RUN), *arguments]
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        command = ["unshare", "--net", "bash", "-c", 'ip link set lo up && exec "$@"', "run", *command]
    return subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=timeout_s,
                          env=environment)


def test_the_bundle_fits_a_device_run_and_brings_what_the_gpu_machine_lacks(wheelhouse):
    manifest = json.loads((wheelhouse / "bundle.json").read_text())
    names = {wheel["name"] for wheel in manifest["wheels"]}
    # hivemind and what the GPU machine's package list lacks; geotrain itself
    assert {"hivemind", "pydantic", "cryptography", "prefetch-generator", "configargparse", "py-multihash",
            "py-cid", "base58", "varint", "netaddr", "webdataset", "geotrain"} <= names
    # nothing the target has: no torch, no second numpy
    assert not names & {"torch", "torchaudio", "timm", "transformers", "numpy", "scipy", "protobuf", "grpcio"}
    assert manifest["python_version"] == PYTHON_VERSION
    assert manifest["total_bytes"] == sum(path.stat().st_size for path in wheelhouse.glob("*.whl"))
    assert manifest["total_bytes"] <= 64 * 2**20
    assert sorted(path.name for path in wheelhouse.glob("*.whl")) == sorted(w["file"] for w in manifest["wheels"])
    hivemind = next(wheel for wheel in manifest["wheels"] if wheel["name"] == "hivemind")
    assert hivemind["file"].startswith("hivemind-1.1.12-")


def test_run_sh_installs_the_bundle_with_no_network_and_runs_the_benchmark(wheelhouse, target_python, tmp_path):
    # the emulated GPU machine has torch but no hivemind: the bundle is what brings it
    bare = subprocess.run([target_python, "-c", "import torch, timm, transformers, torchaudio; import hivemind"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert "No module named 'hivemind'" in bare.stderr, bare.stderr
    committed = hashlib.sha256(COMMITTED_RESULTS.read_bytes()).hexdigest()
    out = tmp_path / "out"

    result = run_offline(["--smoke", str(out)], tmp_path, target_python, wheelhouse)

    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert sorted(path.name for path in out.iterdir()) == [
        "environment.json", "gpu_throughput.json", "gpu_throughput.memory.md", "logs.tar.gz", "run.log"]
    environment = json.loads((out / "environment.json").read_text())
    assert environment["problems"] == []
    assert environment["versions"]["hivemind"] == "1.1.12"
    assert environment["executable"] == str(target_python)  # the emulated GPU machine's Python, not this one
    report = json.loads((out / "gpu_throughput.json").read_text())
    assert report["setup"]["device"] == "cpu" and report["setup"]["precisions"] == ["fp32"]
    assert report["setup"]["smoke"] is True and report["setup"]["hivemind"] == "1.1.12"
    assert report["rows"], "no measured rows"
    for row in report["rows"]:
        plain, geotrain = row["plain"], row["geotrain_x1"]
        assert "error" not in plain and "error" not in geotrain, row
        assert plain["samples_per_second"] > 0 and geotrain["samples_per_second"] > 0
        assert row["ratio_x1_over_plain"] == pytest.approx(geotrain["samples_per_second"] / plain["samples_per_second"])
        assert geotrain["device"] == "cpu" and geotrain["precision"] == "fp32"
        assert geotrain["params_identical"] is True
        assert row["target_batch_size"] % row["batch_size_per_step"] == 0
        assert row["parameters"] == plain["parameters"] == geotrain["parameters"]
        # no GPU: no memory or utilisation figure rather than a made-up one
        assert plain["peak_gpu_memory_bytes"] is None and geotrain["peak_gpu_memory_bytes"] is None
        assert plain["gpu_busy_percent"] is None and geotrain["gpu_busy_percent"] is None
    table = (out / "run.log").read_text()
    assert "plain/s" in table and "x1/plain" in table and "[EMJ24]" in table
    assert "| cv/tiny | fp32 |" in (out / "gpu_throughput.memory.md").read_text()
    with tarfile.open(out / "logs.tar.gz") as logs:
        assert any(name.endswith("peer-0.jsonl") for name in logs.getnames())
    assert hashlib.sha256(COMMITTED_RESULTS.read_bytes()).hexdigest() == committed, "smoke wrote over results"
    # torch's shared memory manager (a binary of the emulated machine's torch, under tmp_path) exits by itself
    # once the peers it served are gone, a moment after them: seen still alive right after run.sh on a busy CPU
    survivors = []
    try:
        wait_for(lambda: not processes_mentioning(str(tmp_path)), 10, "the benchmark's processes to end")
    except AssertionError:
        survivors = [describe(pid) for pid in processes_mentioning(str(tmp_path))]
    assert not survivors, f"processes of the benchmark outlived it by 10 s: {survivors}"


def test_run_sh_without_a_bundle_or_with_one_for_another_python_exits_3(wheelhouse, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_offline(["--smoke", str(tmp_path / "out")], tmp_path, Path(sys.executable), empty, timeout_s=60)
    printed = result.stdout + result.stderr  # run.sh prints everything into its run.log too
    assert result.returncode == 3, printed
    assert "no bundle in" in printed and "make wheelhouse" in printed

    other = tmp_path / "other"
    shutil.copytree(wheelhouse, other)
    manifest = json.loads((other / "bundle.json").read_text())
    manifest["python_version"] = "3.99"
    (other / "bundle.json").write_text(json.dumps(manifest))
    result = run_offline(["--smoke", str(tmp_path / "out")], tmp_path, Path(sys.executable), other, timeout_s=60)
    printed = result.stdout + result.stderr
    assert result.returncode == 3, printed
    assert "for Python 3.99; this machine's" in printed and f"is {PYTHON_VERSION}" in printed
    assert "for Python 3.99" in (tmp_path / "out" / "run.log").read_text()
    assert not (tmp_path / "site").exists(), "nothing is installed from a bundle that cannot work"


def test_run_sh_smoke_never_writes_into_the_committed_results(tmp_path):
    result = subprocess.run(["bash", str(RUN), "--smoke", str(ROOT / "benchmarks" / "results")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "does not write into benchmarks/results" in result.stderr
    result = subprocess.run(["bash", str(RUN)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage: benchmarks/gpu/run.sh" in result.stderr


def test_wheelhouse_refuses_a_package_list_it_cannot_read(tmp_path):
    bad = tmp_path / "packages.txt"
    bad.write_text("torch\nnot a name!\n")
    result = subprocess.run([sys.executable, str(WHEELHOUSE), "--target-has", str(bad), "--out", str(tmp_path / "b")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"--target-has {bad}, line 2: 'not a name!' is not a package name" in result.stderr
    assert "Traceback" not in result.stderr
    bad.write_bytes(b"torch\n\xff\xfe\n")
    result = subprocess.run([sys.executable, str(WHEELHOUSE), "--target-has", str(bad), "--out", str(tmp_path / "b")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "cannot read it" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "b").exists(), "nothing is downloaded for a list it cannot read"


def describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return f"{pid} (gone)"
