"""
Benchmark: one GRPO rollout at the series size, from a real fine-tuned model. 16 training
instructions, each written for 8 times (128 stories of up to 200 tokens, temperature 1),
scored, their old and reference log-probabilities, and the update (2 passes in minibatches
of 16): the seconds of each part and its share of the machine's matrix-product peak
(measured after each rollout, the fastest taken), the median of --repeats rollouts, each
with new instructions, and their range (a busy machine moves them from one rollout to the
next); and the writing's own floor, its products at the peak and the keys and values its
steps read at the memory's speed (a sum over 256 MB measures it). As in grpo.py, everything
runs in one precision, bf16 where the device multiplies faster (devices.default_precision),
--precision to choose.

In the same run: the episode's literal writing, one call of 8 stories for each of the 16
instructions, beside grpo.py's one batched pass over all 128, the same instructions and the
same number of stories, so the ratio holds on any machine; and the batched pass again in the
other precision, to see what bf16 buys, and how far bf16 matrix products move the
log-probabilities the ratio and the KL are made of, against fp32, on the rollout's own stories;
both only where bf16 is the machine's faster precision (or asked for with --precision bf16):
elsewhere bf16 runs many times slower, and the bench says so instead.

With --profile, one more rollout's writing under torch's profiler: its operators, the most
expensive first, the single-token steps its rows took against the tokens its stories kept
(a row whose story has ended goes on costing a step until it leaves the batch), and the
pages of fresh memory the system handed it (Linux and macOS count them).

    python bench/rollout.py                       (about 7 minutes on a 2-core CPU)
    python bench/rollout.py --precision fp32 --repeats 1
    python bench/rollout.py --repeats 1 --profile
"""
import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

try:
    import resource  # the page faults a process took: Linux and macOS, not Windows
except ImportError:
    resource = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import grpo_asks, peak_memory_mb, read_bandwidth, timed  # noqa: E402
from bench.train import DTYPES, forward_flops, matmul_peak  # noqa: E402
from checkpoints import CHECKPOINTS, load_checkpoint  # noqa: E402
from devices import autocast, default_precision, machine, pick_device  # noqa: E402
from evaluate import words_used  # noqa: E402
from grpo import GROUP, group_advantages, grpo_loss, rollout  # noqa: E402
from ppo import EPOCHS, LR, MINIBATCH, pack, token_logprobs  # noqa: E402
from sample import MAX_NEW_TOKENS, cut_at_end, generate  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from train import optimizer_step  # noqa: E402

PARTS = ("writing", "scoring", "logprobs", "update")  # a rollout's, timed one after another


def write_group_by_group(policy, tokenizer, prompts, seed):
    """The episode's literal loop: one call of 8 stories for each instruction. Returns the
    story tokens it wrote, each story up to its end-of-text, as the rollout counts them."""
    generator = torch.Generator(device=prompts[0].device).manual_seed(seed)
    written = 0
    for prompt in prompts:
        out = generate(policy, prompt, MAX_NEW_TOKENS, temperature=1.0, stop=tokenizer.eot, generator=generator)
        written += sum(len(cut_at_end(row, tokenizer.eot)) for row in out[:, prompt.size(1):].tolist())
    return written


def cache_bytes_read(prompts, stories, config, element_size):
    """The fewest bytes of keys and values the writing's steps can read: the step that takes
    in a story's token reads, in every layer, the keys and values of its row's prompt and of
    its story so far, that token included. A story's first token comes from its prompt's
    pass, which reads no cache. The writing reads more than this: whole blocks of positions,
    each up to the batch's longest row, and rows whose story has ended until they leave."""
    per_position = 2 * config.n_layer * config.n_embd * element_size
    return per_position * sum(len(prompt) + k for prompt, story in zip(prompts, stories) for k in range(1, len(story)))


def writing_flops(model, prompts, stories):
    """The writing's matrix products: a forward pass for each story token, the one that drew
    it, attending to its prompt and to its story before it (the first token comes from the
    prompt's last position). Tokens drawn after a story ended are not the stories'."""
    attended = sum(len(story) * len(prompt) + len(story) * (len(story) - 1) // 2
                   for prompt, story in zip(prompts, stories))
    return forward_flops(model, sum(len(story) for story in stories), attended)


