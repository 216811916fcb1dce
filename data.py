"""
Episode 1, data: real TinyStories in; clean stories, instructions and token files out.

By default it downloads TinyStoriesV2-GPT4 (train and valid) from the dataset's home on
Hugging Face, with a progress line, resuming a partial download. With --source it reads a
local copy instead: a .txt or .txt.gz file, or a folder of them, with stories separated by
<|endoftext|> lines. Then, in order, each step skipped when its inputs haven't changed and
its outputs are still the files it made (the same size and hash):

1. stories: stripped; empty and repeated stories dropped; a valid story that is also in
   train is dropped from valid, and a held-out story from train, so evaluation never
   measures what training saw; one train story in four is kept out of pretraining, for
   fine-tuning                                 -> data/train.txt, data/tune.txt, data/valid.txt
2. instructions: the words a child would know (askable), and the nouns among them; for each
   story kept for fine-tuning, three words it uses, and the instruction that asks for them
   ("Write a story that uses the words kite, river and brave.")
                                                    -> data/words.json, data/instructions.jsonl
3. the tokenizer (tokenizer.py), trained on the train stories   -> data/tokenizer.json
4. token files for pretraining, an end-of-text before each story -> data/train.bin, valid.bin

The 50 held-out instructions that evaluation uses forever are not made here each time:
they are heldout.json, committed beside this file (version 1, drawn once from the valid
stories of the shared sample), so that every machine and every source of data measures
models on the same 150 words. A folder without that file gets one drawn from its own
valid stories, by the same rule.

Choices of ours: in a folder, a file whose name has "valid" in it is validation text and
any other is train text; a file whose name has "lowercase" in it is left out (lowercased
stories teach a model to write without capitals; name the file itself to use it). With no
valid file, one story in twenty is held out as valid. A story that is not valid UTF-8 is
dropped, and the count is printed. The tokenizer learns from the first
TOKENIZER_MEGABYTES of train stories: plenty for 5,376 tokens, and minutes instead of an
hour on the full 2.2 GB.

The plumbing is files.py's: the download that resumes, each file written under a temporary
name and renamed once whole, the manifest of the steps done, one data.py at a time per folder.

Run:
    python data.py --source ../shared/data/tinystories     (a local copy; how CI runs)
    python data.py --megabytes 100                         (download the first 100 MB of train)
"""
import argparse
import gzip
import hashlib
import json
import random
import re
from collections import Counter
from pathlib import Path

import tokenizer as bpe
from files import DATA, atomic, fetch, inputs_of, one_at_a_time, read_lines, run_step

TRAIN_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt"
VALID_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt"
SEPARATOR = bpe.END_OF_TEXT
SEED = 1337  # the series' seed: every later script's draws start from it
HELDOUT = Path(__file__).resolve().parent / "heldout.json"  # committed: the evaluation set
HELD_OUT = 50  # instructions, three words each: 150 words, the evaluation set forever
HELD_OUT_VERSION = 1  # a new set gets a new version, never silently
TOKENIZER_MEGABYTES = 200  # of train stories, for learning the merges
VALID_SHARE = 20  # with no valid file, one story in VALID_SHARE becomes valid
# One train story in TUNE_SHARE is kept out of pretraining, for fine-tuning on instructions: a
# story pretraining has read many times is predicted from its own first tokens, and then the
# instruction adds nothing to fine-tuning's loss (episode 3 tells the experiment).
TUNE_SHARE = 4
# A word a child would know: in at least 1 in 500 train stories (and 5 of them), but in at
# most 1 in 10, as "happy" or "park" would be asked for and used without trying.
RARE, COMMON, FEWEST = 1 / 500, 1 / 10, 5
STOP_WORDS = frozenset("""
a about above after again against all also am an and any are around as at away back be
because been before being below between both but by came can come could did do does doing
done down during each even ever every few for from get go going gone got had has have
having he her here hers herself him himself his how if in into is it its itself just
let like made make many may me more most much must my myself no nor not now of off on
once one only or other our ours out over own said same saw say says see she should so
some still such than that the their theirs them then there these they this those through
to too two under until up upon very was way we well went were what when where which while
who whom why will with would yes yet you your yours yourself
again almost already always another anymore anyone anything enough everyone everything
instead later maybe never nothing really someone something sometimes soon sure though
""".split())
WORD = re.compile(r"[a-z]+")  # a word of lowercased text, for the reward (evaluate.py)
# A word written in lowercase as a whole, in cased text: not "nstead" in "Instead", not "immy"
# in "Timmy", not "don" in "don't" or "don’t" (the stories write both apostrophes), not "ups" in
# "grown-ups". Names are capitalised, so never match.
LOWERCASE_WORD = re.compile(r"(?<![\w'’-])[a-z]+(?![\w'’-])")
# The words a noun comes after ("the kite", "his red kite"): an askable word within two words after
# one of them in at least NOUN_SHARE of its uses is a noun, which fine-tuning's word swap may
# replace by another noun and the story still reads (finetune.py --swap).
DETERMINERS = frozenset("a an the his her my their our your its this that".split())
NOUN_SHARE = 0.6
# A word as nouns_among counts them, apostrophes inside it: "dog’s" is one word, so "a dog’s
# kite" puts the kite two words after "a".
ANY_WORD = re.compile(r"[A-Za-z'’]+")


