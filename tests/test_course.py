"""course.py runs the series' commands in order, skips what is done, runs again what was
interrupted or made from a newer model, and writes the report: all without training, as its runner is replaced by one
that records each command and writes the file the command would have written."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import course
from conftest import log_points


def evaluated(model):
    return [["evaluate.py", model, "--seeds", "3", "--device", "cpu"]]


FULL_COMMANDS = [
    ["data.py", "--source", "../shared/data/tinystories"],
    ["train.py", "--steps", "2322", "--minutes", "360", "--device", "cpu"], *evaluated("checkpoints/pretrain"),
    ["finetune.py", "--minutes", "240", "--device", "cpu"], *evaluated("checkpoints/finetune"),
    ["preferences.py", "--instructions", "2000", "--device", "cpu"],
    ["dpo.py", "--steps", "100", "--minutes", "60", "--device", "cpu"], *evaluated("checkpoints/dpo"),
    ["ppo.py", "--rollouts", "32", "--minutes", "120", "--kl", "0.05", "--device", "cpu"],
    *evaluated("checkpoints/ppo/kl-0.05"),
    ["grpo.py", "--rollouts", "32", "--minutes", "120", "--kl", "0.05", "--device", "cpu"],
    *evaluated("checkpoints/grpo/kl-0.05"),
    ["grpo.py", "--rollouts", "36", "--minutes", "120", "--kl", "0", "--device", "cpu"],
    *evaluated("checkpoints/grpo/kl-0"),
    ["docs/plots.py", "--course", "--seeds", "1"],
]
WORDS_USED = {"pretrain": 0.06, "finetune": 0.27, "dpo": 0.31, "dpo-seed-2": 0.35, "dpo-seed-3": 0.36,
              "ppo-kl-0.05": 0.45, "ppo-kl-0.05-seed-2": 0.41, "ppo-kl-0.05-seed-3": 0.4,
              "grpo-kl-0.05": 0.5, "grpo-kl-0.05-seed-2": 0.44, "grpo-kl-0.05-seed-3": 0.47,
              "grpo-kl-0": 0.58, "grpo-kl-0-seed-2": 0.6, "grpo-kl-0-seed-3": 0.62}


class Scripts:
    """Stands in for course.run: each command is recorded, and writes its step's output."""

    def __init__(self, monkeypatch, fail_at=None, failure=None):
        self.commands, self.outputs, self.fail_at, self.failure = [], {}, fail_at, failure
        real_course = course.course

        def course_and_its_outputs(*args):
            steps = real_course(*args)
            self.outputs = {tuple(step.command): step.output for step in steps}
            return steps

        monkeypatch.setattr(course, "course", course_and_its_outputs)
        monkeypatch.setattr(course, "run", self.run)

    def run(self, command):
        self.commands.append(command)
        output = self.outputs[tuple(command[:-1] if command[-1] == "--resume" else command)]
        if command[0] == "evaluate.py":
            name = course.model_name(Path(command[1]))
            output.parent.mkdir(parents=True, exist_ok=True)
            made_by = {"rollout": 32} if "kl-" in name else {"step": 100}
            output.write_text(json.dumps({
                "model": name, "words_used": WORDS_USED[name], "valid_loss": 2.4, "ended": 0.5, "made_by": made_by,
                "words_used_by_seed": [WORDS_USED[name]], "uses_of_a_used_word": 1.5,
                "stories": [{"words": ["kite", "river", "brave"], "story": f"The {name} story.\n\nThe end.",
                             "words_used": 1 / 3}]}))
        elif command[0] == "docs/plots.py":
            (course.PLOTS / "course-rl.png").write_bytes(b"a plot")
        else:  # a training script saves its model along the way, before it can be interrupted
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_bytes(b"made")
            if command[0] in ("ppo.py", "grpo.py"):  # and PPO and GRPO their rollouts' checkpoints
                (output.parent / "rollout-10.pt").write_bytes(b"rollout 10")
        if command[0] == self.fail_at:
            raise self.failure


