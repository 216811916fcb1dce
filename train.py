"""
Episode 2, pretraining: the GPT learns to write stories by predicting each next token.

Windows of CONTEXT tokens are drawn at random from data/train.bin (every story, each after
an end-of-text token), and the model learns to predict each token from those before it.
AdamW, a short warmup and then a cosine decay of the learning rate, gradients clipped at 1,
bfloat16 matrix products where the device does them faster (devices.default_precision), the
validation loss on fixed windows of data/valid.bin every so often, TensorBoard scalars and
a sample story, and a checkpoint in checkpoints/pretrain/ at each validation.

Departures from the usual recipe: the run is budgeted in minutes (--minutes) rather than
steps, so the cosine decay follows the share of the minutes used; that way a learner on any
machine gets a fully decayed model at the end of the time they chose (if it holds more steps
than the warmup's). With --steps, the decay follows the steps instead, so that any machine
makes the same model, a faster one sooner, and the minutes are only a cap. With --resume it
goes on from its last checkpoint, on the schedule it started with (its --minutes and
--steps, and the minutes already trained), drawing the windows, and in one process on a CPU
the dropout masks, that it would have drawn had it not stopped: with --steps, in one process
on a CPU, a run stopped and resumed makes the model it would have made.

Under torchrun (several GPUs, or several processes on the CPU; distributed.py, which a learner
may skip) each process takes its own rows of each batch and DDP averages their gradients, so
a step is the same step, on the same 16 windows, whatever the number of processes (dropout
aside, each process drawing its own masks); rank 0
alone logs, validates and saves. --micro-batch N puts a process's rows through the model N
at a time, their gradients adding up (gradient accumulation): the same steps in less memory,
for a larger model than the series'.

    python train.py --minutes 60
    torchrun --standalone --nproc_per_node 2 train.py --minutes 60
"""
import argparse
import json
import math
import time

import numpy as np
import torch

import distributed
from checkpoints import (CHECKPOINTS, RUNS, model_from, must_load, read_checkpoint, run_settings, run_writer,
                         save_checkpoint, stop_if_diverged)
from data import SEED, check_seed
from devices import autocast, default_precision, resumed_precision
from files import DATA, check_made, check_writable, require
from model import GPT, Config
from tokenizer import encode_prompt, load_tokenizer

BATCH = 16  # windows per step
CONTEXT = Config.context  # tokens per window, the model's whole context: a story, often with the next one's start
LR = 1e-3  # the peak learning rate, after warmup
MIN_LR = 1e-4  # where the cosine ends
WARMUP = 100  # steps
WEIGHT_DECAY = 0.1  # on matrices only, not on biases and layer norms
BETAS = (0.9, 0.95)
CLIP = 1.0  # the most gradient norm a step takes
EVAL_EVERY = 250  # steps between validations
EVAL_WINDOWS = 256  # fixed windows of valid.bin for the loss during training


