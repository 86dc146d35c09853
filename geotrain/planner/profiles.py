"""Model profiles: what the planner needs to know about the model being trained.

A profile is a small YAML file::

    name: convnext_large
    task: cv
    parameters: 197800000          # model parameters
    bytes_per_parameter: 2         # on the wire: 2 with fp16 compression, 4 without, 1 with uniform8bit
                                   #   (powersgd: from the model's shapes and the rank, see profile_from_run)
    target_batch_size: 32768       # samples the swarm accumulates per averaging round
    samples_per_second:            # one VM alone, without hivemind, keyed by GPU ("T4"), whole
      T4: 80                       #   instance ("8xV100") or "cpu"
    hivemind_efficiency: 0.488     # share of that rate a peer keeps inside a hivemind swarm
    round_overhead_s: 20.1         # matchmaking and bookkeeping per averaging round
    state_averaging_every_epochs: 0  # parameters are averaged too every N rounds; 0 = never
    data_bytes_per_sample: 0       # bytes read from object storage per sample (priced as data loading)
    min_vm_memory_gb: 0            # VMs the catalog lists with less memory are left out (0: no minimum)
    state_bytes_per_parameter: 2   # optional: a state averaging round's, when not bytes_per_parameter (powersgd)
    sources: {...}                 # where each figure comes from

Shipped profiles live in ``geotrain/data/planner/profiles/``; the user's own, written by
``geotrain profile --from-run``, in ``~/.config/geotrain/profiles/`` (or ``$GEOTRAIN_PROFILES_DIR``,
or ``--profiles-dir``). A user profile with the name of a shipped one replaces it, so ``geotrain profile``
refuses to write one; it also refuses a name the user's directory has unless ``--overwrite`` is given.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from geotrain.config import OptimizerConfig
from geotrain.pricing.catalog import DATA_DIR
from geotrain.planner.errors import PlannerError
from geotrain.text_files import load_yaml, read_user_text

SHIPPED_PROFILES_DIR = DATA_DIR / "profiles"
PROFILES_DIR_ENV = "GEOTRAIN_PROFILES_DIR"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")

# Bytes per parameter on the wire for each of geotrain's gradient compressions (config.GradCompression);
# powersgd's depend on the model's shapes and the rank (powersgd_bytes_per_parameter).
BYTES_PER_PARAMETER = {"none": 4, "fp16": 2, "uniform8bit": 1}
COMPRESSIONS = (*BYTES_PER_PARAMETER, "powersgd")

# Used when a hand-written profile leaves them out: the values calibrated on [EMJ24]'s CV A-8 run
# (see geotrain.planner.validation, which derives them from the published figures).
DEFAULT_HIVEMIND_EFFICIENCY = 0.488
DEFAULT_ROUND_OVERHEAD_S = 20.1


@dataclass
class ModelProfile:
    name: str
    parameters: int
    bytes_per_parameter: float
    target_batch_size: int
    samples_per_second: dict[str, float]
    task: str = ""
    hivemind_efficiency: float = DEFAULT_HIVEMIND_EFFICIENCY
    round_overhead_s: float = DEFAULT_ROUND_OVERHEAD_S
    state_averaging_every_epochs: int = 0
    data_bytes_per_sample: float = 0.0
    min_vm_memory_gb: float = 0.0
    state_bytes_per_parameter: float | None = None  # a state averaging round's; None: bytes_per_parameter
    sources: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    @property
    def gradient_bytes(self) -> float:
        """Bytes of one compressed gradient (the M of the all-reduce traffic)."""
        return self.parameters * self.bytes_per_parameter

    @property
    def bytes_averaged_per_round(self) -> float:
        """Gradients every round, plus parameters every ``state_averaging_every_epochs`` rounds."""
        state_bytes = self.parameters * (self.state_bytes_per_parameter or self.bytes_per_parameter)
        state = state_bytes / self.state_averaging_every_epochs if self.state_averaging_every_epochs else 0.0
        return self.gradient_bytes + state

    def to_yaml(self) -> str:
        data = asdict(self)
        data.pop("path")
        if data["state_bytes_per_parameter"] is None:
            data.pop("state_bytes_per_parameter")
        return yaml.safe_dump(data, sort_keys=False)


KIND_NAMES = {int: "whole number", float: "number"}
# What `geotrain profile --from-run` reads, for its messages about a file that is something else.
SUMMARY_HINT = "; --from-run expects the JSON summary that `geotrain local --json PATH` writes"


def _field(data: dict[str, Any], key: str, where: str, kind: type, minimum: float | None = None,
           default: Any = None, maximum: float | None = None, hint: str = "") -> Any:
    """``data[key]`` as a ``kind`` within the bounds, or a :class:`PlannerError` naming ``where`` and the key;
    ``hint`` ends every message (what the file should have been)."""
    expected = KIND_NAMES.get(kind, kind.__name__)
    if key not in data or data[key] is None:
        if default is not None:
            return default
        raise PlannerError(f"{where}: key {key!r} is missing; expected a {expected}{hint}")
    value = data[key]
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
        raise PlannerError(f"{where}: {key} is {value!r}; expected a {expected}{hint}")
    if isinstance(value, float) and not math.isfinite(value):
        raise PlannerError(f"{where}: {key} is {value}; expected a finite {expected}{hint}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise PlannerError(f"{where}: {key} is {value}; expected a number {bounds}{hint}")
    return value


def parse_profile(data: Any, where: str) -> ModelProfile:
    if not isinstance(data, dict):
        raise PlannerError(f"{where}: expected a mapping of profile keys (name, parameters, ...)")
    known = {"name", "task", "parameters", "bytes_per_parameter", "target_batch_size", "samples_per_second",
             "hivemind_efficiency", "round_overhead_s", "state_averaging_every_epochs", "data_bytes_per_sample",
             "min_vm_memory_gb", "state_bytes_per_parameter", "sources"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlannerError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    rates = data.get("samples_per_second") or {}
    if not isinstance(rates, dict) or not rates:
        raise PlannerError(f"{where}: samples_per_second must map a GPU type to samples/s, e.g. {{T4: 80}}")
    for key, value in rates.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PlannerError(f"{where}: samples_per_second.{key} is {value!r}; expected a finite number > 0")
    name = str(data.get("name") or "")
    if not NAME_PATTERN.match(name):
        raise PlannerError(f"{where}: name {name!r} is not valid; expected letters, digits, '_', '-', '.'")
    return ModelProfile(
        name=name,
        task=str(data.get("task") or ""),
        parameters=_field(data, "parameters", where, int, minimum=1),
        bytes_per_parameter=_field(data, "bytes_per_parameter", where, float, minimum=0.01),
        target_batch_size=_field(data, "target_batch_size", where, int, minimum=1),
        samples_per_second={str(key): float(value) for key, value in rates.items()},
        hivemind_efficiency=_field(data, "hivemind_efficiency", where, float, minimum=0.01, maximum=1.0,
                                   default=DEFAULT_HIVEMIND_EFFICIENCY),
        round_overhead_s=_field(data, "round_overhead_s", where, float, minimum=0.0, default=DEFAULT_ROUND_OVERHEAD_S),
        state_averaging_every_epochs=_field(data, "state_averaging_every_epochs", where, int, minimum=0, default=0),
        data_bytes_per_sample=_field(data, "data_bytes_per_sample", where, float, minimum=0.0, default=0.0),
        min_vm_memory_gb=_field(data, "min_vm_memory_gb", where, float, minimum=0.0, default=0.0),
        state_bytes_per_parameter=(_field(data, "state_bytes_per_parameter", where, float, minimum=0.01)
                                   if data.get("state_bytes_per_parameter") is not None else None),
        sources={str(k): str(v) for k, v in (data.get("sources") or {}).items()},
    )


def read_profile(path: Path) -> ModelProfile:
    text = read_user_text(path, "profile", PlannerError)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None)
        raise PlannerError(f"profile {path} is not valid YAML{where}{': ' + problem if problem else ''}; "
                           "fix the file or remove it") from None
    profile = parse_profile(data, str(path))
    profile.path = Path(path)
    return profile


def user_profiles_dir(override: str | Path | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    if os.environ.get(PROFILES_DIR_ENV):
        return Path(os.environ[PROFILES_DIR_ENV]).expanduser()
    return Path("~/.config/geotrain/profiles").expanduser()


def _profile_files(profiles_dir: str | Path | None) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for directory in (SHIPPED_PROFILES_DIR, user_profiles_dir(profiles_dir)):
        if directory.is_dir():
            for path in sorted(directory.glob("*.yaml")):
                files[path.stem] = path  # the user's directory comes second, so its profiles win
    return files


def available_profiles(profiles_dir: str | Path | None = None) -> list[str]:
    return sorted(_profile_files(profiles_dir))


def load_profile(name: str, profiles_dir: str | Path | None = None) -> ModelProfile:
    """A profile by name (user directory first, then shipped), or a path to a YAML file."""
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        return read_profile(Path(name))
    files = _profile_files(profiles_dir)
    if name not in files:
        raise PlannerError(f"no profile named {name!r}; available: {', '.join(sorted(files)) or 'none'} "
                           f"(user profiles in {user_profiles_dir(profiles_dir)}); create one with "
                           "`geotrain profile --from-run RUN.json --name NAME`")
    return read_profile(files[name])


def profile_from_run(summary_path: Path, name: str, device_type: str | None = None) -> ModelProfile:
    """A measured profile from the JSON summary that ``geotrain local --json PATH`` writes.

    The peers' samples/s are measured inside a hivemind swarm, so the profile's rate is the compute
    rate of one peer (samples over compute seconds) and its hivemind efficiency is 1. The round
    overhead is the measured communication time per averaging round.
    """
    where = str(summary_path)
    text = read_user_text(summary_path, "run summary", PlannerError,
                          unreadable_hint="write one with `geotrain local --json PATH`")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlannerError(f"{where} is not valid JSON (line {error.lineno}, column {error.colno}); "
                           "expected the summary that `geotrain local --json PATH` writes") from None
    if not isinstance(data, dict):
        raise PlannerError(f"{where}: expected a JSON object{SUMMARY_HINT}")
    if not NAME_PATTERN.match(name):
        raise PlannerError(f"profile name {name!r} is not valid; expected letters, digits, '_', '-', '.'")
    parameters = _field(data, "parameters", where, int, minimum=1, hint=SUMMARY_HINT)
    target_batch_size = _field(data, "target_batch_size", where, int, minimum=1, hint=SUMMARY_HINT)
    compression = data.get("grad_compression", "fp16")
    if compression not in COMPRESSIONS:
        raise PlannerError(f"{where}: grad_compression is {compression!r}; expected one of {', '.join(COMPRESSIONS)}")
    peers = data.get("peers")
    if not isinstance(peers, list) or not peers:
        raise PlannerError(f"{where}: 'peers' is missing or empty; the run must have trained with at least one peer"
                           f"{SUMMARY_HINT}")
    rates, comm_s, samples = [], [], 0.0
    for index, peer in enumerate(peers):
        if not isinstance(peer, dict):
            raise PlannerError(f"{where}: peers[{index}] is not an object{SUMMARY_HINT}")
        peer_where = f"{where}: peers[{index}]"
        peer_samples = _field(peer, "samples", peer_where, float, minimum=0, hint=SUMMARY_HINT)
        compute = _field(peer, "compute_s", peer_where, float, minimum=0, hint=SUMMARY_HINT)
        samples += peer_samples
        comm_s.append(_field(peer, "comm_s", peer_where, float, minimum=0, hint=SUMMARY_HINT))
        if compute > 0 and peer_samples > 0:
            rates.append(peer_samples / compute)
    if not rates:
        raise PlannerError(f"{where}: no peer reports samples and compute_s above 0; run `geotrain local` longer")
    device = device_type or str(data.get("device") or "")
    if not device:
        raise PlannerError(f"{where}: 'device' is missing; pass --device-type (e.g. cpu, T4)")
    if device.startswith("cuda") and not device_type:
        raise PlannerError(f"{where}: the run used {device!r}; pass --device-type with the GPU model "
                           "(e.g. T4, A10) so the planner can match catalog VMs")
    rounds = samples / target_batch_size
    sources = {
        "samples_per_second": f"measured: mean compute rate of {len(rates)} peer(s) in {summary_path}",
        "hivemind_efficiency": "1: the measured rate is already the rate inside a hivemind swarm",
        "task": f"{data.get('task', '?')}/{data.get('preset', '?')}",
    }
    if rounds >= 1 and sum(comm_s) > 0:
        overhead = sum(comm_s) / len(comm_s) / rounds
        sources["round_overhead_s"] = f"measured: communication seconds per averaging round ({rounds:.1f} rounds)"
    else:
        overhead = DEFAULT_ROUND_OVERHEAD_S
        sources["round_overhead_s"] = ("default (the run finished fewer than one averaging round; "
                                       "[EMJ24] CV A-8 calibration)")
    state_every = OptimizerConfig.model_fields["average_state_every"].default
    sources["state_averaging_every_epochs"] = "geotrain's optimizer.average_state_every default"
    if compression == "powersgd":
        rank = _field(data, "powersgd_rank", where, int, minimum=1, hint=SUMMARY_HINT)
        bytes_per_parameter = powersgd_bytes_per_parameter(str(data.get("task") or ""), data.get("preset"), rank,
                                                           parameters, where)
        sources["bytes_per_parameter"] = (f"PowerSGD rank {rank} on the shapes of {data.get('task')}/"
                                          f"{data.get('preset')}: fp16 factors and the tensors sent as they are")
        state_bytes_per_parameter = BYTES_PER_PARAMETER["fp16"]
        sources["state_bytes_per_parameter"] = "with powersgd, state averaging rounds send the parameters in fp16"
    else:
        bytes_per_parameter, state_bytes_per_parameter = BYTES_PER_PARAMETER[compression], None
    return ModelProfile(
        name=name, task=str(data.get("task") or ""), parameters=parameters,
        bytes_per_parameter=bytes_per_parameter, target_batch_size=target_batch_size,
        samples_per_second={device: round(sum(rates) / len(rates), 4)}, hivemind_efficiency=1.0,
        round_overhead_s=round(overhead, 4), state_averaging_every_epochs=int(state_every),
        data_bytes_per_sample=0.0, state_bytes_per_parameter=state_bytes_per_parameter, sources=sources)


def powersgd_bytes_per_parameter(task: str, preset: Any, rank: int, parameters: int, where: str) -> float:
    """Bytes on the wire per parameter of one PowerSGD round (both phases, fp16) for the model of ``task``/
    ``preset``, built from its config (no download), at ``rank``."""
    from geotrain.config import TaskConfig
    from geotrain.hive.averaging.powersgd import values_on_the_wire
    from geotrain.tasks import build_task

    try:
        model = build_task(TaskConfig(name=task, preset=preset)).build_model()
    except Exception as error:
        raise PlannerError(f"{where}: cannot build the model of task {task!r}, preset {preset!r} to count what "
                           f"PowerSGD sends ({error})") from None
    built = sum(p.numel() for p in model.parameters())
    if built != parameters:
        raise PlannerError(f"{where}: the model of {task}/{preset} has {built} parameters, the run says "
                           f"{parameters}; was the run made with another geotrain version?")
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    factors, plain = values_on_the_wire(shapes, rank)
    return round(2 * (factors + plain) / parameters, 6)


def check_profile_name(name: str, profiles_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """Where ``geotrain profile --name NAME`` writes; a name that is taken is refused.

    A shipped profile's name always (a user profile of that name would replace it for ``geotrain plan``,
    which would then plan the wrong model); one of the user's own profiles unless ``overwrite``.
    """
    if not NAME_PATTERN.match(name):
        raise PlannerError(f"profile name {name!r} is not valid; expected letters, digits, '_', '-', '.'")
    path = user_profiles_dir(profiles_dir) / f"{name}.yaml"
    shipped = SHIPPED_PROFILES_DIR / f"{name}.yaml"
    if shipped.exists():
        raise PlannerError(f"--name {name}: {name!r} is a shipped profile ({shipped}), and a profile of yours with "
                           f"that name would replace it for `geotrain plan --profile {name}`, even with --overwrite; "
                           "choose another --name")
    if path.exists() and not overwrite:
        raise PlannerError(f"--name {name}: a profile named {name!r} already exists ({path}); pass --overwrite to "
                           "replace it, or choose another --name")
    return path


def save_profile(profile: ModelProfile, profiles_dir: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write ``profile`` into the user's profile directory; see :func:`check_profile_name` for the names refused."""
    path = check_profile_name(profile.name, profiles_dir, overwrite)
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(profile.to_yaml())
        tmp.replace(path)
    except OSError as error:
        raise PlannerError(f"cannot write profile into {directory}: {error.strerror}; "
                           "choose another directory with --profiles-dir") from None
    return path
