"""
One run on several processes: what pretraining, fine-tuning, PPO and GRPO need to run under
torchrun (torch's launcher: a process per GPU, or per share of the CPU's cores), with
DistributedDataParallel (DDP). Plumbing that a learner may skip: `python train.py` goes
through none of it, as in one process every function here gives back what it was given, or
does nothing.

    torchrun --standalone --nproc_per_node 2 train.py --steps 1000

How a run splits over N processes (docs/torchrun.md):
- Every process draws the same batch (the same seed, so the same random numbers) and takes
  its own rows of it (my_rows). DDP averages the processes' gradients as backward computes
  them, so one update on N processes is one process's update on the same rows, up to the
  order of float additions (dropout aside: each process draws its own masks). A loss that is
  a mean over tokens counts by its share() of the batch's tokens, so that the average over
  the processes is the whole batch's mean.
- PPO and GRPO: every process draws the same rollout's instructions (GRPO's 16, PPO's 16
  batches of 8), writes its share of them, and gather() gives every process the whole
  rollout back: the advantages, the whitening and the figures logged are then computed as
  one process computes them.
- Rank 0 alone prints, logs to TensorBoard, evaluates and saves (on_rank_0, NoWriter); the
  others wait for it. Its clock is everyone's (seconds_since): the learning rate follows
  the minutes, and every process must take the same one, and stop at the same step.
- The processes talk through NCCL on CUDA GPUs (process i on cuda:i of its machine), gloo on
  the CPU. Apple's GPUs (mps) have no backend: a single process only.
Bad use (a number of processes that does not split the batch evenly, a missing backend, a
script that runs in one process: one_process) stops every process with one line, printed
once.
"""
import functools
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from devices import pick_device


