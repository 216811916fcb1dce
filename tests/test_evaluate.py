import errno
import json
import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import evaluate
from checkpoints import load_checkpoint, read_checkpoint
from evaluate import load_instructions, measure, model_name, words_used
from tokenizer import load_tokenizer


def test_the_held_out_stories_are_written_as_the_rollouts_write_them(monkeypatch):
    # Up to 200 tokens at temperature 1 with no top-k: the same stories the RL episodes score.
    import sample

    calls = []

    def recording(model, tokenizer, prompts, max_new_tokens, temperature=1.0, top_k=None, seed=0):
        calls.append((prompts, max_new_tokens, temperature, top_k, seed))
        return []

    monkeypatch.setattr(evaluate, "write_stories", recording)
    evaluate.heldout_stories(None, None, [{"instruction": "Write a story."}], seed=3)
    assert calls == [(["Write a story."], sample.MAX_NEW_TOKENS, 1.0, None, 3)] and sample.MAX_NEW_TOKENS == 200


@pytest.mark.parametrize("story, share", [
    ("The kite flew over the river. Brave Tom!", 1.0),
    ("THE KITE, the River... (and nothing else)", 2 / 3),
    ("A brave boy.", 1 / 3),
    ("", 0.0),
    ("Skites and kiteboards; a rainbow over the riverbank; bravely.", 0.0),  # only inside other words
    ("Two kites by the rivers, braver than ever.", 2 / 3),  # -s counts; -r does not
    ("kite-river-brave", 1.0),  # a dash separates words
])
def test_words_used_counts_whole_words_in_any_case(story, share):
    assert words_used(story, ["kite", "river", "brave"]) == pytest.approx(share)


@pytest.mark.parametrize("word, story, used", [
    # One form a story, so that each form is checked on its own.
    ("jump", "He jumped.", True), ("jump", "She jumps.", True), ("jump", "They were jumping.", True),
    ("bake", "They baked.", True), ("bake", "She was baking.", True), ("bake", "He bakes.", True),
    ("box", "Boxes!", True), ("wish", "Two wishes.", True), ("buzz", "It buzzes.", True),
    ("watch", "She watches.", True), ("box", "Boxs!", False), ("watch", "She watchs.", False),
    ("cry", "She cried.", True), ("cry", "She cries.", True), ("cry", "She was crying.", True),
    ("cry", "She crys.", False),
    ("play", "They played.", True), ("play", "She plays.", True), ("play", "Playing!", True),
    ("play", "She plaies.", False), ("stay", "He stayed.", True),
    ("stop", "It stopped.", True), ("stop", "It was stopping.", True), ("run", "Running!", True),
    ("run", "He ran.", False),
    ("cake", "The cakes' box.", True), ("kite", "Lily's kite", True),
    ("car", "A card.", False), ("win", "The wind.", False), ("ten", "They tend it.", False),
    ("car", "She cares.", False), ("rain", "The brain.", False),
    ("rain", "It rainned.", False), ("look", "He lookked.", False),  # two vowels: no doubling
    ("tie", "He was tying it.", True), ("tie", "He tied it.", True), ("tie", "He was tiing it.", False),
    ("agree", "They were agreeing.", True), ("agree", "They agreed.", True), ("eye", "Eyeing it.", True),
    ("open", "She opened it.", True), ("admit", "He admitted it.", True), ("admit", "He admited it.", True),
    ("travel", "They traveled.", True), ("travel", "They travelled.", True),
    # Another word's forms: hope's, being, care's, hate's, stare's.
    ("hop", "She hoped.", False), ("hop", "Hoping!", False), ("hop", "It hopped.", True),
    ("bee", "It was being good.", False), ("car", "She cared.", False), ("hat", "He hated it.", False),
    ("star", "They were staring.", False), ("star", "She starred.", True),
    ("crayon", "She crayoned it.", True), ("crayon", "She crayonned it.", True),  # y before a vowel: two syllables
])
def test_inflection_rule(word, story, used):
    assert words_used(story, [word]) == float(used)


