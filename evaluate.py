"""
Episode 5, evaluation: how well does a model do what it is asked, and what does it cost?

For each model given on the command line (a checkpoint folder, for the final model in it,
or a checkpoint file), three figures:

- words used: a story for each of the 50 held-out instructions (heldout.json, beside the
  scripts; never seen in training), at temperature 1 as in the RL episodes, with a fixed seed; the share
  of the 150 requested words that the stories use. This is the reward of the RL episodes.
- loss on plain stories: the next-token loss on VALID_WINDOWS (512) windows of 256 tokens
  spread evenly over data/valid.bin, the same windows every time, in float32, so the figure
  is the same on any machine and compares from model to model (`--valid-windows all` takes
  the whole file: 1,268 windows of the shared sample, about 20,000 of the full download's).
  It rises when a model forgets how to write stories.
- stories that end: the share of those 50 stories that end (write end-of-text) within
  MAX_NEW_TOKENS (200) tokens.

The rule for a word: it counts when the story has it as a whole word, in any case, or one
of its regular forms: -s (-es after s, x, z, ch, sh; -ies for a consonant and y), -ed and
-ing, with the usual spelling (bake: bakes, baked, baking; tie: tied, tying; agree: agreed,
agreeing; stop: stopped, stopping; cry: cries, cried, crying). Irregular forms don't count
(run is not in "ran"), nor a word inside another ("rain" is not in "rainbow", "car" not in
"card"), nor, mostly, another word's forms ("hop" is not in "hoped", which is hope's, nor
"bee" in "being"). The rule knows spelling, not English: "bath" still counts in "bathing"
and "breath" in "breathed" (bathe's and breathe's), and a noun gets forms no story writes
("tree": "treeing"), which cost nothing.

And two signs of reward hacking, for the RL episodes: stories that don't end (they run on
to the limit, where a longer story has more chances to use a word), and how many times a
used word is used (the reward counts it once, however often it comes back).

With --seeds N the held-out stories are written N times, with N seeds, and the table gives
the mean and the range of the words used: one seed's 150 words move by several points from
luck alone. The table is printed, and each model's figures and stories are saved under
runs/evaluate/, in a file named after the checkpoint's path (grpo-kl-0.05-rollout-10.json).

    python evaluate.py checkpoints/pretrain checkpoints/finetune --seeds 3
"""
import argparse
import json
import os
import re
from pathlib import Path

import distributed
from checkpoints import RUNS, checkpoint_file, model_from, read_checkpoint
from data import HELDOUT, WORD, read_heldout
from devices import pick_device
from files import atomic, check_writable
from sample import MAX_NEW_TOKENS, write_stories
from tokenizer import load_tokenizer
from train import load_tokens, valid_loss

SEED = 0  # the same stories for a model every time it is measured
VALID_WINDOWS = 512  # of valid.bin, for the loss on plain stories: a fixed cost whatever the data's size
# A last consonant after a single vowel, which may double before -ed and -ing: stop, stopped.
DOUBLES = re.compile(r"[^aeiou][aeiou][bdgklmnprt]$")
# A word's groups of vowels, one a syllable (y is a vowel where no vowel follows it: "sky", not
# "crayon"). A word of one syllable doubles its last consonant (hop: hopped; "hoped" is hope's);
# a longer word may not (open: opened; admit: admitted), so it takes both spellings.
VOWEL_GROUPS = re.compile(r"(?:[aeiou]|y(?![aeiou]))+")


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
    if word.endswith("ie"):  # tie: tied, tying
        found |= {word + "d", word[:-2] + "ying"}
    elif word.endswith(("ee", "ye", "oe")):  # agree: agreed, agreeing (and "bee" is not in "being")
        found |= {word + "d", word + "ing"}
    elif word.endswith("e"):  # bake: baked, baking
        found |= {word + "d", word[:-1] + "ing"}
    elif DOUBLES.search(word) and len(VOWEL_GROUPS.findall(word)) == 1:  # stop: stopped, stopping
        found |= {word + word[-1] + "ed", word + word[-1] + "ing"}
    elif DOUBLES.search(word):  # open: opened; admit: admitted
        found |= {word + "ed", word + "ing", word + word[-1] + "ed", word + word[-1] + "ing"}
    else:  # jump: jumped, jumping
        found |= {word + "ed", word + "ing"}
    return found


def words_used(story, words):
    """The reward: the share of the requested words the story uses, between 0 and 1."""
    found = set(WORD.findall(story.lower()))
    return sum(bool(forms(word) & found) for word in words) / len(words)


def times_used(story, word):
    """How many times a story uses a word, in any of its forms: one use is the task, more is
    the reward hacking the RL episodes watch for (the reward counts a word once)."""
    wanted = forms(word)
    return sum(found in wanted for found in WORD.findall(story.lower()))


def heldout_stories(model, tokenizer, instructions, seed=SEED):
    """One story per held-out instruction, as tokens, at temperature 1."""
    return write_stories(model, tokenizer, [i["instruction"] for i in instructions], MAX_NEW_TOKENS, seed=seed)


def measure_stories(model, tokenizer, instructions, seed):
    """The held-out stories of one seed: the words they use, how many end, how often a used
    word comes back."""
    stories = heldout_stories(model, tokenizer, instructions, seed)
    texts = [tokenizer.decode(story) for story in stories]
    used = [words_used(text, i["words"]) for text, i in zip(texts, instructions)]
    uses = [n for text, i in zip(texts, instructions) for n in (times_used(text, w) for w in i["words"]) if n]
    return {"words_used": sum(used) / len(used), "ended": sum(tokenizer.eot in s for s in stories) / len(stories),
            "uses_of_a_used_word": sum(uses) / max(len(uses), 1),
            "stories": [{"words": i["words"], "story": text, "words_used": u}
                        for i, text, u in zip(instructions, texts, used)]}


