import argparse
import json

import numpy as np
import torch

import finetune
import train
from data import askable_words, load_tokenizer, read_instructions
from model import GPT, TINY, Config
from sample import encode_prompt


def test_only_the_story_and_its_end_are_targets():
    examples = [([9, 1, 2, 3, 4, 5, 9], 3), ([9, 1, 2, 6, 9], 3)]  # prompt of 3, then the story
    x, y = finetune.collate(examples, pad=0, device="cpu")
    assert x.tolist() == [[9, 1, 2, 3, 4, 5], [9, 1, 2, 6, 0, 0]]
    assert y.tolist() == [[-1, -1, 3, 4, 5, 9], [-1, -1, 6, 9, -1, -1]]


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
    askable = askable_words(workspace / "data" / "train.txt")
    first, second = (finetune.ask_anew(tokenizer, stories, askable, epoch) for epoch in (0, 1))
    assert first == [finetune.encode_example(tokenizer, i) for i in instructions]  # the file's words first
    prompts = [tokenizer.decode(tokens[1:length]) for tokens, length in second]
    assert sum(a != b for a, b in zip(first, second)) > 20  # most stories are asked for other words
    for prompt, story in zip(prompts, stories):
        words = prompt.removeprefix("Write a story that uses the words ").rstrip(".\n").replace(" and", ",").split(", ")
        assert len(words) == 3 and all(word in story for word in words)


def test_several_asks_give_each_story_other_words_on_one_pass(workspace):
    tokenizer = load_tokenizer(workspace / "data")
    instructions = read_instructions(workspace / "data" / "instructions.jsonl")[:40]
    stories = [i["story"] for i in instructions]
    askable = askable_words(workspace / "data" / "train.txt")
    asked = finetune.ask_anew(tokenizer, stories, askable, 0, asks=2)
    assert len(asked) == 80
    assert asked[::2] == finetune.ask_anew(tokenizer, stories, askable, 0)  # the first ask is the file's
    assert sum(first != second for first, second in zip(asked[::2], asked[1::2])) > 20


def test_a_plain_story_is_predicted_from_an_end_of_text(workspace):
    tokenizer = load_tokenizer(workspace / "data")
    story = read_instructions(workspace / "data" / "instructions.jsonl")[0]["story"]
    tokens, prompt_length = finetune.encode_plain(tokenizer, story)
    assert tokens == [tokenizer.eot] + tokenizer.encode(story) + [tokenizer.eot] and prompt_length == 1
    _, y = finetune.collate([(tokens, prompt_length)], tokenizer.eot, "cpu")
    assert y[0].tolist() == tokens[1:]  # every token of the story is a target


def test_each_lever_names_its_own_folder():
    def name(lr=finetune.LR, asks=1, plain_share=finetune.PLAIN_SHARE):
        return finetune.run_name(argparse.Namespace(lr=lr, asks=asks, plain_share=plain_share))
    assert name() == "finetune"
    assert [name(lr=3e-4), name(asks=3), name(plain_share=0)] == ["finetune-lr-0.0003", "finetune-asks-3",
                                                                  "finetune-plain-0"]