def training_parser(description, minutes, precision=None, steps=None):
    """The options of every script that trains for a budget of minutes, or of steps if those run
    out first (this one, finetune.py, dpo.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--minutes", type=float, default=minutes, help=f"training time (default {minutes:g})")
    parser.add_argument("--steps", type=int, default=steps,
                        help=f"stop after this many steps, if sooner (default {steps or 'none'})")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=precision,
                        help=f"default: {precision or 'bf16 where it is faster'}")
    return parser


def parse_training_args(parser):
    args = parser.parse_args()
    if not 0 < args.minutes < math.inf or (args.steps is not None and args.steps <= 0):
        parser.error("--minutes and --steps must be positive (and --minutes a number)")
    check_seed(parser, vars(args).get("seed", 0))  # finetune.py and dpo.py add --seed
    if vars(args).get("micro_batch") is not None and args.micro_batch < 1:  # train.py and finetune.py add it
        parser.error("--micro-batch must be 1 or more")
    return args


def add_micro_batch(parser):
    """--micro-batch, for pretraining and fine-tuning."""
    parser.add_argument("--micro-batch", type=int, metavar="ROWS",
                        help="rows of a batch a process puts through the model at once, the gradients of its "
                             "pieces adding up to the same step (gradient accumulation, for less memory; default: "
                             "all its rows)")


def budget_used(seconds, minutes, step, steps):
    """The share of the budget used, which the schedule follows: of the steps, when there are
    some, so that any machine makes the same model, a faster one sooner; else of the minutes.
    1 once the minutes are up, either way: with steps, the minutes are only a cap."""
    if seconds >= minutes * 60:
        return 1.0
    return step / steps if steps else seconds / (minutes * 60)


def load_tokens(split, folder=DATA):
    """data/train.bin or data/valid.bin as a memmap: read from disk as needed, never loaded whole."""
    path = folder / f"{split}.bin"
    require(path)
    size = path.stat().st_size
    if size % 2 or size // 2 <= CONTEXT:  # uint16 tokens, at least one window and its next token
        raise SystemExit(f"{path} is damaged or too short ({size:,} bytes); make it again with python data.py")
    check_made(path)  # not cut short since data.py made it
    return np.memmap(path, dtype=np.uint16, mode="r")


def random_batch(tokens, rng, device, batch=BATCH, context=CONTEXT):
    """batch windows of context tokens, each with its next tokens as targets, from anywhere in
    tokens: the last window's target is the file's last token."""
    starts = rng.integers(0, len(tokens) - context, size=batch)  # the high end excluded
    windows = torch.from_numpy(np.stack([tokens[s:s + context + 1] for s in starts]).astype(np.int64))
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


def resumable(made_by):
    """Whether a pretraining checkpoint's made_by says where its run stood: its step, its
    seconds, and the schedule it started with."""
    settings, numbers = made_by.get("settings"), (int, float)
    return (isinstance(made_by.get("step"), int) and isinstance(made_by.get("seconds"), numbers)
            and isinstance(settings, dict) and isinstance(settings.get("minutes"), numbers)
            and "steps" in settings and isinstance(settings["steps"], (int, type(None))))


def resume(folder, args, device, tokenizer, rng):
    """The run in folder, to go on from: its model, its optimizer, the step and seconds where
    it stopped, and its precision. args takes the schedule the run started with (its --minutes
    and --steps), rng the windows it would have drawn next, and in one process torch's random
    state the dropout masks it would have drawn (resume_draws)."""
    checkpoint = read_checkpoint(folder)
    made_by, advice = checkpoint["made_by"], "start without --resume"
    # Pretraining's own checkpoint, with its optimizer's state (a final or copied model has none).
    if made_by.get("script") != "train.py" or "optimizer" not in checkpoint:
        raise SystemExit(f"{folder} holds no pretraining run's optimizer state to resume from; {advice}")
    if not resumable(made_by):
        raise SystemExit(f"{folder} does not say its step, seconds and schedule; {advice}")
    model = model_from(checkpoint, folder, device, tokenizer)
    optimizer = make_optimizer(model)
    must_load(folder, "an optimizer state", lambda: optimizer.load_state_dict(checkpoint["optimizer"]), advice)
    step, elapsed = made_by["step"], made_by["seconds"]
    # The schedule is the one the run started with, whatever the command line says now.
    schedule = made_by["settings"]["minutes"], made_by["settings"]["steps"]
    if (args.minutes, args.steps) != schedule:
        limit = f"at most {schedule[1]} steps" if schedule[1] else "no limit on steps"
        print(f"a resumed run keeps its schedule, {schedule[0]:g} minutes and {limit}: "
              "the --minutes and --steps of this command are not used")
    args.minutes, args.steps = schedule
    # And its precision, on a device of the kind it started on: picked again, the CPU's
    # timing could choose the other one and train another model.
    precision = args.precision or resumed_precision(made_by["settings"], device)
    print(f"resuming at step {step}, {elapsed / 60:.1f} of {args.minutes:g} minutes")
    must_load(folder, "a random state", lambda: resume_draws(checkpoint, rng, step), advice)
    return model, optimizer, step, elapsed, precision


def resume_draws(checkpoint, rng, step):
    """A resumed run draws the windows the run would have drawn had it not stopped, and in one
    process the same dropout masks too: the random states its checkpoint kept. (Under
    torchrun each process keeps its own dropout seed; a GPU's masks come from the GPU's
    generator, which the checkpoint does not keep.) A checkpoint without them draws new
    windows, from the step."""
    if not {"numpy_random", "torch_random"} <= checkpoint.keys():
        rng.bit_generator.state = np.random.default_rng(SEED + step).bit_generator.state
        return
    rng.bit_generator.state = checkpoint["numpy_random"]
    if distributed.world() == 1:
        torch.set_rng_state(checkpoint["torch_random"])


def demo_story(model, tokenizer, prompt, seed, max_new_tokens=120):
    """What the model writes after prompt, as text, for the logs: temperature 1, dropout off,
    with the model's own generate (episode 4's sample.write does the same for every later
    episode, with top-k and many stories at once)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([encode_prompt(tokenizer, prompt)], device=device)
    was_training = model.training
    model.eval()
    out = model.generate(tokens, max_new_tokens, stop=tokenizer.eot,
                         generator=torch.Generator(device=device).manual_seed(seed))
    model.train(was_training)
    return tokenizer.decode(out[0, tokens.size(1):].tolist())