def measure_rollout(policy, reference, optimizer, tokenizer, asks, seed, device, precision, both_precisions):
    """One rollout of grpo.py, part by part; the same instructions written group by group, and,
    with both_precisions, written again in the other precision."""
    def write(precision):
        with autocast(device, precision):
            return rollout(policy, tokenizer, asks, np.random.default_rng(seed), seed)

    (prompts, stories, rewards), writing_and_scoring = timed(device, lambda: write(precision))
    texts = [tokenizer.decode(story) for story in stories]
    _, scoring = timed(device, lambda: [words_used(t, ["cake", "rain", "jump"]) for t in texts])
    groups = [torch.tensor([prompts[i]], device=device).repeat(GROUP, 1) for i in range(0, len(prompts), GROUP)]
    with autocast(device, precision):
        by_group_tokens, by_group = timed(device, lambda: write_group_by_group(policy, tokenizer, groups, seed))
    other = "fp32" if precision == "bf16" else "bf16"
    other_stories, other_writing = [], 0.0
    if both_precisions:
        (_, other_stories, _), other_writing = timed(device, lambda: write(other))

    x, y, mask = pack(prompts, stories, tokenizer.eot, device)
    advantages, _ = group_advantages(torch.tensor(rewards, device=device))

    def old_and_ref():
        with torch.no_grad(), autocast(device, precision):
            return token_logprobs(policy, x, y), token_logprobs(reference, x, y)

    (old, ref), logprobs = timed(device, old_and_ref)

    def update():
        for _ in range(EPOCHS):
            for rows in torch.randperm(len(x)).to(device).split(MINIBATCH):
                with autocast(device, precision):
                    new = token_logprobs(policy, x[rows], y[rows])
                loss, _ = grpo_loss(new, old[rows], ref[rows], advantages[rows], mask[rows], 0.05)
                optimizer_step(policy, optimizer, loss, LR)

    _, updating = timed(device, update)
    written = int(mask.sum())
    run = {"writing": writing_and_scoring - scoring, "scoring": scoring, "logprobs": logprobs, "update": updating,
           "by_group": by_group, "by_group_tokens": by_group_tokens,
           "other_writing": other_writing, "other_tokens": sum(len(s) for s in other_stories),
           "story_tokens": written, "positions": x.numel(), "mean_length": written / len(x),
           "cache_bytes_read": cache_bytes_read(prompts, stories, policy.config, DTYPES[precision].itemsize)}
    run["whole rollout"] = sum(run[part] for part in PARTS)
    # Each part's matrix products, a backward pass twice a forward's. A pass over the packed
    # stories computes every position of every row, each attending to itself and those before it.
    rows, positions = x.shape
    a_pass = forward_flops(policy, x.numel(), rows * positions * (positions + 1) // 2)
    work = {"writing": writing_flops(policy, prompts, stories), "scoring": 0.0, "logprobs": 2 * a_pass,
            "update": EPOCHS * 3 * a_pass}
    run.update({f"{part} work": flops for part, flops in work.items()})
    run["whole rollout work"] = sum(work.values())
    return run


def precision_drift(policy, tokenizer, asks, device):
    """On one rollout's stories: bf16 against fp32 log-probabilities of the same weights."""
    prompts, stories, _ = rollout(policy, tokenizer, asks, np.random.default_rng(99), 99)
    x, y, mask = pack(prompts, stories, tokenizer.eot, device)
    with torch.no_grad():
        exact = token_logprobs(policy, x, y)
        with autocast(device, "bf16"):
            rounded = token_logprobs(policy, x, y)
    # The KL of the bf16 model from the fp32 one that wrote the stories, estimated as grpo.py
    # estimates the policy's from the reference: r is the other model's log p less the writer's.
    r = rounded - exact
    return {"mean_abs_per_token": float((r.abs() * mask).sum() / mask.sum()),
            "ratio_spread": float(((torch.exp(r) - 1).abs() * mask).sum() / mask.sum()),
            "kl_per_story": float(((torch.exp(r) - r - 1) * mask).sum(dim=1).mean())}


def profile_writing(policy, tokenizer, asks, device, precision, operators=15):
    """One more rollout's writing under the profiler; prints where its time went."""
    rows_a_step = []  # the batch of each single-token step
    hook = policy.register_forward_pre_hook(lambda _, args: rows_a_step.append(len(args[0])) if args[0].size(1) == 1
                                            else None)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else None
    with profile(activities=[ProfilerActivity.CPU]) as profiled, autocast(device, precision):
        prompts, stories, _ = rollout(policy, tokenizer, asks, np.random.default_rng(99), 99)
    hook.remove()
    by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\nthe writing of one more rollout, profiled:\n"
          f"{profiled.key_averages().table(sort_by=by, row_limit=operators)}")
    # The first token of every row comes from the prompt's pass; each later one from a step.
    stepped, kept = len(prompts) + sum(rows_a_step), sum(len(story) for story in stories)
    print(f"{len(rows_a_step) + 1} steps; {stepped:,} tokens written, {kept:,} kept in the stories: "
          f"{1 - kept / stepped:.1%} written after a story had ended")
    if resource:
        print(f"pages of fresh memory taken (minor page faults): "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults:,}")


