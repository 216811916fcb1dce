import _pyio
import errno
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data
import files
import tokenizer as bpe
from conftest import NAMES
from data import SEPARATOR, STOP_WORDS


def whole_words(story):
    """The story's words as written, punctuation stripped: "Instead," is "Instead", never "nstead"."""
    return {token.strip(".,!?;:\"'()") for token in story.split()}


def prepare(corpus, out, heldout=None):
    data.prepare(data.local_files(corpus), out, vocab_size=400, heldout=heldout or out / "heldout.json")
    return out


def read(path):
    return list(data.stories(path))


@pytest.fixture
def prepared(corpus, tmp_path):
    return prepare(corpus, tmp_path / "data")


def test_split_keeps_train_tune_and_valid_apart(corpus, prepared):
    train, tune, valid = (read(prepared / f"{split}.txt") for split in ("train", "tune", "valid"))
    assert len(train) + len(tune) == 400 and len(valid) == 120  # the valid copy of a train story is dropped
    assert 60 <= len(tune) <= 140  # about one in four train stories is kept out of pretraining
    assert not set(train) & set(valid) and not set(train) & set(tune) and not set(tune) & set(valid)


def test_instructions_come_from_the_stories_kept_out_of_pretraining(prepared):
    tune = set(read(prepared / "tune.txt"))
    stories = [e["story"] for e in files.read_instructions(prepared / "instructions.jsonl")]
    assert stories and set(stories) <= tune


def test_the_nouns_are_the_askable_words_that_mostly_come_after_a_determiner(tmp_path):
    path = tmp_path / "train.txt"
    stories = ["The kite flew. Tom jumped.", "A red kite jumped over the river.", "She jumped. The river ran.",
               "His kite fell, so he jumped again. Then Tom fell."]
    path.write_text("".join(f"{s}\n{SEPARATOR}\n" for s in stories), encoding="utf-8")
    # kite: 4 uses, all within two words after a determiner; river 2 of 2; jumped 0 of 4 ("a red
    # kite jumped" is three words on), fell 1 of 2 ("His kite fell"): under NOUN_SHARE, so not a noun.
    assert data.nouns_among(path, {"kite", "river", "jumped", "fell"}) == {"kite", "river"}


def test_words_json_holds_the_askable_words_and_their_nouns_and_a_damaged_one_is_refused(prepared):
    askable, nouns = files.read_words(prepared / "words.json")
    assert askable == data.askable_words(prepared / "train.txt")
    assert nouns == data.nouns_among(prepared / "train.txt", askable) and nouns  # the test corpus's nouns
    (prepared / "words.json").write_text('{"askable": ["kite"], "nouns": ["river"]}')
    with pytest.raises(SystemExit, match="damaged.*python data.py"):
        files.read_words(prepared / "words.json")
    (prepared / "words.json").write_text('{"askable": ')
    with pytest.raises(SystemExit, match="damaged; make it again with python data.py"):
        files.read_words(prepared / "words.json")
    # A string would be read letter by letter; numbers, capitals or two words are no words the reward reads.
    for damaged in ('{"askable": "cake", "nouns": "cake"}', '{"askable": [1, 2], "nouns": [1]}',
                    '{"askable": ["Cake", "kite"], "nouns": ["kite"]}', '{"askable": ["a b"], "nouns": []}'):
        (prepared / "words.json").write_text(damaged)
        with pytest.raises(SystemExit, match="damaged \\(its words are not two lists of lowercase words\\)"):
            files.read_words(prepared / "words.json")
    with pytest.raises(SystemExit, match="no .*words.json: make it with python data.py"):
        files.read_words(prepared / "missing" / "words.json")


def test_a_limit_reads_the_first_instructions_and_no_further(prepared):
    path = prepared / "instructions.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[5] = "x" + lines[5][1:]  # damaged past the limit, its size unchanged
    path.write_text("".join(lines), encoding="utf-8")
    assert files.read_instructions(path, limit=5) == [json.loads(line) for line in lines[:5]]
    with pytest.raises(SystemExit, match="damaged"):
        files.read_instructions(path)


