"""
Episode 3, instructions: the pretrained model learns to write a story for an instruction,
and to use the words the instruction asks for.

Each example is a prompt (an end-of-text, then "Write a story that uses the words kite,
river and brave." and a newline), then the story, then end-of-text. The loss counts only the
story's tokens and its end-of-text, so the model learns to answer instructions, not to write
them, and to end a story on its own. Four choices make it read the words from the
instruction rather than recall them with a story it knows:

- The stories are those data.py kept out of pretraining (data/instructions.jsonl): a story
  the model has read many times is predicted from its own first tokens, and an instruction
  would add nothing to the loss.
- Each pass over the stories asks each of them for other words it uses, drawn anew, so the
  words can only be read from the instruction, never recalled with the story.
- Each story is asked for WORDS, 24, of its words (all it has, if fewer), where the
  evaluation asks for three: the first use of a word the instruction names is a token only
  the instruction can help with, and 24 words make those tokens a large enough share of the
  loss for the model to learn to copy them.
- Three eighths of each batch (PLAIN_SHARE) are windows of the pretraining stories
  (data/train.bin, read as pretraining reads it): a replay that keeps the model writing
  stories as well as it did, and lets it train at pretraining's peak learning rate.

Pretraining's optimizer, schedule and training step (train.py). The budget is STEPS, 1,000
steps, or --minutes if those run out first: the schedule runs over the steps, so any machine
makes the same model, a faster one sooner. Two losses are logged: on instructions held back
from training (is it learning the task?) and on plain valid stories (does it still write
stories? it should stay close to the pretrained model's). The final model goes to
checkpoints/finetune/.

The levers, each an option; a run that moves one off its default trains into a folder named
after it (checkpoints/finetune-plain-0.5, finetune-words-8-seed-2, ...):

    --lr LR                the peak learning rate (default 1e-3, pretraining's)
    --plain-share SHARE    the share of each batch given to plain stories, the replay (0.375)
    --words N              the words each training story is asked for (24; the evaluation asks 3)
    --swap SHARE           the share of asked nouns swapped, throughout the story, for another
                           noun that only the instruction names (0: off)
    --first-use-weight W   a diagnostic, no recipe: the loss on each asked word's first use
                           counts W times, to see whether the model can learn to copy at all (1)
    --asks N               the sets of words each story is asked for on each pass (1)
    --seed N               the training seed: the stories' order, the words asked, the replay's
                           windows, the dropout; the held-back instructions stay the same
    --keep                 keeps the model of each evaluation beside the final one, as step-N.pt,
                           to measure the words used against steps
    --steps N, --minutes M the budget: 1,000 steps, or 120 minutes if those run out first
    --micro-batch ROWS     rows put through the model at once, their gradients adding up to the
                           same step (gradient accumulation, for less memory; default: all)

Choices of ours: examples longer than the model's context, 256 tokens, are cut there, so
they end without their end-of-text; a batch is padded to its longest example, rounded up to
a multiple of ALIGN positions (16: the attention is faster so, for the rollouts and DPO; with
the replay's windows a batch already has 256), the padding masked out of the loss; the first
TUNE_POOL instructions are read, all of the shared sample's and more than any run asks for
on the full download.

Under torchrun (distributed.py, docs/torchrun.md) each process takes its own rows of each
batch, as in pretraining; the loss stays the mean over the whole batch's story tokens, as
each process's share counts by its tokens.

    python finetune.py                              # 1,000 steps, at most --minutes 120
    python finetune.py --keep --seed 2              # another training seed, each evaluation's model kept
    python finetune.py --plain-share 0.5 --words 8  # levers off their defaults, in a folder of their own
    torchrun --standalone --nproc_per_node 2 finetune.py   # the same steps on two processes
"""
import json
import math
import random
import re
import time

import numpy as np
import torch
import torch.nn.functional as F

import distributed
from checkpoints import CHECKPOINTS, RUNS, load_checkpoint, run_settings, run_writer, save_checkpoint, stop_if_diverged
from data import SEED, WORD, ask, instruction
from devices import autocast, default_precision
from files import check_writable, read_instructions, read_words
from tokenizer import encode_prompt, load_tokenizer
from train import (CONTEXT, accumulated_step, add_micro_batch, budget_used, demo_story, learning_rate, load_tokens,
                   make_optimizer, parse_training_args, train_step, training_parser, valid_loss)
