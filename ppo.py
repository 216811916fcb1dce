"""
Episode 8, PPO: the model learns from its own stories, scored by the reward, with a critic.

The policy is the fine-tuned model (checkpoints/finetune), and a frozen copy of it is the
reference. Each rollout, the policy writes 128 stories, in batches of 8 different training
instructions of one length, at temperature 1 with no top-k (the update compares each
token's probability with the full distribution it was drawn from); each story is cut at its
first end-of-text, which it keeps, and the reward (evaluate.words_used) scores it by the
share of the requested words it uses.

The critic is one linear layer on the model's channels (the final layer norm's output): at
each token, it guesses the reward the story is going to get. A token's advantage is the
story's reward R minus that guess V: how much better the story turned out than it looked
from there. Then PPO's update (Schulman and others, 2017): EPOCHS passes over the rollout,
in shuffled minibatches of MINIBATCH stories, maximising for each story token

    min(ratio * A, clip(ratio, 1 - CLIP, 1 + CLIP) * A) - kl * (e^r - r - 1)

where ratio = p(token) / p_old(token), p_old being the policy that wrote it, and
r = log p_ref(token) - log p(token): e^r - r - 1 estimates the KL from the reference at that
token (Schulman's "k3": unbiased, never negative), and it holds the policy near the
fine-tuned model. The loss is that objective's mean over all the stories' tokens, negated,
plus the critic's squared error, weighted by VALUE_WEIGHT.

Choices of ours, where the usual recipe leaves room:
- The critic reads the channels with their gradient stopped: a probe of the policy's
  features, so its error never moves the policy. InstructGPT's critic was a second model,
  as large as the policy; ours is 385 numbers.
- No discount and no GAE: the reward comes once, at the end of a story, so every token's
  return is the story's reward.
- Advantages are whitened over each rollout's story tokens (mean 0, spread 1), as TRL's
  PPO does. On the rewards' own scale (shares of three words, a spread of about a quarter
  once the critic has their level), the KL penalty would weigh about four times as much
  against them as against GRPO's, which are in spreads of their group.
- The policy stays in evaluation mode, dropout off, so the update's probabilities match the
  rollout's, and the first minibatch's ratio is exactly 1.
- Log-probabilities in float32; the matrix products, the writing's and the update's, in
  bfloat16 where the device does them faster (devices.default_precision), as bench/rollout.py
  measures.

Exported for GRPO: CLIP, EPOCHS, LR, MINIBATCH, pack() and token_logprobs(). What both
scripts do around their loop (the options, the figures logged under TRL's names, the
checkpoints, --resume and the end of a run) is rl.py's. The evaluation is DPO's
(dpo.evaluate: the held-out words and the demo story), counted in rollouts.

Under torchrun (distributed.py): each process writes its share of the 16 batches and gets
the whole rollout back, so the whitening is over the whole rollout's tokens; each takes its
share of every minibatch, its losses counted by its share of the minibatch's story tokens,
so that DDP's average of the gradients is one process's update. Rank 0 alone logs,
evaluates and saves.

    python ppo.py --minutes 10 --kl 0.05
    torchrun --standalone --nproc_per_node 2 ppo.py --minutes 10 --kl 0.05
"""
import copy
import json
import time

import numpy as np
import torch
import torch.nn as nn

import distributed
from checkpoints import CHECKPOINTS, RUNS, load_checkpoint, run_settings, run_writer
from devices import autocast, resumed_precision
from dpo import evaluate, target_logprobs
from evaluate import load_instructions, words_used
from files import check_writable
from finetune import collate
from preferences import load_asks
from rl import (EVAL_EVERY, clip_stats, finish, log_rollout, parse_rl_args, resume, rl_parser, rollout_stats,
                run_name, save_rollout)
from sample import MAX_NEW_TOKENS, cut_at_end, generate
from tokenizer import load_tokenizer
from train import CLIP as GRAD_CLIP  # noqa: F401  optimizer_step's clip, named for the run's settings
from train import optimizer_step