@torch.no_grad()
def valid_loss(model, tokens, device, precision="fp32", windows=EVAL_WINDOWS, context=CONTEXT, batch=BATCH):
    """The mean next-token loss on `windows` windows spread evenly over tokens (None: all of
    them, end to end). The same windows every time, so the figures compare."""
    if windows is None:
        windows = (len(tokens) - 1) // context
    starts = np.linspace(0, len(tokens) - context - 1, windows).astype(np.int64)
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(starts), batch):
        rows = np.stack([tokens[s:s + context + 1] for s in starts[i:i + batch]]).astype(np.int64)
        rows = torch.from_numpy(rows).to(device)
        with autocast(device, precision):
            _, loss = model(rows[:, :-1], rows[:, 1:])
        total += loss.item() * len(rows)
    model.train(was_training)
    return total / len(starts)


def learning_rate(step, progress, peak=LR, floor=MIN_LR, warmup=WARMUP):
    """Linear warmup over `warmup` steps, then a cosine from peak to floor as progress goes 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model, lr=LR):
    # Decay only the matrices: shrinking biases and layer norms toward 0 helps nothing.
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS)


def optimizer_step(model, optimizer, loss, lr):
    """The gradients of loss, their norm clipped at CLIP, and one update at learning rate lr."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    update(model, optimizer, lr)


def update(model, optimizer, lr):
    """One update at learning rate lr, with the gradients there are, their norm clipped at CLIP."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()


def train_step(model, optimizer, x, y, device, precision, lr, micro_batch=None):
    """One step: the loss of predicting every target, and the update it asks for."""
    def mean_loss(rows):
        with autocast(device, precision):
            _, loss = model(x[rows], y[rows])
        return loss
    return accumulated_step(model, optimizer, mean_loss, y >= 0, lr, micro_batch)


def accumulated_step(model, optimizer, mean_loss, counted, lr, micro_batch=None):
    """One update from a batch's mean loss over its counted targets (a mask, or weights),
    mean_loss(rows) being the mean over some of its rows. The rows go through the model in
    pieces: under torchrun each process takes its own rows of the batch, and with micro_batch
    it takes them that many at a time (distributed.pieces). Each piece's mean counts by its
    share of the batch's targets, and its gradients add up to the others', so the update, and
    the loss it returns, are the whole batch's, whatever the processes and pieces."""
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    for rows, share, syncing in distributed.pieces(model, counted, micro_batch):
        with syncing:  # under DDP, the processes' gradients are averaged once, at the last piece
            piece = mean_loss(rows) * share
            piece.backward()
        loss += piece.item()
    update(model, optimizer, lr)
    return distributed.mean(loss)


