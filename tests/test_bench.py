"""The generation benchmark runs, both variants writing every token they are asked for
(bench/generate.py asserts the shape), so its figures in the docs can be made again; and the
cache it measures is faster than writing without it. The attention benchmark times every
length it is given, in both precisions. The benchmark of two ways taking turns times both,
and their log-probabilities agree. The rollout benchmark prints each part of a rollout with
its share of the matrix peak."""
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import kernels
import ppo
from bench import common, decode
from bench import train as train_bench
from model import GPT, TINY, Config
from sample import prefill

ROOT = Path(__file__).resolve().parents[1]


def test_generation_benchmark_runs_both_variants_and_its_ratio_is_their_seconds():
    # Which way is faster is the bench's to measure, not a test's (a busy machine could flip
    # it): the test checks that both ran and that the ratio printed is the one their rates give.
    done = subprocess.run([sys.executable, "bench/generate.py", "--stories", "2", "--tokens", "8", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    rates = {}
    for variant in ("with", "without"):
        row = re.search(rf"\| {variant} the KV cache \| [\d.]+ \| ([\d,]+) \| [\d,]+ MB \|", done.stdout)
        rates[variant] = float(row.group(1).replace(",", ""))
    ratio = float(re.search(r"the cache is ([\d.]+) times faster", done.stdout).group(1))
    assert ratio == pytest.approx(rates["with"] / rates["without"], abs=0.05 + 0.02 * ratio)


def test_attention_benchmark_times_each_length_in_each_precision():
    done = subprocess.run([sys.executable, "bench/attention.py", "--lengths", "17", "32", "--stories", "1",
                           "--repeats", "1", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, check=True)
    for length in (17, 32):
        assert re.search(rf"^\| {length} \|( [\d.]+ ms \|){{4}}$", done.stdout, re.MULTILINE)


# The float32 backward pass of attention serves bf16 alone: that comparison runs in bf16.
@pytest.mark.parametrize("comparison, precision", [
    ("align", "fp32"), ("logprobs", "fp32"),
    pytest.param("attention", "bf16", marks=pytest.mark.skipif(
        not kernels.FLOAT32_BACKWARD, reason="this build of torch lacks the CPU kernel's operators"))])
def test_turns_benchmark_times_both_ways_and_they_give_the_same_log_probabilities(comparison, precision, run_main,
                                                                                  monkeypatch, capsys):
    import grpo
    from bench import turns

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)  # the tiny model's stories, cut short
    # Each way must really run as it says: the log_softmax way with log_softmax, not
    # log_softmax_at twice; the float32 backward in its own way's minibatches only.
    calls = {"gather": 0, "attention": 0}

    def counted(name, function):
        def spy(*args):
            calls[name] += 1
            return function(*args)
        return spy
    monkeypatch.setattr(turns, "log_softmax_by_gather", counted("gather", turns.log_softmax_by_gather))
    monkeypatch.setattr(kernels.CausalAttentionFloat32Backward, "apply",
                        counted("attention", kernels.CausalAttentionFloat32Backward.apply))
    run_main(turns, comparison, "--rollouts", "1", "--rounds", "2", "--device", "cpu", "--precision", precision)
    assert bool(calls["gather"]) == (comparison == "logprobs")
    # Two rounds, each one minibatch's pass through every layer of the tiny model.
    assert calls["attention"] == (2 * TINY["n_layer"] if comparison == "attention" else 0)
    out = capsys.readouterr().out
    for way in turns.WAYS[comparison]:
        assert re.search(rf"^\| {way} \| [\d, ]+ \| [\d.]+ s \| [\d.]+ s \|$", out, re.MULTILINE)
    apart = float(re.search(r"differ by at most (\S+)$", out, re.MULTILINE).group(1))
    assert apart < 1e-5


def test_turns_benchmark_refuses_an_attention_comparison_of_two_same_ways(run_main, capsys):
    from bench import turns

    with pytest.raises(SystemExit):
        run_main(turns, "attention", "--device", "cpu", "--precision", "fp32")
    assert "both ways would be the same" in capsys.readouterr().err


# Where the machine multiplies bf16 faster, the benchmark writes in both precisions; elsewhere it
# says why it doesn't (bf16 would run many times slower there).
@pytest.mark.parametrize("machine_s_precision", ["bf16", "fp32"])
def test_rollout_benchmark_times_each_part_and_its_share_of_the_matrix_peak(machine_s_precision, run_main,
                                                                           monkeypatch, capsys):
    import grpo
    from bench import rollout as rollout_bench
    from bench import train as train_bench

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)  # the tiny model's stories, cut short
    monkeypatch.setattr(rollout_bench, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "default_precision", lambda device: machine_s_precision)
    # A small product for the peak: the tiny model's figures need no accurate one, only a number.
    monkeypatch.setattr(rollout_bench, "matmul_peak",
                        lambda device, dtype: train_bench.matmul_peak(device, dtype, size=256, repeats=2))
    run_main(rollout_bench, "--repeats", "1", "--device", "cpu", "--precision", "fp32")
    out = capsys.readouterr().out
    for part in ("writing", "logprobs", "update"):
        assert re.search(rf"^\| {part} \| [\d.]+ \| \d+% \| \d+% \|$", out, re.MULTILINE)
    assert re.search(r"^\| scoring \| [\d.]+ \| \d+% \| no products \|$", out, re.MULTILINE)
    whole = re.search(r"^\| whole rollout \| ([\d.]+) \| 100% \| (\d+)% \|$", out, re.MULTILINE)
    assert whole
    # The floor is the rollout's products at the peak: the rollout takes 1 / (its share of the peak) times it,
    # the share printed in whole percents and the times to a tenth.
    floor = re.search(r"^the floor, every product at the peak: ([\d.]+) s a rollout; this one took ([\d.]+) times it$",
                      out, re.MULTILINE)
    share = int(whole[2])
    assert floor and 100 / (share + 0.5) - 0.05 <= float(floor[2]) <= (100 / (share - 0.5) + 0.05 if share else math.inf)
    # The writing's own floor: its products at the peak and its reads of the cache at the
    # memory's speed (cache_bytes_read, tested below); the tiny model's seconds round to 0.0.
    assert re.search(r"^the writing's floor, its products at the peak \([\d.]+ s\) and the keys and values its "
                     r"steps read \([\d.]+ GB\) at the memory's [\d.]+ GB/s \([\d.]+ s\): [\d.]+ s; it took "
                     r"[\d.]+ times it$", out, re.MULTILINE)
    assert re.search(r"group by group \(16 calls of 8, its own stories\): [\d.]+ times faster", out)
    compared = re.search(r"writing in bf16 .*: [\d,]+ generated tokens per second", out)
    assert bool(compared) == (machine_s_precision == "bf16")
    assert ("bf16 not measured" in out) == (machine_s_precision == "fp32")


# A busy machine moves a rollout's seconds from one to the next, so the table gives each
# figure's median and the repeats' range: each rollout's share of the peak from its own work
# and its own seconds.
def test_rollout_benchmark_reports_each_figure_as_the_median_and_the_range_of_its_rollouts():
    from bench.rollout import report

    def run(writing, update, story_tokens):
        # A peak of 1 FLOP/s: the work is in FLOPs, and a share of the peak is work / seconds.
        return {"writing": writing, "scoring": 1.0, "logprobs": 0.0, "update": update,
                "whole rollout": writing + 1.0 + update, "writing work": story_tokens, "scoring work": 0.0,
                "logprobs work": 0.0, "update work": 3 * story_tokens, "whole rollout work": 4 * story_tokens}

    table = report([run(10.0, 29.0, 3.0), run(14.0, 35.0, 3.5), run(12.0, 27.0, 2.4)], peak=1.0).splitlines()
    # Writing: 3 FLOPs in 10 s, 3.5 in 14, 2.4 in 12; the whole rollouts 40, 50 and 40 s.
    assert table[2] == "| writing | 12.0 (10.0 to 14.0) | 30% | 25% (20% to 30%) |"
    assert table[3] == "| scoring | 1.0 (1.0 to 1.0) | 2% | no products |"
    # Update: 9 in 29 s, 10.5 in 35, 7.2 in 27; whole: 12 in 40, 14 in 50, 9.6 in 40.
    assert table[5] == "| update | 29.0 (27.0 to 35.0) | 72% | 30% (27% to 31%) |"
    assert table[6] == "| whole rollout | 40.0 (40.0 to 50.0) | 100% | 28% (24% to 30%) |"
    # One rollout: its figures alone.
    assert report([run(10.0, 29.0, 3.0)], peak=1.0).splitlines()[2] == "| writing | 10.0 | 25% | 30% |"


# A shared machine's speed moves from one minute to the next: the peak is measured after each
# rollout, and the fastest is the one every share divides by.
def test_rollout_benchmark_takes_the_fastest_peak_measured_after_each_rollout(run_main, monkeypatch, capsys):
    import grpo
    from bench import rollout as rollout_bench

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "MAX_NEW_TOKENS", 16)
    peaks = iter([2e12, 5e12, 3e12])
    monkeypatch.setattr(rollout_bench, "matmul_peak", lambda device, dtype: next(peaks))
    divided_by = []

    def report(runs, peak):
        divided_by.append(peak)
        return ""

    monkeypatch.setattr(rollout_bench, "report", report)
    run_main(rollout_bench, "--repeats", "3", "--device", "cpu", "--precision", "fp32")
    assert divided_by == [5e12]
    assert "peak measured at 5.000 TFLOP/s (the fastest after each rollout: 2.000 to 5.000)" in capsys.readouterr().out


