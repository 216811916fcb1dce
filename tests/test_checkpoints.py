import argparse
import calendar
import errno
import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

import tokenizer as bpe
import distributed
from checkpoints import (checkpoint_file, load_checkpoint, logged, read_checkpoint, run_settings, run_writer,
                         save_checkpoint)
from model import GPT, TINY, Config


class Evil:
    def __reduce__(self):
        return (print, ("this ran code",))


def test_saved_model_loads_with_the_same_outputs(small_model, small_tokenizer, tmp_path):
    folder = tmp_path / "checkpoints" / "finetune"
    save_checkpoint(folder, small_model, small_tokenizer, {"script": "test", "step": 3, "settings": {"lr": 1e-3}})
    loaded = load_checkpoint(folder, tokenizer=small_tokenizer).eval()
    tokens = torch.randint(0, small_tokenizer.vocab_size, (2, 10))
    small_model.eval()
    assert torch.equal(loaded(tokens)[0], small_model(tokens)[0])
    assert read_checkpoint(folder)["made_by"]["settings"] == {"lr": 1e-3}
    assert [p.name for p in folder.iterdir()] == ["model.pt"]  # no temporary file left


def test_a_run_s_settings_are_its_constants_then_its_options():
    constants = {"BATCH": 16, "BETAS": (0.9, 0.95), "LR": 1e-3, "EXAMPLE": "Write a story.", "AMX": True,
                 "DATA": Path("data"), "WORD": re.compile("x"), "TINY": {"n_layer": 2}, "BOTH": (1, Path("x")),
                 "make": print, "lower_case": 3, "NUMPY": np.float64(0.5)}
    options = argparse.Namespace(lr=3e-4, minutes=10.0, rollouts=math.inf, device=None)
    settings = run_settings(options, constants, device="cpu", script="x.py")
    # Numbers, strings and tuples of them, by their lower-case names; not paths, patterns, dicts, functions
    # or numpy numbers (which a checkpoint loaded with weights_only=True refuses).
    # An option without a bound as None: the settings are printed and logged as JSON, which has no infinity.
    assert settings == {"batch": 16, "betas": (0.9, 0.95), "lr": 3e-4, "example": "Write a story.", "amx": True,
                        "minutes": 10.0, "rollouts": None, "device": "cpu", "script": "x.py"}
    json.dumps(settings, allow_nan=False)


def test_of_a_step_logged_twice_the_point_written_last_counts(tmp_path):
    # A run that went on from a checkpoint logs steps 1 and 2 again, an hour later, into the
    # same folder. Its file is the first one written here, so that the order the files are
    # read in would pick the older points: the clock alone must decide.
    with SummaryWriter(tmp_path) as went_on:
        for step, value in ((1, 10.0), (2, 20.0)):
            went_on.add_scalar("rollout/kl", value, step, walltime=5000.0 + step)
    with SummaryWriter(tmp_path) as first:
        for step, value in ((1, 1.0), (2, 2.0), (3, 3.0)):
            first.add_scalar("rollout/kl", value, step, walltime=1000.0 + step)
    assert len(list(tmp_path.iterdir())) == 2
    assert logged(tmp_path, "rollout/kl") == {1: 10.0, 2: 20.0, 3: 3.0}
    assert logged(tmp_path, "rollout/reward") == {}  # a tag the run never logged


def write_points(run, resumed, points):
    writer = run_writer(run, resumed)
    for step, value in points.items():
        writer.add_scalar("rollout/reward", value, step)
    writer.close()


def test_a_new_run_moves_an_earlier_runs_log_into_a_folder_of_its_own(tmp_path, capsys):
    # A run of 10 rollouts, resumed for an 11th; then a new run of 4 in the same folder. Read
    # with the earlier run's files, the new run's curve would go on with its rollouts 4 to 10.
    run = tmp_path / "runs" / "grpo" / "kl-0.05"
    earlier = {step: float(step) for step in range(10)}
    write_points(run, False, earlier)
    write_points(run, True, {10: 50.0})
    earlier[10] = 50.0
    assert logged(run, "rollout/reward") == earlier  # a resumed run's points join its own
    write_points(run, False, {step: 100.0 + step for step in range(4)})
    assert logged(run, "rollout/reward") == {step: 100.0 + step for step in range(4)}
    [kept] = [path for path in run.iterdir() if path.is_dir()]
    assert re.fullmatch(r"earlier-\d{4}-\d\d-\d\d-\d{6}", kept.name)
    assert logged(kept, "rollout/reward") == earlier  # nothing lost: both of that run's files
    assert f"moved to {kept}" in capsys.readouterr().out


