"""
Benchmark: how fast the tokenizer trains and encodes, on the train stories in data/.

    python bench/tokenizer.py          (after python data.py)

Prints the seconds to train VOCAB_SIZE tokens, and megabytes per second to encode the
train stories: once with an empty cache (every word's merges worked out), once warm.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tokenizer as bpe  # noqa: E402
from data import stories  # noqa: E402
from devices import machine  # noqa: E402
from files import DATA, require  # noqa: E402


def main():
    argparse.ArgumentParser(description="Time training the tokenizer on data/train.txt, and encoding it.").parse_args()
    require(DATA / "train.txt")
    texts = list(stories(DATA / "train.txt"))
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"machine: {machine()}")
    print(f"train stories: {len(texts):,}, {megabytes:.2f} MB")

    started = time.perf_counter()
    tokenizer = bpe.train(texts, bpe.VOCAB_SIZE, progress=False)
    print(f"train {bpe.VOCAB_SIZE} tokens: {time.perf_counter() - started:.2f} s")

    for label in ("cold cache", "warm cache"):
        started = time.perf_counter()
        count = sum(len(tokenizer.encode(t)) for t in texts)
        seconds = time.perf_counter() - started
        print(f"encode ({label}): {megabytes / seconds:.1f} MB/s, {count / seconds / 1e6:.2f}M tokens/s, "
              f"{megabytes * 1e6 / count:.2f} bytes per token")

    started = time.perf_counter()
    tokens = tokenizer.encode("\n".join(texts))
    decoded = tokenizer.decode(tokens)
    seconds = time.perf_counter() - started
    assert decoded == "\n".join(texts)
    print(f"encode and decode back, exact: {megabytes / seconds:.1f} MB/s")


if __name__ == "__main__":
    main()
