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
- Advantages are not normalised: every reward is a share of three words, on one scale.
- The policy stays in evaluation mode, dropout off, so the update's probabilities match the
  rollout's, and the first minibatch's ratio is exactly 1.
- Log-probabilities in float32; the matrix products in bfloat16 where the device does them
  faster (model.default_precision), as bench/rollout.py measures.

Exported for GRPO: CLIP, EPOCHS, LR, MINIBATCH, pack() and token_logprobs(); and what both
scripts do around their loop: rl_parser(), save_rollout(), resume(), log_rollout(), finish(),
and the figures logged under TRL's names, clip_stats() and rollout_stats(). The evaluation is
DPO's (dpo.evaluate: the held-out words and the demo story), counted in rollouts.

    python ppo.py --minutes 10 --kl 0.05
"""
import argparse
import copy
import json
import math
import time

import numpy as np
import torch
import torch.nn as nn
from torch.utils.tensorboard import SummaryWriter

from data import check_writable, load_tokenizer
from dpo import evaluate, target_logprobs
from evaluate import load_instructions, words_used
from finetune import collate
from model import (CHECKPOINTS, RUNS, autocast, default_precision, load_checkpoint, pick_device, read_checkpoint,
                   save_checkpoint)
from preferences import load_asks
from sample import MAX_NEW_TOKENS, cut_at_end
from train import optimizer_step

CLIP = 0.2  # how far one rollout may move a token's probability, as a ratio: 0.8 to 1.2
EPOCHS = 2  # passes over each rollout
LR = 5e-5  # AdamW's learning rate, no weight decay
MINIBATCH = 16  # stories per update
VALUE_WEIGHT = 0.5  # the critic's squared error, next to the policy's loss
BATCHES, PER_BATCH = 16, 8  # a rollout: 16 batches of 8 instructions of one length, 128 stories
EVAL_EVERY = 10  # rollouts
SEED = 1337


def rl_parser(description):
    """The options of ppo.py and grpo.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--minutes", type=float, default=10, help="training time (default 10)")
    parser.add_argument("--kl", type=float, default=0.05, help="the KL penalty's weight (default 0.05)")
    parser.add_argument("--lr", type=float, default=LR, help=f"the learning rate (default {LR:g}, PPO's); "
                        "another one gets its own folder")
    parser.add_argument("--seed", type=int, default=SEED, help=f"default {SEED}; another seed gets its own folder")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: bf16 where it is faster")
    parser.add_argument("--rollouts", type=int, default=math.inf, help="stop after this many rollouts, if sooner")
    parser.add_argument("--resume", action="store_true", help="go on from the run's last rollout checkpoint")
    return parser


def parse_rl_args(parser):
    args = parser.parse_args()
    if not 0 < args.minutes < math.inf:
        parser.error("--minutes must be a positive number")
    if not 0 <= args.kl < math.inf:
        parser.error("--kl must be a number, 0 or more")
    if not 0 < args.lr < math.inf:
        parser.error("--lr must be a positive number")
    if args.rollouts < 1:
        parser.error("--rollouts must be at least 1")
    return args


def run_name(args):
    """The run's folder, named after its KL weight: kl-0.05, kl-0; kl-0.05-seed-2 for another
    seed, kl-0.05-lr-1e-05 for another learning rate."""
    return (f"kl-{args.kl:g}" + (f"-lr-{args.lr:g}" if args.lr != LR else "")
            + (f"-seed-{args.seed}" if args.seed != SEED else ""))


@torch.no_grad()
def rollout(policy, tokenizer, asks, rng, seed):
    """Writes 128 stories, each for an instruction of its own: the prompts, the stories'
    tokens, and their rewards."""
    device = next(policy.parameters()).device
    # Eight different instructions of one length stack into a batch with no padding.
    lengths = [length for length, group in asks.items() if len(group) >= PER_BATCH]
    batches = []
    for length in rng.choice(lengths, BATCHES):
        batches.append([asks[length][i] for i in rng.choice(len(asks[length]), PER_BATCH, replace=False)])
    prompts = [torch.tensor([tokens for tokens, _ in batch], device=device) for batch in batches]
    # Temperature 1 and no top-k: the update compares probabilities with the full distribution.
    generator = torch.Generator(device=device).manual_seed(seed)
    outs = policy.generate(prompts, MAX_NEW_TOKENS, temperature=1.0, stop=tokenizer.eot, generator=generator)
    asked, stories, rewards = [], [], []
    for batch, out in zip(batches, outs):
        for (tokens, words), row in zip(batch, out[:, len(batch[0][0]):].tolist()):
            story = cut_at_end(row, tokenizer.eot)
            asked.append(tokens)
            stories.append(story)
            rewards.append(words_used(tokenizer.decode(story), words))
    return asked, stories, rewards


