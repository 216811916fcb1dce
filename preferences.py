"""
Episode 6, preferences: pairs of the fine-tuned model's own stories, one better than the other.

For a training instruction, the fine-tuned model writes STORIES stories at temperature 1,
and the reward (evaluate.words_used: the share of the requested words a story uses) picks
the best as chosen and the worst as rejected. When all the stories score alike, nothing
tells them apart, and the instruction gives no pair. The pairs keep the stories' tokens, as
the model wrote them (decoding and encoding again could split the text differently), and
their text, for people. They go to data/preferences.json with the settings that made them.

load_asks() is here too: the training instructions (the first ASK_POOL of them), tokenized
and grouped by their length in tokens, so that instructions of one length stack into a
batch with no padding.

    python preferences.py --instructions 2000
"""
import argparse
import json
import time
from collections import Counter

import numpy as np

import distributed
from checkpoints import CHECKPOINTS, checkpoint_file, load_checkpoint
from data import SEED
from devices import pick_device
from evaluate import words_used
from files import DATA, atomic, check_writable, file_hash, read_instructions
from model import Config
from sample import MAX_NEW_TOKENS, write_stories
from tokenizer import encodable, encode_prompt, load_tokenizer

STORIES = 4  # stories per instruction, from which the best and the worst make a pair
# The training instructions the later episodes read, the first of the file: more than any run of
# ours draws (GRPO's ten minutes take 512), and a cost that stays the same with the full data's
# over half a million (the shared sample has 1,240).
ASK_POOL = 20_000
CHUNK = 32  # instructions written together, between progress lines
PAIRS = DATA / "preferences.json"


def load_asks(tokenizer, path=DATA / "instructions.jsonl"):
    """{length in tokens: [(prompt tokens, words), ...]} for the first ASK_POOL training instructions."""
    asks = {}
    for example in read_instructions(path, limit=ASK_POOL):
        tokens = encode_prompt(tokenizer, example["instruction"])
        asks.setdefault(len(tokens), []).append((tokens, example["words"]))
    return asks


def pick_pair(rewards):
    """The indices of the best and the worst story (the first of each, on ties), or None
    when every story scores alike."""
    best, worst = int(np.argmax(rewards)), int(np.argmin(rewards))
    return None if rewards[best] == rewards[worst] else (best, worst)


def make_pairs(model, tokenizer, examples, stories_per=STORIES, seed=SEED):
    """Writes stories_per stories for each example (a dict with instruction and words) and
    returns the pairs of the examples that give one."""
    prompts = [e["instruction"] for e in examples for _ in range(stories_per)]
    stories = write_stories(model, tokenizer, prompts, MAX_NEW_TOKENS, seed=seed)
    pairs = []
    for i, example in enumerate(examples):
        group = stories[i * stories_per:(i + 1) * stories_per]
        texts = [tokenizer.decode(s) for s in group]
        rewards = [words_used(t, example["words"]) for t in texts]
        pair = pick_pair(rewards)
        if pair:
            chosen, rejected = pair
            pairs.append({"instruction": example["instruction"], "words": example["words"],
                          "chosen": texts[chosen], "rejected": texts[rejected],
                          "chosen_tokens": group[chosen], "rejected_tokens": group[rejected],
                          "chosen_reward": rewards[chosen], "rejected_reward": rewards[rejected]})
    return pairs


def what_they_differ_by(pairs, eot):
    """What the pairs teach, printed: how many pairs use how many words on each side (the
    commonest first), then each side's mean length in tokens and share of stories that end."""
    print("| chosen story uses / rejected story uses | pairs |\n| --- | --- |")
    uses = Counter((round(p["chosen_reward"] * len(p["words"])), round(p["rejected_reward"] * len(p["words"])))
                   for p in pairs)
    for (chosen, rejected), count in uses.most_common():
        print(f"| {chosen} word{'s' if chosen > 1 else ''} / {rejected} | {count} |")
    for side in ("chosen", "rejected"):
        stories = [p[f"{side}_tokens"] for p in pairs]
        print(f"the {side} stories: {np.mean([len(s) for s in stories]):.0f} tokens on average, "
              f"{np.mean([s[-1] == eot for s in stories]):.0%} of them end")


