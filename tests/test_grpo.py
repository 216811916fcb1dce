import inspect
import itertools
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_ppo import (each_pass_takes_every_story_once_in_a_new_order, first_minibatches, recording_the_logs,
                      recording_the_seeds, recording_the_update, rewards_printed, stories_that_end_at_different_steps)

import evaluate
import grpo
import ppo
import train
from checkpoints import read_checkpoint
from data import instruction
from tokenizer import encode_prompt

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


def test_the_gradient_is_that_of_the_loss_inside_the_clip_s_band_and_beyond_it():
    # Central differences in float64 against autograd: where the two sides of the clip's min
    # are equal (inside the band), the whole gradient must pass, not half of it.
    g = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in (6, 3, 5)], dtype=torch.float64)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    new = (old + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.15).requires_grad_()
    ref = old + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.2
    advantages = torch.tensor([1.2, -0.7, 0.4], dtype=torch.float64)
    loss_of = lambda new: grpo.grpo_loss(new, old, ref, advantages, mask, kl=0.05)[0]  # noqa: E731
    (got,) = torch.autograd.grad(loss_of(new), new)
    ratio = (new - old).exp().detach()
    assert ((ratio - 1).abs() < grpo.CLIP).sum() > 5 and ((ratio - 1).abs() > grpo.CLIP).sum() > 2  # both cases
    assert not ((ratio - 1).abs() - grpo.CLIP).abs().lt(1e-3).any()  # no ratio on the band's edge
    expected, h = torch.zeros_like(got), 1e-6
    for i, t in itertools.product(range(3), range(6)):
        step = torch.zeros_like(got)
        step[i, t] = h
        expected[i, t] = (loss_of(new.detach() + step) - loss_of(new.detach() - step)) / (2 * h)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)


