"""docs/plots.py draws the docs' figures from the logs under runs/ and prints the table of the
RL runs: the table's means are over the rollouts a run has (its first and last five), a
panel draws each seed's run thin and the seeds' mean over the steps they all have on top, a
figure drawn only when named is drawn when named, and a figure is written whole."""
import json
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


def test_the_rl_table_takes_the_first_and_last_five_rollouts_and_the_mean_share_of_tied_groups(tmp_path, monkeypatch,
                                                                                           capsys):
    run = tmp_path / "grpo" / "kl-0.05"
    log_points(run, "rollout/reward", [0.1, 0.1, 0.1, 0.1, 0.1, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9])
    log_points(run, "rollout/kl", [1.0] * 7 + [3.0] * 5)
    log_points(run, "rollout/frac_reward_zero_std", [0.5, 0.5, 0.25, 0.25, 0.0, 0.0, 0.25, 0.25, 0.0, 0.0, 0.0, 1.0])
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    plots.rl_table()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| GRPO")]
    assert rows == ["| GRPO, KL 0.05 | 12 | 10.0% | 90.0% | 3.0 | 25% |"]


def test_the_seeds_mean_is_over_the_seeds_at_the_steps_they_all_have():
    series = [([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 2], [3.0, 4.0]), ([1, 2, 3], [5.0, 6.0, 7.0])]  # one stopped early
    assert plots.seeds_mean(series) == ([1, 2], [3.0, 4.0])


def test_with_its_seeds_finds_every_seed_s_run(tmp_path, monkeypatch):
    for name in ("kl-0", "kl-0-seed-2", "kl-0-seed-3", "kl-0-seed-4"):
        (tmp_path / "grpo" / name).mkdir(parents=True)
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    assert plots.with_its_seeds("grpo/kl-0", 3) == ["grpo/kl-0", "grpo/kl-0-seed-2", "grpo/kl-0-seed-3"]


def test_a_panel_draws_each_seed_thin_and_their_mean_on_top(tmp_path, monkeypatch):
    for name, values in (("dpo", [1.0, 2.0, 3.0]), ("dpo-seed-2", [3.0, 4.0])):
        log_points(tmp_path / name, "dpo/margin", values)
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    figures = []
    monkeypatch.setattr(plots, "save", lambda figure, file: figures.append(figure))
    plots.panels("x.png", "t", [("margin", "dpo/margin", "step")], [("DPO", "C0", ["dpo", "dpo-seed-2"])])
    lines = figures[0].axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[1.0, 2.0, 3.0], [3.0, 4.0], [2.0, 3.0]]
    assert [line.get_linewidth() for line in lines] == [0.8, 0.8, 1.6]  # each seed thin, their mean on top
    assert lines[-1].get_label() == "DPO, mean of 2 seeds"
    matplotlib.pyplot.close(figures[0])


def test_a_seed_that_stopped_before_a_panel_s_tag_is_left_out_of_that_panel_s_mean(tmp_path, monkeypatch):
    # The third seed stopped after its first evaluation, before any batch's margin.
    for name, values in (("dpo", [1.0, 2.0]), ("dpo-seed-2", [3.0, 4.0])):
        log_points(tmp_path / name, "dpo/margin", values)
        log_points(tmp_path / name, "words/heldout", [0.3, 0.4])
    log_points(tmp_path / "dpo-seed-3", "words/heldout", [0.3])
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    figures = []
    monkeypatch.setattr(plots, "save", lambda figure, file: figures.append(figure))
    plots.panels("x.png", "t", [("words", "words/heldout", "step"), ("margin", "dpo/margin", "step")],
                 [("DPO", "C0", ["dpo", "dpo-seed-2", "dpo-seed-3"])])
    words, margin = (axis.get_lines() for axis in figures[0].axes)
    assert words[-1].get_label() == "DPO, mean of 3 seeds"
    assert margin[-1].get_label() == "DPO, mean of 2 seeds" and list(margin[-1].get_ydata()) == [2.0, 3.0]
    matplotlib.pyplot.close(figures[0])


def test_the_course_s_training_figure_draws_each_stage_from_its_own_tags(tmp_path, monkeypatch):
    # Pretraining logs the valid loss, fine-tuning its two losses: each is drawn, in the panels it has.
    log_points(tmp_path / "pretrain", "loss/valid", [3.0, 2.5])
    log_points(tmp_path / "finetune", "loss/instructions", [2.75, 2.5])
    log_points(tmp_path / "finetune", "loss/plain", [2.5, 2.25])
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    figures = []
    monkeypatch.setattr(plots, "save", lambda figure, file: figures.append(figure))
    plots.course_figures(["course-training.png"], seeds=1)
    drawn = [[(line.get_label(), list(line.get_ydata())) for line in axis.get_lines()] for axis in figures[0].axes]
    assert drawn == [[("pretraining", [3.0, 2.5]), ("fine-tuning", [])],
                     [("pretraining", []), ("fine-tuning", [2.75, 2.5])],
                     [("pretraining", []), ("fine-tuning", [2.5, 2.25])]]
    matplotlib.pyplot.close(figures[0])


