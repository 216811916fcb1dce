"""The pretraining and fine-tuning scripts run end to end, on the series-size model, for a
few steps, in a copy of the workspace's data."""
import errno
import functools
import os
import re
import shutil
import sys

import pytest
import torch

import dpo
import finetune
import train
from checkpoints import read_checkpoint


@pytest.fixture
def learner(workspace, tmp_path, monkeypatch):
    shutil.copytree(workspace / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(script, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", [script.__name__ + ".py", *args])
    script.main()


def test_interrupted_pretraining_resumes_on_its_schedule_then_fine_tuning_starts_from_it(learner, monkeypatch,
                                                                                        capsys):
    # Each evaluation on less: the loss on plain stories over 1 window, not 256, the instruction
    # loss over 2 held-back examples, and a demo story of 1 token. At the series' size, the
    # evaluations took most of this test's time, and it is about the schedule, not the figures.
    real_instruction_loss, real_demo_story = finetune.instruction_loss, train.demo_story
    for script in (train, finetune):
        monkeypatch.setattr(script, "valid_loss", functools.partial(train.valid_loss, windows=1))
        monkeypatch.setattr(script, "demo_story", lambda model, tokenizer, prompt, seed, max_new_tokens=1:
                            real_demo_story(model, tokenizer, prompt, seed, max_new_tokens=1))
    monkeypatch.setattr(finetune, "instruction_loss",
                        lambda model, examples, *args: real_instruction_loss(model, examples[:2], *args))
    # And pretraining's steps on 1 window, not 16: the same schedule, in a fraction of the time.
    monkeypatch.setattr(train, "random_batch", functools.partial(train.random_batch, batch=1))
    # A run of 4 steps, checkpointed every 2, interrupted during its third step.
    real_step, steps_taken = train.train_step, []

    def interrupted_at_the_third_step(*args, **kwargs):
        if len(steps_taken) == 2:
            raise KeyboardInterrupt
        steps_taken.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "EVAL_EVERY", 2)
    monkeypatch.setattr(train, "train_step", interrupted_at_the_third_step)
    with pytest.raises(KeyboardInterrupt):
        run(train, monkeypatch, "--steps", "4", "--minutes", "30")
    assert read_checkpoint(learner / "checkpoints" / "pretrain")["made_by"]["step"] == 2

    # Resumed, with other numbers on the command line, it finishes the schedule it started with.
    monkeypatch.setattr(train, "train_step", real_step)
    run(train, monkeypatch, "--resume", "--steps", "99", "--minutes", "1")
    out = capsys.readouterr().out
    assert "resuming at step 2" in out
    assert "a resumed run keeps its schedule, 30 minutes and at most 4 steps" in out  # and says so
    resumed = read_checkpoint(learner / "checkpoints" / "pretrain")
    assert resumed["made_by"]["step"] == 4 and "optimizer" in resumed
    assert resumed["made_by"]["settings"]["steps"] == 4 and resumed["made_by"]["settings"]["minutes"] == 30

    # Fine-tuning on examples and plain windows of at most 64 tokens, not the context's 256: the
    # same schedule, folders and rows of a batch, in about a quarter of the time a step.
    monkeypatch.setattr(finetune, "MAX_LENGTH", 64)
    # With --keep, each evaluation's model stays as step-N.pt, for the curve of words against steps.
    # By default a run is STEPS steps, whatever the minutes allow beyond them, and three eighths of
    # each batch is plain stories (an end-of-text for their prompt).
    monkeypatch.setattr(finetune, "EVAL_EVERY", 1)
    monkeypatch.setattr(finetune, "STEPS", 2)
    real_step, targets = finetune.train_step, []
    monkeypatch.setattr(finetune, "train_step", lambda model, optimizer, x, y, *args: targets.append(y)
                        or real_step(model, optimizer, x, y, *args))
    run(finetune, monkeypatch, "--minutes", "1", "--keep")
    assert "(train.py, step 4)" in capsys.readouterr().out  # it loaded the pretrained model
    made_by = read_checkpoint(learner / "checkpoints" / "finetune")["made_by"]
    assert made_by["script"] == "finetune.py" and made_by["step"] == 2
    assert made_by["settings"]["lr"] == finetune.LR and made_by["settings"]["plain_share"] == finetune.PLAIN_SHARE
    # Every constant the run used is in its settings, as it was: none typed out by hand to forget.
    for constant in ("EVAL_EVERY", "HELD_BACK", "ALIGN", "TUNE_POOL", "CONTEXT", "MAX_LENGTH", "MIN_LR", "WARMUP"):
        assert made_by["settings"][constant.lower()] == getattr(finetune, constant)
    # And pretraining's, which its optimizer and training step take from train.py.
    assert (made_by["settings"]["grad_clip"], made_by["settings"]["weight_decay"], tuple(made_by["settings"]["betas"])) == (
        train.CLIP, train.WEIGHT_DECAY, train.BETAS)
    kept = sorted(path.name for path in (learner / "checkpoints" / "finetune").glob("step-*.pt"))
    assert kept == ["step-1.pt", "step-2.pt"]
    assert read_checkpoint(learner / "checkpoints" / "finetune" / "step-1.pt")["made_by"]["step"] == 1
    assert set(made_by["losses"]) == {"instructions", "plain"}
    assert (learner / "runs" / "finetune").exists() and (learner / "runs" / "pretrain").exists()
    assert [plain_rows(y) for y in targets] == [[False] * 10 + [True] * 6] * 2

    # A lever's run goes to its own folder; with --plain-share 0, every example is an instruction.
    targets.clear()
    run(finetune, monkeypatch, "--steps", "2", "--lr", "3e-4", "--asks", "2", "--plain-share", "0", "--swap", "1")
    lever = read_checkpoint(learner / "checkpoints" / "finetune-lr-0.0003-asks-2-plain-0-swap-1")["made_by"]
    assert lever["step"] == 2 and lever["settings"]["lr"] == 3e-4 and lever["settings"]["asks"] == 2
    assert lever["settings"]["swap"] == 1
    assert [plain_rows(y) for y in targets] == [[False] * 16] * 2
    assert read_checkpoint(learner / "checkpoints" / "finetune")["made_by"]["settings"]["lr"] == finetune.LR  # left alone
    assert (learner / "runs" / "finetune-lr-0.0003-asks-2-plain-0-swap-1").exists()

    # Another training seed: its own folder, other batches, the same held-back instructions to measure.
    capsys.readouterr()
    targets.clear()
    run(finetune, monkeypatch, "--steps", "1")
    default_run = capsys.readouterr().out
    default_batch = targets[0]
    targets.clear()
    run(finetune, monkeypatch, "--steps", "1", "--seed", "2")
    seeded_run = capsys.readouterr().out
    seeded = read_checkpoint(learner / "checkpoints" / "finetune-seed-2")["made_by"]
    assert seeded["settings"]["seed"] == 2 and seeded["step"] == 1
    assert not torch.equal(targets[0], default_batch)
    held_back_loss = re.compile(r"step 0: loss on held-back instructions ([0-9.]+)")
    assert held_back_loss.search(seeded_run).group(1) == held_back_loss.search(default_run).group(1)


def plain_rows(targets):
    """Which rows of a training batch are plain stories: their first token is a target, not a prompt's."""
    return (targets[:, 0] >= 0).tolist()


@pytest.mark.parametrize("script", [train, finetune, dpo])
def test_a_full_disk_stops_training_before_it_starts(script, learner, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    monkeypatch.setattr(script, "load_tokenizer", lambda: pytest.fail("it went on past the check"))
    with pytest.raises(SystemExit, match="no space left on the disk for checkpoints"):
        run(script, monkeypatch, "--steps", "2")


@pytest.mark.parametrize("args", [["--lr", "0"], ["--asks", "0"], ["--plain-share", "0.01"], ["--plain-share", "0.99"],
                                  ["--plain-share", "nan"], ["--plain-share", "inf"], ["--swap", "1.5"],
                                  ["--first-use-weight", "inf"]])
def test_a_lever_out_of_range_gets_one_line(args, learner, monkeypatch, capsys):
    monkeypatch.setattr(finetune, "load_tokenizer", lambda: pytest.fail("it went on past the check"))
    with pytest.raises(SystemExit):
        run(finetune, monkeypatch, *args)
    assert args[0] in capsys.readouterr().err
