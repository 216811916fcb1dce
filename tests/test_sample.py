import pytest

import sample
from conftest import always_writes
from sample import cut_at_end, write, write_stories
from tokenizer import encode_prompt


def test_prompt_starts_with_end_of_text(small_tokenizer):
    tokens = encode_prompt(small_tokenizer, "Write a story.\n")
    assert tokens[0] == small_tokenizer.eot and small_tokenizer.decode(tokens[1:]) == "Write a story.\n"


def test_story_is_cut_after_its_first_end_of_text():
    assert cut_at_end([5, 6, 9, 7, 9], 9) == [5, 6, 9]
    assert cut_at_end([5, 6, 7], 9) == [5, 6, 7]


def test_a_story_stops_at_end_of_text_and_keeps_it(small_model, small_tokenizer):
    always_writes(small_model, small_tokenizer.eot)
    assert write(small_model, small_tokenizer, "Once upon a time") == "<|endoftext|>"


def test_write_gives_at_most_the_tokens_asked_for_and_a_seed_repeats_it(small_model, small_tokenizer):
    (tokens,) = write_stories(small_model, small_tokenizer, ["Once upon a time"], max_new_tokens=12, seed=3)
    assert len(tokens) == 12 and small_tokenizer.eot not in tokens  # random weights rarely end a story
    story = write(small_model, small_tokenizer, "Once upon a time", max_new_tokens=12, seed=3)
    assert story == small_tokenizer.decode(tokens)
    assert write(small_model, small_tokenizer, "Once upon a time", max_new_tokens=12, seed=4) != story


def test_stories_of_prompts_of_several_lengths_come_back_in_order(small_model, small_tokenizer):
    prompts = ["Once upon a time", "A kite", "The river was", "A river", "A kite flew", "A river flew"]
    together = write_stories(small_model, small_tokenizer, prompts, max_new_tokens=15, temperature=0)
    alone = [write_stories(small_model, small_tokenizer, [p], max_new_tokens=15, temperature=0)[0] for p in prompts]
    assert together == alone


def test_writing_turns_dropout_off_and_leaves_a_training_model_in_training(small_model, small_tokenizer):
    small_model.eval()
    in_eval = write(small_model, small_tokenizer, "A kite", max_new_tokens=20, seed=3)
    small_model.train()  # dropout would change the story, if writing left it on
    assert write(small_model, small_tokenizer, "A kite", max_new_tokens=20, seed=3) == in_eval
    assert small_model.training


def test_a_temperature_too_small_to_divide_by_is_refused(run_main, capsys):
    with pytest.raises(SystemExit):
        run_main(sample, "--temperature", "1e-40")
    assert "--temperature must be 0 (the likeliest token) or at least 0.001" in capsys.readouterr().err


def test_an_empty_prompt_is_written_after_as_given(run_main, monkeypatch):
    prompts = []
    monkeypatch.setattr(sample, "write", lambda model, tokenizer, prompt, *args: prompts.append(prompt) or "")
    run_main(sample, "--prompt", "")
    run_main(sample, "--model", "checkpoints/finetune")
    assert prompts == ["", "Once upon a time"]
