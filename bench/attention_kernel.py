"""
Benchmark: what a hand-written kernel would buy the writing on a CPU without AMX, where a new
token's attention over the cache is kernels.block_attention, two of torch's products a block.
The kernel (bench/attention_kernel.cpp) does the same work in C++ with AVX2 instructions (every
x86 CPU of the last ten years has them): for each row and head, the scores in float32 from the
keys (float32, or bf16 or fp16 widened to float32), their softmax, and the values weighed in
float32, in one pass that reads each key and value once, each block's keys as they lie in
memory (one channel's positions after another), the softmax's exponentials 8 at a time. The
bench compiles it as it starts, a plain shared library without torch's headers (a C++
compiler, about 3 seconds on a 2-core CPU), and calls it through ctypes on the tensors' memory.

It measures three things, in the precision the scripts write in on this machine (--precision
to choose): how near each way comes to the float64 answer; a step's attention, 7 layers of
128 rows at 32, 128 and 224 positions, the ways taking turns (bench/decode.py's two, and the
kernel); and a rollout's writing from the fine-tuned model, block_attention and the kernel
taking turns in one process (the order changing each turn), as separate runs move with a
busy machine by more than the ways differ. In float32 it measures one way more: the kernel
over a cache kept in fp16 (Fp16Cache), half the bytes for each step to read, the layers
still in float32.

The series does not use the kernel: it needs a C++ compiler and an x86 CPU where a learner
runs it, and in a ten-minute run it buys less than one rollout (episode 16's speed page has
the figures, and why). On a CPU with AMX, where the writing takes torch's fused kernel, the
bench still sets the kernel beside block_attention, the cache in blocks for both.

    python bench/attention_kernel.py                  (four to five minutes on a 2-core CPU)
    python bench/attention_kernel.py --rollouts 10    (ten turns: about two minutes more)
"""
import argparse
import ctypes
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
import sample  # noqa: E402
from bench.common import grpo_asks  # noqa: E402
from bench.decode import attention_ways  # noqa: E402
from bench.rollout import writing_flops  # noqa: E402
from bench.train import DTYPES, matmul_peak  # noqa: E402
from checkpoints import CHECKPOINTS, load_checkpoint  # noqa: E402
from devices import autocast, default_precision, machine  # noqa: E402
from grpo import rollout  # noqa: E402
from model import GPT, Config  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402

KERNEL = Path(__file__).with_name("attention_kernel.cpp")

# The kernel's function for each pair of types it takes (the query's, the cache's).
FUNCTIONS = {(torch.float32, torch.float32): "attend_float", (torch.bfloat16, torch.bfloat16): "attend_bf16",
             (torch.float32, torch.float16): "attend_float_over_fp16"}


