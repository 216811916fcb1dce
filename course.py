"""
The whole course in one command: the data, pretraining, fine-tuning, preference pairs, DPO,
PPO, GRPO with and without its KL penalty, the table of models, the plots, and a report of
it all in report/README.md.

    python course.py                                       # downloads TinyStories (about 2.2 GB)
    python course.py --source ../shared/data/tinystories   # reads a local copy instead
    python course.py --quick                               # small budgets, to see the whole path work

Each step is one of the series' own commands, run in a new process, and timed. A step whose
output is already there, and newer than what it is made from, is skipped: running the course
again goes on where it stopped, and after a step's output is deleted, that step runs again
and so does each step made from it. The training scripts save their model along the way, so
a step the course saw interrupted runs again even though its output exists.
"""
import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import machine
from evaluate import model_name, table
from files import DATA, atomic
from model import CHECKPOINTS, RUNS
from preferences import PAIRS

ROOT = Path(__file__).resolve().parent
REPORT = Path("report") / "README.md"
RECORD = RUNS / "course.json"  # each step's command and minutes, kept from one run of the course to the next
PLOTS = ROOT / "docs" / "img"  # where docs/plots.py draws
KL = 0.05  # the KL weight of PPO and of the first GRPO run; the second runs without the penalty
PPO = CHECKPOINTS / "ppo" / f"kl-{KL:g}"
GRPO, GRPO_NO_KL = CHECKPOINTS / "grpo" / f"kl-{KL:g}", CHECKPOINTS / "grpo" / "kl-0"
MODELS = [CHECKPOINTS / "pretrain", CHECKPOINTS / "finetune", CHECKPOINTS / "dpo", PPO, GRPO, GRPO_NO_KL]
# Minutes for each training script, and how many training instructions make preference pairs.
# Fine-tuning takes its own budget, 1,000 steps (episode 3, step 11), in whatever minutes they take.
# The full setting measures each model with three seeds of the held-out stories, as the docs do.
FULL = {"pretrain": 60, "instructions": 2000, "dpo": 10, "ppo": 10, "grpo": 10, "seeds": 3}
# Enough for each script to take some steps and save its model: the whole path works, though
# the models learn little. The loss on plain stories on 128 windows of them, not all 1,266.
QUICK = {"pretrain": 3, "finetune": 1.5, "instructions": 64, "dpo": 1, "ppo": 1, "grpo": 1, "valid_windows": 128}


@dataclass
class Step:
    name: str
    command: list  # a script of the series and its arguments
    output: Path = None  # the file that shows the step is done; None: the step runs every time
    made_from: Path = None  # the earlier step's output that this one is made from
    needs: str = None  # a module the step needs that requirements.txt doesn't install


def course(budget, source=None, device=None):
    """The steps in order, each script with its budget."""
    source = ["--source", source] if source else []
    device = ["--device", device] if device else []

    def minutes(script):
        return ["--minutes", f"{budget[script]:g}"] if script in budget else []

    tokens, pretrained, finetuned = DATA / "valid.bin", final(CHECKPOINTS / "pretrain"), final(CHECKPOINTS / "finetune")
    steps = [
        # Episode 1: the stories, the instruction sets, the tokenizer and the token files.
        Step("data", ["data.py", *source], tokens),
        # Episodes 2 and 3: a model that writes stories, then one that is asked for words.
        Step("pretraining", ["train.py", *minutes("pretrain"), *device], pretrained, tokens),
        Step("fine-tuning", ["finetune.py", *minutes("finetune"), *device], finetuned, pretrained),
        # Episodes 6 and 7: pairs of the fine-tuned model's own stories, then DPO on them.
        Step("preferences", ["preferences.py", "--instructions", str(budget["instructions"]), *device],
             PAIRS, finetuned),
        Step("DPO", ["dpo.py", *minutes("dpo"), *device], final(CHECKPOINTS / "dpo"), PAIRS),
        # Episodes 8 and 16: RL on the reward itself; GRPO once more without the KL penalty, to see what it holds back.
        Step(f"PPO, KL {KL:g}", ["ppo.py", *minutes("ppo"), "--kl", f"{KL:g}", *device], final(PPO), finetuned),
        Step(f"GRPO, KL {KL:g}", ["grpo.py", *minutes("grpo"), "--kl", f"{KL:g}", *device], final(GRPO), finetuned),
        Step("GRPO, KL 0", ["grpo.py", *minutes("grpo"), "--kl", "0", *device], final(GRPO_NO_KL), finetuned),
    ]
    # Episode 5's table, one model at a time, so that a model measured once isn't measured again.
    # The quick setting measures the loss on plain stories on a sample of windows, not all of them.
    windows = ["--valid-windows", str(budget["valid_windows"])] if "valid_windows" in budget else []
    seeds = ["--seeds", str(budget["seeds"])] if "seeds" in budget else []
    steps += [Step(f"evaluation of {model_name(m)}", ["evaluate.py", str(m), *seeds, *windows, *device],
                   evaluation(m), final(m))
              for m in MODELS]
    # The plots are drawn again every time, from whatever runs/ holds now: it takes seconds.
    steps.append(Step("plots", ["docs/plots.py"], needs="matplotlib"))
    return steps


