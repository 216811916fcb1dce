import re

import pytest
import torch

import ppo
from model import GPT, TINY, Config, KVCache, read_checkpoint


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
    assert x.tolist() == [[0, 11, 12, 4, 5], [0, 13, 0, 0, 0]]  # the last token is only a target
    assert y.tolist() == [[-1, -1, 4, 5, eot], [-1, 6, -1, -1, -1]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]


def test_token_logprobs_equal_a_hand_computation():
    model = tiny_policy()
    x, y, mask = ppo.pack([[0, 7, 8]], [[9, 10, 0]], pad=0, device="cpu")
    with torch.no_grad():
        got = ppo.token_logprobs(model, x, y)
        logits, _ = model(x)
    by_hand = [torch.log_softmax(logits[0, 2 + i], -1)[t].item() for i, t in enumerate([9, 10, 0])]
    assert got[0, 2:].tolist() == pytest.approx(by_hand, abs=1e-6)
    assert got[0, :2].tolist() == [0.0, 0.0]


def sampled_logprobs(model, prompt, story):
    """The log-probability of each written token under the distribution it was drawn from,
    stepping through the KV cache as writing does."""
    cache = KVCache(model.config, len(prompt) + len(story))
    logits, _ = model(torch.tensor([prompt]), cache=cache)
    found = []
    for token in story:
        found.append(torch.log_softmax(logits[0, -1], -1)[token].item())
        logits, _ = model(torch.tensor([[token]]), cache=cache)
    return found


def test_token_logprobs_of_written_stories_are_those_they_were_sampled_from():
    model = tiny_policy()
    prompts = [[0, 3, 4, 5], [0, 6]]  # two lengths, each written for three times, in one batch
    groups = [torch.tensor([p]).repeat(3, 1) for p in prompts]
    outs = model.generate(groups, 12, stop=0, generator=torch.Generator().manual_seed(0))
    asked = [p for p in prompts for _ in range(3)]
    stories = [row[len(p):] for p, out in zip(prompts, outs) for row in out.tolist()]
    stories = [s[:s.index(0) + 1] if 0 in s else s for s in stories]
    x, y, mask = ppo.pack(asked, stories, pad=0, device="cpu")
    with torch.no_grad():
        packed = ppo.token_logprobs(model, x, y)
        for row, (prompt, story) in enumerate(zip(asked, stories)):
            start = len(prompt) - 1
            assert packed[row, start:start + len(story)].tolist() == pytest.approx(
                sampled_logprobs(model, prompt, story), abs=1e-5)


def test_the_first_minibatch_ratio_is_exactly_one():
    model = tiny_policy()
    prompts = [[0, 3 + i % 5] for i in range(32)]
    stories = [[5 + (i * 7 + j) % 40 for j in range(3 + i % 9)] for i in range(32)]
    x, y, mask = ppo.pack(prompts, stories, pad=0, device="cpu")
    with torch.no_grad():
        old = ppo.token_logprobs(model, x, y)  # the whole rollout at once, as the scripts do
    rows = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:ppo.MINIBATCH]
    new = ppo.token_logprobs(model, x[rows], y[rows])
    _, ratio = ppo.ppo_loss(new, old[rows], old[rows], torch.ones_like(new), mask[rows], kl=0.05)
    assert torch.equal(ratio * mask[rows], mask[rows])


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
    assert new.grad[0, 2] != 0 and new.grad[0, 3] != 0
    stats = ppo.clip_stats(ratio, advantages, torch.ones(1, 4))
    assert stats == {"clip_ratio/low": 0.25, "clip_ratio/high": 0.25, "clip_ratio/region": 0.5}


def test_the_critic_learns_the_rewards_of_a_fixed_rollout():
    model = tiny_policy()
    critic = torch.nn.Linear(model.config.n_embd, 1)
    x, y, mask = ppo.pack([[0, 3], [0, 4], [0, 5], [0, 6]], [[7, 8, 9], [10, 11], [12], [13, 14, 15, 16]],
                          pad=0, device="cpu")
    rewards = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])
    with torch.no_grad():
        _, channels = model(x, hidden=True)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss = ppo.value_loss(critic(channels).squeeze(-1), rewards, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10


def test_hidden_channels_give_the_same_logits():
    model = tiny_policy()
    tokens = torch.randint(0, 50, (2, 9))
    logits, _ = model(tokens)
    same, channels = model(tokens, hidden=True)
    assert torch.equal(logits, same) and channels.shape == (2, 9, model.config.n_embd)
    assert torch.allclose(model.head(channels), logits)


def rewards_printed(out):
    return [float(r) for r in re.findall(r"rollout \d+: reward ([0-9.]+)", out)]


def test_ppo_raises_an_easy_reward_and_saves_its_run(workspace, run_main, quick, capsys):
    quick(ppo)
    run_main(ppo, "--rollouts", "12", "--kl", "0.05", "--seed", "3", "--lr", "3e-3")
    rewards = rewards_printed(capsys.readouterr().out)
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05
    folder = workspace / "checkpoints" / "ppo" / "kl-0.05-lr-0.003-seed-3"
    assert {p.name for p in folder.iterdir()} == {"rollout-0.pt", "rollout-10.pt", "rollout-12.pt", "model.pt"}
    assert read_checkpoint(folder / "rollout-10.pt")["made_by"]["rollout"] == 10
    assert "critic" in read_checkpoint(folder / "rollout-10.pt")
    assert any((workspace / "runs" / "ppo" / "kl-0.05-lr-0.003-seed-3").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("args, message", [(["--kl", "-0.1"], "--kl"), (["--minutes", "0"], "--minutes"),
                                           (["--rollouts", "0"], "--rollouts"), (["--lr", "0"], "--lr")])
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
