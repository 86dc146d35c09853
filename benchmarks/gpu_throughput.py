"""GPU throughput: geotrain (a swarm of one, then two trainers sharing the GPU) next to a plain PyTorch loop.

For each preset and precision, in one run, one after the other on the same GPU:

- **plain**: a plain PyTorch mixed-precision training loop: the task's own model, data pipeline (a DataLoader
  with the same workers and pinned memory as the trainer) and loss, ``torch.optim.AdamW`` with geotrain's
  defaults (lr 1e-3, no weight decay) on the GPU, ``torch.autocast`` in the same dtype, in fp16 a
  ``torch.amp.GradScaler("cuda")``, gradient accumulation up to the same target batch (one optimizer step per
  epoch, as the [EMJ24] single-GPU baselines did);
- **geotrain x1**: ``geotrain local --peers 1`` (coordinator + one trainer; hivemind with nobody to average with);
- **geotrain x2**: ``geotrain local --peers 2 --device cuda``: two trainers sharing the one GPU, averaging
  over loopback (once per preset, in the first precision given).

Same micro-batch, target batch, precision and data on every side. The plain loop first measures its rate for
a few steps, and the target batch is set so that one epoch lasts about ``--epoch-seconds`` on this GPU. The
first epoch (first kernels, allocator growth, data workers filling up, peers meeting) is left out:
samples/s = samples of the measured epochs / their time (for geotrain, from the trainers' event files, from
the end of the warm-up epoch to the end of the last one, summed over the trainers). Peak GPU memory: the plain
loop's ``torch.cuda.max_memory_allocated``, geotrain's ``peak_gpu_memory_bytes`` from its summary. GPU
utilisation: NVML's (``nvidia-smi``'s) busy share of the GPU, sampled every 0.2 s by this process and averaged
over each side's measured epochs.

    python benchmarks/gpu_throughput.py                       # cuda; bf16 and fp16; one preset per task family
    python benchmarks/gpu_throughput.py --presets cv/resnet50 --precision fp16
    python benchmarks/gpu_throughput.py --device cpu --smoke  # checks that it runs; writes runs/, not results

Target: the swarm of one reaches at least 0.95 of the plain loop's samples/s. Geotrain's epoch ends with
the optimizer step on the offloaded copy (host memory) and host<->GPU copies; the short epochs of this
benchmark weigh that more than the [EMJ24] target batch of 32768 samples would (minutes per epoch there).

Time: ``--budget-s`` (default 480) bounds the whole run. Sides run in order of importance (plain and x1 for
every preset in the first precision, then x2, then plain and x1 in the other precisions), and a side that would not fit in what is
left is skipped and reported as skipped. ``--device cpu --smoke``: the CV tiny preset, a few steps, a swarm of
one only, for the test suite. Writes JSON (default ``benchmarks/results/gpu_throughput.json``; with
``--smoke``, ``runs/gpu_throughput_smoke.json``) after every side, the peak-memory table beside it
(``*.memory.md``), and prints a table. Exit codes: 0 measured; 1 a side failed (the JSON says which); 2 a
usage error, e.g. ``--device cuda`` on a machine without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "gpu_throughput.json"
SMOKE_OUTPUT = ROOT / "runs" / "gpu_throughput_smoke.json"
DEFAULT_PRESETS = ("cv/convnext_large", "nlp/roberta-base", "asr/whisper-small")
SMOKE_PRESETS = ("cv/tiny",)
TARGET_RATIO = 0.95  # geotrain as a swarm of one over the plain loop
LEARNING_RATE = 1e-3  # geotrain's default; AdamW without weight decay on both sides
FIRST_SIDE_ESTIMATE_S = {"plain": 30.0, "geotrain_x1": 45.0, "geotrain_x2": 55.0}  # before one has been measured

# Samples per micro-step, per trainer: the study's. [EMJ24]'s peers logged 32 samples a step for every CV model and
# for RoBERTa (512-token sequences) on their T4 and A10 GPUs, and for Whisper Tiny 20, Base 8 and Small 3 on a T4,
# 16 on an A100 (read from the per-step sample counters of the W&B logs in the study's artifact,
# github.com/cirquit/hivemind-multi-cloud, artifacts/wandb/; the launch scripts are not published). Whisper
# Small takes the A100's 16 here. Two trainers sharing one GPU need about twice the memory of one; on a small
# GPU pass a smaller --batch-size.
BATCH_SIZES = {"cv/tiny": 16, "nlp/tiny": 16, "asr/tiny": 8, "cv/resnet18": 32, "cv/resnet50": 32,
               "cv/resnet152": 32, "cv/wide_resnet101_2": 32, "cv/convnext_large": 32, "nlp/roberta-base": 32,
               "nlp/roberta-large": 32, "nlp/xlm-roberta-large": 32, "asr/whisper-tiny": 20,
               "asr/whisper-base": 8, "asr/whisper-small": 16}
DEFAULT_BATCH_SIZE = 16

# Single-GPU throughputs of [EMJ24] (A. Erben, R. Mayer, H.-A. Jacobsen, "How Can We Train Deep Learning Models
# Across Clouds and Continents? An Experimental Study", PVLDB 17(6), 2024): fp16, target batch 32768, hivemind.
# ConvNextLarge: 80 samples/s on one T4 (80.8 in Fig. 7a, setup A-1), 185 on one A10. The figures this project
# takes from [EMJ24] hold no single-GPU rate for the other presets.
EMJ24_SAMPLES_PER_SECOND = {
    "cv/convnext_large": {"T4": 80.0, "A10": 185.0},
}
EMJ24_TWO_GPU_NOTE = ("[EMJ24]: on 2 GPUs hivemind reached only 48-78% of one GPU's throughput (gradient "
                      "accumulation overhead); 2 trainers here share one GPU instead")


class UsageError(Exception):
    """Something the user must fix: exit 2 with the message, no traceback."""


# --- the plain loop (runs in a child process: its own CUDA context, freed when it exits) ---------------------
def plain_loop(spec: dict) -> dict:
    import torch

    from geotrain.config import TaskConfig
    from geotrain.tasks import build_task

    device = torch.device(spec["device"])
    if device.type == "cpu" and spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    task_name, preset = spec["preset"].split("/", 1)
    task = build_task(TaskConfig(name=task_name, preset=preset))
    batch_size = spec["batch_size"]
    model = task.build_model().to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec["precision"])
    scaler = torch.amp.GradScaler("cuda") if spec["precision"] == "fp16" else None
    batches = task.build_loader(batch_size, data_seed=1, workers=spec["data_workers"],
                                pin_memory=device.type == "cuda")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def micro_step(accumulation_steps: int) -> float:
        """One micro-batch's forward and backward; returns the seconds spent waiting for the batch."""
        started = time.perf_counter()
        batch = next(batches)
        waited = time.perf_counter() - started
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype is not None):
            loss = task.loss(model, batch) / accumulation_steps
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return waited

    def optimizer_step() -> None:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        for _ in range(spec["warmup_steps"]):
            micro_step(spec["warmup_steps"])
        optimizer_step()  # allocates AdamW's state, as the first epoch does
        synchronize()
        target_batch_size = spec.get("target_batch_size")
        calibration = None
        if target_batch_size is None:
            steps = spec["calibration_steps"]
            started = time.perf_counter()
            for _ in range(steps):
                micro_step(steps)
            optimizer_step()
            synchronize()
            calibration = steps * batch_size / (time.perf_counter() - started)
            micro_steps = max(spec["min_steps_per_epoch"], round(calibration * spec["epoch_seconds"] / batch_size))
            target_batch_size = micro_steps * batch_size
        accumulation_steps = target_batch_size // batch_size
        data_s = 0.0
        window_started = time.time()
        started = time.perf_counter()
        for _ in range(spec["epochs"]):
            for _ in range(accumulation_steps):
                data_s += micro_step(accumulation_steps)
            optimizer_step()
        synchronize()
        wall_s = time.perf_counter() - started
        window_ended = time.time()
    finally:
        batches.close()
    samples = spec["epochs"] * accumulation_steps * batch_size
    return {
        "samples_per_second": samples / wall_s,
        "samples": samples,
        "wall_s": wall_s,
        "data_s": data_s,
        "measured_window_unix": [window_started, window_ended],
        "calibration_samples_per_second": calibration,
        "target_batch_size": target_batch_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "fp16_loss_scale": scaler.get_scale() if scaler is not None else None,
    }


