"""GPU throughput: geotrain (a swarm of one, then two trainers sharing the GPU) next to a plain PyTorch loop.

For each preset, in one run, one after the other on the same GPU:

- **plain**: a plain PyTorch mixed-precision training loop: the task's own model, data pipeline (a DataLoader
  with the same workers and pinned memory as the trainer) and loss, ``torch.optim.AdamW`` with geotrain's
  defaults (lr 1e-3, no weight decay) on the GPU, ``torch.autocast`` in the same dtype, in fp16 a
  ``torch.amp.GradScaler("cuda")``, gradient accumulation up to the same target batch (one optimizer step per
  epoch, as the [EMJ24] single-GPU baselines did);
- **geotrain x1**: ``geotrain local --peers 1`` (coordinator + one trainer; hivemind with nobody to average with);
- **geotrain x2**: ``geotrain local --peers 2 --device cuda``: two trainers sharing the one GPU, averaging
  over loopback.

Same micro-batch, target batch, precision and data on every side. The plain loop first measures its rate for
a few steps, and the target batch is set so that one epoch lasts about ``--epoch-seconds`` on this GPU. The
first epoch (first kernels, allocator growth, data workers filling up, peers meeting) is left out:
samples/s = samples of the measured epochs / their time (for geotrain, from the trainers' event files, from
the end of the warm-up epoch to the end of the last one, summed over the trainers). Peak GPU memory: the plain loop's
``torch.cuda.max_memory_allocated``, geotrain's ``peak_gpu_memory_bytes`` from its summary.

    python benchmarks/gpu_throughput.py                       # cuda, auto precision, the three presets
    python benchmarks/gpu_throughput.py --presets cv/resnet50 --precision fp16
    python benchmarks/gpu_throughput.py --device cpu --smoke --output /tmp/gpu_throughput.json

Target: the swarm of one reaches at least 0.95 of the plain loop's samples/s. Geotrain's epoch ends with
the optimizer step on the offloaded copy (host memory) and host<->GPU copies; the short epochs of this
benchmark weigh that more than the [EMJ24] target batch of 32768 samples would (minutes per epoch there).

Planned to finish within 8 minutes on one GPU for the three default presets: per preset a plain run and two
``geotrain local`` runs (each starts a coordinator and its trainers: tens of seconds) of 3 epochs of about 6 s;
raise ``--epoch-seconds``/``--epochs`` when there is time; each side stops after ``--timeout-s``.
``--device cpu --smoke``: the CV tiny preset, a few steps, a swarm of one only, for the test suite.
Writes JSON (default ``benchmarks/results/gpu_throughput.json``) and prints a table.
Exit codes: 0 measured; 1 a side failed (the JSON says which); 2 a usage error, e.g. ``--device cuda`` on a
machine without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "gpu_throughput.json"
DEFAULT_PRESETS = ("cv/resnet50", "cv/convnext_large", "nlp/roberta-base")
SMOKE_PRESETS = ("cv/tiny",)
TARGET_RATIO = 0.95  # geotrain as a swarm of one over the plain loop
LEARNING_RATE = 1e-3  # geotrain's default; AdamW without weight decay on both sides

# Samples per micro-step, per trainer (not the study's: [EMJ24] gives target batches only). Two trainers sharing
# one GPU need about twice the memory of one; on a small GPU pass a smaller --batch-size.
BATCH_SIZES = {"cv/tiny": 16, "nlp/tiny": 16, "cv/resnet18": 64, "cv/resnet50": 64, "cv/resnet152": 32,
               "cv/wide_resnet101_2": 32, "cv/convnext_large": 32, "nlp/roberta-base": 16, "nlp/roberta-large": 8,
               "nlp/xlm-roberta-large": 8}
DEFAULT_BATCH_SIZE = 16

# Single-GPU throughputs of [EMJ24] (A. Erben, R. Mayer, H.-A. Jacobsen, "How Can We Train Deep Learning Models
# Across Clouds and Continents? An Experimental Study", PVLDB 17(6), 2024): fp16, target batch 32768, hivemind.
# ConvNextLarge: 80 samples/s on one T4 (80.8 in Fig. 7a, setup A-1), 185 on one A10. The figures this project
# takes from [EMJ24] hold no single-GPU rate for ResNet50 or RoBERTa-Base.
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
        started = time.perf_counter()
        for _ in range(spec["epochs"]):
            for _ in range(accumulation_steps):
                data_s += micro_step(accumulation_steps)
            optimizer_step()
        synchronize()
        wall_s = time.perf_counter() - started
    finally:
        batches.close()
    samples = spec["epochs"] * accumulation_steps * batch_size
    return {
        "samples_per_second": samples / wall_s,
        "samples": samples,
        "wall_s": wall_s,
        "data_s": data_s,
        "calibration_samples_per_second": calibration,
        "target_batch_size": target_batch_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_gpu_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
        "fp16_loss_scale": scaler.get_scale() if scaler is not None else None,
    }


def run_child(command: list[str], log_path: Path, timeout_s: float, prefix: str) -> tuple[int | None, bool]:
    """Run ``command`` in its own process group, logging its output and echoing its progress lines with
    ``prefix``; (exit code, timed out). Past the limit it gets SIGINT (``geotrain local`` then stops its peers),
    and SIGKILL if it is still there a minute later."""
    deadline = time.monotonic() + timeout_s
    timed_out = False
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
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


def measure_plain(preset: str, args, batch_size: int, directory: Path) -> dict:
    spec = {"preset": preset, "device": args.device, "precision": args.precision, "batch_size": batch_size,
            "data_workers": args.data_workers, "warmup_steps": args.warmup_steps,
            "calibration_steps": args.calibration_steps, "epoch_seconds": args.epoch_seconds,
            "min_steps_per_epoch": args.min_steps_per_epoch, "epochs": args.epochs,
            "target_batch_size": args.target_batch_size, "threads": os.cpu_count()}
    result_path = directory / "plain.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--plain-child", json.dumps(spec),
               "--output", str(result_path)]
    code, timed_out = run_child(command, directory / "plain.log", args.timeout_s, "    plain | ")
    if code != 0 or not result_path.exists():
        return {"error": _failure("plain loop", code, timed_out, directory / "plain.log")}
    return json.loads(result_path.read_text())


# --- geotrain --------------------------------------------------------------------------------------------------
def steady_rate(event_files: list[Path], skip_epochs: int) -> tuple[float | None, dict]:
    """Samples/s after the first ``skip_epochs`` epochs, summed over trainers; and the measured epochs' split."""
    from geotrain.events import read_events

    total, split = 0.0, {"epochs": 0, "wall_s": 0.0, "compute_s": 0.0, "comm_s": 0.0, "data_s": 0.0}
    for path in event_files:
        events = read_events(path)
        epochs = [e for e in events if e["event"] == "epoch"]
        measured = [e for e in epochs if e["epoch"] > skip_epochs]
        if not measured:
            return None, split
        before = [e["time"] for e in epochs if e["epoch"] <= skip_epochs]
        # a trainer that caught up by loading state may have skipped the warm-up epoch's event
        start = max(before) if before else next(e["time"] for e in events if e["event"] == "training")
        total += sum(e["samples"] for e in measured) / (measured[-1]["time"] - start)
        for epoch in measured:
            split["epochs"] += 1
            for key in ("wall_s", "compute_s", "comm_s", "data_s"):
                split[key] += epoch.get(key) or 0.0
    return total, split


