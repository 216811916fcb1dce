"""
Probe: where do the odd fragments in the stories come from ("aInside", "padgs")? Writes
stories for the demo instruction with write_stories() (the KV cache, temperature 1 as in
the RL episodes), then runs each whole story through the model again and asks how likely
each written token was. The share of tokens the model gave less than 1 in 10,000 (the
tail) is compared with the share that sampling from those recomputed distributions should
give: equal shares mean the cache and the sampler draw from the model's own distribution,
and the fragments are the model's tail, not a bug. --top-k shows what cutting the tail does.

    python bench/sampling_tail.py checkpoints/finetune
    python bench/sampling_tail.py checkpoints/finetune --top-k 50
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import load_checkpoint  # noqa: E402
from dpo import DEMO  # noqa: E402
from sample import MAX_NEW_TOKENS, sampling_logits, write_stories  # noqa: E402
from tokenizer import encode_prompt, load_tokenizer  # noqa: E402

TAIL = 1e-4  # a token the model gives less than this is in its tail


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a checkpoint folder or file")
    parser.add_argument("--stories", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=None)
    args = parser.parse_args()
    if args.stories < 1 or (args.top_k is not None and args.top_k < 1):
        parser.error("--stories and --top-k must be at least 1")
    tokenizer = load_tokenizer()
    model = load_checkpoint(args.model, "cpu", tokenizer).eval()
    prompt = encode_prompt(tokenizer, DEMO)
    stories = write_stories(model, tokenizer, [DEMO] * args.stories, MAX_NEW_TOKENS, top_k=args.top_k, seed=0)

    written, in_tail, expected, examples = 0, 0, 0.0, []
    with torch.no_grad():
        for story in stories:
            # The whole prompt and story at once: no cache, each position sees its full prefix.
            tokens = torch.tensor([prompt + story])
            logits, _ = model(tokens[:, :-1])
            logits = logits[0, len(prompt) - 1:].float()
            model_probabilities = F.softmax(logits, dim=-1)
            targets = tokens[0, len(prompt):]
            chosen = model_probabilities.gather(-1, targets[:, None])[:, 0]
            # What sampling should put in the tail: the sampler's mass on the model's tail tokens.
            tail = model_probabilities < TAIL
            sampler = F.softmax(sampling_logits(logits, 1.0, args.top_k), dim=-1)
            expected += (sampler * tail).sum().item()
            written += len(story)
            in_tail += int((chosen < TAIL).sum())
            examples += [(tokenizer.decode(story[max(0, i - 3):i]), tokenizer.decode(story[i:i + 1]))
                         for i in (chosen < TAIL).nonzero()[:, 0].tolist()[:1]]

    print(f"{args.stories} stories for {DEMO.strip()!r}, top-k {args.top_k}: {written:,} tokens")
    print(f"written tokens the model gives less than {TAIL:g}: {in_tail / written:.2%} "
          f"(sampling from the recomputed distributions should give {expected / written:.2%})")
    for before, token in examples[:8]:
        print(f"  {before!r} then {token!r}")


if __name__ == "__main__":
    main()