# --- GPU utilisation -------------------------------------------------------------------------------------------
class UtilisationSampler:
    """NVML's GPU busy percentage and used memory, every ``interval_s``, in a thread of this process.

    Through ``pynvml`` (the nvidia-ml-py package) where it is installed, else ``nvidia-smi``; on a CPU, or with
    neither, it records nothing and every mean is None."""

    def __init__(self, device: str, interval_s: float = 0.2):
        self.samples: list[tuple[float, float, float]] = []  # (unix time, busy %, used MiB)
        self.source: str | None = None
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read = None
        if not device.startswith("cuda"):
            return
        index = int(device.partition(":")[2] or 0)
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)

            def read() -> tuple[float, float]:
                return (float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                        pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20)

            read()
            self._read, self.source = read, "nvml"
        except Exception:
            if shutil.which("nvidia-smi"):
                def read() -> tuple[float, float]:
                    line = subprocess.run(["nvidia-smi", "-i", str(index), "--query-gpu=utilization.gpu,memory.used",
                                           "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                          timeout=5).stdout.strip()
                    busy, used = (float(value) for value in line.split(","))
                    return busy, used

                try:
                    read()
                    self._read, self.source = read, "nvidia-smi"
                except Exception:
                    pass

    def __enter__(self) -> "UtilisationSampler":
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-utilisation", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                busy, used = self._read()
            except Exception:
                continue
            self.samples.append((time.time(), busy, used))

    def mean_busy_percent(self, window: list[float] | None) -> float | None:
        if not window:
            return None
        inside = [busy for when, busy, _ in self.samples if window[0] <= when <= window[1]]
        return sum(inside) / len(inside) if inside else None


# --- running a side in a child process -------------------------------------------------------------------------
def run_child(command: list[str], log_path: Path, timeout_s: float, prefix: str, cwd: Path) -> tuple[int | None, bool]:
    """Run ``command`` in its own process group, logging its output and echoing its progress lines with
    ``prefix``; (exit code, timed out). Past the limit it gets SIGINT (``geotrain local`` then stops its peers),
    and SIGKILL if it is still there a minute later."""
    deadline = time.monotonic() + timeout_s
    timed_out = False
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                   start_new_session=True, bufsize=1)
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(process.stdout, selectors.EVENT_READ)
                while not timed_out:
                    if selector.select(timeout=1.0):
                        line = process.stdout.readline()
                        if not line:
                            break  # the child closed its output: it is exiting
                        log.write(line)
                        if _worth_echoing(line):
                            print(f"{prefix}{line.rstrip()}", flush=True)
                    elif process.poll() is not None:
                        break
                    timed_out = time.monotonic() > deadline
            if not timed_out:
                try:
                    process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            if process.poll() is None:
                _stop_group(process)
            process.stdout.close()
    return process.returncode, timed_out


def _worth_echoing(line: str) -> bool:
    """Progress lines of `geotrain local` and of the plain loop's child; not the peers' log noise."""
    return line.startswith(("epoch ", "geotrain local:", "swarm:", "computed on", "plain:")) or "Error" in line


def _stop_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def _failure(what: str, code: int | None, timed_out: bool, log_path: Path) -> str:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
    reason = "timed out" if timed_out else f"exit code {code}"
    return f"{what}: {reason}; last lines of its log: " + " / ".join(line.strip() for line in tail)


def measure_plain(preset: str, precision: str, args, batch_size: int, directory: Path, timeout_s: float,
                  sampler: UtilisationSampler) -> dict:
    spec = {"preset": preset, "device": args.device, "precision": precision, "batch_size": batch_size,
            "data_workers": args.data_workers, "warmup_steps": args.warmup_steps,
            "calibration_steps": args.calibration_steps, "epoch_seconds": args.epoch_seconds,
            "min_steps_per_epoch": args.min_steps_per_epoch, "epochs": args.epochs,
            "target_batch_size": args.target_batch_size, "threads": os.cpu_count()}
    result_path = directory / "plain.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--plain-child", json.dumps(spec),
               "--output", str(result_path)]
    code, timed_out = run_child(command, directory / "plain.log", timeout_s, "    plain | ", directory)
    if code != 0 or not result_path.exists():
        return {"error": _failure("plain loop", code, timed_out, directory / "plain.log"), "timed_out": timed_out}
    result = json.loads(result_path.read_text())
    result["gpu_busy_percent"] = sampler.mean_busy_percent(result["measured_window_unix"])
    return result


