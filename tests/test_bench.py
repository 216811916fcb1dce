"""The generation benchmark runs, both variants writing every token they are asked for
(bench/generate.py asserts the shape), so its figures in the docs can be made again; and the
cache it measures is faster than writing without it. The attention benchmark times every
length it is given, in both precisions."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generation_benchmark_runs_both_variants_and_the_cache_is_faster():
    # Long enough stories that recomputing the prefix costs more than the cache saves in noise.
    done = subprocess.run([sys.executable, "bench/generate.py", "--stories", "2", "--tokens", "20", "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert re.search(r"\| with the KV cache \| [\d.]+ \| [\d,]+ \| [\d,]+ MB \|", done.stdout)
    assert re.search(r"\| without the KV cache \| [\d.]+ \| [\d,]+ \| [\d,]+ MB \|", done.stdout)
    speedup = float(re.search(r"the cache is ([\d.]+) times faster", done.stdout).group(1))
    assert speedup > 1


def test_attention_benchmark_times_each_length_in_each_precision():
    done = subprocess.run([sys.executable, "bench/attention.py", "--lengths", "17", "32", "--stories", "1",
                           "--repeats", "1", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, check=True)
    for length in (17, 32):
        assert re.search(rf"^\| {length} \|( [\d.]+ ms \|){{4}}$", done.stdout, re.MULTILINE)