def measure_geotrain(preset: str, peers: int, args, batch_size: int, target_batch_size: int,
                     directory: Path) -> dict:
    task_name, preset_name = preset.split("/", 1)
    run_dir = directory / f"geotrain-x{peers}"
    summary_path = run_dir / "summary.json"
    command = [sys.executable, "-m", "geotrain", "local", "--peers", str(peers), "--epochs", str(1 + args.epochs),
               "--task", task_name, "--preset", preset_name, "--device", args.device, "--precision", args.precision,
               "--batch-size", str(batch_size), "--target-batch-size", str(target_batch_size),
               "--optimizer", "adamw", "--lr", str(LEARNING_RATE), "--data-workers", str(args.data_workers),
               "--offload-optimizer" if args.offload_optimizer else "--no-offload-optimizer",
               "--network-profile", "loopback", "--run-dir", str(run_dir), "--json", str(summary_path)]
    run_dir.mkdir(parents=True, exist_ok=True)
    code, timed_out = run_child(command, directory / f"geotrain-x{peers}.log", args.timeout_s,
                                f"    geotrain x{peers} | ")
    if not summary_path.exists():
        return {"error": _failure(f"geotrain local --peers {peers}", code, timed_out,
                                  directory / f"geotrain-x{peers}.log")}
    summary = json.loads(summary_path.read_text())
    rate, split = steady_rate([run_dir / f"peer-{i}.jsonl" for i in range(peers)], skip_epochs=1)
    peaks = [p["peak_gpu_memory_bytes"] for p in summary["peers"]]
    result = {
        "samples_per_second": rate,
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
        "exit_code": code,
    }
    if code != 0 or rate is None:
        result["error"] = _failure(f"geotrain local --peers {peers}", code, timed_out,
                                   directory / f"geotrain-x{peers}.log")
    return result