# Pretraining's optimizer and gradient clip, which make_optimizer and the training step use:
# named here so that the run's settings record them (run_settings reads the module's constants).
from train import BETAS, WEIGHT_DECAY  # noqa: F401
from train import CLIP as GRAD_CLIP  # noqa: F401

BATCH = 16  # examples per step
MAX_LENGTH = CONTEXT  # tokens of an example, prompt included: the positions pretraining trained
# A batch's positions, rounded up to a multiple: bf16 attention ran forward 2.2 to 3.7 times as slow
# at some lengths as at their multiple of 16 on the CPUs bench/attention.py measured (217 against 224).
ALIGN = 16
LR = 1e-3  # the peak, pretraining's: the replay below keeps the stories that so large a rate would shake
PLAIN_SHARE = 0.375  # of each batch: plain stories, the replay that keeps the loss on plain stories
# Off: swapping asked nouns did not raise the words used (episode 3's lab).
SWAP = 0.0  # of the asked nouns: swapped for other nouns throughout the story
WORDS = 24  # asked of each training story (the evaluation asks for three): more first uses to learn from
STEPS = 1_000  # the budget: the held-back instructions' loss flattens from step 900 (episode 3)
MINUTES = 120  # at most: 1,000 steps took 45 to 60 on two CPU cores with fast bf16, 69 to 76 without
MIN_LR = 3e-5
WARMUP = 50  # steps
EVAL_EVERY = 100  # steps
HELD_BACK = 256  # train instructions kept out of training, for the instruction loss
# Fine-tuning reads the first TUNE_POOL instructions: all of the shared sample's 1,240, and on the
# full download (over half a million) more than a 3,000-step run asks for (30,000), not the whole file.
TUNE_POOL = 50_000
SEEDS_APART = 1_000_000  # asks of a story between two training seeds' first: more than any run makes
EXAMPLE = instruction(["kite", "river", "brave"])  # the story logged at each evaluation
DEMO_TOKENS = 200  # its most tokens: a whole story, as many as sample.MAX_NEW_TOKENS (episode 4) gives one


def encode_example(tokenizer, example):
    """An instruction as (tokens, prompt length): the prompt, the story, end-of-text."""
    prompt = encode_prompt(tokenizer, example["instruction"])
    tokens = prompt + tokenizer.encode(example["story"]) + [tokenizer.eot]
    return tokens[:MAX_LENGTH], len(prompt)


def split_held_back(instructions):
    """The instructions to train on, and the last HELD_BACK of one shuffle with the series'
    seed, whatever the run's: the same held back for every run, to measure the instruction
    loss (bench/instruction_probe.py probes them too)."""
    order = np.random.default_rng(SEED).permutation(len(instructions))
    return [instructions[i] for i in order[:-HELD_BACK]], [instructions[i] for i in order[-HELD_BACK:]]


