"""The generation benchmark runs, both variants writing every token they are asked for
(bench/generate.py asserts the shape), so its figures in the docs can be made again."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generation_benchmark_runs_both_variants():
    done = subprocess.run([sys.executable, "bench/generate.py", "--stories", "2", "--tokens", "3"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    assert re.search(r"\| with the KV cache \| [\d.]+ \| [\d,]+ \| [\d,]+ MB \|", done.stdout)
    assert re.search(r"\| without the KV cache \| [\d.]+ \| [\d,]+ \| [\d,]+ MB \|", done.stdout)
    assert re.search(r"the cache is [\d.]+ times faster", done.stdout)