def test_an_earlier_log_that_cannot_be_moved_stops_the_new_run_in_one_line(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "grpo" / "kl-0.05"
    write_points(run, False, {0: 1.0})

    def held_open(path, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "rename", held_open)
    with pytest.raises(SystemExit, match=r"^cannot move the earlier run's TensorBoard log in .*kl-0.05 into earlier-"
                                         r"\S+ \(Permission denied\); close what holds it open, or delete it"):
        run_writer(run, resumed=False)
    assert logged(run, "rollout/reward") == {0: 1.0}  # left where it was


def test_under_torchrun_only_rank_0_writes_or_moves_a_log(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "pretrain"
    write_points(run, False, {0: 1.0})
    monkeypatch.setattr(distributed, "is_main", lambda: False)
    write_points(run, False, {0: 2.0})
    assert [path.is_file() for path in run.iterdir()] == [True]
    assert logged(run, "rollout/reward") == {0: 1.0}


def test_missing_checkpoint_names_the_command_that_makes_it(tmp_path):
    with pytest.raises(SystemExit, match="python finetune.py"):
        load_checkpoint(tmp_path / "checkpoints" / "finetune")
    with pytest.raises(SystemExit, match="python grpo.py"):
        load_checkpoint(tmp_path / "checkpoints" / "grpo" / "kl-0.05" / "rollout-10.pt")
    with pytest.raises(SystemExit, match=r"python dpo.py with the options its folder's name gives \(dpo-seed-2\)"):
        load_checkpoint(tmp_path / "checkpoints" / "dpo-seed-2")
    for elsewhere in ("models/finetune", "checkpoints/pretrain-old"):  # not a folder any script names
        with pytest.raises(SystemExit, match="make it with the script that writes it"):
            load_checkpoint(tmp_path / elsewhere)
    # A project inside a folder named checkpoints: its own checkpoints/ says which script.
    with pytest.raises(SystemExit, match="python grpo.py"):
        load_checkpoint(tmp_path / "checkpoints" / "series" / "checkpoints" / "grpo" / "kl-0.05" / "rollout-10.pt")


def test_truncated_checkpoint_is_refused(small_model, small_tokenizer, tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test"})
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(SystemExit, match="not a checkpoint that loads safely"):
        load_checkpoint(path)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_that_would_run_code_is_refused(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.save({"model": Evil(), "config": {}, "tokenizer": "", "made_by": {}}, path)
    with pytest.raises(SystemExit, match="not a checkpoint that loads safely"):
        load_checkpoint(path)
    assert "this ran code" not in capsys.readouterr().out
    torch.save([1, 2, 3], path)  # loads safely, but is no checkpoint
    with pytest.raises(SystemExit, match="not a checkpoint of this series"):
        load_checkpoint(path)
    torch.save({"model": {}, "config": {}}, path)  # a model of some other code: no tokenizer, nothing of who made it
    with pytest.raises(SystemExit, match="not a checkpoint of this series"):
        load_checkpoint(path)
    # Its keys, but what made it or its config not a mapping (a file edited by hand).
    for made_by, config in (("train.py", {}), ({}, "the series' model")):
        torch.save({"model": {}, "config": config, "tokenizer": "", "made_by": made_by}, path)
        with pytest.raises(SystemExit, match="not a checkpoint of this series"):
            load_checkpoint(path)


def test_wrong_shaped_weights_are_refused_not_half_loaded(small_model, small_tokenizer, tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test"})
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["config"]["n_embd"] = 64  # the weights are 32 wide
    torch.save(checkpoint, path)
    with pytest.raises(SystemExit, match="does not match"):
        load_checkpoint(path)
    checkpoint["config"].update(n_embd=32, n_layer=40)  # missing weights: a list of hundreds, kept short
    torch.save(checkpoint, path)
    with pytest.raises(SystemExit, match="does not match") as refused:
        load_checkpoint(path)
    assert len(str(refused.value)) < 300 and "\n" not in str(refused.value)
    # Weights of the right shapes, but heads that do not split them: refused here, not in forward().
    for heads in (3, 0):
        checkpoint["config"].update(n_layer=2, n_head=heads)
        torch.save(checkpoint, path)
        with pytest.raises(SystemExit, match=f"does not match.*does not split into {heads} heads"):
            load_checkpoint(path)


def test_a_model_whose_context_is_not_the_series_is_refused(small_tokenizer, tmp_path):
    path = tmp_path / "checkpoints" / "pretrain" / "model.pt"
    model = GPT(Config(vocab_size=small_tokenizer.vocab_size, **{**TINY, "context": 128}))
    save_checkpoint(path, model, small_tokenizer, {"script": "test"})
    with pytest.raises(SystemExit, match="context of 128 tokens.*python train.py"):
        load_checkpoint(path)


def test_a_model_whose_vocabulary_is_not_its_tokenizer_s_is_refused(small_tokenizer, tmp_path):
    # Made with this tokenizer, but cut to fewer tokens: one the tokenizer writes would fail in the embedding.
    path = tmp_path / "checkpoints" / "finetune" / "model.pt"
    model = GPT(Config(vocab_size=small_tokenizer.vocab_size - 8, **TINY))
    save_checkpoint(path, model, small_tokenizer, {"script": "test"})
    with pytest.raises(SystemExit, match=f"a vocabulary of {small_tokenizer.vocab_size - 8} tokens, where "
                                         f"data/tokenizer.json has {small_tokenizer.vocab_size}; .*python finetune.py"):
        load_checkpoint(path, tokenizer=small_tokenizer)
    assert load_checkpoint(path).config.vocab_size == small_tokenizer.vocab_size - 8  # no tokenizer, no check


def test_model_of_another_tokenizer_is_refused(small_model, small_tokenizer, tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test"})
    other = bpe.train(["another text entirely, with other merges"] * 5, vocab_size=280, progress=False)
    with pytest.raises(SystemExit, match="another tokenizer"):
        load_checkpoint(path, tokenizer=other)


def test_interrupted_save_keeps_the_old_checkpoint(small_model, small_tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test", "step": 1})

    def interrupted(obj, file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, small_model, small_tokenizer, {"script": "test", "step": 2})
    assert read_checkpoint(path)["made_by"]["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


@pytest.mark.parametrize("diverged", [math.nan, math.inf])
def test_weights_gone_to_nan_or_inf_are_not_saved_over_a_good_model_nor_loaded(diverged, small_tokenizer, tmp_path):
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=small_tokenizer.vocab_size, **TINY))
    path = tmp_path / "model.pt"
    save_checkpoint(path, model, small_tokenizer, {"script": "test", "step": 1})
    with torch.no_grad():
        model.blocks[1].mlp.down.weight[3, 5] = diverged  # one weight is enough to spread
    with pytest.raises(SystemExit, match="^the model's weights are no longer finite numbers .* stops before it writes "
                                         ".*model.pt; start it again, with a lower --lr where the script takes one$"):
        save_checkpoint(path, model, small_tokenizer, {"script": "test", "step": 2})
    assert read_checkpoint(path)["made_by"]["step"] == 1
    # Such a file, written by other means, is refused when loaded, not written with.
    torch.save({**torch.load(path, weights_only=True), "model": model.state_dict()}, path)
    with pytest.raises(SystemExit, match="model.pt holds weights that are not finite numbers \\(nan or inf\\)"):
        load_checkpoint(path)


def test_a_folder_means_its_final_model(small_model, small_tokenizer, tmp_path):
    assert checkpoint_file("checkpoints/ppo/kl-0.05").name == "model.pt"
    assert checkpoint_file("checkpoints/ppo/kl-0.05/rollout-10.pt").name == "rollout-10.pt"
    # A file of another name is itself: a checkpoint saved as mine.pth loads, and a text file is refused as one.
    save_checkpoint(tmp_path / "saved.pt", small_model, small_tokenizer, {"script": "test", "step": 3})
    (tmp_path / "saved.pt").rename(tmp_path / "mine.pth")
    assert read_checkpoint(tmp_path / "mine.pth")["made_by"]["step"] == 3
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(SystemExit, match="notes.txt is not a checkpoint that loads safely"):
        read_checkpoint(tmp_path / "notes.txt")


def saved_step(path):
    return read_checkpoint(path)["made_by"]["step"]


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS])
def test_a_save_the_disk_refuses_stops_with_one_line_and_keeps_the_checkpoint(small_model, small_tokenizer, tmp_path,
                                                                             monkeypatch, error):
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test", "step": 1})

    def refused(obj, file):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(torch, "save", refused)
    if error == errno.EROFS:  # on a read-only disk, removing the temporary file fails too
        monkeypatch.setattr(Path, "unlink", lambda *args, **kwargs: refused(None, None))
    with pytest.raises(SystemExit) as stopped:
        save_checkpoint(path, small_model, small_tokenizer, {"script": "test", "step": 2})
    message = str(stopped.value)
    assert "\n" not in message and str(tmp_path) in message
    assert ("no space left" if error == errno.ENOSPC else "Read-only file system") in message
    monkeypatch.undo()
    assert saved_step(path) == 1


def test_temporary_files_of_killed_saves_are_removed_and_a_save_is_on_disk_before_its_rename(
        small_model, small_tokenizer, tmp_path, monkeypatch):
    stale, running = tmp_path / ".model.pt.99999.tmp", tmp_path / ".model.pt.88888.tmp"
    stale.write_bytes(b"half of a checkpoint, from a run killed yesterday")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    running.write_bytes(b"a save that another run is writing now")
    calls, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda *args: calls.append("replace") or real_replace(*args))
    save_checkpoint(tmp_path / "model.pt", small_model, small_tokenizer, {"script": "test", "step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "model.pt"]
    assert calls == ["fsync", "replace"]


def test_a_checkpoint_without_its_tokenizer_is_refused_in_one_line(small_model, small_tokenizer, tmp_path):
    # Without the tokenizer's fingerprint, no script could check what its tokens mean: refused
    # when read, not a KeyError when a script compares it (nor loaded unchecked when none does).
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test", "step": 1})
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["tokenizer"]
    torch.save(checkpoint, path)
    for read in (read_checkpoint, lambda path: load_checkpoint(path, tokenizer=small_tokenizer)):
        with pytest.raises(SystemExit, match=r"model.pt is not a checkpoint of this series; make it again with "
                                             r"the script that writes it$"):
            read(path)


@pytest.mark.parametrize("path", ["checkpoints", "checkpoints/model.pt", "checkpoints/mine.pt"])
def test_a_missing_checkpoint_directly_under_checkpoints_names_no_script(tmp_path, path):
    # No folder under checkpoints/ says which script makes it: the one line names none, where
    # looking for that folder would run past the end of the path.
    with pytest.raises(SystemExit, match=r"^no checkpoint at .*checkpoints[/\\]\w+\.pt: make it with the script that "
                                         r"writes it$"):
        load_checkpoint(tmp_path / path)


def test_a_checkpoint_loads_onto_the_device_it_is_asked_for(small_model, small_tokenizer, tmp_path):
    # The scripts load their model onto the GPU they train on: weights left on the CPU would meet
    # the GPU's tokens in the first forward pass. torch's meta device stands in for a GPU here.
    save_checkpoint(tmp_path / "model.pt", small_model, small_tokenizer, {"script": "test"})
    model = load_checkpoint(tmp_path / "model.pt", torch.device("meta"), small_tokenizer, quiet=True)
    assert {weight.device.type for weight in model.state_dict().values()} == {"meta"}


def test_weights_that_do_not_fit_are_refused_with_what_does_not_fit(small_model, small_tokenizer, tmp_path):
    # torch's first line only names the class; the line after it says which weights, and how.
    path = tmp_path / "model.pt"
    save_checkpoint(path, small_model, small_tokenizer, {"script": "test"})
    checkpoint = torch.load(path, weights_only=True)
    for config, reason in (({"n_embd": 64}, "size mismatch for"), ({"n_layer": 40}, "Missing key")):
        torch.save({**checkpoint, "config": {**checkpoint["config"], **config}}, path)
        with pytest.raises(SystemExit, match=f"does not match the model it describes \\(\\s*{reason}"):
            load_checkpoint(path)


@pytest.fixture
def five_hours_behind_utc(monkeypatch):
    """The local clock 5 hours behind UTC, whatever the machine's: a name taken from UTC by
    mistake would then be 5 hours off."""
    if not hasattr(time, "tzset"):
        pytest.skip("this system's time module cannot change its zone")
    monkeypatch.setenv("TZ", "EST5")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_an_earlier_run_s_log_is_kept_under_the_local_time_that_run_last_wrote(tmp_path, five_hours_behind_utc):
    # The folder's name tells the runs apart in TensorBoard: when the earlier run ended, on the
    # learner's clock, not when the new one began.
    run = tmp_path / "runs" / "grpo" / "kl-0.05"
    write_points(run, False, {0: 1.0})
    [events] = run.iterdir()
    last_written = calendar.timegm((2024, 3, 5, 19, 7, 9))  # 14:07:09 at 5 hours behind UTC
    os.utime(events, (last_written, last_written))
    write_points(run, False, {0: 2.0})
    assert (run / "earlier-2024-03-05-140709" / events.name).exists()
