import itertools
import math
import re

import numpy as np
import pytest
import torch

import evaluate
import finetune
import ppo
import rl
import sample
from checkpoints import read_checkpoint
from devices import autocast
from model import GPT, TINY, Config
from tokenizer import encode_prompt


def tiny_policy(vocab_size=50, seed=0):
    torch.manual_seed(seed)
    model = GPT(Config(vocab_size=vocab_size, **TINY)).eval()
    with torch.no_grad():  # weights far from their initial scale, so the distributions are not flat
        for p in model.parameters():
            if p.dim() >= 2:  # the matrices; layer norms as they are, else every row writes one token
                p.normal_(0, 0.3)
    return model


def test_pack_masks_exactly_the_story_tokens_and_their_end_of_text():
    eot = 0
    x, y, mask = ppo.pack([[0, 11, 12], [0, 13]], [[4, 5, eot], [6]], pad=eot, device="cpu")
    padding = [0] * (finetune.ALIGN - 5)  # the longest row's 5 positions, rounded up
    assert x.tolist() == [[0, 11, 12, 4, 5] + padding, [0, 13, 0, 0, 0] + padding]  # the last token is only a target
    assert y.tolist() == [[-1, -1, 4, 5, eot] + [-1] * len(padding), [-1, 6, -1, -1, -1] + [-1] * len(padding)]
    assert mask.tolist() == [[0, 0, 1, 1, 1] + padding, [0, 1, 0, 0, 0] + padding]


def test_token_logprobs_equal_a_hand_computation():
    model = tiny_policy()
    x, y, mask = ppo.pack([[0, 7, 8]], [[9, 10, 0]], pad=0, device="cpu")
    with torch.no_grad():
        got = ppo.token_logprobs(model, x, y)
        logits, _ = model(x)
    by_hand = [torch.log_softmax(logits[0, 2 + i], -1)[t].item() for i, t in enumerate([9, 10, 0])]
    assert got[0, 2:5].tolist() == pytest.approx(by_hand, abs=1e-6)
    assert got[0, :2].tolist() == [0.0, 0.0] and not got[0, 5:].any()  # the prompt and the padding


def test_token_logprobs_are_float32_where_the_logits_are_bf16():
    # Under autocast the logits come out in bf16; rounded back to bf16, each log-probability
    # would move by up to 1/256 of its size, and the ratio and KL with it.
    model = tiny_policy()
    x, y, mask = ppo.pack([[0, 7, 8]], [[9, 10, 0]], pad=0, device="cpu")
    with torch.no_grad(), autocast("cpu", "bf16"):
        got = ppo.token_logprobs(model, x, y)
        logits, _ = model(x)
    assert logits.dtype == torch.bfloat16 and got.dtype == torch.float32
    by_hand = torch.log_softmax(logits[0, 2:5].float(), -1).gather(-1, torch.tensor([[9], [10], [0]])).squeeze(1)
    assert torch.allclose(got[0, 2:5], by_hand, atol=1e-5)


def write_and_record(model, groups, max_new_tokens, stop, monkeypatch):
    """Writes after groups of prompts in one batch, as the rollouts do, and records the
    log-probability of each drawn token under the distribution it was drawn from: the batched
    logits sample.next_token is given at each step. Returns the stories, cut after their stop,
    each with its recorded log-probabilities, and how many rows each step had."""
    real, steps = sample.next_token, []

    def recording(logits, temperature, top_k, generator):
        token = real(logits, temperature, top_k, generator)
        drawn = torch.log_softmax(sample.sampling_logits(logits, temperature, top_k), -1)
        steps.append((token.tolist(), drawn.gather(-1, token[:, None]).squeeze(1).tolist()))
        return token

    monkeypatch.setattr(sample, "next_token", recording)
    outs = sample.generate(model, groups, max_new_tokens, stop=stop, generator=torch.Generator().manual_seed(0))
    written = [row[group.size(1):] for group, out in zip(groups, outs) for row in out.tolist()]
    # A step's rows are those still in the batch, in order: rows leave only once they have ended.
    batch, ended, found = list(range(len(written))), set(), [[] for _ in written]
    for step, (tokens, logprobs) in enumerate(steps):
        if len(tokens) < len(batch):
            batch = [row for row in batch if row not in ended]
        assert len(tokens) == len(batch)
        for row, token, logprob in zip(batch, tokens, logprobs):
            if row not in ended:
                assert written[row][step] == token
                found[row].append(logprob)
                if token == stop:
                    ended.add(row)
    stories = [w[:w.index(stop) + 1] if stop in w else w for w in written]
    assert [len(f) for f in found] == [len(s) for s in stories]
    return stories, found, [len(tokens) for tokens, _ in steps]


