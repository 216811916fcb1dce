"""
The docs' plots, drawn from the TensorBoard logs under runs/ and evaluate.py's results in
runs/evaluate/ into docs/img/, and the table of the RL runs (episodes 8 and 16), printed.

    pip install matplotlib && python docs/plots.py
    python docs/plots.py rl-step-11-reward.png rl-step-11-heldout.png   # only these figures
    python docs/plots.py --course     # the course's figures (course.py draws them), from its runs

Each figure is drawn from the logs that runs/ holds now: naming figures leaves the others as
they are. Episode 16's step 8 (GRPO and PPO) and episode 7's step 5 (DPO), from episode 3's
step 11 model, write into the same folders as the other figures' runs: their figures are
drawn only when named (ONLY_WHEN_NAMED), and the others show whichever runs runs/ holds.
matplotlib is needed only here, to redraw the plots; the series itself doesn't use it.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import logged  # noqa: E402
from files import atomic  # noqa: E402

RUNS = Path("runs")
IMAGES = Path(__file__).parent / "img"
PLOTS = [
    # (run, file, title, y label, {tag: label})
    ("pretrain", "pretrain-loss.png", "Pretraining, 60 minutes on a 2-core CPU", "loss",
     {"loss/train": "train (one batch)", "loss/valid": "valid stories"}),
    ("finetune", "finetune-loss.png", "Fine-tuning on instructions, 20 minutes", "loss",
     {"loss/instructions": "held-back instructions (story tokens)", "loss/plain": "plain valid stories"}),
    ("dpo", "dpo-words.png", "DPO: share of the words used on the held-out instructions", "words used",
     {"words/heldout": "held-out instructions"}),
    ("dpo", "dpo-margin.png", "DPO: reward margin and accuracy on the training pairs", "",
     {"dpo/margin": "reward margin", "dpo/accuracy": "accuracy"}),
    ("ppo/kl-0.05", "ppo-curves.png", "PPO, KL 0.05: each rollout", "",
     {"rollout/reward": "reward (share of the words)", "rollout/value_loss": "critic's squared error",
      "rollout/clip_ratio/region": "tokens where the clip binds"}),
]
# The RL runs side by side, rollout by rollout: (file, title, y label, tag, {run: label}).
RL_RUNS = {"ppo/kl-0.05": "PPO, KL 0.05", "grpo/kl-0.05": "GRPO, KL 0.05", "grpo/kl-0.05-seed-1": "GRPO, KL 0.05, seed 1",
           "grpo/kl-0.05-seed-2": "GRPO, KL 0.05, seed 2", "grpo/kl-0": "GRPO, KL 0",
           "grpo/kl-0-seed-1": "GRPO, KL 0, seed 1", "grpo/kl-0.05-lr-1e-05": "GRPO, KL 0.05, lr 1e-5"}
# Episode 16, step 8: GRPO and PPO from episode 3's step 11 model.
STEP_11_RUNS = {"grpo/kl-0.05": "GRPO, KL 0.05", "grpo/kl-0.05-seed-2": "GRPO, KL 0.05, seed 2",
                "grpo/kl-0.05-seed-3": "GRPO, KL 0.05, seed 3", "ppo/kl-0.05": "PPO, KL 0.05",
                "ppo/kl-0.05-seed-2": "PPO, KL 0.05, seed 2"}
# Episode 7, step 5: DPO from the step 11 model, three orders of the pairs (dpo.py --seed).
DPO_STEP_11_RUNS = {"dpo": "seed 1337", "dpo-seed-2": "seed 2", "dpo-seed-3": "seed 3"}
# Figures drawn only when named, as their runs share folders with RL_RUNS' and the DPO figures'.
ONLY_WHEN_NAMED = (STEP_11_RUNS, DPO_STEP_11_RUNS)
COMPARISONS = [
    ("rl-reward.png", "The reward of each rollout (its own 16 or 128 instructions)", "share of the words",
     "rollout/reward", RL_RUNS),
    ("rl-kl.png", "KL from the fine-tuned model, per story", "KL per story", "rollout/kl", RL_RUNS),
    ("rl-heldout.png", "Words used on the 50 held-out instructions", "share of the words", "words/heldout", RL_RUNS),
    ("rl-step-11-reward.png", "From episode 3's step 11 model: the reward of each rollout", "share of the words",
     "rollout/reward", STEP_11_RUNS),
    ("rl-step-11-heldout.png", "From episode 3's step 11 model: words used on the 50 held-out instructions",
     "share of the words", "words/heldout", STEP_11_RUNS),
    ("dpo-step-11-words.png", "DPO from episode 3's step 11 model: words used on the held-out instructions",
     "share of the words", "words/heldout", DPO_STEP_11_RUNS),
    ("dpo-step-11-margin.png", "DPO from episode 3's step 11 model: reward margin on each batch of pairs",
     "reward margin", "dpo/margin", DPO_STEP_11_RUNS),
]


def scalars(run, tag):
    """A run's points of a tag, (steps, values), the latest of each step."""
    latest = logged(RUNS / run, tag)
    return sorted(latest), [latest[step] for step in sorted(latest)]


