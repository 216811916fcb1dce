import errno
import json
import pathlib
from collections import Counter

import numpy as np
import pytest
import torch

import preferences
from data import SEED, instruction


def test_asks_are_grouped_by_their_length_in_tokens(workspace, workspace_tokenizer):
    asks = preferences.load_asks(workspace_tokenizer, workspace / "data" / "instructions.jsonl")
    lines = (workspace / "data" / "instructions.jsonl").read_text().splitlines()
    assert sum(len(group) for group in asks.values()) == len(lines)
    for length, group in asks.items():
        assert all(len(tokens) == length and tokens[0] == workspace_tokenizer.eot and len(words) == 3
                   for tokens, words in group)
        assert torch.tensor([tokens for tokens, _ in group]).shape == (len(group), length)  # they stack


def test_asks_are_the_first_of_the_pool_whatever_the_file_holds(workspace, workspace_tokenizer, monkeypatch):
    monkeypatch.setattr(preferences, "ASK_POOL", 7)
    asks = preferences.load_asks(workspace_tokenizer, workspace / "data" / "instructions.jsonl")
    first = preferences.read_instructions(workspace / "data" / "instructions.jsonl")[:7]
    assert sorted(words for group in asks.values() for _, words in group) == sorted(e["words"] for e in first)


def test_a_pair_needs_a_better_and_a_worse_story():
    assert preferences.pick_pair([1 / 3, 1 / 3, 1 / 3, 1 / 3]) is None
    assert preferences.pick_pair([0.0, 2 / 3, 1 / 3, 2 / 3]) == (1, 0)
    # The first best and the first worst, wherever they lie.
    for rewards in ([0, 1, 1 / 3, 2 / 3], [2 / 3, 0, 1, 1 / 3], [1 / 3, 2 / 3, 0, 2 / 3, 0], [1, 0, 0, 1 / 3]):
        assert preferences.pick_pair(rewards) == (rewards.index(max(rewards)), rewards.index(min(rewards)))


def test_pairs_never_tie(workspace, workspace_tokenizer, workspace_model):
    examples = [json.loads(line) for line in (workspace / "data" / "instructions.jsonl").read_text().splitlines()]
    # Stories of a random tiny workspace_model rarely use a word; give them one to find in every example.
    examples = [{**e, "words": [e["words"][0], "a", "the"]} for e in examples[:24]]
    pairs = preferences.make_pairs(workspace_model, workspace_tokenizer, examples, stories_per=4, seed=0)
    assert pairs
    assert all(pair["chosen_reward"] > pair["rejected_reward"] for pair in pairs)


def test_a_pair_keeps_the_tokens_as_written_not_encoded_again(workspace_tokenizer, monkeypatch):
    eot = workspace_tokenizer.eot
    # Single bytes, as a model may write them: encoding their text again would merge them.
    written = [list(b" x") + [eot], list(b" a the") + [eot]]
    assert workspace_tokenizer.encode(" a the") != list(b" a the")
    monkeypatch.setattr(preferences, "write_stories", lambda *args, **kwargs: written)
    example = {"instruction": "Write a story that uses the words kite, a and the.\n", "words": ["kite", "a", "the"]}
    (pair,) = preferences.make_pairs(None, workspace_tokenizer, [example], stories_per=2)
    assert pair["chosen_tokens"] == written[1] and pair["rejected_tokens"] == written[0]
    assert pair["chosen"] == " a the<|endoftext|>"