# --- geotrain --------------------------------------------------------------------------------------------------
def steady_rate(event_files: list[Path], skip_epochs: int) -> tuple[float | None, dict, list[float] | None]:
    """Samples/s after the first ``skip_epochs`` epochs, summed over trainers; the measured epochs' split; and
    the measured window (unix times, from the earliest trainer's start of it to the latest one's end)."""
    from geotrain.events import read_events

    total, split = 0.0, {"epochs": 0, "wall_s": 0.0, "compute_s": 0.0, "comm_s": 0.0, "data_s": 0.0}
    window: list[float] | None = None
    for path in event_files:
        events = read_events(path)
        epochs = [e for e in events if e["event"] == "epoch"]
        measured = [e for e in epochs if e["epoch"] > skip_epochs]
        if not measured:
            return None, split, None
        before = [e["time"] for e in epochs if e["epoch"] <= skip_epochs]
        # a trainer that caught up by loading state may have skipped the warm-up epoch's event
        start = max(before) if before else next(e["time"] for e in events if e["event"] == "training")
        total += sum(e["samples"] for e in measured) / (measured[-1]["time"] - start)
        window = [min(start, window[0]), max(measured[-1]["time"], window[1])] if window else \
            [start, measured[-1]["time"]]
        for epoch in measured:
            split["epochs"] += 1
            for key in ("wall_s", "compute_s", "comm_s", "data_s"):
                split[key] += epoch.get(key) or 0.0
    return total, split, window