def test_lowercased_file_is_left_out(prepared):
    assert all(any(c.isupper() for c in story) for story in read(prepared / "train.txt"))


def test_stories_are_stripped_and_empty_or_repeated_ones_dropped(tmp_path):
    source = tmp_path / "train.txt"
    source.write_text(f"  A first story.  \n{SEPARATOR}\n\n{SEPARATOR}\nA   first\nstory.\n{SEPARATOR}\n"
                      f"A second story.\n{SEPARATOR}\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text(f"A valid story.\n{SEPARATOR}\n", encoding="utf-8")
    counts = data.write_stories(data.local_files(tmp_path), tmp_path / "out")
    kept = read(tmp_path / "out" / "train.txt") + read(tmp_path / "out" / "tune.txt")
    assert sorted(kept) == ["A first story.", "A second story."]
    assert counts["dropped"] == 2


def test_story_that_is_not_utf8_is_dropped_with_a_message(tmp_path, capsys):
    (tmp_path / "train.txt").write_bytes(f"Good story.\n{SEPARATOR}\n".encode() + b"Bad \xff story.\n"
                                         + f"{SEPARATOR}\nAnother good one.\n{SEPARATOR}\n".encode())
    stories = list(data.read_stories(tmp_path / "train.txt"))
    assert [s.strip() for s in stories] == ["Good story.", "Another good one."]
    assert "dropped 1 stories that are not valid UTF-8" in capsys.readouterr().out


def test_a_line_with_several_separators_ends_a_story_at_each(tmp_path):
    (tmp_path / "train.txt").write_text(f"Story A.\n{SEPARATOR}\nStory B.{SEPARATOR}Story C.{SEPARATOR}\nStory D.\n")
    stories = list(data.read_stories(tmp_path / "train.txt"))
    assert [s.strip() for s in stories] == ["Story A.", "Story B.", "Story C.", "Story D."]


def test_the_story_files_keep_their_line_breaks_where_text_files_end_lines_otherwise(tmp_path, monkeypatch):
    # Python's own open (_pyio), ending lines as Windows does: a text file written without
    # newline="\n" would hold \r\n, and read_stories, which reads bytes, stories with \r in them.
    (tmp_path / "train.txt").write_text(f"A story.\nIts second line.\n{SEPARATOR}\nAnother story.\n{SEPARATOR}\n")
    (tmp_path / "valid.txt").write_text(f"A valid story.\n{SEPARATOR}\n")
    monkeypatch.setattr(os, "linesep", "\r\n")
    monkeypatch.setattr(data, "open", _pyio.open, raising=False)
    data.write_stories(data.local_files(tmp_path), tmp_path / "out")
    written = [(tmp_path / "out" / name).read_bytes() for name in ("train.txt", "tune.txt", "valid.txt")]
    assert b"Its second line" in b"".join(written) and b"\r" not in b"".join(written)
    stories = [story for name in ("train.txt", "tune.txt") for story in read(tmp_path / "out" / name)]
    assert sorted(stories) == ["A story.\nIts second line.", "Another story."]


def test_without_a_valid_file_one_story_in_twenty_becomes_valid(corpus, tmp_path):
    counts = data.write_stories(data.local_files(corpus / "stories-train.txt.gz"), tmp_path)
    assert counts["train"] + counts["tune"] + counts["valid"] == 400
    assert 5 <= counts["valid"] <= 40


def check_heldout(instructions, valid=None, train=()):
    assert len(instructions) == 50
    for example in instructions:
        words = example["words"]
        assert len(set(words)) == 3 and not set(words) & STOP_WORDS
        assert set(words) <= whole_words(example["story"])
        assert example["instruction"] == data.instruction(words)
        assert valid is None or example["story"] in valid
        assert example["story"] not in train


def test_drawn_heldout_has_50_instructions_whose_words_are_in_their_valid_stories(prepared):
    instructions = data.read_heldout(prepared / "heldout.json")
    check_heldout(instructions, set(read(prepared / "valid.txt")), set(read(prepared / "train.txt")))


def test_committed_heldout_is_version_1_and_its_words_are_in_its_stories():
    heldout = json.loads(data.HELDOUT.read_text())
    assert heldout["version"] == data.HELD_OUT_VERSION == 1
    check_heldout(heldout["instructions"])


def test_heldout_draw_is_the_same_on_every_run_and_then_kept(corpus, tmp_path):
    first = prepare(corpus, tmp_path / "first")
    second = prepare(corpus, tmp_path / "second")
    assert (first / "heldout.json").read_bytes() == (second / "heldout.json").read_bytes()
    assert (first / "instructions.jsonl").read_bytes() == (second / "instructions.jsonl").read_bytes()
    # More train stories change the askable words, but an existing held-out set is never drawn again.
    before = (first / "heldout.json").read_bytes()
    with gzip.open(corpus / "stories-train.txt.gz", "at") as f:
        f.write("".join(f"A pebble and a pebble and a lantern, {i}.\n{SEPARATOR}\n" for i in range(50)))
    prepare(corpus, first)
    assert (first / "heldout.json").read_bytes() == before


def test_heldout_stories_never_reach_training(corpus, prepared, tmp_path):
    story = data.read_heldout(prepared / "heldout.json")[0]["story"]
    with gzip.open(corpus / "stories-train.txt.gz", "at") as f:
        f.write(f"{story}\n{SEPARATOR}\n")
    counts = data.write_stories(data.local_files(corpus), tmp_path, prepared / "heldout.json")
    assert counts["held out"] == 1
    assert story not in read(tmp_path / "train.txt") + read(tmp_path / "tune.txt")


def test_instructions_ask_for_whole_lowercase_words_never_names(prepared):
    names = {name.lower() for name in NAMES} | {name.lower()[1:] for name in NAMES}
    for line in (prepared / "instructions.jsonl").read_text().splitlines():
        example = json.loads(line)
        assert not names & set(example["words"])
        assert not {"nstead", "uddenly", "didn"} & set(example["words"])
        assert set(example["words"]) <= whole_words(example["story"])


def test_a_source_without_stories_leaves_what_was_prepared(prepared, tmp_path):
    before = {name: (prepared / name).read_bytes() for name in ("train.txt", "valid.txt", "manifest.json")}
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no train stories"):
        prepare(empty, prepared)
    assert {name: (prepared / name).read_bytes() for name in before} == before


def test_a_source_with_no_valid_stories_leaves_what_was_prepared(corpus, prepared, tmp_path):
    before = {name: (prepared / name).read_bytes() for name in ("train.txt", "valid.txt", "manifest.json")}
    source = tmp_path / "no-valid"
    source.mkdir()
    (source / "stories-train.txt.gz").write_bytes((corpus / "stories-train.txt.gz").read_bytes())
    (source / "stories-valid.txt").write_text("")
    with pytest.raises(SystemExit, match="no valid stories"):
        prepare(source, prepared)
    assert {name: (prepared / name).read_bytes() for name in before} == before


def test_the_held_out_draw_does_not_depend_on_the_order_of_the_valid_stories(prepared, tmp_path):
    askable, _ = files.read_words(prepared / "words.json")
    stories = read(prepared / "valid.txt")
    reversed_file = tmp_path / "valid.txt"
    reversed_file.write_text("".join(f"{s}\n{SEPARATOR}\n" for s in reversed(stories)), encoding="utf-8")
    assert data.draw_heldout(reversed_file, askable) == data.draw_heldout(prepared / "valid.txt", askable)


def test_a_damaged_heldout_file_is_refused(tmp_path):
    whole = json.loads(data.HELDOUT.read_text(encoding="utf-8"))
    # Damaged, not JSON of a held-out set, another version, or an instruction short.
    for text in ("", '{"version": 1, "instr', "[]", json.dumps({**whole, "version": 2}),
                 json.dumps({**whole, "instructions": whole["instructions"][1:]})):
        (tmp_path / "heldout.json").write_text(text)
        with pytest.raises(SystemExit, match="is not version 1"):
            data.read_heldout(tmp_path / "heldout.json")


def test_instructions_read_back_as_written_and_bad_files_are_refused(prepared, tmp_path):
    lines = (prepared / "instructions.jsonl").read_text().splitlines()
    assert files.read_instructions(prepared / "instructions.jsonl") == [json.loads(line) for line in lines]
    with pytest.raises(SystemExit, match="make it with python data.py"):
        files.read_instructions(tmp_path / "missing.jsonl")
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text(lines[0] + "\n" + lines[1][:20] + "\n")  # cut off mid-line
    with pytest.raises(SystemExit, match="damaged"):
        files.read_instructions(damaged)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no instructions"):
        files.read_instructions(empty)
    # Lines of JSON with their keys, but not of their kinds: words given as one string would
    # be read letter by letter by the reward; an instruction that is a number fails in the tokenizer.
    first = json.loads(lines[0])
    for key, value in (("words", first["words"][0]), ("words", [1, 2, 3]), ("instruction", 12345),
                       ("story", None)):
        wrong = tmp_path / "wrong.jsonl"
        wrong.write_text(json.dumps({**first, key: value}) + "\n" + lines[1] + "\n")
        with pytest.raises(SystemExit, match="a line without its words, instruction and story"):
            files.read_instructions(wrong)
    # Whole lines, but fewer of them than data.py wrote (a copy cut short): its manifest says so.
    (prepared / "instructions.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(SystemExit, match="where data.py made"):
        files.read_instructions(prepared / "instructions.jsonl")


def test_token_files_hold_every_story_after_an_end_of_text(prepared):
    tokenizer = bpe.load_tokenizer(prepared)
    tokens = np.memmap(prepared / "valid.bin", dtype=np.uint16, mode="r")
    expected = "".join(SEPARATOR + s for s in read(prepared / "valid.txt"))
    assert tokens[0] == tokenizer.eot
    assert tokenizer.decode(tokens.tolist()) == expected


def test_second_run_reuses_what_is_there(corpus, prepared, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}
    prepare(corpus, prepared)
    assert capsys.readouterr().out.count("up to date") == 4
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == before


def test_a_changed_valid_share_splits_again_only_a_source_without_a_valid_file(corpus, prepared, tmp_path,
                                                                                monkeypatch, capsys):
    # The held-out set drawn from the valid file, as a source without one has too few to draw from.
    heldout = prepared / "heldout.json"
    (corpus / "stories-valid.txt").rename(tmp_path / "valid-aside.txt")
    without_valid = prepare(corpus, tmp_path / "without-valid", heldout)
    valid_before = read(without_valid / "valid.txt")
    monkeypatch.setattr(data, "VALID_SHARE", 5)
    capsys.readouterr()
    prepare(corpus, without_valid, heldout)
    assert "stories: up to date" not in capsys.readouterr().out
    assert len(read(without_valid / "valid.txt")) > len(valid_before)
    # With a valid file, VALID_SHARE splits nothing: the data stays as it is.
    (tmp_path / "valid-aside.txt").rename(corpus / "stories-valid.txt")
    prepare(corpus, prepared)
    assert capsys.readouterr().out.count("up to date") == 4


@pytest.mark.parametrize("setting, value, made_again", [
    ("TUNE_SHARE", 3, {"stories", "instructions", "tokenizer", "tokens"}),
    ("NOUN_SHARE", 0.9, {"instructions"}),
    ("ANY_WORD", re.compile(r"[A-Za-z]+"), {"instructions"}),
    ("LOWERCASE_WORD", re.compile(r"\b[a-z]+\b"), {"instructions"}),
    ("TOKENIZER_MEGABYTES", 1, {"tokenizer", "tokens"}),
])
def test_a_changed_setting_makes_its_step_and_the_steps_after_it_again(corpus, prepared, monkeypatch, capsys,
                                                                       setting, value, made_again):
    monkeypatch.setattr(data, setting, value)
    capsys.readouterr()
    prepare(corpus, prepared)
    printed = capsys.readouterr().out
    steps = {"stories", "instructions", "tokenizer", "tokens"}
    assert {step for step in steps if f"{step}: up to date" not in printed} == made_again


def test_changed_source_is_prepared_again(corpus, prepared, capsys):
    with gzip.open(corpus / "stories-train.txt.gz", "at") as f:
        f.write(f"A new story about a kite.\n{SEPARATOR}\n")
    prepare(corpus, prepared)
    assert re.search(r"stories: (\d+) train, (\d+) fine-tuning", capsys.readouterr().out)
    assert len(read(prepared / "train.txt")) + len(read(prepared / "tune.txt")) == 401


# ---------------------------------------------------------------- damaged outputs, two runs at once


def test_a_damaged_output_is_made_again(corpus, prepared, capsys):
    made = {name: (prepared / name).read_bytes() for name in ("train.bin", "instructions.jsonl", "tokenizer.json")}
    # A token file cut to an even size (half its tokens) and instructions cut mid-line.
    (prepared / "train.bin").write_bytes(made["train.bin"][:len(made["train.bin"]) // 4 * 2])
    (prepared / "instructions.jsonl").write_bytes(made["instructions.jsonl"][:-30])
    capsys.readouterr()
    prepare(corpus, prepared)
    out = capsys.readouterr().out
    assert "stories: up to date" in out and "tokenizer: up to date" in out
    assert "instructions: up to date" not in out and "tokens: up to date" not in out
    # A truncated tokenizer, which the error of load_tokenizer says to make again with data.py.
    (prepared / "tokenizer.json").write_bytes(made["tokenizer.json"][:100])
    prepare(corpus, prepared)
    assert {name: (prepared / name).read_bytes() for name in made} == made


def test_a_token_file_cut_since_data_py_made_it_is_refused(prepared):
    import train

    path = prepared / "train.bin"
    path.write_bytes(path.read_bytes()[:-1000])  # still an even size, and many windows long
    with pytest.raises(SystemExit, match="where data.py made .*make it again with python data.py"):
        train.load_tokens("train", prepared)


@pytest.mark.parametrize("damaged", ['{"stories": ', '{"tokens": {"outputs": []}}',
                                     '{"tokens": {"outputs": {"valid.bin": ["649444", "x"]}}}',
                                     '{"instructions": {"outputs": {"instructions.jsonl": 5}}}'])
def test_a_damaged_manifest_runs_every_step_again_and_checks_nothing(damaged, corpus, prepared, capsys):
    import train

    (prepared / "manifest.json").write_text(damaged)
    # Read as no manifest: the files it would check against are read as they are.
    assert files.read_manifest(prepared) == {}
    assert len(train.load_tokens("valid", prepared)) > 0
    assert files.read_instructions(prepared / "instructions.jsonl")
    capsys.readouterr()
    prepare(corpus, prepared)
    assert "up to date" not in capsys.readouterr().out


def test_a_data_folder_it_cannot_write_is_refused_in_one_line(corpus, prepared, monkeypatch):
    # A folder on a read-only disk: the lock, the first file data.py opens there, is refused.
    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    before = {path.name: path.read_bytes() for path in prepared.iterdir()}
    monkeypatch.setattr(files, "open", read_only, raising=False)
    monkeypatch.setattr("sys.argv", ["data.py", "--source", str(corpus), "--out", str(prepared)])
    with pytest.raises(SystemExit, match=f"cannot write in {prepared} .Read-only file system.; make it writable"):
        data.main()
    assert {path.name: path.read_bytes() for path in prepared.iterdir()} == before


def test_a_second_data_py_on_the_same_folder_is_refused(corpus, tmp_path, monkeypatch):
    out = tmp_path / "data"
    monkeypatch.setattr("sys.argv", ["data.py", "--source", str(corpus), "--out", str(out)])
    with files.one_at_a_time(out):
        with pytest.raises(SystemExit, match="another python data.py is preparing"):
            data.main()
    assert not (out / "manifest.json").exists()
    with files.one_at_a_time(out):  # let go when the first run ends
        pass


@pytest.mark.parametrize("args, message", [(["--megabytes", "0"], "--megabytes must be a positive number"),
                                           (["--source", "no-such-folder"], "no such file or folder")])
def test_a_bad_source_or_size_is_refused_in_one_line_before_anything_is_read(args, message, tmp_path, monkeypatch,
                                                                             capsys):
    # --megabytes 0 would otherwise download the whole 2.2 GB.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data, "download", lambda *a, **k: pytest.fail("it downloaded"))
    monkeypatch.setattr("sys.argv", ["data.py", *args])
    with pytest.raises(SystemExit) as stopped:
        data.main()
    assert message in str(stopped.value) + capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # no empty data folder left behind


def test_an_out_that_is_a_file_is_refused_in_one_line(corpus, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr("sys.argv", ["data.py", "--source", str(corpus), "--out", str(tmp_path / "notes.txt")])
    with pytest.raises(SystemExit):
        data.main()
    assert "notes.txt is a file: name a folder" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("words", ["kite", ["Kite", "river", "brave"], ["kite", "kite", "river"], None])
def test_a_held_out_instruction_that_the_reward_would_misread_is_refused(tmp_path, words):
    heldout = json.loads(data.HELDOUT.read_text())
    example = heldout["instructions"][6]
    if words is None:  # the words as written, another instruction
        example["instruction"] = "Write a story.\n"
    else:  # a word as a string is read letter by letter; a capital never matches a story's word
        example.update(words=words, instruction=data.instruction(words) if isinstance(words, list) else "")
    (tmp_path / "heldout.json").write_text(json.dumps(heldout))
    with pytest.raises(SystemExit, match="held-out instruction 7 is not three lowercase words"):
        data.read_heldout(tmp_path / "heldout.json")


def test_a_word_counts_once_per_story_however_often_the_story_uses_it(tmp_path):
    stories = [f"Tom ran home, number {i}." for i in range(100)]
    for i in range(6):
        stories[i] += " He saw a kite."  # in 6 stories: askable
    for i in range(6, 8):
        stories[i] += " A lantern, a lantern, a lantern, a lantern, a lantern."  # 10 uses, in 2 stories only
    for i in range(8, 8 + data.FEWEST):
        stories[i] += " A frog sat."  # in as few stories as an askable word may be
    for i in range(20, 19 + data.FEWEST):
        stories[i] += " A ball fell."  # in one story fewer
    (tmp_path / "train.txt").write_text("".join(f"{s}\n{SEPARATOR}\n" for s in stories), encoding="utf-8")
    askable = data.askable_words(tmp_path / "train.txt")
    assert "kite" in askable and "lantern" not in askable
    assert "frog" in askable and "ball" not in askable


@pytest.mark.parametrize("apostrophe", ["'", "’"])
def test_a_word_cut_by_an_apostrophe_is_never_asked_for_and_either_apostrophe_reads_alike(tmp_path, apostrophe):
    # The stories write both apostrophes: "didn’t" is no more the word "didn" than "didn't" is,
    # and "a dog’s kite" puts the kite two words after "a", as "a dog's kite" does.
    stories = [f"Tom ran home, number {i}." for i in range(100)]
    for i in range(6):
        stories[i] += f" She didn{apostrophe}t see a dog{apostrophe}s kite."
    (tmp_path / "train.txt").write_text("".join(f"{s}\n{SEPARATOR}\n" for s in stories), encoding="utf-8")
    askable = data.askable_words(tmp_path / "train.txt")
    assert askable == {"kite"} and data.nouns_among(tmp_path / "train.txt", askable) == {"kite"}
    assert data.askable_in(stories[0], askable | {"didn", "dog"}) == ["kite"]


def test_the_words_asked_of_a_story_are_the_same_in_every_process():
    story = "The kite, the river, the brave frog, a red boat, a big cake and a warm sun."
    askable = ["kite", "river", "brave", "frog", "red", "boat", "big", "cake", "warm", "sun"]
    code = f"import data; print(data.pick_words({story!r}, set({askable!r})))"
    root = Path(data.__file__).resolve().parent
    drawn = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(drawn) == 1


def test_a_story_after_a_separator_on_the_same_line_is_kept(tmp_path):
    (tmp_path / "train.txt").write_text(f"Story A.\n{SEPARATOR}Story B.\n{SEPARATOR}\n")
    assert [s.strip() for s in data.read_stories(tmp_path / "train.txt")] == ["Story A.", "Story B."]


def test_one_train_story_in_four_is_kept_for_fine_tuning_with_or_without_a_valid_file():
    keys = [data.fingerprint(f"Story number {i}.") for i in range(20_000)]
    for has_valid in (True, False):
        splits = [data.split_of("train", key, has_valid) for key in keys]
        kept = [split for split in splits if split != "valid"]
        assert 0.235 < kept.count("tune") / len(kept) < 0.265


def test_a_heldout_file_with_an_instruction_missing_is_refused(tmp_path):
    heldout = json.loads(data.HELDOUT.read_text())
    heldout["instructions"].pop()
    (tmp_path / "heldout.json").write_text(json.dumps(heldout))
    with pytest.raises(SystemExit, match="is not version 1"):
        data.read_heldout(tmp_path / "heldout.json")


# ---------------------------------------------------------------- what makes a step run again


def test_a_new_held_out_story_leaves_train_when_the_data_is_prepared_again(corpus, prepared):
    # A held-out set that now holds a train story (a new heldout.json): the stories are split again.
    askable = set(json.loads((prepared / "words.json").read_text())["askable"])
    story = next(s for s in read(prepared / "train.txt") if data.ask(s, askable))
    heldout = data.read_heldout(prepared / "heldout.json")
    data.write_heldout(prepared / "heldout.json", [data.ask(story, askable), *heldout[1:]])
    prepare(corpus, prepared)
    assert story not in read(prepared / "train.txt") + read(prepared / "tune.txt")


def test_a_deleted_words_file_is_made_again(corpus, prepared):
    # words.json gone, the instructions step runs again and writes the same file.
    made = (prepared / "words.json").read_bytes()
    (prepared / "words.json").unlink()
    prepare(corpus, prepared)
    assert (prepared / "words.json").read_bytes() == made


def test_an_input_edited_to_its_own_size_or_an_output_damaged_in_place_runs_its_step_again(corpus, prepared, capsys):
    # The same number of bytes: the manifest tells them apart by the input's time, the output's hash.
    source = corpus / "stories-valid.txt"
    source.write_text(source.read_text().replace("Once upon", "Once apon", 1))
    capsys.readouterr()
    prepare(corpus, prepared)
    assert "stories: up to date" not in capsys.readouterr().out
    assert "Once apon" in (prepared / "valid.txt").read_text()
    tokens = bytearray((prepared / "train.bin").read_bytes())
    tokens[10] ^= 1
    (prepared / "train.bin").write_bytes(bytes(tokens))
    prepare(corpus, prepared)
    out = capsys.readouterr().out
    assert "tokens: up to date" not in out and (prepared / "train.bin").read_bytes() != bytes(tokens)


def test_a_new_tokenizer_makes_the_token_files_again(corpus, prepared):
    # Prepared with 400 tokens: a tokenizer of 300 makes train.bin again, every id under 300.
    data.prepare(data.local_files(corpus), prepared, vocab_size=300, heldout=prepared / "heldout.json")
    assert int(np.fromfile(prepared / "train.bin", dtype=np.uint16).max()) < 300
