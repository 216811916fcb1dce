import os
import shutil
import time

import numpy as np
import pytest
import torch

import grpo
import ppo
import rl
from checkpoints import load_checkpoint
from model import TINY, GPT, Config


def stepped_losses(script, run_main, monkeypatch, args, stop_before=None):
    """The loss of every optimizer step of a run; with stop_before, the run is interrupted as
    that rollout (counted from 0 in this process) starts."""
    losses, rollouts = [], []
    real_step, real_rollout = script.optimizer_step, script.rollout

    def step(model, optimizer, loss, lr):
        losses.append(loss.item())
        return real_step(model, optimizer, loss, lr)

    def rollout(*args, **kwargs):
        if len(rollouts) == stop_before:
            raise KeyboardInterrupt
        rollouts.append(1)
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(script, "optimizer_step", step)
    monkeypatch.setattr(script, "rollout", rollout)
    try:
        run_main(script, *args)
    except KeyboardInterrupt:
        pass
    monkeypatch.setattr(script, "optimizer_step", real_step)
    monkeypatch.setattr(script, "rollout", real_rollout)
    return losses


# A run stopped in its fourth rollout and resumed from its checkpoint at rollout 2 takes the
# steps an uninterrupted run takes: the same stories, minibatches and weights, to the bit.
@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_a_resumed_run_steps_as_an_uninterrupted_run_does(script, workspace, run_main, quick, monkeypatch):
    quick(script)
    monkeypatch.setattr(rl, "EVAL_EVERY", 2)
    monkeypatch.setattr(script, "EVAL_EVERY", 2)
    args = ["--rollouts", "4", "--seed", "7", "--device", "cpu", "--precision", "fp32", "--lr", "3e-3"]
    folder = workspace / "checkpoints" / script.__name__ / "kl-0.05-lr-0.003-seed-7"  # the run's own
    whole = stepped_losses(script, run_main, monkeypatch, args)
    shutil.rmtree(folder)
    first = stepped_losses(script, run_main, monkeypatch, args, stop_before=3)
    then = stepped_losses(script, run_main, monkeypatch, args + ["--resume"])
    steps_a_rollout = len(whole) // 4
    assert len(then) == 2 * steps_a_rollout  # rollouts 3 and 4
    assert first[:2 * steps_a_rollout] + then == whole


def test_resume_refuses_a_rollout_checkpoint_of_another_tokenizer_or_shape(workspace, workspace_tokenizer,
                                                                          small_tokenizer, tmp_path):
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer = torch.optim.AdamW(policy.parameters())
    rng = np.random.default_rng(0)
    settings = {"script": "grpo.py"}
    rl.save_rollout(tmp_path / "other-tokenizer", 2, 0.0, policy, small_tokenizer, optimizer, rng, settings)
    with pytest.raises(SystemExit, match="another tokenizer"):
        rl.resume(tmp_path / "other-tokenizer", policy, optimizer, rng, workspace_tokenizer)
    wider = GPT(Config(vocab_size=policy.config.vocab_size, **{**TINY, "n_embd": 2 * TINY["n_embd"]}))
    rl.save_rollout(tmp_path / "other-shape", 2, 0.0, wider, workspace_tokenizer, torch.optim.AdamW(wider.parameters()),
                    rng, settings)
    with pytest.raises(SystemExit, match="another shape"):
        rl.resume(tmp_path / "other-shape", policy, optimizer, rng, workspace_tokenizer)


# A new run (without --resume) saves over an earlier run's rollout checkpoints only as far as
# it gets: interrupted at rollout 2, it leaves the earlier run's rollout-32.pt beside its own.
def test_resume_goes_on_from_the_checkpoint_saved_last_not_an_earlier_runs_higher_one(
        workspace, workspace_tokenizer, tmp_path):
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer = torch.optim.AdamW(policy.parameters())
    rng = np.random.default_rng(0)
    for rollout in (32, 0, 2):  # the earlier run's last, then the new run's two
        rl.save_rollout(tmp_path, rollout, 0.0, policy, workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / "rollout-32.pt", (an_hour_ago, an_hour_ago))
    assert rl.resume(tmp_path, policy, optimizer, rng, workspace_tokenizer)["made_by"]["rollout"] == 2
