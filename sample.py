"""
Episode 4, sampling: from a prompt to a story, one token at a time.

write() is what every later episode uses to hear from a model: a prompt in, a story out,
with a temperature (1 samples from the model's own distribution; lower is safer and duller;
0 always takes the likeliest token), top-k (sample only among the k likeliest tokens), a
seed, and at most MAX_NEW_TOKENS. A story stops at its first end-of-text, which it keeps:
ending a story is something the model has to learn too.

write_stories() writes many stories in one pass: up to 128 prompts, of any lengths, go into
one batch, with the model's KV cache (model.py), and a batch finishes early once every story
has ended. The RL episodes write their 128 stories at once this way.

A prompt starts with an end-of-text token, as every story did in pretraining, so the model
knows a new story begins. Writing runs in float32 unless the caller asks for bfloat16 with
model.autocast, as the RL episodes do where it is faster (their update runs in it too).

    python sample.py --words rain cake jump                  (the fine-tuned model)
    python sample.py --model checkpoints/pretrain --prompt "Once upon a time"
"""
import argparse
import math
import re
from itertools import groupby

import torch

from data import instruction
from model import CHECKPOINTS, load_checkpoint, pick_device
from tokenizer import encode_prompt, load_tokenizer

MAX_NEW_TOKENS = 200  # the most tokens a story gets
# The lowest temperature but 0: below it, logits divided by it run to infinity (1e-40 makes
# them all infinite) and the draw lands past the last token. 0 takes the likeliest token.
MIN_TEMPERATURE = 1e-3


def cut_at_end(tokens, eot):
    """A story's tokens up to and including its first end-of-text."""
    return tokens[: tokens.index(eot) + 1] if eot in tokens else tokens


def write_stories(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_k=None, seed=0,
                  batch=128):
    """One story per prompt (texts), as lists of tokens cut after their first end-of-text.
    The stories are written `batch` at a time, in one pass whatever their prompts' lengths,
    and a prompt repeated one after another runs once for all its copies. With a seed, the
    same prompts give the same stories."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    stories = []
    was_training = model.training
    model.eval()  # no dropout while writing
    for start in range(0, len(encoded), batch):
        # Copies of one prompt, one after another, make a group: a (copies, length) tensor.
        groups = [torch.tensor(list(copies), device=device) for _, copies in groupby(encoded[start:start + batch])]
        outs = model.generate(groups, max_new_tokens, temperature, top_k, stop=tokenizer.eot, generator=generator)
        for group, out in zip(groups, outs):
            stories += [cut_at_end(row, tokenizer.eot) for row in out[:, group.size(1):].tolist()]
    model.train(was_training)
    return stories


def write(model, tokenizer, prompt, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_k=None, seed=0):
    """The story a model writes after a prompt, as text; it ends with <|endoftext|> if the model ended it."""
    (story,) = write_stories(model, tokenizer, [prompt], max_new_tokens, temperature, top_k, seed)
    return tokenizer.decode(story)


def main():
    parser = argparse.ArgumentParser(description="Write a story with a trained model.")
    parser.add_argument("--model", default=str(CHECKPOINTS / "finetune"), help="a checkpoint folder or file")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--words", nargs=3, metavar="WORD", help="three words to ask for")
    group.add_argument("--prompt", default="Once upon a time", help="any text to continue (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=MAX_NEW_TOKENS, help="the most new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    args = parser.parse_args()
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        parser.error(f"--temperature must be 0 (the likeliest token) or at least {MIN_TEMPERATURE:g}")
    if (args.top_k is not None and args.top_k < 1) or args.tokens < 1:
        parser.error("--top-k and --tokens must be at least 1")
    if args.words and not all(re.fullmatch("[a-z]+", word) for word in args.words):
        parser.error("--words: three lowercase words, letters only (as the reward reads them)")

    tokenizer = load_tokenizer()
    model = load_checkpoint(args.model, pick_device(args.device), tokenizer)
    prompt = instruction(args.words) if args.words else args.prompt  # "" too: a story from nothing
    room = model.config.context - len(encode_prompt(tokenizer, prompt))
    if room < 1:
        parser.error(f"the prompt is longer than the model's context of {model.config.context} tokens")
    print(prompt + write(model, tokenizer, prompt, min(args.tokens, room), args.temperature, args.top_k, args.seed))


if __name__ == "__main__":
    main()