def save(figure, file):
    """The figure as docs/img/FILE, written whole or not at all."""
    with atomic(IMAGES / file) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
    print(f"wrote docs/img/{file}")


def draw(file, title, xlabel, ylabel, lines):
    """One plot: a line for each (steps, values, label) that has points; none, and the figure
    in docs/img/ is left as it is (a run that stopped before it logged leaves an empty folder)."""
    lines = [line for line in lines if line[0]]
    if not lines:
        print(f"nothing logged for {file} in runs/: skipping it")
        return
    figure, axes = plt.subplots(figsize=(7, 3.6))
    for steps, values, label in lines:
        axes.plot(steps, values, label=label, marker="o" if len(steps) < 40 else None, markersize=3)
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    save(figure, file)


# Episode 3, step 6: each fine-tuning recipe's models along the way (finetune.py --keep),
# measured by evaluate.py --seeds 3 and bench/instruction_probe.py: {run's folder: label}.
RECIPES = {"finetune": "default recipe", "finetune-swap-1": "--swap 1 (asked nouns swapped)"}
# Episode 3's step 7, the diagnostic: the first use of each asked word weighs 20 in the loss.
FIRST_USE = {"finetune-swap-1-first-use-20": "--swap 1 --first-use-weight 20",
             "finetune-first-use-20": "--first-use-weight 20"}

# Episode 3's step 8: each training story asked for more of its words (finetune.py --words N).
MORE_WORDS = {"finetune-words-8": "--words 8", "finetune-words-16": "--words 16",
              "finetune-words-24-steps-400": "--words 24", "finetune-words-24": "--words 24, 1,000 steps"}
# Episode 3's step 9: 24 words with half of each batch plain stories (--plain-share 0.5), 1,000 steps.
LARGER_REPLAY = {"finetune-words-24": "--words 24 (a quarter plain stories)",
                 "finetune-plain-0.5-words-24": "--words 24 --plain-share 0.5"}
# Episode 3's step 10: three eighths of each batch plain stories, between steps 8 and 9.
REPLAY_THREE_EIGHTHS = {"finetune-plain-0.375-words-24": "--words 24 --plain-share 0.375",
                        "finetune-plain-0.5-words-24": "--words 24 --plain-share 0.5"}


# Each figure of fine-tuning recipes: (file, {run's folder: label}).
FINETUNE_FIGURES = [("finetune-recipes.png", RECIPES), ("finetune-first-use.png", FIRST_USE),
                    ("finetune-more-words.png", MORE_WORDS), ("finetune-larger-replay.png", LARGER_REPLAY),
                    ("finetune-replay-three-eighths.png", REPLAY_THREE_EIGHTHS)]


def finetune_curves(recipes, file):
    """The words used on the held-out instructions (the mean of the seeds, and the lowest and
    highest), the probe's nats and the loss on plain stories, against fine-tuning steps, from
    runs/evaluate/RUN-step-N.json and runs/probe/RUN-step-N.json; step 0 is the pretrained model."""
    figure, (words, probe, loss) = plt.subplots(1, 3, figsize=(11, 3.4))
    drawn = 0
    for run, label in recipes.items():
        points = sorted(measured(run))
        if len(points) < 2:
            print(f"fewer than 2 steps of {run} measured in runs/evaluate: left out of {file}")
            continue
        drawn += 1
        steps, results, probes = zip(*points)
        seeds = [r["words_used_by_seed"] for r in results]
        mean = [sum(s) / len(s) for s in seeds]
        words.errorbar(steps, mean, yerr=[[m - min(s) for m, s in zip(mean, seeds)],
                                          [max(s) - m for m, s in zip(mean, seeds)]],
                       marker="o", markersize=3, capsize=3, label=label)
        probed = [(step, p["instruction_moves"]) for step, p in zip(steps, probes) if p]
        if probed:
            probe.plot(*zip(*probed), marker="o", markersize=3, label=label)
        loss.plot(steps, [r["valid_loss"] for r in results], marker="o", markersize=3, label=label)
    if not drawn:
        plt.close(figure)
        print(f"none of the runs of {file} measured: skipping it")
        return
    words.set(title="Words used, held-out instructions", xlabel="fine-tuning step", ylabel="share of the words")
    probe.set(title="The instruction moves a word by", xlabel="fine-tuning step", ylabel="nats")
    loss.set(title="Loss on plain valid stories", xlabel="fine-tuning step", ylabel="loss")
    for axes in (words, probe, loss):
        axes.grid(alpha=0.3)
    words.legend(fontsize=8)
    figure.tight_layout()
    save(figure, file)


