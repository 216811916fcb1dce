"""steps.tsv names commits that exist, once each, and `python tags.py` makes from it, in a
fresh clone, tags whose scripts compile."""
import io
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

import tags

needs_git = pytest.mark.skipif(not shutil.which("git"), reason="no git on this machine")


def missing_history():
    """Why this copy has not the whole history the tags are made from, or None if it has."""
    if not (tags.ROOT / ".git").exists() or not shutil.which("git"):
        return "no .git here (a tarball?) or no git: the tags come from the history"
    shallow = subprocess.run(["git", "-C", str(tags.ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()
    if shallow != "false":
        return "a shallow clone: the tags need the whole history (git fetch --unshallow brings it)"
    return None


MISSING_HISTORY = missing_history()
needs_history = pytest.mark.skipif(MISSING_HISTORY is not None, reason=str(MISSING_HISTORY))


def git(folder, *args):
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True).stdout


def tags_py(clone, *args):
    return subprocess.run([sys.executable, "tags.py", *args], cwd=clone, capture_output=True, text=True)


@pytest.fixture
def clone(tmp_path):
    """A fresh clone of this repository, with this working tree's tags.py and steps.tsv."""
    folder = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(tags.ROOT), str(folder)], check=True)
    for name in ("tags.py", "steps.tsv"):
        shutil.copy(tags.ROOT / name, folder / name)
    return folder


@needs_history
def test_every_step_names_exactly_one_commit():
    rows = tags.read_steps()
    commits, errors = tags.find_commits(rows)
    assert not errors
    assert len(commits) == len(rows)


@needs_history
def test_a_clone_gets_every_tag_on_its_commit_and_the_scripts_there_compile(clone):
    made = tags_py(clone)
    assert made.returncode == 0, made.stderr
    assert tags_py(clone).stdout == made.stdout  # a second run makes the same tags
    assert tags_py(clone, "--check").returncode == 0
    for tag, subject in tags.read_steps():
        assert git(clone, "log", "-1", "--format=%s", tag).strip() == subject
        archive = subprocess.run(["git", "-C", str(clone), "archive", tag], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as files:
            scripts = [m for m in files.getmembers() if m.name.endswith(".py")]
            assert scripts, tag
            for script in scripts:
                compile(files.extractfile(script).read(), f"{tag}:{script.name}", "exec")


@needs_history
def test_a_row_without_its_commit_stops_with_one_line_and_tags_nothing(clone):
    with open(clone / "steps.tsv", "a", encoding="utf-8") as f:
        f.write("ep99-1-nothing\tEpisode 99, step 1: never committed\n")
    checked = tags_py(clone, "--check")
    assert checked.returncode != 0
    assert checked.stderr == "tags.py: ep99-1-nothing: no commit on this branch with the subject " \
                             "'Episode 99, step 1: never committed'\n"
    assert tags_py(clone).returncode != 0
    assert "ep99-1-nothing" not in git(clone, "tag", "--list")


@needs_git
@pytest.mark.skipif(not (tags.ROOT / ".git").exists(), reason="no .git here to clone")
def test_a_shallow_clone_is_told_it_needs_the_whole_history(tmp_path):
    folder = tmp_path / "shallow"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{tags.ROOT}", str(folder)], check=True)
    for name in ("tags.py", "steps.tsv"):  # this working tree's, as in the fresh clone above
        shutil.copy(tags.ROOT / name, folder / name)
    made = tags_py(folder)
    assert made.returncode != 0 and "shallow" in made.stderr and "git fetch --unshallow" in made.stderr
    assert len(made.stderr.splitlines()) == 1 and git(folder, "tag", "--list") == ""


@needs_git
def test_a_subject_on_two_commits_is_refused(tmp_path, monkeypatch):
    git(tmp_path, "init", "--quiet")
    for message in ("Episode 1, step 1: twice", "Episode 1, step 1: twice", "Episode 2: once"):
        git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
            "commit", "--quiet", "--allow-empty", "-m", message)
    monkeypatch.setattr(tags, "ROOT", tmp_path)
    commits, errors = tags.find_commits([("ep1-1-twice", "Episode 1, step 1: twice"), ("ep2-1-once", "Episode 2: once"),
                                         ("bad..name", "Episode 2: once")])
    assert list(commits) == ["ep2-1-once"]
    assert errors == ["ep1-1-twice: 2 commits on this branch with the subject 'Episode 1, step 1: twice'",
                      "bad..name: not a name git takes for a tag"]


@pytest.mark.parametrize("text, error", [
    ("tag\tcommit subject\nep1-1-stories Episode 1, step 1: no tab\n",
     "steps.tsv, line 2: expected a tag, a tab and a commit subject"),
    ("tag\tcommit subject\nep1-1-a\tEpisode 1, step 1: a\nep1-1-a\tEpisode 1, step 2: b\n",
     "steps.tsv, line 3: ep1-1-a is already on an earlier line"),
    ("ep1-1-a\tEpisode 1, step 1: a\n", "steps.tsv, line 1: expected the header: tag, a tab, commit subject"),
    ("tag\tcommit subject\nep1-1-a\t\n", "steps.tsv, line 2: expected a tag, a tab and a commit subject"),
    ("", "steps.tsv, line 1: expected the header: tag, a tab, commit subject"),  # emptied, not a traceback
])
def test_a_table_out_of_shape_is_refused_in_one_line(tmp_path, text, error):
    table = tmp_path / "steps.tsv"
    table.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit, match=f"^{error}$"):
        tags.read_steps(table)