# The rollouts after the first are written by the updated model, so two runs of the bench
# write the same stories only if their updates shuffle the stories the same way.
def test_rollout_benchmark_runs_do_the_same_work_each_time(run_main, monkeypatch):
    import grpo
    from bench import rollout as rollout_bench

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "MAX_NEW_TOKENS", 16)
    # The tiny model's stories use none of the words: a reward that tells them apart, so that
    # the update moves the model.
    monkeypatch.setattr(grpo, "words_used", lambda text, words: len(text) % 7 / 7)
    monkeypatch.setattr(rollout_bench, "matmul_peak",
                        lambda device, dtype: train_bench.matmul_peak(device, dtype, size=256, repeats=2))
    weights_after = []
    measure = rollout_bench.measure_rollout

    def measured(policy, *args):
        run = measure(policy, *args)
        weights_after.append(torch.cat([p.detach().flatten() for p in policy.parameters()]))
        return run

    monkeypatch.setattr(rollout_bench, "measure_rollout", measured)
    for _ in range(2):
        torch.manual_seed(len(weights_after))  # whatever the global random state was before
        run_main(rollout_bench, "--repeats", "2", "--device", "cpu", "--precision", "fp32")
    assert not torch.equal(weights_after[0], weights_after[1])  # the second update moved it
    assert torch.equal(weights_after[1], weights_after[3])


# The work a part's seconds are divided by: each token's forward pass attends to the positions
# it sees, itself and those before it, not to a whole window (a writing step's count is
# checked against torch's counter in test_step_flops_...).
def test_the_writing_s_work_is_a_forward_pass_for_each_story_token_over_the_positions_it_sees():
    from bench import rollout as rollout_bench

    model = tiny_model()
    prompts, stories = [[1, 2, 3], [4, 5]], [[7, 8], [9, 9, 9, 0]]
    # A story's first token comes from its prompt's last position, each later one from the step over the one before.
    each = [train_bench.forward_flops(model, 1, len(prompt) + k) for prompt, story in zip(prompts, stories)
            for k in range(len(story))]
    assert rollout_bench.writing_flops(model, prompts, stories) == sum(each)


def test_the_log_probabilities_and_the_update_count_each_position_over_those_before_it(run_main, monkeypatch):
    import grpo
    from bench import rollout as rollout_bench

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "matmul_peak", lambda device, dtype: 1e12)
    measured, measure = [], rollout_bench.measure_rollout
    monkeypatch.setattr(rollout_bench, "measure_rollout", lambda policy, *args: measured.append(
        (policy, measure(policy, *args))) or measured[-1][1])
    run_main(rollout_bench, "--repeats", "1", "--device", "cpu", "--precision", "fp32")
    [(policy, run)] = measured
    rows, positions = 128, run["positions"] // 128
    a_pass = sum(rows * train_bench.forward_flops(policy, 1, position) for position in range(1, positions + 1))
    assert run["logprobs work"] == 2 * a_pass  # the policy's and the reference's
    assert run["update work"] == ppo.EPOCHS * 3 * a_pass  # forward and backward, each pass over the stories


def test_the_literal_loop_counts_the_story_tokens_it_wrote_as_the_rollout_does(monkeypatch):
    from bench import rollout as rollout_bench

    class Tokenizer:
        eot = 9

    # Two groups of two rows after a prompt of 3: stories of 2 (ended), 3 (cut at the limit), 1 and 1.
    written = iter([torch.tensor([[1, 1, 1, 5, 9, 9], [1, 1, 1, 5, 6, 7]]),
                    torch.tensor([[2, 2, 2, 9, 9, 9], [2, 2, 2, 9, 9, 9]])])
    monkeypatch.setattr(rollout_bench, "generate", lambda *args, **kwargs: next(written))
    prompts = [torch.ones(2, 3, dtype=torch.long), 2 * torch.ones(2, 3, dtype=torch.long)]
    assert rollout_bench.write_group_by_group(None, Tokenizer(), prompts, seed=0) == 2 + 3 + 1 + 1


def test_decode_benchmark_times_a_step_its_share_of_the_peak_and_lists_its_operators(run_main, monkeypatch, capsys):
    from bench import decode
    from bench import train as train_bench

    # The peak measured before the steps and after them, the faster the one the step is divided by.
    peaks = iter([2e12, 5e12])
    monkeypatch.setattr(decode, "matmul_peak", lambda device, dtype: next(peaks))
    run_main(decode, "--positions", "22", "--steps", "2", "--device", "cpu", "--precision", "fp32")
    out = capsys.readouterr().out
    assert "the matrix-product peak: 5.000 TFLOP/s, the faster of 2.000 before the steps and 5.000 after them" in out
    at_the_peak = decode.step_flops(GPT(Config()), 22) / 5e12 * 1000
    assert f"and the step's products at the peak {at_the_peak:.1f} ms" in out
    assert re.search(r"a step of 128 rows at 22 cached positions: [\d.]+ ms, [\d,]+ tokens per second, \d+% of "
                     r"the matrix peak", out)
    assert "aten::addmm" in out  # the matrix products, among the operators listed
    cache = 2 * 7 * 128 * 384 * 22 * 4  # keys and values, the series' 7 layers, 128 rows, 384 channels, fp32
    assert re.search(rf"the attention reads {cache / 1e6:.0f} MB of keys and values a step; at the memory's "
                     r"[\d.]+ GB/s .* that is [\d.]+ ms, and the step's products at the peak [\d.]+ ms", out)
    assert re.search(r"dropping a quarter of the rows from the cache: [\d.]+ ms", out)
    assert re.search(r"the attention over the cache in fp32, 7 layers, two ways taking turns \(ms a step\):\n"
                     r"  torch's fused kernel, over the positions so far: [\d.]+\n"
                     r"  by hand, over blocks of 32 positions \(kernels.block_attention\): [\d.]+", out)


