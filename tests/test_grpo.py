import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import evaluate
import grpo
from model import read_checkpoint
from test_ppo import rewards_printed

REPOSITORY = Path(__file__).resolve().parents[1]


def test_advantages_of_each_untied_group_have_mean_0_and_unit_spread():
    rewards = torch.rand(16 * 8, generator=torch.Generator().manual_seed(0)).round(decimals=1)
    advantages, tied = grpo.group_advantages(rewards)
    groups = advantages.view(16, 8)
    assert not tied.any()
    assert torch.allclose(groups.mean(dim=1), torch.zeros(16), atol=1e-6)
    assert torch.allclose(groups.std(dim=1), torch.ones(16), atol=1e-3)  # the small number shaves a hair off
    # A story above its group's mean gets a positive advantage, one below it a negative one.
    means = rewards.view(16, 8).mean(dim=1, keepdim=True)
    assert torch.equal(groups > 0, rewards.view(16, 8) > means)


def test_tied_groups_get_exactly_zero_even_where_rounding_leaves_a_hair():
    # Eight equal rewards whose float32 mean is not exactly the reward: unmasked, the
    # advantages would be a hair off zero, divided by the small number.
    value = next(v for v in (1 / 3, 2 / 3, 0.1, 0.7, 0.3) if (torch.full((8,), v) - torch.full((8,), v).mean()).any())
    rewards = torch.cat([torch.full((8,), value), torch.zeros(8), torch.tensor([0, 1 / 3, 0, 0, 2 / 3, 0, 0, 1.0])])
    advantages, tied = grpo.group_advantages(rewards)
    assert tied.tolist() == [True, True, False]
    assert torch.all(advantages[:16] == 0)
    assert advantages[16:].abs().sum() > 0


def equation_3(new, old, ref, advantages, lengths, kl, clip=0.2):
    """DeepSeekMath's objective, negated, token by token in plain Python."""
    total = 0.0
    for i, length in enumerate(lengths):
        story = 0.0
        for t in range(length):
            ratio = torch.exp(new[i, t] - old[i, t]).item()
            a = advantages[i].item()
            r = (ref[i, t] - new[i, t]).item()
            story += min(ratio * a, max(min(ratio, 1 + clip), 1 - clip) * a) - kl * (torch.exp(torch.tensor(r)).item() - r - 1)
        total += story / length
    return -total / len(lengths)


def test_loss_is_deepseekmath_equation_3():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 2, 7, 3]
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths])
    old = -torch.rand(4, 7, generator=g) * 3
    new = old + torch.randn(4, 7, generator=g) * 0.3  # some ratios outside the clip's band
    ref = old + torch.randn(4, 7, generator=g) * 0.2
    advantages = torch.tensor([1.2, -0.7, 0.4, -1.5])
    loss, _ = grpo.grpo_loss(new * mask, old * mask, ref * mask, advantages, mask, kl=0.05)
    assert loss.item() == pytest.approx(equation_3(new, old, ref, advantages, lengths, kl=0.05), rel=1e-5)


def test_with_kl_weight_0_the_reference_does_not_change_the_gradient():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=g)
    mask = torch.ones(3, 4)
    advantages = torch.tensor([1.0, -1.0, 0.5])
    grads = []
    for ref in (old, old + torch.randn(3, 4, generator=g)):
        new = (old + 0.1 * torch.randn(3, 4, generator=torch.Generator().manual_seed(2))).requires_grad_()
        loss, _ = grpo.grpo_loss(new, old, ref, advantages, mask, kl=0.0)
        loss.backward()
        grads.append(new.grad)
    assert torch.equal(grads[0], grads[1])


def test_a_short_run_writes_its_logs_checkpoints_and_final_model(workspace, run_main, quick, capsys):
    quick(grpo)
    run_main(grpo, "--rollouts", "12", "--kl", "0.05", "--lr", "3e-3")
    out = capsys.readouterr().out
    rewards = rewards_printed(out)
    assert len(rewards) == 12 and sum(rewards[-3:]) > sum(rewards[:3]) + 0.15  # it learns the easy reward
    assert re.search(r"rollout 12: reward [0-9.]+, KL [0-9.]+, \d+ tied groups", out)
    folder = workspace / "checkpoints" / "grpo" / "kl-0.05-lr-0.003"
    assert {p.name for p in folder.iterdir()} == {"rollout-0.pt", "rollout-10.pt", "rollout-12.pt", "model.pt"}
    assert read_checkpoint(folder)["made_by"]["rollout"] == 12
    assert any((workspace / "runs" / "grpo" / "kl-0.05-lr-0.003").glob("events.out.tfevents.*"))
    assert evaluate.model_name(folder) == "grpo-kl-0.05-lr-0.003"
    assert evaluate.model_name(workspace / "checkpoints" / "grpo" / "kl-0.05") == "grpo-kl-0.05"


def test_with_kl_weight_0_the_drift_is_still_measured(workspace, run_main, quick, capsys):
    quick(grpo)
    run_main(grpo, "--rollouts", "3", "--kl", "0", "--precision", "fp32", "--lr", "3e-3")
    drifts = [float(d) for d in re.findall(r"KL ([0-9.]+)", capsys.readouterr().out)]
    assert drifts[0] == 0 and drifts[-1] > 0.01  # the first rollout is the reference's own


def test_an_interrupted_run_resumes_where_its_last_checkpoint_left_it(workspace, run_main, quick, monkeypatch,
                                                                     capsys):
    quick(grpo)
    monkeypatch.setattr(grpo, "EVAL_EVERY", 2)
    real_rollout, done = grpo.rollout, []

    def interrupted_in_the_fourth(*args, **kwargs):
        if len(done) == 3:
            raise KeyboardInterrupt
        done.append(1)
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(grpo, "rollout", interrupted_in_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_main(grpo, "--rollouts", "6", "--seed", "5")
    folder = workspace / "checkpoints" / "grpo" / "kl-0.05-seed-5"
    assert sorted(p.name for p in folder.iterdir()) == ["rollout-0.pt", "rollout-2.pt"]
    capsys.readouterr()

    monkeypatch.setattr(grpo, "rollout", real_rollout)
    run_main(grpo, "--rollouts", "6", "--seed", "5", "--resume")
    out = capsys.readouterr().out
    assert "resuming" in out and "rollout 2," in out
    assert re.findall(r"rollout (\d+): reward", out) == ["3", "4", "5", "6"]
    assert read_checkpoint(folder)["made_by"]["rollout"] == 6


def test_a_run_killed_at_any_moment_leaves_every_checkpoint_loadable(workspace, tmp_path):
    """Kill -9 a real grpo.py run at random moments; every checkpoint it wrote still loads."""
    shutil.copytree(workspace / "data", tmp_path / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", tmp_path / "checkpoints" / "finetune")
    rng = random.Random(0)
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    for _ in range(2):
        process = subprocess.Popen([sys.executable, str(REPOSITORY / "grpo.py"), "--minutes", "5"], cwd=tmp_path,
                                   env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(3, 8))
        process.send_signal(signal.SIGKILL)
        process.wait()
        for checkpoint in (tmp_path / "checkpoints" / "grpo").rglob("*.pt"):
            read_checkpoint(checkpoint)
