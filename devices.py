"""
The machine a script runs on: the device it picks (the GPU when there is one), the precision
of its matrix products, and a line that describes the machine, for the figures measured on it.
Plumbing that every script imports; a learner may skip it.
"""
import math
import os
import platform
import time
from contextlib import nullcontext

import torch


def pick_device(name=None):
    """The GPU when there is one (CUDA, then Apple's MPS), else the CPU; --device overrides."""
    if name:
        return chosen_device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def chosen_device(name):
    """The device named by --device, refused in one line when the series doesn't run on it
    (torch knows others: xpu, meta...) or this machine has no such device."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise SystemExit(f"--device {name}: not a device the series runs on; use cpu, cuda or mps")
    # A Mac has one GPU: mps:0 at most.
    available = {"cpu": lambda: True, "mps": lambda: torch.backends.mps.is_available() and (device.index or 0) == 0,
                 "cuda": lambda: (device.index or 0) < torch.cuda.device_count()}
    if not available[device.type]():
        raise SystemExit(f"--device {name}: this machine (or its build of torch) has no {name}")
    return device


def autocast(device, precision):
    """Matrix products in bfloat16 where asked, weights and their updates in float32."""
    if precision == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


def default_precision(device):
    """bf16 on CUDA GPUs that have it and on CPUs that multiply bf16 matrices clearly faster
    than fp32 (the series' AMD EPYC: about 2.1 times; many laptops' CPUs: slower); fp32
    elsewhere, Apple's MPS included. --precision overrides it. Under torchrun on the CPU every
    process calls it, together: they take rank 0's timing."""
    if device.type == "cuda":
        # From compute capability 8 (NVIDIA's Ampere) a GPU multiplies bf16 itself; older ones
        # (a T4, a V100) have no bf16 units and torch emulates them, though
        # torch.cuda.is_bf16_supported() says yes for them. Under ROCm (AMD's GPUs) torch's own
        # check says yes for every GPU, and so does this.
        return "bf16" if torch.version.hip or torch.cuda.get_device_capability(device)[0] >= 8 else "fp32"
    if device.type == "cpu":
        return "bf16" if rank_0s_timing(bf16_speedup_on_cpu()) > 1.5 else "fp32"
    return "fp32"


def rank_0s_timing(speedup):
    """Under torchrun, rank 0's timing in every process, so that all of them train in one
    precision (each process times its own CPU, at the same moment as the others, and two
    could fall either side of the line); in one process, its own."""
    # Written here, not in distributed.py, as distributed.py imports this file.
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return speedup
    shared = torch.tensor([speedup], dtype=torch.float64)  # on the CPU, where gloo, the CPU runs' backend, takes it
    torch.distributed.broadcast(shared, 0)
    return shared.item()


def resumed_precision(settings, device):
    """The precision a run's settings record, for the run going on on a device of the kind it
    started on, so that it makes the model it would have made (saying so where this machine
    would pick the other one: a CPU without fast bf16, say); default_precision's on another
    kind of device, for a new run (no settings) or one that recorded no precision or device."""
    picked = default_precision(device)
    recorded = "precision" in settings and "device" in settings
    if not recorded or torch.device(settings["device"]).type != device.type:
        return picked
    if settings["precision"] != picked:
        print(f"going on in {settings['precision']}, the precision the run started in, where this machine "
              f"picks {picked}; --precision {picked} trains on in it")
    return settings["precision"]


def bf16_speedup_on_cpu(size=512, repeats=4, rounds=5):
    """How many times faster this CPU multiplies bf16 matrices than fp32 ones: each
    precision's fastest of `rounds` rounds of `repeats` products, the two taking turns, so
    that a moment when the machine is busy elsewhere (a few milliseconds are enough to
    outweigh a round) is unlikely to pick a whole run's precision."""
    matrices = {dtype: torch.randn(size, size, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    fastest = dict.fromkeys(matrices, math.inf)
    for a in matrices.values():
        a @ a  # warm up
    for _ in range(rounds):
        for dtype, a in matrices.items():
            start = time.perf_counter()
            for _ in range(repeats):
                a @ a
            fastest[dtype] = min(fastest[dtype], time.perf_counter() - start)
    return fastest[torch.float32] / fastest[torch.bfloat16]


def machine():
    """The machine in one line: its CPU and cores, its GPU if any, and torch's version and threads."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads"