def asking():
    """Everything that decides which words are asked for: a change to any of it makes the instructions again."""
    return {"seed": SEED, "rare": RARE, "common": COMMON, "fewest": FEWEST, "pattern": LOWERCASE_WORD.pattern,
            "stop_words": hashlib.sha256(" ".join(sorted(STOP_WORDS)).encode()).hexdigest()[:16],
            "determiners": sorted(DETERMINERS), "noun_share": NOUN_SHARE, "noun_pattern": ANY_WORD.pattern}


# ---------------------------------------------------------------- getting the text

def download(folder, megabytes=None):
    """TinyStories from its home into folder: the train stories (or those of its first
    `megabytes`, cut after the last whole one) and the valid ones, marked as local_files marks them."""
    train_name = Path(TRAIN_URL).name if not megabytes else f"TinyStoriesV2-GPT4-train-first-{megabytes}MB.txt"
    train = folder / train_name
    fetch(TRAIN_URL, train, megabytes * 1_000_000 if megabytes else None, f"\n{SEPARATOR}\n".encode())
    valid = fetch(VALID_URL, folder / Path(VALID_URL).name)
    return [("train", train), ("valid", valid)]


def local_files(source):
    """The files of a local copy, each marked train or valid by its name."""
    source = Path(source)
    if not source.exists():
        raise SystemExit(f"--source {source}: no such file or folder")
    if source.is_file():
        files = [source]
    else:
        files = sorted(p for p in source.iterdir() if p.name.endswith((".txt", ".txt.gz")))
        for p in [p for p in files if "lowercase" in p.name]:
            print(f"  leaving out {p.name}: lowercased text (name the file itself to use it)")
        files = [p for p in files if "lowercase" not in p.name]
    if not files:
        raise SystemExit(f"--source {source}: no .txt or .txt.gz files in it")
    return [("valid" if "valid" in p.name else "train", p) for p in files]


def read_stories(path):
    """Yields the stories of a file, streamed: the whole dataset is gigabytes."""
    opener = gzip.open if path.name.endswith(".gz") else open
    lines, bad, offset, first_bad = [], 0, 0, None
    with opener(path, "rb") as file:
        for line in read_lines(file, path):
            offset += len(line)
            if SEPARATOR.encode() not in line:
                lines.append(line)
                continue
            # A separator ends the story before it (usually on a line of its own; a line may hold several).
            *ends, after = line.split(SEPARATOR.encode())
            for before in ends:
                story, lines = b"".join(lines) + before, []
                try:
                    yield story.decode("utf-8")
                except UnicodeDecodeError:
                    bad += 1
                    first_bad = first_bad or offset
            lines = [after] if after.strip() else []
    try:
        if lines:
            yield b"".join(lines).decode("utf-8")
    except UnicodeDecodeError:
        bad += 1
        first_bad = first_bad or offset
    if bad:
        print(f"  {path.name}: dropped {bad} stories that are not valid UTF-8 (the first near byte {first_bad:,})")


