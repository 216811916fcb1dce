"""
Episode 7, DPO: learning from pairs of stories, with no reward model and no sampling.

Direct preference optimisation (Rafailov and others, 2023) trains on the pairs of
preferences.py: for an instruction x, a chosen story c that used more of the words and a
rejected story r that used fewer. The fine-tuned model, frozen, is the reference, and the
loss for a pair is

    -log sigmoid(BETA * ((log p(c|x) - log p_ref(c|x)) - (log p(r|x) - log p_ref(r|x))))

where log p(c|x) sums the log-probabilities of the story's tokens, its end-of-text
included. It makes the chosen story more likely than the reference made it, and the
rejected one less likely, and BETA sets how far from the reference that may go. BETA times
each bracket is the "implicit reward" of a story; their difference is the reward margin,
and accuracy is the share of pairs with a positive margin.

The model trains with dropout off, as a model equal to its reference must give the same
log-probabilities (the loss is then log 2 for every pair), and in float32 by default: a
story's log-probability sums about 200 tokens', and bfloat16's rounding of each would add
up to noise as large as the differences DPO learns from. Adam, no weight decay, the
schedule of train.py over --minutes (over --steps, when given). Every EVAL_EVERY steps, the
share of the words it uses on the held-out instructions, and its story for DEMO. The final
model: checkpoints/dpo/. Nothing in the training is drawn but the order of the pairs, so
--seed N shuffles them in another order, into folders of its own (checkpoints/dpo-seed-N/,
runs/dpo-seed-N/): the spread of a few seeds says how much of a result is that order's luck.

Exported for PPO and GRPO: DEMO, the instruction that asks for rain, cake and jump;
words_rate(), a story for each held-out instruction and the share of the words they use;
and evaluate(), which logs both.

    python dpo.py --minutes 10
    python dpo.py --minutes 10 --seed 2
"""
import copy
import json
import textwrap
import time

import numpy as np
import torch
import torch.nn.functional as F

import distributed
from checkpoints import CHECKPOINTS, RUNS, load_checkpoint, run_settings, run_writer, save_checkpoint
from data import SEED, instruction
from devices import autocast, pick_device
from evaluate import heldout_stories, load_instructions, words_used
from files import check_writable
from finetune import collate
from kernels import log_softmax_at
from preferences import load_pairs
from sample import write
from tokenizer import encode_prompt, load_tokenizer
from train import CLIP as GRAD_CLIP  # noqa: F401  optimizer_step's clip, named for the run's settings
from train import budget_used, learning_rate, optimizer_step, parse_training_args, training_parser

BETA = 0.1  # how far from the reference the preferences may pull the model
LR = 5e-5  # the peak learning rate
MIN_LR = 5e-6
WARMUP = 10  # steps
BATCH = 16  # pairs per step
EVAL_EVERY = 25  # steps between measures on the held-out instructions
DEMO = instruction(["rain", "cake", "jump"])


def run_name(seed):
    """The run's folder: dpo, or dpo-seed-2 for another seed than the series'."""
    return "dpo" + (f"-seed-{seed}" if seed != SEED else "")


def words_rate(model, tokenizer, instructions):
    """A story for each held-out instruction (evaluate.py's seed); the share of the requested words they use."""
    stories = heldout_stories(model, tokenizer, instructions)
    used = [words_used(tokenizer.decode(s), i["words"]) for s, i in zip(stories, instructions)]
    return sum(used) / len(used)


def evaluate(model, tokenizer, instructions, writer, step, unit="step"):
    """The share of the requested words the held-out stories use, and the demo story,
    logged to TensorBoard at `step` and printed (PPO and GRPO count in rollouts)."""
    share = words_rate(model, tokenizer, instructions)
    story = write(model, tokenizer, DEMO, max_new_tokens=120)
    writer.add_scalar("words/heldout", share, step)
    writer.add_text("demo", DEMO + story, step)
    writer.flush()
    print(f"{unit} {step}: the held-out stories use {share:.0%} of the words")
    print(textwrap.indent(textwrap.fill(story, 100), "    "), flush=True)


def target_logprobs(logits, y):
    """Each target's log-probability under logits, in float32; 0 where the target is -1 (the
    prompt and the padding)."""
    # Every row needs a valid index: -1 becomes 0, and the mask then zeroes those.
    return log_softmax_at(logits, y.clamp(min=0)) * (y >= 0)


def story_logprobs(model, x, y):
    """log p(story | instruction) for each row: the sum of the log-probabilities of the
    targets, where targets of -1 (the prompt and the padding) count for nothing."""
    logits, _ = model(x)
    return target_logprobs(logits, y).sum(dim=1)