def measure(model, tokenizer, instructions, valid_tokens, device, seeds=1, windows=None):
    """A model's figures: those of its held-out stories, the mean over `seeds` seeds (each
    seed's words used kept too), and its loss on plain stories (all of them, or `windows`
    windows spread over them). The stories kept are seed 0's."""
    by_seed = [measure_stories(model, tokenizer, instructions, SEED + seed) for seed in range(seeds)]
    mean = {key: sum(m[key] for m in by_seed) / seeds for key in ("words_used", "ended")}
    # How often a used word comes back: over the seeds whose stories used a word (a seed that used none has no figure).
    with_uses = [m["uses_of_a_used_word"] for m in by_seed if m["uses_of_a_used_word"]]
    mean["uses_of_a_used_word"] = sum(with_uses) / max(len(with_uses), 1)
    return {**mean, "words_used_by_seed": [m["words_used"] for m in by_seed],
            "valid_loss": valid_loss(model, valid_tokens, device, "fp32", windows=windows),
            "stories": by_seed[0]["stories"]}


def windows_or_all(text):
    """--valid-windows: a number, or all (None: valid_loss then reads the whole file)."""
    return None if text == "all" else int(text)


def model_name(path):
    """A model is named after its folder. A checkpoint saved along the way keeps its own
    name; a final model in a folder whose name starts with kl- is named after the folder
    above it, a dash, and the folder."""
    file = Path(os.path.abspath(checkpoint_file(path)))  # the folder's own name where the path is . or ../
    if file.name != "model.pt":
        return file.stem
    folder = file.parent
    # ppo/kl-0.05 is named ppo-kl-0.05, and grpo/kl-0.05 grpo-kl-0.05: the two don't collide.
    return f"{folder.parent.name}-{folder.name}" if folder.name.startswith("kl-") else folder.name


def saved_name(path):
    """The file a model's results are saved in: its path under checkpoints/, joined by dashes
    (grpo-kl-0.05-rollout-10), so that two runs' rollout-10, or two folders named alike,
    never overwrite each other's; elsewhere its whole path from the root. The same name from
    wherever the path is given."""
    file = checkpoint_file(os.path.normpath(path))  # inside/../model.pt is model.pt
    own_name = [] if file.name == "model.pt" else [file.stem]
    whole = [*Path(os.path.abspath(file)).parent.parts[1:], *own_name]  # the drive or root left out
    below = whole[len(whole) - whole[::-1].index("checkpoints"):] if "checkpoints" in whole else []
    return "-".join(below or whole)


def spread(values, form="{:.0%}"):
    """A figure over several seeds: the mean, and the lowest and highest (in `form`)."""
    if len(values) == 1:
        return form.format(values[0])
    return f"{form.format(sum(values) / len(values))} ({form.format(min(values))} to {form.format(max(values))})"


def table(rows):
    """The table of models, in markdown."""
    lines = [f"| model | words used | loss on plain stories | stories that end within {MAX_NEW_TOKENS} tokens "
             "| uses of a used word |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {spread(r['words_used_by_seed'])} | {r['valid_loss']:.2f} | {r['ended']:.0%} | "
              f"{r['uses_of_a_used_word']:.1f} |" for r in rows]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="Measure models on the held-out instructions and plain stories.")
    parser.add_argument("models", nargs="+", help="checkpoint folders (their final model) or files")
    parser.add_argument("--seeds", type=int, default=1, help="seeds for the held-out stories: their mean and spread")
    parser.add_argument("--valid-windows", type=windows_or_all, default=VALID_WINDOWS,
                        help=f"the loss on this many windows spread over the valid stories, or all "
                        f"(default {VALID_WINDOWS})")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    args = parser.parse_args()
    if args.seeds < 1 or (args.valid_windows is not None and args.valid_windows < 1):
        parser.error("--seeds and --valid-windows must be at least 1 (or --valid-windows all)")
    distributed.one_process()
    check_writable(RUNS / "evaluate")  # now, not after the first model's stories are written

    device = pick_device(args.device)
    tokenizer = load_tokenizer()
    instructions = load_instructions()
    valid_tokens = load_tokens("valid")
    rows = []
    for path in args.models:
        checkpoint = read_checkpoint(path)
        model = model_from(checkpoint, path, device, tokenizer).eval()
        name = model_name(path)
        # What made the model (its script, steps or rollouts, settings) goes with its figures.
        made_by = checkpoint["made_by"]
        result = {"model": name, "checkpoint": str(path), "seeds": args.seeds, "valid_windows": args.valid_windows,
                  "made_by": made_by,
                  **measure(model, tokenizer, instructions, valid_tokens, device, args.seeds, args.valid_windows)}
        with atomic(RUNS / "evaluate" / f"{saved_name(path)}.json") as tmp:
            tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        rows.append(result)
        print(f"  {name}: {spread(result['words_used_by_seed'])} of the words, loss {result['valid_loss']:.2f}, "
              f"{result['ended']:.0%} ended", flush=True)
    print("\n" + table(rows))
    print(f"\nsaved in {RUNS / 'evaluate'}/")


if __name__ == "__main__":
    main()
