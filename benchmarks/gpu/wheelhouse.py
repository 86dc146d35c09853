"""The offline bundle: every wheel a machine without a package index needs to run geotrain, and geotrain itself.

Run it on a machine that reaches the package index; copy the folder it fills to the machine without one and
install it there with ``benchmarks/gpu/run.sh`` (or ``pip install --no-index --no-deps --target DIR WHEELS``).

    python3 benchmarks/gpu/wheelhouse.py                          # Python 3.12, x86-64 Linux -> .wheelhouse/
    python3 benchmarks/gpu/wheelhouse.py --python-version 3.11 --out /tmp/wheels --target-has my-packages.txt

What goes in: hivemind (pinned, as geotrain pins it; its wheel carries the ``p2pd`` daemon) and geotrain's own
requirements, with everything they need in turn, less what the target machine already has (``--target-has``: a
file of distribution names, default ``benchmarks/gpu/target-packages.txt``: the GPU machines this project
borrows). Binary wheels are taken for the target's Python and platform; a package published only as source is
built into a wheel here, and must come out pure Python (else it cannot travel and this stops, saying which).
The bundle must fit ``--max-mib`` (default 64, what a device run may carry); ``bundle.json`` beside the wheels
lists each one, its size and who needs it. Exit codes: 0 built; 1 a package could not be had or the bundle is
too large (the message says which); 2 a usage error.
"""

from __future__ import annotations

import argparse
import configparser
import email.parser
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a bare Python: pip carries the same library
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / ".wheelhouse"
DEFAULT_TARGET_HAS = Path(__file__).resolve().parent / "target-packages.txt"
MANIFEST = "bundle.json"
# Older manylinux tags first would pick old builds; pip matches each tag exactly, so name the common ones.
MANYLINUX_TAGS = ("manylinux_2_39", "manylinux_2_35", "manylinux_2_34", "manylinux_2_31", "manylinux_2_28",
                  "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014", "manylinux1")


class BundleError(Exception):
    """The bundle cannot be built: exit 1 with the message."""


def read_names(path: Path) -> set[str]:
    """Distribution names, one a line, '#' comments."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BundleError(f"--target-has {path}: cannot read it ({error})") from None
    names = set()
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            names.add(canonicalize_name(Requirement(line).name))
        except Exception:
            raise BundleError(f"--target-has {path}, line {number}: {line!r} is not a package name") from None
    return names


def geotrain_requirements() -> list[str]:
    """install_requires from setup.cfg."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def marker_environment(python_version: str, machine: str) -> dict[str, str]:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": machine,
            "platform_release": "", "platform_version": "", "implementation_version": f"{python_version}.0",
            "extra": ""}


def applies(requirement: Requirement, environment: dict[str, str]) -> bool:
    return requirement.marker is None or Marker(str(requirement.marker)).evaluate(environment)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        metadata = email.parser.Parser().parsestr(archive.read(name).decode("utf-8"))
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


