"""
Benchmark: pretraining speed of the series model (14.6M parameters), a batch of
train.BATCH windows of train.CONTEXT tokens, forward, backward and AdamW step, in fp32 and
with bf16 autocast; and how much of the machine's matrix-product peak that reaches. bf16 is
timed where the scripts train in it (devices.default_precision), or when --precision bf16
asks for it: on a CPU without fast bf16 products (many laptops, some servers) they can run
far slower than fp32's (80 times slower, devices.bf16_speedup_on_cpu measured, on a 2-core
AMD EPYC with AVX2 only, where the bench's bf16 part had not ended after two minutes).

The peak is measured here, with large matrix products in each precision, before the steps
and after them, and the faster counts: measured once, in a minute the shared machine runs
slow, the peak would come out low and the share of it high. A training step costs about 6
floating-point operations per parameter per token (2 forward, 4 backward), plus attention:
12 x layers x width x context per token (PaLM's appendix B). The token embedding counts, as
it is also the output layer; the position embedding, a lookup, doesn't.

    python bench/train.py        (one and a half to two minutes on a 2-core CPU)

Each variant runs in a fresh process, so the peak memory it reports is its own.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import peak_memory_mb, run_variant, synchronize, timed  # noqa: E402
from devices import default_precision, machine, pick_device  # noqa: E402
from model import GPT, Config  # noqa: E402
from train import BATCH, CONTEXT, make_optimizer, train_step  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(device, dtype, size=4096, repeats=10):
    """FLOP/s of a large square matrix product, the fastest of `repeats`: the most this
    machine does. On a shared machine a product now and then runs slow, and an average over
    them would put the peak low and every share of it high."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # untimed: the first product also pays for setting up the library's kernels and threads
    fastest = min(timed(device, lambda: a @ b)[1] for _ in range(repeats))
    return 2 * size**3 / fastest


def forward_flops(model, tokens, attended):
    """The matrix products of a forward pass over `tokens` tokens that attend to `attended`
    positions in all (each to itself and those before it): two FLOPs a weight for each token,
    and four a channel of each layer for each position attended (the query with its key, the
    attention's weight with its value)."""
    c = model.config
    matrices = model.parameter_count() - c.context * c.n_embd  # all but the position lookup
    return 2 * matrices * tokens + 4 * c.n_layer * c.n_embd * attended


def flops_per_token(model):
    """A training step's work a token: a forward pass, and a backward pass twice as much, the
    attention counted over the whole window, as PaLM counts it (and torch's math kernel works)."""
    return 3 * forward_flops(model, 1, CONTEXT)


def measure(precision, steps, device):
    torch.manual_seed(0)
    model = GPT(Config()).to(device).train()
    optimizer = make_optimizer(model)
    x = torch.randint(0, model.config.vocab_size, (BATCH, CONTEXT), device=device)
    y = torch.randint(0, model.config.vocab_size, (BATCH, CONTEXT), device=device)
    train_step(model, optimizer, x, y, device, precision, 1e-4)  # warm up
    # The peak before the steps, and again after them (the module's docstring says why).
    peak_before = matmul_peak(device, DTYPES[precision])
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, x, y, device, precision, 1e-4)
    synchronize(device)
    tokens_per_second = steps * BATCH * CONTEXT / (time.perf_counter() - started)
    peak = max(peak_before, matmul_peak(device, DTYPES[precision]))
    achieved = tokens_per_second * flops_per_token(model)
    return {"precision": precision, "tokens_per_second": tokens_per_second, "tflops": achieved / 1e12,
            "peak_tflops": peak / 1e12, "share_of_peak": achieved / peak, "peak_memory_mb": peak_memory_mb(device)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device")
    parser.add_argument("--precision", choices=list(DTYPES), help="time this one alone (default: fp32, and bf16 "
                                                                  "where the scripts train in it)")
    parser.add_argument("--variant", choices=list(DTYPES), help="run one precision here (used internally)")
    args = parser.parse_args()
    device = pick_device(args.device)
    if args.variant:
        print(json.dumps(measure(args.variant, args.steps, device)))
        return

    print(f"machine: {machine()}; device: {device}")
    # bf16 beside fp32 where the scripts train in it: on a CPU without fast bf16 products (many
    # laptops), its steps can take many times fp32's.
    if args.precision:
        precisions = [args.precision]
    elif default_precision(device) == "bf16":
        precisions = list(DTYPES)
    else:
        precisions = ["fp32"]
        print("bf16 not timed: the scripts train in fp32 on this device, where bf16 is not clearly faster "
              "(--precision bf16 times it anyway)")
    print(f"batch {BATCH} x context {CONTEXT}, {args.steps} steps after one to warm up")
    extra = ["--steps", str(args.steps)] + (["--device", args.device] if args.device else [])
    print("| precision | tokens per second | TFLOP/s | matrix-product peak | share of peak | peak memory |")
    print("| --- | --- | --- | --- | --- | --- |")
    for precision in precisions:
        r = run_variant(__file__, precision, extra)
        print(f"| {precision} | {r['tokens_per_second']:,.0f} | {r['tflops']:.3f} | {r['peak_tflops']:.3f} | "
              f"{r['share_of_peak']:.0%} | {r['peak_memory_mb']:,.0f} MB |")


if __name__ == "__main__":
    main()