def main():
    parser = training_parser("Pretrain the GPT on the train stories.", minutes=60)
    parser.add_argument("--resume", action="store_true", help="go on from checkpoints/pretrain/model.pt")
    add_micro_batch(parser)
    args = parse_training_args(parser)
    # One process, or under torchrun this process's device, each taking its rows of a batch (distributed.py).
    device = distributed.setup(args.device, BATCH, "windows of a batch")
    folder = CHECKPOINTS / "pretrain"
    check_writable(folder, RUNS / "pretrain")  # now, not when the first checkpoint is saved
    tokenizer = load_tokenizer()
    train_tokens, valid_tokens = load_tokens("train"), load_tokens("valid")

    # A new model, or the last checkpoint with its optimizer, step and time so far. (Under
    # torchrun, each process its own seed for its dropout; DDP gives them all rank 0's weights.)
    torch.manual_seed(distributed.seed(SEED))
    rng = np.random.default_rng(SEED)  # the windows' draws
    if args.resume:
        model, optimizer, step, elapsed, precision = resume(folder, args, device, tokenizer, rng)
    else:
        step, elapsed = 0, 0.0
        precision = args.precision or default_precision(device)
        model = GPT(Config(vocab_size=tokenizer.vocab_size)).to(device)
        optimizer = make_optimizer(model)
        print(f"model: {model.parameter_count() / 1e6:.2f}M parameters")
    settings = run_settings(args, globals(), device=str(device), precision=precision,
                            processes=distributed.world())
    print(json.dumps(settings))
    # Under torchrun, DDP averages the processes' gradients at each step; in one process, the model itself.
    ddp_model = distributed.wrap(model)
    writer = run_writer(RUNS / "pretrain", args.resume)
    writer.add_text("settings", json.dumps(settings, indent=1), step)

    @distributed.on_rank_0  # under torchrun, rank 0 alone validates and saves, the others waiting for it
    def validate_and_save():
        seconds = time.time() - started  # the steps so far, the last one included, by rank 0's clock
        stop_if_diverged(model, folder)  # before a story drawn from nan probabilities, which torch refuses
        loss = valid_loss(model, valid_tokens, device, precision)
        story = demo_story(model, tokenizer, "Once upon a time", seed=step)
        writer.add_scalar("loss/valid", loss, step)
        writer.add_text("sample", story, step)
        writer.flush()
        made_by = {"script": "train.py", "step": step, "seconds": seconds, "valid_loss": loss, "settings": settings}
        save_checkpoint(folder, model, tokenizer, made_by, optimizer,
                        numpy_random=rng.bit_generator.state, torch_random=torch.get_rng_state())
        print(f"step {step}: valid loss {loss:.3f}\n  Once upon a time{story[:300]}")

    model.train()
    started = time.time() - elapsed
    interval_start, interval_tokens = time.time(), 0
    saved_at = None  # the step whose model the loop last measured and saved
    while True:
        elapsed = distributed.seconds_since(started)
        progress = budget_used(elapsed, args.minutes, step, args.steps)
        if progress >= 1.0:
            break
        # Predict every next token of a batch of windows, and move the weights.
        lr = learning_rate(step, progress)
        x, y = random_batch(train_tokens, rng, device)
        loss = train_step(ddp_model, optimizer, x, y, device, precision, lr, args.micro_batch)
        step += 1
        interval_tokens += x.numel()

        if step % 10 == 0:
            tokens_per_second = interval_tokens / (time.time() - interval_start)
            writer.add_scalar("loss/train", loss, step)
            writer.add_scalar("lr", lr, step)
            writer.add_scalar("tokens_per_second", tokens_per_second, step)
            print(f"step {step}: loss {loss:.3f}, lr {lr:.2e}, {tokens_per_second:.0f} tokens/s, "
                  f"{elapsed / 60:.1f} min", flush=True)
            interval_start, interval_tokens = time.time(), 0
        if step % EVAL_EVERY == 0:
            validate_and_save()
            saved_at = step
            interval_start, interval_tokens = time.time(), 0

    elapsed = time.time() - started
    if saved_at != step:  # the last step's model, unless the loop has just measured and saved it
        validate_and_save()
    writer.close()
    distributed.end()
    print(f"done: {step} steps, {elapsed / 60:.1f} minutes; the model is in {folder}/model.pt")


if __name__ == "__main__":
    main()