def _failure(what: str, code: int, timed_out: bool, log_path: Path) -> str:
    tail = log_path.read_text().strip().splitlines()[-5:] if log_path.exists() else []
    reason = "timed out" if timed_out else f"exit code {code}"
    return f"{what}: {reason}; last lines of its log: " + " / ".join(line.strip() for line in tail)


# --- the run -----------------------------------------------------------------------------------------------------
def resolve(args) -> tuple[str, str, dict]:
    """The device and precision every side uses (checked the way the trainer checks them), and the machine."""
    import torch

    from geotrain.compute import resolve_device, resolve_precision
    from geotrain.errors import UserError

    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", args.device):
        raise UsageError(f"--device {args.device}: expected cuda, cuda:N or cpu")
    try:
        device = resolve_device(args.device)
        precision = resolve_precision(args.precision, device)
    except UserError as error:
        hint = ". This benchmark measures a GPU; to check that it runs on a CPU: --device cpu --smoke" \
            if args.device.startswith("cuda") else ""
        raise UsageError(f"{error}{hint}") from None
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "torch_cuda_build": torch.version.cuda, "gpu": None}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        machine.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory,
                       gpu_capability=f"{properties.major}.{properties.minor}")
    # every side gets the resolved precision, so that "auto" cannot resolve differently in a child
    return args.device, precision, machine


def check_presets(presets: list[str]) -> None:
    from geotrain.tasks.presets import PRESET_NAMES

    for preset in presets:
        task_name, _, name = preset.partition("/")
        if task_name not in ("cv", "nlp", "asr") or name not in PRESET_NAMES.get(task_name, ()):
            known = ", ".join(f"{t}/{p}" for t in ("cv", "nlp", "asr") for p in PRESET_NAMES[t])
            raise UsageError(f"--presets: unknown preset {preset!r}; expected TASK/PRESET, one of {known}")