def pack(prompts, stories, pad, device):
    """Prompts and their stories in one padded batch: the tokens x, the targets y (-1 over
    the prompts and the padding), and the mask over the stories' tokens, end-of-text included."""
    x, y = collate([(prompt + story, len(prompt)) for prompt, story in zip(prompts, stories)], pad, device)
    return x, y, (y >= 0).float()


def token_logprobs(model, x, y):
    """Each target's log-probability under model, in float32; 0 over prompts and padding."""
    logits, _ = model(x)
    return target_logprobs(logits, y)


def ppo_loss(new, old, ref, advantages, mask, kl):
    """The policy's loss on a minibatch, and each token's ratio of new to old probability."""
    ratio = torch.exp(new - old)
    # PPO's clipped objective, and the KL from the reference, per token.
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantages)
    r = ref - new
    per_token = (surrogate - kl * (torch.exp(r) - r - 1)) * mask
    # A mean over all the minibatch's story tokens, negated, as the optimiser minimises.
    return -per_token.sum() / mask.sum(), ratio


def value_loss(values, rewards, mask):
    """The critic's squared error against each story's reward, over the stories' tokens."""
    return ((values - rewards[:, None]) ** 2 * mask).sum() / mask.sum()


def clip_stats(ratio, advantages, mask):
    """Where the clip binds, as shares of the story tokens, by TRL's names: from below (the
    ratio under 1 - CLIP with a negative advantage) and from above (over 1 + CLIP, positive).
    A ratio outside the band whose advantage points back inside is not clipped."""
    low = masked_mean(((ratio < 1 - CLIP) & (advantages < 0)).float(), mask)
    high = masked_mean(((ratio > 1 + CLIP) & (advantages > 0)).float(), mask)
    return {"clip_ratio/low": low, "clip_ratio/high": high, "clip_ratio/region": low + high}


def rollout_stats(stories, old, mask, eot):
    """What TRL logs of the stories: their mean length, the share cut at the token limit, and
    the policy's entropy per token, estimated as the mean of -log p over the tokens it drew
    (at temperature 1 with no top-k, that mean estimates the entropy without bias)."""
    return {"completions/mean_length": float(mask.sum(dim=1).mean()),
            "completions/clipped_ratio": sum(eot not in story for story in stories) / len(stories),
            "entropy": masked_mean(-old, mask)}


def masked_mean(values, mask):
    return float((values * mask).sum() / mask.sum())


def log_rollout(writer, rollout, logged, line):
    """A rollout's figures, under rollout/ in TensorBoard, and its line in the log."""
    for key, value in logged.items():
        writer.add_scalar(f"rollout/{key}", value, rollout)
    print(f"rollout {rollout}: {line}", flush=True)


def save_rollout(folder, rollout, seconds, policy, tokenizer, optimizer, rng, settings, **state):
    """A checkpoint named after the rollout, with all a resumed run needs: the optimizer, the
    random state, the rollouts and seconds so far (and PPO's critic)."""
    made_by = {"script": settings["script"], "rollout": rollout, "seconds": seconds, "settings": settings}
    save_checkpoint(folder / f"rollout-{rollout}.pt", policy, tokenizer, made_by, optimizer,
                    numpy_random=rng.bit_generator.state, torch_random=torch.get_rng_state(), **state)