CLIP = 0.2  # how far one rollout may move a token's probability, as a ratio: 0.8 to 1.2
EPOCHS = 2  # passes over each rollout
LR = 5e-5  # AdamW's learning rate, no weight decay
MINIBATCH = 16  # stories per update
VALUE_WEIGHT = 0.5  # the critic's squared error, next to the policy's loss
BATCHES, PER_BATCH = 16, 8  # a rollout: 16 batches of 8 instructions of one length, 128 stories


@torch.no_grad()
def rollout(policy, tokenizer, asks, rng, seed):
    """Writes 128 stories, 16 batches of 8 instructions of one length each: the prompts, the
    stories' tokens, and their rewards. A batch's 8 instructions differ; two batches of one
    length draw theirs apart, so an instruction can come back in a rollout."""
    device = next(policy.parameters()).device
    # Eight different instructions of one length stack into a batch with no padding. A length
    # is drawn as often as it holds instructions, so that every instruction of a length that
    # fills a batch is as likely as any other (GRPO's draw): on the shared sample, 1,217 are
    # 18 tokens long and 23 are 19.
    lengths = [length for length, group in asks.items() if len(group) >= PER_BATCH]
    held = np.array([len(asks[length]) for length in lengths])
    batches = []
    for length in rng.choice(lengths, BATCHES, p=held / held.sum()):
        batches.append([asks[length][i] for i in rng.choice(len(asks[length]), PER_BATCH, replace=False)])
    # Under torchrun, every process draws the same 16 batches and writes its own share of them.
    batches = batches[distributed.my_rows(BATCHES)]
    prompts = [torch.tensor([tokens for tokens, _ in batch], device=device) for batch in batches]
    # Temperature 1 and no top-k: the update compares probabilities with the full distribution.
    generator = torch.Generator(device=device).manual_seed(distributed.seed(seed))
    outs = generate(policy, prompts, MAX_NEW_TOKENS, temperature=1.0, stop=tokenizer.eot, generator=generator)
    asked, stories, rewards = [], [], []
    for batch, out in zip(batches, outs):
        for (tokens, words), row in zip(batch, out[:, len(batch[0][0]):].tolist()):
            story = cut_at_end(row, tokenizer.eot)
            asked.append(tokens)
            stories.append(story)
            rewards.append(words_used(tokenizer.decode(story), words))
    # Under torchrun, every process gets the whole rollout back, in the order one process writes it.
    return distributed.gather(asked), distributed.gather(stories), distributed.gather(rewards)


def pack(prompts, stories, pad, device):
    """Prompts and their stories in one padded batch: the tokens x, the targets y (-1 over
    the prompts and the padding), and the mask over the stories' tokens, end-of-text included."""
    x, y = collate([(prompt + story, len(prompt)) for prompt, story in zip(prompts, stories)], pad, device)
    return x, y, (y >= 0).float()


def token_logprobs(model, x, y, hidden=False):
    """Each target's log-probability under model, in float32; 0 over prompts and padding.
    With hidden=True, the final layer norm's output too: the channels the critic reads.
    MINIBATCH rows at a time: a whole rollout's logits at once, 128 x 224 x 5,376 numbers,
    run far past the CPU's caches (twice as slow, measured), and a row's log-probabilities
    come out the same, to the last bit, whichever rows it shares a pass with."""
    logprobs, channels = [], []
    for rows_x, rows_y in zip(x.split(MINIBATCH), y.split(MINIBATCH)):
        logits, rows_channels = model(rows_x, hidden=True)
        logprobs.append(target_logprobs(logits, rows_y))
        channels.append(rows_channels)
    return (torch.cat(logprobs), torch.cat(channels)) if hidden else torch.cat(logprobs)


