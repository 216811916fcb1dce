"""
Benchmark: torch's fused attention (scaled_dot_product_attention, causal) at the shapes of a
GRPO update's minibatch, 16 stories of 6 heads of 64 channels, over lengths around a
rollout's longest (about 220 positions), forward alone and forward with its backward pass,
in bf16 and fp32. The lengths take turns, --repeats rounds, and each figure is the median:
a busy machine slows them all alike.

It is why finetune.collate rounds a batch's length up to a multiple of ALIGN positions: on
the CPU we measured, some lengths run much slower than their neighbours in bf16.

    python bench/attention.py               (15 to 40 seconds on a 2-core CPU)
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import timed  # noqa: E402
from bench.train import DTYPES  # noqa: E402
from devices import machine, pick_device  # noqa: E402
from model import Config  # noqa: E402


def attention_inputs(stories, length, dtype, device):
    """Queries, keys and values as the model's attention makes them: views (stories, heads,
    positions, head size) of one product of all three, (stories, positions, 3 x channels)."""
    config = Config()
    qkv = torch.randn(stories, length, 3 * config.n_embd, dtype=dtype, device=device, requires_grad=True)
    shape = (stories, length, config.n_head, config.n_embd // config.n_head)
    return qkv, [t.view(shape).transpose(1, 2) for t in qkv.split(config.n_embd, dim=2)]


def milliseconds(device, qkv, qkv_views, backward):
    qkv.grad = None  # each backward pass writes its gradient afresh, as in a training step

    def attend():
        if backward:
            F.scaled_dot_product_attention(*qkv_views, is_causal=True).sum().backward()
        else:
            with torch.no_grad():
                F.scaled_dot_product_attention(*qkv_views, is_causal=True)
    return timed(device, attend)[1] * 1000


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[208, 216, 217, 218, 219, 220, 223, 224])
    parser.add_argument("--stories", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device")
    args = parser.parse_args()
    if args.repeats < 1 or args.stories < 1 or min(args.lengths) < 1:
        parser.error("--repeats, --stories and --lengths must be at least 1")
    device = pick_device(args.device)
    torch.manual_seed(0)
    inputs = {(length, name): attention_inputs(args.stories, length, dtype, device)
              for length in args.lengths for name, dtype in DTYPES.items()}
    times = {(key, backward): [] for key in inputs for backward in (False, True)}
    for kept in [False] + [True] * args.repeats:  # the first round warms up, untimed
        for (key, backward), taken in times.items():
            taken_now = milliseconds(device, *inputs[key], backward)
            if kept:
                taken.append(taken_now)
    print(f"machine: {machine()}; device: {device}; {args.stories} stories, the median of {args.repeats} rounds")
    headers = [f"{name} {what}" for name in DTYPES for what in ("forward", "forward and backward")]
    print("| positions | " + " | ".join(headers) + " |")
    print("| --- " * (len(headers) + 1) + "|")
    for length in args.lengths:
        cells = [f"{statistics.median(times[(length, name), backward]):.1f} ms"
                 for name in DTYPES for backward in (False, True)]
        print(f"| {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