def compiler_takes_openmp():
    """Whether there is a C++ compiler that takes -fopenmp (Apple's clang does not)."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    return compiler is not None and subprocess.run([compiler, "-fopenmp", "-x", "c++", "-E", os.devnull],
                                                   capture_output=True).returncode == 0


# The hand-written kernel builds only where there is AVX2 and a C++ compiler with OpenMP.
KERNEL_NEEDS = "the kernel needs an x86 CPU with AVX2 and a C++ compiler that takes -fopenmp"
KERNEL_BUILDS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and compiler_takes_openmp()


def cache_of_rows_at_several_positions(channels, dtype, query_scale=1.0, block=kernels.CACHE_BLOCK):
    """A query for each of 24 rows and 3 heads, and their keys and values in 3 blocks, as
    sample.KVCache keeps them (each block's keys channel by channel in memory); each row sees
    its first positions, from 1 to all of them (the mask the cache makes)."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, blocks = 24, 3, 3
    q = (query_scale * torch.randn(rows, heads, 1, channels, generator=generator)).to(dtype)
    keys = torch.randn(blocks, rows, heads, channels, block, generator=generator).to(dtype).transpose(-2, -1)
    values = torch.randn(blocks, rows, heads, block, channels, generator=generator).to(dtype)
    seen = torch.randint(1, blocks * block + 1, (rows,), generator=generator)
    seen[:2] = torch.tensor([1, blocks * block])
    visible = (torch.arange(blocks * block) < seen[:, None])[:, None, None, :]
    return q, keys, values, visible


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
@pytest.mark.parametrize("channels", [16, 32, 64])  # the tiny model's heads, the series', and the one between
@pytest.mark.parametrize("dtype, rounding", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_hand_written_kernel_gives_float64_s_answer_within_its_precision_s_rounding(channels, dtype, rounding):
    from bench import attention_kernel

    attention = attention_kernel.as_attention(attention_kernel.build()[0])
    q, keys, values, visible = cache_of_rows_at_several_positions(channels, dtype)
    blocks, block, rows = keys.size(0), keys.size(3), keys.size(1)
    # The slots a row does not see hold NaN in both keys and values: the kernel must leave them
    # out of its answer (block_attention gets zeros there, as its products would carry a NaN).
    unseen = ~visible[:, 0, 0].T.reshape(blocks, block, rows).transpose(1, 2)  # (blocks, rows, block)
    for cache in (keys, values):
        cache[unseen[:, :, None, :, None].expand_as(cache)] = float("nan")
    in_order = [cache.double().nan_to_num().permute(1, 2, 0, 3, 4).flatten(2, 3) for cache in (keys, values)]
    exact = F.scaled_dot_product_attention(q.double(), *in_order, attn_mask=visible)
    by_hand = kernels.block_attention(q, keys.nan_to_num(), values.nan_to_num(), visible)
    ours = attention(q, keys, values, visible)
    assert ours.dtype == dtype and ours.shape == q.shape
    # Within the precision's rounding of the exact answer, as block_attention's is.
    assert torch.allclose(ours.double(), exact, atol=rounding)
    assert torch.allclose(by_hand.double(), exact, atol=rounding)
    if dtype == torch.bfloat16:  # block_attention's bf16 products round the scores; the kernel's stay float32
        assert (ours.double() - exact).abs().mean() <= (by_hand.double() - exact).abs().mean()
        # bf16 numbers widen exactly and the kernel works in float32: its bf16 answer is its float32
        # answer over the same numbers, rounded to the nearest bf16 as torch rounds.
        widened = attention(q.float(), keys.float(), values.float(), visible)
        assert torch.equal(ours, widened.bfloat16())
    # With no mask, every position of every block.
    whole = F.scaled_dot_product_attention(q.double(), *[c.nan_to_num() for c in in_order])
    keys = keys.transpose(-2, -1).nan_to_num().transpose(-2, -1)  # NaN to 0 in the same layout
    assert torch.allclose(attention(q, keys, values.nan_to_num(), None).double(), whole, atol=rounding)


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
def test_hand_written_kernel_s_softmax_holds_where_a_row_s_scores_lie_hundreds_apart():
    from bench import attention_kernel

    attention = attention_kernel.as_attention(attention_kernel.build()[0])
    # Queries 40 times as large: most rows' scores then span more than 87, below which the
    # kernel's e^x stops, and the rest of its range is crossed too.
    q, keys, values, visible = cache_of_rows_at_several_positions(64, torch.float32, query_scale=40.0)
    in_order = [cache.double().permute(1, 2, 0, 3, 4).flatten(2, 3) for cache in (keys, values)]
    scores = (q.double() @ in_order[0].transpose(-2, -1) / 8).masked_fill(~visible, float("nan"))
    spans = scores.nan_to_num(float("-inf")).amax(-1) - scores.nan_to_num(float("inf")).amin(-1)
    assert (spans > 87).float().mean() > 0.5
    exact = F.scaled_dot_product_attention(q.double(), *in_order, attn_mask=visible)
    assert torch.allclose(attention(q, keys, values, visible).double(), exact, atol=1e-5)


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
def test_hand_written_kernel_reads_blocks_of_64_and_refuses_blocks_it_cannot_read_32_at_a_time():
    from bench import attention_kernel

    attention = attention_kernel.as_attention(attention_kernel.build()[0])
    # Blocks of 64 positions: two runs of 32 positions in each block's scores.
    q, keys, values, visible = cache_of_rows_at_several_positions(64, torch.float32, block=64)
    in_order = [cache.double().permute(1, 2, 0, 3, 4).flatten(2, 3) for cache in (keys, values)]
    exact = F.scaled_dot_product_attention(q.double(), *in_order, attn_mask=visible)
    assert torch.allclose(attention(q, keys, values, visible).double(), exact, atol=1e-5)
    # Blocks of 16 (block_attention reads them) are refused, not read past their end.
    q, keys, values, visible = cache_of_rows_at_several_positions(64, torch.float32, block=16)
    with pytest.raises(ValueError, match="blocks of positions 32 at a time"):
        attention(q, keys, values, visible)


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
@pytest.mark.parametrize("channels", [16, 64])
def test_hand_written_kernel_reads_an_fp16_cache_under_a_float32_query_and_refuses_other_mixes(channels):
    from bench import attention_kernel

    attention = attention_kernel.as_attention(attention_kernel.build()[0])
    q, keys, values, visible = cache_of_rows_at_several_positions(channels, torch.float32)
    halves = [cache.to(torch.float16) for cache in (keys, values)]  # laid out as they were
    # float64's answer over the rounded cache: the kernel adds only float32's rounding to fp16's.
    in_order = [cache.double().permute(1, 2, 0, 3, 4).flatten(2, 3) for cache in halves]
    exact = F.scaled_dot_product_attention(q.double(), *in_order, attn_mask=visible)
    ours = attention(q, *halves, visible)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours.double(), exact, atol=1e-5)
    # A bf16 query over an fp16 cache, or keys and values of two types, are refused in one line.
    with pytest.raises(ValueError, match="or a float32 query over an fp16 cache"):
        attention(q.bfloat16(), *halves, visible)
    with pytest.raises(ValueError, match="or a float32 query over an fp16 cache"):
        attention(q, halves[0], values, visible)


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
def test_hand_written_kernel_refuses_what_it_would_misread_in_one_line():
    from bench import attention_kernel

    attention = attention_kernel.as_attention(attention_kernel.build()[0])
    q, keys, values, visible = cache_of_rows_at_several_positions(64, torch.float32)
    # The kernel reads memory where it is told: each of these would read the wrong numbers, or past the end.
    position_by_position = keys.contiguous()  # the same numbers, not in the cache's layout
    with pytest.raises(ValueError, match="dense, as sample.KVCache keeps them"):
        attention(q, position_by_position, values, visible)
    with pytest.raises(ValueError, match="on the CPU"):
        attention(q.to("meta"), keys.to("meta"), values.to("meta"), visible.to("meta"))
    with pytest.raises(ValueError, match=r"q: \(rows, heads, 1, channels\)"):
        attention(q[:, :2], keys, values, visible)
    with pytest.raises(ValueError, match="a head's channels: 16, 32 or 64"):
        attention(*cache_of_rows_at_several_positions(24, torch.float32))
    last_row_sees_none = visible.clone()
    last_row_sees_none[-1] = False
    with pytest.raises(ValueError, match="at least one position for each row"):
        attention(q, keys, values, last_row_sees_none)
    many = cache_of_rows_at_several_positions(16, torch.float32, block=32 * 11)  # 3 blocks of 352 positions
    with pytest.raises(ValueError, match="at most 1024 positions"):
        attention(*many)
    # The kernel's own interface: a count for each row, and a count past the cache's end is all of it.
    kernel = attention_kernel.build()[0]
    with pytest.raises(ValueError, match="a count of positions for each row"):
        kernel(q, keys, values, torch.full((q.size(0) - 1,), 5))
    everything = torch.full((q.size(0),), keys.size(0) * keys.size(3))
    assert torch.equal(kernel(q, keys, values, everything + 10**12), kernel(q, keys, values, everything))


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
def test_hand_written_kernel_rounds_its_bf16_answers_to_the_nearest_ties_to_even_and_keeps_nan():
    from bench import attention_kernel

    kernel = attention_kernel.build()[0]
    # A query of zeros weighs a row's positions alike: its answer is the mean of the values it sees,
    # worked out exactly in float32. bf16 keeps 1 + 7 bits, so next to 1 its numbers lie 2^-7 apart.
    q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16)
    keys = torch.zeros(1, 1, 1, 16, 32, dtype=torch.bfloat16).transpose(-2, -1)
    values = torch.zeros(1, 1, 1, 32, 16, dtype=torch.bfloat16)
    step = 2.0 ** -7

    def mean_of(*numbers):
        values[0, 0, 0, :len(numbers)] = torch.tensor(numbers)[:, None]
        return kernel(q, keys, values, torch.tensor([len(numbers)]))[0, 0, 0]

    def bf16(number):
        return torch.full((16,), number, dtype=torch.bfloat16)

    # Halfway between two bf16 numbers, the answer goes to the one whose last bit is 0: down from
    # 1 + 2^-8 to 1, up from 1 + 3 x 2^-8 to 1 + 2^-6 (truncating, or rounding ties away from 0,
    # would get one of them wrong); past halfway, to the nearer one, up from 1 + 0.75 x 2^-7.
    assert torch.equal(mean_of(1.0, 1.0 + step), bf16(1.0))
    assert torch.equal(mean_of(1.0 + step, 1.0 + 2 * step), bf16(1.0 + 2 * step))
    assert torch.equal(mean_of(1.0, 1.0, 1.0, 1.0 + 3 * step), bf16(1.0 + step))
    # A value that is not a number makes the answer not a number, not infinity.
    assert mean_of(1.0, 1.0, float("nan")).isnan().all()


