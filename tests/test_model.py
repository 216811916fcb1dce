import pytest
import torch

import model as gpt
from conftest import always_writes
from model import GPT, TINY, Config, KVCache, autocast
from tokenizer import VOCAB_SIZE


def tiny_model(seed=0, vocab_size=97):
    torch.manual_seed(seed)
    model = GPT(Config(vocab_size=vocab_size, **TINY))
    # Larger weights than at initialisation, so the logits are far from ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # the matrices; layer norms as they are, else every row writes one token
                p.normal_(0, 0.3)
    return model.eval()


def generate_by_recomputing(model, prompt, new_tokens):
    """Greedy generation the slow way: the whole prefix again for every new token."""
    tokens = prompt
    for _ in range(new_tokens):
        logits, _ = model(tokens)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_series_model_has_about_14_6_million_parameters():
    count = GPT(Config()).parameter_count()
    assert Config().vocab_size == VOCAB_SIZE
    assert 14.5e6 <= count <= 14.7e6


def test_greedy_generation_with_the_cache_equals_recomputing_the_prefix():
    model = tiny_model()
    prompt = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        slow = generate_by_recomputing(model, prompt, 40)
    fast = model.generate(prompt, 40, temperature=0)
    assert torch.equal(fast, slow)


def test_a_repeated_prompt_runs_once_and_gives_what_separate_prompts_give():
    model = tiny_model()
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    one = model.generate(prompt, 30, temperature=0)
    group = model.generate(prompt.repeat(8, 1), 30, temperature=0)
    assert torch.equal(group, one.repeat(8, 1))
    calls = []
    model.blocks[0].register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    model.generate(prompt.repeat(8, 1), 3)
    assert calls == [1, 8, 8]  # the prompt with one row, then each new token with all eight


def test_a_batch_of_one_prompt_with_one_seed_is_reproducible():
    model = tiny_model()
    prompt = torch.randint(0, 97, (1, 5)).repeat(8, 1)
    first = model.generate(prompt, 30, generator=torch.Generator().manual_seed(7))
    again = model.generate(prompt, 30, generator=torch.Generator().manual_seed(7))
    other = model.generate(prompt, 30, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert len({tuple(row) for row in first[:, 5:].tolist()}) > 1  # the stories of a group differ


def test_sampling_follows_the_model_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1e9]]).repeat(20000, 1)
    tokens = gpt.next_token(logits, 1.0, None, torch.Generator().manual_seed(0))
    shares = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(shares, torch.softmax(logits[0], -1), atol=0.015)
    top2 = gpt.next_token(logits, 1.0, 2, torch.Generator().manual_seed(0))
    assert set(top2.tolist()) == {1, 2}
    cooler = gpt.next_token(logits, 0.5, None, torch.Generator().manual_seed(0))
    shares = torch.bincount(cooler, minlength=4).float() / len(cooler)
    assert torch.allclose(shares, torch.softmax(logits[0] / 0.5, -1), atol=0.015)


def test_sampling_over_blocks_of_tokens_follows_the_model_distribution():
    # next_token finds the block of BLOCK tokens a draw falls in, then the token within it: a
    # vocabulary of several blocks and a padded last one, its probability spread over all of them.
    vocab = 3 * gpt.BLOCK + 10
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    tokens = gpt.next_token(logits.repeat(40000, 1), 1.0, None, torch.Generator().manual_seed(0))
    shares = torch.bincount(tokens, minlength=vocab).float() / len(tokens)
    expected = torch.softmax(logits[0], -1)
    assert len(shares) == vocab  # no token past the vocabulary
    assert (shares - expected).abs().max() < 0.006 and (shares - expected).abs().sum() / 2 < 0.04


def test_generation_stops_at_the_stop_token_and_pads_with_it():
    model = tiny_model()
    prompt = torch.randint(0, 97, (4, 6), generator=torch.Generator().manual_seed(3))
    free = model.generate(prompt, 30, temperature=0)
    stop = free[0, 6 + 4].item()  # the fifth token the first row writes
    stopped = model.generate(prompt, 30, temperature=0, stop=stop)
    first_row = stopped[0, 6:].tolist()
    end = first_row.index(stop)
    assert end <= 4 and all(t == stop for t in first_row[end:])
    assert torch.equal(stopped[0, :6 + end + 1], free[0, :6 + end + 1])