@functools.cache
def build():
    """The kernel compiled as a plain shared library (about 3 seconds on a 2-core CPU, once a
    process: a later call returns the same kernel and seconds) and loaded: its attend(q, keys,
    values, seen), and the seconds the build took; or an exit that says what is missing."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # AVX-512 CPUs have AVX2 too
        raise SystemExit(f"the kernel needs an x86 CPU with AVX2; this one offers "
                         f"{torch.backends.cpu.get_cpu_capability()}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        library = Path(folder, "attention_kernel.so")
        compile_kernel(library)
        # Loaded into the process, the library no longer needs its file.
        loaded = ctypes.CDLL(str(library))
    # Each function's C types (bench/attention_kernel.cpp's extern "C" block): without them, ctypes
    # would pass Python's numbers as 32-bit ints and cut the pointers short.
    for name in FUNCTIONS.values():
        function = getattr(loaded, name)
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_int]
        function.restype = ctypes.c_bool
    # The most positions a row may see: the kernel keeps a row's scores on its stack.
    most_positions = ctypes.c_int64.in_dll(loaded, "most_positions").value
    return functools.partial(attend, loaded, most_positions), time.perf_counter() - started


def compile_kernel(library):
    """bench/attention_kernel.cpp compiled into the shared library `library` by the C++ compiler
    (CXX names another than c++), for AVX2 with FMA and F16C, threads by OpenMP; or an exit
    that says in one line what went wrong."""
    compiler = os.environ.get("CXX", "c++")
    command = [compiler, "-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", str(KERNEL),
               "-o", str(library)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"the kernel needs a C++ compiler: there is no {compiler} (CXX names another)")
    except OSError as error:  # there, but not a program this user may run
        raise SystemExit(f"the kernel needs a C++ compiler: {compiler} did not run ({error.strerror})")
    except subprocess.CalledProcessError as error:
        # The compiler's first error, not the lines before it that say where it was found.
        said = error.stderr.strip().splitlines() or ["no message"]
        first_error = next((line for line in said if "error" in line), said[0])
        raise SystemExit(f"the kernel did not build: {first_error}")


def attend(library, most_positions, q, keys, values, seen):
    """A new token's attention by the kernel: q (rows, heads, 1, channels) over keys and values
    (blocks, rows, heads, positions of a block, channels) as sample.KVCache keeps them (each
    block's keys channel by channel in memory, a transposed view), a row seeing its first
    seen[row] positions."""
    # The kernel reads memory wherever it is told to: what it takes on trust is checked first.
    refuse_what_the_kernel_would_misread(q, keys, values, seen, most_positions)
    blocks, rows, heads, block, channels = keys.shape
    q, seen = q.contiguous(), seen.to(torch.long).contiguous()
    out = torch.empty_like(q)
    # The kernel checks each row's count itself (at least one position), before it starts.
    kernel = getattr(library, FUNCTIONS[q.dtype, keys.dtype])
    if not kernel(q.data_ptr(), keys.data_ptr(), values.data_ptr(), seen.data_ptr(), out.data_ptr(),
                  blocks, rows, heads, block, channels, torch.get_num_threads()):
        raise ValueError("seen: at least one position for each row")
    return out


def refuse_what_the_kernel_would_misread(q, keys, values, seen, most_positions):
    """A one-line ValueError for inputs the kernel would read wrongly, or past their end."""
    if (q.dtype, keys.dtype) not in FUNCTIONS or values.dtype != keys.dtype:
        raise ValueError("the kernel takes float32 or bf16 throughout, or a float32 query over an fp16 cache")
    if {tensor.device.type for tensor in (q, keys, values, seen)} != {"cpu"}:
        raise ValueError("the kernel reads the CPU's memory: q, keys, values and seen on the CPU")
    if keys.dim() != 5 or values.shape != keys.shape:
        raise ValueError("keys and values: (blocks, rows, heads, positions of a block, channels), of one shape")
    if not (keys.transpose(-2, -1).is_contiguous() and values.is_contiguous()):
        raise ValueError("keys and values dense, as sample.KVCache keeps them: the kernel reads a cache's blocks "
                         "in place")
    blocks, rows, heads, block, channels = keys.shape
    if q.shape != (rows, heads, 1, channels):
        raise ValueError("q: (rows, heads, 1, channels)")
    if seen.numel() != rows:
        raise ValueError("seen: a count of positions for each row")
    if channels not in (16, 32, 64):
        raise ValueError("a head's channels: 16, 32 or 64")
    if blocks == 0 or block == 0 or block % 32:
        raise ValueError("blocks of positions 32 at a time")
    if blocks * block > most_positions:
        raise ValueError(f"at most {most_positions} positions")


def as_attention(kernel):
    """The kernel (build()'s attend) behind block_attention's interface, for the writing
    (float32, bf16, or a float32 query over an fp16 cache; no dropout): the cache's `visible`
    is each row's first positions, so a row's count of them is all it needs."""
    def attention(q, keys, values, visible, dropout=0.0):
        assert not dropout, "the kernel writes without dropout"
        if visible is None:
            seen = torch.full((q.size(0),), keys.size(0) * keys.size(-2), device=q.device)
        else:  # (rows, 1, 1, positions) as the cache makes it, or one row of positions for all
            seen = visible.expand(q.size(0), 1, 1, visible.size(-1))[:, 0, 0].sum(-1)
        return kernel(q, keys, values, seen)
    return attention


class Fp16Cache(sample.KVCache):
    """sample.KVCache with its keys and values kept in fp16 where the layers make them in
    float32: half the bytes for each step to read, each number rounded to 11 significant bits
    (fp16 holds numbers up to 65,504; the bench model's keys and values stay within 5 in a
    rollout)."""

    def make(self, rows, heads, channels, dtype, device):
        super().make(rows, heads, channels, torch.float16 if dtype == torch.float32 else dtype, device)

    def add(self, layer, k, v):
        # A step's new keys and values rounded as they are stored (writing each row's at its own
        # position takes one precision); a prompt attends to its own, unrounded, as it stores them.
        if self.keys is not None and k.size(2) == 1:
            k, v = k.to(self.keys.dtype), v.to(self.keys.dtype)
        return super().add(layer, k, v)


def errors_from_float64(attention, dtype, cache_dtype=None, rows=128, heads=6, channels=64, blocks=7, seed=0):
    """The mean and the largest distance of a way's answer from inputs in `dtype` (the cache
    rounded to cache_dtype, for a way that keeps it so) from the float64 answer over the
    unrounded inputs, rows at several positions of a cache in blocks, each seeing its first ones."""
    generator = torch.Generator().manual_seed(seed)
    block = kernels.CACHE_BLOCK
    q = torch.randn(rows, heads, 1, channels, generator=generator).to(dtype)
    # Keys and values as sample.KVCache keeps them: each block's keys channel by channel.
    keys = torch.randn(blocks, rows, heads, channels, block, generator=generator).to(dtype).transpose(-2, -1)
    values = torch.randn(blocks, rows, heads, block, channels, generator=generator).to(dtype)
    seen = torch.randint(1, blocks * block + 1, (rows,), generator=generator)
    visible = (torch.arange(blocks * block) < seen[:, None])[:, None, None, :]
    # The reference: torch's attention in float64 over the positions in order, masked as the rows see them.
    in_order = [cache.double().permute(1, 2, 0, 3, 4).flatten(2, 3) for cache in (keys, values)]
    exact = F.scaled_dot_product_attention(q.double(), *in_order, attn_mask=visible)
    if cache_dtype is not None:  # rounded in the same layout
        keys, values = keys.to(cache_dtype), values.to(cache_dtype)
    apart = (attention(q, keys, values, visible).double() - exact).abs()
    return float(apart.mean()), float(apart.max())


def writing_in_turns(model, tokenizer, ways, turns, precision):
    """A rollout's writing in `precision` with each of `ways` (a name: an attention that takes
    block_attention's inputs, the cache it reads, and that cache's precision) in turn, `turns` times, each turn the same
    instructions and draws, the order changing each turn: each way's seconds, tokens and matrix
    products."""
    asks = grpo_asks(tokenizer)
    taken = {way: [] for way in ways}
    # The cache in blocks, which every way reads, where a CPU with AMX would keep one block.
    with autocast(torch.device("cpu"), precision), mock.patch.object(kernels, "BY_HAND_ON_CPU", True):
        rollout(model, tokenizer, asks, np.random.default_rng(turns), turns)  # once first, as the process warms up
        for turn in range(turns):
            first = turn % len(ways)
            for way in list(ways)[first:] + list(ways)[:first]:
                attention, cache, _ = ways[way]
                with mock.patch.object(kernels, "block_attention", attention), \
                        mock.patch.object(sample, "KVCache", cache):
                    started = time.perf_counter()
                    prompts, stories, _ = rollout(model, tokenizer, asks, np.random.default_rng(turn), turn)
                    taken[way].append((time.perf_counter() - started, sum(len(story) for story in stories),
                                       writing_flops(model, prompts, stories)))
    return taken


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=str(CHECKPOINTS / "finetune"))
    parser.add_argument("--rollouts", type=int, default=5, help="turns of a rollout's writing, each way once a turn "
                        "(0: none)")
    parser.add_argument("--rounds", type=int, default=5, help="turns of the attention alone, at each length")
    parser.add_argument("--precision", choices=list(DTYPES), help="default: the scripts' for this CPU")
    args = parser.parse_args()
    if args.rollouts < 0 or args.rounds < 1:
        parser.error("--rollouts must be 0 or more, --rounds at least 1")
    # The kernel reads a block 32 positions at a time: say so now, not in the middle of a timing.
    if kernels.CACHE_BLOCK % 32:
        raise SystemExit(f"the kernel reads blocks of a multiple of 32 positions; kernels.CACHE_BLOCK is "
                         f"{kernels.CACHE_BLOCK}")
    # The model first: a missing or damaged checkpoint says so before a minute of building and timing.
    tokenizer = load_tokenizer() if args.rollouts else None
    model = load_checkpoint(args.model, torch.device("cpu"), tokenizer).eval() if args.rollouts else None
    kernel, seconds = build()
    attention = as_attention(kernel)
    precision = args.precision or default_precision(torch.device("cpu"))
    print(f"machine: {machine()}; {precision}; the kernel built in {seconds:.1f} s")
    # Each way: its attention, the cache the writing keeps for it, and that cache's precision
    # (None: the layers').
    kernel_ways = {"the kernel": (attention, sample.KVCache, None)}
    if precision == "fp32":  # a bf16 cache is already half the bytes
        kernel_ways["the kernel, fp16 cache"] = (attention, Fp16Cache, torch.float16)
    ways = {"kernels.block_attention": (kernels.block_attention, sample.KVCache, None), **kernel_ways}

    print(f"\nfrom the float64 answer, 128 rows at 1 to 224 positions, {precision} inputs:")
    for way, (way_attention, _, cache_dtype) in ways.items():
        mean, largest = errors_from_float64(way_attention, DTYPES[precision], cache_dtype)
        print(f"  {way}: {mean:.1e} on average, {largest:.1e} at most")

    series = GPT(Config())  # the series' shapes: its layers, heads and channels
    by_hand = {way: (way_attention, cache_dtype) for way, (way_attention, _, cache_dtype) in kernel_ways.items()}
    print(f"\na step's attention, 7 layers, 128 rows, {precision}, {len(ways) + 1} ways taking turns (ms a step):")
    print("| positions | torch's fused kernel | " + " | ".join(ways) + " |")
    print("| --- " * (len(ways) + 2) + "|")
    for positions in (32, 128, 224):
        times = attention_ways(series, torch.device("cpu"), precision, positions, args.rounds, by_hand)
        print(f"| {positions} | " + " | ".join(f"{ms:.1f}" for ms in times.values()) + " |")

    if args.rollouts:
        taken = writing_in_turns(model, tokenizer, ways, args.rollouts, precision)
        # The writing's share of the peak as bench/rollout.py counts it (the rollout's scoring,
        # about 0.02 s, included here).
        peak = matmul_peak(torch.device("cpu"), DTYPES[precision])
        print(f"\na rollout's writing, 128 stories, {precision}, {args.rollouts} turns in one process (medians; "
              f"the {precision} matrix peak measured at {peak / 1e12:.3f} TFLOP/s):")
        for way, runs in taken.items():
            print(f"  {way}: {statistics.median(s for s, _, _ in runs):.2f} s, "
                  f"{statistics.median(s / tokens * 1e6 for s, tokens, _ in runs):.0f} µs a token, "
                  f"{statistics.median(work / s for s, _, work in runs) / peak:.0%} of the peak")
        plain = taken.pop("kernels.block_attention")
        for way, runs in taken.items():
            ratios = [kernel[0] / alone[0] for alone, kernel in zip(plain, runs)]
            print(f"  {way}: its time over block_attention's, turn by turn: {', '.join(f'{r:.2f}' for r in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