def fingerprint(text):
    # whitespace-insensitive, so a story repeated with other line breaks still counts as repeated
    return hashlib.blake2b(" ".join(text.split()).encode(), digest_size=8).digest()


def write_stories(files, out, heldout=HELDOUT):
    """Step 1: clean stories into train.txt, tune.txt and valid.txt; returns how many of each."""
    held_out = {fingerprint(i["story"]) for i in read_heldout(heldout)} if Path(heldout).exists() else set()
    seen = set()  # fingerprints of the stories kept so far, train first
    counts = Counter()
    has_valid = any(split == "valid" for split, _ in files)
    ordered = [f for f in files if f[0] == "train"] + [f for f in files if f[0] == "valid"]
    with atomic(out / "train.txt") as train_tmp, atomic(out / "tune.txt") as tune_tmp, \
            atomic(out / "valid.txt") as valid_tmp:
        # Lines end in "\n" on every system: read_stories reads the files back as bytes.
        with open(train_tmp, "w", encoding="utf-8", newline="\n") as train, \
                open(tune_tmp, "w", encoding="utf-8", newline="\n") as tune, \
                open(valid_tmp, "w", encoding="utf-8", newline="\n") as valid:
            split_files = {"train": train, "tune": tune, "valid": valid}
            for split, path in ordered:
                for story in read_stories(path):
                    story = story.strip()
                    key = fingerprint(story)
                    if not story or key in seen:
                        counts["dropped"] += 1
                        continue
                    seen.add(key)
                    if split == "train" and key in held_out:
                        counts["held out"] += 1  # evaluation's stories never reach training
                        continue
                    goes_to = split_of(split, key, has_valid)
                    split_files[goes_to].write(f"{story}\n{SEPARATOR}\n")
                    counts[goes_to] += 1
            # Refused before the files are renamed, so the stories of an earlier run stay as they were.
            for split in ("train", "valid"):
                if counts[split] == 0:
                    raise SystemExit(f"no {split} stories in the source; the stories prepared before are kept")
    return counts


def split_of(source_split, key, has_valid):
    """Where a story goes, decided by its fingerprint: with no valid file, one in VALID_SHARE
    is valid; of the train stories, one in TUNE_SHARE is kept for fine-tuning."""
    if source_split == "valid" or (not has_valid and key[0] % VALID_SHARE == 0):
        return "valid"
    return "tune" if key[1] % TUNE_SHARE == 0 else "train"


def stories(path):
    """The stories of data/train.txt, tune.txt or valid.txt."""
    return (story.strip() for story in read_stories(path))


# ---------------------------------------------------------------- instructions

def instruction(words):
    """The text that asks for the words, three of them in the files ("kite, river and brave");
    the story follows on the next line."""
    *others, last = words
    return f"Write a story that uses the words {', '.join(others)} and {last}.\n"


def askable_words(train_path):
    """Words a child would know: written in lowercase in the stories (so not names), not stop
    words, in neither too few stories nor too many."""
    in_stories, total = Counter(), 0
    for story in stories(train_path):
        in_stories.update(set(LOWERCASE_WORD.findall(story)))
        total += 1
    fewest, most = max(FEWEST, RARE * total), COMMON * total
    return {word for word, n in in_stories.items()
            if fewest <= n <= most and len(word) >= 3 and word not in STOP_WORDS}


def nouns_among(train_path, askable):
    """The askable words that are nouns, as far as a count can tell: within two words after a
    determiner in at least NOUN_SHARE of their uses (a few adjectives pass too: "the mighty lion")."""
    uses, after_determiner = Counter(), Counter()
    for story in stories(train_path):
        words = ANY_WORD.findall(story)
        for i, word in enumerate(words):
            if word in askable:
                uses[word] += 1
                after_determiner[word] += any(w.lower() in DETERMINERS for w in words[max(0, i - 2):i])
    return {word for word in uses if after_determiner[word] >= NOUN_SHARE * uses[word]}


def write_words(path, askable, nouns):
    with atomic(path) as tmp:
        tmp.write_text(json.dumps({"askable": sorted(askable), "nouns": sorted(nouns)}, indent=0) + "\n")


