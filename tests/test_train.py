import math
import shutil
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import devices
import distributed
import finetune
import launch
import train
from checkpoints import load_checkpoint, logged, save_checkpoint
from model import GPT, TINY, Config
from tokenizer import encode_prompt
from test_finetune import tiny_pretrained_model_in
from test_ppo import tiny_policy


def test_learning_rate_warms_up_then_decays_to_the_minimum():
    assert train.learning_rate(0, 0.0) == pytest.approx(train.LR / train.WARMUP)
    assert train.learning_rate(train.WARMUP, 0.0) == pytest.approx(train.LR)
    assert train.learning_rate(10**6, 0.5) == pytest.approx((train.LR + train.MIN_LR) / 2)
    assert train.learning_rate(10**6, 1.0) == pytest.approx(train.MIN_LR)
    rates = [train.learning_rate(10**6, p / 10) for p in range(11)]
    assert rates == sorted(rates, reverse=True)


def test_a_window_s_targets_are_its_next_tokens():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = train.random_batch(tokens, np.random.default_rng(0), "cpu", batch=4, context=8)
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(y, x + 1)  # in 0, 1, 2, ... each token's next is itself plus one


def test_every_window_can_be_drawn_the_last_one_included():
    tokens = np.arange(11, dtype=np.uint16)  # windows of 8 and their targets: three start at 0, 1 or 2
    x, y = train.random_batch(tokens, np.random.default_rng(0), "cpu", batch=200, context=8)
    assert set(x[:, 0].tolist()) == {0, 1, 2} and int(y.max()) == 10


def test_the_schedule_follows_the_steps_when_there_are_some_else_the_minutes_which_always_cap_it():
    assert train.budget_used(30, 1, 0, None) == 0.5  # half a minute of one
    assert train.budget_used(30, 1, 8, 10) == 0.8  # 8 of 10 steps: the schedule follows the steps
    assert train.budget_used(45, 1, 2, 10) == 0.2  # a slow machine too: the time is a cap, not the schedule
    assert train.budget_used(90, 1, 8, 10) == 1.0  # time is up


def test_training_makes_the_loss_fall():
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=50, **TINY))
    optimizer = train.make_optimizer(model)
    tokens = np.tile(np.arange(50, dtype=np.uint16), 40)  # a sequence the model can learn
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(60):
        x, y = train.random_batch(tokens, rng, "cpu", batch=8, context=32)
        losses.append(train.train_step(model, optimizer, x, y, "cpu", "fp32", lr=1e-3))
    assert losses[0] > math.log(50) - 0.5
    assert np.mean(losses[-5:]) < losses[0] - 1.0


def test_valid_loss_is_the_mean_over_its_windows():
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=50, **TINY)).eval()
    tokens = np.random.default_rng(0).integers(0, 50, 200).astype(np.uint16)
    got = train.valid_loss(model, tokens, "cpu", windows=None, context=16, batch=5)
    windows = (len(tokens) - 1) // 16
    starts = np.linspace(0, len(tokens) - 17, windows).astype(int)
    by_hand = []
    for s in starts:
        window = torch.tensor(tokens[s:s + 17].astype(np.int64))
        logits, _ = model(window[None, :-1])
        by_hand.append(F.cross_entropy(logits[0], window[1:]).item())
    assert got == pytest.approx(np.mean(by_hand), rel=1e-5)


def test_a_checkpoint_without_the_random_states_resumes_drawing_new_windows_from_its_step():
    # A checkpoint without the random states: the windows from SEED + step, the dropout masks
    # from the run's seed.
    rng, torch_state = np.random.default_rng(train.SEED), torch.get_rng_state()
    train.resume_draws({"made_by": {"step": 250}}, rng, 250)
    assert rng.integers(0, 10**9) == np.random.default_rng(train.SEED + 250).integers(0, 10**9)
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_the_valid_loss_of_a_training_model_is_measured_without_dropout_and_leaves_it_training():
    # Dropout on would make the loss noisy and too high; left off, pretraining would go on
    # without it after its first validation.
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=50, **TINY))
    assert model.config.dropout > 0
    tokens = np.random.default_rng(0).integers(0, 50, 400).astype(np.uint16)
    in_training = train.valid_loss(model.train(), tokens, "cpu", windows=6, context=16)
    assert model.training
    assert in_training == train.valid_loss(model.eval(), tokens, "cpu", windows=6, context=16)


