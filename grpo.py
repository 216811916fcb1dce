"""
Episode 16, GRPO: reinforcement learning without a critic.

Group relative policy optimisation (Shao and others, DeepSeekMath, 2024) takes PPO's update
and drops its critic. For each instruction the policy writes a group of GROUP stories, and
each story's advantage is its reward against its group's: (r - mean) / std over the group,
shared by every token of the story. The objective is DeepSeekMath's equation 3, with PPO's
clip (CLIP), epochs, minibatches and learning rate (ppo.py), and a KL penalty per token with
the estimate e^r - r - 1, r = log p_ref - log p:

    mean over stories i of  1/|o_i| * sum over tokens t of
        min(ratio_t * A_i, clip(ratio_t, 1 - CLIP, 1 + CLIP) * A_i) - kl * (e^r_t - r_t - 1)

Where this departs from the paper and from the frameworks:
- DeepSeekMath writes 64 answers per question and makes one update per rollout, so the
  ratio stays at 1 and the clip never binds; we write 8 stories per instruction and keep
  PPO's two passes, so the clip acts from the second minibatch on.
- The loss averages each story's tokens, then the stories (the paper's; TRL's loss_type
  "grpo"). TRL's default averages over all the tokens of a batch instead ("dapo"), and it
  flags the per-story mean for its length bias: a long story's tokens each weigh less, so a
  long bad story is pushed down more gently than a short one. We follow DeepSeekMath, as
  the episode compares GRPO with the paper's objective; DAPO's token mean is one line away.
- No dynamic sampling (DAPO): a group whose stories all tie has zero advantages and adds
  no gradient; we count those groups rather than refill the batch.
- With --kl 0 there is no penalty (DAPO's choice), but the reference stays, to measure how
  far the policy drifts.
- PPO's precision: log-probabilities in float32, the matrix products of the writing and of
  the update in bfloat16 where the device does them faster (devices.default_precision).
  The formula is the same; the numbers round differently.
- The evaluation each EVAL_EVERY rollouts, the log of each rollout and the end of a run
  are PPO's, shared in rl.py: evaluate (DPO's, which PPO uses too: dpo.words_rate on the
  held-out instructions and the demo story, written with sample.write), rl.log_rollout and
  rl.finish; so is the checkpoint each evaluation saves, with what --resume needs. So are
  the options: --lr defaults to PPO's learning rate, ppo.LR, which is how GRPO trains at
  PPO's rate.

Under torchrun (as TRL runs GRPO on several GPUs; distributed.py): each process writes its
share of the 16 groups and gets the whole rollout back, so the advantages come from whole
groups as here; each takes its share of every minibatch, DDP averaging the gradients, so
an update is one process's on the same stories. Rank 0 alone logs, evaluates and saves.

    python grpo.py --minutes 10 --kl 0.05
    torchrun --standalone --nproc_per_node 2 grpo.py --minutes 10 --kl 0.05
"""
import copy
import json
import time

import numpy as np
import torch

import distributed
from checkpoints import CHECKPOINTS, RUNS, load_checkpoint, run_settings, run_writer
from devices import autocast, resumed_precision
from dpo import evaluate
from evaluate import load_instructions, words_used
from files import check_writable
from ppo import CLIP, EPOCHS, LR, MINIBATCH, pack, token_logprobs
from preferences import load_asks
from rl import (EVAL_EVERY, clip_stats, finish, log_rollout, parse_rl_args, resume, rl_parser, rollout_stats,
                run_name, save_rollout)
from sample import MAX_NEW_TOKENS, cut_at_end, generate
from tokenizer import load_tokenizer
from train import CLIP as GRAD_CLIP  # noqa: F401  optimizer_step's clip, named for the run's settings
from train import optimizer_step

PROMPTS = 16  # instructions per rollout
GROUP = 8  # stories per instruction: 16 x 8 = 128, as many as a rollout of PPO's