# In float32 the log-probabilities of the update are those of the draws, to rounding. In bfloat16,
# the scripts' precision where it is faster, the writing (one token at a time, over a bfloat16
# cache) and the update (whole stories) round differently: they agree to bfloat16's
# rounding, a hundredth of a nat on average, where the clip allows 0.18 either way.
@pytest.mark.parametrize("precision, worst, mean", [("fp32", 1e-5, 1e-5), ("bf16", 0.1, 0.02)])
def test_token_logprobs_of_written_stories_are_those_they_were_sampled_from(monkeypatch, precision, worst, mean):
    model = tiny_policy()
    # As in a rollout: groups that repeat one prompt (GRPO's) and a batch of different prompts of
    # one length (PPO's), of several lengths, in one batch, at temperature 1, rows ending at stop.
    groups = [torch.tensor([[0, 3, 4, 5]]).repeat(3, 1), torch.tensor([[0, 6]]).repeat(3, 1),
              torch.tensor([[0, 7, 8], [0, 9, 10], [0, 11, 12]])]
    stop = 1
    with autocast("cpu", precision):
        stories, drawn, batch_sizes = write_and_record(model, groups, 24, stop, monkeypatch)
    assert min(batch_sizes) < 9 and any(stop not in s for s in stories)  # rows left, others wrote on
    prompts = [row.tolist() for group in groups for row in group]
    x, y, mask = ppo.pack(prompts, stories, pad=0, device="cpu")
    with torch.no_grad(), autocast("cpu", precision):
        packed = ppo.token_logprobs(model, x, y)
    gaps = []
    for row, (prompt, story) in enumerate(zip(prompts, stories)):
        start = len(prompt) - 1
        assert len(drawn[row]) == len(story)
        gaps += [abs(a - b) for a, b in zip(packed[row, start:start + len(story)].tolist(), drawn[row])]
    assert max(gaps) <= worst and sum(gaps) / len(gaps) <= mean


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_first_minibatch_ratio_is_exactly_one_as_the_scripts_compute_it(precision):
    # As in the scripts: a policy with dropout (model.TINY keeps the series' 0.1) in evaluation
    # mode, the whole rollout's log-probabilities at once, then a minibatch's, each under autocast.
    model = tiny_policy()
    assert model.config.dropout > 0 and not model.training
    rows = ppo.BATCHES * ppo.PER_BATCH
    prompts = [[0, 3 + i % 5] for i in range(rows)]
    stories = [[5 + (i * 7 + j) % 40 for j in range(3 + i % 9)] for i in range(rows)]
    x, y, mask = ppo.pack(prompts, stories, pad=0, device="cpu")
    with torch.no_grad(), autocast("cpu", precision):
        old = ppo.token_logprobs(model, x, y)
    picked = torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:ppo.MINIBATCH]
    with autocast("cpu", precision):
        new = ppo.token_logprobs(model, x[picked], y[picked])
    _, ratio = ppo.ppo_loss(new, old[picked], old[picked], torch.ones_like(new), mask[picked], kl=0.05)
    assert torch.equal(ratio * mask[picked], mask[picked])


def test_kl_term_is_zero_when_policy_equals_reference_and_positive_otherwise():
    new = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.ones_like(new)
    advantages = torch.zeros_like(new)  # the clipped objective counts for nothing here
    same, _ = ppo.ppo_loss(new, new, new, advantages, mask, kl=1.0)
    assert same.item() == 0.0
    apart, _ = ppo.ppo_loss(new, new, new + torch.tensor([[0.3, -0.2, 0.0]]), advantages, mask, kl=1.0)
    assert apart.item() > 0  # the loss rises with the KL, whichever way the policy moved


