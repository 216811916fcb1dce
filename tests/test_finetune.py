import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import finetune
import train
from checkpoints import read_checkpoint, save_checkpoint
from data import LOWERCASE_WORD, SEED, instruction
from files import read_instructions, read_words
from model import GPT, TINY, Config
from tokenizer import encode_prompt, load_tokenizer


def test_only_the_story_and_its_end_are_targets():
    examples = [([9, 1, 2, 3, 4, 5, 9], 3), ([9, 1, 2, 6, 9], 3)]  # prompt of 3, then the story
    x, y = finetune.collate(examples, pad=0, device="cpu")
    padding = finetune.ALIGN - 6  # the longest example's 6 positions, rounded up
    assert x.tolist() == [[9, 1, 2, 3, 4, 5] + [0] * padding, [9, 1, 2, 6, 0, 0] + [0] * padding]
    assert y.tolist() == [[-1, -1, 3, 4, 5, 9] + [-1] * padding, [-1, -1, 6, 9, -1, -1] + [-1] * padding]


@pytest.mark.parametrize("tokens, positions", [(17, 16), (18, 32), (218, 224), (256, 256), (257, 256)])
def test_a_batch_is_rounded_up_to_a_multiple_of_align_never_past_the_context(tokens, positions):
    x, y = finetune.collate([(list(range(tokens)), 1)], pad=0, device="cpu")  # tokens - 1 positions
    assert x.shape == y.shape == (1, positions)
    assert y[0, :tokens - 1].tolist() == list(range(1, tokens))  # every token a target, none lost


def test_examples_are_prompt_story_and_end_cut_at_the_context(workspace, tmp_path):
    tokenizer = load_tokenizer(workspace / "data")
    ordinary = json.loads((workspace / "data" / "instructions.jsonl").read_text().splitlines()[0])
    long = {**ordinary, "story": " ".join(["The kite flew over the river."] * 100)}
    (tokens, prompt_length), (cut, _) = (finetune.encode_example(tokenizer, e) for e in (ordinary, long))
    prompt = encode_prompt(tokenizer, ordinary["instruction"])
    assert tokens == prompt + tokenizer.encode(ordinary["story"]) + [tokenizer.eot]
    assert prompt_length == len(prompt)
    assert len(cut) == finetune.MAX_LENGTH and cut[-1] != tokenizer.eot  # cut, so it lost its end


def test_fine_tuning_makes_the_instruction_loss_fall(workspace):
    tokenizer = load_tokenizer(workspace / "data")
    examples = [finetune.encode_example(tokenizer, e) for e in read_instructions(workspace / "data" / "instructions.jsonl")[:64]]
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=tokenizer.vocab_size, **TINY))
    optimizer = train.make_optimizer(model, lr=3e-3)
    before = finetune.instruction_loss(model, examples, tokenizer.eot, "cpu", "fp32")
    for step in range(40):
        batch = [examples[i] for i in np.random.default_rng(step).choice(64, 8)]
        x, y = finetune.collate(batch, tokenizer.eot, "cpu")
        train.train_step(model, optimizer, x, y, "cpu", "fp32", 3e-3)
    after = finetune.instruction_loss(model, examples, tokenizer.eot, "cpu", "fp32")
    assert after < before - 1.0


def test_each_pass_asks_each_story_for_words_it_uses_drawn_anew(workspace):
    tokenizer = load_tokenizer(workspace / "data")
    instructions = read_instructions(workspace / "data" / "instructions.jsonl")[:40]
    stories = [i["story"] for i in instructions]
    askable, _ = read_words(workspace / "data" / "words.json")
    first, second = ([finetune.encode_example(tokenizer, finetune.ask_anew(story, askable, seed, words=3))
                      for story in stories] for seed in (SEED, SEED + 1))
    assert first == [finetune.encode_example(tokenizer, i) for i in instructions]  # the file's words first
    prompts = [tokenizer.decode(tokens[1:length]) for tokens, length in second]
    assert sum(a != b for a, b in zip(first, second)) > 20  # most stories are asked for other words
    for prompt, story in zip(prompts, stories):
        words = asked_words(prompt)
        assert len(words) == 3 and all(word in story for word in words)


