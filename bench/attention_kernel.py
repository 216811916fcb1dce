"""
Benchmark: what a hand-written kernel would buy the writing on a CPU without AMX, where a new
token's attention over the cache is kernels.block_attention, two of torch's products a block.
The kernel below does the same work in C++ with AVX2 instructions (every x86 CPU of the last
ten years has them): for each row and head, the scores in float32 from the keys (float32, or
bf16 or fp16 widened to float32), their softmax, and the values weighed in float32, in one pass that
reads each key and value once, each block's keys as they lie in memory (one channel's positions
after another), the softmax's exponentials 8 at a time. torch compiles it as the bench starts
(torch.utils.cpp_extension.load_inline: a C++ compiler and the ninja build tool, about 30
seconds the first time on a 2-core CPU, then kept).

It measures three things, in the precision the scripts write in on this machine (--precision
to choose): how near each way comes to the float64 answer; a step's attention, 7 layers of
128 rows at 32, 128 and 224 positions, the ways taking turns (bench/decode.py's two, and the
kernel); and a rollout's writing from the fine-tuned model, block_attention and the kernel
taking turns in one process (the order changing each turn), as separate runs move with a
busy machine by more than the ways differ. In float32 it measures one way more: the kernel
over a cache kept in fp16 (Fp16Cache), half the bytes for each step to read, the layers
still in float32.

The series does not use the kernel: it needs a compiler and ninja where a learner runs it,
and its first build takes longer than it saves in a first ten-minute run (episode 16's speed
page has the figures, and why). On a CPU with AMX, where the writing takes torch's fused
kernel, the bench still sets the kernel beside block_attention, the cache in blocks for both.

    python bench/attention_kernel.py                  (about four minutes on a 2-core CPU, the first build included)
    python bench/attention_kernel.py --rollouts 10    (ten turns: about two minutes more)
"""
import argparse
import statistics
import sys
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

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

constexpr int64_t MOST_POSITIONS = 1024;  // a row's scores, kept on the stack

// 8 numbers as float32 ones: float32 as they are; a bf16 number is the upper half of a float32's bits;
// fp16 numbers widened by the CPU's own instruction (F16C, on every CPU with AVX2).
static inline __m256 load8(const float* from) { return _mm256_loadu_ps(from); }
static inline __m256 load8(const at::BFloat16* from) {
    __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
static inline __m256 load8(const at::Half* from) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
}

// e^x for 8 numbers at once, for the x <= 0 of a softmax (scores less their largest), where
// std::exp takes one at a time: x = n ln 2 + r, e^r as 1 + r + r^2 P(r) on |r| <= ln(2)/2,
// P of degree 5 (Cephes' expf), 2^n put in the exponent's bits; within 1.3 units in the last
// place of float32. x is taken no lower than -87 (e^-87 is 1.6e-38, nothing beside the largest
// score's 1), which keeps 2^n at 2^-126 or more, the least the exponent's bits hold. (Slots
// past a row's positions may give any x, NaN too: their e^x is computed and never used.)
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - n ln 2, with ln 2 in two parts so that r keeps its low bits.
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