def test_a_figure_drawn_only_when_named_is_drawn_when_named(tmp_path, monkeypatch):
    log_points(tmp_path / "runs" / "grpo" / "kl-0.05", "rollout/reward", [0.2, 0.3])
    log_points(tmp_path / "runs" / "grpo" / "kl-0.05", "rollout/kl", [1.0, 2.0])
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(sys, "argv", ["plots.py", "rl-step-11-reward.png"])
    plots.main()
    assert [path.name for path in (tmp_path / "img").iterdir()] == ["rl-step-11-reward.png"]


def test_the_course_s_training_figure_draws_pretraining_alone_when_fine_tuning_has_no_run(tmp_path, monkeypatch):
    log_points(tmp_path / "pretrain", "loss/valid", [3.0, 2.5])
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    drawn = []
    monkeypatch.setattr(plots, "panels", lambda file, title, panels_of, groups: drawn.append((file, groups)))
    plots.course_figures(["course-training.png"], seeds=1)
    assert [(file, [label for label, _, _ in groups]) for file, groups in drawn] == [
        ("course-training.png", ["pretraining"])]


def test_the_course_s_figures_named_with_others_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(sys, "argv", ["plots.py", "course-training.png", "rl-reward.png"])
    with pytest.raises(SystemExit):
        plots.main()
    assert "name them in a command of their own" in capsys.readouterr().err


def test_a_run_that_stopped_before_it_logged_leaves_the_figure_as_it_was(tmp_path, monkeypatch, capsys):
    # train.py stopped for a missing tokenizer, after making its runs/ folder: nothing to draw.
    (tmp_path / "runs" / "pretrain").mkdir(parents=True)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "pretrain-loss.png").write_bytes(b"the figure before")
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(sys, "argv", ["plots.py", "pretrain-loss.png"])
    plots.main()
    assert (tmp_path / "img" / "pretrain-loss.png").read_bytes() == b"the figure before"
    assert "nothing logged for pretrain-loss.png in runs/: skipping it" in capsys.readouterr().out


def test_the_course_s_figures_leave_a_figure_as_it_was_when_its_runs_logged_nothing(tmp_path, monkeypatch, capsys):
    for run in ("pretrain", "finetune", "ppo/kl-0.05"):
        (tmp_path / "runs" / run).mkdir(parents=True)
    (tmp_path / "img").mkdir()
    for file in ("course-training.png", "course-rl.png"):
        (tmp_path / "img" / file).write_bytes(b"the figure before")
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    plots.course_figures(["course-training.png", "course-rl.png"], seeds=1)
    for file in ("course-training.png", "course-rl.png"):
        assert (tmp_path / "img" / file).read_bytes() == b"the figure before"
    assert capsys.readouterr().out.count("nothing logged for course-") == 2


@pytest.mark.parametrize("content, error", [(b'{"words_used_by_seed": [0.2', r"is damaged \(JSONDecodeError\)"),
                                            (b"{}", "lacks words_used_by_seed, valid_loss"),
                                            (b'{"words_used_by_seed": [0.2]}', "lacks words_used_by_seed, valid_loss"),
                                            (b'{"words_used_by_seed": [0.2\xff', r"is damaged \(UnicodeDecodeError\)")])
def test_a_damaged_result_is_refused_in_one_line(tmp_path, monkeypatch, content, error):
    # An older or damaged result (a figure missing, bytes that are not text) would otherwise stop
    # the plots with a traceback (KeyError, UnicodeDecodeError).
    (tmp_path / "evaluate").mkdir()
    (tmp_path / "evaluate" / "finetune-step-200.json").write_bytes(content)
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    with pytest.raises(SystemExit, match=f"{error}; measure the model again with python evaluate.py"):
        list(plots.measured("finetune"))


def test_the_course_s_figures_with_no_runs_at_all_each_say_so(tmp_path, monkeypatch, capsys):
    # A learner who draws before the course has trained anything learns why nothing was drawn.
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(sys, "argv", ["plots.py", "--course"])
    plots.main()
    out = capsys.readouterr().out
    assert all(f"nothing logged for {file} in runs/" in out for file in plots.COURSE_FIGURES)
    assert not any((tmp_path / "img").iterdir())


def write_result(folder, name, result):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result))


