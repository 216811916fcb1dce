"""The generation benchmark runs, both variants writing every token they are asked for
(bench/generate.py asserts the shape), so its figures in the docs can be made again; and the
cache it measures is faster than writing without it."""
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