// The sum of 8 numbers, and below their largest: halves, then quarters, then the last two.
static inline float sum8(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

static inline float max8(__m256 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

// A block's scores, 32 positions at a time, from its keys channel by channel (`block`
// numbers a channel): the block is read as it lies in memory, one channel's 32 positions after
// another. For each 8 of the 32, one sum over the even channels and one over the odd: 8 sums,
// each waiting on half as many products as one sum a position would.
template <int CHANNELS, typename T>
static inline void block_scores(const float* q, const T* key, int64_t block, float* scores) {
    for (int64_t p = 0; p < block; p += 32) {
        __m256 even[4], odd[4];
        for (int i = 0; i < 4; i++) even[i] = odd[i] = _mm256_setzero_ps();
        for (int c = 0; c < CHANNELS; c += 2) {
            const __m256 qe = _mm256_set1_ps(q[c]), qo = _mm256_set1_ps(q[c + 1]);
            for (int i = 0; i < 4; i++) {
                even[i] = _mm256_fmadd_ps(qe, load8(key + c * block + p + 8 * i), even[i]);
                odd[i] = _mm256_fmadd_ps(qo, load8(key + (c + 1) * block + p + 8 * i), odd[i]);
            }
        }
        for (int i = 0; i < 4; i++) _mm256_store_ps(scores + p + 8 * i, _mm256_add_ps(even[i], odd[i]));
    }
}

// One row and head: its query over the first `seen` positions of its keys and values, which
// lie `block` positions at a time, `apart` numbers between one block and the next; a block's
// keys channel by channel (`block` numbers a channel), its values position by position.
template <int CHANNELS, typename Q, typename T>
static void attend_one(const Q* query, const T* keys, const T* values,
                       int64_t apart, int64_t block, int64_t seen, Q* out) {
    constexpr int PARTS = CHANNELS / 8;
    // Every 8 scores start at a multiple of 8 (a block is a multiple of 32), so that they load
    // and store as one aligned piece of 32 bytes.
    alignas(32) float scores[MOST_POSITIONS];
    float q[CHANNELS];
    const float scale = 1.0f / std::sqrt(static_cast<float>(CHANNELS));
    for (int c = 0; c < CHANNELS; c++) q[c] = static_cast<float>(query[c]) * scale;
    // The scores in float32, block by block, each whole; the largest a row sees, which the
    // softmax subtracts. Slots past `seen` are kept out of it, the total and the weighed sum.
    for (int64_t start = 0; start < seen; start += block)
        block_scores<CHANNELS>(q, keys + (start / block) * apart, block, scores + start);
    __m256 largest8 = _mm256_set1_ps(-INFINITY);
    const int64_t whole = seen / 8 * 8;
    for (int64_t p = 0; p < whole; p += 8) largest8 = _mm256_max_ps(largest8, _mm256_load_ps(scores + p));
    float largest = max8(largest8);
    for (int64_t p = whole; p < seen; p++) largest = std::max(largest, scores[p]);
    // The softmax's weights, left unnormalized until the end (the last few one by one, so
    // that no slot past `seen` enters the total).
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t p = 0; p < whole; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(scores + p), _mm256_set1_ps(largest)));
        _mm256_store_ps(scores + p, e);
        total8 = _mm256_add_ps(total8, e);
    }
    float total = sum8(total8);
    if (whole < seen) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(scores + whole), _mm256_set1_ps(largest)));
        _mm256_store_ps(scores + whole, e);
        for (int64_t p = whole; p < seen; p++) total += scores[p];
    }
    // The values weighed by them.
    __m256 sum[PARTS];
    for (int part = 0; part < PARTS; part++) sum[part] = _mm256_setzero_ps();
    for (int64_t start = 0; start < seen; start += block) {
        const T* value = values + (start / block) * apart;
        for (int64_t p = start; p < std::min(seen, start + block); p++, value += CHANNELS) {
            __m256 weight = _mm256_set1_ps(scores[p]);
            for (int part = 0; part < PARTS; part++)
                sum[part] = _mm256_fmadd_ps(weight, load8(value + 8 * part), sum[part]);
        }
    }
    float result[CHANNELS];
    for (int part = 0; part < PARTS; part++)
        _mm256_storeu_ps(result + 8 * part, _mm256_mul_ps(sum[part], _mm256_set1_ps(1.0f / total)));
    for (int c = 0; c < CHANNELS; c++) out[c] = static_cast<Q>(result[c]);
}

// Every row and head of a step: the query and the answer of type Q, the cache of type T
// (float, at::BFloat16 or at::Half).
template <typename Q, typename T>
static void attend_all(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                       const torch::Tensor& seen, torch::Tensor& out) {
    const int64_t rows = keys.size(1), heads = keys.size(2), block = keys.size(3), channels = keys.size(4);
    const Q* query = q.data_ptr<Q>();
    const T *K = keys.data_ptr<T>(), *V = values.data_ptr<T>();
    const int64_t* S = seen.data_ptr<int64_t>();
    Q* O = out.data_ptr<Q>();
    const int64_t apart = rows * heads * block * channels;
    // Each row and head on its own: the threads share them out.
    at::parallel_for(0, rows * heads, 8, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
            const int64_t first = i * block * channels, at = i * channels, seen_here = S[i / heads];
            if (channels == 16) attend_one<16>(query + at, K + first, V + first, apart, block, seen_here, O + at);
            if (channels == 32) attend_one<32>(query + at, K + first, V + first, apart, block, seen_here, O + at);
            if (channels == 64) attend_one<64>(query + at, K + first, V + first, apart, block, seen_here, O + at);
        }
    });
}