def test_a_story_asked_for_more_words_names_that_many_of_its_own_in_its_instruction(workspace):
    askable, _ = read_words(workspace / "data" / "words.json")
    stories = [i["story"] for i in read_instructions(workspace / "data" / "instructions.jsonl")[:40]]
    for story in stories:
        example = finetune.ask_anew(story, askable, SEED + 1, words=8)
        words = example["words"]
        own = set(LOWERCASE_WORD.findall(story)) & askable
        assert len(set(words)) == len(words) == min(8, len(own)) and set(words) <= own
        assert example["instruction"] == f"Write a story that uses the words {', '.join(words[:-1])} and {words[-1]}.\n"
        assert asked_words(example["instruction"]) == words
    assert sum(len(finetune.ask_anew(story, askable, SEED, words=8)["words"]) > 3 for story in stories) > 30
    # Three words read as the files and the evaluation write them.
    assert instruction(["kite", "river", "brave"]) == "Write a story that uses the words kite, river and brave.\n"


def asked_words(prompt):
    return prompt.removeprefix("Write a story that uses the words ").rstrip(".\n").replace(" and", ",").split(", ")


def test_a_pass_asks_each_story_asks_times_with_seeds_new_on_each_pass():
    rng = np.random.default_rng(0)
    first, second = finetune.a_pass(rng, 40, 2, 0), finetune.a_pass(rng, 40, 2, 1)
    assert sorted(first) == [(story, SEED + k) for story in range(40) for k in (0, 1)]
    assert sorted(second) == [(story, SEED + 2 + k) for story in range(40) for k in (0, 1)]
    # Shuffled: a story's two asks are not side by side, and the passes' orders differ.
    assert sum(a[0] == b[0] for a, b in zip(first, first[1:])) < 5
    assert [story for story, _ in first] != [story for story, _ in second]
    # Another training seed asks for other words on every pass, the first one included: two
    # seeds never share an ask's seed, not even a pass apart.
    def ask_seeds(seed):
        return {ask for epoch in range(20) for _, ask in finetune.a_pass(np.random.default_rng(0), 40, 2, epoch, seed)}
    assert not ask_seeds(2) & ask_seeds(3) and not ask_seeds(SEED) & ask_seeds(SEED + 1)
    assert ask_seeds(SEED) == set(range(SEED, SEED + 40))  # the default seed's asks: SEED to SEED + 39


NOUNS = {"kite", "river", "cake", "frog", "boat", "pond", "hat", "sun", "kites", "boats", "frogs"}
STORY = "The kite flew over the river. Kite up high! The frog saw the kite and jumped."


def test_a_swap_replaces_each_asked_noun_throughout_the_story_and_asks_for_the_new_one():
    example = {"words": ["kite", "river", "jumped"], "instruction": "", "story": STORY}
    swapped = finetune.swap_nouns(example, NOUNS, 1.0, seed=0)
    kite, river, jumped = swapped["words"]
    assert jumped == "jumped"  # not a noun: left alone
    assert {kite, river} <= NOUNS - {"kite", "river", "frog"} - {"kites", "boats", "frogs"}  # singular, not in the story
    assert kite != river
    assert swapped["story"] == (STORY.replace("kite", kite).replace("Kite", kite.capitalize())
                                .replace("river", river))
    assert swapped["instruction"] == f"Write a story that uses the words {kite}, {river} and jumped.\n"
    assert finetune.swap_nouns(example, NOUNS, 1.0, seed=0) == swapped  # the same for a seed
    assert any(finetune.swap_nouns(example, NOUNS, 1.0, seed=s)["words"] != swapped["words"] for s in range(1, 5))


def test_a_swap_share_swaps_about_that_share_of_the_asked_nouns():
    example = {"words": ["kite", "river", "frog"], "instruction": "", "story": STORY}
    swapped = [word != old for seed in range(200)
               for old, word in zip(example["words"], finetune.swap_nouns(example, NOUNS,
                                                                          0.5, seed)["words"])]
    assert 0.4 < np.mean(swapped) < 0.6
    assert finetune.swap_nouns(example, NOUNS, 0.0, seed=0)["story"] == STORY


