"""
A script's main() as the torchrun tests run it: no test can patch anything in the processes
torchrun starts, so they start this file, which patches the script, then runs it:

    torchrun --standalone --nproc_per_node 2 tests/launch.py grpo ARGS

The patches (patch(), which a test in one process applies with monkeypatch's setattr) are
those the tests make in one process (conftest.py's make_quick), and the tests' tiny model,
without dropout (two processes can't draw one process's dropout masks), for pretraining and
fine-tuning too. Environment variables the tests set:

- EVAL_EVERY: rollouts between PPO's and GRPO's checkpoints;
- STORIES_BY_PROMPT: each group (GRPO) or batch (PPO) of stories drawn with a seed of its own
  prompt's, so that one process and several, which split the rollout, write the same stories;
- SAVES: a file where each checkpoint saved is written down with the rank that saved it;
- RANKS: a folder where each process leaves its weights and optimizer at the end, to check
  that the processes never part ways.
"""
import functools
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import finetune  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
import rl  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from conftest import at_most_8_tokens, make_quick  # noqa: E402
from model import TINY, Config  # noqa: E402

SCRIPTS = {"train": train, "finetune": finetune, "ppo": ppo, "grpo": grpo}
RANK = os.environ.get("RANK", "0")


def tiny_config(vocab_size):
    return Config(vocab_size=vocab_size, **{**TINY, "dropout": 0.0})


def stories_by_prompt(policy, prompts, max_new_tokens, generator=None, **options):
    """sample.generate, each group of prompts written with a generator seeded by its own tokens."""
    return [sample.generate(policy, [group], max_new_tokens, **options,
                            generator=torch.Generator(group.device).manual_seed(int(group.sum())))[0]
            for group in prompts]


def patch(setattr, environment):
    setattr(train, "Config", tiny_config)
    demo_story = at_most_8_tokens(train.demo_story)
    for script in (train, finetune):
        setattr(script, "valid_loss", functools.partial(train.valid_loss, windows=16))
        setattr(script, "demo_story", demo_story)
    setattr(sample, "MAX_NEW_TOKENS", 16)
    for script in (ppo, grpo):
        make_quick(setattr, script)
        if "EVAL_EVERY" in environment:
            setattr(script, "EVAL_EVERY", int(environment["EVAL_EVERY"]))
        if environment.get("STORIES_BY_PROMPT"):
            setattr(script, "generate", stories_by_prompt)
    if "EVAL_EVERY" in environment:
        setattr(rl, "EVAL_EVERY", int(environment["EVAL_EVERY"]))


def saved(obj, file, *args, **kwargs):
    with open(os.environ["SAVES"], "a") as log:
        log.write(f"rank {RANK} saved {Path(file.name).name}\n")
    return real_save(obj, file, *args, **kwargs)


def update(model, optimizer, lr):
    last.update(model=model, optimizer=optimizer)
    return real_update(model, optimizer, lr)


if __name__ == "__main__":
    patch(setattr, os.environ)
    real_save = torch.save
    if "SAVES" in os.environ:
        torch.save = saved
    real_update, last = train.update, {}
    train.update = update
    name, *arguments = sys.argv[1:]
    sys.argv = [f"{name}.py", *arguments]
    SCRIPTS[name].main()
    if "RANKS" in os.environ and last:
        real_save({"model": last["model"].state_dict(), "optimizer": last["optimizer"].state_dict()},
                  Path(os.environ["RANKS"]) / f"rank-{RANK}.pt")