@torch.no_grad()
def rollout(policy, tokenizer, asks, rng, seed):
    """Writes a group of stories for each of 16 instructions: the prompts, the stories'
    tokens, and their rewards, group after group."""
    device = next(policy.parameters()).device
    picked = [asks[i] for i in rng.choice(len(asks), PROMPTS, replace=False)]
    # Under torchrun, every process draws the same 16 and writes its own share of the groups.
    picked = picked[distributed.my_rows(PROMPTS)]
    # A group: one instruction, written for eight times, so its stories can be scored against each other.
    prompts = [torch.tensor([tokens], device=device).repeat(GROUP, 1) for tokens, _ in picked]
    # Temperature 1 and no top-k, as in PPO: the update compares probabilities with the full distribution.
    generator = torch.Generator(device=device).manual_seed(distributed.seed(seed))
    outs = generate(policy, prompts, MAX_NEW_TOKENS, temperature=1.0, stop=tokenizer.eot, generator=generator)
    asked, stories, rewards = [], [], []
    for (tokens, words), out in zip(picked, outs):
        # Each row of out is the prompt, then the story: the story is what comes past the prompt.
        for row in out[:, len(tokens):].tolist():
            story = cut_at_end(row, tokenizer.eot)  # it keeps its end-of-text: stopping is learned too
            asked.append(tokens)
            stories.append(story)
            rewards.append(words_used(tokenizer.decode(story), words))
    # Under torchrun, every process gets the whole rollout back, the groups in the order one process writes them.
    return distributed.gather(asked), distributed.gather(stories), distributed.gather(rewards)


def group_advantages(rewards):
    """One advantage per story, from its group's rewards, with no critic; and which groups tied."""
    # In place of a critic: each story's reward against its group's, in spreads above the group's mean.
    groups = rewards.view(-1, GROUP)
    advantages = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)
    # A group whose stories all tie has no way to tell them apart, so its advantages are zeros
    # (rounding in the mean could leave them a hair off).
    tied = (groups == groups[:, :1]).all(dim=1)
    advantages = advantages.masked_fill(tied[:, None], 0.0)
    return advantages.view(-1), tied


def grpo_loss(new, old, ref, advantages, mask, kl):
    """DeepSeekMath's equation 3 on a minibatch, negated; and each token's ratio."""
    ratio = torch.exp(new - old)
    A = advantages.unsqueeze(1)  # the story's advantage, on each of its tokens
    # PPO's clipped objective, and the KL from the reference per token, as in ppo.py.
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * A)
    r = ref - new
    per_token = (surrogate - kl * (torch.exp(r) - r - 1)) * mask
    # A mean over each story's tokens, then over the stories, so a story counts once, however long.
    return -(per_token.sum(dim=1) / mask.sum(dim=1)).mean(), ratio