def test_clip_stops_the_gradient_past_the_band_in_the_advantages_direction():
    old = torch.zeros(1, 4)
    # ratios 1.5 (advantage +1: clipped), 0.5 (advantage -1: clipped), 1.5 (advantage -1: not), 1.0 (+1)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.5, 1.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, ratio = ppo.ppo_loss(new, old, new.detach(), advantages, torch.ones(1, 4), kl=0.0)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] == 0
    # The others, the whole gradient of -ratio x advantage / 4 tokens: past the band against
    # the advantage, and inside it, where the min's two sides are equal.
    assert new.grad[0, 2].item() == pytest.approx(1.5 / 4) and new.grad[0, 3].item() == pytest.approx(-1 / 4)
    stats = rl.clip_stats(ratio, advantages, torch.ones(1, 4), ppo.CLIP)
    assert stats == {"clip_ratio/low": 0.25, "clip_ratio/high": 0.25, "clip_ratio/region": 0.5}


def ppo_objective(new, old, ref, advantages, mask, kl, clip=ppo.CLIP):
    """PPO's loss in plain Python: the clipped objective minus kl times k3 (r = ref - new), at
    each story token, averaged over all the minibatch's story tokens, and negated."""
    total, tokens = 0.0, 0
    for i in range(mask.size(0)):
        for t in range(mask.size(1)):
            if not mask[i, t]:
                continue
            ratio = math.exp(new[i, t].item() - old[i, t].item())
            a = advantages[i, t].item()
            r = ref[i, t].item() - new[i, t].item()
            total += min(ratio * a, max(min(ratio, 1 + clip), 1 - clip) * a) - kl * (math.exp(r) - r - 1)
            tokens += 1
    return -total / tokens


def test_loss_is_the_token_mean_of_the_clipped_objective_and_k3_on_padded_stories():
    g = torch.Generator().manual_seed(0)
    # Four stories of different lengths after prompts of different lengths, padded to 9.
    lengths, starts = [5, 2, 7, 3], [1, 3, 1, 2]
    mask = torch.zeros(4, 9)
    for i, (start, n) in enumerate(zip(starts, lengths)):
        mask[i, start:start + n] = 1
    # Numbers over the prompts and the padding too: the mask alone must keep them out.
    old = -torch.rand(4, 9, generator=g) * 3
    new = (old + torch.randn(4, 9, generator=g) * 0.3).requires_grad_()  # ratios on both sides of the band
    ref = old + torch.randn(4, 9, generator=g) * 0.5
    advantages = torch.randn(4, 9, generator=g)  # one per token, as the critic's guesses make them
    ratio = torch.exp(new - old).detach()
    story = mask.bool()
    assert (story & (ratio > 1 + ppo.CLIP) & (advantages > 0)).any()  # the clip binds from above
    assert (story & (ratio < 1 - ppo.CLIP) & (advantages < 0)).any()  # and from below
    loss, got_ratio = ppo.ppo_loss(new, old, ref, advantages, mask, kl=0.1)
    assert loss.item() == pytest.approx(ppo_objective(new, old, ref, advantages, mask, kl=0.1), rel=1e-5)
    assert torch.allclose(got_ratio.detach(), ratio)
    loss.backward()
    assert torch.all(new.grad[~story] == 0) and torch.all(new.grad[story] != 0)