def load_pairs(tokenizer, path=PAIRS, written_by=None):
    """The saved pairs and the settings that made them, refused unless each pair is an
    instruction and two stories' tokens of this tokenizer within the context, the chosen one
    the better; and, given a model's folder (DPO's fine-tuned model), unless that model wrote
    them."""
    if not path.exists():
        raise SystemExit(f"no {path}: make it with python preferences.py")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        pairs, settings = saved["pairs"], saved["settings"]
        if not isinstance(pairs, list) or not isinstance(settings, dict):
            raise TypeError("pairs must be a list and settings a mapping")
        better = [p["chosen_reward"] > p["rejected_reward"] for p in pairs]
    except (ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"{path} is not a file of preference pairs ({type(error).__name__}: {error}); "
                         "make it again with python preferences.py")
    if not pairs:
        raise SystemExit(f"{path} holds no pairs: every instruction's stories tied; "
                         "make it again with python preferences.py --instructions N, N larger")
    # Made before data.py made the tokenizer again, the pairs' token numbers mean other things.
    if not same_tokenizer(tokenizer, pairs, settings):
        raise SystemExit(f"{path} was made with another tokenizer than data/tokenizer.json; "
                         "make it again with python preferences.py")
    if not all(well_formed(pair, tokenizer) for pair in pairs):
        raise SystemExit(f"{path} has a pair that is not an instruction and two stories' tokens within the "
                         "context; make it again with python preferences.py")
    if not all(better):
        raise SystemExit(f"{path} has a pair whose chosen story is not the better one; make it again")
    # Written by another model (the fine-tuned model, made again since), they are not the stories
    # of the model DPO starts from, whose reference would not be the model that wrote them. (A
    # file from before the pairs recorded their model's hash is taken as it is.)
    if written_by and "model_hash" in settings:
        model = checkpoint_file(written_by)
        if settings["model_hash"] != file_hash(model):
            raise SystemExit(f"{path} holds the stories of another model than {model} (made again since?); "
                             "make the pairs again with python preferences.py")
    return pairs, settings


def same_tokenizer(tokenizer, pairs, settings):
    """Whether the pairs' tokens are this tokenizer's: by the fingerprint saved with them, or in a
    file from before they recorded it, by each chosen story's tokens giving its text."""
    if "tokenizer" in settings:
        return settings["tokenizer"] == tokenizer.fingerprint()
    return all(tokenizer.decode(pair["chosen_tokens"]) == pair.get("chosen")
               for pair in pairs if well_formed(pair, tokenizer))


def well_formed(pair, tokenizer):
    """Whether a pair holds an instruction and, for each side, a story's tokens: numbers below
    the tokenizer's vocabulary, at most MAX_NEW_TOKENS of them, as the model writes them, and
    with the instruction's tokens within the context (DPO reads each story after it)."""
    instruction = pair.get("instruction")
    if not (isinstance(instruction, str) and encodable(instruction)):
        return False
    prompt = len(encode_prompt(tokenizer, instruction))
    # DPO reads the prompt and story but the last token, a target only: one more than the context fits.
    return all(
        isinstance(tokens, list) and 0 < len(tokens) <= MAX_NEW_TOKENS and prompt + len(tokens) <= Config.context + 1
        and all(type(t) is int and 0 <= t < tokenizer.vocab_size for t in tokens)
        for tokens in (pair.get("chosen_tokens"), pair.get("rejected_tokens")))


def main():
    parser = argparse.ArgumentParser(description="Build preference pairs from the fine-tuned model's stories.")
    parser.add_argument("--instructions", type=int, default=2000, help="training instructions to use")
    parser.add_argument("--stories", type=int, default=STORIES, help="stories per instruction")
    parser.add_argument("--model", default=str(CHECKPOINTS / "finetune"))
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    args = parser.parse_args()
    if args.instructions < 1 or args.stories < 2:
        parser.error("--instructions must be at least 1 and --stories at least 2")
    distributed.one_process()
    check_writable(PAIRS.parent)  # now, not when the pairs are saved

    device = pick_device(args.device)
    tokenizer = load_tokenizer()
    model = load_checkpoint(args.model, device, tokenizer).eval()
    # A fixed sample of the training instructions (of the first ASK_POOL), the same for a seed.
    examples = read_instructions(limit=ASK_POOL)
    chosen = np.random.default_rng(SEED).permutation(len(examples))[:args.instructions]
    examples = [examples[i] for i in sorted(chosen)]

    pairs, started = [], time.time()
    for start in range(0, len(examples), CHUNK):
        pairs += make_pairs(model, tokenizer, examples[start:start + CHUNK], args.stories, SEED + start)
        done = min(start + CHUNK, len(examples))
        print(f"\r  {len(pairs)} pairs from {done} of {len(examples)} instructions "
              f"({done - len(pairs)} tied), {(time.time() - started) / 60:.1f} min", end="", flush=True)
    print()
    if not pairs:
        raise SystemExit(f"every instruction's stories tied, so there are no pairs; {PAIRS} is left as it was. "
                         "Try more --instructions or --stories")
    # The instructions used: all the pool holds where --instructions asks for more (the shared sample's 1,240).
    settings = {**vars(args), "instructions": len(examples), "seed": SEED, "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": 1.0, "tokenizer": tokenizer.fingerprint(),
                "model_hash": file_hash(checkpoint_file(args.model))}
    with atomic(PAIRS) as tmp:
        tmp.write_text(json.dumps({"settings": settings, "pairs": pairs}, ensure_ascii=False) + "\n", encoding="utf-8")
    chosen, rejected = (np.mean([p[f"{side}_reward"] for p in pairs]) for side in ("chosen", "rejected"))
    print(f"{len(pairs)} pairs in {PAIRS}; the chosen stories use {chosen:.0%} of their words on average, "
          f"the rejected {rejected:.0%}")
    what_they_differ_by(pairs, tokenizer.eot)


if __name__ == "__main__":
    main()