def under_torchrun():
    """Whether torchrun started this process: it sets RANK, WORLD_SIZE and LOCAL_RANK for each."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank():
    """This process's number, 0 to world() - 1; 0 in one process."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world():
    """How many processes share the run; 1 in one process."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main():
    """Whether this process logs, evaluates and saves: rank 0, or the only process."""
    return rank() == 0


def setup(device_name, split, what):
    """The device this process runs on. In one process, pick_device's (--device). Under
    torchrun, this process's: the GPU of its LOCAL_RANK (cuda:0, cuda:1... of its machine)
    or the CPU, once the processes are joined in a group (NCCL between GPUs, gloo on the
    CPU). The processes share out `split` `what` (16 windows of a batch, 16 instructions of a
    rollout), so their number must divide it; the other processes' prints go nowhere."""
    if not under_torchrun():
        return pick_device(device_name)
    processes = int(os.environ["WORLD_SIZE"])
    if split % processes:
        *fewer, most = [str(n) for n in range(1, split + 1) if split % n == 0]
        refuse(f"{processes} processes can't take equal shares of the {split} {what}: "
               f"run {', '.join(fewer)} or {most} of them")
    try:
        device = pick_device(device_name)
    except SystemExit as refused:  # --device names a device this machine lacks
        refuse(refused.code)
    if device.type == "mps":
        refuse("torchrun on mps: torch has no backend to join processes on Apple's GPUs; run one process "
               f"(python {script()}), or several on the CPU (--device cpu)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not (dist.is_available() and getattr(dist, f"is_{backend}_available")()):
        on_the_cpu = ", or several on the CPU (--device cpu)" if backend == "nccl" else ""
        refuse(f"torchrun on {device.type}: this build of torch has no {backend} backend to join the processes; "
               f"run one process (python {script()}){on_the_cpu}")
    if device.type == "cuda":
        per_machine, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", processes)), torch.cuda.device_count()
        if per_machine > gpus:
            refuse(f"{per_machine} processes on this machine, one GPU each, and it has {gpus}: "
                   f"use --nproc_per_node {gpus} or fewer")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    # On a GPU, bound to it from the start (torch 2.3 and later); gloo takes no device.
    dist.init_process_group(backend, **({"device_id": device} if device.type == "cuda" else {}))
    if not is_main():
        sys.stdout = open(os.devnull, "w")  # one log, rank 0's; errors still show, from every process
    return device


def script():
    return os.path.basename(sys.argv[0])


def one_process():
    """Stops a script that runs in one process when torchrun started it: each process would do
    all of its work, and write its results again."""
    if under_torchrun():
        refuse(f"{script()} runs in one process: python {script()} (torchrun takes train.py, finetune.py, "
               "ppo.py and grpo.py)")


def refuse(message):
    """Stops every process, the first of each machine with the line that says why, the others
    without a word a moment later (after it, so that the line comes once and first; torchrun
    then reports the processes that stopped)."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        raise SystemExit(message)
    time.sleep(2)
    raise SystemExit(1)


def wrap(model):
    """The model under DDP: each process starts from rank 0's weights, and backward averages
    the gradients over the processes; what trains is still the model, whose state_dict has
    its own names (no "module."). In one process, the model itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return model
    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def my_rows(count):
    """This process's rows of `count` (a slice): the i-th of world() equal runs of them, so that
    the processes' rows, one after another, are all the rows in order. All of them in one process."""
    return slice(rank() * count // world(), (rank() + 1) * count // world())


def share(part, whole):
    """What a mean over `part` of a batch's tokens (a mask, or weights) is multiplied by, so
    that DDP's average over the processes is the mean over `whole`: the part's share of the
    tokens, times the number of processes. Exactly 1 in one process, where the part is the whole."""
    return world() * float(part.sum()) / float(whole.sum())


def pieces(model, counted, micro_batch=None):
    """This process's rows of a batch, micro_batch rows at a time (all at once by default),
    for gradient accumulation: for each piece, its rows (a slice), its share() of the batch's
    tokens (counted: a mask or weights, a row per example), and what to run its forward and
    backward passes under: DDP's no_sync() for all but the last piece, so that the gradients
    add up in each process and are averaged over the processes once, with the last."""
    mine = my_rows(len(counted))
    size = micro_batch or mine.stop - mine.start
    starts = range(mine.start, mine.stop, size)
    for start in starts:
        rows = slice(start, min(start + size, mine.stop))
        syncing = start == starts[-1] or not isinstance(model, DistributedDataParallel)
        yield rows, share(counted[rows], counted), nullcontext() if syncing else model.no_sync()


def gather(values):
    """Every process's values, rank 0's first: tensors (of one shape in every process) joined
    along their first dimension, lists joined into one. The values themselves in one process."""
    if world() == 1:
        return values
    if isinstance(values, torch.Tensor):
        parts = [torch.empty_like(values) for _ in range(world())]
        dist.all_gather(parts, values.detach().contiguous())
        return torch.cat(parts)
    parts = [None] * world()
    dist.all_gather_object(parts, values)
    return [value for part in parts for value in part]


def mean(number):
    """A number's mean over the processes, for the logs; the number itself in one process."""
    if world() == 1:
        return number
    total = torch.tensor(float(number), dtype=torch.float64, device=talking_device())
    dist.all_reduce(total)
    return total.item() / world()


def seconds_since(start):
    """Seconds since start, by rank 0's clock: every process takes the same learning rate and
    stops at the same step when a budget is in minutes."""
    seconds = time.time() - start
    if world() == 1:
        return seconds
    seconds = torch.tensor(seconds, dtype=torch.float64, device=talking_device())
    dist.broadcast(seconds, 0)
    return seconds.item()


def talking_device():
    """Where the tensors the processes exchange must be: NCCL's on this process's GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def seed(number):
    """This process's own seed from the run's: the run's for rank 0 (so one process is
    unchanged), one drawn from (seed, rank) for each other rank, so that no two processes
    draw the same random numbers (their dropout, the stories they write)."""
    if rank() == 0:
        return number
    return int(np.random.SeedSequence([number, rank()]).generate_state(1)[0])


def on_rank_0(function):
    """function run by rank 0 alone, the other processes waiting for it (evaluating, logging,
    saving); in one process, function itself."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        result = function(*args, **kwargs) if is_main() else None
        barrier()
        return result
    return run


class NoWriter:
    """TensorBoard's writer for the processes other than rank 0: it writes nothing, as rank 0 alone logs."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def barrier():
    """Every process waits here until all have come."""
    if world() > 1:
        dist.barrier()


def end():
    """The processes leave their group together, at the end of a run."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
