"""Before the GPU benchmark: is everything geotrain needs importable here, and does a hivemind peer start?

    python3 benchmarks/gpu/preflight.py --out environment.json [--gpu] [--bundle .wheelhouse/bundle.json]

Checks, and lists every problem at once: the modules geotrain imports to train CV, NLP and ASR models
(torch, torchaudio, timm, transformers, hivemind, pydantic, ...), geotrain itself (with ``--source``: every
module of the source tree, installed), the requirements of every
wheel of the bundle (a missing one is a problem; another version than asked is a warning: a machine's own torch
may differ from the pinned one), hivemind's ``p2pd`` daemon, a DHT that starts and stops on loopback, and with
``--gpu`` a CUDA GPU. Writes what it found (versions, GPU, problems) as JSON. Exit codes: 0 ready; 3 something
is missing (each reason on its own line, on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

# what a trainer of each task family imports, and what the benchmark itself needs
MODULES = ("torch", "torchaudio", "timm", "transformers", "tokenizers", "numpy", "scipy", "yaml", "pydantic",
           "prometheus_client", "webdataset", "soundfile", "hivemind", "geotrain", "geotrain.trainer",
           "geotrain.tasks.vision", "geotrain.tasks.language", "geotrain.tasks.speech", "geotrain.local",
           "geotrain.cli")
VERSIONS = ("torch", "torchaudio", "timm", "transformers", "numpy", "scipy", "protobuf", "pydantic", "hivemind",
            "geotrain", "grpcio", "msgpack", "uvloop", "cryptography")


def check_imports(problems: list[str]) -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # an ImportError, or a module that breaks on import (wrong ABI, ...)
            problems.append(f"cannot import {name}: {type(error).__name__}: {error}")


def check_bundle_requirements(bundle: Path, problems: list[str], warnings: list[str]) -> None:
    """Every requirement of every bundled distribution, against what is installed here."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    manifest = json.loads(bundle.read_text())
    for wheel in manifest["wheels"]:
        try:
            distribution = importlib.metadata.distribution(wheel["name"])
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{wheel['file']} is in the bundle but {wheel['name']} is not installed")
            continue
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                version = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{wheel['name']} needs {requirement}, which is not installed (add it to the bundle: "
                                f"remove {canonicalize_name(requirement.name)} from the target's package list)")
                continue
            if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                warnings.append(f"{wheel['name']} asks for {requirement}; this machine has {version}")


def check_installed_geotrain(source: Path, problems: list[str]) -> None:
    """Every module of the source tree is in the installed geotrain (a subpackage left out of the wheel is not)."""
    try:
        import geotrain
    except Exception:
        return  # already reported
    installed = Path(geotrain.__file__).parent
    if installed.resolve() == (source / "geotrain").resolve():
        problems.append(f"geotrain is imported from the source tree ({installed}), not from the bundle's wheel")
        return
    missing = sorted(str(path.relative_to(source)) for path in (source / "geotrain").rglob("*.py")
                     if not (installed / path.relative_to(source / "geotrain")).exists())
    if missing:
        problems.append(f"the installed geotrain ({installed}) lacks {len(missing)} of the source tree's modules: "
                        + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))


def check_p2pd_and_dht(problems: list[str]) -> None:
    try:
        import hivemind
    except Exception:
        return  # already reported
    daemon = Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"
    if not daemon.exists():
        problems.append(f"hivemind's p2pd daemon is missing ({daemon})")
        return
    if not os.access(daemon, os.X_OK):
        problems.append(f"hivemind's p2pd daemon is not executable ({daemon}): install the wheel with pip, which "
                        "keeps its mode")
        return
    try:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            if not dht.get_visible_maddrs():
                problems.append("a hivemind DHT started on loopback but has no address")
        finally:
            dht.shutdown()
    except Exception as error:
        problems.append(f"a hivemind DHT did not start on loopback: {type(error).__name__}: {error}")


def describe(gpu: bool, problems: list[str]) -> dict:
    found: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                   "executable": sys.executable, "versions": {}}
    for name in VERSIONS:
        try:
            found["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found["versions"][name] = None
    try:
        shm = os.statvfs("/dev/shm")
        found["dev_shm_bytes"] = shm.f_frsize * shm.f_blocks
    except OSError:
        found["dev_shm_bytes"] = None
    try:
        import torch

        found["torch_cuda_build"] = torch.version.cuda
        found["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            properties = torch.cuda.get_device_properties(0)
            found["gpu_memory_bytes"] = properties.total_memory
            found["gpu_capability"] = f"{properties.major}.{properties.minor}"
        elif gpu:
            problems.append(f"no CUDA GPU is visible to torch {torch.__version__} (CUDA build: "
                            f"{torch.version.cuda or 'none'}); for a CPU check run with --smoke")
    except Exception:
        pass  # torch's import problem is already reported
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where to write what was found (JSON)")
    parser.add_argument("--gpu", action="store_true", help="a CUDA GPU must be visible")
    parser.add_argument("--bundle", type=Path, help="the bundle's bundle.json: check its wheels' requirements")
    parser.add_argument("--source", type=Path, help="geotrain's source tree: the installed geotrain must hold all of it")
    args = parser.parse_args(argv)
    started = time.monotonic()
    problems: list[str] = []
    warnings: list[str] = []
    check_imports(problems)
    if args.bundle is not None:
        check_bundle_requirements(args.bundle, problems, warnings)
    if args.source is not None:
        check_installed_geotrain(args.source, problems)
    check_p2pd_and_dht(problems)
    found = describe(args.gpu, problems)
    if found["dev_shm_bytes"] is not None and found["dev_shm_bytes"] < 2**31:
        warnings.append(f"/dev/shm holds only {found['dev_shm_bytes'] / 2**20:.0f} MiB: hivemind keeps the parameters "
                        "and averaged gradients there (docs/gpu.md, Containers)")
    found.update(problems=problems, warnings=warnings, seconds=round(time.monotonic() - started, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(found, indent=2) + "\n")
    versions = ", ".join(f"{name} {version}" for name, version in found["versions"].items() if version)
    print(f"preflight: Python {found['python']}; {versions}; GPU: {', '.join(found.get('gpus', [])) or 'none'}",
          flush=True)
    for warning in warnings:
        print(f"preflight: warning: {warning}", flush=True)
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr, flush=True)
    return 3 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
