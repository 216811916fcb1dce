import inspect

import pytest
import torch

import kernels
import sample
from conftest import always_writes
from devices import autocast
from sample import KVCache, cut_at_end, generate, write, write_stories
from test_model import generate_by_recomputing, tiny_model
from tokenizer import encode_prompt


# Every test here with both of the cache's layouts, whatever the machine: blocks of positions a
# new token's attention reads by hand (a CPU without AMX keeps blocks of 32; 4 here, so short
# prompts fill several), and one block of the whole context, read by torch's fused kernel (a CPU
# with AMX, a GPU).
@pytest.fixture(autouse=True, params=["blocks", "one block"])
def cache_layout(request, monkeypatch):
    monkeypatch.setattr(kernels, "BY_HAND_ON_CPU", request.param == "blocks")
    monkeypatch.setattr(kernels, "CACHE_BLOCK", 4)
    return request.param


def by_position(blocks):
    """A cache's keys or values in blocks as (layers, rows, heads, positions, channels)."""
    return blocks.permute(0, 2, 3, 1, 4, 5).flatten(3, 4)


def laid_out_as_made(cache, layout):
    """Dense, and in the order KVCache.make lays a cache out: values position by position, keys
    too in one block, but each block's keys channel by channel where there are several."""
    keys = cache.keys.transpose(-2, -1) if layout == "blocks" else cache.keys
    return keys.is_contiguous() and cache.values.is_contiguous()


# However a cache is made (one prompt's, copied to the rows of its group; one of several
# prompts; several groups gathered) and after rows leave it, it is laid out as make() lays it:
# each block's keys channel by channel, as block_attention's product reads them.
def test_a_cache_keeps_its_layout_however_it_is_made_and_narrowed(cache_layout):
    model = tiny_model()
    g = torch.Generator().manual_seed(7)
    shared, several = torch.randint(0, 97, (1, 6), generator=g).repeat(3, 1), torch.randint(0, 97, (3, 6), generator=g)
    with torch.no_grad():
        for groups in ([shared], [several], [shared, several]):
            _, cache = sample.prefill(model, groups, 10)
            assert laid_out_as_made(cache, cache_layout)
            model(torch.randint(0, 97, (sum(map(len, groups)), 1), generator=g), cache=cache)
            cache.keep(torch.arange(sum(map(len, groups))) % 3 != 1)
            assert laid_out_as_made(cache, cache_layout)


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


def test_write_stories_batches_draw_from_one_generator_seeded_once(small_model, small_tokenizer):
    # Four copies of one prompt in batches of two: the second batch draws on where the first
    # left off, as two calls of generate with one generator do, so its stories are new ones.
    stories = write_stories(small_model, small_tokenizer, ["Once"] * 4, max_new_tokens=20, seed=5, batch=2)
    generator = torch.Generator().manual_seed(5)
    group = torch.tensor([encode_prompt(small_tokenizer, "Once")] * 2)
    expected = [cut_at_end(row[group.size(1):].tolist(), small_tokenizer.eot) for _ in range(2)
                for row in generate(small_model, [group], 20, stop=small_tokenizer.eot, generator=generator)[0]]
    assert stories == expected and stories[:2] != stories[2:]


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


def test_write_passes_its_temperature_and_top_k_on(small_model, small_tokenizer):
    # Temperature 0 and top-k 1 each take the likeliest token whatever the seed; temperature 1
    # draws, so two seeds write two stories.
    def story(seed, **options):
        return write(small_model, small_tokenizer, "A kite", max_new_tokens=24, seed=seed, **options)

    greedy = story(1, temperature=0)
    assert story(2, temperature=0) == greedy == story(1, top_k=1) == story(2, top_k=1)
    assert story(1) != story(2)


def test_the_command_line_s_options_reach_write(run_main, monkeypatch):
    real_write, calls = sample.write, []
    monkeypatch.setattr(sample, "write", lambda *args, **kwargs: calls.append(
        inspect.signature(real_write).bind(*args, **kwargs)) or "")
    run_main(sample, "--top-k", "7", "--seed", "5", "--temperature", "0.5", "--tokens", "9", "--device", "cpu")
    (bound,) = calls
    bound.apply_defaults()
    got = {name: bound.arguments[name] for name in ("max_new_tokens", "temperature", "top_k", "seed")}
    assert got == {"max_new_tokens": 9, "temperature": 0.5, "top_k": 7, "seed": 5}


