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
a step the course saw interrupted runs again even though its output exists: pretraining, PPO
and GRPO go on from their last checkpoint (--resume), the others start over. So a course
longer than a sitting can be taken in several: stop it (Ctrl-C), run it again later.
"""
import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from checkpoints import CHECKPOINTS, RUNS, logged
from data import SEED
from devices import machine
from dpo import run_name as dpo_run_name
from evaluate import model_name, saved_name, spread, table
from files import DATA, atomic
from ppo import LR
from preferences import PAIRS
from rl import rollout_checkpoints, run_name
from sample import MAX_NEW_TOKENS

ROOT = Path(__file__).resolve().parent
REPORT = Path("report") / "README.md"
RECORD = RUNS / "course.json"  # each step's command and minutes, kept from one run of the course to the next
PLOTS = ROOT / "docs" / "img"  # where docs/plots.py draws
KL = 0.05  # the KL weight of PPO and of the first GRPO run; the second runs without the penalty
# Each training script's budget, as its options: steps and rollouts, so that any machine makes the
# same models, a faster one sooner. The minutes are only a cap, 2.4 to 5.7 times what each step
# took on the course's 2-core EPYC (results/README.md), so that only a machine more than twice
# as slow stops short (with a model that learned less).
# Pretraining: 2,322 steps, what `python train.py --minutes 60` made in bf16 on 2 cores of an AMD
# EPYC with fast bf16, and the model that fine-tuning's recipe was measured from (episode 3).
# Fine-tuning: its own 1,000 steps. DPO: 100 steps, ten to fourteen minutes on two CPU cores.
# GRPO: the video's rollouts in its ten minutes, 32 with the penalty and 36 without; PPO as many
# as GRPO with its penalty, to compare.
# The models are measured with three seeds of the held-out stories, as the docs do.
FULL = {"pretrain": ["--steps", "2322", "--minutes", "360"], "finetune": ["--minutes", "240"],
        "dpo": ["--steps", "100", "--minutes", "60"], "ppo": ["--rollouts", "32", "--minutes", "120"],
        "grpo": ["--rollouts", "32", "--minutes", "120"], "grpo-kl-0": ["--rollouts", "36", "--minutes", "120"],
        "instructions": 2000, "eval_seeds": 3}
LAST_ROLLOUTS = 5  # the end of an RL run, for its KL per story: the video's "over the last five rollouts"
# The GRPO episode's table, as the video reports it from its laptop (one run of each), beside ours.
VIDEO = """| model | words used | loss on plain stories | stories that end within 200 tokens | KL per story at the end |
| --- | --- | --- | --- | --- |
| fine-tuned | 27% | 2.38 | 48% | 0 |
| PPO, KL 0.05 | 45% | 2.48 | 30% | about 19 |
| GRPO, KL 0.05 (32 rollouts) | 50% | 2.46 | 42% | about 14 |
| GRPO, KL 0 (36 rollouts) | 58% | 2.56 | 8% | about 44 |"""
# Enough for each script to take some steps and save its model: the whole path works, though
# the models learn little. The loss on plain stories on 128 windows of them, not evaluate.py's default.
QUICK = {"pretrain": ["--minutes", "3"], "finetune": ["--minutes", "1.5"], "dpo": ["--minutes", "1"],
         "ppo": ["--minutes", "1"], "grpo": ["--minutes", "1"], "grpo-kl-0": ["--minutes", "1"],
         "instructions": 64, "valid_windows": 128}


@dataclass
class Step:
    name: str
    command: list  # a script of the series and its arguments
    output: Path = None  # the file that shows the step is done; None: the step runs every time
    made_from: Path = None  # the earlier step's output that this one is made from
    needs: str = None  # a module the step needs that requirements.txt doesn't install
    resumes_from: Callable = None  # folder -> the checkpoints there an interrupted run goes on from (--resume)


def training_seeds(count):
    """The series' seed, then 2, 3, ...: the seeds of the DPO, PPO and GRPO runs."""
    return [SEED, *range(2, count + 1)]