def measure_geotrain(preset: str, precision: str, peers: int, args, batch_size: int, target_batch_size: int,
                     directory: Path, timeout_s: float, sampler: UtilisationSampler) -> dict:
    task_name, preset_name = preset.split("/", 1)
    run_dir = directory / f"geotrain-x{peers}"
    summary_path = run_dir / "summary.json"
    log_path = directory / f"geotrain-x{peers}.log"
    command = [sys.executable, "-m", "geotrain", "local", "--peers", str(peers), "--epochs", str(1 + args.epochs),
               "--task", task_name, "--preset", preset_name, "--device", args.device, "--precision", precision,
               "--batch-size", str(batch_size), "--target-batch-size", str(target_batch_size),
               "--optimizer", "adamw", "--lr", str(LEARNING_RATE), "--data-workers", str(args.data_workers),
               "--offload-optimizer" if args.offload_optimizer else "--no-offload-optimizer",
               "--network-profile", "loopback", "--run-dir", str(run_dir), "--json", str(summary_path)]
    code, timed_out = run_child(command, log_path, timeout_s, f"    geotrain x{peers} | ", directory)
    if not summary_path.exists():
        return {"error": _failure(f"geotrain local --peers {peers}", code, timed_out, log_path), "timed_out": timed_out}
    summary = json.loads(summary_path.read_text())
    rate, split, window = steady_rate([run_dir / f"peer-{i}.jsonl" for i in range(peers)], skip_epochs=1)
    peaks = [p["peak_gpu_memory_bytes"] for p in summary["peers"]]
    result = {
        "samples_per_second": rate,
        "gpu_busy_percent": sampler.mean_busy_percent(window),
        "summary_swarm_samples_per_second": summary["swarm_samples_per_second"],  # includes the warm-up epoch
        "peak_gpu_memory_bytes": summary["peak_gpu_memory_bytes"],  # the largest of one trainer
        "peak_gpu_memory_bytes_per_trainer": peaks,
        "peak_gpu_memory_bytes_all_trainers": sum(peaks) if peaks and None not in peaks else None,
        "device": summary["device"],
        "precision": summary["precision"],
        "parameters": summary["parameters"],
        "epochs_completed": summary["epochs_completed"],
        "params_identical": summary["params_identical"],
        "data_s": summary["data_s"],
        "measured_epochs_split_s": split,  # summed over trainers and measured epochs
        "measured_window_unix": window,
        "exit_code": code,
        "timed_out": timed_out,
    }
    if code != 0 or rate is None:
        result["error"] = _failure(f"geotrain local --peers {peers}", code, timed_out, log_path)
    return result