def test_a_temperature_too_small_to_divide_by_is_refused(run_main, capsys):
    with pytest.raises(SystemExit):
        run_main(sample, "--temperature", "1e-40")
    assert "--temperature must be 0 (the likeliest token) or at least 0.001" in capsys.readouterr().err


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])
def test_a_seed_out_of_range_is_refused(run_main, capsys, seed):
    with pytest.raises(SystemExit):
        run_main(sample, "--seed", seed)
    assert "--seed must be 0 to 4294967295" in capsys.readouterr().err


def test_a_prompt_of_bytes_that_are_not_utf8_is_refused_in_one_line(run_main, capsys):
    # As Python hands over `--prompt "$(printf 'a\xffb')"` from a UTF-8 terminal.
    with pytest.raises(SystemExit) as stopped:
        run_main(sample, "--prompt", b"a\xffb".decode("utf-8", "surrogateescape"))
    assert stopped.value.code == 2
    assert "--prompt: the text holds bytes that are not UTF-8" in capsys.readouterr().err


def test_an_empty_prompt_is_written_after_as_given(run_main, monkeypatch):
    prompts = []
    monkeypatch.setattr(sample, "write", lambda model, tokenizer, prompt, *args: prompts.append(prompt) or "")
    run_main(sample, "--prompt", "")
    run_main(sample, "--model", "checkpoints/finetune")
    assert prompts == ["", "Once upon a time"]


def test_a_prompt_that_fills_the_context_gets_one_token_and_a_longer_one_is_refused(workspace, workspace_tokenizer,
                                                                                   run_main, monkeypatch, capsys):
    # Prompts of 255, 256 and 257 tokens: "the" again and again, each " the" one token.
    start = len(encode_prompt(workspace_tokenizer, "the"))
    prompts = {length: "the" + " the" * (length - start) for length in (255, 256, 257)}
    assert all(len(encode_prompt(workspace_tokenizer, p)) == length for length, p in prompts.items())
    room = []
    monkeypatch.setattr(sample, "write", lambda model, tokenizer, prompt, tokens, *args: room.append(tokens) or "")
    for length in (255, 256):
        run_main(sample, "--prompt", prompts[length], "--tokens", "5")
    assert room == [2, 1]  # the context is 256 positions
    with pytest.raises(SystemExit):
        run_main(sample, "--prompt", prompts[257])
    assert "longer than the model's context of 256 tokens" in capsys.readouterr().err


def test_greedy_generation_with_the_cache_equals_recomputing_the_prefix():
    model = tiny_model()
    prompt = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        slow = generate_by_recomputing(model, prompt, 40)
    fast = generate(model, prompt, 40, temperature=0)
    assert torch.equal(fast, slow)


def test_a_repeated_prompt_runs_once_and_gives_what_separate_prompts_give():
    model = tiny_model()
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    one = generate(model, prompt, 30, temperature=0)
    group = generate(model, prompt.repeat(8, 1), 30, temperature=0)
    assert torch.equal(group, one.repeat(8, 1))
    calls = []
    model.blocks[0].register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    generate(model, prompt.repeat(8, 1), 3)
    assert calls == [1, 8, 8]  # the prompt with one row, then each new token with all eight


def test_a_batch_of_one_prompt_with_one_seed_is_reproducible():
    model = tiny_model()
    prompt = torch.randint(0, 97, (1, 5)).repeat(8, 1)
    first = generate(model, prompt, 30, generator=torch.Generator().manual_seed(7))
    again = generate(model, prompt, 30, generator=torch.Generator().manual_seed(7))
    other = generate(model, prompt, 30, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert len({tuple(row) for row in first[:, 5:].tolist()}) > 1  # the stories of a group differ


def test_sampling_follows_the_model_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1e9]]).repeat(20000, 1)
    tokens = sample.next_token(logits, 1.0, None, torch.Generator().manual_seed(0))
    shares = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(shares, torch.softmax(logits[0], -1), atol=0.015)
    top2 = sample.next_token(logits, 1.0, 2, torch.Generator().manual_seed(0))
    assert set(top2.tolist()) == {1, 2}
    cooler = sample.next_token(logits, 0.5, None, torch.Generator().manual_seed(0))
    shares = torch.bincount(cooler, minlength=4).float() / len(cooler)
    assert torch.allclose(shares, torch.softmax(logits[0] / 0.5, -1), atol=0.015)