def test_a_word_used_again_and_again_counts_once():
    # The reward is the share of the asked words a story uses: each asked word once, however often.
    assert words_used("A kite, a kite, and a kite again.", ["kite", "river", "brave"]) == pytest.approx(1 / 3)
    assert words_used("Kites! The kite flew. Kiting.", ["kite", "river", "brave"]) == pytest.approx(1 / 3)


# Each last consonant that doubles before -ed and -ing after a single vowel, in a word that ends so.
@pytest.mark.parametrize("word, doubled", [
    ("rob", "robbed"), ("nod", "nodding"), ("hug", "hugged"), ("trek", "trekked"), ("travel", "travelled"),
    ("hum", "humming"), ("plan", "planned"), ("stop", "stopping"), ("star", "starred"), ("stir", "stirring"),
    ("pat", "patted"),
])
def test_a_last_consonant_doubles_before_ed_and_ing(word, doubled):
    assert evaluate.DOUBLES.search(word)
    assert words_used(f"They {doubled} all day.", [word]) == 1.0


@pytest.mark.parametrize("path, name", [
    ("checkpoints/ppo/kl-0.05", "ppo-kl-0.05"),
    ("checkpoints/grpo/kl-0/model.pt", "grpo-kl-0"),
    ("checkpoints/grpo/kl-0.05/rollout-10.pt", "rollout-10"),
    ("checkpoints/finetune", "finetune"),
    ("checkpoints/finetune/model.pt", "finetune"),
    ("checkpoints/dpo/", "dpo"),
    ("checkpoints/klaus", "klaus"),  # only a KL weight's folder, kl-, takes its parent's name
])
def test_model_names(path, name):
    assert model_name(path) == name


@pytest.mark.parametrize("path, name", [
    ("checkpoints/ppo/kl-0.05/rollout-10.pt", "ppo-kl-0.05-rollout-10"),
    ("checkpoints/grpo/kl-0.05/rollout-10.pt", "grpo-kl-0.05-rollout-10"),
    ("checkpoints/grpo/kl-0.05", "grpo-kl-0.05"),
    ("checkpoints/finetune/model.pt", "finetune"),
    ("old/checkpoints/finetune", "finetune"),
    ("checkpoints/ppo/x/../kl-0.05", "ppo-kl-0.05"),  # the same folder, however it is written
    ("checkpoints/old/checkpoints/finetune", "finetune"),  # below the last checkpoints/
])
def test_saved_results_are_named_after_the_path_so_two_runs_never_collide(path, name):
    assert evaluate.saved_name(path) == name


def test_a_model_in_the_folder_you_are_in_is_named_after_that_folder(tmp_path, monkeypatch):
    # Its results are saved under its whole path, as no folder under checkpoints/ names it.
    (tmp_path / "my-model" / "inside").mkdir(parents=True)
    (tmp_path / "checkpoints").mkdir()
    whole_path = "-".join((tmp_path / "my-model").parts[1:])
    monkeypatch.chdir(tmp_path / "my-model")
    for path in ("model.pt", ".", "inside/../model.pt"):
        assert (model_name(path), evaluate.saved_name(path)) == ("my-model", whole_path)
    monkeypatch.chdir(tmp_path / "my-model" / "inside")
    assert (model_name("../model.pt"), evaluate.saved_name("../model.pt")) == ("my-model", whole_path)
    monkeypatch.chdir(tmp_path)
    assert evaluate.saved_name("checkpoints") == "-".join((tmp_path / "checkpoints").parts[1:])