def test_swapped_examples_from_the_real_words_ask_for_words_their_story_uses(workspace):
    tokenizer = load_tokenizer(workspace / "data")
    askable, nouns = read_words(workspace / "data" / "words.json")
    stories = [i["story"] for i in read_instructions(workspace / "data" / "instructions.jsonl")[:40]]
    changed = 0
    for story in stories:
        tokens, length = finetune.encode_example(tokenizer, finetune.ask_anew(story, askable, SEED, nouns, swap=1.0))
        words, text = asked_words(tokenizer.decode(tokens[1:length])), tokenizer.decode(tokens[length:])
        assert all(word in text for word in words)
        changed += text.removesuffix(tokenizer.decode([tokenizer.eot])) != story
    assert changed > 30  # the test corpus asks for nouns


def test_plain_rows_are_windows_of_the_pretraining_tokens_every_token_a_target():
    tokens = np.arange(1000, dtype=np.uint16)
    windows = finetune.plain_windows(tokens, np.random.default_rng(0), 3)
    assert len(windows) == 3
    for window, prompt_length in windows:
        assert prompt_length == 1 and len(window) == finetune.MAX_LENGTH + 1
        assert window == list(range(window[0], window[0] + finetune.MAX_LENGTH + 1))  # consecutive tokens
    _, y = finetune.collate(windows, pad=0, device="cpu")
    assert y.tolist() == [window[1:] for window, _ in windows]  # every token but the first is a target
    assert finetune.plain_windows(tokens, np.random.default_rng(0), 0) == []


def test_each_lever_names_its_own_folder():
    def name(lr=finetune.LR, asks=1, plain_share=finetune.PLAIN_SHARE, swap=finetune.SWAP, words=finetune.WORDS,
             first_use_weight=1.0, seed=SEED):
        return finetune.run_name(argparse.Namespace(lr=lr, asks=asks, plain_share=plain_share, swap=swap, words=words,
                                                    first_use_weight=first_use_weight, seed=seed))
    assert name() == "finetune"
    assert [name(lr=3e-4), name(asks=3), name(plain_share=0), name(swap=1), name(words=8), name(first_use_weight=10),
            name(seed=2)] == ["finetune-lr-0.0003", "finetune-asks-3", "finetune-plain-0", "finetune-swap-1",
                              "finetune-words-8", "finetune-first-use-10", "finetune-seed-2"]
    assert name(words=3, plain_share=0.5, seed=3) == "finetune-plain-0.5-words-3-seed-3"
    assert name(asks=2) == "finetune-asks-2"  # any asks but 1: never over checkpoints/finetune


def test_the_first_use_of_each_asked_word_is_weighed_and_nothing_else(workspace):
    tokenizer = load_tokenizer(workspace / "data")
    example = {"words": ["kite", "river", "moon"], "instruction": instruction(["kite", "river", "moon"]),
               "story": "Tom had a red kite. The kite flew over the river, and the river was wide."}  # no moon
    encoded = [finetune.encode_example(tokenizer, example)]
    batch = encoded + finetune.plain_windows(np.arange(1000, dtype=np.uint16), np.random.default_rng(0), 1)
    _, y = finetune.collate(batch, tokenizer.eot, "cpu")
    weights = finetune.first_use_weights(tokenizer, [example], encoded, y, 10.0)
    kite, river = (tokenizer.encode(" " + word)[0] for word in ("kite", "river"))
    first = [y[0].tolist().index(token) for token in (kite, river)]  # the first target that is each word
    assert [(row, place) for row, place in (weights != 1).nonzero().tolist()] == [(0, place) for place in sorted(first)]
    assert weights[0, first].tolist() == [10.0, 10.0] and bool((weights[1] == 1).all())