def kl_gradient(ref, kl):
    """The gradient of the loss on one minibatch against new, for a given reference."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    new = (old + 0.1 * torch.randn(3, 4, generator=torch.Generator().manual_seed(2))).requires_grad_()
    loss, _ = grpo.grpo_loss(new, old, ref(old), torch.tensor([1.0, -1.0, 0.5]), mask, kl)
    loss.backward()
    return new.grad


def test_with_kl_weight_0_the_reference_does_not_change_the_gradient():
    further = lambda old: old + torch.randn(3, 4, generator=torch.Generator().manual_seed(3))  # noqa: E731
    assert torch.equal(kl_gradient(lambda old: old, 0.0), kl_gradient(further, 0.0))
    # With a weight, it does: the penalty pulls each token toward the reference.
    assert not torch.allclose(kl_gradient(lambda old: old, 0.05), kl_gradient(further, 0.05))


def test_the_penalty_s_gradient_is_that_of_the_k3_estimate():
    # With no advantages the objective is the penalty alone: kl (e^r - r - 1), r = log p_ref - log p,
    # whose gradient in log p is kl (1 - e^r), for each token, over its story's length and the stories.
    def ref(old):
        return old + torch.randn(3, 4, generator=torch.Generator().manual_seed(3)) * 0.5
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=g)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    new = (old + 0.1 * torch.randn(3, 4, generator=torch.Generator().manual_seed(2))).requires_grad_()
    loss, _ = grpo.grpo_loss(new, old, ref(old), torch.zeros(3), mask, kl=0.05)
    loss.backward()
    r = ref(old) - new.detach()
    expected = 0.05 * (1 - torch.exp(r)) * mask / mask.sum(dim=1, keepdim=True) / 3
    torch.testing.assert_close(new.grad, expected, rtol=1e-5, atol=1e-7)


def test_a_rollout_cuts_each_story_at_its_first_end_of_text_and_packs_its_tokens_alone(small_tokenizer,
                                                                                      monkeypatch):
    eot = small_tokenizer.eot
    words = ["kite", "river", "brave"]
    asks = [(encode_prompt(small_tokenizer, f"Story {i}."), words) for i in range(grpo.PROMPTS)]
    kite = small_tokenizer.encode(" a kite")
    # Row r of group g writes r + g % 3 tokens of a kite, then ends, and end-of-text after it.
    monkeypatch.setattr(grpo, "generate", stories_that_end_at_different_steps(kite, eot))
    policy = torch.nn.Linear(1, 1)  # on the CPU: the rollout reads its device from it
    prompts, stories, rewards = grpo.rollout(policy, small_tokenizer, asks, np.random.default_rng(0), seed=0)
    assert len(stories) == grpo.PROMPTS * grpo.GROUP
    # 16 groups of 16 different instructions: none is drawn twice, and each group asks one.
    groups = [prompts[g * grpo.GROUP:(g + 1) * grpo.GROUP] for g in range(grpo.PROMPTS)]
    assert all(group == group[:1] * grpo.GROUP for group in groups)
    assert len({tuple(group[0]) for group in groups}) == grpo.PROMPTS
    # Exactly the tokens written after each prompt, to the first end-of-text: not the prompt's last.
    assert stories == [(kite * 10)[:r + g % 3] + [eot] for g in range(grpo.PROMPTS) for r in range(grpo.GROUP)]
    lengths = {len(story) for story in stories}
    assert len(lengths) > 3  # the stories end at several steps
    for story, reward in zip(stories, rewards):
        assert story[-1] == eot and eot not in story[:-1]  # its first end-of-text, kept, and nothing after
        assert reward == evaluate.words_used(small_tokenizer.decode(story), words)
    _, _, mask = ppo.pack(prompts, stories, eot, "cpu")
    assert mask.sum(dim=1).tolist() == [len(story) for story in stories]


def test_a_short_run_writes_its_logs_checkpoints_and_final_model(workspace, run_main, quick, capsys, monkeypatch):
    quick(grpo)
    updates = recording_the_update(grpo, "grpo_loss", monkeypatch)
    seeds = recording_the_seeds(grpo, monkeypatch)
    run_main(grpo, "--rollouts", "12", "--kl", "0.05", "--lr", "3e-3", "--device", "cpu", "--precision", "fp32")
    out = capsys.readouterr().out
    rewards = rewards_printed(out)
    assert len(rewards) == 12 and sum(rewards[-3:]) > sum(rewards[:3]) + 0.15  # it learns the easy reward
    # Each rollout trains in EPOCHS passes over its 128 stories, a minibatch at a time.
    assert len(updates) == 12 * grpo.EPOCHS * (grpo.PROMPTS * grpo.GROUP // grpo.MINIBATCH)
    # Each rollout's first update, by the policy that wrote it: a ratio of exactly 1.
    for update in first_minibatches(updates, grpo.PROMPTS * grpo.GROUP):
        assert torch.equal(update["ratio"] * update["mask"], update["mask"])
    each_pass_takes_every_story_once_in_a_new_order(updates, grpo.PROMPTS * grpo.GROUP)
    assert len(set(seeds)) == 12  # each rollout draws its stories with random numbers of its own
    assert re.search(r"rollout 12: reward [0-9.]+, KL [0-9.]+, \d+ tied groups", out)
    folder = workspace / "checkpoints" / "grpo" / "kl-0.05-lr-0.003"
    assert {p.name for p in folder.iterdir()} == {"rollout-0.pt", "rollout-10.pt", "rollout-12.pt", "model.pt"}
    assert read_checkpoint(folder)["made_by"]["rollout"] == 12
    # AdamW with no weight decay: nothing pulls the policy's weights toward 0 but the rewards and the KL.
    groups = read_checkpoint(folder / "rollout-12.pt")["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.0]
    settings = read_checkpoint(folder)["made_by"]["settings"]
    assert settings["lr"] == 3e-3 and settings["kl"] == 0.05 and settings["script"] == "grpo.py"
    # The constants it ran with, its own and those it takes from PPO and rl.py, as they are.
    assert (settings["group"], settings["prompts"], settings["clip"], settings["epochs"], settings["eval_every"]) == (
        grpo.GROUP, grpo.PROMPTS, grpo.CLIP, grpo.EPOCHS, grpo.EVAL_EVERY)
    assert settings["grad_clip"] == train.CLIP  # optimizer_step's, from train.py
    assert any((workspace / "runs" / "grpo" / "kl-0.05-lr-0.003").glob("events.out.tfevents.*"))
    assert evaluate.model_name(folder) == "grpo-kl-0.05-lr-0.003"
    assert evaluate.model_name(workspace / "checkpoints" / "grpo" / "kl-0.05") == "grpo-kl-0.05"


def test_grpo_raises_the_words_used_reward_on_a_tiny_task(workspace_tokenizer, run_main, monkeypatch, capsys):
    """The real reward, evaluate.words_used on the decoded stories, where a tiny model can learn
    it in seconds: every instruction asks for three of four words that the workspace's tokenizer
    writes as one token each (with its space), so a story of 16 tokens can use them all."""
    tokenizer = workspace_tokenizer
    words = ["found", "happy", "look", "near"]
    assert all(len(tokenizer.encode(f" {word}")) == 1 for word in words)
    asks = {}
    for asked in itertools.permutations(words, 3):
        tokens = encode_prompt(tokenizer, instruction(asked))
        asks.setdefault(len(tokens), []).append((tokens, list(asked)))
    monkeypatch.setattr(grpo, "load_asks", lambda tokenizer: asks)
    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(evaluate, "MAX_NEW_TOKENS", 16)
    run_main(grpo, "--rollouts", "12", "--seed", "7", "--lr", "3e-3", "--device", "cpu", "--precision", "fp32")
    rewards = rewards_printed(capsys.readouterr().out)
    # From about 0.03 (the words by chance) to 0.2 and more, over seeds 0, 1, 2 and 7.
    assert len(rewards) == 12 and sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.08


def test_with_kl_weight_0_the_drift_is_still_measured(workspace, run_main, quick, monkeypatch):
    quick(grpo)
    logged = recording_the_logs(grpo, monkeypatch)
    run_main(grpo, "--rollouts", "3", "--kl", "0", "--device", "cpu", "--precision", "fp32", "--lr", "3e-3")
    drifts = [figures["kl"] for figures in logged]  # as logged to TensorBoard, not as printed
    assert len(drifts) == 3
    assert drifts[0] == 0.0 and drifts[-1] > 0.01  # the first rollout is the reference's own


def test_a_rollout_whose_groups_all_tie_logs_them_as_every_instruction(workspace, run_main, quick, monkeypatch,
                                                                         capsys):
    # One reward for every story: each of the 16 groups ties, so the share of groups with a
    # spread of 0 (TRL's frac_reward_zero_std) is 1, a share of the instructions, not of a group.
    quick(grpo)
    monkeypatch.setattr(grpo, "words_used", lambda story, words: 0.5)
    logged = recording_the_logs(grpo, monkeypatch)
    run_main(grpo, "--rollouts", "1", "--device", "cpu", "--precision", "fp32")
    (figures,) = logged
    assert figures["ties"] == grpo.PROMPTS and figures["frac_reward_zero_std"] == 1.0
    assert "rollout 1: reward 0.500, KL 0.00, 16 tied groups" in capsys.readouterr().out


@pytest.mark.parametrize("script", [ppo, grpo])
def test_the_logged_kl_is_the_k3_estimate_summed_over_a_story_s_tokens(script, workspace, run_main, quick,
                                                                         monkeypatch):
    # The reference made one nat likelier than the policy at every token, r = log ref - log old
    # = 1 in the first rollout (the policy is the reference there): each story token adds
    # e^r - r - 1 = e - 2 to its story's KL, where the other sign would add 1/e.
    quick(script)
    real_logprobs = script.token_logprobs

    def reference_one_nat_likelier(model, x, y, **options):
        logprobs = real_logprobs(model, x, y, **options)
        return logprobs if next(model.parameters()).requires_grad else logprobs + 1.0

    monkeypatch.setattr(script, "token_logprobs", reference_one_nat_likelier)
    logged = recording_the_logs(script, monkeypatch)
    run_main(script, "--rollouts", "1", "--device", "cpu", "--precision", "fp32")
    (figures,) = logged
    assert figures["kl"] == pytest.approx((math.e - 2) * figures["completions/mean_length"], rel=1e-5)


@pytest.mark.parametrize("script, loss_name", [(ppo, "ppo_loss"), (grpo, "grpo_loss")])
def test_the_loss_gets_the_writing_policy_s_log_probabilities_and_the_reference_s(script, loss_name, workspace,
                                                                                 run_main, quick, monkeypatch):
    # The reference made one nat likelier than the policy at every token: in the first rollout,
    # whose policy is the reference, every update's ref - old is 1 on the story tokens (the
    # KL measured from the reference, not from the policy that wrote the stories); and old is
    # held as the rollout's, so that the ratio moves from 1 once the policy has moved.
    quick(script)
    real_logprobs, real_loss, got = script.token_logprobs, getattr(script, loss_name), []

    def reference_one_nat_likelier(model, x, y, **options):
        logprobs = real_logprobs(model, x, y, **options)
        return logprobs if next(model.parameters()).requires_grad else logprobs + 1.0

    def loss(new, old, ref, advantages, mask, kl):
        policy_loss, ratio = real_loss(new, old, ref, advantages, mask, kl)
        got.append((ref - old, ratio.detach(), mask))
        return policy_loss, ratio

    monkeypatch.setattr(script, "token_logprobs", reference_one_nat_likelier)
    monkeypatch.setattr(script, loss_name, loss)
    run_main(script, "--rollouts", "1", "--lr", "3e-3", "--device", "cpu", "--precision", "fp32")
    assert all(torch.allclose(difference * mask, mask, atol=1e-5) for difference, _, mask in got)
    assert torch.equal(got[0][1] * got[0][2], got[0][2])
    assert any(not torch.allclose(ratio * mask, mask) for _, ratio, mask in got[1:])


@pytest.mark.parametrize("script", [ppo, grpo])
def test_a_rollout_writes_at_temperature_1_with_no_top_k(script, workspace, run_main, quick, monkeypatch):
    # The update compares each token's probability with the full distribution it was drawn from.
    quick(script)
    real_generate, options = script.generate, []

    def recording(*args, **kwargs):
        bound = inspect.signature(real_generate).bind(*args, **kwargs)
        bound.apply_defaults()
        options.append((bound.arguments["temperature"], bound.arguments["top_k"]))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(script, "generate", recording)
    run_main(script, "--rollouts", "1", "--device", "cpu", "--precision", "fp32")
    assert options == [(1.0, None)]


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
        run_main(grpo, "--rollouts", "4", "--seed", "5", "--device", "cpu", "--precision", "bf16")
    folder = workspace / "checkpoints" / "grpo" / "kl-0.05-seed-5"
    assert sorted(p.name for p in folder.iterdir()) == ["rollout-0.pt", "rollout-2.pt"]
    capsys.readouterr()

    monkeypatch.setattr(grpo, "rollout", real_rollout)
    updates = recording_the_update(grpo, "grpo_loss", monkeypatch)
    # In bfloat16, as the scripts run where it is faster: the update's first minibatch under
    # autocast still gives a ratio of exactly 1, after a resume too.
    run_main(grpo, "--rollouts", "4", "--seed", "5", "--resume", "--device", "cpu", "--precision", "bf16")
    out = capsys.readouterr().out
    assert "resuming" in out and "rollout 2," in out
    assert re.findall(r"rollout (\d+): reward", out) == ["3", "4"]
    assert read_checkpoint(folder)["made_by"]["rollout"] == 4
    for update in first_minibatches(updates, grpo.PROMPTS * grpo.GROUP):
        assert torch.equal(update["ratio"] * update["mask"], update["mask"])


# grpo.py as `python grpo.py ARGS` runs it, with stories of 16 tokens (sooner to its first
# checkpoint); with SLOW_SAVES set, each checkpoint is written half, then held there for
# seconds with a sign on disk, so that a kill can land inside a save.
LAUNCH = """
import io, os, sys, time
import torch
import sample
sample.MAX_NEW_TOKENS = 16
if os.environ.get("SLOW_SAVES"):
    real_save = torch.save

    def slow_save(obj, file, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        file.write(data[:len(data) // 2])
        file.flush()
        open(os.environ["SLOW_SAVES"], "w").close()
        time.sleep(30)
        file.write(data[len(data) // 2:])

    torch.save = slow_save
import grpo
import ppo
sys.argv = ["grpo.py", *sys.argv[1:]]
grpo.main()
"""


def start_grpo(folder, **environment):
    options = ["--minutes", "5", "--device", "cpu", "--precision", "fp32"]
    with open(folder / "errors.txt", "w") as errors:
        process = subprocess.Popen([sys.executable, "-c", LAUNCH, *options], cwd=folder, stdout=subprocess.DEVNULL,
                                   stderr=errors, env={**os.environ, "PYTHONPATH": str(REPOSITORY), **environment})
    process.cwd = folder
    return process


def wait_for(done, process, what, seconds=120):
    """Waits until done() while grpo.py runs; fails, with its errors, if it ends first."""
    deadline = time.time() + seconds
    while not done():
        if process.poll() is not None:
            pytest.fail(f"grpo.py ended before {what}:\n{(process.cwd / 'errors.txt').read_text()[-2000:]}")
        assert time.time() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.05)


def kill(process):
    assert process.poll() is None  # it was running when killed, not ended or crashed
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_run_killed_at_any_moment_leaves_every_checkpoint_loadable(workspace, tmp_path):
    """Kill -9 a real grpo.py run at a random moment after its first checkpoint, then a new run
    in the middle of writing its own over it; every checkpoint still loads, the first one whole."""
    shutil.copytree(workspace / "data", tmp_path / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", tmp_path / "checkpoints" / "finetune")
    folder = tmp_path / "checkpoints" / "grpo" / "kl-0.05"
    first = folder / "rollout-0.pt"

    process = start_grpo(tmp_path)
    wait_for(first.exists, process, "its first checkpoint")
    time.sleep(random.Random(0).uniform(0, 4))
    kill(process)
    saved = sorted(folder.glob("*.pt"))
    assert first in saved
    for checkpoint in saved:
        read_checkpoint(checkpoint)
    before = first.read_bytes()

    # A new run of the same folder saves its own rollout-0.pt over that one: killed halfway through.
    sign = tmp_path / "saving"
    process = start_grpo(tmp_path, SLOW_SAVES=str(sign))
    wait_for(sign.exists, process, "save")
    kill(process)
    halves = list(folder.glob(".rollout-0.pt.*.tmp"))
    assert len(halves) == 1 and 0 < halves[0].stat().st_size < len(before)  # the kill landed inside the save
    assert first.read_bytes() == before  # the checkpoint it was replacing, whole
    for checkpoint in (tmp_path / "checkpoints" / "grpo").rglob("*.pt"):
        read_checkpoint(checkpoint)
