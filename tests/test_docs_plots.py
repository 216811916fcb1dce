"""docs/plots.py draws the docs' figures from the logs under runs/ and prints the table of the
RL runs: the table's means are over the rollouts a run has, and a figure is written whole."""
import sys
from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))

import plots  # noqa: E402
from conftest import log_points  # noqa: E402


def test_the_rl_table_s_means_are_over_the_rollouts_a_run_has(tmp_path, monkeypatch, capsys):
    # A run of 3 rollouts: its first and last five are those 3.
    run = tmp_path / "grpo" / "kl-0.05"
    log_points(run, "rollout/reward", [0.5, 0.5, 0.5])
    log_points(run, "rollout/kl", [3.0, 3.0, 3.0])
    (tmp_path / "grpo" / "kl-0").mkdir()  # a run folder with no rollout logged yet is left out
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    plots.rl_table()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| GRPO")]
    assert rows == ["| GRPO, KL 0.05 | 3 | 50.0% | 50.0% | 3.0 | (no groups) |"]


def test_a_figure_is_written_whole_or_the_one_before_stays(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "IMAGES", tmp_path)
    lines = [([1, 2, 3], [3.0, 2.0, 1.5], "train")]
    plots.draw("curve.png", "A title", "step", "loss", lines)
    assert [path.name for path in tmp_path.iterdir()] == ["curve.png"]  # no temporary file left beside it
    drawn = (tmp_path / "curve.png").read_bytes()
    assert drawn[:8] == b"\x89PNG\r\n\x1a\n"

    # Drawing it again stops halfway (a full disk, say): the figure drawn before is still there, whole.
    def half_written(figure, file, **options):
        Path(file).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half_written)
    with pytest.raises((OSError, SystemExit)):
        plots.draw("curve.png", "A title", "step", "loss", lines)
    assert (tmp_path / "curve.png").read_bytes() == drawn