def final(folder):
    """The final model of a run, in its checkpoint folder."""
    return folder / "model.pt"


def evaluation(model):
    """The file evaluate.py saves a model's figures and stories in."""
    return RUNS / "evaluate" / f"{model_name(model)}.json"


def shown(command):
    return "python " + shlex.join(command)


def installed(module):
    return importlib.util.find_spec(module) is not None


def why_skip(step, record):
    """Why the step needn't run now, or None when it must."""
    if step.needs and not installed(step.needs):
        return f"{step.needs} is not installed (pip install {step.needs})"
    if step.output is None or not step.output.exists():
        return None
    if step.made_from and step.made_from.exists() and step.output.stat().st_mtime < step.made_from.stat().st_mtime:
        return None  # made from an older version of the earlier step's output
    made = record.get(step.name)
    if made and made["minutes"] is None:  # the course started the step, and it never finished
        return None
    if made and made["command"] != shown(step.command):
        return f"{step.output} exists, made by {made['command']}"
    return f"{step.output} exists"


def run(command):
    """A script of the series in a new process, with this Python; its output goes straight to the terminal."""
    subprocess.run([sys.executable, str(ROOT / command[0]), *command[1:]], check=True)


def read_record():
    return json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}


def save_record(record):
    with atomic(RECORD) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def take(step, record):
    """Runs one step, with a record of it before (so an interruption shows) and after (its minutes)."""
    command = shown(step.command)
    print(f"== {step.name}: {command}", flush=True)
    record[step.name] = {"command": command, "started": time.time(), "minutes": None}
    save_record(record)
    try:
        run(step.command)
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"course.py: {step.name} stopped (exit {error.returncode}) in {command}; "
                         "once it is fixed, python course.py goes on from there")
    record[step.name]["minutes"] = (time.time() - record[step.name]["started"]) / 60
    save_record(record)


def drawn_plots(record):
    """The images docs/plots.py drew for this course (docs/img holds the docs' own too)."""
    plots = record.get("plots")
    if not plots or plots["minutes"] is None:
        return []
    # A second's slack: a file's time can trail the clock by a few milliseconds.
    return sorted(p for p in PLOTS.glob("*.png") if p.stat().st_mtime >= plots["started"] - 1)


def report(steps, record):
    """report/README.md: the machine, each step's minutes, the table of models, the plots and a story from each."""
    lines = ["# The course, as it ran here", "", f"`{shown(sys.argv)}` on {machine()}.", "",
             "| step | command | minutes |", "| --- | --- | --- |"]
    for step in steps:
        made = record.get(step.name) or {}
        minutes = "not run by the course" if made.get("minutes") is None else f"{made['minutes']:.1f}"
        lines.append(f"| {step.name} | `{made.get('command', shown(step.command))}` | {minutes} |")
    total = sum(record[step.name]["minutes"] or 0 for step in steps if step.name in record)
    lines.append(f"| in all | | {total:.1f} |")

    results = [json.loads(evaluation(m).read_text(encoding="utf-8")) for m in MODELS if evaluation(m).exists()]
    lines += ["", "## The models", "", table(results)]

    lines += ["", "## Plots", ""]
    images = drawn_plots(record)
    lines += [f"![{p.stem}]({Path(os.path.relpath(p, REPORT.parent)).as_posix()})" for p in images]
    if not images:
        lines.append("None drawn: `pip install matplotlib`, then `python course.py` again.")

    if results:
        words = results[0]["stories"][0]["words"]
        lines += ["", "## A story from each model", "", f"For the first held-out instruction: {', '.join(words)}.", ""]
        for r in results:
            story = r["stories"][0]
            lines += [f"**{r['model']}** ({story['words_used']:.0%} of the words):", ""]
            lines += [f"> {line}".rstrip() for line in story["story"].strip().splitlines()] + [""]

    with atomic(REPORT) as tmp:
        tmp.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")


def main():
    parser = argparse.ArgumentParser(description="The whole course, step by step, then a report in report/README.md.")
    parser.add_argument("--source", help="a local copy of TinyStories for data.py (default: download it)")
    parser.add_argument("--quick", action="store_true", help="small budgets: 14 to 18 minutes on 2 CPU cores")
    parser.add_argument("--device", help="cpu, cuda or mps, for every script (default: the fastest there is)")
    args = parser.parse_args()

    steps = course(QUICK if args.quick else FULL, args.source, args.device)
    record = read_record()
    for step in steps:
        reason = why_skip(step, record)
        if reason:
            print(f"== {step.name}: skipped: {reason}")
        else:
            take(step, record)
    report(steps, record)
    print(f"the report is in {REPORT}")


if __name__ == "__main__":
    main()
