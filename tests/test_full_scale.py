"""bench/full_scale.py's corpus: copies of the sample's stories that data.py keeps, each one,
so that the bench measures the full download's size and not a fraction of it."""
import data
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