def ppo_loss(new, old, ref, advantages, mask, kl):
    """The policy's loss on a minibatch, and each token's ratio of new to old probability."""
    ratio = torch.exp(new - old)
    # PPO's clipped objective, and the KL from the reference, per token.
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantages)
    r = ref - new
    per_token = (surrogate - kl * (torch.exp(r) - r - 1)) * mask
    # A mean over all the minibatch's story tokens, negated, as the optimiser minimises.
    return -per_token.sum() / mask.sum(), ratio


def whiten(advantages, mask):
    """The advantages shifted and scaled to a mean of 0 and a spread of 1 over the story
    tokens (mask), and 0 elsewhere."""
    mean = (advantages * mask).sum() / mask.sum()
    spread = ((((advantages - mean) * mask) ** 2).sum() / mask.sum()).sqrt()
    return (advantages - mean) / (spread + 1e-4) * mask


def value_loss(values, rewards, mask):
    """The critic's squared error against each story's reward, over the stories' tokens."""
    return ((values - rewards[:, None]) ** 2 * mask).sum() / mask.sum()


def main():
    args = parse_rl_args(rl_parser("Train the fine-tuned model with PPO against the words-used reward.", LR))
    # One process, or under torchrun this process's device, each writing its share of the batches (distributed.py).
    device = distributed.setup(args.device, BATCHES, "batches of a rollout")
    name = run_name(args, LR)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    tokenizer = load_tokenizer()

    # The policy to train, and its frozen copy: the reference the KL is measured from.
    policy = load_checkpoint(CHECKPOINTS / "finetune", device, tokenizer)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    # Dropout off, so the probabilities at the update match the rollout's.
    policy.eval()
    # The critic: one linear layer on the model's channels, a guess of the reward at each token.
    # It starts at zero, so the first rollout's advantages are the rewards themselves.
    critic = nn.Linear(policy.config.n_embd, 1).to(device)
    nn.init.zeros_(critic.weight)
    nn.init.zeros_(critic.bias)
    # One optimizer for the policy and the critic; no weight decay, as in the usual PPO.
    trained = nn.ModuleList([policy, critic])
    optimizer = torch.optim.AdamW(trained.parameters(), lr=args.lr, weight_decay=0.0)
    asks = load_asks(tokenizer)
    instructions = load_instructions()
    folder = CHECKPOINTS / "ppo" / name
    check_writable(folder, RUNS / "ppo" / name)  # now, not when the first checkpoint is saved
    # A new run starts at rollout 0; --resume goes on from the run's last rollout checkpoint,
    # with the rollouts, seconds and settings it had.
    rollout_count, seconds, started_with = 0, 0.0, {}
    if args.resume:
        checkpoint = resume(folder, policy, optimizer, rng, tokenizer, critic=critic)
        made_by = checkpoint["made_by"]
        rollout_count, seconds, started_with = made_by["rollout"], made_by["seconds"], made_by["settings"]
    # bf16 where the device multiplies it faster; a resumed run in the precision it started in,
    # so that it goes on as it would have (devices.resumed_precision).
    precision = args.precision or resumed_precision(started_with, device)
    settings = run_settings(args, globals(), script="ppo.py", device=str(device), precision=precision,
                            processes=distributed.world())
    print(json.dumps(settings))
    # Under torchrun, DDP averages the processes' gradients at each step; in one process, the modules themselves.
    ddp_policy, ddp_critic = distributed.wrap(policy), distributed.wrap(critic)
    writer = run_writer(RUNS / "ppo" / name, args.resume)
    writer.add_text("settings", json.dumps(settings, indent=1), rollout_count)

    @distributed.on_rank_0  # under torchrun, rank 0 alone evaluates and saves, the others waiting for it
    def evaluate_and_save():
        evaluate(policy, tokenizer, instructions, writer, rollout_count, unit="rollout")
        save_rollout(folder, rollout_count, time.time() - start, policy, tokenizer, optimizer, rng, settings,
                     critic=critic.state_dict())

    budget, start = args.minutes * 60, time.time() - seconds
    if not args.resume:
        evaluate_and_save()  # rollout 0: the fine-tuned model, before any training
    while distributed.seconds_since(start) < budget and rollout_count < args.rollouts:
        # The policy writes 128 stories, and the reward scores them; in the update's precision,
        # as bf16 writes faster where it multiplies faster.
        with autocast(device, precision):
            prompts, stories, rewards = rollout(policy, tokenizer, asks, rng, seed=args.seed * 100_000 + rollout_count)
        x, y, mask = pack(prompts, stories, tokenizer.eot, device)
        R = torch.tensor(rewards, device=device)
        # With no gradients: the log-probabilities of the policy that wrote the stories, the
        # critic's guess at each token, and the reference's log-probabilities, for the KL.
        # (Under torchrun, each process computes its own rows', and gets them all back.)
        my_stories = distributed.my_rows(len(x))
        with torch.no_grad():
            with autocast(device, precision):
                old, channels = token_logprobs(policy, x[my_stories], y[my_stories], hidden=True)
                ref = token_logprobs(reference, x[my_stories], y[my_stories])
            values = critic(channels.float()).squeeze(-1)
            old, ref, values = (distributed.gather(tensor) for tensor in (old, ref, values))
        # Each token's advantage: the story's reward, minus what the critic expected there;
        # whitened, so the objective weighs against the KL penalty on one scale, whatever the rewards'.
        advantages = whiten((R[:, None] - values) * mask, mask)

        # The update: two passes over the rollout, each in shuffled minibatches of 16 stories,
        # shuffled on the CPU, whose random state a checkpoint keeps for --resume on any device.
        stats = []
        for epoch in range(EPOCHS):
            for rows in torch.randperm(len(x)).to(device).split(MINIBATCH):
                # Under torchrun, every process draws the same minibatches, and takes its share of each.
                mine = rows[distributed.my_rows(len(rows))]  # all of them in one process
                with autocast(device, precision):
                    new, channels = token_logprobs(ddp_policy, x[mine], y[mine], hidden=True)
                values_now = ddp_critic(channels.detach().float()).squeeze(-1)
                policy_loss, ratio = ppo_loss(new, old[mine], ref[mine], advantages[mine], mask[mine], args.kl)
                critic_loss = value_loss(values_now, R[mine], mask[mine])
                # Both are means over the story tokens: under torchrun, counted by this process's
                # share of the minibatch's, so that DDP's average is their mean over all of them.
                share = distributed.share(mask[mine], mask[rows])
                # One step for both: the policy's loss and the critic's error, at VALUE_WEIGHT.
                optimizer_step(trained, optimizer, (policy_loss + VALUE_WEIGHT * critic_loss) * share, args.lr)
                stats.append({"value_loss": distributed.mean(critic_loss.item() * share),
                              **clip_stats(distributed.gather(ratio), advantages[rows], mask[rows], CLIP)})

        # How far the policy that wrote this rollout had drifted: its KL per story, summed over tokens.
        r = ref - old
        drift = float(((torch.exp(r) - r - 1) * mask).sum(dim=1).mean())
        rollout_count += 1
        logged = {"reward": float(R.mean()), "kl": drift, **{k: float(np.mean([s[k] for s in stats])) for k in stats[0]},
                  **rollout_stats(stories, old, mask, tokenizer.eot)}
        log_rollout(writer, rollout_count, logged,
                    f"reward {logged['reward']:.3f}, KL {drift:.2f}, value loss {logged['value_loss']:.4f}, "
                    f"clipped {logged['clip_ratio/region']:.1%}, {logged['completions/mean_length']:.0f} tokens, "
                    f"{(time.time() - start) / 60:.1f} min")
        if rollout_count % EVAL_EVERY == 0:
            evaluate_and_save()
    # The final model is measured too, if the last rollout wasn't, and saved.
    finish(folder, rollout_count, start, policy, tokenizer, settings, writer, evaluate_and_save)


if __name__ == "__main__":
    main()