def main():
    args = parse_rl_args(rl_parser("Train the fine-tuned model with GRPO against the words-used reward.", LR))
    # One process, or under torchrun this process's device, each writing its share of the groups (distributed.py).
    device = distributed.setup(args.device, PROMPTS, "instructions of a rollout")
    name = run_name(args, LR)  # a folder per KL weight: checkpoints/grpo/kl-0.05/
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tokenizer = load_tokenizer()

    # The policy to train, and its frozen copy: the reference the KL is measured from.
    policy = load_checkpoint(CHECKPOINTS / "finetune", device, tokenizer)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    # Dropout off, so the probabilities at the update match the rollout's.
    policy.eval()
    # The policy's weights alone: there is no critic to train.
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    # A group repeats one instruction, so any length will do: one list of them all.
    by_length = load_asks(tokenizer)
    asks = [ask for length in sorted(by_length) for ask in by_length[length]]
    instructions = load_instructions()
    folder = CHECKPOINTS / "grpo" / name
    check_writable(folder, RUNS / "grpo" / name)  # now, not when the first checkpoint is saved
    # A new run starts at rollout 0; --resume goes on from the run's last rollout checkpoint,
    # with the rollouts, seconds and settings it had.
    rollout_count, seconds, started_with = 0, 0.0, {}
    if args.resume:
        made_by = resume(folder, policy, optimizer, rng, tokenizer)["made_by"]
        rollout_count, seconds, started_with = made_by["rollout"], made_by["seconds"], made_by["settings"]
    # bf16 where the device multiplies it faster; a resumed run in the precision it started in,
    # so that it goes on as it would have (devices.resumed_precision).
    precision = args.precision or resumed_precision(started_with, device)
    settings = run_settings(args, globals(), script="grpo.py", device=str(device), precision=precision,
                            processes=distributed.world())
    print(json.dumps(settings))
    # Under torchrun, DDP averages the processes' gradients at each step; in one process, the policy itself.
    ddp_policy = distributed.wrap(policy)
    writer = run_writer(RUNS / "grpo" / name, args.resume)
    writer.add_text("settings", json.dumps(settings, indent=1), rollout_count)

    @distributed.on_rank_0  # under torchrun, rank 0 alone evaluates and saves, the others waiting for it
    def evaluate_and_save():
        evaluate(policy, tokenizer, instructions, writer, rollout_count, unit="rollout")
        save_rollout(folder, rollout_count, time.time() - start, policy, tokenizer, optimizer, rng, settings)

    budget, start = args.minutes * 60, time.time() - seconds
    if not args.resume:
        evaluate_and_save()  # rollout 0: the fine-tuned model, before any training
    while distributed.seconds_since(start) < budget and rollout_count < args.rollouts:
        # 16 groups of 8 stories, packed into one padded batch with a mask over the stories' tokens;
        # written with the update's precision, as bf16 writes faster where it multiplies faster.
        with autocast(device, precision):
            prompts, stories, rewards = rollout(policy, tokenizer, asks, rng, seed=args.seed * 100_000 + rollout_count)
        x, y, mask = pack(prompts, stories, tokenizer.eot, device)
        rewards = torch.tensor(rewards, device=device)
        # One advantage per story: each of its tokens is going to share it.
        advantages, tied = group_advantages(rewards)
        # With no gradients: the log-probabilities of the policy that wrote the stories, which
        # the ratio compares against, and the reference's, for the KL. No values: no critic.
        # (Under torchrun, each process computes its own rows', and gets them all back.)
        my_stories = distributed.my_rows(len(x))
        with torch.no_grad(), autocast(device, precision):
            old = distributed.gather(token_logprobs(policy, x[my_stories], y[my_stories]))
            ref = distributed.gather(token_logprobs(reference, x[my_stories], y[my_stories]))

        # The update is PPO's: two passes over the rollout, in shuffled minibatches of 16 stories
        # (shuffled on the CPU, whose random state a checkpoint keeps for --resume on any device).
        stats = []
        for epoch in range(EPOCHS):
            for rows in torch.randperm(len(x)).to(device).split(MINIBATCH):
                # Under torchrun, every process draws the same minibatches, and takes its share of each.
                mine = rows[distributed.my_rows(len(rows))]  # all of them in one process
                with autocast(device, precision):
                    new = token_logprobs(ddp_policy, x[mine], y[mine])
                loss, ratio = grpo_loss(new, old[mine], ref[mine], advantages[mine], mask[mine], args.kl)
                # PPO's step: zero the gradients, backward, clip them at 1, and the optimiser's step.
                optimizer_step(policy, optimizer, loss, args.lr)
                ratio = distributed.gather(ratio)  # the whole minibatch's, for the figures
                stats.append(clip_stats(ratio, advantages[rows, None].expand_as(ratio), mask[rows], CLIP))

        # How far the policy that wrote this rollout had drifted, as in PPO: KL per story, summed over tokens.
        r = ref - old
        drift = float(((torch.exp(r) - r - 1) * mask).sum(dim=1).mean())
        ties = int(tied.sum())  # groups, of the 16, whose stories all tied
        rollout_count += 1
        logged = {"reward": float(rewards.mean()), "kl": drift, "ties": ties, "frac_reward_zero_std": ties / PROMPTS,
                  **{key: float(np.mean([s[key] for s in stats])) for key in stats[0]},
                  **rollout_stats(stories, old, mask, tokenizer.eot)}
        log_rollout(writer, rollout_count, logged, f"reward {logged['reward']:.3f}, KL {drift:.2f}, "
                    f"{ties} tied groups, {(time.time() - start) / 60:.1f} min")
        if rollout_count % EVAL_EVERY == 0:
            evaluate_and_save()

    # The end is PPO's: one more evaluation if the last rollout wasn't followed by one, then the final model.
    finish(folder, rollout_count, start, policy, tokenizer, settings, writer, evaluate_and_save)


if __name__ == "__main__":
    main()
