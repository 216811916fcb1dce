"""
Episode 5, evaluation: how well does a model do what it is asked, and what does it cost?

For each model given on the command line (a checkpoint folder, for the final model in it,
or a checkpoint file), three figures:

- words used: a story for each of the 50 held-out instructions (data/heldout.json, never
  seen in training), at temperature 1 as in the RL episodes, with a fixed seed; the share
  of the 150 requested words that the stories use. This is the reward of the RL episodes.
- loss on plain stories: the next-token loss on all of data/valid.bin, in float32, so the
  figure is the same on any machine. It rises when a model forgets how to write stories.
- stories that end: the share of those 50 stories that end (write end-of-text) within
  MAX_NEW_TOKENS (200) tokens.

The rule for a word: it counts when the story has it as a whole word, in any case, or one
of its regular forms: -s (-es after s, x, z, ch, sh; -ies for a consonant and y), -ed and
-ing, with the usual spelling (bake: bakes, baked, baking; stop: stopped, stopping; cry:
cries, cried, crying). Irregular forms don't count (run is not in "ran"), nor a word inside
another ("rain" is not in "rainbow", "car" not in "card"). One slip remains, as the rule
doesn't know English: "hop" counts in "hoped" and "hoping", the forms of "hope".

The table is printed, and each model's figures and stories are saved under runs/evaluate/.

    python evaluate.py checkpoints/pretrain checkpoints/finetune
"""
import argparse
import json
import re
from pathlib import Path

from data import HELDOUT, WORD, atomic, load_tokenizer, read_heldout
from model import RUNS, load_checkpoint, pick_device
from sample import MAX_NEW_TOKENS, write_stories
from train import load_tokens, valid_loss

SEED = 0  # the same stories for a model every time it is measured
# A last consonant that doubles before -ed and -ing after a single vowel: stop, stopped.
DOUBLES = re.compile(r"[^aeiou][aeiou][bdgklmnprt]$")


def load_instructions(path=HELDOUT):
    """The 50 held-out instructions (150 words), each a dict with words, instruction and story."""
    return read_heldout(path)


def forms(word):
    """The forms of a requested word that count as using it."""
    found = {word}
    if word.endswith(("s", "x", "z", "ch", "sh")):
        found.add(word + "es")
    elif re.search("[^aeiou]y$", word):
        found |= {word[:-1] + "ies", word[:-1] + "ied"}
    else:
        found.add(word + "s")
    if word.endswith("e"):
        found |= {word + "d", word[:-1] + "ing"}
    else:
        found |= {word + "ed", word + "ing"}
    if DOUBLES.search(word):
        found |= {word + word[-1] + "ed", word + word[-1] + "ing"}
    return found


def words_used(story, words):
    """The reward: the share of the requested words the story uses, between 0 and 1."""
    found = set(WORD.findall(story.lower()))
    return sum(bool(forms(word) & found) for word in words) / len(words)


def heldout_stories(model, tokenizer, instructions, seed=SEED):
    """One story per held-out instruction, as tokens, at temperature 1."""
    return write_stories(model, tokenizer, [i["instruction"] for i in instructions], MAX_NEW_TOKENS, seed=seed)


def measure(model, tokenizer, instructions, valid_tokens, device):
    stories = heldout_stories(model, tokenizer, instructions)
    texts = [tokenizer.decode(story) for story in stories]
    used = [words_used(text, i["words"]) for text, i in zip(texts, instructions)]
    return {
        "words_used": sum(used) / len(used),
        "valid_loss": valid_loss(model, valid_tokens, device, "fp32", windows=None),
        "ended": sum(tokenizer.eot in story for story in stories) / len(stories),
        "stories": [{"words": i["words"], "story": text, "words_used": u}
                    for i, text, u in zip(instructions, texts, used)],
    }


def model_name(path):
    """A model is named after its folder. A checkpoint saved along the way keeps its own
    name; a final model in a folder whose name starts with kl- is named after the folder
    above it, a dash, and the folder."""
    path = Path(path)
    if path.suffix == ".pt" and path.name != "model.pt":
        return path.stem
    folder = path.parent if path.suffix == ".pt" else path
    # ppo/kl-0.05 is named ppo-kl-0.05, and grpo/kl-0.05 grpo-kl-0.05: the two don't collide.
    return f"{folder.parent.name}-{folder.name}" if folder.name.startswith("kl-") else folder.name


def main():
    parser = argparse.ArgumentParser(description="Measure models on the held-out instructions and plain stories.")
    parser.add_argument("models", nargs="+", help="checkpoint folders (their final model) or files")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    args = parser.parse_args()

    device = pick_device(args.device)
    tokenizer = load_tokenizer()
    instructions = load_instructions()
    valid_tokens = load_tokens("valid")
    rows = []
    for path in args.models:
        model = load_checkpoint(path, device, tokenizer).eval()
        name = model_name(path)
        result = {"model": name, "checkpoint": str(path), "seed": SEED, **measure(model, tokenizer, instructions,
                                                                                 valid_tokens, device)}
        with atomic(RUNS / "evaluate" / f"{name}.json") as tmp:
            tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        rows.append(result)
        print(f"  {name}: {result['words_used']:.0%} of the words, loss {result['valid_loss']:.2f}, "
              f"{result['ended']:.0%} ended")

    print(f"\n| model | words used | loss on plain stories | stories that end within {MAX_NEW_TOKENS} tokens |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['words_used']:.0%} | {r['valid_loss']:.2f} | {r['ended']:.0%} |")
    print(f"\nsaved in {RUNS / 'evaluate'}/")


if __name__ == "__main__":
    main()