@pytest.fixture
def learner(tmp_path, monkeypatch):
    """An empty folder to run the course in, with the docs' images in img/ (one drawn long ago)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(course, "PLOTS", tmp_path / "img")
    monkeypatch.setattr(course, "installed", lambda module: True)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "diagram.png").write_bytes(b"an old image")
    age(tmp_path / "img" / "diagram.png")
    return tmp_path


def age(*files):
    """Makes files an hour old, older than any the course writes next."""
    an_hour_ago = time.time() - 3600
    for file in files:
        os.utime(file, (an_hour_ago, an_hour_ago))


def age_everything(learner):
    age(*(learner / "checkpoints").rglob("*.pt"), *(learner / "runs").rglob("*.json"), *(learner / "data").iterdir())


def take_course(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["course.py", *args])
    course.main()


def test_every_step_runs_in_order_and_the_report_has_the_table_plots_and_stories(learner, monkeypatch):
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--source", "../shared/data/tinystories", "--device", "cpu")
    assert scripts.commands == FULL_COMMANDS

    report = (learner / "report" / "README.md").read_text()
    assert "`python course.py --source ../shared/data/tinystories --device cpu` on " in report
    assert "| pretraining | `python train.py --steps 2322 --minutes 360 --device cpu` | 0.0 |" in report
    assert "| in all | | 0.0 |" in report
    assert "| ppo-kl-0.05 | 45% | 2.40 | 50% |" in report
    assert "| grpo-kl-0 | 58% | 2.40 | 50% |" in report
    assert "![course-rl](../img/course-rl.png)" in report and "diagram" not in report
    # One seed: each row is that seed's model; the video's figures beside them, as reported.
    assert "| PPO, KL 0.05 | 1 | 32 rollouts | 45% | 2.40 | 50% |  |" in report
    assert "| GRPO, KL 0 (36 rollouts) | 58% | 2.56 | 8% | about 44 |" in report
    assert "For the first held-out instruction: kite, river, brave." in report
    assert "**dpo** (33% of the words):\n\n> The dpo story.\n>\n> The end.\n" in report


def test_three_seeds_train_each_dpo_ppo_and_grpo_run_three_times_and_the_report_gives_their_mean_and_range(
        learner, monkeypatch):
    scripts = Scripts(monkeypatch)
    monkeypatch.setattr(course, "kl_at_the_end", lambda folder: {"ppo": 20.0, "grpo": 14.0}.get(folder.parent.name))
    take_course(monkeypatch, "--quick", "--seeds", "3")
    assert scripts.commands[-1] == ["docs/plots.py", "--course", "--seeds", "3"]
    trained = [c for c in scripts.commands if c[0] in ("dpo.py", "ppo.py", "grpo.py")]
    assert len(trained) == 12
    # The series' seed first, as a learner's own command has it, then --seed 2 and --seed 3.
    assert [c[-2:] for c in trained[4:]] == [["--seed", "2"]] * 4 + [["--seed", "3"]] * 4
    assert "--seed" not in trained[0] and "--seed" not in trained[3]
    assert ["evaluate.py", "checkpoints/grpo/kl-0-seed-3", "--valid-windows", "128"] in scripts.commands
    report = (learner / "report" / "README.md").read_text()
    assert "| DPO | 3 | 100 steps | 34% (31% to 36%) | 2.40 (2.40 to 2.40) | 50% (50% to 50%) |  |" in report
    assert "| PPO, KL 0.05 | 3 | 32 rollouts | 42% (40% to 45%) | 2.40 (2.40 to 2.40) | 50% (50% to 50%) | " \
           "20.0 (20.0 to 20.0) |" in report
    assert "| GRPO, KL 0 | 3 | 32 rollouts | 60% (58% to 62%) |" in report
    assert "| grpo-kl-0-seed-3 | 62% |" in report  # and each model on its own


def test_a_step_whose_output_exists_is_skipped_and_says_what_made_it(learner, monkeypatch, capsys):
    (learner / "data").mkdir()
    (learner / "data" / "valid.bin").write_bytes(b"tokens")
    (learner / "checkpoints" / "pretrain").mkdir(parents=True)
    (learner / "checkpoints" / "pretrain" / "model.pt").write_bytes(b"trained by hand")
    age(learner / "data" / "valid.bin")
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert [c[0] for c in scripts.commands[:3]] == ["evaluate.py", "finetune.py", "evaluate.py"]
    assert scripts.commands[1] == ["finetune.py", "--minutes", "1.5"]
    assert ("== data: skipped: data/valid.bin exists\n"
            "== pretraining: skipped: checkpoints/pretrain/model.pt exists\n") in capsys.readouterr().out

    # The full course afterwards takes the quick one's models, and says so; only the plots are drawn again.
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch)
    assert scripts.commands == [["docs/plots.py", "--course", "--seeds", "1"]]
    assert ("== fine-tuning: skipped: checkpoints/finetune/model.pt exists, made by python finetune.py --minutes 1.5\n"
            in capsys.readouterr().out)
    report = (learner / "report" / "README.md").read_text()
    assert "| pretraining | `python train.py --steps 2322 --minutes 360` | not run by the course |" in report
    assert "| fine-tuning | `python finetune.py --minutes 1.5` | 0.0 |" in report


def course_after_training_again(learner, monkeypatch, folder):
    """The commands of a quick course taken again after the model in checkpoints/folder was
    trained once more, by hand."""
    Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    age_everything(learner)
    (learner / "checkpoints" / folder / "model.pt").touch()
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    return scripts.commands


def test_a_model_made_again_is_measured_again_and_so_is_each_model_made_from_it(learner, monkeypatch):
    assert course_after_training_again(learner, monkeypatch, "dpo") == [
        ["evaluate.py", "checkpoints/dpo", "--valid-windows", "128"], ["docs/plots.py", "--course", "--seeds", "1"]]

    age_everything(learner)
    (learner / "checkpoints" / "finetune" / "model.pt").touch()  # fine-tuning trained once more
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert [c[0] for c in scripts.commands] == ["evaluate.py", "preferences.py", "dpo.py", "evaluate.py", "ppo.py",
                                                "evaluate.py", "grpo.py", "evaluate.py", "grpo.py", "evaluate.py",
                                                "docs/plots.py"]
    assert ["evaluate.py", "checkpoints/pretrain", "--valid-windows", "128"] not in scripts.commands


def test_a_step_the_course_saw_interrupted_runs_again(learner, monkeypatch):
    Scripts(monkeypatch, fail_at="finetune.py", failure=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        take_course(monkeypatch, "--quick")
    assert (learner / "checkpoints" / "finetune" / "model.pt").exists()  # saved along the way
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert [c[0] for c in scripts.commands[:3]] == ["finetune.py", "evaluate.py", "preferences.py"]


def made_an_hour_ago(learner, *outputs):
    """Earlier steps' outputs, made before the interrupted step began (course.py goes on with
    a step only from checkpoints saved since what it is made from was made)."""
    for output in outputs:
        (learner / output).parent.mkdir(parents=True, exist_ok=True)
        (learner / output).write_bytes(b"made")
        age(learner / output)


def a_sitting_ten_minutes_before_the_last_checkpoint(learner, name):
    record = json.loads((learner / course.RECORD).read_text())
    record[name]["started"] -= 600
    (learner / course.RECORD).write_text(json.dumps(record))


def quick_course_interrupted_in_pretraining(learner, monkeypatch):
    """A --quick course stopped in pretraining, ten minutes after its sitting began, when it had
    saved a checkpoint."""
    Scripts(monkeypatch, fail_at="train.py", failure=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        take_course(monkeypatch, "--quick")
    a_sitting_ten_minutes_before_the_last_checkpoint(learner, "pretraining")


def test_an_interrupted_pretraining_and_grpo_go_on_from_their_checkpoints_and_count_every_sitting(
        learner, monkeypatch, capsys):
    quick_course_interrupted_in_pretraining(learner, monkeypatch)
    # The next sitting: pretraining goes on, and the course runs until GRPO is interrupted in its turn.
    scripts = Scripts(monkeypatch, fail_at="grpo.py", failure=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        take_course(monkeypatch, "--quick")
    assert scripts.commands[0] == ["train.py", "--minutes", "3", "--resume"]
    assert "== pretraining: going on from its last checkpoint, 10.0 minutes in: python train.py --minutes 3 " \
           "--resume" in capsys.readouterr().out
    a_sitting_ten_minutes_before_the_last_checkpoint(learner, "GRPO, KL 0.05")
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert scripts.commands[:2] == [["grpo.py", "--minutes", "1", "--kl", "0.05", "--resume"],
                                    ["evaluate.py", "checkpoints/grpo/kl-0.05", "--valid-windows", "128"]]
    report = (learner / "report" / "README.md").read_text()
    assert "| pretraining | `python train.py --minutes 3` | 10.0, in 2 sittings |" in report
    assert "| GRPO, KL 0.05 | `python grpo.py --minutes 1 --kl 0.05` | 10.0, in 2 sittings |" in report
    assert "| fine-tuning | `python finetune.py --minutes 1.5` | 0.0 |" in report


def test_a_step_interrupted_under_another_command_starts_over_and_on_another_device_goes_on(learner,
                                                                                        monkeypatch):
    # Pretraining interrupted in a --quick course, with a checkpoint of its sitting: the full
    # course trains its own, and does not go on with the quick run's 3 minutes.
    quick_course_interrupted_in_pretraining(learner, monkeypatch)
    scripts = Scripts(monkeypatch, fail_at="train.py", failure=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        take_course(monkeypatch, "--device", "cpu")
    assert scripts.commands[-1] == ["train.py", "--steps", "2322", "--minutes", "360", "--device", "cpu"]
    # The same command on another device goes on from the checkpoint: it loads on any.
    a_sitting_ten_minutes_before_the_last_checkpoint(learner, "pretraining")
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch)
    assert scripts.commands[0] == ["train.py", "--steps", "2322", "--minutes", "360", "--resume"]


def test_an_interrupted_step_starts_over_once_the_model_it_is_made_from_is_made_again(learner, monkeypatch):
    # PPO interrupted after its rollout-10 checkpoint; then fine-tuning is trained once more,
    # by hand: going on would train the old fine-tuned model's policy against the new reference.
    Scripts(monkeypatch, fail_at="ppo.py", failure=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        take_course(monkeypatch, "--quick")
    # Fine-tuned again a second after PPO's last checkpoint, which stays one of this sitting's.
    later = (learner / "checkpoints" / "ppo" / "kl-0.05" / "rollout-10.pt").stat().st_mtime + 1
    os.utime(learner / "checkpoints" / "finetune" / "model.pt", (later, later))
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert ["ppo.py", "--minutes", "1", "--kl", "0.05"] in scripts.commands
    assert not any("--resume" in command for command in scripts.commands)


def test_a_sitting_that_saved_nothing_goes_on_from_the_checkpoint_before_it(learner, monkeypatch):
    # The first sitting saved a checkpoint 10 minutes in; the second went on from it and was
    # interrupted before it saved another.
    made_an_hour_ago(learner, "data/valid.bin")
    now = time.time()
    (learner / "checkpoints" / "pretrain").mkdir(parents=True)
    (learner / "checkpoints" / "pretrain" / "model.pt").write_bytes(b"the first sitting's")
    os.utime(learner / "checkpoints" / "pretrain" / "model.pt", (now - 1000, now - 1000))
    (learner / "runs").mkdir()
    course.save_record({"pretraining": {"command": "python train.py --minutes 3", "started": now - 100,
                                        "minutes": None, "before": 10.0, "first_started": now - 1600,
                                        "sittings": 2}})
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert ["train.py", "--minutes", "3", "--resume"] in scripts.commands
    assert "| pretraining | `python train.py --minutes 3` | 10.0, in 3 sittings |" in (
        learner / "report" / "README.md").read_text()


def test_an_interrupted_step_starts_over_with_no_checkpoint_of_its_own_sitting(learner, monkeypatch):
    # Interrupted before it saved anything: the model.pt there is an older run's.
    (learner / "checkpoints" / "pretrain").mkdir(parents=True)
    (learner / "checkpoints" / "pretrain" / "model.pt").write_bytes(b"an older run's")
    age(learner / "checkpoints" / "pretrain" / "model.pt")
    (learner / "runs").mkdir()
    course.save_record({"pretraining": {"command": "python train.py --minutes 3", "started": time.time(),
                                        "minutes": None}})
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert ["train.py", "--minutes", "3"] in scripts.commands
    assert not any("--resume" in command for command in scripts.commands)


def test_a_failing_step_stops_the_course_with_one_line(learner, monkeypatch):
    Scripts(monkeypatch, fail_at="dpo.py", failure=subprocess.CalledProcessError(2, "dpo.py"))
    with pytest.raises(SystemExit, match=r"^course.py: DPO stopped \(exit 2\) in python dpo.py --steps 100 "
                                         r"--minutes 60; once it is fixed, python course.py goes on from there$"):
        take_course(monkeypatch)
    assert not (learner / "report").exists()


def test_without_matplotlib_the_plots_are_skipped_and_the_report_says_how_to_draw_them(learner, monkeypatch, capsys):
    monkeypatch.setattr(course, "installed", lambda module: module != "matplotlib")
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert ["docs/plots.py", "--course", "--seeds", "1"] not in scripts.commands
    assert "== plots: skipped: matplotlib is not installed (pip install matplotlib)" in capsys.readouterr().out
    assert "None drawn: `pip install matplotlib`, then `python course.py` again." in (
        learner / "report" / "README.md").read_text()


def test_the_report_s_minutes_in_all_are_the_sum_of_its_steps_minutes(learner):
    names = ("data", "pretraining", "fine-tuning", "DPO", "PPO", "plots")
    steps = [course.Step(name, [f"{name}.py"]) for name in names]
    # Pretraining in two sittings; DPO started and never finished; the plots never taken; and a
    # step of an earlier course with more seeds, which this course's table does not show.
    record = {"data": {"command": "python data.py", "minutes": 2.5},
              "pretraining": {"command": "python train.py", "minutes": 61.2, "sittings": 2},
              "fine-tuning": {"command": "python finetune.py", "minutes": 30.1},
              "DPO": {"command": "python dpo.py", "minutes": None},
              "PPO": {"command": "python ppo.py", "minutes": 10.0},
              "DPO, seed 2": {"command": "python dpo.py --seed 2", "minutes": 12.0}}
    course.report(steps, record)
    report = (learner / "report" / "README.md").read_text()
    shown = re.findall(r"^\| ([^|]+) \| `[^`]*` \| ([0-9.]+)", report, re.MULTILINE)
    assert shown == [("data", "2.5"), ("pretraining", "61.2"), ("fine-tuning", "30.1"), ("PPO", "10.0")]
    assert "| DPO | `python dpo.py` | not run by the course |" in report
    assert "| in all | | 103.8 |" in report  # 2.5 + 61.2 + 30.1 + 10.0


def test_the_real_runner_runs_a_script_of_the_series_with_this_python(monkeypatch):
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda command, check: ran.append((command, check)))
    course.run(["train.py", "--minutes", "60"])
    assert ran == [([sys.executable, str(course.ROOT / "train.py"), "--minutes", "60"], True)]


def test_the_kl_at_the_end_is_the_mean_over_the_run_s_last_five_rollouts(learner):
    log_points(learner / "runs" / "grpo" / "kl-0", "rollout/kl", [1, 2, 3, 4, 5, 6, 7])
    assert course.kl_at_the_end(course.CHECKPOINTS / "grpo" / "kl-0") == pytest.approx(5.0)
    # A shorter run afterwards into the same folder: its own three rollouts, not the first run's last.
    time.sleep(0.01)
    log_points(learner / "runs" / "grpo" / "kl-0", "rollout/kl", [10, 20, 30])
    evaluation = course.evaluation(course.CHECKPOINTS / "grpo" / "kl-0")
    evaluation.parent.mkdir(parents=True, exist_ok=True)
    evaluation.write_text(json.dumps({"made_by": {"rollout": 3}}))
    assert course.kl_at_the_end(course.CHECKPOINTS / "grpo" / "kl-0") == pytest.approx(20.0)
    assert course.kl_at_the_end(course.CHECKPOINTS / "grpo" / "kl-0.05") is None  # never run
    assert course.kl_at_the_end(course.CHECKPOINTS / "dpo") is None  # no KL logged for DPO


def test_the_course_s_figures_are_drawn_from_its_runs_each_method_with_all_its_seeds(learner, monkeypatch):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(course.ROOT / "docs"))
    import plots

    monkeypatch.setattr(plots, "RUNS", learner / "runs")
    monkeypatch.setattr(plots, "IMAGES", learner / "img")
    for run in ("grpo/kl-0.05", "grpo/kl-0.05-seed-2", "grpo/kl-0", "grpo/kl-0-seed-3", "grpo/kl-0.05-lr-1e-05",
                "ppo/kl-0.05"):
        log_points(learner / "runs" / run, "rollout/reward", [0.3, 0.4])
    log_points(learner / "runs" / "dpo-seed-2", "dpo/margin", [0.1, 0.2])
    log_points(learner / "runs" / "dpo", "dpo/margin", [0.1, 0.3])
    assert plots.with_its_seeds("grpo/kl-0", 3) == ["grpo/kl-0", "grpo/kl-0-seed-3"]
    assert plots.with_its_seeds("grpo/kl-0.05", 3) == ["grpo/kl-0.05", "grpo/kl-0.05-seed-2"]
    assert plots.with_its_seeds("grpo/kl-0.05", 1) == ["grpo/kl-0.05"]
    # The seeds' mean line: at the rollouts every seed reached, the mean of their values there.
    steps, mean = plots.seeds_mean([([1, 2, 3], [0.1, 0.2, 0.6]), ([2, 1], [0.4, 0.3]), ([1, 2, 3], [0.2, 0.3, 0.9])])
    assert steps == [1, 2] and mean == pytest.approx([0.2, 0.3])
    monkeypatch.setattr(sys, "argv", ["plots.py", "--course", "--seeds", "3"])
    plots.main()
    assert {p.name for p in (learner / "img").glob("course-*.png")} == {"course-dpo.png", "course-rl.png"}


def test_a_damaged_record_stops_the_course_with_one_line(learner, monkeypatch):
    (learner / "runs").mkdir()
    Scripts(monkeypatch)
    # Cut off; not a record of steps; a step without its minutes, or with a number for its command.
    for damaged in ('{"pretraining": {"command": "python train', "[]", '{"data": {"command": "python data.py"}}',
                    '{"data": 5}', '{"data": {"command": 5, "minutes": 1.0}}'):
        (learner / course.RECORD).write_text(damaged)
        with pytest.raises(SystemExit, match="course.json is damaged .*; delete it"):
            take_course(monkeypatch, "--quick")


def test_a_damaged_evaluation_stops_the_report_with_one_line(learner, monkeypatch):
    Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    figures = learner / "runs" / "evaluate" / "dpo.json"
    for damaged in ("", "[]"):  # cut off; not a model's figures
        figures.write_text(damaged)
        with pytest.raises(SystemExit, match="dpo.json is damaged; delete it, and python course.py measures "
                                             "checkpoints/dpo again"):
            take_course(monkeypatch, "--quick")


def test_a_pretrained_model_made_again_is_fine_tuned_again(learner, monkeypatch):
    commands = course_after_training_again(learner, monkeypatch, "pretrain")
    assert [command[0] for command in commands[:4]] == ["evaluate.py", "finetune.py", "evaluate.py", "preferences.py"]


def test_the_report_gives_each_model_s_words_used_as_the_mean_over_its_held_out_seeds(learner, monkeypatch):
    Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    path = course.evaluation(course.CHECKPOINTS / "dpo")
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "words_used": 0.3, "words_used_by_seed": [0.2, 0.3, 0.4], "seeds": 3}))
    assert "| DPO | 1 | 100 steps | 30% |" in course.summary(course.model_rows(1))


def grpo_interrupted_with(learner, older, this_sitting):
    """GRPO with its penalty interrupted 100 seconds after the course started it, its folder
    holding an older run's files and files saved 50 seconds ago, in this sitting."""
    made_an_hour_ago(learner, "data/valid.bin", "checkpoints/pretrain/model.pt", "checkpoints/finetune/model.pt")
    now = time.time()
    folder = learner / "checkpoints" / "grpo" / "kl-0.05"
    folder.mkdir(parents=True)
    for name in older:
        (folder / name).write_bytes(b"an older run's")
        age(folder / name)
    for name in this_sitting:
        (folder / name).write_bytes(b"this sitting's")
        os.utime(folder / name, (now - 50, now - 50))
    (learner / "runs").mkdir()
    course.save_record({"GRPO, KL 0.05": {"command": "python grpo.py --minutes 1 --kl 0.05", "started": now - 100,
                                          "minutes": None}})