# --- the run -----------------------------------------------------------------------------------------------------
def resolve(args) -> tuple[str, list[str], dict]:
    """The device and precisions every side uses (checked the way the trainer checks them), and the machine."""
    import torch

    from geotrain.compute import resolve_device, resolve_precision
    from geotrain.errors import UserError

    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", args.device):
        raise UsageError(f"--device {args.device}: expected cuda, cuda:N or cpu")
    try:
        device = resolve_device(args.device)
        precisions = []
        for asked in args.precision:
            precision = resolve_precision(asked, device)
            if precision not in precisions:
                precisions.append(precision)
    except UserError as error:
        hint = ". This benchmark measures a GPU; to check that it runs on a CPU: --device cpu --smoke" \
            if args.device.startswith("cuda") else ""
        raise UsageError(f"{error}{hint}") from None
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "torch_cuda_build": torch.version.cuda, "gpu": None}
    try:
        import hivemind

        machine["hivemind"] = hivemind.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        machine.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory,
                       gpu_capability=f"{properties.major}.{properties.minor}")
    # every side gets the resolved precision, so that "auto" cannot resolve differently in a child
    return args.device, precisions, machine


def default_precisions(device: str) -> list[str]:
    """bf16 and fp16 on a GPU with fast bf16, fp16 alone on one without, fp32 on a CPU."""
    if not device.startswith("cuda"):
        return ["auto"]
    from geotrain.compute import has_fast_bf16, resolve_device
    from geotrain.errors import UserError

    try:
        return ["bf16", "fp16"] if has_fast_bf16(resolve_device(device)) else ["fp16"]
    except UserError:
        return ["auto"]  # resolve() says what is wrong with the device


def check_presets(presets: list[str]) -> None:
    from geotrain.tasks.presets import PRESET_NAMES

    for preset in presets:
        task_name, _, name = preset.partition("/")
        if task_name not in ("cv", "nlp", "asr") or name not in PRESET_NAMES.get(task_name, ()):
            known = ", ".join(f"{t}/{p}" for t in ("cv", "nlp", "asr") for p in PRESET_NAMES[t])
            raise UsageError(f"--presets: unknown preset {preset!r}; expected TASK/PRESET, one of {known}")