def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=BETA):
    """The loss for each pair, with the implicit rewards' margin."""
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -F.logsigmoid(margin), margin


def pair_losses(policy, reference, x, y, device, precision):
    """The DPO loss and margin of each pair of a batch (chosen rows first, then rejected)."""
    # The reference's log-probabilities need no gradients; the policy's do.
    with torch.no_grad(), autocast(device, precision):
        ref_chosen, ref_rejected = story_logprobs(reference, x, y).chunk(2)
    with autocast(device, precision):
        chosen, rejected = story_logprobs(policy, x, y).chunk(2)
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected)


def pair_batch(pairs, tokenizer, device):
    """Chosen stories in the first half of the rows, rejected in the second, each after its prompt."""
    examples = []
    for side in ("chosen", "rejected"):
        for pair in pairs:
            prompt = encode_prompt(tokenizer, pair["instruction"])
            examples.append((prompt + pair[f"{side}_tokens"], len(prompt)))
    return collate(examples, tokenizer.eot, device)


def main():
    # float32 by default: log-probabilities summed over a story need it (see above).
    parser = training_parser("Train the fine-tuned model with DPO on preference pairs.", minutes=10, precision="fp32")
    parser.add_argument("--seed", type=int, default=SEED,
                        help=f"the order of the pairs (default {SEED}); another seed gets folders of its own")
    args = parse_training_args(parser)
    # One process: its 100 steps are minutes on a laptop.
    distributed.one_process()
    name = run_name(args.seed)
    check_writable(CHECKPOINTS / name, RUNS / name)  # now, not when the model is saved

    device = pick_device(args.device)
    precision = args.precision
    settings = run_settings(args, globals(), device=str(device), precision=precision)
    print(json.dumps(settings))
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer()
    # The model to train and its frozen copy, the reference; dropout off in both.
    policy = load_checkpoint(CHECKPOINTS / "finetune", device, tokenizer).eval()
    reference = copy.deepcopy(policy).requires_grad_(False)
    # The pairs: that model's own stories, refused if another model wrote them.
    pairs, made_with = load_pairs(tokenizer, written_by=CHECKPOINTS / "finetune")
    instructions = load_instructions()
    optimizer = torch.optim.Adam(policy.parameters(), lr=LR)
    writer = run_writer(RUNS / name, resumed=False)
    writer.add_text("settings", json.dumps({**settings, "pairs": len(pairs), "made_with": made_with}, indent=1), 0)
    rng = np.random.default_rng(args.seed)
    step = 0

    evaluate(policy, tokenizer, instructions, writer, step)  # step 0: the fine-tuned model's figures, to compare against
    started, order, position = time.time(), rng.permutation(len(pairs)), 0
    while True:
        progress = budget_used(time.time() - started, args.minutes, step, args.steps)
        if progress >= 1.0:
            break
        # A batch of pairs, in a new order on each pass over them.
        if position + BATCH > len(order):
            order, position = rng.permutation(len(pairs)), 0
        batch = [pairs[i] for i in order[position:position + BATCH]]
        position += BATCH
        # Each pair's loss against the frozen reference, and the update that lowers their mean.
        x, y = pair_batch(batch, tokenizer, device)
        losses, margins = pair_losses(policy, reference, x, y, device, precision)
        loss = losses.mean()
        optimizer_step(policy, optimizer, loss, learning_rate(step, progress, LR, MIN_LR, WARMUP))
        step += 1

        # Accuracy: the share of this batch's pairs whose chosen story now gains more than the rejected.
        accuracy = (margins > 0).float().mean().item()
        writer.add_scalar("dpo/loss", loss.item(), step)
        writer.add_scalar("dpo/margin", margins.mean().item(), step)
        writer.add_scalar("dpo/accuracy", accuracy, step)
        print(f"step {step}: loss {loss.item():.3f}, margin {margins.mean().item():.3f}, "
              f"accuracy {accuracy:.0%}, {(time.time() - started) / 60:.1f} min", flush=True)
        if step % EVAL_EVERY == 0:
            evaluate(policy, tokenizer, instructions, writer, step)
    if step % EVAL_EVERY:  # the final model is measured too
        evaluate(policy, tokenizer, instructions, writer, step)
    writer.close()
    made_by = {"script": "dpo.py", "step": step, "settings": settings, "pairs": made_with}
    save_checkpoint(CHECKPOINTS / name, policy, tokenizer, made_by)
    print(f"done: {step} steps, {(time.time() - started) / 60:.1f} minutes; "
          f"the model is in {CHECKPOINTS / name}/model.pt")


if __name__ == "__main__":
    main()