def test_a_model_under_checkpoints_is_saved_under_one_name_from_wherever_it_is_given(tmp_path, monkeypatch):
    (tmp_path / "checkpoints" / "grpo" / "kl-0.05" / "inside").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert evaluate.saved_name("checkpoints/grpo/kl-0.05") == "grpo-kl-0.05"
    monkeypatch.chdir(tmp_path / "checkpoints" / "grpo" / "kl-0.05")
    assert [evaluate.saved_name(path) for path in (".", "model.pt", "rollout-10.pt")] == [
        "grpo-kl-0.05", "grpo-kl-0.05", "grpo-kl-0.05-rollout-10"]
    # Not rollout-10, which another run's rollout-10 would overwrite.
    monkeypatch.chdir("inside")
    assert evaluate.saved_name("../rollout-10.pt") == "grpo-kl-0.05-rollout-10"
    # A checkpoint saved under another name is a file, not a folder holding model.pt.
    (tmp_path / "checkpoints" / "grpo" / "kl-0.05" / "mine.pth").write_bytes(b"")
    assert (model_name("../mine.pth"), evaluate.saved_name("../mine.pth")) == ("mine", "grpo-kl-0.05-mine")


def test_a_model_outside_checkpoints_is_saved_under_its_whole_path_from_wherever_it_is_given(tmp_path, monkeypatch):
    (tmp_path / "mine" / "finetune" / "inside").mkdir(parents=True)
    whole = "-".join((tmp_path / "mine" / "finetune").parts[1:])
    monkeypatch.chdir(tmp_path)
    assert evaluate.saved_name("mine/finetune") == whole
    monkeypatch.chdir(tmp_path / "mine" / "finetune" / "inside")
    assert [evaluate.saved_name(path) for path in ("..", "../../finetune")] == [whole, whole]
    # Another folder of the same name elsewhere is another file.
    assert evaluate.saved_name("finetune") != whole


def test_a_model_given_by_its_whole_path_outside_checkpoints_is_saved_under_runs(tmp_path):
    # Its whole path, the root left out: a name under runs/evaluate/, not a path from the root.
    name = evaluate.saved_name(str(tmp_path / "mine"))
    assert name == "-".join((tmp_path / "mine").parts[1:])


def test_times_used_counts_every_form_of_a_word():
    assert evaluate.times_used("Cake! The cakes, and more cake. A cupcake.", "cake") == 3
    assert evaluate.times_used("It rained and rained; rainbows.", "rain") == 2


def test_heldout_instructions_load_and_a_wrong_file_is_refused(workspace, tmp_path):
    instructions = load_instructions(workspace / "heldout.json")
    assert len(instructions) == 50 and sum(len(i["words"]) for i in instructions) == 150
    with pytest.raises(SystemExit, match="comes with the repository"):
        load_instructions(tmp_path / "missing.json")
    (tmp_path / "heldout.json").write_text(json.dumps({"version": 1, "instructions": instructions[:49]}))
    with pytest.raises(SystemExit, match="50 held-out"):
        load_instructions(tmp_path / "heldout.json")


@pytest.fixture
def uniform_model(workspace):
    """A model whose every logit is 0: its loss is exactly log(vocabulary), and it never
    prefers the end-of-text token."""
    tokenizer = load_tokenizer(workspace / "data")
    model = load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=tokenizer, quiet=True).eval()
    with torch.no_grad():
        model.ln.weight.zero_()
        model.ln.bias.zero_()
    return model, tokenizer


def test_metrics_of_a_uniform_model_match_a_hand_computation(workspace, uniform_model, monkeypatch):
    model, tokenizer = uniform_model
    instructions = load_instructions(workspace / "heldout.json")
    valid = np.memmap(workspace / "data" / "valid.bin", dtype=np.uint16, mode="r")
    # Two stories end, with the first of their three words, and the others run on without them.
    written = [tokenizer.encode(f"A {i['words'][0]}.") + [tokenizer.eot] if n < 2 else tokenizer.encode("Nothing.")
               for n, i in enumerate(instructions)]
    monkeypatch.setattr(evaluate, "write_stories", lambda *args, **kwargs: written)
    result = measure(model, tokenizer, instructions, valid, "cpu")
    assert result["words_used"] == pytest.approx(2 / 3 / 50)
    assert result["ended"] == pytest.approx(2 / 50)
    assert result["uses_of_a_used_word"] == 1.0
    assert result["valid_loss"] == pytest.approx(math.log(tokenizer.vocab_size), rel=1e-5)