def test_the_critic_learns_the_rewards_of_a_fixed_rollout():
    model = tiny_policy()
    critic = torch.nn.Linear(model.config.n_embd, 1)
    torch.nn.init.zeros_(critic.weight)  # as ppo.py starts it: every guess 0
    torch.nn.init.zeros_(critic.bias)
    x, y, mask = ppo.pack([[0, 3], [0, 4], [0, 5], [0, 6]], [[7, 8, 9], [10, 11], [12], [13, 14, 15, 16]],
                          pad=0, device="cpu")
    rewards = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])
    with torch.no_grad():
        _, channels = model(x, hidden=True)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(300):
        loss = ppo.value_loss(critic(channels).squeeze(-1), rewards, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # At every story token, the critic's guess is now that story's reward.
    values = critic(channels).squeeze(-1).detach()
    story = mask.bool()
    errors = (values - rewards[:, None])[story]
    assert errors.abs().max() < 0.02, errors


def test_whitened_advantages_have_mean_0_and_spread_1_over_the_story_tokens_and_keep_their_order():
    torch.manual_seed(0)
    advantages, mask = torch.randn(4, 7) * 0.3 + 0.2, (torch.rand(4, 7) < 0.7).float()
    white = ppo.whiten(advantages * mask, mask)
    count = mask.sum()
    assert float((white * mask).sum() / count) == pytest.approx(0, abs=1e-6)
    assert float((white ** 2 * mask).sum() / count) == pytest.approx(1, rel=1e-3)
    assert torch.all(white[mask == 0] == 0)
    kept = mask.bool()
    assert torch.equal(advantages[kept].argsort(), white[kept].argsort())


def test_the_value_loss_is_the_mean_squared_error_over_the_story_tokens():
    lengths, starts = [5, 2, 7, 3], [1, 3, 1, 2]  # prompts of several lengths, then padding
    mask = torch.zeros(4, 9)
    for i, (start, n) in enumerate(zip(starts, lengths)):
        mask[i, start:start + n] = 1
    values = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))  # a guess over the padding too
    rewards = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])
    by_hand = [(values[i, t].item() - rewards[i].item()) ** 2
               for i in range(4) for t in range(9) if mask[i, t]]
    got = ppo.value_loss(values, rewards, mask)
    assert got.item() == pytest.approx(sum(by_hand) / sum(lengths), rel=1e-6)


def test_a_rollout_draws_every_instruction_as_often_whatever_its_length(workspace_tokenizer, monkeypatch):
    # 1,000 instructions of 18 tokens and 10 of 19, as the shared sample's 1,217 and 23: a
    # batch of 19 tokens should come about once in a hundred, not once in two.
    eot = workspace_tokenizer.eot
    asks = {length: [([eot] * length, ["kite", "river", "brave"]) for _ in range(count)]
            for length, count in ((18, 1000), (19, 10))}
    monkeypatch.setattr(ppo, "generate", lambda policy, prompts, *args, **kwargs:
                        [torch.cat([p, torch.full((len(p), 1), eot)], dim=1) for p in prompts])
    rng = np.random.default_rng(0)
    lengths = [len(prompt) for seed in range(20)
               for prompt in ppo.rollout(torch.nn.Linear(1, 1), workspace_tokenizer, asks, rng, seed)[0]]
    assert len(lengths) == 20 * 128
    assert lengths.count(19) / len(lengths) < 0.05  # 1% expected; 50% if each length were as likely


def stories_that_end_at_different_steps(kite, eot):
    """A stand-in for sample.generate whose row r of batch b writes r + b % 3 tokens of a kite,
    then ends; the rows that ended write end-of-text after, as generate pads them."""
    def generate(policy, prompts, max_new_tokens, **options):
        outs = []
        for b, batch in enumerate(prompts):
            rows = [(kite * 10)[:r + b % 3] + [eot] for r in range(len(batch))]
            width = max(map(len, rows)) + 3
            outs.append(torch.cat([batch, torch.tensor([row + [eot] * (width - len(row)) for row in rows])], dim=1))
        return outs
    return generate


def test_a_rollout_s_stories_are_the_tokens_written_after_each_prompt_to_the_first_end_of_text(
        small_tokenizer, monkeypatch):
    eot, words = small_tokenizer.eot, ["kite", "river", "brave"]
    asks = {len(encode_prompt(small_tokenizer, "Story 0.")): [
        (encode_prompt(small_tokenizer, f"Story {i}."), words) for i in range(10)]}
    kite = small_tokenizer.encode(" a kite")
    monkeypatch.setattr(ppo, "generate", stories_that_end_at_different_steps(kite, eot))
    prompts, stories, rewards = ppo.rollout(torch.nn.Linear(1, 1), small_tokenizer, asks, np.random.default_rng(0), 0)
    # A batch's eight instructions differ (of the ten there are): none is drawn twice in it.
    for start in range(0, len(prompts), ppo.PER_BATCH):
        assert len({tuple(prompt) for prompt in prompts[start:start + ppo.PER_BATCH]}) == ppo.PER_BATCH
    assert stories == [(kite * 10)[:r + b % 3] + [eot] for b in range(ppo.BATCHES) for r in range(ppo.PER_BATCH)]
    assert rewards == [evaluate.words_used(small_tokenizer.decode(story), words) for story in stories]
    _, _, mask = ppo.pack(prompts, stories, eot, "cpu")
    assert mask.sum(dim=1).tolist() == [len(story) for story in stories]