def test_the_weighted_step_is_the_weighted_mean_of_the_targets_losses():
    torch.manual_seed(0)
    model = GPT(Config(**{**TINY, "vocab_size": 50})).eval()  # no dropout, so the two losses meet
    optimizer = train.make_optimizer(model, 1e-3)
    x, y = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 12))
    y[1, 8:] = -1  # padding, never a target
    weights = torch.ones(y.shape)
    weights[0, 3] = weights[1, 8] = 5.0  # the second is on padding: it counts for nothing
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1,
                                                   reduction="none").view(2, 12)
    by_hand = (losses.sum() + 4 * losses[0, 3]) / (20 + 4)  # 20 targets, one of them counted 5 times
    step = finetune.weighted_step(model, optimizer, x, y, weights, "cpu", "fp32", 1e-3)
    assert step == pytest.approx(by_hand.item(), rel=1e-5)
    assert finetune.weighted_step(model, optimizer, x, y, torch.ones(y.shape), "cpu", "fp32", 0.0) == pytest.approx(
        model(x, y)[1].item(), rel=1e-5)  # weights of 1: the training step's mean


def test_the_held_back_instructions_are_never_trained_on():
    instructions = list(range(finetune.HELD_BACK + 300))
    training, held = finetune.split_held_back(instructions)
    assert len(held) == finetune.HELD_BACK and not set(training) & set(held)
    assert sorted(training + held) == instructions
    assert finetune.split_held_back(instructions) == (training, held)  # the same for every run


def test_every_plain_window_is_a_whole_context_even_at_the_end_of_the_tokens():
    tokens = np.arange(finetune.MAX_LENGTH + 3, dtype=np.uint16)  # a start past 2 would cut a window short
    windows = finetune.plain_windows(tokens, np.random.default_rng(0), 200)
    assert all(len(window) == finetune.MAX_LENGTH + 1 for window, _ in windows)


def test_a_swap_replaces_whole_words_only():
    # "cat" swapped must leave "catch" and "Catch" as they are: only the word itself is the asked noun.
    example = {"words": ["cat", "ball"], "instruction": "", "story": "Cat tried to catch the ball. Catch it, cat!"}
    swapped = finetune.swap_nouns(example, {"cat", "dog"}, 1.0, seed=0)
    assert swapped["words"] == ["dog", "ball"]
    assert swapped["story"] == "Dog tried to catch the ball. Catch it, dog!"


@pytest.mark.parametrize("noun, plural", [("kites", True), ("boats", True), ("kite", False), ("glass", False),
                                          ("bus", False), ("cactus", False)])
def test_a_noun_ending_in_ss_or_us_is_not_taken_for_a_plural(noun, plural):
    # A singular noun is swapped for a singular one: "glass" and "bus" are singular, though they end in s.
    assert finetune.is_plural(noun) is plural


def test_a_noun_with_no_free_noun_to_take_its_place_stays():
    example = {"words": ["kite", "river", "jumped"], "instruction": "", "story": "The kite saw a boat by the river."}
    swapped = finetune.swap_nouns(example, {"kite", "river", "boat", "cakes"}, 1.0, seed=0)
    assert swapped["words"] == example["words"] and swapped["story"] == example["story"]


def test_two_asked_nouns_are_never_swapped_for_the_same_one():
    nouns = {"kite", "river", "cake", "boat"}  # for kite and river, only cake and boat are free
    example = {"words": ["kite", "river", "jumped"], "instruction": "", "story": "The kite flew over the river."}
    for seed in range(20):
        kite, river, _ = finetune.swap_nouns(example, nouns, 1.0, seed)["words"]
        assert {kite, river} == {"cake", "boat"}


def test_the_instruction_loss_is_the_mean_over_all_story_tokens_and_leaves_dropout_on(workspace_tokenizer):
    tokenizer = workspace_tokenizer
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=tokenizer.vocab_size, **TINY))  # in training mode
    # One batch of 16 long examples, then one short one: its few tokens weigh little.
    examples = [([tokenizer.eot, 5] + [7 + i % 50 for i in range(60)], 2)] * finetune.BATCH + [([tokenizer.eot, 5, 9], 2)]
    loss = finetune.instruction_loss(model, examples, tokenizer.eot, "cpu", "fp32")
    assert model.training  # training goes on with its dropout
    model.eval()
    with torch.no_grad():
        x, y = finetune.collate(examples, tokenizer.eot, "cpu")
        assert loss == pytest.approx(model(x, y)[1].item(), rel=1e-5)