def measure_preset(preset: str, args, directory: Path) -> dict:
    batch_size = args.batch_size or BATCH_SIZES.get(preset, DEFAULT_BATCH_SIZE)
    row: dict = {"preset": preset, "batch_size_per_step": batch_size, "emj24_samples_per_second":
                 EMJ24_SAMPLES_PER_SECOND.get(preset)}
    started = time.monotonic()
    print(f"[{preset}] plain PyTorch loop (batch {batch_size}, {args.precision}, {args.data_workers} data workers)",
          flush=True)
    plain = measure_plain(preset, args, batch_size, directory)
    plain["seconds"] = time.monotonic() - started
    row["plain"] = plain
    if "error" in plain:
        print(f"[{preset}] plain loop failed: {plain['error']}", flush=True)
        return row
    target_batch_size = plain["target_batch_size"]
    row.update(target_batch_size=target_batch_size, parameters=plain["parameters"])
    print(f"[{preset}] plain: {plain['samples_per_second']:.1f} samples/s; target batch {target_batch_size} "
          f"({target_batch_size // batch_size} micro-steps per epoch)", flush=True)
    for peers in args.peers:
        print(f"[{preset}] geotrain local --peers {peers} ({1 + args.epochs} epochs, the first one left out)",
              flush=True)
        side_started = time.monotonic()
        side = measure_geotrain(preset, peers, args, batch_size, target_batch_size, directory)
        side["seconds"] = time.monotonic() - side_started
        row[f"geotrain_x{peers}"] = side
        rate = side.get("samples_per_second")
        if rate:
            row[f"ratio_x{peers}_over_plain"] = rate / plain["samples_per_second"]
            print(f"[{preset}] geotrain x{peers}: {rate:.1f} samples/s = {row[f'ratio_x{peers}_over_plain']:.3f} "
                  "of the plain loop", flush=True)
        if "error" in side:
            print(f"[{preset}] geotrain x{peers} failed: {side['error']}", flush=True)
    ratio = row.get("ratio_x1_over_plain")
    row["meets_target"] = None if ratio is None else ratio >= TARGET_RATIO
    row["seconds"] = time.monotonic() - started
    print(f"[{preset}] done in {row['seconds']:.0f} s", flush=True)
    return row


def _gib(value) -> str:
    return f"{value / 2**30:.2f}" if value else "-"


def _rate(value) -> str:
    return f"{value:.1f}" if value else "-"


def format_table(report: dict) -> str:
    header = (f"{'preset':<22} {'batch':>5} {'target':>7} {'plain/s':>9} {'geo x1/s':>9} {'x1/plain':>8} "
              f"{'geo x2/s':>9} {'x2/plain':>8} {'plain GiB':>9} {'x1 GiB':>7} {'x2 GiB':>7}  [EMJ24] one GPU")
    lines = [f"device {report['setup']['device']} ({report['setup'].get('gpu') or 'no GPU'}), precision "
             f"{report['setup']['precision']}; samples/s after a warm-up epoch; GiB: peak GPU memory "
             "(x2: both trainers)", header, "-" * len(header)]
    for row in report["rows"]:
        plain = row.get("plain", {})
        one, two = row.get("geotrain_x1", {}), row.get("geotrain_x2", {})
        ratio1, ratio2 = row.get("ratio_x1_over_plain"), row.get("ratio_x2_over_plain")
        study = row.get("emj24_samples_per_second")
        lines.append(
            f"{row['preset']:<22} {row['batch_size_per_step']:>5} {row.get('target_batch_size') or '-':>7} "
            f"{_rate(plain.get('samples_per_second')):>9} {_rate(one.get('samples_per_second')):>9} "
            f"{(f'{ratio1:.3f}' if ratio1 else '-'):>8} {_rate(two.get('samples_per_second')):>9} "
            f"{(f'{ratio2:.3f}' if ratio2 else '-'):>8} {_gib(plain.get('peak_gpu_memory_bytes')):>9} "
            f"{_gib(one.get('peak_gpu_memory_bytes')):>7} {_gib(two.get('peak_gpu_memory_bytes_all_trainers')):>7}  "
            + (", ".join(f"{gpu} {rate:g}" for gpu, rate in study.items()) if study else "-"))
    lines.append(f"target: geotrain x1 / plain >= {TARGET_RATIO}; [EMJ24] figures: fp16, target batch 32768, "
                 "hivemind, T4 and A10 GPUs")
    return "\n".join(lines)


