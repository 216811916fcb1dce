"""The GPT (model.py): its size, its context, its weights' start, and its plain generate()."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import always_writes
from model import GPT, TINY, Config
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


def test_the_layers_that_add_to_the_stream_start_smaller():
    # GPT-2's scaling: each block's attention and MLP end in a layer that adds to the stream,
    # started at 0.02 / sqrt(2 x layers), where the other matrices start at 0.02.
    model = GPT(Config()).requires_grad_(False)
    scaled = 0.02 / math.sqrt(2 * Config.n_layer)
    for block in (model.blocks[0], model.blocks[-1]):
        assert float(block.attention.proj.weight.std()) == pytest.approx(scaled, rel=0.05)
        assert float(block.mlp.down.weight.std()) == pytest.approx(scaled, rel=0.05)
        assert float(block.mlp.up.weight.std()) == pytest.approx(0.02, rel=0.05)


def test_the_forward_pass_is_gpt2_s_written_out_by_hand():
    # Pre-norm blocks: each adds to the stream its attention of the layer-normed stream, then
    # its MLP (up, GELU, down) of the layer-normed stream; a last layer norm, then the output layer.
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for norm in (module for module in model.modules() if isinstance(module, torch.nn.LayerNorm)):
            norm.weight.normal_(1, 0.3)  # each layer norm its own, so that no two can stand in for each other
            norm.bias.normal_(0, 0.3)
        x = model.token_embedding(tokens) + model.position_embedding(torch.arange(9))
        for block in model.blocks:
            x = x + block.attention(block.ln1(x))
            x = x + block.mlp.down(F.gelu(block.mlp.up(block.ln2(x))))
        torch.testing.assert_close(model(tokens)[0], model.head(model.ln(x)))


def test_in_training_dropout_takes_the_sum_of_the_two_embeddings():
    model = tiny_model().train()
    seen = []
    model.dropout.register_forward_hook(lambda module, inputs, output: seen.append((inputs[0], output)))
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens)
    ((embedded, dropped),) = seen
    torch.testing.assert_close(embedded, model.token_embedding(tokens) + model.position_embedding(torch.arange(9)))
    assert (dropped == 0).any() and not (embedded == 0).any()  # some of its numbers dropped


def test_every_weight_takes_part_in_the_loss():
    # A layer read in the wrong place (the MLP reading the attention's layer norm, say) leaves
    # some weight out of the forward pass: its gradient would be None or zero.
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens)[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_context_is_enforced():
    model = tiny_model()
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_greedy_generation_takes_the_likeliest_token_each_time():
    model = tiny_model()
    prompt = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        slow = generate_by_recomputing(model, prompt, 40)
    assert torch.equal(model.generate(prompt, 40, temperature=0), slow)


def test_generation_past_the_context_reads_the_last_positions():
    # A model of 8 positions writing 15 tokens: each token past the 8th comes from the 8 before it.
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=97, **{**TINY, "context": 8}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    model.eval()
    out = model.generate(torch.tensor([[1, 2, 3]]), 12, temperature=0)
    with torch.no_grad():
        for t in range(8, out.size(1)):
            assert out[0, t] == model(out[:, t - 8:t])[0][0, -1].argmax()


def test_generation_draws_from_the_model_distribution_with_its_temperature_and_top_k():
    model = tiny_model(vocab_size=5)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = model(prompt)[0][0, -1]
    for temperature, top_k in ((1.0, None), (0.5, None), (1.0, 2)):
        expected = torch.softmax(logits / temperature, -1)
        if top_k:
            expected = torch.where(logits >= logits.topk(top_k).values[-1], expected, 0.0)
            expected /= expected.sum()
        out = model.generate(prompt.repeat(4000, 1), 1, temperature, top_k, generator=torch.Generator().manual_seed(0))
        shares = torch.bincount(out[:, -1], minlength=5).float() / 4000
        assert torch.allclose(shares, expected, atol=0.025)


def test_generation_stops_at_the_stop_token_and_pads_with_it():
    model = tiny_model()
    prompt = torch.randint(0, 97, (4, 6), generator=torch.Generator().manual_seed(3))
    free = model.generate(prompt, 30, temperature=0)
    stop = free[0, 6 + 4].item()  # the fifth token the first row writes
    # Written on freely, the first row would write other tokens after it: only stopping pads with it.
    assert any(t != stop for t in free[0, 6 + 5:].tolist())
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
