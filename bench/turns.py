"""
Benchmark: two ways of doing one piece of a GRPO rollout's work, taking turns on the same
stories. For each of --rollouts rollouts from the fine-tuned model, --rounds times each way:
one model's log-probabilities over the 128 stories, then one update minibatch of 16
(forward, backward and the optimizer's step, at a learning rate too small to move the
model). Taking turns in one process, the two ways meet the same machine: separate runs of
bench/rollout.py move with a busy machine by more than these changes do; and the way that
goes first changes each round. The medians, and how far apart the two ways'
log-probabilities (without gradients) are.

The ways compared, each a change that episode 16's speed page measures:
- align: a rollout packed at its own length (ALIGN 1), or rounded up to a multiple
  of finetune.ALIGN positions;
- logprobs: each target's log-probability from torch's log_softmax over a float32
  copy of every logit, or from kernels.log_softmax_at;
- attention: the update's attention with torch's backward pass in bfloat16, or
  with kernels.attention's in float32 (the same forward pass).

    python bench/turns.py align           (about 4 minutes on a 2-core CPU)
    python bench/turns.py logprobs        (about 4 minutes)
    python bench/turns.py attention       (about 3 minutes)
"""
import argparse
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dpo  # noqa: E402
import finetune  # noqa: E402
import kernels  # noqa: E402
from bench.common import grpo_asks, timed  # noqa: E402
from checkpoints import CHECKPOINTS, load_checkpoint  # noqa: E402
from devices import autocast, default_precision, machine, pick_device  # noqa: E402
from grpo import group_advantages, grpo_loss, rollout  # noqa: E402
from ppo import MINIBATCH, pack, token_logprobs  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from train import optimizer_step  # noqa: E402


def log_softmax_by_gather(logits, targets):
    """kernels.log_softmax_at's plain counterpart: torch's log_softmax over a float32 copy of every logit."""
    return F.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# For each comparison, its two ways: the one before the step, then the step's, each a with block.
WAYS = {
    "align": {"ALIGN 1": lambda: mock.patch.object(finetune, "ALIGN", 1), f"ALIGN {finetune.ALIGN}": nullcontext},
    "logprobs": {"log_softmax": lambda: mock.patch.object(dpo, "log_softmax_at", log_softmax_by_gather),
                 "log_softmax_at": nullcontext},
    "attention": {"bf16 backward": lambda: mock.patch.object(kernels, "FLOAT32_BACKWARD", False),
                  "float32 backward": nullcontext},
}


def passes(policy, optimizer, x, y, mask, advantages, rows, device, precision):
    """The policy's log-probabilities over the whole rollout, and their seconds and those of one
    update minibatch (these rows), at a learning rate too small to move the policy."""
    def logprobs():
        with torch.no_grad(), autocast(device, precision):
            return token_logprobs(policy, x, y)

    def update(old):
        with autocast(device, precision):
            new = token_logprobs(policy, x[rows], y[rows])
        loss, _ = grpo_loss(new, old[rows], old[rows], advantages[rows], mask[rows], 0.05)
        optimizer_step(policy, optimizer, loss, 1e-12)

    old, logprobs_seconds = timed(device, logprobs)
    return old, {"logprobs": logprobs_seconds, "minibatch": timed(device, lambda: update(old))[1]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("comparison", choices=sorted(WAYS))
    parser.add_argument("model", nargs="?", default=str(CHECKPOINTS / "finetune"))
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device")
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: the scripts' for the device")
    args = parser.parse_args()
    if args.rollouts < 1 or not 1 <= args.rounds <= 128 // MINIBATCH:
        parser.error(f"--rollouts must be at least 1, --rounds between 1 and {128 // MINIBATCH}")
    device = pick_device(args.device)
    precision = args.precision or default_precision(device)
    if args.comparison == "attention" and (device.type != "cpu" or precision != "bf16" or not kernels.FLOAT32_BACKWARD):
        parser.error("attention: the float32 backward pass serves bf16 on a CPU whose torch has the kernel's "
                     "operators; here both ways would be the same")
    tokenizer = load_tokenizer()
    policy = load_checkpoint(args.model, device, tokenizer).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-12, weight_decay=0.0)
    asks = grpo_asks(tokenizer)
    ways = WAYS[args.comparison]
    times, lengths, apart = {}, {}, 0.0
    for seed in range(args.rollouts):
        with autocast(device, precision):
            prompts, stories, rewards = rollout(policy, tokenizer, asks, np.random.default_rng(seed), seed)
        advantages, _ = group_advantages(torch.tensor(rewards, device=device))
        for turn in range(args.rounds):
            rows = torch.arange(MINIBATCH * turn, MINIBATCH * (turn + 1), device=device)
            olds = {}
            # Each way first in every other round, so neither always meets a length's first pass.
            for way, used in list(ways.items())[::1 if turn % 2 == 0 else -1]:
                with used():
                    x, y, mask = pack(prompts, stories, tokenizer.eot, device)
                    old, seconds = passes(policy, optimizer, x, y, mask, advantages, rows, device, precision)
                lengths.setdefault(way, set()).add(x.size(1))
                for part, taken in seconds.items():
                    times.setdefault((part, way), []).append(taken)
                # Each story's tokens, wherever the padding put them: the two ways' should agree.
                olds[way] = old[mask.bool()]
            first, second = olds.values()
            apart = max(apart, float((first - second).abs().max()))
    print(f"machine: {machine()}; device: {device}; {precision}; {args.rollouts} rollouts x {args.rounds} rounds")
    print(f"| {args.comparison} | positions | log-probabilities, 128 stories | an update's minibatch of 16 |")
    print("| --- | --- | --- | --- |")
    for way in ways:
        print(f"| {way} | {', '.join(map(str, sorted(lengths[way])))} | "
              f"{statistics.median(times['logprobs', way]):.2f} s | {statistics.median(times['minibatch', way]):.2f} s |")
    print(f"the two ways' log-probabilities differ by at most {apart:.2g}")


if __name__ == "__main__":
    main()