class Run:
    """The rows (one per preset and precision), the order their sides run in, and the time budget."""

    def __init__(self, args, precisions: list[str], machine: dict, workspace: Path):
        self.args = args
        self.precisions = precisions
        self.machine = machine
        self.workspace = workspace
        self.started = time.monotonic()
        self.sampler = UtilisationSampler(args.device)
        self.rows: dict[tuple[str, str], dict] = {}
        for precision in precisions:
            for preset in args.presets:
                batch_size = args.batch_size or BATCH_SIZES.get(preset, DEFAULT_BATCH_SIZE)
                self.rows[(preset, precision)] = {
                    "preset": preset, "precision": precision, "batch_size_per_step": batch_size,
                    "emj24_samples_per_second": EMJ24_SAMPLES_PER_SECOND.get(preset)}
        self.side_seconds: dict[str, list[float]] = {}

    def plan(self) -> list[tuple[str, str, str]]:
        """(preset, precision, side) in the order they run, what matters most first: plain and x1 for every
        preset in the first precision, then x2 (in that precision), then plain and x1 in the other precisions."""
        def pairs(precision: str) -> list[tuple[str, str, str]]:
            sides = ["plain"] + (["geotrain_x1"] if 1 in self.args.peers else [])
            return [(preset, precision, side) for preset in self.args.presets for side in sides]

        first, *others = self.precisions
        order = pairs(first)
        if 2 in self.args.peers:
            order += [(preset, first, "geotrain_x2") for preset in self.args.presets]
        for precision in others:
            order += pairs(precision)
        return order

    def remaining_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def estimate_s(self, side: str) -> float:
        seen = self.side_seconds.get(side)
        return max(seen) if seen else FIRST_SIDE_ESTIMATE_S[side] * (0.2 if self.args.smoke else 1.0)

    def run_side(self, preset: str, precision: str, side: str) -> None:
        row = self.rows[(preset, precision)]
        label = f"[{preset} {precision}]"
        if side != "plain" and "target_batch_size" not in row:
            row[side] = {"skipped": "the plain loop did not measure a target batch"}
            return
        remaining = self.remaining_s()
        if self.estimate_s(side) > remaining:
            row[side] = {"skipped": f"time budget: {remaining:.0f} s of --budget-s {self.args.budget_s:g} left, "
                                    f"about {self.estimate_s(side):.0f} s needed"}
            print(f"{label} {side}: skipped, {row[side]['skipped']}", flush=True)
            return
        timeout_s = min(self.args.timeout_s, max(remaining, 10.0))
        directory = self.workspace / f"{preset.replace('/', '-')}-{precision}"
        directory.mkdir(parents=True, exist_ok=True)
        batch_size = row["batch_size_per_step"]
        started = time.monotonic()
        if side == "plain":
            print(f"{label} plain PyTorch loop (batch {batch_size}, {self.args.data_workers} data workers)",
                  flush=True)
            result = measure_plain(preset, precision, self.args, batch_size, directory, timeout_s, self.sampler)
            if "error" not in result:
                row.update(target_batch_size=result["target_batch_size"], parameters=result["parameters"])
                print(f"{label} plain: {result['samples_per_second']:.1f} samples/s"
                      f"{_busy(result.get('gpu_busy_percent'))}; target batch {result['target_batch_size']} "
                      f"({result['target_batch_size'] // batch_size} micro-steps per epoch)", flush=True)
        else:
            peers = int(side[-1])
            print(f"{label} geotrain local --peers {peers} ({1 + self.args.epochs} epochs, the first one left "
                  "out)", flush=True)
            result = measure_geotrain(preset, precision, peers, self.args, batch_size, row["target_batch_size"],
                                      directory, timeout_s, self.sampler)
            plain_rate = row.get("plain", {}).get("samples_per_second")
            rate = result.get("samples_per_second")
            if rate and plain_rate:
                row[f"ratio_x{peers}_over_plain"] = rate / plain_rate
                print(f"{label} geotrain x{peers}: {rate:.1f} samples/s{_busy(result.get('gpu_busy_percent'))} = "
                      f"{row[f'ratio_x{peers}_over_plain']:.3f} of the plain loop", flush=True)
        result["seconds"] = time.monotonic() - started
        self.side_seconds.setdefault(side, []).append(result["seconds"])
        if result.get("timed_out") and timeout_s < self.args.timeout_s:
            # stopped by the run's budget, not by its own limit: not a failure of the side
            result["skipped"] = f"time budget: --budget-s {self.args.budget_s:g} ran out while it ran"
            result["stopped"] = result.pop("error")
            print(f"{label} {side}: {result['skipped']}", flush=True)
        row[side] = result
        if "error" in result:
            print(f"{label} {side} failed: {result['error']}", flush=True)
        ratio = row.get("ratio_x1_over_plain")
        row["meets_target"] = None if ratio is None else ratio >= TARGET_RATIO
        if self.args.logs is not None:
            keep_logs(directory, self.args.logs / directory.name)

    def report(self) -> dict:
        args = self.args
        return {
            "benchmark": "gpu_throughput",
            "what": "samples/s, GPU utilisation and peak GPU memory: geotrain local --peers 1 and --peers 2 "
                    "(sharing one GPU) vs a plain PyTorch mixed-precision loop with the same model, data, loss, "
                    "micro-batch, target batch and precision",
            "setup": {"device": args.device, "precisions": self.precisions, "smoke": args.smoke,
                      "data_workers": args.data_workers, "offload_optimizer": args.offload_optimizer,
                      "geotrain_peers": args.peers, "epochs_measured": args.epochs, "warmup_epochs": 1,
                      "epoch_seconds": args.epoch_seconds, "budget_s": args.budget_s,
                      "gpu_utilisation_source": self.sampler.source,
                      "optimizer": "adamw", "learning_rate": LEARNING_RATE, "network_profile": "loopback",
                      **self.machine},
            "rows": list(self.rows.values()),
            "target_ratio_x1_over_plain": TARGET_RATIO,
            "emj24_note": EMJ24_TWO_GPU_NOTE,
            "seconds": time.monotonic() - self.started,
            "measured_on": time.strftime("%Y-%m-%d"),
        }


def keep_logs(directory: Path, destination: Path) -> None:
    """The side's logs and event files (not checkpoints or state) under ``destination``."""
    for path in directory.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".jsonl", ".json", ".txt"):
            target = destination / path.relative_to(directory)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)


def _busy(percent) -> str:
    return f" (GPU busy {percent:.0f}%)" if percent is not None else ""


def _gib(value) -> str:
    return f"{value / 2**30:.2f}" if value else "-"


def _rate(value) -> str:
    return f"{value:.1f}" if value else "-"


def _percent(value) -> str:
    return f"{value:.0f}" if value is not None else "-"


