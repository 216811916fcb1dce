import json
import os
import shutil
import time
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import devices
import grpo
import ppo
import rl
from checkpoints import load_checkpoint, logged, read_checkpoint, save_checkpoint
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
    run = workspace / "runs" / script.__name__ / folder.name
    shutil.rmtree(run, ignore_errors=True)  # an earlier test's run of these options
    whole = stepped_losses(script, run_main, monkeypatch, args)
    shutil.rmtree(folder)
    first = stepped_losses(script, run_main, monkeypatch, args, stop_before=3)
    then = stepped_losses(script, run_main, monkeypatch, args + ["--resume"])
    steps_a_rollout = len(whole) // 4
    assert len(then) == 2 * steps_a_rollout  # rollouts 3 and 4
    assert first[:2 * steps_a_rollout] + then == whole
    # Its log, too: the new run moved the uninterrupted run's aside, and the resumed one wrote on beside its own.
    [kept] = [path for path in run.iterdir() if path.is_dir()]
    assert logged(run, "rollout/reward") == logged(kept, "rollout/reward")
    assert list(logged(run, "rollout/reward")) == [1, 2, 3, 4]


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_a_resumed_run_keeps_the_precision_it_started_with(script, workspace, run_main, quick, monkeypatch, capsys):
    quick(script)
    monkeypatch.setattr(rl, "EVAL_EVERY", 1)
    monkeypatch.setattr(script, "EVAL_EVERY", 1)
    args = ["--rollouts", "2", "--seed", "11", "--device", "cpu", "--lr", "3e-3"]
    folder = workspace / "checkpoints" / script.__name__ / "kl-0.05-lr-0.003-seed-11"  # the run's own
    monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: 2.1)
    stepped_losses(script, run_main, monkeypatch, args, stop_before=1)  # stopped after its rollout-1 checkpoint
    # Timed again, the CPU would now pick fp32 (a busy moment, say): the run keeps its bf16.
    monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: 1.2)
    capsys.readouterr()
    multiplied_in, real_autocast = set(), script.autocast
    monkeypatch.setattr(script, "autocast", lambda device, precision: multiplied_in.add(precision)
                        or real_autocast(device, precision))
    stepped_losses(script, run_main, monkeypatch, args + ["--resume"])
    assert multiplied_in == {"bf16"}  # what it trained in
    assert read_checkpoint(folder)["made_by"]["settings"]["precision"] == "bf16"  # what it says it trained in
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [settings["precision"] for settings in printed] == ["bf16"]


# A run that has ended, resumed (with the same budget), measured its last rollout already.
@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_a_resumed_run_that_had_ended_is_not_measured_again(script, workspace, run_main, quick, monkeypatch):
    quick(script)
    monkeypatch.setattr(rl, "EVAL_EVERY", 2)
    monkeypatch.setattr(script, "EVAL_EVERY", 2)
    args = ["--rollouts", "3", "--seed", "13", "--device", "cpu", "--precision", "fp32"]
    measured, real_evaluate = [], script.evaluate
    monkeypatch.setattr(script, "evaluate", lambda *given, **options: measured.append(given[4])
                        or real_evaluate(*given, **options))
    run_main(script, *args)
    assert measured == [0, 2, 3]
    run_main(script, *args, "--resume")
    assert measured == [0, 2, 3]
    folder = workspace / "checkpoints" / script.__name__ / "kl-0.05-seed-13"
    assert read_checkpoint(folder)["made_by"]["rollout"] == 3


