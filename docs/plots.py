"""
The docs' plots, drawn from the TensorBoard logs under runs/ into docs/img/.

    pip install matplotlib && python docs/plots.py

matplotlib is needed only here, to redraw the plots; the series itself doesn't use it.
"""
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
]


def scalars(run, tag):
    events = EventAccumulator(str(RUNS / run), size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
    return [p.step for p in points], [p.value for p in points]


def main():
    IMAGES.mkdir(exist_ok=True)
    for run, file, title, ylabel, tags in PLOTS:
        if not (RUNS / run).exists():
            print(f"no runs/{run}: skipping {file}")
            continue
        figure, axes = plt.subplots(figsize=(7, 3.6))
        for tag, label in tags.items():
            steps, values = scalars(run, tag)
            axes.plot(steps, values, label=label, marker="o" if len(steps) < 40 else None, markersize=3)
        axes.set(title=title, xlabel="step", ylabel=ylabel)
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(IMAGES / file, dpi=110)
        plt.close(figure)
        print(f"wrote docs/img/{file}")


if __name__ == "__main__":
    main()
