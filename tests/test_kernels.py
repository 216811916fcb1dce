"""kernels.py: log_softmax_at, the attention with a float32 backward pass and the attention of one
query a row over a cache in blocks give what torch's own functions give, value and gradient."""
import pytest
import torch

import kernels
from devices import autocast
from sample import generate
from test_model import tiny_model


def log_softmax_by_autograd(logits, targets):
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(
        -1, targets.unsqueeze(-1)).squeeze(-1)


# Slices of 4 rows: 15 rows end on a slice of 3, 13 on a slice of one row, 12 on a whole slice.
@pytest.mark.parametrize("rows", [(3, 5), (1, 13), (3, 4)])
def test_log_softmax_at_gives_the_log_softmax_and_its_gradient_across_slices_of_rows(monkeypatch, rows):
    monkeypatch.setattr(kernels, "CACHE_ROWS", 4)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(*rows, 11, generator=generator, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, rows, generator=generator)
    upstream = torch.randn(*rows, generator=generator, dtype=torch.float64)
    got = kernels.log_softmax_at(logits, targets)
    (got_grad,) = torch.autograd.grad(got, logits, upstream)
    expected = log_softmax_by_autograd(logits, targets)
    (expected_grad,) = torch.autograd.grad(expected, logits, upstream)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: kernels.log_softmax_at(x, targets), (logits,))


def test_log_softmax_at_of_bfloat16_logits_is_float32_and_matches_log_softmax():
    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 40, 97, generator=generator)).bfloat16().requires_grad_()
    targets = torch.randint(0, 97, (2, 40), generator=generator)
    upstream = torch.randn(2, 40, generator=generator)
    got = kernels.log_softmax_at(logits, targets)
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
    got = kernels.log_softmax_at(logits, targets)
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


ours = kernels.CausalAttentionFloat32Backward.apply
needs_the_kernel = pytest.mark.skipif(not kernels.FLOAT32_BACKWARD, reason="this build of torch lacks the CPU kernel's operators")


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
    monkeypatch.setattr(kernels.CausalAttentionFloat32Backward, "apply", lambda *qkv: calls.append(1) or ours(*qkv))
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = {}
    for backward in ("float32", "bfloat16"):
        # The same model, with CausalAttentionFloat32Backward, then with torch's own backward pass.
        monkeypatch.setattr(kernels, "FLOAT32_BACKWARD", backward == "float32")
        model.zero_grad()
        with autocast("cpu", "bf16"):
            logits, _ = model(tokens)
        logits.float().logsumexp(-1).sum().backward()
        grads[backward] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert len(calls) == model.config.n_layer  # each layer's attention, in the first pass only
    # Both are about 2% from the float32 model's gradient (bfloat16's rounding); they agree to 0.3%.
    assert (grads["float32"] - grads["bfloat16"]).norm() < 0.01 * grads["bfloat16"].norm()
    monkeypatch.setattr(kernels, "FLOAT32_BACKWARD", True)
    calls.clear()
    with torch.no_grad(), autocast("cpu", "bf16"):
        model(tokens)  # nothing to train through
    assert not calls
    model(tokens)  # float32
    assert not calls
    with autocast("cpu", "bf16"):
        generate(model, tokens, 3, generator=torch.Generator().manual_seed(0))  # writing
    assert not calls
    model.train()
    with autocast("cpu", "bf16"):
        model(tokens)  # with dropout
    assert not calls


def in_blocks(t, block, unwritten):
    """(rows, heads, positions, channels) kept as a cache keeps them: (blocks, rows, heads, block,
    channels), the slots past the last position holding `unwritten`."""
    blocks = -(-t.size(2) // block)
    slots = torch.full(t.shape[:2] + (blocks * block, t.size(3)), unwritten, dtype=t.dtype)
    slots[:, :, :t.size(2)] = t
    return slots.unflatten(2, (blocks, block)).permute(2, 0, 1, 3, 4)


# One query a row over 8 positions (two whole blocks of 4, every row seeing all), and over 9
# (three blocks, the last with three slots not written: NaN keys, stale values) where each of
# the 3 rows sees only its own positions; each with the keys lying in memory position by
# position, and channel by channel (as sample.KVCache keeps them in blocks).
@pytest.mark.parametrize("positions, filled", [(8, None), (9, [3, 8, 5])])
@pytest.mark.parametrize("keys_by_channel", [False, True])
def test_block_attention_is_torchs_attention(positions, filled, keys_by_channel):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 16, generator=generator, dtype=torch.float64) for n in (1, positions, positions))
    keys, values = in_blocks(k, 4, float("nan")), in_blocks(v, 4, 5.0)
    if keys_by_channel:
        keys = keys.transpose(-2, -1).contiguous().transpose(-2, -1)
    visible = None if filled is None else (torch.arange(12) <= torch.tensor(filled)[:, None])[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if visible is None else visible[..., :positions])
    torch.testing.assert_close(kernels.block_attention(q, keys, values, visible), expected, rtol=0, atol=1e-12)
    # The attention() the model calls takes it for keys in blocks.
    torch.testing.assert_close(kernels.attention(q, keys, values, visible, dropout=0.0, causal=False), expected,
                               rtol=0, atol=1e-12)


def test_block_attention_drops_out_weights_where_asked():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 16, generator=generator) for n in (1, 8, 8))
    keys, values = in_blocks(k, 4, 0.0), in_blocks(v, 4, 0.0)
    assert not torch.equal(kernels.block_attention(q, keys, values, None, dropout=0.0), torch.zeros_like(q))
    assert torch.equal(kernels.block_attention(q, keys, values, None, dropout=1.0), torch.zeros_like(q))


def test_a_new_tokens_attention_runs_by_hand_on_a_cpu_without_amx_and_fused_with_it(monkeypatch):
    model = tiny_model()
    calls = []
    by_hand = kernels.block_attention
    monkeypatch.setattr(kernels, "block_attention", lambda *args: calls.append(1) or by_hand(*args))
    tokens = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    for without_amx in (True, False):
        monkeypatch.setattr(kernels, "BY_HAND_ON_CPU", without_amx)
        calls.clear()
        with autocast("cpu", "bf16"):
            generate(model, tokens, 3, generator=torch.Generator().manual_seed(0))
        # Three tokens: the first from the prompt's pass, two from single-token steps, each layer's.
        assert len(calls) == (2 * model.config.n_layer if without_amx else 0)