def test_hidden_channels_give_the_same_logits():
    model = tiny_policy()
    tokens = torch.randint(0, 50, (2, 9))
    logits, _ = model(tokens)
    same, channels = model(tokens, hidden=True)
    assert torch.equal(logits, same) and channels.shape == (2, 9, model.config.n_embd)
    assert torch.allclose(model.head(channels), logits)


def rewards_printed(out):
    return [float(r) for r in re.findall(r"rollout \d+: reward ([0-9.]+)", out)]


def recording_the_update(script, loss_name, monkeypatch):
    """Wraps a script's loss (ppo_loss or grpo_loss), and for PPO its value_loss, to keep what
    each update got: the ratios, the mask, each loss, and the loss the optimizer stepped on."""
    updates, real_loss = [], getattr(script, loss_name)

    def loss(new, old, ref, advantages, mask, kl):
        policy_loss, ratio = real_loss(new, old, ref, advantages, mask, kl)
        updates.append({"ratio": ratio.detach(), "mask": mask, "advantages": advantages, "policy_loss": policy_loss.item()})
        return policy_loss, ratio

    monkeypatch.setattr(script, loss_name, loss)
    if hasattr(script, "value_loss"):
        real_value_loss = script.value_loss

        def value_loss(values, rewards, mask):
            critic_loss = real_value_loss(values, rewards, mask)
            updates[-1]["critic_loss"] = critic_loss.item()
            return critic_loss

        monkeypatch.setattr(script, "value_loss", value_loss)
    real_step = script.optimizer_step

    def optimizer_step(model, optimizer, loss, lr):
        updates[-1]["stepped_on"] = loss.item()
        return real_step(model, optimizer, loss, lr)

    monkeypatch.setattr(script, "optimizer_step", optimizer_step)
    return updates


def each_pass_takes_every_story_once_in_a_new_order(updates, stories):
    """Checks a run's recorded updates (of `stories` stories a rollout): each pass over a
    rollout's minibatches holds every story once, as its advantages show, in an order of its
    own, so no two passes step on the same minibatches."""
    per_pass = math.ceil(stories / ppo.MINIBATCH)
    for first in range(0, len(updates), ppo.EPOCHS * per_pass):
        passes = [torch.cat([u["advantages"] for u in updates[start:start + per_pass]]).reshape(stories, -1)
                  for start in range(first, first + ppo.EPOCHS * per_pass, per_pass)]
        rows = sorted(map(tuple, passes[0].tolist()))
        assert all(sorted(map(tuple, one_pass.tolist())) == rows for one_pass in passes)
        if len(set(rows)) > 1:  # where every story has one advantage, no order can show
            assert not any(torch.equal(a, b) for a, b in itertools.combinations(passes, 2))


def recording_the_seeds(script, monkeypatch):
    """Wraps a script's rollout to keep the seed each rollout writes its stories with."""
    seeds, real_rollout = [], script.rollout
    monkeypatch.setattr(script, "rollout", lambda *args, seed: seeds.append(seed) or real_rollout(*args, seed=seed))
    return seeds


def recording_the_logs(script, monkeypatch):
    """Wraps a script's log_rollout to keep each rollout's figures, as TensorBoard gets them."""
    logged, real_log = [], script.log_rollout
    monkeypatch.setattr(script, "log_rollout", lambda writer, rollout, figures, line: logged.append(figures)
                        or real_log(writer, rollout, figures, line))
    return logged


def first_minibatches(updates, stories):
    """Each rollout's first update (of `stories` stories): its policy is still the one that wrote them."""
    per_rollout = ppo.EPOCHS * math.ceil(stories / ppo.MINIBATCH)
    assert len(updates) % per_rollout == 0
    return updates[::per_rollout]