def parse_arguments(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "fp16", "bf16"),
                        help="auto: bf16 on GPUs that have it, else fp16; fp32 on the CPU")
    parser.add_argument("--presets", nargs="+", metavar="TASK/PRESET",
                        help=f"default: {' '.join(DEFAULT_PRESETS)} ({' '.join(SMOKE_PRESETS)} with --smoke); "
                             "commas work too")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny presets and a few steps: checks that the benchmark runs (e.g. --device cpu)")
    parser.add_argument("--batch-size", type=int, help="samples per micro-step for every preset (default per preset)")
    parser.add_argument("--target-batch-size", type=int,
                        help="samples per epoch (default: what the plain loop computes in --epoch-seconds)")
    parser.add_argument("--epoch-seconds", type=float, help="length of an epoch at the plain loop's rate (default 6)")
    parser.add_argument("--epochs", type=int, help="measured epochs after the warm-up epoch (default 2)")
    parser.add_argument("--data-workers", type=int, help="DataLoader workers on every side (default 4; smoke 0)")
    parser.add_argument("--peers", type=int, nargs="+", choices=(1, 2),
                        help="geotrain swarms to run: 1 (a swarm of one), 2 (two trainers sharing the device); "
                             "default 1 2 (1 with --smoke)")
    parser.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=True,
                        help="geotrain's --offload-optimizer (default on, as in geotrain)")
    parser.add_argument("--timeout-s", type=float, help="limit per side (default 240 s; smoke 120 s)")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)  # internal: run the plain loop for this spec
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"epoch_seconds": 0.3 if smoke else 6.0, "epochs": 1 if smoke else 2,
                "data_workers": 0 if smoke else 4, "timeout_s": 120.0 if smoke else 240.0}
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
    if args.epochs < 1 or args.epoch_seconds <= 0 or args.data_workers < 0:
        parser.error("--epochs must be at least 1, --epoch-seconds above 0, --data-workers at least 0")
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
        args.device, args.precision, machine = resolve(args)
    except UsageError as error:
        print(f"gpu_throughput: {error}", file=sys.stderr)
        return 2
    started = time.monotonic()
    gpu = f" ({machine['gpu']})" if machine["gpu"] else ""
    sides = ", ".join(["plain loop", *(f"geotrain x{peers}" for peers in args.peers)])
    print(f"gpu_throughput: {', '.join(args.presets)} on {args.device}{gpu} in {args.precision}; per preset: {sides}; "
          f"{args.epochs} measured epochs of about {args.epoch_seconds:g} s each", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as temporary:
        for preset in args.presets:
            directory = Path(temporary) / preset.replace("/", "-")
            directory.mkdir(parents=True)
            rows.append(measure_preset(preset, args, directory))
    report = {
        "benchmark": "gpu_throughput",
        "what": "samples/s and peak GPU memory: geotrain local --peers 1 and --peers 2 (sharing one GPU) vs a plain "
                "PyTorch mixed-precision loop with the same model, data, loss, batch, target batch and precision",
        "setup": {"device": args.device, "precision": args.precision, "smoke": args.smoke,
                  "data_workers": args.data_workers, "offload_optimizer": args.offload_optimizer,
                  "geotrain_peers": args.peers, "epochs_measured": args.epochs, "warmup_epochs": 1,
                  "epoch_seconds": args.epoch_seconds,
                  "optimizer": "adamw", "learning_rate": LEARNING_RATE, "network_profile": "loopback", **machine},
        "rows": rows,
        "target_ratio_x1_over_plain": TARGET_RATIO,
        "emj24_note": EMJ24_TWO_GPU_NOTE,
        "seconds": time.monotonic() - started,
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report), flush=True)
    print(f"written to {args.output} ({report['seconds']:.0f} s)", flush=True)
    sides = ["plain", *(f"geotrain_x{peers}" for peers in args.peers)]
    failed = [row["preset"] for row in rows if any("error" in row.get(side, {"error": "not run"}) for side in sides)]
    if failed:
        print(f"gpu_throughput: some sides failed for {', '.join(failed)}; see the JSON", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