class Bundle:
    def __init__(self, out: Path, python_version: str, machine: str, target_has: set[str]):
        self.out = out
        self.python_version = python_version
        self.machine = machine
        self.target_has = target_has
        self.environment = marker_environment(python_version, machine)
        self.wheels: dict[str, Path] = {}  # canonical name -> wheel file
        self.needed_by: dict[str, set[str]] = {}
        self.built_from_source: set[str] = set()

    def pip(self, *arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *arguments],
                              capture_output=True, text=True)

    def platform_arguments(self) -> list[str]:
        arguments = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation", "cp"]
        for tag in MANYLINUX_TAGS:
            arguments += ["--platform", f"{tag}_{self.machine}"]
        return arguments

    def fetch(self, requirement: Requirement, directory: Path) -> Path:
        """One wheel for ``requirement``: a binary wheel for the target, else one built here from source."""
        before = set(directory.iterdir())
        done = self.pip("download", "--quiet", "--no-deps", *self.platform_arguments(), "-d", str(directory),
                        str(requirement))
        if done.returncode != 0:
            with tempfile.TemporaryDirectory() as source:
                built = self.pip("wheel", "--quiet", "--no-deps", "--no-binary", ":all:", "-w", source,
                                 str(requirement))
                if built.returncode != 0:
                    raise BundleError(f"{requirement}: no wheel for Python {self.python_version} on "
                                      f"{self.machine} Linux, and its source did not build:\n"
                                      + (done.stderr + built.stderr).strip()[-1500:])
                wheel = next(Path(source).glob("*.whl"))
                _, _, _, tags = parse_wheel_filename(wheel.name)
                if not any(tag.abi == "none" and tag.platform == "any" for tag in tags):
                    raise BundleError(f"{requirement}: no binary wheel for Python {self.python_version} on "
                                      f"{self.machine} Linux, and its source builds machine code ({wheel.name}): "
                                      "build the wheel on a machine like the target and put it in the bundle")
                shutil.copy(wheel, directory)
                self.built_from_source.add(canonicalize_name(requirement.name))
        new = [path for path in set(directory.iterdir()) - before if path.suffix == ".whl"]
        wanted = canonicalize_name(requirement.name)
        for path in new:
            if canonicalize_name(parse_wheel_filename(path.name)[0]) == wanted:
                return path
        # pip found it already downloaded (same file): look it up by name
        for path in directory.glob("*.whl"):
            if canonicalize_name(parse_wheel_filename(path.name)[0]) == wanted:
                return path
        raise BundleError(f"{requirement}: pip reported success but left no wheel in {directory}")

    def fetch_many(self, requirements: list[Requirement]) -> dict[str, Path]:
        """Wheels for ``requirements``: one pip call for those that have a wheel for the target, and one each
        for the others (built from source here)."""
        fetched: dict[str, Path] = {}
        pending = list(requirements)
        while pending:
            done = self.pip("download", "--quiet", "--no-deps", *self.platform_arguments(), "-d", str(self.out),
                            *(str(requirement) for requirement in pending))
            if done.returncode == 0:
                by_name = {canonicalize_name(parse_wheel_filename(p.name)[0]): p for p in self.out.glob("*.whl")}
                fetched.update({canonicalize_name(r.name): by_name[canonicalize_name(r.name)] for r in pending})
                break
            # pip names the first requirement it found no wheel for; that one comes from source
            missing = next((r for r in pending if f"for {r}" in done.stderr or f"for {r.name}" in done.stderr), None)
            if missing is None:
                fetched.update({canonicalize_name(r.name): self.fetch(r, self.out) for r in pending})
                break
            fetched[canonicalize_name(missing.name)] = self.fetch(missing, self.out)
            pending.remove(missing)
        return fetched

    def add(self, roots: list[tuple[str, str]]) -> None:
        """Level by level from (requirement, who needs it), skipping what the target has."""
        level = [(Requirement(text), by) for text, by in roots]
        while level:
            wanted: dict[str, Requirement] = {}
            for requirement, by in level:
                name = canonicalize_name(requirement.name)
                if name in self.target_has or not applies(requirement, self.environment):
                    continue
                self.needed_by.setdefault(name, set()).add(by)
                if name in self.wheels:
                    version = parse_wheel_filename(self.wheels[name].name)[1]
                    if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
                        raise BundleError(f"{by} needs {requirement}, but {self.wheels[name].name} was taken for an "
                                          f"earlier requirement ({', '.join(sorted(self.needed_by[name]))})")
                    continue
                earlier = wanted.get(name)
                specifier = requirement.specifier if earlier is None else earlier.specifier & requirement.specifier
                wanted[name] = Requirement(f"{requirement.name}{specifier}")
            level = []
            for name, wheel in self.fetch_many(list(wanted.values())).items():
                self.wheels[name] = wheel
                print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB), for "
                      f"{', '.join(sorted(self.needed_by[name]))}", flush=True)
                for child in wheel_requirements(wheel):
                    if child.marker is not None and "extra" in str(child.marker):
                        continue  # optional extras are not installed
                    level.append((child, name))

    def add_geotrain(self) -> Path:
        with tempfile.TemporaryDirectory() as directory:
            built = self.pip("wheel", "--quiet", "--no-deps", "-w", directory, str(ROOT))
            if built.returncode != 0:
                raise BundleError("geotrain: its wheel did not build:\n" + built.stderr.strip()[-1500:])
            wheel = next(Path(directory).glob("geotrain-*.whl"))
            target = self.out / wheel.name
            shutil.copy(wheel, target)
        self.wheels["geotrain"] = target
        self.needed_by["geotrain"] = {"the bundle"}
        return target


def build(args) -> dict:
    target_has = read_names(args.target_has)
    if args.out.exists():
        stale = [path for path in args.out.iterdir() if path.suffix == ".whl" or path.name == MANIFEST]
        others = [path for path in args.out.iterdir() if path not in stale]
        if others:
            raise BundleError(f"--out {args.out}: holds files that are not a bundle's ({others[0].name}); "
                              "give an empty or new folder")
        for path in stale:
            path.unlink()  # one bundle at a time: two versions of a package stop the whole install
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = Bundle(args.out, args.python_version, args.machine, target_has)
    requirements = geotrain_requirements()
    print(f"wheelhouse: Python {args.python_version} on {args.machine} Linux into {args.out}; leaving out the "
          f"{len(target_has)} packages of {args.target_has}", flush=True)
    bundle.add([(text, "geotrain") for text in requirements])
    bundle.add_geotrain()
    wheels = sorted(bundle.wheels.items())
    total = sum(path.stat().st_size for _, path in wheels)
    manifest = {
        "python_version": args.python_version, "platform": f"linux_{args.machine}",
        "target_has": sorted(target_has), "target_has_file": str(args.target_has),
        "total_bytes": total,
        "wheels": [{"name": name, "file": path.name, "bytes": path.stat().st_size,
                    "needed_by": sorted(bundle.needed_by.get(name, ())),
                    "built_here_from_source": name in bundle.built_from_source} for name, path in wheels],
    }
    (args.out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wheelhouse: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.out}", flush=True)
    if total > args.max_mib * 2**20:
        raise BundleError(f"the bundle is {total / 2**20:.1f} MiB, over --max-mib {args.max_mib:g}; the largest: "
                          + ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB"
                                      for _, p in sorted(wheels, key=lambda w: -w[1].stat().st_size)[:3]))
    return manifest


def parse_arguments(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT.name}/ in the repo")
    parser.add_argument("--python-version", default="3.12", help="the target's Python, MAJOR.MINOR (default 3.12)")
    parser.add_argument("--machine", default="x86_64", choices=("x86_64", "aarch64"),
                        help="the target's processor (default x86_64)")
    parser.add_argument("--target-has", type=Path, default=DEFAULT_TARGET_HAS,
                        help="file of the packages the target already has (default: the project's GPU machines)")
    parser.add_argument("--max-mib", type=float, default=64.0, help="largest bundle allowed, MiB (default 64)")
    args = parser.parse_args(argv)
    parts = args.python_version.split(".")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        parser.error(f"--python-version {args.python_version}: expected MAJOR.MINOR, e.g. 3.12")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    try:
        build(args)
    except BundleError as error:
        print(f"wheelhouse: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