def test_a_used_word_s_uses_average_over_the_seeds_that_used_one(workspace, uniform_model, monkeypatch):
    # The first seed's stories use no word; the second's each use their first word twice.
    model, tokenizer = uniform_model
    instructions = load_instructions(workspace / "heldout.json")
    valid = np.memmap(workspace / "data" / "valid.bin", dtype=np.uint16, mode="r")

    def stories(model, tokenizer, instructions, seed):
        if seed == evaluate.SEED:
            return [tokenizer.encode("Nothing.") for _ in instructions]
        return [tokenizer.encode(f"A {i['words'][0]} and a {i['words'][0]}.") for i in instructions]

    monkeypatch.setattr(evaluate, "heldout_stories", stories)
    result = measure(model, tokenizer, instructions, valid, "cpu", seeds=2, windows=4)
    assert result["words_used_by_seed"] == [0.0, pytest.approx(1 / 3)]
    assert result["uses_of_a_used_word"] == 2.0


def test_command_line_prints_the_table_and_saves_json(workspace, monkeypatch, capsys):
    # Stories known in advance, one set for each seed: with seed 0, every story uses its first
    # word and has its second only inside another word, and ends; with seed 1, the first 10
    # stories use all three words and none ends. So the words used are 1/3 and 10/50.
    def written(model, tokenizer, prompts, max_new_tokens, seed):
        instructions = load_instructions()
        assert prompts == [i["instruction"] for i in instructions]
        if seed == 0:
            return [tokenizer.encode(f"A {w[0]} and a {w[1]}s{w[1]}.") + [tokenizer.eot]
                    for w in (i["words"] for i in instructions)]
        return [tokenizer.encode(f"{', '.join(i['words'])}!" if n < 10 else "Nothing.")
                for n, i in enumerate(instructions)]

    monkeypatch.setattr(evaluate, "write_stories", written)
    monkeypatch.chdir(workspace)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "checkpoints/finetune", "--seeds", "2", "--device", "cpu"])
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(args) or real_load(*args, **kwargs))
    evaluate.main()
    assert len(loads) == 1  # the checkpoint, read once for its model and what made it
    out = capsys.readouterr().out
    saved = json.loads((workspace / "runs" / "evaluate" / "finetune.json").read_text())
    assert saved["words_used_by_seed"] == pytest.approx([1 / 3, 10 / 50])
    assert saved["words_used"] == pytest.approx((1 / 3 + 10 / 50) / 2)
    assert saved["ended"] == pytest.approx(0.5) and saved["uses_of_a_used_word"] == pytest.approx(1.0)
    # What made the model comes with its figures.
    assert saved["made_by"] == json.loads(json.dumps(read_checkpoint(workspace / "checkpoints" / "finetune")["made_by"]))
    # The stories kept are seed 0's, each with its words and the share it uses.
    instructions = load_instructions()  # the committed set
    assert [s["words"] for s in saved["stories"]] == [i["words"] for i in instructions]
    assert all(s["story"].startswith(f"A {s['words'][0]} and a ") for s in saved["stories"])
    assert [s["words_used"] for s in saved["stories"]] == pytest.approx([1 / 3] * 50)
    assert f"| finetune | 27% (20% to 33%) | {saved['valid_loss']:.2f} | 50% | 1.0 |" in out


