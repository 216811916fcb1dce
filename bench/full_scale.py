"""
Bench: the learner's own path at the full download's scale. It makes a corpus the size of
TinyStoriesV2's train file (2.2 GB, and a valid file a hundredth of that) from the shared
sample's stories, each copy given a main character of its own so that data.py keeps it
(it drops repeated stories), in a scratch folder; then runs the course's steps on it with
tiny budgets, one after the other, and prints for each: its wall time, when it printed its
first line of progress (a training step's, a rollout's, a model's figures), and its peak
resident memory. The scratch folder is removed at the end (--keep leaves it).

    python bench/full_scale.py --source ../shared/data/tinystories                  (about 30 minutes)
    python bench/full_scale.py --source ../shared/data/tinystories --gigabytes 0.22 (a tenth, to try it)
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import max_resident_mb  # noqa: E402
from data import SEPARATOR, local_files, read_stories  # noqa: E402
from devices import machine  # noqa: E402

# Each step as the course runs it, with a budget of a few steps rather than minutes; the line
# it prints once it has done some real work, and what that line means (None: only the total).
STEPS = [
    ("data.py", ["--source", "source"], None, ""),
    ("train.py", ["--steps", "20"], r"step 10: loss", "its 10th step"),
    ("finetune.py", ["--steps", "20"], r"step 10: loss", "its 10th step"),
    ("preferences.py", ["--instructions", "16"], r"\s*\d+ pairs from", "its 16 instructions' pairs"),
    ("dpo.py", ["--steps", "10"], r"step 1: loss", "its first step, after an evaluation"),
    ("ppo.py", ["--rollouts", "1"], r"rollout 1:", "its first rollout, after an evaluation"),
    ("grpo.py", ["--rollouts", "1"], r"rollout 1:", "its first rollout, after an evaluation"),
    ("evaluate.py", ["checkpoints/finetune", "--seeds", "3"], None, ""),
]
SYLLABLES = "ba ko mi ta lu re zo ni fe da po si gu na te vi ro ma ke lo".split()
# A name in a story: a capitalised word inside a sentence (not after . ! ? or a quote).
NAME = re.compile(r"(?<=[a-z,] )[A-Z][a-z]+\b")


def name(number):
    """A made-up name for each copy: Bakomi, Bakota, ... (8,000 of them)."""
    a, b, c = number // 400 % 20, number // 20 % 20, number % 20
    return (SYLLABLES[a] + SYLLABLES[b] + SYLLABLES[c]).capitalize()


def renamed(story, copy):
    """The story with its most frequent name replaced by the copy's own, or None if it names no one."""
    names = NAME.findall(story)
    if not names:
        return None
    main = max(sorted(set(names)), key=names.count)  # sorted: the same choice on every run
    return re.sub(rf"\b{main}\b", name(copy), story)


def write_copies(stories, path, megabytes):
    """Copies of the stories, renamed, to path until it holds megabytes of text; returns the count."""
    budget, count = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as file:
        for copy in range(8000):
            for story in stories:
                text = story if copy == 0 else renamed(story, copy)
                if text is None:
                    continue
                file.write(f"{text}\n{SEPARATOR}\n")
                budget -= len(text.encode("utf-8")) + len(SEPARATOR) + 2
                count += 1
                if budget <= 0:
                    return count
    return count


def run(script, args, marker, folder):
    """Runs a step in the folder; returns (seconds, seconds to the marker's line or None, peak MB,
    the lines it printed)."""
    started, first = time.time(), None
    process = subprocess.Popen([sys.executable, str(ROOT / script), *args], cwd=folder, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in process.stdout:
        if first is None and marker and re.match(marker, line):
            first = time.time() - started
        lines.append(line)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.time() - started
    if status != 0:
        raise SystemExit(f"{script} failed:\n{''.join(lines[-5:])}")
    return seconds, first, max_resident_mb(usage.ru_maxrss), lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, help="the shared sample's folder, whose stories are copied")
    parser.add_argument("--gigabytes", type=float, default=2.2, help="of train text (default 2.2, the full file)")
    parser.add_argument("--keep", action="store_true", help="leave the scratch folder")
    args = parser.parse_args()
    if args.gigabytes <= 0:
        parser.error("--gigabytes must be positive")
    folder = Path(tempfile.mkdtemp(prefix="full-scale-"))
    try:
        (folder / "source").mkdir()
        files = local_files(args.source)
        started = time.time()
        stories = {split: [s.strip() for _, p in files if _ == split for s in read_stories(p)] for split in ("train", "valid")}
        train = write_copies(stories["train"], folder / "source" / "train.txt", args.gigabytes * 1000)
        valid = write_copies(stories["valid"], folder / "source" / "valid.txt", args.gigabytes * 10)
        print(f"corpus: {train:,} train and {valid:,} valid stories, "
              f"{(folder / 'source' / 'train.txt').stat().st_size / 1e9:.2f} GB of train text "
              f"({time.time() - started:.0f} s), in {folder}")
        print(f"machine: {machine()}\n")
        print("| command | seconds | progress | peak memory |")
        print("| --- | --- | --- | --- |")
        data_steps = []
        for script, step_args, marker, meaning in STEPS:
            seconds, first, megabytes, lines = run(script, step_args, marker, folder)
            progress = f"{meaning} after {first:.0f} s" if first is not None else ""
            print(f"| `python {script} {' '.join(step_args)}` | {seconds:.0f} | {progress} | "
                  f"{megabytes / 1024:.2f} GB |", flush=True)
            if script == "data.py":  # its own steps' seconds, which it prints, for after the table
                data_steps = [line.strip() for line in lines if re.match(r"\w+: .*\(\d+\.\d s\)$", line.strip())]
        print("\ndata.py's steps:\n" + "\n".join(data_steps))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