def test_the_optimizer_takes_the_recipe_s_betas():
    optimizer = train.make_optimizer(GPT(Config(vocab_size=50, **TINY)))
    assert [group["betas"] for group in optimizer.param_groups] == [train.BETAS] * len(optimizer.param_groups)


def test_a_step_takes_its_gradients_clipped_to_a_norm_of_clip():
    # One step of plain gradient descent at rate 1 moves the weights by the gradient itself:
    # a loss 1,000 times too large moves them by CLIP, no more.
    model = torch.nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    train.optimizer_step(model, torch.optim.SGD(model.parameters(), lr=1.0), 1000 * model(torch.ones(1, 4)).sum(), 1.0)
    assert float((model.weight.detach() - before).norm()) == pytest.approx(train.CLIP)


def test_weight_decay_shrinks_the_matrices_alone():
    model = GPT(Config(vocab_size=50, **TINY))
    optimizer = train.make_optimizer(model)
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay == {id(p): train.WEIGHT_DECAY if p.dim() >= 2 else 0.0 for p in model.parameters()}


def test_missing_token_file_names_the_command(tmp_path):
    with pytest.raises(SystemExit, match="python data.py"):
        train.load_tokens("train", tmp_path)


def test_the_demo_story_is_the_model_s_own_generate_with_dropout_off_and_leaves_training_on(small_tokenizer):
    # Pretraining logs its story with the model's own generate, so it needs no later episode.
    model = tiny_policy(vocab_size=small_tokenizer.vocab_size).train()
    story = train.demo_story(model, small_tokenizer, "Once upon a time", seed=3, max_new_tokens=40)
    assert model.training
    prompt = torch.tensor([encode_prompt(small_tokenizer, "Once upon a time")])
    written = model.eval().generate(prompt, 40, stop=small_tokenizer.eot, generator=torch.Generator().manual_seed(3))
    assert story == small_tokenizer.decode(written[0, prompt.size(1):].tolist())
    assert story != train.demo_story(model, small_tokenizer, "Once upon a time", seed=4, max_new_tokens=40)


CPU_FP32 = ["--device", "cpu", "--precision", "fp32"]


@pytest.mark.parametrize("script", [train, finetune])
def test_the_last_step_s_model_is_measured_and_saved_once(script, workspace, tmp_path, monkeypatch):
    # Runs that measure and save every 5 steps: 10 steps save at 5 and 10 (not 10 twice), 7 at 5 and 7.
    shutil.copytree(workspace / "data", tmp_path / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", tmp_path / "checkpoints" / "pretrain")
    launch.patch(monkeypatch.setattr, {})
    monkeypatch.setattr(script, "EVAL_EVERY", 5)
    saved = []

    def save_checkpoint(folder, model, tokenizer, made_by, *optimizer, **state):
        saved.append(made_by["step"])

    monkeypatch.setattr(script, "save_checkpoint", save_checkpoint)
    monkeypatch.chdir(tmp_path)
    for steps, expected in (("10", [5, 10]), ("7", [5, 7])):
        saved.clear()
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", "--steps", steps, *CPU_FP32])
        script.main()
        assert saved == expected


@pytest.mark.parametrize("script", [train, finetune])
def test_a_run_whose_weights_go_to_nan_stops_in_one_line_and_keeps_the_last_model(script, workspace, tmp_path,
                                                                                 monkeypatch):
    # Weights of nan after the first update, as a learning rate far too high leaves them: the
    # run stops at its next measurement, before a story drawn from them (which torch refuses)
    # and before a save over the model there.
    shutil.copytree(workspace / "data", tmp_path / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", tmp_path / "checkpoints" / "pretrain")
    before = (tmp_path / "checkpoints" / "pretrain" / "model.pt").read_bytes()
    launch.patch(monkeypatch.setattr, {})
    monkeypatch.setattr(script, "EVAL_EVERY", 2)
    real_update = train.update

    def diverging(model, optimizer, lr):
        real_update(model, optimizer, lr)
        with torch.no_grad():
            for weight in model.parameters():
                weight.fill_(math.nan)

    monkeypatch.setattr(train, "update", diverging)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", "--steps", "4", *CPU_FP32])
    with pytest.raises(SystemExit, match="^the model's weights are no longer finite numbers \\(nan or inf\\): the "
                                         "run diverged, and stops before it writes checkpoints/"):
        script.main()
    assert (tmp_path / "checkpoints" / "pretrain" / "model.pt").read_bytes() == before
    assert not list((tmp_path / "checkpoints").glob("finetune*/*.pt"))  # fine-tuning saved nothing either


def test_a_checkpoint_s_seconds_count_the_step_it_saves(workspace, tmp_path, monkeypatch):
    # A clock that moves 10 seconds a training step and stands still otherwise: the checkpoints
    # saved at steps 5 and 7 record 50 and 70 seconds, the time a resumed run goes on from.
    shutil.copytree(workspace / "data", tmp_path / "data")
    launch.patch(monkeypatch.setattr, {})
    monkeypatch.setattr(train, "EVAL_EVERY", 5)
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    train_step = train.train_step

    def step_of_ten_seconds(*args):
        clock[0] += 10.0
        return train_step(*args)

    monkeypatch.setattr(train, "train_step", step_of_ten_seconds)
    saved = []
    monkeypatch.setattr(train, "save_checkpoint", lambda folder, model, tokenizer, made_by, *optimizer, **state:
                        saved.append((made_by["step"], made_by["seconds"])))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "7", *CPU_FP32])
    train.main()
    assert saved == [(5, 50.0), (7, 70.0)]