def test_writing_ends_early_once_every_row_has_stopped():
    model = tiny_model()
    always_writes(model, 5)
    out = model.generate(torch.randint(0, 97, (4, 6)), 30, stop=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (4, 7) and torch.all(out[:, 6] == 5)


def test_context_is_enforced():
    model = tiny_model()
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_cache_refuses_several_tokens_after_the_prompt():
    model = tiny_model()
    cache = KVCache(model.config, 20)
    model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
    with pytest.raises(AssertionError):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_pick_device_honours_an_override_and_refuses_what_is_not_there():
    assert gpt.pick_device("cpu") == torch.device("cpu")
    for name in ("nonsense", "meta", "xpu", "vulkan"):  # torch knows the last three; the series runs on none
        with pytest.raises(SystemExit, match="not a device the series runs on"):
            gpt.pick_device(name)
    with pytest.raises(SystemExit, match="has no cuda:99"):
        gpt.pick_device("cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="has no cuda"):
            gpt.pick_device("cuda")


# In bf16 too, the scripts' precision where it is faster, and its cache's: a row writes the same
# whichever rows share its batch. (A whole prefix at once rounds bf16 differently from one token
# at a time, so the recomputation is compared in fp32.)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_prompts_of_several_lengths_in_one_batch_write_what_each_group_writes_alone(precision):
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    # A rollout in small: groups that repeat one prompt, of three lengths, and a group of two different prompts.
    groups = [torch.randint(0, 97, (1, n), generator=g).repeat(copies, 1) for n, copies in ((5, 4), (9, 3), (2, 4))]
    groups.append(torch.randint(0, 97, (2, 6), generator=g))
    with autocast("cpu", precision):
        together = model.generate(groups, 30, temperature=0)
        alone = [model.generate(group, 30, temperature=0) for group in groups]
    for group, out, out_alone in zip(groups, together, alone):
        assert torch.equal(out, out_alone)
        if precision == "fp32":
            with torch.no_grad():
                assert torch.equal(out, generate_by_recomputing(model, group, 30))


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
    free = model.generate(groups, 20, temperature=0)
    stop = free[0][0, 3 + 2].item()  # the third token the first group writes: it ends early
    stopped = model.generate(groups, 20, temperature=0, stop=stop)
    ended_at = []
    for group, out in zip(groups, stopped):
        # Each group as it writes alone, and each row as the whole prefix again for every token gives it.
        alone = model.generate(group, 20, temperature=0, stop=stop)  # ends once its own rows have
        assert torch.equal(out[:, :alone.size(1)], alone) and torch.all(out[:, alone.size(1):] == stop)
        assert torch.equal(out, stopped_by_recomputing(model, group, out.size(1) - group.size(1), stop))
        ended_at += [row.tolist().index(stop) if stop in row else None for row in out[:, group.size(1):]]
    assert None in ended_at and len({at for at in ended_at if at is not None}) > 1  # rows ended at several steps
    calls = []
    model.blocks[0].register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    model.generate(groups, 20, temperature=0, stop=stop)
    rows = sum(len(group) for group in groups)
    assert min(calls[len(groups):]) < rows  # rows that ended stopped costing a step


def test_stories_of_a_group_written_with_others_follow_the_model_distribution():
    model = tiny_model(vocab_size=5)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = torch.softmax(model(prompt)[0][0, -1], -1)
    groups = [torch.tensor([[4]]).repeat(100, 1), prompt.repeat(4000, 1), torch.tensor([[0, 1, 2, 3, 4]]).repeat(100, 1)]
    out = model.generate(groups, 1, generator=torch.Generator().manual_seed(0))
    shares = torch.bincount(out[1][:, -1], minlength=5).float() / 4000
    assert torch.allclose(shares, expected, atol=0.025)


def log_softmax_by_autograd(logits, targets):
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(
        -1, targets.unsqueeze(-1)).squeeze(-1)


def test_log_softmax_at_gives_the_log_softmax_and_its_gradient_across_slices_of_rows(monkeypatch):
    monkeypatch.setattr(gpt, "CACHE_ROWS", 4)  # 3 x 5 = 15 rows: three slices of 4, one of 3
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=generator, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5), generator=generator)
    upstream = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    got = gpt.log_softmax_at(logits, targets)
    (got_grad,) = torch.autograd.grad(got, logits, upstream)
    expected = log_softmax_by_autograd(logits, targets)
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: gpt.log_softmax_at(x, targets), (logits,))


def test_log_softmax_at_of_bfloat16_logits_is_float32_and_matches_log_softmax():
    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 40, 97, generator=generator)).bfloat16().requires_grad_()
    targets = torch.randint(0, 97, (2, 40), generator=generator)
    upstream = torch.randn(2, 40, generator=generator)
    got = gpt.log_softmax_at(logits, targets)
    (got_grad,) = torch.autograd.grad(got, logits, upstream)
    expected = log_softmax_by_autograd(logits, targets)
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream)
    assert got.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), expected_grad.float(), rtol=1e-2, atol=1e-3)