// q: (rows, heads, 1, channels); keys and values: (blocks, rows, heads, positions of a block,
// channels), as sample.KVCache keeps them (each block's keys channel by channel in memory, a
// transposed view): all float32, all bf16, or a float32 query over a cache kept in fp16 (half
// the bytes to read). A row sees its first seen[row] positions.
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor seen) {
    const auto query_type = q.scalar_type(), cache_type = keys.scalar_type();
    const bool one_type = query_type == cache_type && (query_type == at::kFloat || query_type == at::kBFloat16);
    const bool fp16_cache = query_type == at::kFloat && cache_type == at::kHalf;
    TORCH_CHECK(values.scalar_type() == cache_type && (one_type || fp16_cache),
                "the kernel takes float32 or bf16 throughout, or a float32 query over an fp16 cache");
    TORCH_CHECK(keys.transpose(-2, -1).is_contiguous() && values.is_contiguous(),
                "keys and values dense, as sample.KVCache keeps them: the kernel reads a cache's blocks in place");
    TORCH_CHECK(keys.dim() == 5 && values.sizes() == keys.sizes(),
                "keys and values: (blocks, rows, heads, positions of a block, channels), of one shape");
    const int64_t blocks = keys.size(0), rows = keys.size(1), heads = keys.size(2), block = keys.size(3);
    const int64_t channels = keys.size(4);
    TORCH_CHECK(q.sizes() == torch::IntArrayRef({rows, heads, 1, channels}), "q: (rows, heads, 1, channels)");
    TORCH_CHECK(seen.numel() == rows && seen.min().item<int64_t>() >= 1, "seen: at least one position for each row");
    TORCH_CHECK(channels == 16 || channels == 32 || channels == 64, "a head's channels: 16, 32 or 64");
    TORCH_CHECK(blocks > 0 && block > 0 && block % 32 == 0, "blocks of positions 32 at a time");
    TORCH_CHECK(blocks * block <= MOST_POSITIONS, "at most ", MOST_POSITIONS, " positions");
    q = q.contiguous();
    seen = seen.to(torch::kLong).clamp_max(blocks * block).contiguous();
    auto out = torch::empty_like(q);
    if (fp16_cache) attend_all<float, at::Half>(q, keys, values, seen, out);
    else if (query_type == at::kFloat) attend_all<float, float>(q, keys, values, seen, out);
    else attend_all<at::BFloat16, at::BFloat16>(q, keys, values, seen, out);
    return out;
}
"""


def build():
    """The compiled kernel (about 30 seconds the first time on a 2-core CPU, then torch's kept
    build), and the seconds it took; or an exit that says what is missing."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):  # AVX-512 CPUs have AVX2 too
        raise SystemExit(f"the kernel needs an x86 CPU with AVX2; this one offers "
                         f"{torch.backends.cpu.get_cpu_capability()}")
    from torch.utils.cpp_extension import load_inline

    started = time.perf_counter()
    try:
        compiled = load_inline("attention_kernel", cpp_sources=KERNEL, functions=["attend"],
                               extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"])
    except (RuntimeError, OSError) as error:  # no compiler, no ninja, or the build failed
        first_line = str(error).strip().partition("\n")[0]
        raise SystemExit(f"the kernel did not build (it needs a C++ compiler and ninja): {first_line}")
    return compiled, time.perf_counter() - started


def as_attention(compiled):
    """The kernel behind block_attention's interface, for the writing (float32, bf16, or a
    float32 query over an fp16 cache; no dropout): the cache's `visible` is each row's first
    positions, so a row's count of them is all it needs."""
    def attention(q, keys, values, visible, dropout=0.0):
        assert not dropout, "the kernel writes without dropout"
        if visible is None:
            seen = torch.full((q.size(0),), keys.size(0) * keys.size(-2), device=q.device)
        else:  # (rows, 1, 1, positions) as the cache makes it, or one row of positions for all
            seen = visible.expand(q.size(0), 1, 1, visible.size(-1))[:, 0, 0].sum(-1)
        return compiled.attend(q, keys, values, seen)
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
    compiled, seconds = build()
    attention = as_attention(compiled)
    precision = args.precision or default_precision(torch.device("cpu"))
    print(f"machine: {machine()}; {precision}; the kernel built (or loaded) in {seconds:.1f} s")
    # Each way: its attention, the cache the writing keeps for it, and that cache's precision
    # (None: the layers').
    kernel_ways = {"the kernel": (attention, sample.KVCache, None)}
    if precision == "fp32":  # a bf16 cache is already half the bytes
        kernel_ways["the kernel, fp16 cache"] = (attention, Fp16Cache, torch.float16)
    ways = {"kernels.block_attention": (kernels.block_attention, sample.KVCache, None), **kernel_ways}

    print(f"\nfrom the float64 answer, 128 rows at 1 to 224 positions, {precision} inputs:")
    for way, (attend, _, cache_dtype) in ways.items():
        mean, largest = errors_from_float64(attend, DTYPES[precision], cache_dtype)
        print(f"  {way}: {mean:.1e} on average, {largest:.1e} at most")

    series = GPT(Config())  # the series' shapes: its layers, heads and channels
    by_hand = {way: (attend, cache_dtype) for way, (attend, _, cache_dtype) in kernel_ways.items()}
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