def test_an_older_run_s_checkpoint_beside_this_sitting_s_does_not_stop_it_going_on(learner, monkeypatch):
    grpo_interrupted_with(learner, older=["rollout-30.pt"], this_sitting=["rollout-10.pt"])
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert ["grpo.py", "--minutes", "1", "--kl", "0.05", "--resume"] in scripts.commands


def test_a_copy_of_a_rollout_checkpoint_under_another_name_is_not_a_run_to_go_on_from(learner, monkeypatch):
    # grpo.py --resume reads only rollout-N.pt: the course must not send it there for a copy.
    grpo_interrupted_with(learner, older=[], this_sitting=["rollout-10 (copy).pt"])
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert ["grpo.py", "--minutes", "1", "--kl", "0.05"] in scripts.commands
    assert not any("--resume" in command for command in scripts.commands)


def test_pretraining_stopped_before_its_first_checkpoint_starts_again(learner, monkeypatch):
    # Interrupted before it saved anything, with no model.pt at all: it starts afresh, not --resume.
    made_an_hour_ago(learner, "data/valid.bin")
    (learner / "runs").mkdir()
    course.save_record({"pretraining": {"command": "python train.py --minutes 3", "started": time.time() - 100,
                                        "minutes": None}})
    scripts = Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    assert scripts.commands[0] == ["train.py", "--minutes", "3"]