def seed_models(seed):
    """The folders of one training seed's DPO, PPO, GRPO and GRPO without KL, by each script's own naming."""
    rl_folder = lambda kl: run_name(SimpleNamespace(kl=kl, lr=LR, seed=seed), LR)  # noqa: E731
    return {"dpo": CHECKPOINTS / dpo_run_name(seed), "ppo": CHECKPOINTS / "ppo" / rl_folder(KL),
            "grpo": CHECKPOINTS / "grpo" / rl_folder(KL), "grpo-kl-0": CHECKPOINTS / "grpo" / rl_folder(0)}


def course(budget, seeds=1, source=None, device=None):
    """The steps in order, each script with its budget, each model measured once it is made."""
    source = ["--source", source] if source else []
    device = ["--device", device] if device else []
    # Episode 5's table, one model at a time, so that a model measured once isn't measured again.
    # The quick setting measures the loss on plain stories on fewer windows than evaluate.py's default.
    measure = ((["--seeds", str(budget["eval_seeds"])] if "eval_seeds" in budget else [])
               + (["--valid-windows", str(budget["valid_windows"])] if "valid_windows" in budget else []))

    def trained(name, command, folder, made_from):
        """A training step, then the evaluation of the model it made."""
        # Pretraining saves its model with its optimizer, PPO and GRPO each tenth rollout: they can go on.
        resumes_from = {"train.py": pretraining_checkpoint, "ppo.py": rollout_checkpoints,
                        "grpo.py": rollout_checkpoints}.get(command[0])
        return [Step(name, [*command, *device], final(folder), made_from, resumes_from=resumes_from),
                Step(f"evaluation of {model_name(folder)}", ["evaluate.py", str(folder), *measure, *device],
                     evaluation(folder), final(folder))]

    tokens, pretrained, finetuned = DATA / "valid.bin", CHECKPOINTS / "pretrain", CHECKPOINTS / "finetune"
    # Episode 1: the stories, the instruction sets, the tokenizer and the token files.
    steps = [Step("data", ["data.py", *source], tokens)]
    # Episodes 2 and 3: a model that writes stories, then one that is asked for words.
    steps += trained("pretraining", ["train.py", *budget["pretrain"]], pretrained, tokens)
    steps += trained("fine-tuning", ["finetune.py", *budget["finetune"]], finetuned, final(pretrained))
    # Episode 6: pairs of the fine-tuned model's own stories.
    steps.append(Step("preferences", ["preferences.py", "--instructions", str(budget["instructions"]), *device],
                      PAIRS, final(finetuned)))
    # Episodes 7, 8 and 16, one training seed after another: DPO on the pairs, then RL on the reward
    # itself, GRPO once more without the KL penalty, to see what it holds back.
    for seed in training_seeds(seeds):
        folders, named = seed_models(seed), ("" if seed == SEED else f", seed {seed}")
        seeded = [] if seed == SEED else ["--seed", str(seed)]
        steps += trained(f"DPO{named}", ["dpo.py", *budget["dpo"], *seeded], folders["dpo"], PAIRS)
        for script, kl, key in (("ppo.py", KL, "ppo"), ("grpo.py", KL, "grpo"), ("grpo.py", 0, "grpo-kl-0")):
            command = [script, *budget[key], "--kl", f"{kl:g}", *seeded]
            steps += trained(f"{script[:-3].upper()}, KL {kl:g}{named}", command, folders[key], final(finetuned))
    # The plots are drawn again every time, from whatever runs/ holds now: it takes seconds.
    steps.append(Step("plots", ["docs/plots.py", "--course", "--seeds", str(seeds)], needs="matplotlib"))
    return steps


def final(folder):
    """The final model of a run, in its checkpoint folder."""
    return folder / "model.pt"


def evaluation(model):
    """The file evaluate.py saves a model's figures and stories in."""
    return RUNS / "evaluate" / f"{saved_name(model)}.json"


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
    """Each step's command and minutes (None: started, never finished), from earlier runs of the course."""
    try:
        record = json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}
        if not isinstance(record, dict) or not all(map(recorded, record.values())):
            raise ValueError("not a command and its minutes for each step")
    except ValueError as error:
        raise SystemExit(f"{RECORD} is damaged ({error}); delete it, and python course.py takes each step whose "
                         "output is there as done, an interrupted one too (delete that output to run it again)")
    return record


