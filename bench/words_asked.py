"""
What asking each training story for more of its words (finetune.py --words N) changes in
the data fine-tuning reads: over one pass of the training stories (those finetune.py does
not hold back), asked as its first pass asks them, the first uses of the asked words as a
share of the story tokens (finetune.first_uses, what --first-use-weight would weigh), the
prompt's mean length, and the examples cut at the context before their end-of-text; and
first, how many askable words the training stories use, all that --words can ask for.

    python bench/words_asked.py                  (3, 8, 16 and 24 words; seconds)
    python bench/words_asked.py --words 3 24
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data import SEED, askable_in  # noqa: E402
from files import read_instructions, read_words  # noqa: E402
from finetune import MAX_LENGTH, TUNE_POOL, a_pass, ask_anew, encode_example, first_uses, split_held_back  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402


def what_the_words_change(tokenizer, stories, askable, nouns, words):
    """One pass of the stories, each asked for `words` of its words as the first pass of the
    default seed asks it: (first uses over story tokens, the prompts' mean tokens, examples cut)."""
    examples = [ask_anew(stories[story], askable, seed, nouns, words=words)
                for story, seed in a_pass(np.random.default_rng(SEED), len(stories), 1, 0)]
    first, story_tokens, prompts, cut = 0, 0, [], 0
    for example in examples:
        tokens, prompt = encode_example(tokenizer, example)
        first += len(first_uses(tokenizer, example["words"], tokens[prompt:]))
        story_tokens += len(tokens) - prompt
        prompts.append(prompt)
        cut += tokens[-1] != tokenizer.eot
    return first / story_tokens, float(np.mean(prompts)), cut


def askable_per_story(stories, askable):
    """How many distinct askable words each story uses: the most that --words can ask of it."""
    return [len(askable_in(story, askable)) for story in stories]


def main():
    parser = argparse.ArgumentParser(description="What asking each training story for more words changes in the data.")
    parser.add_argument("--words", type=int, nargs="+", default=[3, 8, 16, 24], help="words asked (default 3 8 16 24)")
    args = parser.parse_args()
    if min(args.words) < 3:
        parser.error("--words: 3 or more each")
    tokenizer = load_tokenizer()
    training, _ = split_held_back(read_instructions(limit=TUNE_POOL))
    stories = [example["story"] for example in training]
    askable, nouns = read_words()
    print(f"one pass of the {len(stories):,} training stories")
    # 8: the fewest words the default table asks for beyond the three of instructions.jsonl.
    counts = askable_per_story(stories, askable)
    print(f"askable words a story uses: {np.mean(counts):.1f} on average, "
          f"{np.mean(np.array(counts) >= 8):.1%} of the stories at least 8")
    print(f"| words asked | first uses, share of the story tokens | prompt, tokens | examples cut at {MAX_LENGTH} tokens "
          "(no end-of-text) |")
    print("| --- | --- | --- | --- |")
    for words in args.words:
        share, prompt, cut = what_the_words_change(tokenizer, stories, askable, nouns, words)
        print(f"| {words} | {share:.1%} | {prompt:.0f} | {cut} |")


if __name__ == "__main__":
    main()