def format_table(report: dict) -> str:
    header = (f"{'preset':<20} {'prec':<4} {'batch':>5} {'target':>7} {'plain/s':>9} {'busy%':>5} {'geo x1/s':>9} "
              f"{'busy%':>5} {'x1/plain':>8} {'geo x2/s':>9} {'x2/plain':>8}  [EMJ24] one GPU")
    lines = [f"device {report['setup']['device']} ({report['setup'].get('gpu') or 'no GPU'}); samples/s after a "
             "warm-up epoch; busy%: GPU utilisation over the measured epochs", header, "-" * len(header)]
    for row in report["rows"]:
        plain = row.get("plain", {})
        one, two = row.get("geotrain_x1", {}), row.get("geotrain_x2", {})
        ratio1, ratio2 = row.get("ratio_x1_over_plain"), row.get("ratio_x2_over_plain")
        study = row.get("emj24_samples_per_second")
        lines.append(
            f"{row['preset']:<20} {row['precision']:<4} {row['batch_size_per_step']:>5} "
            f"{row.get('target_batch_size') or '-':>7} {_rate(plain.get('samples_per_second')):>9} "
            f"{_percent(plain.get('gpu_busy_percent')):>5} {_rate(one.get('samples_per_second')):>9} "
            f"{_percent(one.get('gpu_busy_percent')):>5} {(f'{ratio1:.3f}' if ratio1 else '-'):>8} "
            f"{_rate(two.get('samples_per_second')):>9} {(f'{ratio2:.3f}' if ratio2 else '-'):>8}  "
            + (", ".join(f"{gpu} {rate:g}" for gpu, rate in study.items()) if study else "-"))
    skipped = [f"{row['preset']} {row['precision']} {side}" for row in report["rows"]
               for side in ("plain", "geotrain_x1", "geotrain_x2") if "skipped" in row.get(side, {})]
    if skipped:
        lines.append("skipped (time budget or no plain figure): " + ", ".join(skipped))
    lines.append(f"target: geotrain x1 / plain >= {TARGET_RATIO}; [EMJ24] figures: fp16, target batch 32768, "
                 "hivemind, T4 and A10 GPUs")
    return "\n".join(lines)