def test_hand_written_kernel_s_build_says_in_one_line_what_is_missing_or_what_failed(monkeypatch, tmp_path):
    from bench import attention_kernel

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    build = attention_kernel.build.__wrapped__  # each call its own build, not the process's kept one
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    with pytest.raises(SystemExit, match=r"needs a C\+\+ compiler: there is no .*no-compiler \(CXX names another\)$"):
        build()
    # A file that is there but is no program to run.
    not_a_program = tmp_path / "not-a-program"
    not_a_program.write_text("")
    monkeypatch.setenv("CXX", str(not_a_program))
    with pytest.raises(SystemExit, match=r"needs a C\+\+ compiler: .*not-a-program did not run \(Permission denied\)$"):
        build()
    # A compiler that fails: its first error, not the line before it that says where.
    failing = tmp_path / "failing-compiler"
    failing.write_text("#!/bin/sh\necho \"attention_kernel.cpp: In function 'attend_one':\" >&2\n"
                       "echo 'attention_kernel.cpp:1: error: something is wrong' >&2\n"
                       "echo 'and a second line' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    with pytest.raises(SystemExit, match=r"^the kernel did not build: attention_kernel.cpp:1: error: something is "
                                         r"wrong$"):
        build()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(SystemExit, match="needs an x86 CPU with AVX2; this one offers DEFAULT"):
        build()


# The bench's fp16 cache: the layers' float32 keys and values rounded as they are stored, rows
# at several positions included (each row's token written at its own place), read by the kernel.
@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
def test_an_fp16_cache_read_by_the_kernel_gives_the_float32_cache_s_logits_to_fp16_s_rounding(monkeypatch):
    import sample
    from bench import attention_kernel
    from test_model import tiny_model

    monkeypatch.setattr(kernels, "BY_HAND_ON_CPU", True)  # the cache in blocks of 32, which the kernel reads
    attention = attention_kernel.as_attention(attention_kernel.build()[0])
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    groups = [torch.randint(0, 97, (2, 3), generator=g), torch.randint(0, 97, (3, 40), generator=g)]
    tokens = torch.randint(0, 97, (6, 5), generator=g)

    def logits_of_each_step(cache_kind, attend):
        monkeypatch.setattr(sample, "KVCache", cache_kind)
        monkeypatch.setattr(kernels, "block_attention", attend)
        with torch.no_grad():
            logits, cache = prefill(model, groups, 6)
            steps = [logits] + [model(token[:, None], cache=cache)[0][:, -1] for token in tokens]
        return torch.stack(steps), cache

    plain, _ = logits_of_each_step(sample.KVCache, kernels.block_attention)
    rounded, cache = logits_of_each_step(attention_kernel.Fp16Cache, attention)
    assert cache.keys.dtype == cache.values.dtype == torch.float16 and torch.is_tensor(cache.filled)
    assert not torch.equal(rounded[1:], plain[1:])  # the steps read rounded keys and values
    torch.testing.assert_close(rounded, plain, rtol=0, atol=1e-2)  # logits of up to about 5


@pytest.mark.skipif(not KERNEL_BUILDS, reason=KERNEL_NEEDS)
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_attention_kernel_benchmark_reports_errors_steps_and_rollouts_in_turns(precision, run_main, monkeypatch,
                                                                               capsys):
    import grpo
    import sample
    from bench import attention_kernel
    from bench import train as train_bench

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)  # the tiny model's stories, cut short
    monkeypatch.setattr(kernels, "BY_HAND_ON_CPU", False)  # as on a CPU with AMX: the bench still sets every way
    monkeypatch.setattr(attention_kernel, "matmul_peak",
                        lambda device, dtype: train_bench.matmul_peak(device, dtype, size=256, repeats=2))
    monkeypatch.setattr(decode, "ROWS", 8)  # the attention alone over 8 rows' caches, not 128: seconds less
    # Which attention read which cache: in the rollouts, the tiny model's heads of 16 channels;
    # alone, the series' shapes, heads of 64. Each way, over its own cache.
    used = set()

    def spy(way, attend):
        def attention(q, keys, *args, **kwargs):
            used.add((way, q.size(-1), keys.dtype))
            return attend(q, keys, *args, **kwargs)
        return attention
    as_attention = attention_kernel.as_attention
    monkeypatch.setattr(attention_kernel, "as_attention", lambda compiled: spy("kernel", as_attention(compiled)))
    monkeypatch.setattr(kernels, "block_attention", spy("plain", kernels.block_attention))
    run_main(attention_kernel, "--rollouts", "2", "--rounds", "1", "--precision", precision)
    out = capsys.readouterr().out
    assert f"; {precision}; the kernel built" in out and f"128 stories, {precision}," in out
    ways = ["kernels.block_attention", "the kernel"] + (["the kernel, fp16 cache"] if precision == "fp32" else [])
    for way in ways:
        assert re.search(rf"^  {way}: \d\.\de-\d\d on average, \d\.\de-\d\d at most$", out, re.MULTILINE)
        assert re.search(rf"^  {way}: [\d.]+ s, \d+ µs a token, \d+% of the peak$", out, re.MULTILINE)
    assert "| positions | torch's fused kernel | " + " | ".join(ways) + " |" in out
    for positions in (32, 128, 224):
        assert re.search(rf"^\| {positions} \|( [\d.]+ \|){{{len(ways) + 1}}}$", out, re.MULTILINE)
    for way in ways[1:]:
        assert re.search(rf"^  {way}: its time over block_attention's, turn by turn: [\d.]+, [\d.]+ \(median [\d.]+\)$",
                         out, re.MULTILINE)
    assert sample.KVCache is not attention_kernel.Fp16Cache  # the series' cache, put back after its rollouts
    dtype = train_bench.DTYPES[precision]
    caches = [("plain", dtype), ("kernel", dtype)] + ([("kernel", torch.float16)] if precision == "fp32" else [])
    assert used == {(way, channels, cache) for way, cache in caches for channels in (16, 64)}


def test_attention_kernel_benchmark_names_a_missing_checkpoint_before_building(run_main, monkeypatch, capsys):
    from bench import attention_kernel

    monkeypatch.setattr(attention_kernel, "build", lambda: pytest.fail("built before checking the checkpoint"))
    with pytest.raises(SystemExit, match="python finetune.py"):
        run_main(attention_kernel, "checkpoints/finetune/step-9.pt", "--rollouts", "1")


def test_attention_kernel_benchmark_refuses_a_cache_block_it_cannot_read_before_building(run_main, monkeypatch):
    from bench import attention_kernel

    monkeypatch.setattr(kernels, "CACHE_BLOCK", 16)
    monkeypatch.setattr(attention_kernel, "build", lambda: pytest.fail("built for blocks it cannot read"))
    with pytest.raises(SystemExit, match="blocks of a multiple of 32 positions; kernels.CACHE_BLOCK is 16"):
        run_main(attention_kernel, "--rollouts", "0")


def test_decode_benchmark_s_attention_reads_each_layer_s_own_cache():
    # One layer's cache read again would come from the CPU's cache where it fits: faster than a step.
    from bench import decode
    from model import GPT, Config

    model = GPT(Config(vocab_size=64, **TINY))
    read = []

    def spy(q, keys, values, visible):
        read.append((keys.data_ptr(), values.data_ptr()))
        return kernels.block_attention(q, keys, values, visible)
    times = decode.attention_ways(model, torch.device("cpu"), "fp32", 40, rounds=2, more={"spy": (spy, None)})
    assert len(times) == 3 and len(read) == 2 * TINY["n_layer"]
    assert len(set(read)) == TINY["n_layer"] and len({ptr for pair in read for ptr in pair}) == 2 * TINY["n_layer"]


