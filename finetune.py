"""
Episode 3, instructions: the pretrained model learns to write a story for an instruction.

Each example is a prompt (an end-of-text, then "Write a story that uses the words kite,
river and brave." and a newline), then the story, then end-of-text: the instructions of
data/instructions.jsonl, one per story that data.py kept out of pretraining (a story the
model has read many times is predicted from its own first tokens, and the instruction would
add nothing to the loss). Each pass over the stories asks each of them for three other words
it uses, drawn anew (the first pass asks for the file's words), so the words can only be
read from the instruction, never recalled with the story. The loss counts only the story's tokens and
its end-of-text, so the model learns to answer instructions, not to write them, and to end
a story on its own. Pretraining's optimizer, schedule over --minutes, training step and
peak learning rate (train.py); a quarter of each batch is plain pretraining stories, a
replay that keeps the model writing stories as it did while it learns the instructions
(step 4 found the larger rate alone loses that, and the replay pays it back).

Two losses are logged: on instructions held back from training (is it learning the task?)
and on plain valid stories (does it still write stories? it should stay close to the
pretrained model's). The final model goes to checkpoints/finetune/; with --keep, the model
of each evaluation stays beside it as step-N.pt, to measure the words used against steps.

The levers of episode 3's step 4, each run in a folder named after what it changes
(checkpoints/finetune-lr-0.0003-plain-0, finetune-asks-3, finetune-plain-0): --lr, the
peak learning rate; --asks N, each story asked for N sets of words on each pass;
--plain-share, the share of each batch given to plain stories. Step 5 made the best of
them, --lr 1e-3 --plain-share 0.25, the default.

Choices of ours: examples longer than the model's context, 256 tokens (about one in six),
are cut there, so they end without their end-of-text; a batch is padded to its longest
example, the padding masked out of the loss.

    python finetune.py --minutes 20
    python finetune.py --minutes 50 --keep
    python finetune.py --minutes 20 --lr 3e-4 --plain-share 0   # step 2's recipe
"""
import json
import time

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

from data import DATA, SEED, ask, askable_words, check_writable, instruction, load_tokenizer, read_instructions, stories
from model import CHECKPOINTS, RUNS, autocast, default_precision, load_checkpoint, pick_device, save_checkpoint
from sample import encode_prompt, write
from train import (CONTEXT, budget_used, learning_rate, load_tokens, make_optimizer, parse_training_args,
                   train_step, training_parser, valid_loss)

BATCH = 16  # examples per step
MAX_LENGTH = CONTEXT  # tokens of an example, prompt included: the positions pretraining trained
LR = 1e-3  # the peak, pretraining's: with the replay below, step 4's best (3e-4 before)
PLAIN_SHARE = 0.25  # of each batch: plain stories, the replay that keeps the loss on plain stories
MIN_LR = 3e-5
WARMUP = 50  # steps
EVAL_EVERY = 100  # steps
HELD_BACK = 256  # train instructions kept out of training, for the instruction loss
EXAMPLE = instruction(["kite", "river", "brave"])  # the story logged at each evaluation


def encode_example(tokenizer, example):
    """An instruction as (tokens, prompt length): the prompt, the story, end-of-text."""
    prompt = encode_prompt(tokenizer, example["instruction"])
    tokens = prompt + tokenizer.encode(example["story"]) + [tokenizer.eot]
    return tokens[:MAX_LENGTH], len(prompt)


def ask_anew(tokenizer, tune_stories, askable, epoch, asks=1):
    """Each story asked asks times for three words it uses, drawn anew for each pass over the
    stories (the first ask of the first pass is for the words of data/instructions.jsonl)."""
    return [encode_example(tokenizer, ask(story, askable, seed=SEED + epoch * asks + k))
            for story in tune_stories for k in range(asks)]


def encode_plain(tokenizer, story):
    """A plain story as an example: an end-of-text for its prompt, as in pretraining."""
    return encode_example(tokenizer, {"instruction": "", "story": story})


def run_name(args):
    """The run's folder: finetune, or finetune-lr-0.0003 (-asks-3, -plain-0) with a lever off its default."""
    return ("finetune" + (f"-lr-{args.lr:g}" if args.lr != LR else "") + (f"-asks-{args.asks}" if args.asks > 1 else "")
            + (f"-plain-{args.plain_share:g}" if args.plain_share != PLAIN_SHARE else ""))