def test_a_draw_past_its_blocks_running_sum_takes_a_token_that_can_be_drawn(monkeypatch):
    # One likely token and eleven of probability 2^-53 each, the rest of the block outside the
    # top 12. The block's running sum adds the small ones to 1 one at a time, and each rounds
    # away; its sum adds them to each other first, and comes out a hair above 1. The largest
    # uniform number torch draws, 1 - 2^-53, lands in that hair, past the running sum.
    logits = torch.full((1, sample.BLOCK), -1e9)
    logits[0, 0], logits[0, 1:12] = 0.0, -53 * torch.log(torch.tensor(2.0))
    probs = torch.softmax(logits, -1).double()
    if probs.sum() == probs.cumsum(-1)[0, -1]:
        pytest.skip("this machine's sum adds in the running sum's order: no draw falls past it")
    largest = 1 - 2.0**-53
    monkeypatch.setattr(torch, "rand", lambda *size, generator=None, device=None, dtype=None:
                        torch.full(size, largest, dtype=dtype, device=device))
    token = int(sample.next_token(logits, 1.0, 12, None))
    assert probs[0, token] > 0


def test_the_smallest_draw_takes_the_first_token_that_can_be_drawn(monkeypatch):
    # torch's uniform numbers start at 0. A draw of 0 falls where the running sum starts, and
    # tokens of probability 0 (outside the top k) may stand there before the first that can be
    # drawn: here a whole block of them, then two more.
    logits = torch.full((1, 2 * sample.BLOCK), -1e9)
    first = sample.BLOCK + 2
    logits[0, first:first + 4] = torch.tensor([0.5, 1.0, 0.0, 2.0])
    monkeypatch.setattr(torch, "rand", lambda *size, generator=None, device=None, dtype=None:
                        torch.zeros(size, dtype=dtype, device=device))
    assert int(sample.next_token(logits, 1.0, 4, None)) == first


# next_token finds the block of BLOCK tokens a draw falls in, then the token within it: a
# vocabulary of several blocks, whole (as the series' 5,376 tokens are) or with a padded last one,
# its probability spread over all of them.
@pytest.mark.parametrize("vocab", [3 * sample.BLOCK, 3 * sample.BLOCK + 10])
def test_sampling_over_blocks_of_tokens_follows_the_model_distribution(vocab):
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    tokens = sample.next_token(logits.repeat(40000, 1), 1.0, None, torch.Generator().manual_seed(0))
    shares = torch.bincount(tokens, minlength=vocab).float() / len(tokens)
    expected = torch.softmax(logits[0], -1)
    assert len(shares) == vocab  # no token past the vocabulary
    assert (shares - expected).abs().max() < 0.006 and (shares - expected).abs().sum() / 2 < 0.04


def test_fast_generation_stops_at_the_stop_token_and_pads_with_it():
    model = tiny_model()
    prompt = torch.randint(0, 97, (16, 6), generator=torch.Generator().manual_seed(3))
    free = generate(model, prompt, 30, temperature=0)
    written = free[:, 6:].tolist()

    def first_stop_of_the_first_row():
        # A token the first row writes early, while too few rows have written it for the first
        # row to leave the batch at once (rows leave once a quarter have ended): so it writes
        # on, and what it writes after its stop must be the stop again, where written on
        # freely it would write other tokens.
        for at in range(2, 12):
            stop = written[0][at]
            if (stop not in written[0][:at] and any(t != stop for t in written[0][at + 1:])
                    and sum(stop in row[:at + 1] for row in written) * 4 < len(written)):
                return at, stop
    at, stop = first_stop_of_the_first_row()
    stopped = generate(model, prompt, 30, temperature=0, stop=stop)
    first_row = stopped[0, 6:].tolist()
    assert first_row.index(stop) == at and all(t == stop for t in first_row[at:])
    assert torch.equal(stopped[0, :6 + at + 1], free[0, :6 + at + 1])