def test_pairs_are_saved_with_their_settings_and_read_back(workspace, workspace_tokenizer, run_main, capsys):
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    pairs, settings = preferences.load_pairs(workspace_tokenizer, workspace / "data" / "preferences.json")
    assert settings["instructions"] == 16 and settings["stories"] == 3
    assert 0 < len(pairs) <= 16
    assert all(workspace_tokenizer.decode(p[f"{side}_tokens"]) == p[side] for p in pairs for side in ("chosen", "rejected"))
    # Each side's share of its words, on average over the pairs; then what the pairs differ by.
    chosen, rejected = (sum(p[f"{side}_reward"] for p in pairs) / len(pairs) for side in ("chosen", "rejected"))
    out = capsys.readouterr().out
    assert f"the chosen stories use {chosen:.0%} of their words on average, the rejected {rejected:.0%}" in out
    counted = [line for line in out.splitlines() if line.startswith("| ") and line.endswith(" |")][2:]
    assert sum(int(line.split(" | ")[-1].strip(" |")) for line in counted) == len(pairs)


def test_what_the_pairs_differ_by_counts_words_lengths_and_endings(capsys):
    eot, three, five = 0, ["kite", "river", "brave"], ["kite", "river", "brave", "frog", "hat"]
    # Words counted from each pair's own number of words; the commonest row first, though it sorts last.
    pairs = [{"words": three, "chosen_reward": 1 / 3, "rejected_reward": 0.0,
              "chosen_tokens": [5, 6, eot], "rejected_tokens": [5, 6, 7, 8, 9]},
             {"words": five, "chosen_reward": 3 / 5, "rejected_reward": 2 / 5,
              "chosen_tokens": [5, eot], "rejected_tokens": [5, 6, 7, eot]},
             {"words": five, "chosen_reward": 3 / 5, "rejected_reward": 2 / 5,
              "chosen_tokens": [5, 6, 7, 8], "rejected_tokens": [5, eot]}]
    preferences.what_they_differ_by(pairs, eot)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == ["| 3 words / 2 | 2 |", "| 1 word / 0 | 1 |"]
    assert lines[4] == "the chosen stories: 3 tokens on average, 67% of them end"
    assert lines[5] == "the rejected stories: 4 tokens on average, 67% of them end"


def test_no_pairs_leave_the_saved_pairs_as_they_were(workspace, run_main, monkeypatch):
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    saved = (workspace / "data" / "preferences.json").read_bytes()
    monkeypatch.setattr(preferences, "make_pairs", lambda *args: [])  # every group tied
    with pytest.raises(SystemExit, match="no pairs"):
        run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    assert (workspace / "data" / "preferences.json").read_bytes() == saved


def test_damaged_pairs_file_is_refused(workspace_tokenizer, tmp_path):
    (tmp_path / "preferences.json").write_text('{"pairs": [')
    with pytest.raises(SystemExit, match="python preferences.py"):
        preferences.load_pairs(workspace_tokenizer, tmp_path / "preferences.json")
    with pytest.raises(SystemExit, match="python preferences.py"):
        preferences.load_pairs(workspace_tokenizer, tmp_path / "missing.json")