def measured(run):
    """(step, evaluate.py's result, the probe's or None) for the pretrained model and each kept step of a run."""
    for path in (RUNS / "evaluate").glob("*.json"):
        step = re.fullmatch(rf"{re.escape(run)}-step-(\d+)", path.stem) or re.fullmatch(r"pretrain", path.stem)
        if step:
            probe = RUNS / "probe" / path.name
            yield (int(step.group(1)) if step.groups() else 0,
                   read_result(path, ("words_used_by_seed", "valid_loss"), "python evaluate.py"),
                   read_result(probe, ("instruction_moves",), "python bench/instruction_probe.py")
                   if probe.exists() else None)


def read_result(path, keys, command):
    """A model's saved figures, refused in one line if the file was cut or edited."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise SystemExit(f"{path} is damaged ({type(error).__name__}); measure the model again with {command}")
    if not isinstance(result, dict) or not set(keys) <= result.keys():
        raise SystemExit(f"{path} lacks {', '.join(keys)}; measure the model again with {command}")
    return result


# The course's figures (python course.py, any --seeds): its training curves, DPO's and each RL
# method's runs, each training seed a thin line and their mean on top.
COURSE_RL = {"ppo/kl-0.05": "PPO, KL 0.05", "grpo/kl-0.05": "GRPO, KL 0.05", "grpo/kl-0": "GRPO, KL 0"}
COURSE_FIGURES = ["course-training.png", "course-dpo.png", "course-rl.png"]


def with_its_seeds(run, seeds):
    """A run and its other training seeds' runs under runs/, as course.py --seeds names them:
    grpo/kl-0.05, grpo/kl-0.05-seed-2, ... up to seed `seeds`."""
    named = [run] + [f"{run}-seed-{seed}" for seed in range(2, seeds + 1)]
    return [name for name in named if (RUNS / name).exists()]


def panels(file, title, panels_of, groups):
    """A row of plots, one per (title, tag, x label); each of groups is (label, colour, runs): a
    run alone is a line, several runs (training seeds) a thin line each and their mean on top."""
    # A run that stopped before it logged leaves an empty folder: nothing of it to draw.
    groups = [(label, colour, [run for run in runs if any(scalars(run, tag)[0] for _, tag, _ in panels_of)])
              for label, colour, runs in groups]
    groups = [group for group in groups if group[2]]
    if not groups:
        print(f"nothing logged for {file} in runs/: skipping it")
        return
    figure, axes = plt.subplots(1, len(panels_of), figsize=(4.3 * len(panels_of), 3.5), squeeze=False)
    axes = axes[0]
    for axis, (panel_title, tag, xlabel) in zip(axes, panels_of):
        for label, colour, runs in groups:
            # A seed that stopped before it logged this tag is left out of this panel's mean
            # (none left: an empty line, which keeps the group's name in the legend).
            series = [points for points in (scalars(run, tag) for run in runs) if points[0]]
            if len(series) > 1:
                for steps, values in series:
                    axis.plot(steps, values, color=colour, alpha=0.3, linewidth=0.8)
                label = f"{label}, mean of {len(series)} seeds"
            steps, values = seeds_mean(series)
            axis.plot(steps, values, color=colour, linewidth=1.6, marker="o" if len(steps) < 15 else None,
                      markersize=3, label=label)
        axis.set(title=panel_title, xlabel=xlabel)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    save(figure, file)


def seeds_mean(series):
    """The mean of several runs' (steps, values), at the steps they all have: a seed that
    stopped early (its minutes ran out) ends the mean there, rather than bending it."""
    common = sorted(set.intersection(*(set(steps) for steps, _ in series))) if series else []
    by_step = [dict(zip(steps, values)) for steps, values in series]
    return common, [sum(run[step] for run in by_step) / len(by_step) for step in common]


def course_figures(files, seeds):
    """The course's figures, from its runs under runs/, `seeds` training seeds of each."""
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    training = [(label, colours[i], [run]) for i, (label, run) in enumerate((("pretraining", "pretrain"),
                                                                             ("fine-tuning", "finetune")))
                if (RUNS / run).exists()]
    if "course-training.png" in files:
        panels("course-training.png", "The course: pretraining, then fine-tuning",
               [("pretraining: loss on valid stories", "loss/valid", "step"),
                ("fine-tuning: held-back instructions", "loss/instructions", "step"),
                ("fine-tuning: plain valid stories", "loss/plain", "step")], training)
    dpo = with_its_seeds("dpo", seeds)
    if "course-dpo.png" in files:
        panels("course-dpo.png", "The course: DPO, each training seed and their mean",
               [("words used, held-out instructions", "words/heldout", "step"),
                ("reward margin on each batch of pairs", "dpo/margin", "step")],
               [("DPO", colours[2], dpo)])
    rl = [(label, colours[3 + i], with_its_seeds(run, seeds)) for i, (run, label) in enumerate(COURSE_RL.items())]
    if "course-rl.png" in files:
        panels("course-rl.png", "The course: PPO and GRPO, each training seed and their mean",
               [("reward of each rollout", "rollout/reward", "rollout"),
                ("KL from the fine-tuned model, per story", "rollout/kl", "rollout"),
                ("words used, held-out instructions", "words/heldout", "rollout")], rl)