def test_fast_writing_ends_early_once_every_row_has_stopped():
    model = tiny_model()
    always_writes(model, 5)
    out = generate(model, torch.randint(0, 97, (4, 6)), 30, stop=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, 7) and torch.all(out[:, 6] == 5)


def test_cache_refuses_several_tokens_after_the_prompt():
    model = tiny_model()
    cache = KVCache(model.config, 20)
    model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
    with pytest.raises(AssertionError):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def rollout_in_small():
    """Groups that repeat one prompt, of three lengths, and a group of two different prompts."""
    g = torch.Generator().manual_seed(4)
    groups = [torch.randint(0, 97, (1, n), generator=g).repeat(copies, 1) for n, copies in ((5, 4), (9, 3), (2, 4))]
    return groups + [torch.randint(0, 97, (2, 6), generator=g)]


def test_prompts_of_several_lengths_in_one_batch_write_what_each_group_writes_alone():
    model = tiny_model()
    groups = rollout_in_small()
    together = generate(model, groups, 30, temperature=0)
    for group, out in zip(groups, together):
        assert torch.equal(out, generate(model, group, 30, temperature=0))
        with torch.no_grad():
            assert torch.equal(out, generate_by_recomputing(model, group, 30))


# Groups whose prompts have one length (most of GRPO's rollouts) keep one count of positions for
# every row, and write what each group writes alone.
def test_groups_of_prompts_of_one_length_keep_one_count_and_write_what_each_writes_alone():
    model = tiny_model()
    g = torch.Generator().manual_seed(8)
    groups = [torch.randint(0, 97, (1, 5), generator=g).repeat(3, 1), torch.randint(0, 97, (2, 5), generator=g)]
    with torch.no_grad():
        _, cache = sample.prefill(model, groups, 30)
    assert cache.filled == 5 and not torch.is_tensor(cache.filled)
    for group, out in zip(groups, generate(model, groups, 30, temperature=0)):
        assert torch.equal(out, generate(model, group, 30, temperature=0))


# Where each row's token goes, what a layer reads and which positions each row sees are the same
# in every layer: a step works them out once, not once a layer.
def test_a_step_works_out_its_positions_once_for_all_layers(monkeypatch):
    model = tiny_model()
    worked_out = []
    this_step = KVCache.this_step

    def counted(cache, *args):
        worked_out.append(1)
        return this_step(cache, *args)
    monkeypatch.setattr(KVCache, "this_step", counted)
    generate(model, rollout_in_small(), 6, temperature=0)
    assert model.config.n_layer > 1 and len(worked_out) == 5  # 6 tokens: the first from the prompts' pass, then 5 steps


# In bf16 too, the scripts' precision where it is faster, with either layout of the cache: a row's
# logits are its logits alone, whichever rows share its batch, to bf16's rounding (which a CPU's
# kernels may round differently for another number of rows, so the same greedy tokens are not
# asked for).
def test_in_bf16_a_batch_of_prompts_of_several_lengths_gives_each_row_its_logits_alone():
    model = tiny_model()
    groups = rollout_in_small()
    tokens = torch.randint(0, 97, (4, sum(map(len, groups))), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), autocast("cpu", "bf16"):
        logits, cache = sample.prefill(model, groups, 4)
        alone = [sample.prefill(model, [group], 4) for group in groups]
        for step in range(4):
            expected = torch.cat([group_logits for group_logits, _ in alone])
            assert cache.keys.dtype == torch.bfloat16  # the layers' precision: half the bytes to read
            torch.testing.assert_close(logits.float(), expected.float(), rtol=0.02, atol=0.05)
            # The same next token for a row in the batch and alone, at each row's own position.
            logits = model(tokens[step][:, None], cache=cache)[0][:, -1]
            rows = tokens[step].split([len(group) for group in groups])
            alone = [(model(row[:, None], cache=group_cache)[0][:, -1], group_cache)
                     for row, (_, group_cache) in zip(rows, alone)]


