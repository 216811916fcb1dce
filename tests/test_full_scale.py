"""bench/full_scale.py's corpus: copies of the sample's stories that data.py keeps, each one,
so that the bench measures the full download's size and not a fraction of it."""
import sys
from types import SimpleNamespace

import data
from bench import full_scale
from bench.full_scale import name, renamed, write_copies


def test_every_copy_is_a_story_of_its_own_and_a_story_naming_no_one_is_written_once(tmp_path):
    stories = ["Once upon a time, a girl named Lily had a kite. Lily loved it, and Lily flew it.",
               "The sun was hot. Mom said, Tom is here.", "it was a hot day. the end."]
    count = write_copies(stories, tmp_path / "train.txt", megabytes=0.02)
    kept = list(data.stories(tmp_path / "train.txt"))
    assert len(kept) == count and sum(len(s.encode()) + len(data.SEPARATOR) + 2 for s in kept) >= 20_000
    assert len({data.fingerprint(story) for story in kept}) == count  # data.py drops none as repeated
    assert kept.count(stories[2]) == 1 and kept[:3] == stories  # the first copy is the story itself
    assert renamed(stories[0], 5) == stories[0].replace("Lily", name(5))  # the main character, everywhere


def test_names_are_distinct_for_every_copy():
    assert len({name(copy) for copy in range(8000)}) == 8000


def test_the_copies_stop_at_the_first_story_that_reaches_the_budget_in_bytes(tmp_path):
    # The corpus is TinyStoriesV2's size in bytes (a megabyte of 10**6 of them): each story its
    # UTF-8 bytes, curly quotes three each, a newline, the separator and a newline; the copies
    # stop at the first story that reaches the budget, so the file holds it and less than one story more.
    stories = ["“Look,” said Lily. “A crêpe, a piñata and a café!” Lily smiled.",
               "Then Tom ran home. The end."]
    path = tmp_path / "train.txt"
    count = write_copies(stories, path, megabytes=0.01)
    entries = path.read_bytes().split(b"\n" + data.SEPARATOR.encode() + b"\n")[:-1]
    assert len(entries) == count
    size = path.stat().st_size
    assert size == sum(len(entry) + len(data.SEPARATOR) + 2 for entry in entries)
    assert size >= 10_000 > size - (len(entries[-1]) + len(data.SEPARATOR) + 2)


def test_a_step_s_progress_is_timed_at_its_first_marked_line_from_its_start(tmp_path, monkeypatch):
    # The table's progress column: when the step first printed its marker (a 10th training step,
    # say), in seconds from the step's start, not its last such line.
    (tmp_path / "step.py").write_text("print('loading')\nprint('step 10: loss 1.0')\nprint('step 10: loss 0.9')\n")
    monkeypatch.setattr(full_scale, "ROOT", tmp_path)
    clock = iter([100.0, 103.0, 110.0, 120.0])
    monkeypatch.setattr(full_scale, "time", SimpleNamespace(time=lambda: next(clock)))
    seconds, first, _, lines = full_scale.run("step.py", [], r"step 10: loss", tmp_path)
    assert first == 3.0 and seconds == 10.0 and len(lines) == 3


def test_the_full_scale_corpus_is_the_size_asked_and_its_figures_in_their_units(tmp_path, monkeypatch, capsys):
    # --gigabytes 2.2: 2,200 MB of train text and a valid file a hundredth of it, as the full
    # download's; the train file's size in GB of 10**9 bytes, each step's peak memory in GB of 1,024 MB.
    asked = {}

    def write_copies(stories, path, megabytes):  # a sparse file of the size asked, written at once
        asked[path.name] = megabytes
        with open(path, "wb") as file:
            file.truncate(int(megabytes * 1_000_000))
        return 7

    monkeypatch.setattr(full_scale, "write_copies", write_copies)
    monkeypatch.setattr(full_scale, "local_files", lambda source: [("train", "t"), ("valid", "v")])
    monkeypatch.setattr(full_scale, "read_stories", lambda path: ["A story."])
    monkeypatch.setattr(full_scale, "run", lambda script, args, marker, folder: (12.0, 3.0, 1536.0, []))
    monkeypatch.setattr(full_scale.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["full_scale.py", "--source", "shared", "--gigabytes", "2.2"])
    full_scale.main()
    assert asked == {"train.txt": 2200.0, "valid.txt": 22.0}
    out = capsys.readouterr().out
    assert "corpus: 7 train and 7 valid stories, 2.20 GB of train text" in out
    assert "| `python train.py --steps 20` | 12 | its 10th step after 3 s | 1.50 GB |" in out