def collate(examples, pad, device):
    """A padded batch; targets are -1 (skipped by the loss) over prompts and padding."""
    length = max(len(tokens) for tokens, _ in examples) - 1
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
    parser = training_parser("Fine-tune the pretrained model on instructions.", minutes=20)
    parser.add_argument("--keep", action="store_true",
                        help="also keep the model of each evaluation as step-N.pt, for a curve of words used against steps")
    parser.add_argument("--lr", type=float, default=LR, help=f"the peak learning rate (default {LR:g})")
    parser.add_argument("--asks", type=int, default=1, help="sets of words each story is asked for on each pass (default 1)")
    parser.add_argument("--plain-share", type=float, default=PLAIN_SHARE,
                        help=f"the share of each batch given to plain pretraining stories (default {PLAIN_SHARE:g})")
    args = parse_training_args(parser)
    plain_rows = round(args.plain_share * BATCH)  # plain stories in each batch, the rest instructions
    if not (0 < args.lr < 1 and args.asks >= 1 and (args.plain_share == 0 or 0 < plain_rows < BATCH)):
        parser.error(f"--lr must be between 0 and 1, --asks at least 1, and --plain-share 0 or a share that leaves "
                     f"at least one plain story and one instruction in a batch of {BATCH}")
    name = run_name(args)
    folder = CHECKPOINTS / name
    check_writable(folder, RUNS / name)  # now, not when the model is saved

    device = pick_device(args.device)
    precision = args.precision or default_precision(device)
    settings = {**vars(args), "device": str(device), "precision": precision, "batch": BATCH,
                "max_length": MAX_LENGTH, "min_lr": MIN_LR, "warmup": WARMUP, "seed": SEED}
    print(json.dumps(settings))
    tokenizer = load_tokenizer()
    torch.manual_seed(SEED)
    model = load_checkpoint(CHECKPOINTS / "pretrain", device, tokenizer)
    optimizer = make_optimizer(model, args.lr)

    # Shuffle once with the seed; the last HELD_BACK examples measure the instruction loss.
    rng = np.random.default_rng(SEED)
    instructions = read_instructions()
    if len(instructions) < HELD_BACK + BATCH:
        raise SystemExit(f"{len(instructions)} instructions are too few: {HELD_BACK} are held back and a batch is {BATCH}")
    order = rng.permutation(len(instructions))
    tune_stories = [instructions[i]["story"] for i in order[:-HELD_BACK]]
    held_back = [encode_example(tokenizer, instructions[i]) for i in order[-HELD_BACK:]]
    askable = askable_words(DATA / "train.txt")
    epoch, train_examples = 0, ask_anew(tokenizer, tune_stories, askable, 0, args.asks)
    rng.shuffle(train_examples)  # with --asks, a story's asks in different batches from the first pass
    asked_rows = BATCH - plain_rows
    plain = [encode_plain(tokenizer, story) for story in stories(DATA / "train.txt")] if plain_rows else []
    cut = sum(tokens[-1] != tokenizer.eot for tokens, _ in train_examples + held_back)
    print(f"{len(instructions):,} instructions: {len(train_examples):,} training examples a pass, {len(held_back)} held back; "
          f"{cut:,} of these examples are longer than {MAX_LENGTH} tokens and cut there")
    valid_tokens = load_tokens("valid")
    pad = tokenizer.eot  # any token: padding is never a target
    writer = SummaryWriter(RUNS / name)
    writer.add_text("settings", json.dumps(settings, indent=1), 0)
    step = 0

    def evaluate_and_save(save=True):
        losses = {"instructions": instruction_loss(model, held_back, pad, device, precision),
                  "plain": valid_loss(model, valid_tokens, device, precision)}
        story = write(model, tokenizer, EXAMPLE, seed=step)
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
    started, position = time.time(), 0
    while True:
        progress = budget_used(time.time() - started, args.minutes, step, args.steps)
        if progress >= 1.0:
            break
        # Go through the stories in a new order each epoch, each asked for three other words it
        # uses: the words must be read from the instruction, as no story comes with the same ones twice.
        if position + asked_rows > len(train_examples):
            epoch += 1
            train_examples = ask_anew(tokenizer, tune_stories, askable, epoch, args.asks)
            rng.shuffle(train_examples)
            position = 0
        batch = train_examples[position:position + asked_rows]
        position += asked_rows
        # Plain stories the model pretrained on fill the rest of the batch (none with --plain-share 0).
        batch += [plain[i] for i in rng.choice(len(plain), plain_rows)] if plain_rows else []
        x, y = collate(batch, pad, device)
        # The loss on the stories' tokens only, and the update it asks for.
        lr = learning_rate(step, progress, args.lr, MIN_LR, WARMUP)
        loss = train_step(model, optimizer, x, y, device, precision, lr)
        step += 1
        if step % 10 == 0:
            writer.add_scalar("loss/train", loss, step)
            writer.add_scalar("lr", lr, step)
            print(f"step {step}: loss {loss:.3f}, lr {lr:.2e}, {(time.time() - started) / 60:.1f} min", flush=True)
        if step % EVAL_EVERY == 0:
            evaluate_and_save()
    evaluate_and_save()
    writer.close()
    print(f"done: {step} steps, {(time.time() - started) / 60:.1f} minutes; the model is in {folder}/model.pt")


if __name__ == "__main__":
    main()