def stopped_by_recomputing(model, prompt, new_tokens, stop):
    """Greedy writing the slow way, each row on its own: after a row writes stop, only stop."""
    with torch.no_grad():
        out = generate_by_recomputing(model, prompt, new_tokens)
    for row in out[:, prompt.size(1):]:
        ends = (row == stop).nonzero()
        if len(ends):
            row[int(ends[0]) + 1:] = stop
    return out


def test_rows_that_end_leave_the_batch_and_the_others_write_on_unchanged():
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    # As in a rollout: groups that repeat one prompt (GRPO's), groups of different prompts of one
    # length (PPO's), and single prompts, of several lengths.
    groups = [torch.randint(0, 97, (1, 3), generator=g).repeat(3, 1), torch.randint(0, 97, (4, 7), generator=g),
              torch.randint(0, 97, (1, 4), generator=g), torch.randint(0, 97, (3, 5), generator=g),
              torch.randint(0, 97, (1, 6), generator=g).repeat(2, 1)]
    free = generate(model, groups, 20, temperature=0)
    stop = free[0][0, 3 + 2].item()  # the third token the first group writes: it ends early
    stopped = generate(model, groups, 20, temperature=0, stop=stop)
    ended_at = []
    for group, out in zip(groups, stopped):
        # Each group as it writes alone, and each row as the whole prefix again for every token gives it.
        alone = generate(model, group, 20, temperature=0, stop=stop)  # ends once its own rows have
        assert torch.equal(out[:, :alone.size(1)], alone) and torch.all(out[:, alone.size(1):] == stop)
        assert torch.equal(out, stopped_by_recomputing(model, group, out.size(1) - group.size(1), stop))
        ended_at += [row.tolist().index(stop) if stop in row else None for row in out[:, group.size(1):]]
    assert None in ended_at and len({at for at in ended_at if at is not None}) > 1  # rows ended at several steps
    calls = []
    model.blocks[0].register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    generate(model, groups, 20, temperature=0, stop=stop)
    rows = sum(len(group) for group in groups)
    assert min(calls[len(groups):]) < rows  # rows that ended stopped costing a step


@pytest.mark.parametrize("lengths", [(5,), (3, 7, 4)])
def test_a_narrowed_cache_holds_the_kept_rows_positions_and_counts_unchanged(lengths, cache_layout):
    # Prompts of one length (one count for all rows) and of several (a count per row), then a
    # few tokens written; the rows kept move up, and each must keep every position it filled.
    model = tiny_model()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        _, cache = sample.prefill(model, [torch.randint(0, 97, (3, n), generator=g) for n in lengths], 10)
        for _ in range(3):
            model(torch.randint(0, 97, (3 * len(lengths), 1), generator=g), cache=cache)
    filled = cache.filled.tolist() if torch.is_tensor(cache.filled) else [cache.filled] * 3 * len(lengths)
    rows = torch.tensor([True, False, True] * len(lengths))
    keys, values = by_position(cache.keys), by_position(cache.values)
    kept = [(keys[:, r, :, :filled[r]].clone(), values[:, r, :, :filled[r]].clone(), filled[r])
            for r in range(len(rows)) if rows[r]]
    memory = cache.keys.data_ptr(), cache.values.data_ptr()
    cache.keep(rows)
    assert cache.keys.size(2) == cache.values.size(2) == len(kept)
    # In the memory the cache had, and dense: each layer's blocks one tensor the attention reads as it is.
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == memory
    assert laid_out_as_made(cache, cache_layout)
    for row, (keys, values, count) in enumerate(kept):
        assert torch.equal(by_position(cache.keys)[:, row, :, :count], keys)
        assert torch.equal(by_position(cache.values)[:, row, :, :count], values)
    if len(lengths) > 1:
        assert cache.filled.tolist() == [count for _, _, count in kept]


def test_stories_of_a_group_written_with_others_follow_the_model_distribution():
    model = tiny_model(vocab_size=5)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = torch.softmax(model(prompt)[0][0, -1], -1)
    groups = [torch.tensor([[4]]).repeat(100, 1), prompt.repeat(4000, 1), torch.tensor([[0, 1, 2, 3, 4]]).repeat(100, 1)]
    out = generate(model, groups, 1, generator=torch.Generator().manual_seed(0))
    shares = torch.bincount(out[1][:, -1], minlength=5).float() / 4000
    assert torch.allclose(shares, expected, atol=0.025)