def test_the_fine_tuning_curves_start_at_the_pretrained_model_and_span_the_seeds(tmp_path, monkeypatch):
    # Each recipe's points are its kept steps, after the pretrained model at step 0; the words
    # used are the seeds' mean with a bar from the lowest seed to the highest; the probe's point
    # only where the probe ran; a recipe with no step measured is left out, not a lone point.
    seeds = {0: [0.1, 0.2, 0.6], 100: [0.3, 0.3, 0.9], 200: [0.5, 0.6, 1.0], 300: [0.4, 0.5, 1.0]}  # 3 seeds
    losses = {0: 2.0, 100: 1.8, 200: 1.9, 300: 1.95}
    for step in seeds:
        write_result(tmp_path / "evaluate", "pretrain" if step == 0 else f"finetune-step-{step}",
                     {"words_used_by_seed": seeds[step], "valid_loss": losses[step]})
    write_result(tmp_path / "probe", "finetune-step-200", {"instruction_moves": 1.5})
    monkeypatch.setattr(plots, "RUNS", tmp_path)
    figures = []
    monkeypatch.setattr(plots, "save", lambda figure, file: figures.append(figure))
    plots.finetune_curves({"finetune": "default recipe", "finetune-swap-1": "--swap 1"}, "x.png")
    words, probe, loss = figures[0].axes
    means, bars = words.containers[0][0], words.containers[0][2][0].get_segments()
    assert list(means.get_xdata()) == [0, 100, 200, 300]
    assert list(means.get_ydata()) == pytest.approx([sum(s) / len(s) for s in seeds.values()])
    assert [y for bar in bars for y in (bar[0][1], bar[1][1])] == pytest.approx(
        [y for s in seeds.values() for y in (min(s), max(s))])
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in probe.get_lines()] == [([200], [1.5])]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in loss.get_lines()] == [
        (list(losses), list(losses.values()))]
    assert [text.get_text() for text in words.get_legend().get_texts()] == ["default recipe"]
    matplotlib.pyplot.close(figures[0])


def test_the_docs_plots_by_default_leave_out_the_figures_drawn_only_when_named(tmp_path, monkeypatch):
    # python docs/plots.py: the RL runs' figures, against rollouts, and the fine-tuning recipes';
    # not the step 11 figures, whose runs share these folders.
    run = tmp_path / "runs" / "grpo" / "kl-0.05"
    for tag in ("rollout/reward", "rollout/kl", "words/heldout"):
        log_points(run, tag, [0.2, 0.3])
    for name in ("pretrain", "finetune-step-100"):
        write_result(tmp_path / "runs" / "evaluate", name, {"words_used_by_seed": [0.2], "valid_loss": 2.0})
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    saved = {}
    monkeypatch.setattr(plots, "save", lambda figure, file: saved.setdefault(file, figure))
    monkeypatch.setattr(sys, "argv", ["plots.py"])
    plots.main()
    assert sorted(saved) == ["finetune-recipes.png", "rl-heldout.png", "rl-kl.png", "rl-reward.png"]
    assert saved["rl-reward.png"].axes[0].get_xlabel() == "rollout"
    for figure in saved.values():
        matplotlib.pyplot.close(figure)


def test_a_figure_name_that_is_not_one_of_the_docs_is_refused(tmp_path, monkeypatch, capsys):
    # A misspelt name would otherwise draw nothing, and say nothing of it.
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(sys, "argv", ["plots.py", "rl-rewards.png"])
    with pytest.raises(SystemExit):
        plots.main()
    assert "no figure named rl-rewards.png" in capsys.readouterr().err


def test_a_course_figure_named_is_drawn_alone_from_each_training_seed(tmp_path, monkeypatch):
    # Naming a figure leaves the others as they are; --seeds 2 takes each run's second seed too.
    for run in ("pretrain", "dpo", "dpo-seed-2", "dpo-seed-3"):
        (tmp_path / "runs" / run).mkdir(parents=True)
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    drawn = []
    monkeypatch.setattr(plots, "panels", lambda file, title, panels_of, groups: drawn.append((file, groups)))
    monkeypatch.setattr(sys, "argv", ["plots.py", "course-dpo.png", "--seeds", "2"])
    plots.main()
    assert [(file, [runs for _, _, runs in groups]) for file, groups in drawn] == [
        ("course-dpo.png", [["dpo", "dpo-seed-2"]])]


@pytest.mark.parametrize("args", [["--seeds", "3"], ["rl-reward.png", "--seeds", "2"], ["--course", "--seeds", "0"]])
def test_seeds_outside_the_course_s_figures_get_one_line(args, tmp_path, monkeypatch, capsys):
    # Only the course's runs have training seeds: --seeds 3 for the other figures would draw one
    # seed each and say nothing, and --seeds 0 would draw no run at all.
    monkeypatch.setattr(plots, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(plots, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(sys, "argv", ["plots.py", *args])
    with pytest.raises(SystemExit):
        plots.main()
    assert "--seeds must be at least 1, and goes with the course's figures" in capsys.readouterr().err
    assert not (tmp_path / "img").exists()