def test_decode_benchmark_s_attention_gives_a_way_the_cache_rounded_where_it_asks_laid_out_as_before():
    from bench import decode
    from model import GPT, Config

    model = GPT(Config(vocab_size=64, **TINY))
    read = []

    def spy(q, keys, values, visible):
        read.append((keys.dtype, values.dtype, keys.transpose(-2, -1).is_contiguous(), values.is_contiguous()))
        return kernels.block_attention(q, keys.float(), values.float(), visible)
    decode.attention_ways(model, torch.device("cpu"), "fp32", 40, rounds=2, more={"fp16": (spy, torch.float16)})
    assert read == [(torch.float16, torch.float16, True, True)] * (2 * TINY["n_layer"])


def test_the_writing_reads_each_rows_positions_so_far_at_each_step_after_the_first_token():
    from bench.rollout import cache_bytes_read

    config = Config(vocab_size=64, **TINY)
    # A prompt of 3 and a story of 3 tokens: its 2nd and 3rd come from steps over 4 and 5
    # positions; a story of one token, from its prompt's pass, reads no cache. A position is
    # 256 bytes: keys and values, 2 layers, 32 channels, bf16.
    assert cache_bytes_read([[1, 2, 3], [4, 5]], [[6, 7, 0], [0]], config, 2) == (4 + 5) * 256


def tiny_model():
    torch.manual_seed(0)
    return GPT(Config(vocab_size=64, **TINY)).eval()


def test_flops_per_token_is_a_training_step_s_matrix_products_per_token():
    # Counted by torch: forward and backward of a whole window (train.CONTEXT tokens); the
    # estimate leaves out only the biases' and layer norms' few FLOPs. Attention by its matrix
    # products (torch's math kernel), which the counter sees, over every pair of positions.
    model = tiny_model()
    x = torch.randint(0, 64, (1, train_bench.CONTEXT))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x)[1].backward()
    assert train_bench.flops_per_token(model) == pytest.approx(counter.get_total_flops() / x.numel(), rel=0.03)


def test_step_flops_is_a_cached_step_s_matrix_products_for_all_its_rows(monkeypatch):
    # The attention by hand over the cache's blocks, whose products the counter sees (a CPU
    # with AMX would take torch's fused kernel, which it does not).
    monkeypatch.setattr(kernels, "BY_HAND_ON_CPU", True)
    model = tiny_model()
    counted = {}
    for positions in (32, 64):  # the step's token is the last of `positions`
        prompts = torch.randint(0, 64, (decode.ROWS, positions - 1))
        with torch.no_grad():
            _, cache = prefill(model, [prompts], 4)
            with FlopCounterMode(display=False) as counter:
                model(torch.randint(0, 64, (decode.ROWS, 1)), cache=cache)
        counted[positions] = counter.get_total_flops()
        assert decode.step_flops(model, positions) == pytest.approx(counted[positions], rel=0.04)
    # The attention's part, exactly: what 32 more cached positions add.
    assert decode.step_flops(model, 64) - decode.step_flops(model, 32) == counted[64] - counted[32]


def test_matmul_peak_is_a_products_flops_over_the_fastest_products_seconds(monkeypatch):
    seconds = iter([3.0, 0.5, 2.0])  # the timed products, one of them fast
    monkeypatch.setattr(train_bench, "timed", lambda device, work: (work(), next(seconds)))
    with FlopCounterMode(display=False) as counter:
        peak = train_bench.matmul_peak(torch.device("cpu"), torch.float32, size=64, repeats=3)
    assert peak == pytest.approx(counter.get_total_flops() / 4 / 0.5)  # 4 products: a warm-up, then 3 timed


@pytest.mark.parametrize("peaks", [(5e12, 2e12), (2e12, 5e12)], ids=["faster-before", "faster-after"])
def test_training_benchmark_divides_by_the_faster_peak_measured_before_and_after_its_steps(peaks, monkeypatch):
    monkeypatch.setattr(train_bench, "Config", lambda: Config(**TINY))
    monkeypatch.setattr(train_bench, "BATCH", 2)
    monkeypatch.setattr(train_bench, "CONTEXT", 16)
    measured = iter(peaks)
    monkeypatch.setattr(train_bench, "matmul_peak", lambda device, dtype: next(measured))
    result = train_bench.measure("fp32", 1, torch.device("cpu"))
    assert result["peak_tflops"] == 5.0
    assert result["share_of_peak"] == pytest.approx(result["tflops"] / 5.0)


@pytest.mark.parametrize("machine_s, asked, timed_in", [("bf16", [], ["fp32", "bf16"]), ("fp32", [], ["fp32"]),
                                                         ("fp32", ["--precision", "bf16"], ["bf16"])],
                         ids=["fast-bf16", "slow-bf16", "asked-for"])
def test_training_benchmark_times_bf16_only_where_the_scripts_train_in_it_or_asked(machine_s, asked, timed_in,
                                                                                   run_main, monkeypatch, capsys):
    # On a CPU without fast bf16 products, bf16's steps would take tens of minutes.
    ran = []
    monkeypatch.setattr(train_bench, "default_precision", lambda device: machine_s)
    monkeypatch.setattr(train_bench, "run_variant", lambda script, precision, extra: ran.append(precision) or {
        "tokens_per_second": 1000.0, "tflops": 0.1, "peak_tflops": 0.2, "share_of_peak": 0.5, "peak_memory_mb": 9.0})
    run_main(train_bench, "--device", "cpu", *asked)
    out = capsys.readouterr().out
    assert ran == timed_in
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("| fp32 |") or
            line.startswith("| bf16 |")] == [f"| {precision}" for precision in timed_in]
    assert ("bf16 not timed" in out) == (timed_in == ["fp32"])


def test_read_bandwidth_is_bytes_over_seconds(monkeypatch):
    monkeypatch.setattr(common, "timed", lambda device, work: (None, 0.5))
    assert common.read_bandwidth(torch.device("cpu")) == pytest.approx(256 * 2**20 / 0.5)


@pytest.mark.skipif(not Path("/proc/self/status").exists() or sys.platform == "darwin", reason="Linux's /proc")
def test_peak_memory_is_in_megabytes():
    high_water_kb = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                         if line.startswith("VmHWM:"))
    assert common.peak_memory_mb(torch.device("cpu")) == pytest.approx(high_water_kb / 1024, rel=0.1)


def test_a_child_process_s_peak_memory_is_read_in_its_platform_s_unit(monkeypatch):
    # bench/full_scale.py reads its steps' ru_maxrss: kilobytes on Linux, bytes on macOS.
    monkeypatch.setattr(common.sys, "platform", "darwin")
    assert common.max_resident_mb(3 * 2**20) == 3
    monkeypatch.setattr(common.sys, "platform", "linux")
    assert common.max_resident_mb(3 * 2**10) == 3


def test_a_full_scale_step_s_peak_memory_is_read_in_its_platform_s_unit(tmp_path, monkeypatch):
    from bench import full_scale

    (tmp_path / "step.py").write_text("print('done')\n")
    monkeypatch.setattr(full_scale, "ROOT", tmp_path)
    real_wait4 = os.wait4

    def wait4(pid, options):  # the child as it ended, its ru_maxrss 3 MB in macOS's bytes
        done, status, usage = real_wait4(pid, options)
        return done, status, type("Usage", (), {"ru_maxrss": 3 * 2**20})()

    monkeypatch.setattr(full_scale.os, "wait4", wait4)
    monkeypatch.setattr(common.sys, "platform", "darwin")
    seconds, first, peak_mb, lines = full_scale.run("step.py", [], None, tmp_path)
    assert peak_mb == 3 and lines == ["done\n"]


def test_the_bf16_drift_is_the_kl_estimate_grpo_makes(monkeypatch):
    from bench import rollout as rollout_bench

    # The fp32 model wrote the stories: r is the bf16 model's log p less the writer's, as grpo.py's ref - old.
    exact, rounded = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    passes = iter([exact, rounded])
    monkeypatch.setattr(rollout_bench, "rollout", lambda *args: ([[1]], [[2, 3]], [0.0]))
    monkeypatch.setattr(rollout_bench, "pack", lambda *args: (None, None, torch.ones(1, 2)))
    monkeypatch.setattr(rollout_bench, "token_logprobs", lambda *args: next(passes))
    drift = rollout_bench.precision_drift(None, type("T", (), {"eot": 0})(), [], torch.device("cpu"))
    r = rounded - exact
    assert drift["kl_per_story"] == pytest.approx(float((torch.exp(r) - r - 1).sum()))