def rl_table():
    """The RL runs in figures, printed as markdown: rollouts, the reward over the first and the
    last five rollouts, the KL per story over the last five, and the share of tied groups."""
    print("| run | rollouts | reward, first 5 | reward, last 5 | KL per story, last 5 | tied groups |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run, label in {**RL_RUNS, **STEP_11_RUNS}.items():
        if not (RUNS / run).exists():
            continue
        _, rewards = scalars(run, "rollout/reward")
        _, kl = scalars(run, "rollout/kl")
        if not rewards:  # a run folder made, no rollout logged yet
            continue
        _, ties = scalars(run, "rollout/frac_reward_zero_std")
        tied = f"{sum(ties) / len(ties):.0%}" if ties else "(no groups)"
        first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
        print(f"| {label} | {len(rewards)} | {first:.1%} | {last:.1%} | {statistics.fmean(kl[-5:]):.1f} | {tied} |")


def main():
    parser = argparse.ArgumentParser(description="Draw the docs' plots from the logs under runs/.")
    parser.add_argument("files", nargs="*", help="only these figures (rl-reward.png, ...); default: all the docs'")
    parser.add_argument("--course", action="store_true", help="the course's figures only: " + ", ".join(COURSE_FIGURES))
    parser.add_argument("--seeds", type=int, default=1, help="with --course: each run's training seeds (default 1)")
    args = parser.parse_args()
    files = args.files
    drawn = [file for file, *_ in COMPARISONS + [(file,) for _, file, *_ in PLOTS]]
    drawn += [file for file, _ in FINETUNE_FIGURES] + COURSE_FIGURES
    unknown = sorted(set(files) - set(drawn))
    if unknown:
        parser.error(f"no figure named {', '.join(unknown)}; the figures: {', '.join(drawn)}")
    course = args.course or bool(set(files) & set(COURSE_FIGURES))
    if course and set(files) - set(COURSE_FIGURES):
        parser.error(f"the course's figures ({', '.join(COURSE_FIGURES)}) are drawn apart from the others: "
                     "name them in a command of their own")
    # Only the course's runs have training seeds under runs/; a --seeds given elsewhere would change nothing.
    if args.seeds < 1 or (args.seeds > 1 and not course):
        parser.error("--seeds must be at least 1, and goes with the course's figures (--course, or one of them named)")
    IMAGES.mkdir(exist_ok=True)
    if course:
        course_figures(files or COURSE_FIGURES, args.seeds)
        return
    for file, title, ylabel, tag, runs in COMPARISONS:
        if (files and file not in files) or (not files and any(runs is named for named in ONLY_WHEN_NAMED)):
            continue
        lines = [(*scalars(run, tag), label) for run, label in runs.items() if (RUNS / run).exists()]
        if not lines:
            print(f"none of the runs of {file} in runs/: skipping it")
            continue
        draw(file, title, "rollout" if "/" in next(iter(runs)) else "step", ylabel, lines)
    for run, file, title, ylabel, tags in PLOTS:
        if files and file not in files:
            continue
        if not (RUNS / run).exists():
            print(f"no runs/{run}: skipping {file}")
            continue
        draw(file, title, "rollout" if "/" in run else "step", ylabel,
             [(*scalars(run, tag), label) for tag, label in tags.items()])
    for file, recipes in FINETUNE_FIGURES:
        if not files or file in files:
            finetune_curves(recipes, file)
    rl_table()


if __name__ == "__main__":
    main()