def a_pass(rng, stories, asks, epoch, seed=SEED):
    """One pass over the stories, in a shuffled order: each story's index `asks` times, with
    the seed of each of its asks, new for each pass (with the run's default seed, the first
    pass's first is the file's). Two runs' seeds are SEEDS_APART asks apart, so that no two
    runs ever ask a story with the same seed, whatever their seeds and passes."""
    first = SEED + (seed - SEED) * SEEDS_APART + epoch * asks
    return [(i // asks, first + i % asks) for i in rng.permutation(stories * asks).tolist()]


def ask_anew(story, askable, seed, nouns=(), swap=0.0, words=WORDS):
    """A story as an instruction, asked for `words` words it uses (all it has, if fewer), drawn
    with the seed (a new one for each pass over the stories; with three words, the first pass's
    are those of data/instructions.jsonl), with a share `swap` of the asked nouns swapped for
    other nouns throughout the story."""
    example = ask(story, askable, seed, words)
    return swap_nouns(example, nouns, swap, seed) if swap else example


def swap_nouns(example, nouns, share, seed):
    """The example with each asked noun, with probability share, replaced throughout its story
    by another noun the story doesn't use (singular for singular, plural for plural), and the
    instruction asking for that one: a word that only the instruction can give away, however
    well the story is remembered. Other forms of the word ("kites" for "kite") stay as they are."""
    rng = random.Random(f"{seed}:{example['story']}")
    story, words = example["story"], list(example["words"])
    in_story = set(WORD.findall(story.lower()))
    for i, word in enumerate(words):
        if word not in nouns or rng.random() >= share:
            continue
        others = [n for n in sorted(nouns) if is_plural(n) == is_plural(word) and n not in in_story]
        if not others:  # every noun of its kind is in the story already: the word stays
            continue
        new = rng.choice(others)
        for old, replacement in ((word, new), (word.capitalize(), new.capitalize())):
            story = re.sub(rf"\b{old}\b", replacement, story)
        words[i] = new
        in_story.add(new)
    return {"words": words, "instruction": instruction(words), "story": story}


def is_plural(noun):
    return noun.endswith("s") and not noun.endswith(("ss", "us"))


def first_uses(tokenizer, words, story):
    """(place in the story's tokens, token) of the first use of each asked word the story uses:
    the word's first token, with its space (bench/instruction_probe.py measures the same places)."""
    tokens = [tokenizer.encode(" " + word)[0] for word in words]
    return [(story.index(token), token) for token in tokens if token in story]


def first_use_weights(tokenizer, examples, encoded, y, weight):
    """A weight for each target of y: `weight` on the first use in its story of each word an
    instruction asks for, 1 elsewhere. The rows of y past the examples (plain windows) weigh 1 throughout."""
    weights = torch.ones(y.shape)
    for row, (example, (tokens, prompt_length)) in enumerate(zip(examples, encoded)):
        for place, _ in first_uses(tokenizer, example["words"], tokens[prompt_length:]):
            # Position i predicts token i + 1: the story's token k is the target at prompt_length + k - 1.
            weights[row, prompt_length + place - 1] = weight
    return weights.to(y.device)


def weighted_step(model, optimizer, x, y, weights, device, precision, lr, micro_batch=None):
    """train.py's training step with each target's loss weighed: a weighted mean over the targets."""
    weights = weights * (y >= 0)

    def weighted_mean_loss(rows):
        with autocast(device, precision):
            logits, _ = model(x[rows])
        losses = F.cross_entropy(logits.flatten(0, 1).float(), y[rows].flatten(), ignore_index=-1, reduction="none")
        return (losses * weights[rows].flatten()).sum() / weights[rows].sum()
    return accumulated_step(model, optimizer, weighted_mean_loss, weights, lr, micro_batch)


def plain_windows(tokens, rng, count):
    """count windows of data/train.bin, as pretraining reads them: a context's worth of the
    stories pretraining trained on, every token a target (a prompt of one token)."""
    starts = rng.integers(0, len(tokens) - MAX_LENGTH - 1, size=count)
    return [(tokens[start:start + MAX_LENGTH + 1].tolist(), 1) for start in starts]


def run_name(args):
    """The run's folder: finetune, or finetune-lr-0.0003 (-asks-3, -plain-0, -swap-1, -words-8,
    -first-use-10) with a lever off its default, and -seed-2 for another training seed."""
    return ("finetune" + (f"-lr-{args.lr:g}" if args.lr != LR else "") + (f"-asks-{args.asks}" if args.asks > 1 else "")
            + (f"-plain-{args.plain_share:g}" if args.plain_share != PLAIN_SHARE else "")
            + (f"-swap-{args.swap:g}" if args.swap != SWAP else "")
            + (f"-words-{args.words}" if args.words != WORDS else "")
            + (f"-first-use-{args.first_use_weight:g}" if args.first_use_weight != 1 else "")
            + (f"-seed-{args.seed}" if args.seed != SEED else ""))


def collate(examples, pad, device):
    """A padded batch; targets are -1 (skipped by the loss) over prompts and padding. Its
    positions are the longest example's, rounded up to a multiple of ALIGN (the context is one)."""
    longest = max(len(tokens) for tokens, _ in examples) - 1
    rounded_up = math.ceil(longest / ALIGN) * ALIGN
    length = max(longest, min(rounded_up, MAX_LENGTH))  # never past the context, which is a multiple
    x = torch.full((len(examples), length), pad, dtype=torch.long)
    y = torch.full((len(examples), length), -1, dtype=torch.long)
    for row, (tokens, prompt_length) in enumerate(examples):
        tokens = torch.tensor(tokens)
        x[row, :len(tokens) - 1] = tokens[:-1]
        # Position i predicts token i + 1: the story starts at the prompt's length.
        y[row, prompt_length - 1:len(tokens) - 1] = tokens[prompt_length:]
    return x.to(device), y.to(device)


@torch.no_grad()
def instruction_loss(model, examples, pad, device, precision):
    """The loss on the stories of examples, as in training, without dropout."""
    model.eval()
    losses, counts = [], []
    for start in range(0, len(examples), BATCH):
        x, y = collate(examples[start:start + BATCH], pad, device)
        with autocast(device, precision):
            _, loss = model(x, y)
        losses.append(loss.item())
        counts.append(int((y >= 0).sum()))
    model.train()
    return float(np.average(losses, weights=counts))


def main():
    parser = training_parser("Fine-tune the pretrained model on instructions.", minutes=MINUTES, steps=STEPS)
    parser.add_argument("--keep", action="store_true",
                        help="also keep the model of each evaluation as step-N.pt, for a curve of words used against steps")
    parser.add_argument("--lr", type=float, default=LR, help=f"the peak learning rate (default {LR:g})")
    parser.add_argument("--asks", type=int, default=1, help="sets of words each story is asked for on each pass (default 1)")
    parser.add_argument("--plain-share", type=float, default=PLAIN_SHARE,
                        help=f"the share of each batch given to plain pretraining stories (default {PLAIN_SHARE:g})")
    parser.add_argument("--swap", type=float, default=SWAP,
                        help=f"the share of asked nouns swapped for other nouns throughout the story (default {SWAP:g})")
    parser.add_argument("--words", type=int, default=WORDS,
                        help=f"words each training story is asked for, all it has if fewer (default {WORDS}; the "
                             f"evaluation asks for three)")
    parser.add_argument("--first-use-weight", type=float, default=1.0,
                        help="a diagnostic, not a recipe: the loss on the first use of each asked word counts this "
                             "many times (default 1, no weight)")
    parser.add_argument("--seed", type=int, default=SEED,
                        help=f"the training seed: the order of the stories, the words asked, the replay, the dropout "
                             f"(default {SEED}; the held-back instructions are the same for every seed)")
    add_micro_batch(parser)
    args = parse_training_args(parser)
    if not 0 <= args.plain_share <= 1:  # nan and inf too, before round() meets them
        parser.error("--plain-share must be between 0 and 1")
    # Plain stories in each batch, the rest instructions.
    plain_rows = round(args.plain_share * BATCH)
    if not (0 < args.lr < 1 and args.asks >= 1 and (args.plain_share == 0 or 0 < plain_rows < BATCH)
            and 0 <= args.swap <= 1 and args.words >= 3 and 0 < args.first_use_weight < math.inf):
        parser.error(f"--lr must be between 0 and 1, --asks at least 1, --swap between 0 and 1, --words at least 3, "
                     f"--first-use-weight a finite number above 0, and --plain-share 0 "
                     f"or a share that leaves at least one plain story and one instruction in a batch of {BATCH}")
    name = run_name(args)
    folder = CHECKPOINTS / name
    # One process, or under torchrun this process's device, each taking its rows of a batch (distributed.py).
    device = distributed.setup(args.device, BATCH, "examples of a batch")
    check_writable(folder, RUNS / name)  # now, not when the model is saved
    precision = args.precision or default_precision(device)
    settings = run_settings(args, globals(), device=str(device), precision=precision, processes=distributed.world())
    print(json.dumps(settings))
    tokenizer = load_tokenizer()
    torch.manual_seed(distributed.seed(args.seed))  # under torchrun, each process its own dropout
    model = load_checkpoint(CHECKPOINTS / "pretrain", device, tokenizer)
    optimizer = make_optimizer(model, args.lr)
    # Under torchrun, DDP averages the processes' gradients at each step; in one process, the model itself.
    ddp_model = distributed.wrap(model)

    # The same HELD_BACK examples measure the instruction loss in every run; the rest are trained on.
    instructions = read_instructions(limit=TUNE_POOL)
    if len(instructions) < HELD_BACK + BATCH:
        raise SystemExit(f"{len(instructions)} instructions are too few: {HELD_BACK} are held back and a batch is {BATCH}")
    training, held = split_held_back(instructions)
    tune_stories = [example["story"] for example in training]
    held_back = [encode_example(tokenizer, example) for example in held]
    askable, nouns = read_words()
    asked_rows = BATCH - plain_rows
    cut = sum(tokens[-1] != tokenizer.eot for tokens, _ in held_back)
    print(f"{len(instructions):,} instructions: {len(tune_stories) * args.asks:,} training examples a pass, "
          f"{len(held_back)} held back, {cut} of which are longer than {MAX_LENGTH} tokens and cut there")
    train_tokens, valid_tokens = load_tokens("train"), load_tokens("valid")
    pad = tokenizer.eot  # any token: padding is never a target
    writer = run_writer(RUNS / name, resumed=False)
    writer.add_text("settings", json.dumps(settings, indent=1), 0)
    step = 0

    @distributed.on_rank_0  # under torchrun, rank 0 alone evaluates and saves, the others waiting for it
    def evaluate_and_save(save=True):
        stop_if_diverged(model, folder)  # before a story drawn from nan probabilities, which torch refuses
        losses = {"instructions": instruction_loss(model, held_back, pad, device, precision),
                  "plain": valid_loss(model, valid_tokens, device, precision)}
        story = demo_story(model, tokenizer, EXAMPLE, seed=step, max_new_tokens=DEMO_TOKENS)
        for name, value in losses.items():
            writer.add_scalar(f"loss/{name}", value, step)
        writer.add_text("story", EXAMPLE + story, step)
        writer.flush()
        if save:
            made_by = {"script": "finetune.py", "step": step, "losses": losses, "settings": settings}
            save_checkpoint(folder, model, tokenizer, made_by)
            if args.keep:
                save_checkpoint(folder / f"step-{step}.pt", model, tokenizer, made_by)
        print(f"step {step}: loss on held-back instructions {losses['instructions']:.3f}, "
              f"on plain stories {losses['plain']:.3f}\n  {EXAMPLE}  {story[:300]}")

    evaluate_and_save(save=False)  # the pretrained model's figures, to compare against
    model.train()
    # The run's own seed draws the rest: the passes' orders, the words asked, the replay's windows.
    rng = np.random.default_rng(args.seed)
    # Each example is made as it is drawn, so that nothing waits on the size of the data.
    epoch, position, asks = 0, 0, a_pass(rng, len(tune_stories), args.asks, 0, args.seed)
    started = time.time()
    saved_at = None  # the step whose model the loop last measured and saved
    while True:
        progress = budget_used(distributed.seconds_since(started), args.minutes, step, args.steps)
        if progress >= 1.0:
            break
        # Go through the stories in a new order each epoch, each asked for other words it uses (24, or
        # --words): the words must be read from the instruction, as no story comes with the same ones twice.
        if position + asked_rows > len(asks):
            epoch, position, asks = epoch + 1, 0, a_pass(rng, len(tune_stories), args.asks, epoch + 1, args.seed)
        examples = [ask_anew(tune_stories[story], askable, seed, nouns, args.swap, args.words)
                    for story, seed in asks[position:position + asked_rows]]
        position += asked_rows
        batch = [encode_example(tokenizer, example) for example in examples]
        # Windows of the stories the model pretrained on fill the rest of the batch (none with --plain-share 0).
        batch += plain_windows(train_tokens, rng, plain_rows)
        x, y = collate(batch, pad, device)
        # The loss on the stories' tokens only, and the update it asks for.
        lr = learning_rate(step, progress, args.lr, MIN_LR, WARMUP)
        if args.first_use_weight == 1:
            loss = train_step(ddp_model, optimizer, x, y, device, precision, lr, args.micro_batch)
        else:
            weights = first_use_weights(tokenizer, examples, batch, y, args.first_use_weight)
            loss = weighted_step(ddp_model, optimizer, x, y, weights, device, precision, lr, args.micro_batch)
        step += 1
        if step % 10 == 0:
            writer.add_scalar("loss/train", loss, step)
            writer.add_scalar("lr", lr, step)
            print(f"step {step}: loss {loss:.3f}, lr {lr:.2e}, {(time.time() - started) / 60:.1f} min", flush=True)
        if step % EVAL_EVERY == 0:
            evaluate_and_save()
            saved_at = step
    if saved_at != step:  # the last step's model, unless the loop has just measured and saved it
        evaluate_and_save()
    writer.close()
    distributed.end()
    print(f"done: {step} steps, {(time.time() - started) / 60:.1f} minutes; the model is in {folder}/model.pt")


if __name__ == "__main__":
    main()