def test_log_softmax_at_leaves_float32_logits_as_they_were():
    # float32 logits are not copied to work on: a slice of a larger tensor, as the model's are often views.
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 20, generator=generator)[..., :13].requires_grad_()
    before = logits.detach().clone()
    targets = torch.randint(0, 13, (2, 6), generator=generator)
    got = gpt.log_softmax_at(logits, targets)
    got.sum().backward()
    (expected_grad,) = torch.autograd.grad(log_softmax_by_autograd(logits, targets).sum(), logits)
    assert torch.equal(logits.detach(), before)
    torch.testing.assert_close(got, log_softmax_by_autograd(logits, targets), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits.grad, expected_grad, rtol=0, atol=1e-6)


def attention_inputs(length):
    # Queries, keys, values and the gradient from above, over several of the kernel's blocks of positions.
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, length, 16, generator=generator, dtype=torch.float64) for _ in range(4)]


def attention_and_gradients(attend, inputs, dtype):
    """attend's output for the queries, keys and values of inputs, in dtype, and their gradients."""
    *qkv, upstream = (t.to(dtype) for t in inputs)
    qkv = [t.requires_grad_() for t in qkv]
    out = attend(*qkv)
    return out, torch.autograd.grad(out, qkv, upstream)


def causal_sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


ours = gpt.CausalAttentionFloat32Backward.apply
needs_the_kernel = pytest.mark.skipif(not gpt.FLOAT32_BACKWARD, reason="this build of torch lacks the CPU kernel's operators")


@needs_the_kernel
def test_attention_with_a_float32_backward_is_causal_attention_with_its_gradient():
    inputs = attention_inputs(100)
    got, got_grads = attention_and_gradients(ours, inputs, torch.float64)
    expected, expected_grads = attention_and_gradients(causal_sdpa, inputs, torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)
    small = [t[:1, :2, :5, :4].clone().requires_grad_() for t in inputs[:3]]
    assert torch.autograd.gradcheck(ours, small)


@needs_the_kernel
def test_attention_in_bfloat16_has_torchs_forward_to_the_bit_and_a_gradient_a_little_nearer_the_exact_one():
    inputs = attention_inputs(100)
    got, got_grads = attention_and_gradients(ours, inputs, torch.bfloat16)
    torchs, torchs_grads = attention_and_gradients(causal_sdpa, inputs, torch.bfloat16)
    _, exact_grads = attention_and_gradients(causal_sdpa, inputs, torch.float64)
    assert torch.equal(got, torchs)  # so a ratio of new to old probabilities starts at exactly 1
    for got_grad, torchs_grad, exact in zip(got_grads, torchs_grads, exact_grads):
        assert got_grad.dtype == torch.bfloat16
        # On average 75% to 93% of the error of torch's bfloat16 backward pass, here.
        error, torchs_error = (float((g.double() - exact).abs().mean()) for g in (got_grad, torchs_grad))
        assert error < 1e-3 and error < torchs_error


@needs_the_kernel
def test_the_float32_backward_serves_bfloat16_passes_trained_through_on_a_cpu_and_no_others(monkeypatch):
    model = tiny_model()
    calls = []
    monkeypatch.setattr(gpt.CausalAttentionFloat32Backward, "apply", lambda *qkv: calls.append(1) or ours(*qkv))
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = {}
    for backward in ("float32", "bfloat16"):
        # The same model, with CausalAttentionFloat32Backward, then with torch's own backward pass.
        monkeypatch.setattr(gpt, "FLOAT32_BACKWARD", backward == "float32")
        model.zero_grad()
        with autocast("cpu", "bf16"):
            logits, _ = model(tokens)
        logits.float().logsumexp(-1).sum().backward()
        grads[backward] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert len(calls) == model.config.n_layer  # each layer's attention, in the first pass only
    # Both are about 2% from the float32 model's gradient (bfloat16's rounding); they agree to 0.3%.
    assert (grads["float32"] - grads["bfloat16"]).norm() < 0.01 * grads["bfloat16"].norm()
    monkeypatch.setattr(gpt, "FLOAT32_BACKWARD", True)
    calls.clear()
    with torch.no_grad(), autocast("cpu", "bf16"):
        model(tokens)  # nothing to train through
    assert not calls
    model(tokens)  # float32
    assert not calls
    with autocast("cpu", "bf16"):
        model.generate(tokens, 3, generator=torch.Generator().manual_seed(0))  # writing
    assert not calls
    model.train()
    with autocast("cpu", "bf16"):
        model(tokens)  # with dropout
    assert not calls
