"""
The tags that mark each step of each episode, made in your clone from steps.tsv.

Tags made on one machine never travel with the branch, so the steps are committed as a
table instead: one row per step, a tag and the exact subject of its commit, separated by a
tab. A new step is one more row.

    python tags.py          # tag each step's commit (run it again at any time: same tags)
    python tags.py --check  # only check that each row finds its commit, once
    git checkout ep1-1-stories
"""
import argparse
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent
STEPS = ROOT / "steps.tsv"
HEADER = "tag\tcommit subject"


def git(*args):
    """What a git command prints; a git that fails, or is not there, stops tags.py with one line."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise SystemExit("tags.py: git is not installed, or not on the PATH; install it, then run tags.py again")
    except subprocess.CalledProcessError as error:
        # git's reason is its "fatal:" or "error:" line; hints may follow it.
        said = [line for line in error.stderr.splitlines() if line.startswith(("fatal:", "error:"))]
        raise SystemExit(f"tags.py: git {args[0]} failed: {(said or [f'exit status {error.returncode}'])[0]}")


def read_steps(path=STEPS):
    """The rows of steps.tsv under its header: (tag, commit subject)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise SystemExit(f"{path.name} can't be read ({type(error).__name__}): git restore {path.name}")
    if lines[:1] != [HEADER]:
        raise SystemExit(f"{path.name}, line 1: expected the header: tag, a tab, commit subject")
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        tag, tab, subject = line.partition("\t")
        if not (tag and tab and subject):
            raise SystemExit(f"{path.name}, line {number}: expected a tag, a tab and a commit subject")
        if tag in {earlier for earlier, _ in rows}:
            raise SystemExit(f"{path.name}, line {number}: {tag} is already on an earlier line")
        rows.append((tag, subject))
    return rows


def commits_by_subject():
    """Every commit on the current branch, under its subject (a subject can have several)."""
    found = {}
    for line in git("log", "--format=%H %s").splitlines():
        commit, _, subject = line.partition(" ")
        found.setdefault(subject, []).append(commit)
    return found


def find_commits(rows):
    """Each row's commit, and a one-line error for each row that finds none or more than one."""
    found, commits, errors = commits_by_subject(), {}, []
    for tag, subject in rows:
        matches = found.get(subject, [])
        if subprocess.run(["git", "check-ref-format", f"refs/tags/{tag}"]).returncode:
            errors.append(f"{tag}: not a name git takes for a tag")
        elif len(matches) == 1:
            commits[tag] = matches[0]
        else:
            count = "no commit" if not matches else f"{len(matches)} commits"
            errors.append(f"{tag}: {count} on this branch with the subject {subject!r}")
    return commits, errors


def main():
    parser = argparse.ArgumentParser(description="Tag each step of each episode, from steps.tsv.")
    parser.add_argument("--check", action="store_true", help="check every row finds its commit; make no tags")
    args = parser.parse_args()
    if not (ROOT / ".git").exists():
        raise SystemExit("tags.py: this copy has no .git (a tarball?), so no history to tag; clone the repository")
    if git("rev-parse", "--is-shallow-repository").strip() == "true":
        raise SystemExit("tags.py: this clone is shallow (git clone --depth): the steps' commits may be missing "
                         "from it; run git fetch --unshallow, then tags.py again")

    rows = read_steps()
    commits, errors = find_commits(rows)
    # Any row in doubt stops the whole command before a tag is made, so no row's doubt leaves a
    # half-made set of tags (a tag git itself refuses stops it where it is, with git's reason).
    if errors:
        raise SystemExit("\n".join(f"tags.py: {error}" for error in errors))
    for tag, subject in rows:
        if not args.check:
            git("tag", "--force", tag, commits[tag])
        print(f"{tag:20} {commits[tag][:7]}  {subject}")
    print(f"{len(rows)} steps {'found' if args.check else 'tagged'}")


if __name__ == "__main__":
    main()
