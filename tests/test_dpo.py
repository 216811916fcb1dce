import copy
import itertools
import json
import math
import shutil

import pytest
import torch

import dpo
import finetune
import preferences
from checkpoints import load_checkpoint, read_checkpoint, save_checkpoint
from data import instruction
from tokenizer import encode_prompt
from train import learning_rate


def fake_pairs(tokenizer, count=6):
    return [{"instruction": "Write a story that uses the words kite, river and brave.\n",
             "chosen_tokens": tokenizer.encode(f"A brave kite {i} by the river.") + [tokenizer.eot],
             "rejected_tokens": tokenizer.encode(f"Once there was a cat number {i}. It slept all day long.")}
            for i in range(count)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dpo_loss_of_a_model_equal_to_its_reference_is_log_2(workspace_tokenizer, workspace_model, precision):
    reference = copy.deepcopy(workspace_model).requires_grad_(False)
    x, y = dpo.pair_batch(fake_pairs(workspace_tokenizer), workspace_tokenizer, "cpu")
    losses, margins = dpo.pair_losses(workspace_model, reference, x, y, torch.device("cpu"), precision)
    assert torch.allclose(losses, torch.full_like(losses, math.log(2)))
    assert torch.all(margins == 0)


def story_logprob_by_hand(model, prompt, story):
    """log p(story | prompt): the story's tokens' log-probabilities, one row, no padding, added up."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + story]))
    return sum(torch.log_softmax(logits[0, len(prompt) - 1 + i], -1)[t].item() for i, t in enumerate(story))


def test_pair_losses_follow_the_dpo_formula_for_a_policy_apart_from_its_reference(workspace_tokenizer,
                                                                                  workspace_model):
    reference = copy.deepcopy(workspace_model).requires_grad_(False)
    with torch.no_grad():  # the policy a few updates away from its reference
        g = torch.Generator().manual_seed(0)
        for p in workspace_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    pairs = fake_pairs(workspace_tokenizer, 3)
    x, y = dpo.pair_batch(pairs, workspace_tokenizer, "cpu")
    losses, margins = dpo.pair_losses(workspace_model, reference, x, y, torch.device("cpu"), "fp32")
    for pair, loss, margin in zip(pairs, losses.tolist(), margins.tolist()):
        prompt = encode_prompt(workspace_tokenizer, pair["instruction"])
        chosen, rejected = (story_logprob_by_hand(workspace_model, prompt, pair[f"{side}_tokens"])
                            - story_logprob_by_hand(reference, prompt, pair[f"{side}_tokens"])
                            for side in ("chosen", "rejected"))
        by_hand = dpo.BETA * (chosen - rejected)
        assert abs(by_hand) > 0.01  # the pair tells the policy from its reference
        assert margin == pytest.approx(by_hand, rel=1e-3)
        assert loss == pytest.approx(-math.log(1 / (1 + math.exp(-by_hand))), rel=1e-4)


@pytest.mark.parametrize("first_token", [None, 0])
def test_story_logprobs_sum_the_story_tokens_only(workspace_tokenizer, workspace_model, first_token):
    # Token 0 is a token like any other (a byte of the tokenizer's): only -1, the prompt and the
    # padding, counts for nothing.
    pair = fake_pairs(workspace_tokenizer, 1)
    if first_token is not None:
        pair[0]["chosen_tokens"] = [first_token] + pair[0]["chosen_tokens"]
    x, y = dpo.pair_batch(pair, workspace_tokenizer, "cpu")
    with torch.no_grad():
        logits, _ = workspace_model(x)
        got = dpo.story_logprobs(workspace_model, x, y)
    prompt_length = len(workspace_tokenizer.encode(pair[0]["instruction"])) + 1
    story = pair[0]["chosen_tokens"]
    by_hand = sum(torch.log_softmax(logits[0, prompt_length - 1 + i], -1)[t].item() for i, t in enumerate(story))
    assert got[0].item() == pytest.approx(by_hand, rel=1e-5)


def test_dpo_gradient_makes_the_chosen_story_likelier(workspace_tokenizer, workspace_model):
    x, y = dpo.pair_batch(fake_pairs(workspace_tokenizer), workspace_tokenizer, "cpu")
    with torch.no_grad():
        ref_chosen, ref_rejected = dpo.story_logprobs(workspace_model, x, y).chunk(2)
    optimizer = torch.optim.SGD(workspace_model.parameters(), lr=0.05)
    chosen, rejected = dpo.story_logprobs(workspace_model, x, y).chunk(2)
    loss, _ = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected)
    loss.mean().backward()
    optimizer.step()
    with torch.no_grad():
        new_chosen, new_rejected = dpo.story_logprobs(workspace_model, x, y).chunk(2)
    assert torch.all(new_chosen > ref_chosen)
    assert torch.all(new_chosen - new_rejected > ref_chosen - ref_rejected)


def test_dpo_runs_end_to_end_and_saves_its_model(workspace, run_main, capsys, monkeypatch):
    losses, real_pair_losses = [], dpo.pair_losses
    monkeypatch.setattr(dpo, "pair_losses", lambda *args: losses.append(real_pair_losses(*args)[0]) or
                        real_pair_losses(*args))
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    rates, real_step = [], dpo.optimizer_step
    monkeypatch.setattr(dpo, "optimizer_step", lambda model, optimizer, loss, lr: rates.append(lr) or
                        real_step(model, optimizer, loss, lr))
    run_main(dpo, "--steps", "2", "--precision", "fp32", "--device", "cpu")
    made_by = read_checkpoint(workspace / "checkpoints" / "dpo")["made_by"]
    assert made_by["script"] == "dpo.py" and made_by["step"] == 2
    # DPO's own schedule, not pretraining's: its warmup's first step, and never above its peak.
    assert rates[0] == pytest.approx(learning_rate(0, 0.0, dpo.LR, dpo.MIN_LR, dpo.WARMUP)) and max(rates) <= dpo.LR
    # The script's own first step: its policy is still its reference, with dropout off in both,
    # so the loss is log 2 for every pair.
    assert len(losses) == 2
    assert torch.allclose(losses[0], torch.full_like(losses[0], math.log(2)))
    out = capsys.readouterr().out
    assert "step 0: the held-out stories use" in out and "step 2: loss" in out
    assert out.count("step 2: the held-out stories use") == 1  # the final model, measured once


def pairs_of_one_story(run_main, count=8):
    """data/preferences.json with `count` pairs (at most 120), each asking for other words: the
    tests' tiny model makes a pair or two, and the first is copied under `count` instructions.
    Returns the instructions."""
    run_main(preferences, "--instructions", "16", "--stories", "3", "--device", "cpu")
    saved = json.loads(preferences.PAIRS.read_text(encoding="utf-8"))
    words = ["cat", "dog", "sun", "tree", "ball", "cake", "rain", "jump", "park", "boat"]
    asked = [instruction(three) for three in itertools.islice(itertools.combinations(words, 3), count)]
    saved["pairs"] = [dict(saved["pairs"][0], instruction=text) for text in asked]
    preferences.PAIRS.write_text(json.dumps(saved), encoding="utf-8")
    return asked


def test_another_seed_orders_the_pairs_anew_into_folders_of_its_own(workspace, run_main, monkeypatch):
    pairs_of_one_story(run_main)
    first_batches, real_pair_batch = [], dpo.pair_batch
    monkeypatch.setattr(dpo, "pair_batch", lambda pairs, *args: first_batches.append(
        [(p["instruction"], p["chosen_tokens"], p["rejected_tokens"]) for p in pairs]) or real_pair_batch(pairs, *args))
    run_main(dpo, "--steps", "1", "--precision", "fp32", "--device", "cpu")
    default_model = (workspace / "checkpoints" / "dpo" / "model.pt").read_bytes()
    run_main(dpo, "--steps", "1", "--precision", "fp32", "--device", "cpu", "--seed", "2")
    # The same pairs, in another order; the default seed's model and logs are left as they were.
    assert len(first_batches[0]) == 8 and sorted(first_batches[0]) == sorted(first_batches[1])
    assert first_batches[0] != first_batches[1]
    assert read_checkpoint(workspace / "checkpoints" / "dpo-seed-2")["made_by"]["settings"]["seed"] == 2
    assert (workspace / "checkpoints" / "dpo" / "model.pt").read_bytes() == default_model
    assert sorted(path.name for path in (workspace / "runs").glob("dpo*")) == ["dpo", "dpo-seed-2"]


def test_each_pass_takes_every_pair_once_in_a_new_order_and_the_last_model_is_measured_once(workspace, run_main,
                                                                                             monkeypatch):
    # Two batches of pairs a pass, and three passes.
    asked = pairs_of_one_story(run_main, 2 * dpo.BATCH)
    batches, real_pair_batch = [], dpo.pair_batch
    monkeypatch.setattr(dpo, "pair_batch", lambda pairs, *args: batches.append([p["instruction"] for p in pairs])
                        or real_pair_batch(pairs, *args))
    measured = []  # the steps whose model is measured on the held-out instructions
    monkeypatch.setattr(dpo, "evaluate", lambda policy, tokenizer, instructions, writer, step: measured.append(step))
    monkeypatch.setattr(dpo, "EVAL_EVERY", 3)
    run_main(dpo, "--steps", "6", "--precision", "fp32", "--device", "cpu")
    assert measured == [0, 3, 6]  # the last step's model once, where it falls on EVAL_EVERY too
    assert [len(batch) for batch in batches] == [dpo.BATCH] * 6
    passes = [batches[step] + batches[step + 1] for step in range(0, 6, 2)]
    assert all(sorted(one_pass) == sorted(asked) for one_pass in passes)
    assert passes[0] != passes[1] and passes[1] != passes[2]


@pytest.mark.parametrize("script", [dpo, finetune])
@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])  # past 32 bits: data.check_seed says why
def test_a_seed_out_of_range_gets_one_line_before_anything_is_read(script, seed, workspace, run_main, capsys):
    with pytest.raises(SystemExit):
        run_main(script, "--seed", seed)
    assert "--seed must be 0 to 4294967295" in capsys.readouterr().err


def test_words_rate_is_the_share_over_the_heldout_set(workspace, workspace_tokenizer, workspace_model, monkeypatch):
    from evaluate import load_instructions
    instructions = load_instructions(workspace / "heldout.json")
    first_word = [workspace_tokenizer.encode(i["words"][0]) for i in instructions]
    monkeypatch.setattr(dpo, "heldout_stories", lambda *args: first_word)
    assert dpo.words_rate(workspace_model, workspace_tokenizer, instructions) == pytest.approx(1 / 3)


def test_the_reference_stays_the_fine_tuned_model_and_the_first_step_logs_log_2(workspace, run_main, capsys,
                                                                                 monkeypatch):
    seen, real_pair_losses = [], dpo.pair_losses
    monkeypatch.setattr(dpo, "pair_losses", lambda policy, reference, *args: seen.append((policy, reference))
                        or real_pair_losses(policy, reference, *args))
    pairs_of_one_story(run_main)
    capsys.readouterr()
    run_main(dpo, "--steps", "2", "--precision", "fp32", "--device", "cpu")
    (policy, reference), _ = seen
    fine_tuned = read_checkpoint(workspace / "checkpoints" / "finetune")["model"]
    assert all(torch.equal(value, fine_tuned[name]) for name, value in reference.state_dict().items())
    assert not all(torch.equal(value, fine_tuned[name]) for name, value in policy.state_dict().items())
    # Step 1: the policy is its reference, so each pair's loss is log 2 (the batch's mean, not
    # its sum) and no pair's margin is positive yet.
    assert "step 1: loss 0.693, margin 0.000, accuracy 0%" in capsys.readouterr().out


def test_pairs_another_model_wrote_are_refused_before_any_step(workspace, workspace_tokenizer, run_main, monkeypatch):
    # The fine-tuned model made again after the pairs were written: they are no longer its stories.
    pairs_of_one_story(run_main)
    model = workspace / "checkpoints" / "finetune" / "model.pt"
    kept = workspace / "finetune-model-kept.pt"
    shutil.copy2(model, kept)
    steps = []
    monkeypatch.setattr(dpo, "optimizer_step", lambda *args: steps.append(args))
    try:
        made_again = load_checkpoint(model.parent, tokenizer=workspace_tokenizer)
        torch.nn.init.normal_(made_again.head.weight)
        save_checkpoint(model.parent, made_again, workspace_tokenizer, {"script": "finetune.py", "step": 1})
        with pytest.raises(SystemExit, match=r"holds the stories of another model than checkpoints/finetune/model.pt "
                                             r"\(made again since\?\); make the pairs again with python preferences.py"):
            run_main(dpo, "--steps", "1", "--precision", "fp32", "--device", "cpu")
        assert steps == []
        # Pairs from before they recorded their model are taken as they are.
        saved = json.loads(preferences.PAIRS.read_text(encoding="utf-8"))
        del saved["settings"]["model_hash"]
        preferences.PAIRS.write_text(json.dumps(saved), encoding="utf-8")
        run_main(dpo, "--steps", "1", "--precision", "fp32", "--device", "cpu")
        assert len(steps) == 1
    finally:
        shutil.copy2(kept, model)