def tiny_pretrained_model_in(folder, workspace, monkeypatch):
    """A copy of the workspace's data in folder, made the current folder, with a tiny model
    saved as checkpoints/pretrain; returns the tokenizer."""
    shutil.copytree(workspace / "data", folder / "data")
    monkeypatch.chdir(folder)
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=tokenizer.vocab_size, **TINY))
    save_checkpoint(folder / "checkpoints" / "pretrain", model, tokenizer, {"script": "train.py", "step": 1})
    return tokenizer


def test_the_run_s_levers_reach_its_steps(workspace, tmp_path, monkeypatch):
    """--lr is the schedule's peak, --words the words asked, and each pass asks anew."""
    tokenizer = tiny_pretrained_model_in(tmp_path, workspace, monkeypatch)
    lrs, asked, real_ask = [], [], finetune.ask_anew

    def ask_anew(story, askable, seed, *args):
        example = real_ask(story, askable, seed, *args)
        asked.append((story, seed, example["words"]))
        return example

    monkeypatch.setattr(finetune, "train_step",
                        lambda model, optimizer, x, y, device, precision, lr, *rest: lrs.append(lr) or 0.0)
    monkeypatch.setattr(finetune, "ask_anew", ask_anew)
    monkeypatch.setattr(finetune, "instruction_loss", lambda *args: 0.0)
    monkeypatch.setattr(finetune, "valid_loss", lambda *args: 0.0)
    monkeypatch.setattr(finetune, "demo_story", lambda *args, **kwargs: "")
    stories = len(finetune.read_instructions(tmp_path / "data" / "instructions.jsonl")) - finetune.HELD_BACK
    instructions_a_step = round(finetune.BATCH * (1 - finetune.PLAIN_SHARE))  # the rest are plain stories
    steps = 2 * stories // instructions_a_step + 2  # over two passes and more
    monkeypatch.setattr(sys, "argv", ["finetune.py", "--steps", str(steps), "--lr", "3e-4", "--words", "4",
                                      "--device", "cpu", "--precision", "fp32"])
    finetune.main()
    assert lrs[0] == pytest.approx(train.learning_rate(0, 0.0, 3e-4, finetune.MIN_LR, finetune.WARMUP))
    assert all(len(words) <= 4 for _, _, words in asked) and any(len(words) == 4 for _, _, words in asked)
    assert len({(story, seed) for story, seed, _ in asked}) == len(asked)  # no story asked twice with one seed
    assert read_checkpoint(tmp_path / "checkpoints" / "finetune-lr-0.0003-words-4")["made_by"]["step"] == steps


@pytest.fixture
def recorded_run(workspace, tmp_path, monkeypatch):
    """finetune.main() in a copy of the workspace, from a tiny pretrained model, with the steps, the losses and the
    demo story left out: run(*options) gives each step's record (its batch x and y, the stories asked for it, the
    weights of a weighted step, torch's seed), for the test to read what the options changed."""
    tokenizer = tiny_pretrained_model_in(tmp_path, workspace, monkeypatch)
    steps, asked, real_ask = [], [], finetune.ask_anew

    def ask_anew(story, *args):
        asked.append(story)
        return real_ask(story, *args)

    def record(x, y, weights=None):
        steps.append({"x": x.clone(), "y": y.clone(), "weights": weights, "stories": asked[:],
                      "torch_seed": torch.initial_seed()})
        asked.clear()
        return 0.0

    monkeypatch.setattr(finetune, "ask_anew", ask_anew)
    monkeypatch.setattr(finetune, "train_step", lambda model, optimizer, x, y, *rest: record(x, y))
    monkeypatch.setattr(finetune, "weighted_step", lambda model, optimizer, x, y, weights, *rest: record(x, y, weights))
    monkeypatch.setattr(finetune, "instruction_loss", lambda *args: 0.0)
    monkeypatch.setattr(finetune, "valid_loss", lambda *args: 0.0)
    monkeypatch.setattr(finetune, "demo_story", lambda *args, **kwargs: "")

    def run(*options, steps_run=2):
        steps.clear()
        monkeypatch.setattr(sys, "argv", ["finetune.py", "--steps", str(steps_run), "--device", "cpu",
                                          "--precision", "fp32", *options])
        finetune.main()
        return steps[:]
    run.steps = steps  # the steps taken so far, for a run that stops
    return run