def test_generate_s_tokens_are_bounded_by_the_context():
    done = subprocess.run([sys.executable, "bench/generate.py", "--stories", "1", "--tokens", "239", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tokens from 1 to 238 (the context less the prompt, and one)" in done.stderr


def test_overflow_refuses_a_page_it_does_not_know_before_it_builds_the_site(monkeypatch, capsys):
    from bench import overflow

    monkeypatch.setattr(sys, "argv", ["overflow.py", "--chromium", "/bin/true", "--pages", "07-dpo.md", "07-dpo"])
    monkeypatch.setattr(overflow.subprocess, "run", lambda *args, **kwargs: pytest.fail("it built the site"))
    with pytest.raises(SystemExit):
        overflow.main()
    assert "no page named 07-dpo.md; the pages: 01-data, 02-lab" in capsys.readouterr().err


def test_a_variant_that_fails_says_why_in_one_line(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('working')\nsys.exit('401 positions is more than the model\\'s context')\n")
    with pytest.raises(SystemExit, match="^fails.py --variant cache failed: 401 positions is more than the model's "
                                         "context$"):
        common.run_variant(str(script), "cache")


def test_timed_waits_for_the_device_before_it_starts_and_before_it_stops(monkeypatch):
    events = []
    monkeypatch.setattr(common, "synchronize", lambda device: events.append("wait"))
    monkeypatch.setattr(common.time, "perf_counter", lambda: events.append("clock") or float(len(events)))
    result, seconds = common.timed(torch.device("cuda"), lambda: events.append("work") or 7)
    assert result == 7 and events == ["wait", "clock", "work", "wait", "clock"]


def test_the_words_asked_table_counts_what_fine_tuning_reads(workspace, run_main, monkeypatch, capsys):
    from bench import words_asked
    from files import read_instructions, read_words
    from finetune import encode_example, first_uses, split_held_back
    from tokenizer import load_tokenizer

    monkeypatch.chdir(workspace)
    tokenizer = load_tokenizer()
    training, _ = split_held_back(read_instructions())
    askable, nouns = read_words()
    # Three words, asked as the first pass of the default seed asks them, are the file's own instructions.
    encoded = [encode_example(tokenizer, example) for example in training]
    first = sum(len(first_uses(tokenizer, example["words"], tokens[prompt:]))
                for example, (tokens, prompt) in zip(training, encoded))
    story_tokens = sum(len(tokens) - prompt for tokens, prompt in encoded)
    share, prompt, cut = words_asked.what_the_words_change(
        tokenizer, [example["story"] for example in training], askable, nouns, 3)
    assert share == pytest.approx(first / story_tokens)
    assert prompt == pytest.approx(sum(prompt for _, prompt in encoded) / len(encoded))
    assert cut == sum(tokens[-1] != tokenizer.eot for tokens, _ in encoded)
    # More words asked: more first uses, and a longer prompt.
    more_share, more_prompt, _ = words_asked.what_the_words_change(
        tokenizer, [example["story"] for example in training], askable, nouns, 8)
    assert more_share > share and more_prompt > prompt
    run_main(words_asked, "--words", "3", "8")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [row.split(" | ")[0] for row in rows] == ["| 3", "| 8"]
    # The askable words a story uses, each once: not capitalised, not part of a hyphenated word.
    assert words_asked.askable_per_story(["The Kite flew over a river-bank with a brave frog, a brave frog."],
                                         {"kite", "river", "brave", "frog", "flew"}) == [3]
    counts = words_asked.askable_per_story([example["story"] for example in training], askable)
    assert min(counts) >= 3  # every training story was asked for three
    assert (f"askable words a story uses: {sum(counts) / len(counts):.1f} on average, "
            f"{sum(count >= 8 for count in counts) / len(counts):.1%} of the stories at least 8") in out


def test_tokenizer_benchmark_times_the_train_stories_and_names_the_command_that_makes_them(
        workspace, run_main, tmp_path, monkeypatch, capsys):
    from bench import tokenizer as tokenizer_bench

    run_main(tokenizer_bench)
    out = capsys.readouterr().out
    assert re.search(r"train stories: [\d,]+, [\d.]+ MB", out) and "encode and decode back, exact" in out
    monkeypatch.chdir(tmp_path)  # no data/ yet
    with pytest.raises(SystemExit, match=r"no data/train.txt: make it with python data.py"):
        tokenizer_bench.main()


def test_training_benchmark_counts_every_token_of_its_steps_batches(monkeypatch):
    # A step trains on BATCH windows of CONTEXT tokens each: 3 steps in 2 seconds (a clock that
    # says so) are 3 x 2 x 16 tokens, and the TFLOP/s are those tokens' work.
    monkeypatch.setattr(train_bench, "Config", lambda: Config(**TINY))
    monkeypatch.setattr(train_bench, "BATCH", 2)
    monkeypatch.setattr(train_bench, "CONTEXT", 16)
    monkeypatch.setattr(train_bench, "matmul_peak", lambda device, dtype: 1e12)
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(train_bench, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    result = train_bench.measure("fp32", 3, torch.device("cpu"))
    assert result["tokens_per_second"] == 3 * 2 * 16 / 2.0
    model = GPT(Config(**TINY))
    assert result["tflops"] == pytest.approx(3 * 2 * 16 / 2.0 * train_bench.flops_per_token(model) / 1e12)


def test_the_rollout_benchmark_s_writing_is_its_seconds_less_the_scoring_s(run_main, monkeypatch):
    # rollout() writes and scores in one call: the writing's seconds are that call's less the
    # scoring's, timed again on its own, so that no part is counted twice in the whole rollout.
    import grpo
    from bench import rollout as rollout_bench

    monkeypatch.setattr(grpo, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "MAX_NEW_TOKENS", 16)
    monkeypatch.setattr(rollout_bench, "matmul_peak", lambda device, dtype: 1e12)
    seconds = iter([5.0, 1.0])  # the writing and scoring, then the scoring alone; every later part 1 s
    monkeypatch.setattr(rollout_bench, "timed", lambda device, work: (work(), next(seconds, 1.0)))
    measured, measure = [], rollout_bench.measure_rollout
    monkeypatch.setattr(rollout_bench, "measure_rollout",
                        lambda *args: measured.append(measure(*args)) or measured[-1])
    run_main(rollout_bench, "--repeats", "1", "--device", "cpu", "--precision", "fp32")
    [run] = measured
    assert (run["writing"], run["scoring"], run["logprobs"], run["update"]) == (4.0, 1.0, 1.0, 1.0)
    assert run["whole rollout"] == 7.0
    assert run["mean_length"] == run["story_tokens"] / 128  # the stories' tokens a story, not a position


@pytest.mark.parametrize("positions, steps, lowest", [(decode.PROMPT, 2, 21), (Config.context - 3, 2, 21), (30, 0, 21),
                                                      (22, 6, 23)],
                         ids=["the-prompt-alone", "no-room-for-the-profiled-steps", "no-step",
                              "no-room-before-the-centre-for-half-the-steps"])
def test_decode_benchmark_refuses_positions_its_steps_have_no_room_for(positions, steps, lowest, monkeypatch,
                                                                       capsys):
    # The cache must hold a token past the prompts before the first step timed (half the steps
    # before --positions), and the steps timed then as many profiled within the context: a
    # number outside is refused before the model is built.
    monkeypatch.setattr(decode, "pick_device", lambda name: pytest.fail("ran past the check"))
    monkeypatch.setattr(sys, "argv", ["decode.py", "--positions", str(positions), "--steps", str(steps)])
    with pytest.raises(SystemExit) as stopped:
        decode.main()
    assert stopped.value.code == 2 and f"--positions between {lowest} and the context (256)" in capsys.readouterr().err


def test_decode_benchmark_s_timed_steps_are_centred_on_the_positions_it_counts_their_work_at():
    # A step's work and bytes are counted at --positions: at 5 steps, the cache holds 38 to 42
    # positions as each timed step begins (the median step at 40), not 40 to 44.
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=64, **TINY)).eval()
    with torch.no_grad():
        seconds, _, cache = decode.writing_steps(model, torch.device("cpu"), 40, 5)
    assert len(seconds) == 5
    assert list(range(cache.filled - 5, cache.filled)) == [38, 39, 40, 41, 42]


def test_decode_benchmark_s_attention_by_hand_reads_every_position_so_far_and_no_more():
    # 40 positions in blocks of 32: both blocks are read, the second's first 8 slots alone visible,
    # as a step of the writing at 40 cached positions reads them.
    model = GPT(Config(vocab_size=64, **TINY))
    read = []

    def spy(q, keys, values, visible):
        read.append((len(keys), len(values), len(visible), int(visible.sum())))
        return kernels.block_attention(q, keys, values, visible)
    decode.attention_ways(model, torch.device("cpu"), "fp32", 40, rounds=1, more={"spy": (spy, None)})
    blocks = -(-40 // kernels.CACHE_BLOCK)
    assert read == [(blocks, blocks, blocks * kernels.CACHE_BLOCK, 40)] * TINY["n_layer"]


def test_decode_benchmark_drops_a_quarter_of_the_rows_as_it_says(monkeypatch):
    # The line printed says a quarter: the rows whose stories end, as the writing drops them.
    kept = []
    monkeypatch.setattr(decode, "timed", lambda device, work: (work(), 0.001))
    decode.narrowing(SimpleNamespace(keep=kept.append), torch.device("cpu"))
    [rows] = kept
    assert len(rows) == decode.ROWS and int(rows.sum()) == decode.ROWS - decode.ROWS // 4


def test_read_bandwidth_divides_by_the_fastest_of_its_sums(monkeypatch):
    # A sum that runs slow now and then (a shared machine) would put the memory's speed low
    # and the writing's floor, which reads the cache at that speed, high.
    seconds = iter([0.8, 0.5, 0.4, 0.9, 0.6])
    monkeypatch.setattr(common, "timed", lambda device, work: (None, next(seconds)))
    assert common.read_bandwidth(torch.device("cpu")) == pytest.approx(256 * 2**20 / 0.4)


def test_peak_memory_on_a_gpu_is_the_most_torch_allocated_in_megabytes(monkeypatch):
    # The tables' peak memory on CUDA: torch's high-water mark, not what is held at the end,
    # in MB of 2**20 bytes as on the CPU.
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: 2**20)
    assert common.peak_memory_mb(torch.device("cuda")) == 3


def test_synchronize_waits_for_the_gpu_it_is_given_and_not_for_a_cpu(monkeypatch):
    # Without the wait, a GPU's timer would measure only the queueing of its work, and every
    # tokens per second and share of the peak measured there would come out high.
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: waited.append("cuda"))
    monkeypatch.setattr(torch.mps, "synchronize", lambda *args: waited.append("mps"))
    for name in ("cuda", "cuda:0", "mps", "cpu"):
        common.synchronize(torch.device(name))
    assert waited == ["cuda", "cuda", "mps"]


def test_training_benchmark_s_clock_times_its_steps_alone_the_device_waited_for(monkeypatch):
    # The tokens per second are the timed steps' alone: not the warm-up step (which pays for
    # setting up), nor the peak's products before and after; and the clock waits for the
    # device's queued work before it starts and before it stops.
    monkeypatch.setattr(train_bench, "Config", lambda: Config(**TINY))
    events = []
    monkeypatch.setattr(train_bench, "train_step", lambda *args: events.append("step"))
    monkeypatch.setattr(train_bench, "matmul_peak", lambda device, dtype: events.append("peak") or 1e12)
    monkeypatch.setattr(train_bench, "synchronize", lambda device: events.append("wait"))
    clock = SimpleNamespace(perf_counter=lambda: events.append("clock") or float(len(events)))
    monkeypatch.setattr(train_bench, "time", clock)
    train_bench.measure("fp32", 3, torch.device("cpu"))
    assert events == ["step", "peak", "wait", "clock", "step", "step", "step", "wait", "clock", "peak"]


def rollout_main_with_runs(monkeypatch, runs, peaks, bandwidth):
    """bench/rollout.py's main() on rollouts measured as `runs` say, the peak after each as `peaks` say."""
    from bench import rollout as rollout_bench

    measured, measured_peaks = iter(runs), iter(peaks)
    monkeypatch.setattr(rollout_bench, "load_tokenizer", lambda: None)
    monkeypatch.setattr(rollout_bench, "load_checkpoint", lambda *args, **kwargs: tiny_model())
    monkeypatch.setattr(rollout_bench, "grpo_asks", lambda tokenizer: [])
    monkeypatch.setattr(rollout_bench, "measure_rollout", lambda *args: next(measured))
    monkeypatch.setattr(rollout_bench, "matmul_peak", lambda device, dtype: next(measured_peaks))
    monkeypatch.setattr(rollout_bench, "read_bandwidth", lambda device: bandwidth)
    monkeypatch.setattr(rollout_bench, "report", lambda runs, peak: "")
    monkeypatch.setattr(sys, "argv", ["rollout.py", "--repeats", str(len(runs)), "--device", "cpu",
                                      "--precision", "fp32"])
    rollout_bench.main()


# The lines under the table: each the median of the rollouts (a busy machine puts one of them
# far off, and a mean would follow it), divided by the fastest peak, and each rate its own
# tokens over its own part's seconds.
def test_rollout_benchmark_s_floors_and_rates_are_the_medians_of_its_rollouts(monkeypatch, capsys):
    def run(whole, whole_work, writing, writing_work, cache_bytes, story_tokens, by_group, by_group_tokens, positions,
            update):
        return {"whole rollout": whole, "whole rollout work": whole_work, "writing": writing,
                "writing work": writing_work, "cache_bytes_read": cache_bytes, "story_tokens": story_tokens,
                "mean_length": story_tokens / 128, "by_group": by_group, "by_group_tokens": by_group_tokens,
                "positions": positions, "update": update, "other_writing": 0.0, "other_tokens": 0}

    # The medians: 36 s and 48 TFLOP a rollout; the writing 10.5 s, 6 TFLOP, 20 GB read, 2,100
    # tokens; group by group 1,200 tokens in 12 s; the update 25,600 positions in 25.6 s.
    runs = [run(30.0, 40e12, 7.0, 4e12, 10e9, 2000, 10.0, 1000, 25000, 20.0),
            run(60.0, 80e12, 20.0, 8e12, 30e9, 3000, 30.0, 2000, 30000, 40.0),
            run(36.0, 48e12, 10.5, 6e12, 20e9, 2100, 12.0, 1200, 25600, 25.6)]
    rollout_main_with_runs(monkeypatch, runs, peaks=[2e12, 4e12, 3e12], bandwidth=10e9)
    out = capsys.readouterr().out
    assert "median of 3 rollouts; 128 stories, 16 tokens each on average" in out  # 2,100 / 128
    # 48 TFLOP at the fastest peak, 4 TFLOP/s: 12 s; the rollout's 36 s are 3 times it.
    assert "the floor, every product at the peak: 12.0 s a rollout; this one took 3.0 times it" in out
    # 6 TFLOP at the peak, 1.5 s, then 20 GB at 10 GB/s, 2 s: 3.5 s, and the writing's 10.5 s 3 times it.
    assert ("the writing's floor, its products at the peak (1.5 s) and the keys and values its steps read (20.0 GB) "
            "at the memory's 10.0 GB/s (2.0 s): 3.5 s; it took 3.0 times it") in out
    assert ("writing: 200 generated tokens per second in one batch, 100 group by group (16 calls of 8, its own "
            "stories): 2.0 times faster") in out
    # Each epoch trains on every position: EPOCHS x 25,600 positions and 2,100 story tokens in 25.6 s.
    assert (f"update: {ppo.EPOCHS * 1000:,.0f} trained positions per second "
            f"({ppo.EPOCHS * 2100 / 25.6:,.0f} story tokens)") in out


def test_the_rollout_benchmark_draws_from_the_instructions_in_grpo_s_order(monkeypatch):
    # grpo.py's rollouts draw from one list of the instructions, shortest first: drawn from
    # another order, the bench's seeds would pick other instructions, and time other stories.
    asks = {5: ["a5", "b5"], 3: ["c3"], 9: ["d9"]}
    monkeypatch.setattr(common, "load_asks", lambda tokenizer: asks)
    assert common.grpo_asks(None) == ["c3", "a5", "b5", "d9"]


# A rollout's own figures from what it wrote: the stories' tokens (end-of-text included, not
# the padding), the other precision's stories', and the bytes of keys and values its steps
# read, in the precision the cache holds them (bf16's two bytes, though the weights are fp32).
def test_a_rollout_counts_its_own_stories_tokens_and_its_cache_in_the_writing_s_precision(monkeypatch):
    from bench import rollout as rollout_bench

    prompts = [[1, 2, 3]] * 8
    stories = [[5, 6, 0], [7, 0], [8], [9, 9, 9, 9], [4, 0], [5], [6, 6], [7, 7, 0]]  # 18 tokens
    other = [[5, 0]] * 8  # in the other precision: 16 tokens
    written = iter([(prompts, stories, [float(i) for i in range(8)]), (prompts, other, [0.0] * 8)])
    monkeypatch.setattr(rollout_bench, "rollout", lambda *args: next(written))
    monkeypatch.setattr(rollout_bench, "write_group_by_group", lambda *args: 11)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = rollout_bench.measure_rollout(model, tiny_model(), optimizer, SimpleNamespace(eot=0, decode=str), [], 0,
                                        torch.device("cpu"), "bf16", True)
    assert run["story_tokens"] == 18 and run["mean_length"] == 18 / 8
    assert run["by_group_tokens"] == 11 and run["other_tokens"] == 16
    # The steps after each story's first token read its prompt and its story so far: 4, 5, ... positions.
    read = sum(3 + k for story in stories for k in range(1, len(story)))
    assert read == 4 + 5 + 4 + 4 + 5 + 6 + 4 + 4 + 4 + 5
    assert run["cache_bytes_read"] == read * 2 * TINY["n_layer"] * TINY["n_embd"] * 2  # keys and values, bf16


# The profile's count of what the writing wasted: every row's first token comes from its
# prompt's pass, each later one from a single-token step of the rows still in the batch.
def test_the_profile_counts_the_tokens_written_after_a_story_had_ended(monkeypatch, capsys):
    from bench import rollout as rollout_bench

    def rollout(policy, *args):
        policy(torch.zeros(4, 3, dtype=torch.long))  # the prompts' pass: each row's first token
        for rows in (4, 3, 2):  # three steps, a row leaving the batch after each
            policy(torch.zeros(rows, 1, dtype=torch.long))
        return [[1, 1, 1]] * 4, [[5, 6, 7, 0], [5, 0], [5, 6, 0], [0]], [0.0] * 4  # 10 tokens kept

    monkeypatch.setattr(rollout_bench, "rollout", rollout)
    with torch.no_grad():
        rollout_bench.profile_writing(tiny_model(), None, [], torch.device("cpu"), "fp32")
    # 4 + 4 + 3 + 2 = 13 written, 10 kept: 3 of 13 written after their story had ended.
    assert "4 steps; 13 tokens written, 10 kept in the stories: 23.1% written after a story had ended" in (
        capsys.readouterr().out)


def test_the_bf16_drift_s_figures_are_per_story_token_and_per_story(monkeypatch):
    from bench import rollout as rollout_bench

    # Two stories, of 2 tokens and 1 (the second row's last position is padding, and its
    # numbers must not count): r is the bf16 model's log p less the fp32 writer's.
    exact = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]])
    rounded = torch.tensor([[-1.5, -1.0], [-0.3, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    passes = iter([exact, rounded])
    monkeypatch.setattr(rollout_bench, "rollout", lambda *args: ([[1], [1]], [[2, 3], [2]], [0.0, 0.0]))
    monkeypatch.setattr(rollout_bench, "pack", lambda *args: (None, None, mask))
    monkeypatch.setattr(rollout_bench, "token_logprobs", lambda *args: next(passes))
    drift = rollout_bench.precision_drift(None, SimpleNamespace(eot=0), [], torch.device("cpu"))
    r = [-0.5, 1.0, 0.2]  # the three story tokens'
    assert drift["mean_abs_per_token"] == pytest.approx((0.5 + 1.0 + 0.2) / 3)
    assert drift["ratio_spread"] == pytest.approx(sum(abs(math.exp(x) - 1) for x in r) / 3)
    kl = [math.exp(x) - x - 1 for x in r]
    assert drift["kl_per_story"] == pytest.approx((kl[0] + kl[1] + kl[2]) / 2)  # the mean of the two stories' sums


def decode_main(monkeypatch, seconds, peaks, *args):
    """bench/decode.py's main() on the tiny model, every timed piece of work taking `seconds` in turn."""
    from bench import decode

    clock, measured_peaks = iter(seconds), iter(peaks)
    monkeypatch.setattr(decode, "GPT", lambda config: GPT(Config(vocab_size=64, **TINY)))
    monkeypatch.setattr(decode, "timed", lambda device, work: (work(), next(clock)))
    monkeypatch.setattr(decode, "matmul_peak", lambda device, dtype: next(measured_peaks))
    monkeypatch.setattr(decode, "read_bandwidth", lambda device: 1e9)
    monkeypatch.setattr(sys, "argv", ["decode.py", "--positions", "22", "--device", "cpu", "--precision", "fp32",
                                      *args])
    decode.main()


# The decode benchmark's figures from its timings: a step the median of the steps timed, its
# rows' tokens a second, its share of the faster peak, the cache's reads and the narrowing in
# milliseconds, and each way of attention the median of its rounds.
def test_decode_benchmark_s_figures_are_its_timings_medians_in_milliseconds(monkeypatch, capsys):
    seconds = [0.1, 0.5, 0.2,  # three steps timed: the median 0.2 s
               0.004,  # dropping a quarter of the rows
               0.001, 0.004, 0.002, 0.004, 0.009, 0.004, 0.002, 0.004, 0.003, 0.004]  # two ways, five rounds
    flops = decode.step_flops(GPT(Config(vocab_size=64, **TINY)), 22)
    # The peak before the steps would put the step at 80% of it, the one after, the faster, at 40%.
    decode_main(monkeypatch, seconds, [flops / 0.2 / 0.8, flops / 0.2 / 0.4], "--steps", "3")
    out = capsys.readouterr().out
    assert "a step of 128 rows at 22 cached positions: 200.0 ms, 640 tokens per second, 40% of the matrix peak" in out
    # Keys and values, 2 layers, 128 rows, 32 channels, 22 positions, fp32: 1.44 MB, at 1 GB/s 1.4 ms.
    cache = 2 * 2 * 128 * 32 * 22 * 4
    assert f"the attention reads {cache / 1e6:.0f} MB of keys and values a step; at the memory's 1.0 GB/s " \
           f"(a sum over 256 MB) that is {cache / 1e9 * 1000:.1f} ms" in out
    assert "dropping a quarter of the rows from the cache: 4.0 ms" in out
    assert re.search(r"torch's fused kernel, over the positions so far: 2.0\n  by hand, .*: 4.0\n", out)


# The compiled table: a step the median of its steps, an update's minibatch the median of all
# but the first (which pays for compiling), each column its own way's.
def test_decode_benchmark_s_compiled_table_gives_each_way_s_medians(monkeypatch, capsys):
    from bench import decode

    monkeypatch.setattr(torch, "compile", lambda model, dynamic: model)
    updates = iter([9.0, 1.0, 3.0, 2.0, 30.0, 0.5, 0.7, 0.6])  # eager's four, then compiled's
    monkeypatch.setattr(decode, "update_minibatch", lambda *args: next(updates))
    seconds = [0.1, 0.1, 0.001] + [0.001] * 10 + [0.05, 0.07] + [0.01, 0.03]  # eager's steps, then compiled's
    decode_main(monkeypatch, seconds, [1e12, 1e12], "--steps", "2", "--compile")
    out = capsys.readouterr().out
    assert "| a step of the writing | 60.0 ms | 20.0 ms |" in out
    assert "| an update minibatch (16 x 224), median of the last 3 | 2.00 s | 0.60 s |" in out


def test_forward_flops_counts_the_output_layer_the_token_embedding_s_weights_make():
    # The token embedding's weights are also the output layer: a product over the vocabulary
    # for every token, the series model's biggest matrix (5,376 x 384, a seventh of its weights),
    # which the tiny model's 64 words hide. A vocabulary of 4,096 makes it most of the work.
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=4096, **TINY))
    x = torch.randint(0, 4096, (1, 8))
    # 8 tokens: the output layer (4,096 x 32), each layer's 12 x 32 x 32 weights, two FLOPs a
    # weight; the attention's two products over the 8 x 8 pairs, 32 channels, in 2 layers.
    by_hand = 2 * 8 * (4096 * 32 + 2 * 12 * 32 * 32) + 4 * 2 * 32 * 8 * 8
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    assert counter.get_total_flops() == by_hand
    assert train_bench.forward_flops(model, 8, 8 * 8) == pytest.approx(by_hand, rel=0.01)  # and the biases'


def test_decode_benchmark_counts_the_cache_s_bytes_in_the_precision_it_holds(monkeypatch, capsys):
    # In bf16 the cache holds two bytes a number, half fp32's: the attention's floor at the
    # memory's speed halves with it.
    monkeypatch.setattr(decode, "attention_ways", lambda *args: {})  # bf16's slow products on a CPU, not counted
    decode_main(monkeypatch, [0.2, 0.004], [1e12, 1e12], "--steps", "1", "--precision", "bf16")
    cache = 2 * 2 * 128 * 32 * 22 * 2  # keys and values, 2 layers, 128 rows, 32 channels, 22 positions, bf16
    assert f"GB/s (a sum over 256 MB) that is {cache / 1e9 * 1000:.1f} ms" in capsys.readouterr().out