def recorded(made):
    """Whether a step of the record holds its command and its minutes (None, or a number)."""
    return (isinstance(made, dict) and isinstance(made.get("command"), str)
            and "minutes" in made and (made["minutes"] is None or isinstance(made["minutes"], (int, float))))


def save_record(record):
    with atomic(RECORD) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def pretraining_checkpoint(folder):
    """Pretraining's checkpoint, if there is one: its model.pt holds the optimizer too."""
    path = folder / "model.pt"
    return [path] if path.exists() else []


def without_device(command):
    """A command as shown, without its --device: a checkpoint loads on any."""
    return re.sub(r" --device \S+", "", command)


def left_off(step, record):
    """The minutes an interrupted run of the step had spent up to its last checkpoint, if it
    can go on from it (--resume), else None. Only a run of the same command goes on, on any
    device (one begun by --quick would keep its small budget), and only a checkpoint saved
    since the course first started the step, and since the model it is made from was made,
    counts: an older one belongs to another run. A sitting that saved none adds no minutes:
    the next goes on from the checkpoint before it."""
    made = record.get(step.name)
    if not step.resumes_from or not made or made["minutes"] is not None:
        return None
    if without_device(made["command"]) != without_device(shown(step.command)):
        return None
    saved = [p.stat().st_mtime for p in step.resumes_from(step.output.parent)]
    if not saved or max(saved) < made.get("first_started", made["started"]):
        return None
    if step.made_from and step.made_from.exists() and max(saved) < step.made_from.stat().st_mtime:
        return None  # what the step is made from was made again since: the run would mix two models
    return made.get("before", 0.0) + max(0.0, max(saved) - made["started"]) / 60


def take(step, record):
    """Runs one step, with a record of it before (so an interruption shows) and after (its
    minutes: with those of the sittings it went on from, if it was interrupted)."""
    command, before = shown(step.command), left_off(step, record)
    if before is None:
        print(f"== {step.name}: {command}", flush=True)
        record[step.name] = {"command": command, "started": time.time(), "minutes": None}
    else:
        print(f"== {step.name}: going on from its last checkpoint, {before:.1f} minutes in: {command} --resume",
              flush=True)
        made = record[step.name]
        record[step.name] = {"command": command, "started": time.time(), "minutes": None, "before": before,
                             "first_started": made.get("first_started", made["started"]),
                             "sittings": made.get("sittings", 1) + 1}
    save_record(record)
    try:
        run(step.command if before is None else [*step.command, "--resume"])
    except subprocess.CalledProcessError as error:
        raise SystemExit(f"course.py: {step.name} stopped (exit {error.returncode}) in {command}; "
                         "once it is fixed, python course.py goes on from there")
    record[step.name]["minutes"] = (before or 0.0) + (time.time() - record[step.name]["started"]) / 60
    save_record(record)


def drawn_plots(record):
    """The images docs/plots.py drew for this course (docs/img holds the docs' own too)."""
    plots = record.get("plots")
    if not plots or plots["minutes"] is None:
        return []
    # A second's slack: a file's time can trail the clock by a few milliseconds.
    return sorted(p for p in PLOTS.glob("*.png") if p.stat().st_mtime >= plots["started"] - 1)


def model_rows(seeds):
    """The report's rows: each kind of model, and the folders of its training seeds."""
    by_seed = [seed_models(seed) for seed in training_seeds(seeds)]
    return {"pretrained": [CHECKPOINTS / "pretrain"], "fine-tuned": [CHECKPOINTS / "finetune"],
            "DPO": [m["dpo"] for m in by_seed], f"PPO, KL {KL:g}": [m["ppo"] for m in by_seed],
            f"GRPO, KL {KL:g}": [m["grpo"] for m in by_seed], "GRPO, KL 0": [m["grpo-kl-0"] for m in by_seed]}


def measured(folder):
    """evaluate.py's figures for a model, or None before it is measured."""
    path = evaluation(folder)
    if not path.exists():
        return None
    try:
        figures = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        figures = None
    if not isinstance(figures, dict):
        raise SystemExit(f"{path} is damaged; delete it, and python course.py measures {folder} again")
    return figures