def test_a_table_that_cannot_be_read_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^steps.tsv can't be read \(FileNotFoundError\): git restore steps.tsv$"):
        tags.read_steps(tmp_path / "steps.tsv")
    (tmp_path / "steps.tsv").write_bytes(b"tag\tcommit subject\n\xff\xfe\n")
    with pytest.raises(SystemExit, match=r"^steps.tsv can't be read \(UnicodeDecodeError\)"):
        tags.read_steps(tmp_path / "steps.tsv")


def commit(folder, message):
    git(folder, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false",
        "commit", "--quiet", "--allow-empty", "-m", message)


@needs_git
def test_a_commit_on_another_branch_is_not_found(tmp_path, monkeypatch):
    git(tmp_path, "init", "--quiet")
    commit(tmp_path, "Episode 1, step 1: here")
    git(tmp_path, "checkout", "--quiet", "-b", "other")
    commit(tmp_path, "Episode 1, step 2: elsewhere")
    git(tmp_path, "checkout", "--quiet", "-")
    monkeypatch.setattr(tags, "ROOT", tmp_path)
    commits, errors = tags.find_commits([("ep1-1-here", "Episode 1, step 1: here"),
                                         ("ep1-2-elsewhere", "Episode 1, step 2: elsewhere")])
    assert list(commits) == ["ep1-1-here"]
    assert errors == ["ep1-2-elsewhere: no commit on this branch with the subject 'Episode 1, step 2: elsewhere'"]


@needs_git
def test_a_row_in_doubt_leaves_no_tag_at_all(tmp_path):
    # A repository of two steps, the second's commit missing: tags.py makes neither tag.
    git(tmp_path, "init", "--quiet")
    shutil.copy(tags.ROOT / "tags.py", tmp_path / "tags.py")
    (tmp_path / "steps.tsv").write_text("tag\tcommit subject\nep1-1-a\tEpisode 1, step 1: a\n"
                                        "ep1-2-b\tEpisode 1, step 2: never committed\n", encoding="utf-8")
    commit(tmp_path, "Episode 1, step 1: a")
    made = subprocess.run([sys.executable, "tags.py"], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode != 0 and "ep1-2-b: no commit" in made.stderr
    assert git(tmp_path, "tag", "--list") == ""


def a_clone_of_one_step(folder, tag):
    """A repository in folder with tags.py, a steps.tsv of one row, tag, and that row's commit."""
    git(folder, "init", "--quiet")
    shutil.copy(tags.ROOT / "tags.py", folder / "tags.py")
    (folder / "steps.tsv").write_text(f"tag\tcommit subject\n{tag}\tEpisode 1, step 1: a\n", encoding="utf-8")
    commit(folder, "Episode 1, step 1: a")


@needs_git
def test_check_makes_no_tag_and_a_plain_run_makes_them(tmp_path, monkeypatch):
    # --check only looks: a learner who checks first still gets the tags from python tags.py, and
    # a --check alone leaves the clone's tags as they were.
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)  # no tag.gpgSign of the user's to ask for a message
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    a_clone_of_one_step(tmp_path, "ep1-1-a")
    checked = subprocess.run([sys.executable, "tags.py", "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert checked.returncode == 0 and "1 steps found" in checked.stdout
    assert git(tmp_path, "tag", "--list") == ""
    made = subprocess.run([sys.executable, "tags.py"], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode == 0 and "1 steps tagged" in made.stdout
    assert git(tmp_path, "tag", "--list") == "ep1-1-a\n"


@needs_git
def test_a_tag_git_refuses_to_make_stops_tags_py_in_one_line(tmp_path, monkeypatch):
    # The learner's own tag ep1 leaves no room for ep1/1-a (git keeps tags as paths): tags.py
    # must fail with git's reason in one line, not a traceback, and not print that every step is tagged.
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)  # no tag.gpgSign of the user's to ask for a message
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    a_clone_of_one_step(tmp_path, "ep1/1-a")
    git(tmp_path, "tag", "ep1")
    made = subprocess.run([sys.executable, "tags.py"], cwd=tmp_path, capture_output=True, text=True)
    assert made.returncode != 0 and "steps tagged" not in made.stdout
    assert made.stderr.startswith("tags.py: git tag failed: fatal: ") and made.stderr.count("\n") == 1  # one line
    assert git(tmp_path, "tag", "--list") == "ep1\n"


def test_a_machine_without_git_gets_one_line(tmp_path, monkeypatch):
    # A tarball's reader, or a fresh machine, may have no git: one line that says so, not a traceback.
    def no_git(command, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", command[0])

    monkeypatch.setattr(tags.subprocess, "run", no_git)
    with pytest.raises(SystemExit, match="^tags.py: git is not installed, or not on the PATH"):
        tags.git("log")