def askable_in(story, askable):
    """The askable words a story uses, each once, in alphabetical order: what an instruction can ask of it."""
    return sorted(set(LOWERCASE_WORD.findall(story)) & askable)


def pick_words(story, askable, seed=SEED, count=3):
    """count distinct askable words that the story uses (all of them if it has fewer), the same
    for a story and a seed whatever the order of the file; None when the story has fewer than three."""
    used = askable_in(story, askable)
    if len(used) < 3:
        return None
    rng = random.Random(hashlib.sha256(f"{seed}:{story}".encode()).digest())
    return rng.sample(used, min(count, len(used)))


def ask(story, askable, seed=SEED, count=3):
    """The instruction for a story, as written to the files (three words), or None."""
    words = pick_words(story, askable, seed, count)
    if words is None:
        return None
    return {"words": words, "instruction": instruction(words), "story": story}


def write_instructions(out, askable):
    """Step 2: an instruction for each story kept for fine-tuning that has three askable words."""
    count = 0
    with atomic(out / "instructions.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as file:
        for story in stories(out / "tune.txt"):
            example = ask(story, askable)
            if example:
                file.write(json.dumps(example, ensure_ascii=False) + "\n")
                count += 1
    return count


def draw_heldout(valid_path, askable):
    """The held-out instructions: valid stories in an order set by the seed alone (a hash of
    seed and story), the first HELD_OUT that have three askable words."""
    ranked = sorted(stories(valid_path), key=lambda s: hashlib.sha256(f"{SEED}:{s}".encode()).digest())
    chosen = []
    for story in ranked:
        example = ask(story, askable)
        if example:
            chosen.append(example)
        if len(chosen) == HELD_OUT:
            return chosen
    raise SystemExit(f"only {len(chosen)} valid stories have three askable words; {HELD_OUT} are needed")


def write_heldout(path, instructions):
    content = {"version": HELD_OUT_VERSION, "seed": SEED,
               "license": "Stories from TinyStories (Eldan and Li, 2023), CDLA-Sharing-1.0",
               "instructions": instructions}
    with atomic(path) as tmp:
        tmp.write_text(json.dumps(content, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def read_heldout(path=HELDOUT):
    """The held-out instructions of a file, refused unless it is version HELD_OUT_VERSION of HELD_OUT."""
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"no {path}: it comes with the repository (or python data.py draws one)")
    try:
        heldout = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        heldout = None
    if not isinstance(heldout, dict) or heldout.get("version") != HELD_OUT_VERSION \
            or not isinstance(heldout.get("instructions"), list) or len(heldout["instructions"]) != HELD_OUT:
        raise SystemExit(f"{path} is not version {HELD_OUT_VERSION} of the {HELD_OUT} held-out instructions")
    # Each as data.py writes it: the reward reads three lowercase words (a string would be
    # scored letter by letter, a capital never matches).
    for number, example in enumerate(heldout["instructions"], 1):
        if not well_formed(example):
            raise SystemExit(f"{path}: held-out instruction {number} is not three lowercase words, their "
                             "instruction and a story; take the file again from the repository")
    return heldout["instructions"]


def well_formed(example):
    """Whether a held-out instruction has three distinct lowercase words, the instruction
    that asks for them, and a story."""
    words = example.get("words") if isinstance(example, dict) else None
    return (isinstance(words, list) and all(isinstance(word, str) and WORD.fullmatch(word) for word in words)
            and len(set(words)) == 3 == len(words) and example.get("instruction") == instruction(words)
            and isinstance(example.get("story"), str))


# ---------------------------------------------------------------- the four steps

def prepare(files, out=DATA, vocab_size=bpe.VOCAB_SIZE, heldout=HELDOUT):
    """The four steps, each skipped when its inputs haven't changed since the last run and
    its outputs are as it made them."""
    out.mkdir(parents=True, exist_ok=True)
    train, tune, valid = out / "train.txt", out / "tune.txt", out / "valid.txt"
    # 1. Clean stories, train, tune and valid apart, the held-out stories out of train
    #    (VALID_SHARE splits them only where the source has no valid file).
    has_valid = any(split == "valid" for split, _ in files)
    run_step(out, "stories", lambda: inputs_of(heldout, *[p for _, p in files], files=[[s, str(p)] for s, p in files],
                                               tune_share=TUNE_SHARE, **({} if has_valid else {"valid_share": VALID_SHARE})),
             [train, tune, valid, heldout], lambda: make_stories(files, out, heldout))
    # 2. An instruction for each story kept for fine-tuning: what fine-tuning and the RL episodes train on.
    run_step(out, "instructions", lambda: inputs_of(train, tune, **asking()),
             [out / "instructions.jsonl", out / "words.json"], lambda: make_instructions(out))
    # 3. The tokenizer learns its merges from the train stories.
    run_step(out, "tokenizer", lambda: inputs_of(train, vocab_size=vocab_size, megabytes=TOKENIZER_MEGABYTES),
             [out / "tokenizer.json"], lambda: make_tokenizer(out, vocab_size))
    # 4. Every story as tokens, each after an end-of-text, for pretraining.
    run_step(out, "tokens", lambda: inputs_of(train, valid, out / "tokenizer.json"),
             [out / "train.bin", out / "valid.bin"], lambda: make_tokens(out))


def make_stories(files, out, heldout):
    counts = write_stories(files, out, heldout)
    # Without a held-out set (a fresh folder), draw one from these valid stories, once.
    if not Path(heldout).exists():
        write_heldout(heldout, draw_heldout(out / "valid.txt", askable_words(out / "train.txt")))
        print(f"  drew {HELD_OUT} held-out instructions from the valid stories into {heldout}")
    return (f"{counts['train']:,} train, {counts['tune']:,} fine-tuning and {counts['valid']:,} valid stories, "
            f"{counts['dropped']:,} empty or repeated dropped, {counts['held out']} held-out stories left out of train")


def make_instructions(out):
    askable = askable_words(out / "train.txt")
    nouns = nouns_among(out / "train.txt", askable)
    write_words(out / "words.json", askable, nouns)
    count = write_instructions(out, askable)
    return f"{len(askable):,} askable words ({len(nouns):,} of them nouns); {count:,} train instructions"


def make_tokenizer(out, vocab_size):
    tokenizer = bpe.train(bpe.first_megabytes(stories(out / "train.txt"), TOKENIZER_MEGABYTES), vocab_size)
    with atomic(out / "tokenizer.json") as tmp:
        tokenizer.save(tmp)
    return f"{tokenizer.vocab_size} tokens in tokenizer.json"


def make_tokens(out):
    tokenizer = bpe.load_tokenizer(out)
    train = bpe.write_tokens(stories(out / "train.txt"), out / "train.bin", tokenizer)
    valid = bpe.write_tokens(stories(out / "valid.txt"), out / "valid.bin", tokenizer)
    return f"{train:,} train and {valid:,} valid tokens"


def check_seed(parser, seed):
    """Stops with one line unless --seed is 0 to 2**32 - 1, the seeds of 32 bits that NumPy's
    older generators take too: far enough inside torch's 2**64 for PPO's and GRPO's seed *
    100,000 + rollout, where a larger seed would stop a run at its first rollout."""
    if not 0 <= seed < 2 ** 32:
        parser.error(f"--seed must be 0 to {2 ** 32 - 1}")


def main():
    parser = argparse.ArgumentParser(description="Prepare TinyStories: stories, instructions, tokenizer, tokens.")
    parser.add_argument("--source", help="a local .txt/.txt.gz file or folder, instead of downloading")
    parser.add_argument("--megabytes", type=int, help="download only the first N MB of the train file")
    parser.add_argument("--out", default=str(DATA), help="the data folder (default: data)")
    args = parser.parse_args()
    if args.megabytes is not None and args.megabytes <= 0:
        parser.error("--megabytes must be a positive number")
    if args.source and not Path(args.source).exists():  # before the data folder is made for it
        parser.error(f"--source {args.source}: no such file or folder")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file: name a folder")
    with one_at_a_time(out):
        files = local_files(args.source) if args.source else download(out / "download", args.megabytes)
        prepare(files, out)


if __name__ == "__main__":
    main()