def test_the_critic_learns_the_story_s_reward(workspace, run_main, quick, monkeypatch):
    # Every story scores 0.5 and the critic starts at 0: its first error is 0.5 squared at every token.
    quick(ppo)
    monkeypatch.setattr(ppo, "words_used", lambda story, words: 0.5)
    updates = recording_the_update(ppo, "ppo_loss", monkeypatch)
    run_main(ppo, "--rollouts", "1", "--device", "cpu", "--precision", "fp32")
    assert updates[0]["critic_loss"] == pytest.approx(0.25)


def test_each_token_s_advantage_is_the_reward_less_the_critic_s_guess_at_that_token(workspace, run_main, quick,
                                                                                   monkeypatch):
    # In the second rollout the critic has learned, and guesses differently along a story: the
    # advantage at each token is the story's reward less the critic's guess from that token's
    # channels, before whitening.
    quick(ppo)
    seen, modules, checked = {}, [], []
    real_logprobs, real_rollout, real_whiten = ppo.token_logprobs, ppo.rollout, ppo.whiten
    real_wrap = ppo.distributed.wrap

    def keeping_channels(model, x, y, hidden=False):
        out = real_logprobs(model, x, y, hidden=hidden)
        if hidden and not torch.is_grad_enabled():  # the rollout's, before the update
            seen["channels"] = out[1]
        return out

    def keeping_rewards(*args, **kwargs):
        prompts, stories, rewards = real_rollout(*args, **kwargs)
        seen["rewards"] = rewards
        return prompts, stories, rewards

    def checked_whiten(advantages, mask):
        critic = modules[1]
        with torch.no_grad():
            values = critic(seen["channels"].float()).squeeze(-1)
        expected = (torch.tensor(seen["rewards"])[:, None] - values) * mask
        checked.append((torch.allclose(advantages, expected, atol=1e-6), values[mask.bool()].unique().numel()))
        return real_whiten(advantages, mask)

    monkeypatch.setattr(ppo, "token_logprobs", keeping_channels)
    monkeypatch.setattr(ppo, "rollout", keeping_rewards)
    monkeypatch.setattr(ppo, "whiten", checked_whiten)
    monkeypatch.setattr(ppo.distributed, "wrap", lambda module: modules.append(module) or real_wrap(module))
    run_main(ppo, "--rollouts", "2", "--lr", "3e-3", "--device", "cpu", "--precision", "fp32")
    assert [same for same, _ in checked] == [True, True]
    assert checked[1][1] > 1  # the second rollout's guesses differ from token to token