def four_steps_of_pretraining(workspace, monkeypatch):
    """A run of train.py in a folder: the tests' tiny model, 4 steps, a checkpoint every 2,
    stopped (KeyboardInterrupt) right after the checkpoint of stop_after_step: run(folder, *args,
    stop_after_step=None, budget=("--steps", "4")), which returns the final checkpoint. (A
    budget in minutes instead takes 4 steps on a clock that makes them last a quarter of it.)"""
    launch.patch(monkeypatch.setattr, {})
    monkeypatch.setattr(train, "Config", lambda vocab_size: Config(vocab_size=vocab_size, **TINY))
    monkeypatch.setattr(train, "EVAL_EVERY", 2)
    save_checkpoint = train.save_checkpoint

    def run(folder, *args, stop_after_step=None, budget=("--steps", "4")):
        shutil.copytree(workspace / "data", folder / "data", dirs_exist_ok=True)
        monkeypatch.chdir(folder)

        def save_then_stop(path, model, tokenizer, made_by, *optimizer, **state):
            save_checkpoint(path, model, tokenizer, made_by, *optimizer, **state)
            if made_by["step"] == stop_after_step:
                raise KeyboardInterrupt

        monkeypatch.setattr(train, "save_checkpoint", save_then_stop)
        monkeypatch.setattr(sys, "argv", ["train.py", *budget, *args])
        train.main()
        return torch.load(folder / "checkpoints" / "pretrain" / "model.pt", weights_only=True)

    return run


def pretraining_in(folder, workspace, monkeypatch):
    """A copy of the workspace's data in folder, made the current folder, for train.main()."""
    shutil.copytree(workspace / "data", folder / "data")
    launch.patch(monkeypatch.setattr, {})
    monkeypatch.chdir(folder)


def test_pretraining_learns_from_train_bin_measures_valid_bin_and_warms_up_from_its_first_step(
        workspace, tmp_path, monkeypatch):
    pretraining_in(tmp_path, workspace, monkeypatch)
    train_tokens, valid_tokens = np.array(train.load_tokens("train")), np.array(train.load_tokens("valid"))
    steps, measured, real_step, real_valid = [], [], train.train_step, train.valid_loss
    monkeypatch.setattr(train, "train_step", lambda *args: steps.append(args) or real_step(*args))
    monkeypatch.setattr(train, "valid_loss", lambda model, tokens, *args, **kwargs: measured.append(np.array(tokens))
                        or real_valid(model, tokens, *args, **kwargs))
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "3", *CPU_FP32])
    train.main()
    # The learning rate of each step by the schedule, the first a warmup's first: LR / WARMUP.
    assert [args[6] for args in steps] == [pytest.approx(train.learning_rate(s, s / 3)) for s in range(3)]
    assert steps[0][6] == pytest.approx(train.LR / train.WARMUP)
    # Each row a window of train.bin, its targets the next tokens; the validation on valid.bin.
    for x, y in (args[2:4] for args in steps):
        for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
            starts = np.flatnonzero(train_tokens[:len(train_tokens) - train.CONTEXT] == row[0])
            assert any(np.array_equal(train_tokens[start:start + len(row)], row) for start in starts)
    assert measured and all(np.array_equal(tokens, valid_tokens) for tokens in measured)