PLAIN_ROWS = round(finetune.BATCH * finetune.PLAIN_SHARE)  # the last rows of a batch: windows of train.bin


def test_the_replay_draws_new_windows_at_each_step(recorded_run):
    # One generator draws the windows of every step: reseeded at each step, every step would replay the same ones.
    first, second = recorded_run()
    assert not torch.equal(first["x"][-PLAIN_ROWS:], second["x"][-PLAIN_ROWS:])
    assert first["x"].shape[0] == second["x"].shape[0] == finetune.BATCH


def test_another_seed_draws_other_stories_other_windows_and_other_dropout(recorded_run):
    # --seed reaches everything the run draws: the stories' order, the replay's windows and torch's seed (dropout).
    (default,), (other,) = recorded_run(steps_run=1), recorded_run("--seed", "2", steps_run=1)
    assert default["stories"] != other["stories"]  # another order of the stories, not only other words asked
    assert not torch.equal(default["x"][-PLAIN_ROWS:], other["x"][-PLAIN_ROWS:])
    assert (default["torch_seed"], other["torch_seed"]) == (SEED, 2)  # one process: the run's seed itself
    assert (recorded_run(steps_run=1)[0]["x"] == default["x"]).all()  # the same seed, the same batch


def test_a_first_use_weight_weighs_each_step_s_first_uses_with_it(recorded_run):
    # A weight other than 1 takes the weighted step at every step, the asked words' first uses weighing that much.
    steps = recorded_run("--first-use-weight", "10")
    assert len(steps) == 2 and all(step["weights"] is not None for step in steps)
    for step in steps:
        weights, y = step["weights"], step["y"]
        assert weights.shape == y.shape and set(weights.unique().tolist()) == {1.0, 10.0}
        assert bool((y[weights == 10] >= 0).all())  # only story tokens, never padding or the prompt
        assert bool((weights[-PLAIN_ROWS:] == 1).all())  # the replay's windows weigh 1
    assert all(step["weights"] is None for step in recorded_run())  # weight 1: the plain training step


def test_too_few_instructions_are_refused_in_one_line_before_training(recorded_run, monkeypatch):
    # HELD_BACK are kept out of training: the rest must fill a batch, or the run is refused before it starts.
    real_read = finetune.read_instructions
    monkeypatch.setattr(finetune, "read_instructions",
                        lambda *args, **kwargs: real_read(*args, **kwargs)[:finetune.HELD_BACK + finetune.BATCH - 1])
    with pytest.raises(SystemExit, match="too few") as refused:
        recorded_run()
    assert "\n" not in str(refused.value)
    assert recorded_run.steps == [] and not list(Path("checkpoints", "finetune").glob("*.pt"))  # nor a model saved


def test_fine_tuning_trains_on_its_training_split_and_measures_its_held_back_examples_and_valid_bin(
        recorded_run, monkeypatch):
    measured, plain = [], []
    monkeypatch.setattr(finetune, "instruction_loss", lambda model, examples, *args: measured.append(examples) or 0.0)
    monkeypatch.setattr(finetune, "valid_loss", lambda model, tokens, *args: plain.append(np.array(tokens)) or 0.0)
    steps = recorded_run(steps_run=2)
    training, held = finetune.split_held_back(read_instructions(limit=finetune.TUNE_POOL))
    asked = {story for step in steps for story in step["stories"]}
    assert asked and asked <= {e["story"] for e in training} and not asked & {e["story"] for e in held}
    assert measured and all(len(examples) == finetune.HELD_BACK for examples in measured)
    valid = np.array(train.load_tokens("valid"))
    assert plain and all(np.array_equal(tokens, valid) for tokens in plain)