def format_memory_table(report: dict) -> str:
    """Markdown: measured peak GPU memory per side, next to the parameters' share (12 B per parameter)."""
    setup = report["setup"]
    lines = [f"Peak GPU memory (GiB, `torch.cuda.max_memory_allocated`), measured on {setup.get('gpu') or 'no GPU'} "
             f"({report['measured_on']}, torch {setup['torch']}); x2: both trainers together. 12 B/param: the "
             "weights, gradients and hivemind's accumulators that docs/gpu.md computes for one trainer "
             "(activations come on top).", "",
             "| preset | precision | micro-batch | parameters | 12 B/param | plain | geotrain x1 | geotrain x2 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        parameters = row.get("parameters")
        lines.append(
            f"| {row['preset']} | {row['precision']} | {row['batch_size_per_step']} | "
            f"{f'{parameters / 1e6:.1f}M' if parameters else '-'} | "
            f"{_gib(12 * parameters) if parameters else '-'} | "
            f"{_gib(row.get('plain', {}).get('peak_gpu_memory_bytes'))} | "
            f"{_gib(row.get('geotrain_x1', {}).get('peak_gpu_memory_bytes'))} | "
            f"{_gib(row.get('geotrain_x2', {}).get('peak_gpu_memory_bytes_all_trainers'))} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    output.with_suffix(".memory.md").write_text(format_memory_table(report))


def parse_arguments(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--precision", nargs="+", choices=("auto", "fp32", "fp16", "bf16"),
                        help="one or more; default on a GPU: bf16 fp16 (fp16 alone without fast bf16); fp32 on a "
                             "CPU")
    parser.add_argument("--presets", nargs="+", metavar="TASK/PRESET",
                        help=f"default: {' '.join(DEFAULT_PRESETS)} ({' '.join(SMOKE_PRESETS)} with --smoke); "
                             "commas work too")
    parser.add_argument("--output", type=Path,
                        help=f"default {DEFAULT_OUTPUT.relative_to(ROOT)} ({SMOKE_OUTPUT.relative_to(ROOT)} with "
                             "--smoke); the memory table goes beside it (.memory.md)")
    parser.add_argument("--logs", type=Path, help="keep every side's logs and event files under this folder")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny presets and a few steps: checks that the benchmark runs (e.g. --device cpu)")
    parser.add_argument("--batch-size", type=int, help="samples per micro-step for every preset (default per preset)")
    parser.add_argument("--target-batch-size", type=int,
                        help="samples per epoch (default: what the plain loop computes in --epoch-seconds)")
    parser.add_argument("--epoch-seconds", type=float, help="length of an epoch at the plain loop's rate (default 4)")
    parser.add_argument("--epochs", type=int, help="measured epochs after the warm-up epoch (default 2)")
    parser.add_argument("--data-workers", type=int, help="DataLoader workers on every side (default 4; smoke 0)")
    parser.add_argument("--peers", type=int, nargs="+", choices=(1, 2),
                        help="geotrain swarms to run: 1 (a swarm of one), 2 (two trainers sharing the device, in "
                             "the first precision only); default 1 2 (1 with --smoke)")
    parser.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=True,
                        help="geotrain's --offload-optimizer (default on, as in geotrain)")
    parser.add_argument("--timeout-s", type=float, help="limit per side (default 240 s; smoke 120 s)")
    parser.add_argument("--budget-s", type=float,
                        help="limit for the whole run: sides that would not fit are skipped (default 480 s)")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)  # internal: run the plain loop for this spec
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"epoch_seconds": 0.3 if smoke else 4.0, "epochs": 1 if smoke else 2,
                "data_workers": 0 if smoke else 4, "timeout_s": 120.0 if smoke else 240.0, "budget_s": 480.0,
                "output": SMOKE_OUTPUT if smoke else DEFAULT_OUTPUT}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.warmup_steps = 2 if smoke else 8
    args.calibration_steps = 3 if smoke else 8
    args.min_steps_per_epoch = 2 if smoke else 4
    args.peers = sorted(set(args.peers or ((1,) if smoke else (1, 2))))
    presets = args.presets or (SMOKE_PRESETS if smoke else DEFAULT_PRESETS)
    args.presets = [name for item in presets for name in item.split(",") if name]
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if args.target_batch_size is not None and args.batch_size is None:
        parser.error("--target-batch-size needs --batch-size (the target is a multiple of it)")
    if args.target_batch_size is not None and args.target_batch_size % args.batch_size:
        parser.error("--target-batch-size must be a multiple of --batch-size")
    if args.epochs < 1 or args.epoch_seconds <= 0 or args.data_workers < 0 or args.budget_s <= 0:
        parser.error("--epochs must be at least 1, --epoch-seconds and --budget-s above 0, --data-workers at "
                     "least 0")
    if smoke and args.plain_child is None and args.output.resolve() == DEFAULT_OUTPUT.resolve():
        parser.error(f"--smoke measures nothing worth keeping: it does not write over {DEFAULT_OUTPUT.relative_to(ROOT)}"
                     "; give another --output")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.plain_child is not None:
        result = plain_loop(json.loads(args.plain_child))
        args.output.write_text(json.dumps(result) + "\n")
        print(f"plain: {result['samples_per_second']:.1f} samples/s", flush=True)
        return 0
    try:
        check_presets(args.presets)
        args.precision = args.precision or default_precisions(args.device)
        args.device, precisions, machine = resolve(args)
    except UsageError as error:
        print(f"gpu_throughput: {error}", file=sys.stderr)
        return 2
    gpu = f" ({machine['gpu']})" if machine["gpu"] else ""
    sides = ", ".join(["plain loop", *(f"geotrain x{peers}" for peers in args.peers)])
    print(f"gpu_throughput: {', '.join(args.presets)} on {args.device}{gpu} in {', '.join(precisions)}; per preset: "
          f"{sides}; {args.epochs} measured epochs of about {args.epoch_seconds:g} s each; budget "
          f"{args.budget_s:g} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as temporary:
        run = Run(args, precisions, machine, Path(temporary))
        with run.sampler:
            for preset, precision, side in run.plan():
                run.run_side(preset, precision, side)
                write_report(run.report(), args.output)  # what is measured survives a kill
    report = run.report()
    write_report(report, args.output)
    print(format_table(report), flush=True)
    print(f"written to {args.output} and {args.output.with_suffix('.memory.md').name} ({report['seconds']:.0f} s)",
          flush=True)
    failed = [f"{row['preset']} {row['precision']} {side}" for row in report["rows"]
              for side in ("plain", "geotrain_x1", "geotrain_x2") if "error" in row.get(side, {})]
    if failed:
        print(f"gpu_throughput: these sides failed: {', '.join(failed)}; see the JSON", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