@pytest.mark.parametrize("script, options", [(train, []), (finetune, []), (finetune, ["--first-use-weight", "10"])])
def test_micro_batch_reaches_the_training_step(script, options, workspace, tmp_path, monkeypatch):
    # 16 rows a step, 3 at a time: five pieces of 3 and one of 1, the memory a piece needs.
    if script is train:
        pretraining_in(tmp_path, workspace, monkeypatch)
    else:
        tiny_pretrained_model_in(tmp_path, workspace, monkeypatch)
        launch.patch(monkeypatch.setattr, {})
        monkeypatch.setattr(finetune, "MAX_LENGTH", 64)
    real_pieces, pieces = distributed.pieces, []

    def recorded(model, counted, micro_batch):
        sizes = []
        pieces.append(sizes)
        for rows, share, syncing in real_pieces(model, counted, micro_batch):
            sizes.append(len(counted[rows]))
            yield rows, share, syncing

    monkeypatch.setattr(distributed, "pieces", recorded)
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", "--steps", "1", "--micro-batch", "3", *options,
                                      *CPU_FP32])
    script.main()
    assert pieces == [[3, 3, 3, 3, 3, 1]]


def test_a_run_stopped_and_resumed_trains_the_model_an_uninterrupted_run_trains(workspace, tmp_path, monkeypatch):
    # One run straight through, one stopped right after its step-2 checkpoint and resumed, the
    # tiny model with dropout. Both draw the same windows and dropout masks, so both end on
    # the same weights, to the bit.
    pretrain = four_steps_of_pretraining(workspace, monkeypatch)
    straight = pretrain(tmp_path / "straight", *CPU_FP32)
    with pytest.raises(KeyboardInterrupt):
        pretrain(tmp_path / "stopped", *CPU_FP32, stop_after_step=2)
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(args) or real_load(*args, **kwargs))
    resumed = pretrain(tmp_path / "stopped", *CPU_FP32, "--resume")
    assert len(loads) == 2  # the checkpoint read once to resume from, and the final one once by pretrain()
    assert resumed["made_by"]["step"] == straight["made_by"]["step"] == 4
    assert straight["config"]["dropout"] > 0
    for name, weights in straight["model"].items():
        assert torch.equal(resumed["model"][name], weights), name
    # And its log reads as the uninterrupted run's: the resumed run wrote on beside its own.
    logs = tmp_path / "straight" / "runs" / "pretrain", tmp_path / "stopped" / "runs" / "pretrain"
    assert list(logged(logs[1], "loss/valid")) == [2, 4]
    assert logged(logs[1], "loss/valid") == logged(logs[0], "loss/valid")


def test_resume_refuses_a_checkpoint_that_is_not_pretraining_s_own(workspace, workspace_tokenizer, tmp_path,
                                                                    monkeypatch):
    pretrain = four_steps_of_pretraining(workspace, monkeypatch)
    model = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True)
    folder = tmp_path / "checkpoints" / "pretrain"
    # A final model copied in (no optimizer), and a GRPO rollout's checkpoint (another script's optimizer).
    for made_by, optimizer in (({"script": "train.py", "step": 4}, None),
                               ({"script": "grpo.py", "rollout": 1}, torch.optim.AdamW(model.parameters()))):
        save_checkpoint(folder, model, workspace_tokenizer, made_by, optimizer)
        with pytest.raises(SystemExit, match="holds no pretraining run's optimizer state to resume from; start without"):
            pretrain(tmp_path, *CPU_FP32, "--resume")