def test_ppo_raises_an_easy_reward_and_saves_its_run(workspace, run_main, quick, capsys, monkeypatch):
    quick(ppo)
    updates = recording_the_update(ppo, "ppo_loss", monkeypatch)
    seeds = recording_the_seeds(ppo, monkeypatch)
    run_main(ppo, "--rollouts", "12", "--kl", "0.05", "--seed", "3", "--lr", "3e-3",
             "--device", "cpu", "--precision", "fp32")
    rewards = rewards_printed(capsys.readouterr().out)
    assert len(rewards) == 12
    assert len(set(seeds)) == 12  # each rollout draws its stories with random numbers of its own
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05
    # The script's own update: in its first minibatch the ratio is exactly 1 (dropout off, the
    # rollout's log-probabilities computed as the update's), and one step takes the policy's
    # loss plus the critic's at VALUE_WEIGHT.
    assert len(updates) == 12 * ppo.EPOCHS * ppo.BATCHES * ppo.PER_BATCH // ppo.MINIBATCH
    for update in first_minibatches(updates, ppo.BATCHES * ppo.PER_BATCH):
        assert torch.equal(update["ratio"] * update["mask"], update["mask"])
    # Each rollout's advantages, over its first pass's minibatches (every story once), are whitened.
    per_pass = ppo.BATCHES * ppo.PER_BATCH // ppo.MINIBATCH
    for first in range(0, len(updates), ppo.EPOCHS * per_pass):
        one_pass = updates[first:first + per_pass]
        advantages = torch.cat([u["advantages"] for u in one_pass])
        mask = torch.cat([u["mask"] for u in one_pass])
        mean = (advantages * mask).sum() / mask.sum()
        assert abs(mean) < 1e-4 and ((advantages - mean) ** 2 * mask).sum() / mask.sum() == pytest.approx(1, rel=1e-2)
    for update in updates:
        assert update["stepped_on"] == pytest.approx(update["policy_loss"] + ppo.VALUE_WEIGHT * update["critic_loss"],
                                                     rel=1e-5, abs=1e-7)
    each_pass_takes_every_story_once_in_a_new_order(updates, ppo.BATCHES * ppo.PER_BATCH)
    folder = workspace / "checkpoints" / "ppo" / "kl-0.05-lr-0.003-seed-3"
    assert {p.name for p in folder.iterdir()} == {"rollout-0.pt", "rollout-10.pt", "rollout-12.pt", "model.pt"}
    assert read_checkpoint(folder / "rollout-10.pt")["made_by"]["rollout"] == 10
    assert "critic" in read_checkpoint(folder / "rollout-10.pt")
    # AdamW with no weight decay, on the policy's weights and the critic's alike.
    groups = read_checkpoint(folder / "rollout-12.pt")["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.0]
    assert any((workspace / "runs" / "ppo" / "kl-0.05-lr-0.003-seed-3").glob("events.out.tfevents.*"))


def test_the_critic_s_error_moves_the_critic_alone_and_its_guesses_are_taken_from_the_rewards(workspace, run_main,
                                                                                                quick, monkeypatch):
    # Three rollouts. The critic reads the policy's channels, detached: its error reaches no
    # weight of the policy. Each token's advantage is the story's reward less the critic's guess
    # there: in the first rollout, with the critic at 0, one number along a story; once the
    # critic has learned, numbers that change along it.
    quick(ppo)
    updates = recording_the_update(ppo, "ppo_loss", monkeypatch)
    loaded, real_load = [], ppo.load_checkpoint
    monkeypatch.setattr(ppo, "load_checkpoint", lambda *args, **kwargs: loaded.append(real_load(*args, **kwargs))
                        or loaded[-1])
    reaches_the_policy, real_value_loss = [], ppo.value_loss

    def value_loss(values, rewards, mask):
        critic_loss = real_value_loss(values, rewards, mask)
        grads = torch.autograd.grad(critic_loss, list(loaded[0].parameters()), allow_unused=True, retain_graph=True)
        reaches_the_policy.append(any(grad is not None for grad in grads))
        return critic_loss

    monkeypatch.setattr(ppo, "value_loss", value_loss)
    run_main(ppo, "--rollouts", "3", "--lr", "3e-3", "--device", "cpu", "--precision", "fp32")
    assert len(reaches_the_policy) == len(updates) > 0 and not any(reaches_the_policy)

    def changes_along_a_story(update):
        return any(len(set(row[kept].tolist())) > 1 for row, kept in zip(update["advantages"], update["mask"].bool()))

    per_rollout = ppo.EPOCHS * ppo.BATCHES * ppo.PER_BATCH // ppo.MINIBATCH
    assert len(updates) == 3 * per_rollout
    assert not any(changes_along_a_story(update) for update in updates[:per_rollout])
    assert all(changes_along_a_story(update) for update in updates[per_rollout:])


@pytest.mark.parametrize("args, message", [(["--kl", "-0.1"], "--kl"), (["--minutes", "0"], "--minutes"),
                                           (["--rollouts", "0"], "--rollouts"), (["--lr", "0"], "--lr"),
                                           (["--seed", "-1"], "--seed must be 0 to 4294967295"),
                                           (["--seed", str(2 ** 32)], "--seed must be 0 to 4294967295")])
def test_bad_options_get_one_line(run_main, capsys, args, message):
    with pytest.raises(SystemExit):
        run_main(ppo, *args)
    assert message in capsys.readouterr().err


def test_a_missing_fine_tuned_model_names_the_command_that_makes_it(workspace, run_main, tmp_path, monkeypatch):
    import shutil
    shutil.copytree(workspace / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["ppo.py", "--rollouts", "1"])
    with pytest.raises(SystemExit, match="python finetune.py"):
        ppo.main()
