"""What the benchmarks share: running each variant in a fresh process, so that its peak
memory is its own, timing a piece of work (a GPU's, not only its queueing), the memory's
speed, the peak memory, and the instructions a GRPO rollout draws from; devices.machine()
describes the machine the figures came from."""
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from preferences import load_asks


def synchronize(device):
    """Waits for the GPU's queued work, so a timer around it measures the work (a CPU runs in order)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(device, work):
    """What work() returns, and the seconds it took."""
    synchronize(device)
    started = time.perf_counter()
    result = work()
    synchronize(device)
    return result, time.perf_counter() - started


def read_bandwidth(device):
    """Bytes a second the device's memory gives: a sum over 256 MB, the best of 5."""
    big = torch.ones(64 * 2**20, device=device)
    return big.numel() * big.element_size() / min(timed(device, big.sum)[1] for _ in range(5))


def peak_memory_mb(device):
    """The most memory the process held: GPU memory on CUDA, resident memory elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return max_resident_mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def max_resident_mb(ru_maxrss):
    """A process's ru_maxrss in MB: counted in kilobytes on Linux, in bytes on macOS."""
    return ru_maxrss / 1024 if sys.platform != "darwin" else ru_maxrss / 2**20


def run_variant(script, variant, extra=()):
    """Runs `script --variant VARIANT` in a new process and returns the JSON it prints last."""
    done = subprocess.run([sys.executable, script, "--variant", variant, *extra], capture_output=True, text=True)
    if done.returncode != 0:  # the last line of its errors says why
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise SystemExit(f"{Path(script).name} --variant {variant} failed: {why}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def grpo_asks(tokenizer):
    """The training instructions as grpo.py draws its rollouts from them: one list, by length."""
    by_length = load_asks(tokenizer)
    return [ask for length in sorted(by_length) for ask in by_length[length]]
