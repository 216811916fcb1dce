"""
Benchmark: what rounding a batch's length up to a multiple of finetune.ALIGN buys a GRPO
rollout (episode 16, step 7). For each of --rollouts rollouts from the fine-tuned model, the
same stories are packed twice, at the rollout's own length (ALIGN 1) and rounded up (ALIGN
16), and the two take turns, --rounds times: one model's log-probabilities over the 128
stories, then one update minibatch of 16 (forward, backward and the optimizer's step, at a
learning rate too small to move the model). Taking turns in one process, the two meet the
same machine: separate runs of bench/rollout.py move with a busy machine by more than this
change does. The medians, in bf16 where the device multiplies faster, as the scripts run.

    python bench/align.py                 (about 4 minutes on a 2-core CPU)
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import finetune  # noqa: E402
from bench.common import machine, synchronize  # noqa: E402
from grpo import grpo_loss, group_advantages, rollout  # noqa: E402
from model import CHECKPOINTS, autocast, default_precision, load_checkpoint, pick_device  # noqa: E402
from ppo import MINIBATCH, pack, token_logprobs  # noqa: E402
from preferences import load_asks  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from train import optimizer_step  # noqa: E402


def packed_at(align, prompts, stories, pad, device):
    """The rollout packed as ppo.pack does, with finetune.ALIGN set to align."""
    kept, finetune.ALIGN = finetune.ALIGN, align
    try:
        return pack(prompts, stories, pad, device)
    finally:
        finetune.ALIGN = kept


def seconds(device, work):
    synchronize(device)
    started = time.perf_counter()
    result = work()
    synchronize(device)
    return result, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=str(CHECKPOINTS / "finetune"))
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device")
    args = parser.parse_args()
    if args.rollouts < 1 or not 1 <= args.rounds <= 128 // MINIBATCH:
        parser.error(f"--rollouts must be at least 1, --rounds between 1 and {128 // MINIBATCH}")
    device = pick_device(args.device)
    precision = default_precision(device)
    tokenizer = load_tokenizer()
    policy = load_checkpoint(args.model, device, tokenizer).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-12, weight_decay=0.0)
    by_length = load_asks(tokenizer)
    asks = [ask for length in sorted(by_length) for ask in by_length[length]]
    times, lengths = {}, {}
    for seed in range(args.rollouts):
        with autocast(device, precision):
            prompts, stories, rewards = rollout(policy, tokenizer, asks, np.random.default_rng(seed), seed)
        advantages, _ = group_advantages(torch.tensor(rewards, device=device))
        batches = {align: packed_at(align, prompts, stories, tokenizer.eot, device) for align in (1, finetune.ALIGN)}
        for turn in range(args.rounds):
            rows = torch.arange(MINIBATCH * turn, MINIBATCH * (turn + 1), device=device)
            for align, (x, y, mask) in batches.items():
                lengths.setdefault(align, set()).add(x.size(1))

                def logprobs():
                    with torch.no_grad(), autocast(device, precision):
                        return token_logprobs(policy, x, y)

                def update():
                    with autocast(device, precision):
                        new = token_logprobs(policy, x[rows], y[rows])
                    loss, _ = grpo_loss(new, old[rows], old[rows], advantages[rows], mask[rows], 0.05)
                    optimizer_step(policy, optimizer, loss, 1e-12)

                old, taken = seconds(device, logprobs)
                times.setdefault(("logprobs", align), []).append(taken)
                times.setdefault(("minibatch", align), []).append(seconds(device, update)[1])
    print(f"machine: {machine()}; device: {device}; {precision}; {args.rollouts} rollouts x {args.rounds} rounds")
    print("| ALIGN | positions | log-probabilities, 128 stories | an update's minibatch of 16 |")
    print("| --- | --- | --- | --- |")
    for align in lengths:
        print(f"| {align} | {', '.join(map(str, sorted(lengths[align])))} | "
              f"{statistics.median(times['logprobs', align]):.2f} s | {statistics.median(times['minibatch', align]):.2f} s |")


if __name__ == "__main__":
    main()
