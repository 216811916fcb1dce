"""
Benchmark: where a step of a rollout's writing goes. 128 stories (16 prompts of 20 tokens,
each written for 8 times, as in GRPO) are written with sample.generate, and --steps
single-token steps centred on --positions cached positions are timed, then as many more
profiled: the seconds of a step, its share of the machine's matrix-product peak, and torch's
profiler's operators, the most expensive first (the matrix products, the attention over the
cache, the copies and the small operators between them); the bytes of the cache a step reads
against the memory's bandwidth, measured in the same run; and what dropping a quarter of the
rows, as the writing does once their stories have ended, costs. The series-size model with
random weights: a step costs the same whatever the weights say.

On a CPU, the attention over the cache two ways, taking turns, the cache in the layers'
precision: torch's fused kernel over the positions so far, which the writing runs on a CPU
with AMX, and the two products by hand over the cache's blocks of 32 positions
(kernels.block_attention; each block's keys channel by channel, as the cache keeps them),
which it runs on a CPU without.

With --compile, the same step compiled by torch.compile (the model's forward pass, shapes
dynamic, as the cache grows by a position at each step) beside it, and one update
minibatch of 16 stories of 224 positions, eager and compiled, each with its compile time.

    python bench/decode.py                 (about 40 seconds on a 2-core CPU)
    python bench/decode.py --compile       (several minutes more: torch.compile on a CPU is slow to compile)
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import read_bandwidth, timed  # noqa: E402
from bench.train import DTYPES, forward_flops, matmul_peak  # noqa: E402
from devices import autocast, default_precision, machine, pick_device  # noqa: E402
from kernels import CACHE_BLOCK, block_attention, log_softmax_at  # noqa: E402
from model import GPT, Config  # noqa: E402
from sample import next_token, prefill  # noqa: E402
from train import optimizer_step  # noqa: E402

ROWS, PROMPT, GROUP = 128, 20, 8  # a GRPO rollout's stories, its prompts' length, a group


def step_flops(model, positions):
    """A single-token step's work for ROWS rows: the matrix products (two FLOPs a weight) and the
    attention over the cached positions (queries with keys, weights with values)."""
    return forward_flops(model, ROWS, ROWS * positions)


def writing_steps(model, device, positions, steps):
    """`steps` single-token steps centred on `positions` cached positions (the first at
    positions - (steps - 1) // 2), so that the work counted at `positions` is the work timed:
    their seconds each, and the step itself, which may run `steps` times more (the cache has
    room for them)."""
    generator = torch.Generator(device=device).manual_seed(0)
    groups = [torch.randint(0, model.config.vocab_size, (1, PROMPT), device=device).repeat(GROUP, 1)
              for _ in range(ROWS // GROUP)]
    logits, cache = prefill(model, groups, positions - PROMPT + 2 * steps)
    token = next_token(logits, 1.0, None, generator)

    def one_step():
        nonlocal logits, token
        logits = model(token[:, None], cache=cache)[0][:, -1]
        token = next_token(logits, 1.0, None, generator)

    for _ in range(positions - (steps - 1) // 2 - PROMPT):
        one_step()
    seconds = [timed(device, one_step)[1] for _ in range(steps)]
    return seconds, one_step, cache


def narrowing(cache, device):
    """The seconds the cache takes to drop a quarter of its rows, spread through the batch, as
    the writing drops the rows whose stories have ended."""
    ended = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))[:ROWS // 4]
    rows = torch.ones(ROWS, dtype=torch.bool, device=device)
    rows[ended] = False
    return timed(device, lambda: cache.keep(rows))[1]


def attention_ways(model, device, precision, positions, rounds=5, more=None):
    """A step's attention over the cache, every layer's, for ROWS rows at `positions` cached
    positions of a longer cache, as the writing reads it (without the mask of rows at several
    positions): two ways, and any in `more` (a name: a function that takes block_attention's
    inputs, and the precision it reads the cache in, None for the layers'), taking turns, each
    way's milliseconds a step, the median of `rounds`. Each layer reads its own cache, as
    in a step: one layer's read again would come from the CPU's own cache where it fits, and
    faster than a step reads it."""
    c = model.config
    generator = torch.Generator(device=device).manual_seed(0)
    blocks = -(-(positions + 80) // CACHE_BLOCK)  # room for 80 more tokens, as a cache has
    shape = (blocks, ROWS, c.n_head, CACHE_BLOCK, c.n_embd // c.n_head)
    query = torch.randn(ROWS, c.n_head, 1, shape[-1], generator=generator, device=device).to(DTYPES[precision])
    # Each layer's keys and values as sample.KVCache keeps them in blocks: a block's keys channel by channel.
    by_channel = (*shape[:-2], shape[-1], shape[-2])  # a block's channels, then its positions
    layers = [[torch.randn(by_channel, generator=generator, device=device).to(query.dtype).transpose(-2, -1),
               torch.randn(shape, generator=generator, device=device).to(query.dtype)]
              for _ in range(c.n_layer)]
    # The same numbers in order of position (rows, heads, positions, channels), and the positions so far.
    in_order = [[cache.permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, :positions] for cache in layer] for layer in layers]
    # Every block holding a position so far, whole, and which of its slots are those positions.
    read = -(-positions // CACHE_BLOCK)
    in_blocks = [[cache[:read] for cache in layer] for layer in layers]
    visible = torch.arange(read * CACHE_BLOCK, device=device) < positions

    by_hand = {f"by hand, over blocks of {CACHE_BLOCK} positions (kernels.block_attention)": (block_attention, None),
               **(more or {})}

    def over_blocks(attend, dtype):
        """A way by hand, as a function of the layer whose cache it reads (rounded to dtype, laid
        out as it was, where the way reads it so)."""
        caches = in_blocks if dtype is None else [[cache.to(dtype) for cache in layer] for layer in in_blocks]
        return lambda layer: attend(query, *caches[layer], visible)

    ways = {"torch's fused kernel, over the positions so far": lambda layer: F.scaled_dot_product_attention(
        query, *in_order[layer])}
    ways.update({way: over_blocks(attend, dtype) for way, (attend, dtype) in by_hand.items()})
    seconds = {way: [] for way in ways}
    for _ in range(rounds):
        for way, attend in ways.items():
            seconds[way].append(timed(device, lambda: [attend(layer) for layer in range(c.n_layer)])[1])
    return {way: statistics.median(s) * 1000 for way, s in seconds.items()}


def update_minibatch(model, optimizer, device, precision):
    """One update on 16 stories of 224 positions, as grpo.py's minibatches: its seconds."""
    x = torch.randint(0, model.config.vocab_size, (16, 224), device=device)

    def update():
        with autocast(device, precision):
            logits, _ = model(x)
        optimizer_step(model, optimizer, -log_softmax_at(logits, x).mean(), 1e-12)
    return timed(device, update)[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--positions", type=int, default=120, help="cached positions the timed steps are centred on")
    parser.add_argument("--steps", type=int, default=10, help="single-token steps timed and profiled")
    parser.add_argument("--compile", action="store_true", help="torch.compile beside eager (slow to compile)")
    parser.add_argument("--device")
    parser.add_argument("--precision", choices=list(DTYPES), help="default: the scripts' for the device")
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    args = parser.parse_args()
    lowest = PROMPT + 1 + max(args.steps - 1, 0) // 2  # a token past the prompts before the first step timed
    if args.steps < 1 or not lowest <= args.positions <= Config.context - 2 * args.steps:
        parser.error(f"--steps at least 1, --positions between {lowest} and the context ({Config.context}) "
                     "less twice --steps (the steps timed, centred on --positions, then as many profiled)")
    device = pick_device(args.device)
    precision = args.precision or default_precision(device)
    torch.manual_seed(0)
    model = GPT(Config()).to(device).eval()
    print(f"machine: {machine()}; device: {device}; {precision}")
    # The matrix peak, measured before the steps and again after them, the faster kept: measured
    # once, in a minute the shared machine runs slow, it would put the step's share of it high.
    peaks = [matmul_peak(device, DTYPES[precision])]

    # The steps timed, then as many again under the profiler (which slows what it watches).
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), autocast(device, precision):
        seconds, one_step, cache = writing_steps(model, device, args.positions, args.steps)
        with profile(activities=activities) as profiled:
            for _ in range(args.steps):
                one_step()
    peaks.append(matmul_peak(device, DTYPES[precision]))
    peak = max(peaks)
    print(f"the matrix-product peak: {peak / 1e12:.3f} TFLOP/s, the faster of {peaks[0] / 1e12:.3f} before the "
          f"steps and {peaks[1] / 1e12:.3f} after them")
    step = statistics.median(seconds)
    flops = step_flops(model, args.positions)
    print(f"a step of {ROWS} rows at {args.positions} cached positions: {step * 1000:.1f} ms, "
          f"{ROWS / step:,.0f} tokens per second, {flops / step / peak:.0%} of the matrix peak "
          f"({flops / 1e9:.2f} GFLOP a step)")
    by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(profiled.key_averages().table(sort_by=by, row_limit=args.rows))
    # The attention over the cache multiplies little and reads much: each layer's keys and
    # values at every cached position, for every row. Its floor is the memory's, not the peak's.
    cache_bytes = 2 * model.config.n_layer * ROWS * model.config.n_embd * args.positions * cache.keys.element_size()
    bandwidth = read_bandwidth(device)
    print(f"the attention reads {cache_bytes / 1e6:.0f} MB of keys and values a step; at the memory's "
          f"{bandwidth / 1e9:.1f} GB/s (a sum over 256 MB) that is {cache_bytes / bandwidth * 1000:.1f} ms, "
          f"and the step's products at the peak {flops / peak * 1000:.1f} ms")
    print(f"dropping a quarter of the rows from the cache: {narrowing(cache, device) * 1000:.1f} ms")
    if device.type == "cpu":
        print(f"the attention over the cache in {precision}, {model.config.n_layer} layers, two ways taking turns "
              "(ms a step):")
        for way, ms in attention_ways(model, device, precision, args.positions).items():
            print(f"  {way}: {ms:.1f}")
    if not args.compile:
        return

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-12, weight_decay=0.0)

    def workload(m):
        """The same work eager or compiled: four update minibatches, then the writing's steps."""
        started = time.perf_counter()
        updates = [update_minibatch(m, optimizer, device, precision) for _ in range(4)]
        with torch.no_grad(), autocast(device, precision):
            steps, _, _ = writing_steps(m, device, args.positions, args.steps)
        return time.perf_counter() - started, updates, steps

    eager = workload(model)
    compiled = workload(torch.compile(model, dynamic=True))
    print("| part | eager | compiled |")
    print("| --- | --- | --- |")
    print(f"| a step of the writing | {statistics.median(eager[2]) * 1000:.1f} ms | "
          f"{statistics.median(compiled[2]) * 1000:.1f} ms |")
    print(f"| an update minibatch (16 x 224), median of the last 3 | {statistics.median(eager[1][1:]):.2f} s | "
          f"{statistics.median(compiled[1][1:]):.2f} s |")
    print(f"| all of it, compiling included | {eager[0]:.0f} s | {compiled[0]:.0f} s |")
    # What torch.compile made of the model: the step reads the cache's positions as numbers, so
    # it is cut into several graphs, each compiled, with Python between them.
    print(f"graphs compiled: {torch._dynamo.utils.counters['stats']['unique_graphs']}, "
          f"graph breaks: {sum(torch._dynamo.utils.counters['graph_break'].values())}")


if __name__ == "__main__":
    main()
