"""
Probe: does a model read its instruction? For held-back training instructions (the ones
finetune.py keeps out of training), the mean log-probability the model gives the first use
of each requested word in the story, after its own instruction, after another example's
instruction, and after no instruction at all. A model that follows instructions gives the
first with its own instruction a much higher log-probability than without: the difference,
in nats, is what the docs call "the instruction moves a word by".

Several models are measured one after the other; each one's figures are saved under
runs/probe/, named after its checkpoint's path as evaluate.py names its results.

    python bench/instruction_probe.py checkpoints/finetune
    python bench/instruction_probe.py checkpoints/finetune/step-*.pt
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import RUNS, load_checkpoint  # noqa: E402
from evaluate import model_name, saved_name  # noqa: E402
from files import atomic, read_instructions  # noqa: E402
from finetune import TUNE_POOL, first_uses, split_held_back  # noqa: E402
from tokenizer import encode_prompt, load_tokenizer  # noqa: E402


def first_use_logprobs(model, tokenizer, prompt, example):
    """Log-probabilities of the first use of each requested word (as a word with its space)."""
    story = tokenizer.encode(example["story"])[:200]
    tokens = torch.tensor([prompt + story])
    logits, _ = model(tokens[:, :-1])
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    places = first_uses(tokenizer, example["words"], story)
    return [logprobs[len(prompt) + place - 1, token].item() for place, token in places]


def probe(model, tokenizer, held_back):
    """{prompt: mean log-probability of the first uses, and how many words} for the three prompts."""
    prompts = {
        "its own instruction": lambda i, e: encode_prompt(tokenizer, e["instruction"]),
        "another example's instruction": lambda i, e: encode_prompt(
            tokenizer, held_back[(i + 1) % len(held_back)]["instruction"]),
        "no instruction, just end-of-text": lambda i, e: [tokenizer.eot],
    }
    results = {}
    with torch.no_grad():
        for label, prompt in prompts.items():
            values = [v for i, e in enumerate(held_back) for v in first_use_logprobs(model, tokenizer, prompt(i, e), e)]
            results[label] = {"mean_logprob": float(np.mean(values)), "words": len(values)}
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+", help="checkpoint folders or files")
    parser.add_argument("--examples", type=int, default=100)
    args = parser.parse_args()
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    tokenizer = load_tokenizer()
    examples = read_instructions(limit=TUNE_POOL)
    # The examples finetune.py held back, in its order.
    _, held_back = split_held_back(examples)
    held_back = held_back[:args.examples]
    for path in args.models:
        model = load_checkpoint(path, "cpu", tokenizer, quiet=True).eval()
        results = probe(model, tokenizer, held_back)
        moves = results["its own instruction"]["mean_logprob"] - results["no instruction, just end-of-text"]["mean_logprob"]
        with atomic(RUNS / "probe" / f"{saved_name(path)}.json") as tmp:
            tmp.write_text(json.dumps({"model": model_name(path), "checkpoint": str(path), "examples": args.examples,
                                       "prompts": results, "instruction_moves": moves}, indent=1) + "\n")
        print(f"\n{model_name(path)}: the instruction moves a word by {moves:.2f} nats")
        print("| the prompt before the story | mean log-probability of the first use of a requested word |")
        print("| --- | --- |")
        for label, result in results.items():
            print(f"| {label} | {result['mean_logprob']:.2f} ({result['words']} words) |")


if __name__ == "__main__":
    main()
