"""
Benchmark: one rollout's writing, 128 stories of 200 new tokens from one prompt, by the
series model (14.6M parameters), with the KV cache and without it (the whole prefix run
again for every new token). Weights are random: speed does not depend on them, and no
story stops early, so every story gets its 200 tokens.

    python bench/generate.py               (about 11 minutes on a 2-core CPU, most of it without the cache)
    python bench/generate.py --stories 16  (a quicker look)

Each variant runs in a fresh process, so the peak memory it reports is its own.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import peak_memory_mb, run_variant, synchronize  # noqa: E402
from devices import machine, pick_device  # noqa: E402
from model import GPT, Config  # noqa: E402
from sample import generate, next_token  # noqa: E402

PROMPT_LENGTH = 19  # as long as most instructions, end-of-text included


@torch.no_grad()
def without_cache(model, prompts, new_tokens, generator):
    """The whole sequence again for each new token, as model.generate writes, but with the cache's
    draw (sample.next_token), so that the two ways differ by the cache alone."""
    tokens = prompts
    for _ in range(new_tokens):
        logits, _ = model(tokens)
        tokens = torch.cat([tokens, next_token(logits[:, -1], 1.0, None, generator)[:, None]], dim=1)
    return tokens


def measure(variant, stories, new_tokens, device):
    torch.manual_seed(0)
    model = GPT(Config()).to(device).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LENGTH), device=device).repeat(stories, 1)
    generator = torch.Generator(device=device).manual_seed(0)
    write = generate if variant == "cache" else without_cache
    write(model, prompt[:2], 4, generator=generator)  # warm up
    synchronize(device)
    started = time.perf_counter()
    out = write(model, prompt, new_tokens, generator=generator)
    synchronize(device)
    seconds = time.perf_counter() - started
    assert out.shape == (stories, PROMPT_LENGTH + new_tokens)
    return {"variant": variant, "seconds": seconds, "tokens_per_second": stories * new_tokens / seconds,
            "peak_memory_mb": peak_memory_mb(device)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stories", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--device")
    parser.add_argument("--variant", choices=["cache", "no-cache"], help="run one variant here (used internally)")
    args = parser.parse_args()
    room = Config.context - PROMPT_LENGTH + 1  # the last position's logits give one token more
    if args.stories < 1 or not 1 <= args.tokens <= room:
        parser.error(f"--stories must be at least 1, and --tokens from 1 to {room} (the context less the prompt, and one)")
    device = pick_device(args.device)
    if args.variant:
        print(json.dumps(measure(args.variant, args.stories, args.tokens, device)))
        return

    print(f"machine: {machine()}; device: {device}")
    print(f"{args.stories} stories of {args.tokens} new tokens after a prompt of {PROMPT_LENGTH}, fp32")
    extra = ["--stories", str(args.stories), "--tokens", str(args.tokens)]
    extra += ["--device", args.device] if args.device else []
    results = {v: run_variant(__file__, v, extra) for v in ("cache", "no-cache")}
    print("| writing | seconds | tokens per second | peak memory |")
    print("| --- | --- | --- | --- |")
    for variant, r in results.items():
        print(f"| {'with' if variant == 'cache' else 'without'} the KV cache | {r['seconds']:.1f} | "
              f"{r['tokens_per_second']:,.0f} | {r['peak_memory_mb']:,.0f} MB |")
    print(f"the cache is {results['no-cache']['seconds'] / results['cache']['seconds']:.1f} times faster")


if __name__ == "__main__":
    main()