def test_pairs_of_another_tokenizer_or_not_of_tokens_are_refused(workspace, workspace_tokenizer, small_tokenizer,
                                                                 run_main):
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    path = workspace / "data" / "preferences.json"
    # The data made again since (another tokenizer): the pairs' token numbers mean other things.
    with pytest.raises(SystemExit, match="made with another tokenizer than data/tokenizer.json; make it again"):
        preferences.load_pairs(small_tokenizer, path)
    saved = json.loads(path.read_text(encoding="utf-8"))
    # A file from before the pairs recorded their tokenizer: loaded where its tokens give its stories' text.
    unrecorded = {key: value for key, value in saved["settings"].items() if key != "tokenizer"}
    path.write_text(json.dumps({**saved, "settings": unrecorded}), encoding="utf-8")
    assert preferences.load_pairs(workspace_tokenizer, path)[0] == saved["pairs"]
    other_text = [{**saved["pairs"][0], "chosen": saved["pairs"][0]["chosen"] + " more"}, *saved["pairs"][1:]]
    path.write_text(json.dumps({"settings": unrecorded, "pairs": other_text}), encoding="utf-8")
    with pytest.raises(SystemExit, match="made with another tokenizer than data/tokenizer.json; make it again"):
        preferences.load_pairs(workspace_tokenizer, path)
    # A damaged pair in such a file is refused as damaged, not as another tokenizer's.
    damaged = [{**saved["pairs"][0], "chosen_tokens": "a story"}, *saved["pairs"][1:]]
    path.write_text(json.dumps({"settings": unrecorded, "pairs": damaged}), encoding="utf-8")
    with pytest.raises(SystemExit, match="not an instruction and two stories' tokens within the context"):
        preferences.load_pairs(workspace_tokenizer, path)
    for settings, pairs in ((["not", "settings"], saved["pairs"]), ([], saved["pairs"]), (saved["settings"], {})):
        path.write_text(json.dumps({"settings": settings, "pairs": pairs}), encoding="utf-8")
        with pytest.raises(SystemExit, match="is not a file of preference pairs"):
            preferences.load_pairs(workspace_tokenizer, path)
    for damage in ({"chosen_tokens": "a story"}, {"rejected_tokens": [workspace_tokenizer.vocab_size]},
                   {"rejected_tokens": [-1]}, {"rejected_tokens": []}, {"instruction": None},
                   {"chosen_tokens": [1] * (preferences.MAX_NEW_TOKENS + 1)},
                   {"instruction": "word " * 400},  # a story after it would not fit the context
                   {"instruction": "\ud800"}):  # a lone surrogate, which no text encodes
        damaged = {**saved, "pairs": [*saved["pairs"][1:], {**saved["pairs"][0], **damage}]}
        path.write_text(json.dumps(damaged), encoding="utf-8")
        with pytest.raises(SystemExit, match="not an instruction and two stories' tokens within the context"):
            preferences.load_pairs(workspace_tokenizer, path)
    path.write_text(json.dumps({**saved, "pairs": []}), encoding="utf-8")
    with pytest.raises(SystemExit, match="holds no pairs"):
        preferences.load_pairs(workspace_tokenizer, path)


def test_each_instruction_s_pair_is_made_of_the_stories_written_for_it(workspace_tokenizer, monkeypatch):
    tokenizer = workspace_tokenizer
    examples = [{"words": words, "instruction": instruction(words)}
                for words in (["kite", "river", "brave"], ["cake", "rain", "jump"])]
    # The k-th story written for a prompt uses k of its words, and names its instruction by number.
    def write_stories(model, tokenizer, prompts, max_new_tokens, seed):
        written, stories = Counter(), []
        for prompt in prompts:
            number = [e["instruction"] for e in examples].index(prompt)
            stories.append(tokenizer.encode(" ".join(examples[number]["words"][:written[prompt]]) + f" story {number}."))
            written[prompt] += 1
        return stories
    monkeypatch.setattr(preferences, "write_stories", write_stories)
    pairs = preferences.make_pairs(None, tokenizer, examples, stories_per=3)
    assert [pair["words"] for pair in pairs] == [e["words"] for e in examples]
    for number, pair in enumerate(pairs):
        assert pair["chosen"].endswith(f"story {number}.") and pair["rejected"].endswith(f"story {number}.")
        assert (pair["chosen_reward"], pair["rejected_reward"]) == (pytest.approx(2 / 3), 0)


def test_a_pair_whose_stories_tie_is_refused(workspace_tokenizer, tmp_path):
    pair = {"instruction": "x", "chosen_tokens": [1], "rejected_tokens": [2], "chosen_reward": 1 / 3,
            "rejected_reward": 1 / 3}
    settings = {"tokenizer": workspace_tokenizer.fingerprint()}
    (tmp_path / "preferences.json").write_text(json.dumps({"settings": settings, "pairs": [pair]}))
    with pytest.raises(SystemExit, match="not the better one"):
        preferences.load_pairs(workspace_tokenizer, tmp_path / "preferences.json")