def report(runs, peak):
    """A table of each part's seconds, its share of the rollout and its share of the matrix
    peak: the median of the rollouts and, for more than one, their range, as a busy machine
    moves them from one rollout to the next."""
    def figure(values, style):
        low, middle, high = min(values), statistics.median(values), max(values)
        return style(middle) if len(values) == 1 else f"{style(middle)} ({style(low)} to {style(high)})"

    total = statistics.median(run["whole rollout"] for run in runs)
    lines = ["| part | seconds | share | share of the matrix peak |", "| --- | --- | --- | --- |"]
    for part in PARTS + ("whole rollout",):
        seconds = [run[part] for run in runs]
        of_peak = "no products"
        if runs[0][f"{part} work"]:  # each rollout's share from its own work and its own seconds
            of_peak = figure([run[f"{part} work"] / run[part] / peak for run in runs], "{:.0%}".format)
        lines.append(f"| {part} | {figure(seconds, '{:.1f}'.format)} | {statistics.median(seconds) / total:.0%} "
                     f"| {of_peak} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=str(CHECKPOINTS / "finetune"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=list(DTYPES))
    parser.add_argument("--device")
    parser.add_argument("--profile", action="store_true", help="then profile one more rollout's writing")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    device = pick_device(args.device)
    machine_s = default_precision(device)
    precision = args.precision or machine_s
    # bf16 beside fp32 where the machine writes bf16 faster (or it is asked for): on a CPU without
    # fast bf16 products (many laptops), it runs many times slower, and the comparison would take long.
    both_precisions = "bf16" in (precision, machine_s)
    tokenizer = load_tokenizer()
    policy = load_checkpoint(args.model, device, tokenizer).eval()
    reference = load_checkpoint(args.model, device, tokenizer, quiet=True).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    asks = grpo_asks(tokenizer)
    print(f"machine: {machine()}; device: {device}; writing and update in {precision}")

    # The update's shuffles seeded, as grpo.py seeds them: each run writes the same stories and
    # does the same work, so that two runs differ only by the machine's speed.
    torch.manual_seed(0)
    # The peak measured after each rollout, and the fastest taken: a shared machine's speed moves
    # from one minute to the next, and a peak measured in a slow one would put every share of it
    # high, even above 100%.
    runs, peaks = [], []
    for seed in range(args.repeats):
        runs.append(measure_rollout(policy, reference, optimizer, tokenizer, asks, seed, device, precision,
                                    both_precisions))
        peaks.append(matmul_peak(device, DTYPES[precision]))
    peak = max(peaks)
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    # The most memory the rollouts held: the peak's three matrices, measured between them, hold
    # less; the bandwidth's buffer below would raise it.
    memory = peak_memory_mb(device)
    print(f"median of {args.repeats} rollouts; 128 stories, {median['mean_length']:.0f} tokens each on average; "
          f"the {precision} matrix-product peak measured at {peak / 1e12:.3f} TFLOP/s (the fastest after each "
          f"rollout: {min(peaks) / 1e12:.3f} to {peak / 1e12:.3f})")
    print(report(runs, peak))
    floor = median["whole rollout work"] / peak
    print(f"\nthe floor, every product at the peak: {floor:.1f} s a rollout; this one took "
          f"{median['whole rollout'] / floor:.1f} times it")
    # The writing multiplies little for what it reads: each step reads every cached key and
    # value of its rows. So its floor is its products at the peak and those reads at the
    # memory's speed, one after the other, as each is an operator of its own.
    bandwidth = read_bandwidth(device)
    products, reading = median["writing work"] / peak, median["cache_bytes_read"] / bandwidth
    print(f"the writing's floor, its products at the peak ({products:.1f} s) and the keys and values its steps "
          f"read ({median['cache_bytes_read'] / 1e9:.1f} GB) at the memory's {bandwidth / 1e9:.1f} GB/s "
          f"({reading:.1f} s): {products + reading:.1f} s; it took {median['writing'] / (products + reading):.1f} "
          "times it")
    print(f"\nwriting: {median['story_tokens'] / median['writing']:,.0f} generated tokens per second in one batch, "
          f"{median['by_group_tokens'] / median['by_group']:,.0f} group by group (16 calls of 8, its own stories): "
          f"{median['story_tokens'] / median['writing'] / (median['by_group_tokens'] / median['by_group']):.1f} "
          "times faster")
    print(f"update: {EPOCHS * median['positions'] / median['update']:,.0f} trained positions per second "
          f"({EPOCHS * median['story_tokens'] / median['update']:,.0f} story tokens)")
    print(f"peak memory: {memory:,.0f} MB")
    if args.profile:
        profile_writing(policy, tokenizer, asks, device, precision)
    if not both_precisions:
        print("\nbf16 not measured: it is not this machine's faster precision (devices.default_precision)")
        return
    other = "fp32" if precision == "bf16" else "bf16"
    print(f"writing in {other} (the same instructions and draws; its stories differ a little): "
          f"{median['other_tokens'] / median['other_writing']:,.0f} generated tokens per second")
    drift = precision_drift(policy, tokenizer, asks, device)
    print(f"\nbf16 against fp32, same weights: {drift['mean_abs_per_token']:.4f} nats per token on average, "
          f"ratios {drift['ratio_spread']:.2%} off 1 on average, KL {drift['kl_per_story']:.4f} per story")


if __name__ == "__main__":
    main()