def test_a_record_interrupted_while_it_is_saved_keeps_the_one_before(learner, monkeypatch):
    # Ctrl-C is how a learner stops the course, and it can land while course.json is written:
    # half a record would stop every later course as damaged, until the learner deletes it.
    (learner / "runs").mkdir()
    before = {"data": {"command": "python data.py", "started": 1.0, "minutes": 2.5}}
    course.save_record(before)
    real_write_text = Path.write_text

    def interrupted(path, text, *args, **kwargs):
        real_write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        course.save_record({**before, "pretraining": {"command": "python train.py", "started": 2.0, "minutes": None}})
    monkeypatch.setattr(Path, "write_text", real_write_text)
    assert course.read_record() == before
    assert [path.name for path in (learner / "runs").iterdir()] == ["course.json"]  # no half-written file left


@pytest.mark.parametrize("seeds", ["0", "-1"])
def test_fewer_than_one_training_seed_is_refused_before_any_step_runs(learner, monkeypatch, capsys, seeds):
    # --seeds 0 would still train the series' seed, and ask the plots for none.
    scripts = Scripts(monkeypatch)
    with pytest.raises(SystemExit):
        take_course(monkeypatch, "--quick", "--seeds", seeds)
    assert "--seeds must be at least 1" in capsys.readouterr().err
    assert scripts.commands == []