@pytest.mark.parametrize("damage, message", [
    (lambda c: c["optimizer"]["param_groups"].pop(), "holds an optimizer state that does not fit this run"),
    (lambda c: c.update(numpy_random={"bit_generator": "PCG64", "state": 5}), "holds a random state that does not"),
    (lambda c: c.update(torch_random=torch.zeros(3, dtype=torch.uint8)), "holds a random state that does not"),
    (lambda c: c["made_by"].pop("seconds"), "does not say its step, seconds and schedule"),
    (lambda c: c["made_by"]["settings"].update(minutes="60"), "does not say its step, seconds and schedule"),
])
def test_resume_refuses_a_damaged_checkpoint_in_one_line(damage, message, workspace, tmp_path, monkeypatch):
    pretrain = four_steps_of_pretraining(workspace, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        pretrain(tmp_path, *CPU_FP32, stop_after_step=2)
    path = tmp_path / "checkpoints" / "pretrain" / "model.pt"
    checkpoint = torch.load(path, weights_only=True)
    damage(checkpoint)
    torch.save(checkpoint, path)
    with pytest.raises(SystemExit, match=f"{message}.*; start without --resume"):
        pretrain(tmp_path, *CPU_FP32, "--resume")


def test_a_resumed_run_keeps_the_precision_it_started_with(workspace, tmp_path, monkeypatch):
    pretrain = four_steps_of_pretraining(workspace, monkeypatch)
    monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: 2.1)
    with pytest.raises(KeyboardInterrupt):
        pretrain(tmp_path, "--device", "cpu", stop_after_step=2)
    # Timed again, the CPU would now pick fp32 (a busy moment, say): the run keeps its bf16.
    monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: 1.2)
    assert pretrain(tmp_path, "--device", "cpu", "--resume")["made_by"]["settings"]["precision"] == "bf16"


def test_a_run_resumed_on_a_budget_of_minutes_goes_on_with_its_clock_and_its_learning_rates(workspace, tmp_path,
                                                                                            monkeypatch):
    # A clock that moves 15 seconds a training step and stands still otherwise (and an hour
    # between the two sittings, which must not count): a minute is 4 steps. Without the
    # warmup, the learning rate follows the share of the minute used from the first step. A
    # run stopped at step 2 and resumed goes on 30 seconds in: its steps 2 and 3 take the
    # uninterrupted run's learning rates, and it ends at step 4, a minute in, as that run did.
    pretrain = four_steps_of_pretraining(workspace, monkeypatch)
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(train, "learning_rate", lambda step, progress, real=train.learning_rate:
                        real(step, progress, warmup=0))
    rates, train_step = [], train.train_step

    def step_of_fifteen_seconds(*args):
        clock[0] += 15.0
        rates.append(args[6])  # train_step(model, optimizer, x, y, device, precision, lr, micro_batch)
        return train_step(*args)

    monkeypatch.setattr(train, "train_step", step_of_fifteen_seconds)
    budget = ("--minutes", "1")
    straight = pretrain(tmp_path / "straight", *CPU_FP32, budget=budget)
    straight_rates = rates[:]
    assert len(set(straight_rates)) == 4  # the rates fall with the time
    rates.clear()
    with pytest.raises(KeyboardInterrupt):
        pretrain(tmp_path / "stopped", *CPU_FP32, budget=budget, stop_after_step=2)
    clock[0] += 3600.0
    resumed = pretrain(tmp_path / "stopped", *CPU_FP32, "--resume", budget=budget)
    assert rates == straight_rates
    assert (resumed["made_by"]["step"], resumed["made_by"]["seconds"]) == (4, 60.0)
    assert (straight["made_by"]["step"], straight["made_by"]["seconds"]) == (4, 60.0)


@pytest.mark.parametrize("args", [["--steps", "0"], ["--steps", "-1"], ["--minutes", "0"], ["--minutes", "inf"],
                                  ["--minutes", "nan"]])
def test_a_budget_that_is_not_positive_gets_one_line(args, run_main, monkeypatch, capsys):
    # --steps 0 would train nothing, then save an untrained model as if pretrained.
    monkeypatch.setattr(train, "load_tokenizer", lambda: pytest.fail("it went on past the check"))
    with pytest.raises(SystemExit):
        run_main(train, *args)
    assert "error: --minutes and --steps must be positive" in capsys.readouterr().err


def test_a_token_file_of_an_odd_size_is_refused_in_one_line(tmp_path):
    # uint16 tokens: an odd number of bytes is half a token short (a copy cut off), and no
    # manifest says what size data.py made it. Read as it is, numpy would stop with its own error.
    (tmp_path / "train.bin").write_bytes(bytes(2 * (train.CONTEXT + 10) + 1))
    with pytest.raises(SystemExit, match=r"train.bin is damaged or too short \(533 bytes\); make it again with "
                                         r"python data.py$"):
        train.load_tokens("train", tmp_path)
