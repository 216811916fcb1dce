"""
The docs' plots, drawn from the TensorBoard logs under runs/ and evaluate.py's results in
runs/evaluate/ into docs/img/, and the table of the RL runs (episodes 8 and 16), printed.

    pip install matplotlib && python docs/plots.py

matplotlib is needed only here, to redraw the plots; the series itself doesn't use it.
"""
import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

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
COMPARISONS = [
    ("rl-reward.png", "The reward of each rollout (its own 16 or 128 instructions)", "share of the words",
     "rollout/reward", RL_RUNS),
    ("rl-kl.png", "KL from the fine-tuned model, per story", "KL per story", "rollout/kl", RL_RUNS),
    ("rl-heldout.png", "Words used on the 50 held-out instructions", "share of the words", "words/heldout", RL_RUNS),
]


def scalars(run, tag):
    events = EventAccumulator(str(RUNS / run), size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
    return [p.step for p in points], [p.value for p in points]


def draw(file, title, xlabel, ylabel, lines):
    """One plot: a line for each (steps, values, label)."""
    figure, axes = plt.subplots(figsize=(7, 3.6))
    for steps, values, label in lines:
        axes.plot(steps, values, label=label, marker="o" if len(steps) < 40 else None, markersize=3)
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(IMAGES / file, dpi=110)
    plt.close(figure)
    print(f"wrote docs/img/{file}")


def finetune_curve():
    """Episode 3: the words used on the held-out instructions against fine-tuning steps, from
    `python evaluate.py checkpoints/pretrain checkpoints/finetune/step-*.pt --seeds 3`: the
    mean of the seeds, and the lowest and highest."""
    points = []
    for path in (RUNS / "evaluate").glob("*.json"):
        step = re.fullmatch(r"finetune-step-(\d+)", path.stem) or re.fullmatch(r"pretrain", path.stem)
        if step:
            result = json.loads(path.read_text())
            points.append((int(step.group(1)) if step.groups() else 0, result))
    if len(points) < 3:
        print("fewer than 3 fine-tuning steps measured in runs/evaluate: skipping finetune-words.png")
        return
    points.sort(key=lambda point: point[0])
    steps = [step for step, _ in points]
    seeds = [result["words_used_by_seed"] for _, result in points]
    figure, (words, loss) = plt.subplots(1, 2, figsize=(9, 3.4))
    mean = [sum(s) / len(s) for s in seeds]
    words.errorbar(steps, mean, yerr=[[m - min(s) for m, s in zip(mean, seeds)], [max(s) - m for m, s in zip(mean, seeds)]],
                   marker="o", markersize=3, capsize=3)
    words.set(title="Words used, held-out instructions", xlabel="fine-tuning step", ylabel="share of the words")
    # The losses only of the models measured on the same windows of plain stories as the steps
    # (the course measures the pretrained model on all of them, step 3 on 256).
    windows = points[-1][1]["valid_windows"]
    same = [(step, result["valid_loss"]) for step, result in points if result["valid_windows"] == windows]
    loss.plot(*zip(*same), marker="o", markersize=3)
    loss.set(title="Loss on plain valid stories", xlabel="fine-tuning step", ylabel="loss")
    for axes in (words, loss):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(IMAGES / "finetune-words.png", dpi=110)
    plt.close(figure)
    print("wrote docs/img/finetune-words.png")


def rl_table():
    """The RL runs in figures, printed as markdown: rollouts, the reward over the first and the
    last five rollouts, the KL per story over the last five, and the share of tied groups."""
    print("| run | rollouts | reward, first 5 | reward, last 5 | KL per story, last 5 | tied groups |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run, label in RL_RUNS.items():
        if not (RUNS / run).exists():
            continue
        _, rewards = scalars(run, "rollout/reward")
        _, kl = scalars(run, "rollout/kl")
        _, ties = scalars(run, "rollout/frac_reward_zero_std")
        tied = f"{sum(ties) / len(ties):.0%}" if ties else "(no groups)"
        print(f"| {label} | {len(rewards)} | {sum(rewards[:5]) / 5:.1%} | {sum(rewards[-5:]) / 5:.1%} | "
              f"{sum(kl[-5:]) / 5:.1f} | {tied} |")


def main():
    IMAGES.mkdir(exist_ok=True)
    for file, title, ylabel, tag, runs in COMPARISONS:
        lines = [(*scalars(run, tag), label) for run, label in runs.items() if (RUNS / run).exists()]
        if lines:
            draw(file, title, "rollout", ylabel, lines)
    for run, file, title, ylabel, tags in PLOTS:
        if not (RUNS / run).exists():
            print(f"no runs/{run}: skipping {file}")
            continue
        draw(file, title, "rollout" if "/" in run else "step", ylabel,
             [(*scalars(run, tag), label) for tag, label in tags.items()])
    finetune_curve()
    rl_table()


if __name__ == "__main__":
    main()