def test_resume_reads_the_rollout_checkpoint_once(workspace, workspace_tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no checkpoints/finetune here for the rollout to be compared with
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer, rng = torch.optim.AdamW(policy.parameters()), np.random.default_rng(0)
    rl.save_rollout(tmp_path / "run", 2, 0.0, policy, workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(args) or real_load(*args, **kwargs))
    assert rl.resume(tmp_path / "run", policy, optimizer, rng, workspace_tokenizer)["made_by"]["rollout"] == 2
    assert len(loads) == 1


def test_resume_refuses_a_run_whose_fine_tuned_model_was_made_again_since(workspace, workspace_tokenizer, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer, rng = torch.optim.AdamW(policy.parameters()), np.random.default_rng(0)
    save_checkpoint(tmp_path / "checkpoints" / "finetune", policy, workspace_tokenizer, {"script": "finetune.py"})
    folder = tmp_path / "checkpoints" / "grpo" / "kl-0.05"
    for rollout in (0, 2):
        rl.save_rollout(folder, rollout, 0.0, policy, workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    # The files' times set apart, as two saves in a row can share a clock tick: the run began at
    # `began` (rollout 0), its last checkpoint ten seconds later.
    began = time.time() - 100
    os.utime(folder / "rollout-0.pt", (began, began))
    os.utime(folder / "rollout-2.pt", (began + 10, began + 10))
    fine_tuned = tmp_path / "checkpoints" / "finetune" / "model.pt"
    os.utime(fine_tuned, (began - 1, began - 1))
    assert rl.resume(folder, policy, optimizer, rng, workspace_tokenizer)["made_by"]["rollout"] == 2
    # Fine-tuned again while the run went on: the rollouts after it would be measured from another model.
    os.utime(fine_tuned, (began + 5, began + 5))
    with pytest.raises(SystemExit, match="was made again after .*; start the run without --resume"):
        rl.resume(folder, policy, optimizer, rng, workspace_tokenizer)


def test_resume_refuses_a_rollout_checkpoint_of_another_tokenizer_or_shape(workspace, workspace_tokenizer,
                                                                          small_tokenizer, tmp_path):
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer = torch.optim.AdamW(policy.parameters())
    rng = np.random.default_rng(0)
    settings = {"script": "grpo.py"}
    rl.save_rollout(tmp_path / "other-tokenizer", 2, 0.0, policy, small_tokenizer, optimizer, rng, settings)
    with pytest.raises(SystemExit, match="another tokenizer .*; start the run without --resume"):
        rl.resume(tmp_path / "other-tokenizer", policy, optimizer, rng, workspace_tokenizer)
    wider = GPT(Config(vocab_size=policy.config.vocab_size, **{**TINY, "n_embd": 2 * TINY["n_embd"]}))
    rl.save_rollout(tmp_path / "other-shape", 2, 0.0, wider, workspace_tokenizer, torch.optim.AdamW(wider.parameters()),
                    rng, settings)
    with pytest.raises(SystemExit, match="another shape"):
        rl.resume(tmp_path / "other-shape", policy, optimizer, rng, workspace_tokenizer)
    # PPO's checkpoint in a GRPO run's folder: its optimizer holds the critic's weights too.
    critic = torch.nn.Linear(policy.config.n_embd, 1)
    both = torch.optim.AdamW([*policy.parameters(), *critic.parameters()])
    rl.save_rollout(tmp_path / "ppo-s", 2, 0.0, policy, workspace_tokenizer, both, rng, {"script": "ppo.py"})
    with pytest.raises(SystemExit, match="holds an optimizer state that does not fit .*; start the run"):
        rl.resume(tmp_path / "ppo-s", policy, optimizer, rng, workspace_tokenizer)
    # Weights that don't fit their own config: the advice is the resume's, not the command that makes the file.
    checkpoint = read_checkpoint(tmp_path / "other-shape" / "rollout-2.pt")
    checkpoint["config"] = asdict(policy.config)
    torch.save(checkpoint, tmp_path / "other-shape" / "rollout-2.pt")
    with pytest.raises(SystemExit, match="does not match the model it describes .*; start the run without --resume$"):
        rl.resume(tmp_path / "other-shape", policy, optimizer, rng, workspace_tokenizer)
    # A final model copied in under a rollout's name: no optimizer, no random state; refused
    # before its weights reach the policy.
    other = GPT(policy.config)
    save_checkpoint(tmp_path / "a-model" / "rollout-3.pt", other, workspace_tokenizer, {"script": "grpo.py"})
    before = {name: weight.clone() for name, weight in policy.state_dict().items()}
    with pytest.raises(SystemExit, match="is not a rollout checkpoint"):
        rl.resume(tmp_path / "a-model", policy, optimizer, rng, workspace_tokenizer)
    assert all(torch.equal(weight, before[name]) for name, weight in policy.state_dict().items())
    # A rollout checkpoint without its random state, or whose optimizer state is damaged.
    rl.save_rollout(tmp_path / "no-random", 2, 0.0, policy, workspace_tokenizer, optimizer, rng, settings)
    checkpoint = read_checkpoint(tmp_path / "no-random" / "rollout-2.pt")
    torch.save({key: value for key, value in checkpoint.items() if key != "numpy_random"},
               tmp_path / "no-random" / "rollout-2.pt")
    with pytest.raises(SystemExit, match="is not a rollout checkpoint"):
        rl.resume(tmp_path / "no-random", policy, optimizer, rng, workspace_tokenizer)
    (tmp_path / "damaged").mkdir()
    torch.save({**checkpoint, "optimizer": {"state": {}}}, tmp_path / "damaged" / "rollout-2.pt")
    with pytest.raises(SystemExit, match="holds an optimizer state that does not fit this run .damaged"):
        rl.resume(tmp_path / "damaged", policy, optimizer, rng, workspace_tokenizer)


@pytest.mark.parametrize("key, damaged, what", [
    ("numpy_random", {"bit_generator": "PCG64", "state": {"state": 1}}, "a NumPy random state"),
    ("numpy_random", {"bit_generator": "MT19937", "state": {}}, "a NumPy random state"),
    ("torch_random", torch.zeros(3, dtype=torch.uint8), "a torch random state"),
    ("critic", {"weight": torch.zeros(1, 3)}, "a critic"),
    ("critic", {"weight": torch.zeros(1, TINY["n_embd"])}, "a critic"),  # of the right shape, but no bias
    ("critic", None, "no critic"),
    ("optimizer", {"state": {}}, "an optimizer state"),
])
def test_resume_refuses_a_damaged_random_state_or_module_before_anything_loads(workspace, workspace_tokenizer,
                                                                             tmp_path, key, damaged, what):
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    critic = torch.nn.Linear(policy.config.n_embd, 1)
    optimizer, rng = torch.optim.AdamW([*policy.parameters(), *critic.parameters()]), np.random.default_rng(0)
    rl.save_rollout(tmp_path, 2, 0.0, GPT(policy.config), workspace_tokenizer, optimizer, rng, {"script": "ppo.py"},
                    critic=torch.nn.Linear(policy.config.n_embd, 1).state_dict())
    checkpoint = read_checkpoint(tmp_path / "rollout-2.pt")
    torch.save({k: v for k, v in {**checkpoint, key: damaged}.items() if v is not None}, tmp_path / "rollout-2.pt")
    before = [{name: weight.clone() for name, weight in module.state_dict().items()} for module in (policy, critic)]
    rng.random()  # its state now other than the checkpoint's
    drawn_before = rng.bit_generator.state
    with pytest.raises(SystemExit, match=f"{what}.*; start the run without --resume$"):
        rl.resume(tmp_path, policy, optimizer, rng, workspace_tokenizer, critic=critic)
    assert all(torch.equal(weight, weights[name]) for module, weights in zip((policy, critic), before)
               for name, weight in module.state_dict().items())
    assert rng.bit_generator.state == drawn_before


@pytest.mark.parametrize("damage", [lambda made_by: made_by.pop("seconds"), lambda made_by: made_by.pop("settings"),
                                    lambda made_by: made_by.update(rollout="2")])
def test_resume_refuses_a_checkpoint_that_does_not_say_where_its_run_stood(workspace, workspace_tokenizer, tmp_path,
                                                                         damage):
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer, rng = torch.optim.AdamW(policy.parameters()), np.random.default_rng(0)
    rl.save_rollout(tmp_path, 2, 30.0, GPT(policy.config), workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    checkpoint = read_checkpoint(tmp_path / "rollout-2.pt")
    damage(checkpoint["made_by"])
    torch.save(checkpoint, tmp_path / "rollout-2.pt")
    before = {name: weight.clone() for name, weight in policy.state_dict().items()}
    with pytest.raises(SystemExit, match="does not say its rollout, seconds and settings; start the run without"):
        rl.resume(tmp_path, policy, optimizer, rng, workspace_tokenizer)
    assert all(torch.equal(weight, before[name]) for name, weight in policy.state_dict().items())


def test_resume_goes_on_from_the_highest_rollout_by_number(workspace, workspace_tokenizer, tmp_path):
    # rollout-10.pt comes after rollout-9.pt, though not in the alphabet.
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer, rng = torch.optim.AdamW(policy.parameters()), np.random.default_rng(0)
    for rollout in (9, 10):
        rl.save_rollout(tmp_path, rollout, 0.0, policy, workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    # A copy under another name is not one of the run's checkpoints.
    shutil.copy(tmp_path / "rollout-9.pt", tmp_path / "rollout-9 (copy).pt")
    assert rl.resume(tmp_path, policy, optimizer, rng, workspace_tokenizer)["made_by"]["rollout"] == 10
    # Nor does a new run remove it, with the earlier run's later checkpoints.
    rl.save_rollout(tmp_path, 0, 0.0, policy, workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rollout-0.pt", "rollout-9 (copy).pt"]


def test_the_stories_figures_are_their_mean_length_the_share_cut_short_and_the_entropy_per_token():
    # Three stories (end-of-text is 0): the first ends, the other two are cut at the limit.
    old = torch.tensor([[-1.0, -3.0], [-2.0, 0.0], [-2.0, 0.0]])  # log p of each drawn token
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    figures = rl.rollout_stats([[5, 0], [5], [6]], old, mask, eot=0)
    assert figures["completions/mean_length"] == pytest.approx(4 / 3)
    assert figures["completions/clipped_ratio"] == pytest.approx(2 / 3)
    assert figures["entropy"] == pytest.approx((1 + 3 + 2 + 2) / 4)  # the mean of -log p over the story tokens


# An earlier run's rollout checkpoints, left in the folder of a new run, would be what a later
# --resume of the new run went on from (it takes the highest rollout).
def test_a_new_run_replaces_an_earlier_runs_checkpoints_once_it_has_saved_its_first(workspace, run_main, quick,
                                                                                    monkeypatch, capsys):
    quick(grpo)
    monkeypatch.setattr(rl, "EVAL_EVERY", 2)
    monkeypatch.setattr(grpo, "EVAL_EVERY", 2)
    folder = workspace / "checkpoints" / "grpo" / "kl-0.05-lr-0.003-seed-8"
    folder.mkdir(parents=True, exist_ok=True)
    earlier = {rollout: folder / f"rollout-{rollout}.pt" for rollout in (0, 10, 32)}
    args = ["--rollouts", "2", "--seed", "8", "--device", "cpu", "--precision", "fp32", "--lr", "3e-3"]
    for checkpoint in earlier.values():
        checkpoint.write_bytes(b"an earlier run's")
    # Stopped in its first evaluation, before it saved anything: the earlier run is left whole.
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    real_evaluate = grpo.evaluate
    monkeypatch.setattr(grpo, "evaluate", stopped)
    with pytest.raises(KeyboardInterrupt):
        run_main(grpo, *args)
    assert all(checkpoint.read_bytes() == b"an earlier run's" for checkpoint in earlier.values())
    monkeypatch.setattr(grpo, "evaluate", real_evaluate)
    run_main(grpo, *args)
    assert sorted(p.name for p in folder.glob("rollout-*.pt")) == ["rollout-0.pt", "rollout-2.pt"]
    assert "the earlier run's later rollout checkpoints removed (2)" in capsys.readouterr().out


def test_a_run_is_named_after_each_option_that_differs_from_its_default():
    def run(**options):
        return rl.run_name(SimpleNamespace(**{"kl": 0.05, "lr": ppo.LR, "seed": rl.SEED, **options}), ppo.LR)
    assert run() == "kl-0.05" and run(kl=0) == "kl-0"
    assert run(lr=ppo.LR / 10) == f"kl-0.05-lr-{ppo.LR / 10:g}" and run(lr=ppo.LR * 10) == f"kl-0.05-lr-{ppo.LR * 10:g}"
    assert run(seed=2) == "kl-0.05-seed-2"


def test_the_clip_binds_only_past_the_band_in_the_advantage_s_direction():
    # Past the band, on its edges (float64: exactly 1 - 0.2 and 1 + 0.2) and inside it, with an
    # advantage of each sign: only two of the eight bind.
    ratio = torch.tensor([[0.7, 0.8, 0.7, 1.3, 1.2, 1.3, 0.9, 1.1]], dtype=torch.float64)
    advantages = torch.tensor([[-1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    stats = rl.clip_stats(ratio, advantages, torch.ones(1, 8, dtype=torch.float64), 0.2)
    assert stats["clip_ratio/low"] == pytest.approx(1 / 8) and stats["clip_ratio/high"] == pytest.approx(1 / 8)


class SimpleWriter:
    """Stands in for TensorBoard's writer: each scalar as (tag, value, step)."""

    def __init__(self, logged):
        self.logged = logged

    def add_scalar(self, tag, value, step):
        self.logged.append((tag, value, step))


def test_a_rollout_s_figures_are_logged_under_rollout(capsys):
    # course.py and docs/plots.py read them there (rollout/kl, rollout/reward).
    logged = []
    rl.log_rollout(SimpleWriter(logged), 3, {"reward": 0.5, "kl": 1.0}, "reward 0.500")
    assert logged == [("rollout/reward", 0.5, 3), ("rollout/kl", 1.0, 3)]
    assert capsys.readouterr().out == "rollout 3: reward 0.500\n"


def test_a_ratio_past_the_band_counts_as_clipped_only_where_its_advantage_pushes_it_further():
    # One token at a time, so that counting the wrong tokens cannot come out the same: the clip
    # binds above the band for a positive advantage, below it for a negative one, and nowhere else.
    one = torch.ones(1, 1)
    for ratio, advantage, low, high in ((1.5, 1.0, 0, 1), (1.5, -1.0, 0, 0), (0.5, -1.0, 1, 0), (0.5, 1.0, 0, 0)):
        stats = rl.clip_stats(torch.tensor([[ratio]]), torch.tensor([[advantage]]), one, 0.2)
        assert (stats["clip_ratio/low"], stats["clip_ratio/high"]) == (low, high), (ratio, advantage)


def test_a_resumed_run_goes_on_with_the_minutes_its_checkpoint_had_spent(workspace, workspace_tokenizer, tmp_path,
                                                                        capsys, monkeypatch):
    # ppo.py and grpo.py count --minutes from the seconds the checkpoint holds: saved as anything
    # else, a run stopped and resumed would train for its whole budget again.
    monkeypatch.chdir(tmp_path)  # no checkpoints/finetune here for the rollout to be compared with
    policy = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    optimizer, rng = torch.optim.AdamW(policy.parameters()), np.random.default_rng(0)
    rl.save_rollout(tmp_path, 4, 150.0, policy, workspace_tokenizer, optimizer, rng, {"script": "grpo.py"})
    made_by = rl.resume(tmp_path, policy, optimizer, rng, workspace_tokenizer)["made_by"]
    assert (made_by["rollout"], made_by["seconds"]) == (4, 150.0)
    assert "rollout 4, 2.5 minutes so far" in capsys.readouterr().out


@pytest.mark.parametrize("option", [["--kl", "inf"], ["--kl", "nan"], ["--minutes", "inf"], ["--lr", "inf"]])
def test_an_option_without_a_bound_is_refused_in_one_line(monkeypatch, capsys, option):
    # A KL weight, a budget or a learning rate of infinity would train to NaN, or never stop.
    monkeypatch.setattr("sys.argv", ["grpo.py", *option])
    with pytest.raises(SystemExit):
        rl.parse_rl_args(rl.rl_parser("a test", ppo.LR))
    assert f"{option[0]} must be" in capsys.readouterr().err