@pytest.fixture
def recorded_chunks(workspace, monkeypatch):
    """What main() hands make_pairs, chunk by chunk: (examples, stories per instruction, seed). No chunk gives a
    pair, so the run ends without writing."""
    chunks = []
    monkeypatch.setattr(preferences, "make_pairs", lambda model, tokenizer, examples, stories_per, seed:
                        chunks.append((examples, stories_per, seed)) or [])
    return chunks


def test_the_instructions_are_a_seeded_sample_of_the_file_not_its_first(workspace, run_main, recorded_chunks):
    # A fixed sample of the whole pool, the series' seed's, in the file's order: not the file's first N.
    with pytest.raises(SystemExit, match="no pairs"):
        run_main(preferences, "--instructions", "40", "--device", "cpu")
    every = preferences.read_instructions(workspace / "data" / "instructions.jsonl")
    chosen = sorted(np.random.default_rng(SEED).permutation(len(every))[:40])
    used = [example for examples, _, _ in recorded_chunks for example in examples]
    assert used == [every[i] for i in chosen] and used != every[:40]


def test_each_chunk_of_instructions_is_written_with_its_own_seed(run_main, recorded_chunks):
    # SEED + the chunk's start: with one seed for all, each chunk would draw the same random numbers again.
    with pytest.raises(SystemExit, match="no pairs"):
        run_main(preferences, "--instructions", str(2 * preferences.CHUNK + 6), "--stories", "3", "--device", "cpu")
    chunk = preferences.CHUNK
    assert [(len(examples), stories, seed) for examples, stories, seed in recorded_chunks] == [
        (chunk, 3, SEED), (chunk, 3, SEED + chunk), (6, 3, SEED + 2 * chunk)]


def test_more_instructions_than_the_pool_holds_records_those_used(workspace, run_main, monkeypatch):
    # The shared sample holds 1,240 instructions, fewer than the default 2,000: the pairs'
    # settings say how many were written for, not how many were asked for.
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    pairs = preferences.load_pairs(preferences.load_tokenizer())[0]
    monkeypatch.setattr(preferences, "make_pairs", lambda model, tokenizer, examples, *args: pairs[:1])
    run_main(preferences, "--instructions", "100000", "--stories", "3", "--device", "cpu")
    pool = len(preferences.read_instructions(limit=preferences.ASK_POOL))
    assert 16 < pool < 100000
    assert json.loads(preferences.PAIRS.read_text(encoding="utf-8"))["settings"]["instructions"] == pool


def test_a_write_failing_midway_leaves_the_saved_pairs_as_they_were(workspace, run_main, monkeypatch):
    # The pairs go to a temporary file, renamed only once whole: a full disk stops the run in one line, the old intact.
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    path = workspace / "data" / "preferences.json"
    saved = path.read_bytes()
    monkeypatch.setattr(preferences, "make_pairs", lambda *args: json.loads(saved)["pairs"])  # the stories skipped

    def half_written(file, text, *args, **kwargs):
        with open(file, "w", encoding="utf-8") as out:
            out.write(text[:len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(pathlib.Path, "write_text", half_written)
    with pytest.raises(SystemExit, match="no space left on the disk") as stopped:
        run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    assert "\n" not in str(stopped.value)
    assert path.read_bytes() == saved
    assert not list(path.parent.glob(".preferences.json.*"))  # nor the half-written temporary file left


@pytest.mark.parametrize("option, value", [("--stories", "1"), ("--stories", "0"), ("--instructions", "0")])
def test_too_few_stories_or_instructions_are_refused_at_once(run_main, monkeypatch, capsys, option, value):
    # One story makes no pair: refused as the command is read, not after the model has written every story.
    monkeypatch.setattr(preferences, "load_checkpoint", lambda *args, **kwargs: pytest.fail("the run went on"))
    with pytest.raises(SystemExit) as refused:
        run_main(preferences, option, value, "--device", "cpu")
    assert refused.value.code == 2  # the parser's error
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line.endswith("--instructions must be at least 1 and --stories at least 2")