def test_the_loss_on_plain_stories_is_the_mean_over_the_windows_asked_for(workspace, workspace_model, monkeypatch):
    # --valid-windows 4: the loss of 4 windows spread evenly over valid.bin, by hand, not that
    # of pretraining's 256 (the files of the shared sample and the full download differ in size).
    tokenizer = load_tokenizer(workspace / "data")
    instructions = load_instructions(workspace / "heldout.json")
    valid = np.memmap(workspace / "data" / "valid.bin", dtype=np.uint16, mode="r")
    monkeypatch.setattr(evaluate, "write_stories", lambda *args, **kwargs: [[tokenizer.eot]] * len(instructions))
    context = workspace_model.config.context
    by_hand = []
    for start in np.linspace(0, len(valid) - context - 1, 4).astype(np.int64):
        window = torch.tensor(valid[start:start + context + 1].astype(np.int64))
        with torch.no_grad():
            logits, _ = workspace_model(window[None, :-1])
        by_hand.append(torch.nn.functional.cross_entropy(logits[0], window[1:]).item())
    assert len(set(by_hand)) == 4  # the windows' losses differ: another number of windows would move the mean
    result = measure(workspace_model, tokenizer, instructions, valid, "cpu", windows=4)
    # Close: a random model's losses are all near log(400), and 256 windows' mean is 6e-5 off, relatively.
    assert result["valid_loss"] == pytest.approx(np.mean(by_hand), rel=1e-6)


@pytest.mark.parametrize("args", [["--valid-windows", "0"], ["--valid-windows", "-2"], ["--seeds", "0"]])
def test_no_windows_or_no_seeds_get_one_line(args, run_main, monkeypatch, capsys):
    # --valid-windows 0 would measure the loss on no window at all: a division by zero, after the stories.
    monkeypatch.setattr(evaluate, "load_tokenizer", lambda: pytest.fail("it went on past the check"))
    with pytest.raises(SystemExit):
        run_main(evaluate, "checkpoints/finetune", *args)
    assert "error: --seeds and --valid-windows must be at least 1 (or --valid-windows all)" in capsys.readouterr().err


def test_a_results_folder_that_cannot_be_written_is_refused_before_any_story_is_written(workspace, tmp_path,
                                                                                      monkeypatch):
    # A full disk under runs/evaluate: one line at the start, not after a model's minutes of stories.
    shutil.copytree(workspace / "data", tmp_path / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", tmp_path / "checkpoints" / "finetune")
    monkeypatch.setattr(evaluate, "write_stories", lambda *args, **kwargs: pytest.fail("it measured first"))

    def full(fd):  # a full disk may refuse the bytes only when they are written out
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "checkpoints/finetune", "--device", "cpu"])
    with pytest.raises(SystemExit, match="no space left on the disk for .*evaluate"):
        evaluate.main()


def test_results_cut_off_while_being_written_leave_the_earlier_results_whole(workspace, tmp_path, monkeypatch):
    # Written to a temporary file, then renamed: a run stopped halfway through writing the
    # JSON (Ctrl-C, a full disk) leaves the last run's results as they were, not half a file.
    shutil.copytree(workspace / "data", tmp_path / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", tmp_path / "checkpoints" / "finetune")
    earlier = tmp_path / "runs" / "evaluate" / "finetune.json"
    earlier.parent.mkdir(parents=True)
    earlier.write_text('{"model": "finetune", "valid_loss": 1.5}\n')
    tokenizer = load_tokenizer(workspace / "data")
    monkeypatch.setattr(evaluate, "write_stories", lambda model, tokenizer_, prompts, *args, **kwargs:
                        [[tokenizer.eot]] * len(prompts))
    real_write_text = Path.write_text

    def cut_off(path, text, *args, **kwargs):
        real_write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", cut_off)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "checkpoints/finetune", "--valid-windows", "4", "--device", "cpu"])
    with pytest.raises(KeyboardInterrupt):
        evaluate.main()
    monkeypatch.undo()
    assert json.loads(earlier.read_text()) == {"model": "finetune", "valid_loss": 1.5}
    assert [path.name for path in earlier.parent.iterdir()] == ["finetune.json"]  # no temporary file left