def made(folder):
    """What a model's training took, as its checkpoint records it: its steps or rollouts."""
    made_by = (measured(folder) or {}).get("made_by", {})
    unit = next((unit for unit in ("rollout", "step") if unit in made_by), None)
    return f"{made_by[unit]:,} {unit}s" if unit else ""


def kl_at_the_end(folder, last=LAST_ROLLOUTS):
    """An RL run's KL from the fine-tuned model per story, over its last rollouts, from its
    TensorBoard log (runs/ppo/kl-0.05 for checkpoints/ppo/kl-0.05); None for other models."""
    run = RUNS / folder.relative_to(CHECKPOINTS)
    if folder.parent.name not in ("ppo", "grpo") or not run.exists():
        return None
    # Each rollout's latest point, up to the final model's last rollout, are this run's.
    latest = logged(run, "rollout/kl")
    final = (measured(folder) or {}).get("made_by", {}).get("rollout", max(latest, default=0))
    kl = [latest[rollout] for rollout in sorted(latest) if rollout <= final][-last:]
    return sum(kl) / len(kl) if kl else None


def summary(rows):
    """The table of models: for each, the mean over its training seeds and their range."""
    lines = [f"| model | training seeds | trained for | words used | loss on plain stories | stories that end within "
             f"{MAX_NEW_TOKENS} tokens | KL per story, last {LAST_ROLLOUTS} rollouts |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, folders in rows.items():
        results = [(folder, measured(folder)) for folder in folders if measured(folder)]
        if not results:
            continue
        words = [sum(r["words_used_by_seed"]) / len(r["words_used_by_seed"]) for _, r in results]
        kl = [k for k in (kl_at_the_end(folder) for folder, _ in results) if k is not None]
        lines.append(f"| {label} | {len(results)} | {', '.join(sorted({made(f) for f, _ in results}))} | "
                     f"{spread(words)} | {spread([r['valid_loss'] for _, r in results], '{:.2f}')} | "
                     f"{spread([r['ended'] for _, r in results])} | {spread(kl, '{:.1f}') if kl else ''} |")
    return "\n".join(lines)


def report(steps, record, seeds=1):
    """report/README.md: the machine, each step's minutes, the table of models (each a mean over
    its training seeds), the video's figures beside them, the plots and a story from each model."""
    lines = ["# The course, as it ran here", "", f"`{shown(sys.argv)}` on {machine()}.", "",
             "| step | command | minutes |", "| --- | --- | --- |"]
    for step in steps:
        made_here = record.get(step.name) or {}
        minutes = "not run by the course" if made_here.get("minutes") is None else f"{made_here['minutes']:.1f}"
        if made_here.get("sittings", 1) > 1:
            minutes += f", in {made_here['sittings']} sittings"
        lines.append(f"| {step.name} | `{made_here.get('command', shown(step.command))}` | {minutes} |")
    total = sum(record[step.name]["minutes"] or 0 for step in steps if step.name in record)
    lines.append(f"| in all | | {total:.1f} |")

    rows = model_rows(seeds)
    results = [r for folders in rows.values() for r in map(measured, folders) if r]
    held_out = max((r.get("seeds", 1) for r in results), default=1)
    lines += ["", "## The models", "", "Each figure is the mean over the training seeds, and in brackets their lowest "
              "and highest" + (f"; each model's words used is itself the mean over {held_out} seeds of the held-out "
                               "stories" if held_out > 1 else "") + ".", "", summary(rows)]
    lines += ["", "As the GRPO video reports them (its laptop, one run each):", "", VIDEO]
    lines += ["", "Each model on its own:", "", table(results)]

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
    parser.add_argument("--quick", action="store_true", help="small budgets: about 13 minutes on 2 CPU cores")
    parser.add_argument("--device", help="cpu, cuda or mps, for every script (default: the fastest there is)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="training seeds of DPO, PPO and GRPO, for the spread of each (default 1)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")

    steps = course(QUICK if args.quick else FULL, args.seeds, args.source, args.device)
    record = read_record()
    for step in steps:
        reason = why_skip(step, record)
        if reason:
            print(f"== {step.name}: skipped: {reason}")
        else:
            take(step, record)
    report(steps, record, args.seeds)
    print(f"the report is in {REPORT}")


if __name__ == "__main__":
    main()