def test_sittings_that_save_nothing_one_after_another_still_go_on_from_the_first_s_checkpoint(learner,
                                                                                             monkeypatch):
    # Each sitting keeps when the course first started the step: after two sittings in a row that
    # saved no checkpoint, the first sitting's would otherwise be taken for an older run's, and
    # pretraining would start over.
    made_an_hour_ago(learner, "data/valid.bin")
    now = time.time()
    model = learner / "checkpoints" / "pretrain" / "model.pt"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"the first sitting's")
    os.utime(model, (now - 1000, now - 1000))
    (learner / "runs").mkdir()
    course.save_record({"pretraining": {"command": "python train.py --minutes 3", "started": now - 100,
                                        "minutes": None, "before": 10.0, "first_started": now - 1600,
                                        "sittings": 2}})

    def stopped_before_it_saves(command):
        raise KeyboardInterrupt

    monkeypatch.setattr(course, "run", stopped_before_it_saves)  # the third sitting
    with pytest.raises(KeyboardInterrupt):
        take_course(monkeypatch, "--quick")
    scripts = Scripts(monkeypatch)  # the fourth
    take_course(monkeypatch, "--quick")
    assert scripts.commands[0] == ["train.py", "--minutes", "3", "--resume"]
    assert "| pretraining | `python train.py --minutes 3` | 10.0, in 4 sittings |" in (
        learner / "report" / "README.md").read_text()


def test_the_report_says_over_how_many_held_out_seeds_each_model_s_words_used_is_a_mean(learner, monkeypatch):
    # The full course measures each model with three seeds of the held-out stories: the report
    # says so, as a figure of one seed and a mean of three are not read alike.
    Scripts(monkeypatch)
    take_course(monkeypatch, "--quick")
    mean_of = "each model's words used is itself the mean over 3 seeds of the held-out stories"
    assert mean_of not in (learner / "report" / "README.md").read_text()  # measured with one seed
    path = course.evaluation(course.CHECKPOINTS / "dpo")
    path.write_text(json.dumps({**json.loads(path.read_text()), "seeds": 3}))
    take_course(monkeypatch, "--quick")
    assert mean_of in (learner / "report" / "README.md").read_text()