def resume(folder, policy, optimizer, rng):
    """Loads the run's last rollout checkpoint into policy, optimizer and random state;
    returns the checkpoint, whose made_by holds the rollouts and seconds so far."""
    saved = sorted(folder.glob("rollout-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not saved:
        raise SystemExit(f"nothing to resume in {folder}: no rollout-N.pt there; start the run without --resume")
    checkpoint = read_checkpoint(saved[-1])
    policy.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    rng.bit_generator.state = checkpoint["numpy_random"]
    torch.set_rng_state(checkpoint["torch_random"])
    made_by = checkpoint["made_by"]
    print(f"resuming {saved[-1]}: rollout {made_by['rollout']}, {made_by['seconds'] / 60:.1f} minutes so far")
    return checkpoint


def finish(folder, rollout, start, policy, tokenizer, settings, writer, evaluate_and_save):
    """The end of a run: the final model measured (if the last rollout wasn't), the writer
    closed, and the model saved in the run's folder."""
    if rollout % EVAL_EVERY:
        evaluate_and_save()
    writer.close()
    seconds = time.time() - start
    made_by = {"script": settings["script"], "rollout": rollout, "seconds": seconds, "settings": settings}
    save_checkpoint(folder, policy, tokenizer, made_by)
    print(f"done: {rollout} rollouts, {seconds / 60:.1f} minutes; the model is in {folder}/model.pt")


def main():
    args = parse_rl_args(rl_parser("Train the fine-tuned model with PPO against the words-used reward."))
    device = pick_device(args.device)
    precision = args.precision or default_precision(device)
    name = run_name(args)
    settings = {**vars(args), "script": "ppo.py", "device": str(device), "precision": precision, "clip": CLIP,
                "epochs": EPOCHS, "minibatch": MINIBATCH, "value_weight": VALUE_WEIGHT,
                "stories": BATCHES * PER_BATCH, "max_new_tokens": MAX_NEW_TOKENS}
    print(json.dumps(settings))
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
    rollout_count, seconds = 0, 0.0
    if args.resume:
        checkpoint = resume(folder, policy, optimizer, rng)
        critic.load_state_dict(checkpoint["critic"])
        rollout_count, seconds = checkpoint["made_by"]["rollout"], checkpoint["made_by"]["seconds"]
    writer = SummaryWriter(RUNS / "ppo" / name)
    writer.add_text("settings", json.dumps(settings, indent=1), rollout_count)

    def evaluate_and_save():
        evaluate(policy, tokenizer, instructions, writer, rollout_count, unit="rollout")
        save_rollout(folder, rollout_count, time.time() - start, policy, tokenizer, optimizer, rng, settings,
                     critic=critic.state_dict())

    budget, start = args.minutes * 60, time.time() - seconds
    if not args.resume:
        evaluate_and_save()  # rollout 0: the fine-tuned model, before any training
    while time.time() - start < budget and rollout_count < args.rollouts:
        # The policy writes 128 stories, and the reward scores them.
        prompts, stories, rewards = rollout(policy, tokenizer, asks, rng, seed=args.seed * 100_000 + rollout_count)
        x, y, mask = pack(prompts, stories, tokenizer.eot, device)
        R = torch.tensor(rewards, device=device)
        # With no gradients: the log-probabilities of the policy that wrote the stories, the
        # critic's guess at each token, and the reference's log-probabilities, for the KL.
        with torch.no_grad():
            with autocast(device, precision):
                logits, channels = policy(x, hidden=True)
                ref = token_logprobs(reference, x, y)
            old = target_logprobs(logits, y)
            values = critic(channels.float()).squeeze(-1)
        # Each token's advantage: the story's reward, minus what the critic expected there.
        advantages = (R[:, None] - values) * mask

        # The update: two passes over the rollout, each in shuffled minibatches of 16 stories.
        stats = []
        for epoch in range(EPOCHS):
            for rows in torch.randperm(len(x), device=device).split(MINIBATCH):
                with autocast(device, precision):
                    logits, channels = policy(x[rows], hidden=True)
                new = target_logprobs(logits, y[rows])
                values_now = critic(channels.detach().float()).squeeze(-1)
                policy_loss, ratio = ppo_loss(new, old[rows], ref[rows], advantages[rows], mask[rows], args.kl)
                critic_loss = value_loss(values_now, R[rows], mask[rows])
                # One step for both: the policy's loss and the critic's error, at VALUE_WEIGHT.
                optimizer_step(trained, optimizer, policy_loss + VALUE_WEIGHT * critic_loss, args.lr)
                stats.append({"value_loss": critic_loss.item(), **clip_stats(ratio, advantages[rows], mask[rows])})

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
