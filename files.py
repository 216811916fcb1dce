"""
The plumbing every script of the series leans on, which a learner can skip: files saved
whole or not at all, downloads that resume, steps that are not done twice, one data.py at a
time, and the data folder's files read back with a check. Each failure a learner can meet
here (a full disk, a dropped connection, a damaged file) stops the run with one line that
says what to do, not a traceback.

- atomic(): every file is written under a temporary name and renamed once whole, so an
  interrupted run never leaves half a file under the real name; check_writable() tries a
  folder before any training, and remove_stale() clears what killed saves left behind.
- fetch(): a download that waits in NAME.part and resumes with an HTTP Range request.
- run_step(): a step of data.py runs again only when its inputs changed or its outputs are
  no longer the files it made (data/manifest.json holds their sizes and hashes), and
  check_made() refuses a file that is not the size data.py made it.
- one_at_a_time(): the operating system's lock on the data folder while data.py prepares it.
- read_words() and read_instructions(): what data.py made, for the later episodes.

It imports none of the series' scripts, so that every one of them can import it.
"""
import errno
import hashlib
import http.client
import itertools
import json
import os
import time
import urllib.error
import urllib.request
import zlib
from contextlib import contextmanager
from pathlib import Path

DATA = Path("data")  # what data.py makes, and every later script reads
# Why a write fails in one line, not a traceback: the disk is full, read-only, or not ours to
# write, or a file stands where the path needs a folder.
UNWRITABLE = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST}
STARTED = time.time()  # a temporary file last written before this is no save of this run's


# ---------------------------------------------------------------- saving safely

@contextmanager
def atomic(path):
    """Yields a temporary path beside `path`; it becomes `path` only if the block finishes,
    so an interrupted run never leaves half a file under the real name. A full disk or a
    folder it may not write in stops the run with one line, the file there before intact."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(path.parent, f".{path.name}.*.tmp")
        yield temporary
        # On disk before the rename: after a power cut, the old file or the new, never an empty one.
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        if not refused(error, temporary):
            raise
        raise SystemExit(unwritable(path.parent, error)) from None
    finally:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:  # a read-only disk: its error here would hide the one above
            pass


def refused(error, temporary):
    """Whether the disk or the folder refused this write (a file the block reads keeps its own error)."""
    named = error.filename is None or Path(error.filename) in (temporary, *temporary.parents)
    return error.errno in UNWRITABLE and named


def unwritable(folder, error):
    if error.errno == errno.ENOSPC:
        return f"no space left on the disk for {folder}; free some space, then run the command again"
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        # os.path.isfile, not Path.is_file: a folder this process may not search raises no error of its own.
        in_the_way = next((path for path in (folder, *folder.parents) if os.path.isfile(path)), None)
        if in_the_way:
            return (f"cannot write in {folder}: {in_the_way} is a file, not a folder; move it away, then run the "
                    "command again")
    return f"cannot write in {folder} ({error.strerror}); make it writable, then run the command again"


def remove_stale(folder, pattern):
    """Removes the temporary files in folder, matching pattern, that saves killed before their
    rename left behind (a checkpoint's: 175 MB each): those last written before this process
    started, as a save still running keeps writing to its own."""
    for stale in Path(folder).glob(pattern):
        try:
            if stale.stat().st_mtime < STARTED:
                stale.unlink()
        except OSError:  # removed by another run meanwhile, or still open (Windows)
            pass


def check_writable(*folders):
    """Stops with one line, before any training, when a folder cannot be saved into, rather
    than when the first checkpoint is saved, after the training time is spent."""
    for folder in folders:
        probe = Path(folder) / ".writable"
        with atomic(probe) as tmp:
            tmp.write_bytes(b"\n")
        probe.unlink(missing_ok=True)
        # Any file's, too: a killed run's rollout-7.pt may never be saved again to clean its own.
        remove_stale(folder, ".*.tmp")


# ---------------------------------------------------------------- downloading

def fetch(url, path, limit=None, end=b"\n"):
    """Downloads url to path, or its first `limit` bytes, cut after the last `end` in them
    (data.py's: the end of a story). A partial download waits in path.part and is resumed
    with an HTTP Range request, so a dropped connection costs nothing but the restart."""
    if path.exists():
        return path
    part = path.with_name(path.name + ".part")
    path.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if limit is None or have < limit:
        have = receive(url, part, have, limit)
    with open(part, "r+b") as file:
        file.truncate(limit if limit is not None and have > limit else have)
    if limit is not None:
        cut_after_last(part, end)  # before the rename: the finished file holds whole stories only
    os.replace(part, path)
    return path


def receive(url, part, have, limit):
    """Appends what the server sends from byte `have` (up to `limit`) to part; returns its size."""
    last = "" if limit is None else str(limit - 1)
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-{last}"} if have or limit else {})
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as error:
        if error.code == 416:  # nothing left to send: the partial file is the whole file
            return have
        raise SystemExit(f"download of {url} failed: HTTP {error.code}; run again to resume, or use --source PATH")
    except (urllib.error.URLError, OSError) as error:
        raise SystemExit(f"cannot reach {url} ({error}); run again to resume, or use --source PATH")
    with response:
        if response.status != 206:  # the server ignored the range: start from the beginning
            have = 0
        size = response.headers.get("Content-Range", "").rpartition("/")[2]
        total = int(size) if size.isdigit() else have + int(response.headers.get("Content-Length") or 0)
        total = min(total, limit) if limit else total
        start, started = have, time.time()
        with open(part, "ab" if have else "wb") as file:
            while limit is None or have < limit:
                try:
                    block = response.read(1 << 20)
                except (OSError, http.client.HTTPException) as error:
                    raise SystemExit(f"\ndownload of {url} stopped at {have:,} bytes ({error}); run again to resume")
                if not block:
                    break
                try:
                    file.write(block)
                except OSError as error:
                    if error.errno in UNWRITABLE:  # the bytes so far stay in part, to resume from
                        raise SystemExit(unwritable(part.parent, error)) from None
                    raise
                have += len(block)
                speed = (have - start) / max(time.time() - started, 1e-9) / 1e6
                print(f"\r  {part.name[:-5]}: {have / 1e6:,.1f} of {total / 1e6:,.1f} MB, {speed:.1f} MB/s",
                      end="", flush=True)
        print()
    # A connection the server closes early ends the reading as the file's end would: the bytes
    # so far stay in part, for the next run to resume from, and are not taken for the whole file.
    if total and have < total:
        raise SystemExit(f"download of {url} stopped at {have:,} of {total:,} bytes; run again to resume")
    return have


def cut_after_last(path, end):
    """A download cut at N megabytes ends inside a story; keep only what comes up to the last `end`."""
    with open(path, "r+b") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(max(0, size - (1 << 20)))
        tail = file.read()
        last = tail.rfind(end)
        if last >= 0:
            file.truncate(size - len(tail) + last + len(end))


def read_lines(file, path):
    """The lines of a file; a damaged or cut-off .gz stops with one line."""
    try:
        yield from file
    except (OSError, EOFError, zlib.error) as error:  # gzip's reader raises all three, by the damage
        raise SystemExit(f"{path} is damaged ({error}); download or copy it again")


# ---------------------------------------------------------------- skipping what is done

def inputs_of(*paths, **settings):
    """What a step depends on: its input files (name, size, time) and its settings."""
    files = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths if Path(p).exists()]
    # Through JSON and back, so that it compares equal to what the manifest read from disk.
    return json.loads(json.dumps({"files": files, "settings": settings}))


def outputs_of(paths):
    """What a step made: each output's size and a hash of its bytes (None for one that is
    missing), so that a file cut short or damaged since then is made again."""
    return {Path(p).name: [Path(p).stat().st_size, file_hash(p)] if Path(p).exists() else None for p in paths}


def file_hash(path):
    """A hash of a file's bytes, read a megabyte at a time (a token file is a gigabyte)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def read_manifest(out):
    """What each step last ran on and made; nothing (so every step runs) if it is missing or damaged."""
    try:
        done = json.loads((Path(out) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return done if isinstance(done, dict) and all(map(step_well_formed, done.values())) else {}


def step_well_formed(step):
    """Whether a step of the manifest holds what run_step wrote: its outputs, each a size and a
    hash (or None)."""
    outputs = step.get("outputs", {}) if isinstance(step, dict) else None
    return isinstance(outputs, dict) and all(
        made is None or (isinstance(made, list) and len(made) == 2 and isinstance(made[0], int))
        for made in outputs.values())


def run_step(out, step, inputs, outputs, make):
    """Runs make() unless the manifest says this step already ran on the same inputs() and its
    outputs are still the files it made. The inputs are read again after the step, for a step
    may make one (heldout.json)."""
    done = read_manifest(out)
    last = done.get(step, {})
    if last.get("inputs") == inputs() and last.get("outputs") == outputs_of(outputs):
        print(f"{step}: up to date ({', '.join(Path(p).name for p in outputs)})")
        return
    started = time.time()
    print(f"{step}: {make()} ({time.time() - started:.1f} s)")
    done[step] = {"inputs": inputs(), "outputs": outputs_of(outputs)}
    with atomic(out / "manifest.json") as tmp:
        tmp.write_text(json.dumps(done, indent=1) + "\n")


def check_made(path):
    """Stops with one line when a file of the data folder is not the size data.py made it
    (cut short by a full disk, or a copy): read as it is, it would silently be less data."""
    path = Path(path)
    for step in read_manifest(path.parent).values():
        made = step.get("outputs", {}).get(path.name)
        if made and made[0] != path.stat().st_size:
            raise SystemExit(f"{path} is {path.stat().st_size:,} bytes where data.py made {made[0]:,}; "
                             "make it again with python data.py")


# ---------------------------------------------------------------- one data.py at a time

@contextmanager
def one_at_a_time(out):
    """Holds the data folder while this run prepares it: a second data.py on the same folder
    stops with one line, where both would write its files and the manifest of one could name
    the data of the other. The lock is the operating system's, so a killed run leaves none."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        file = open(out / ".lock", "a")
    except OSError as error:
        raise SystemExit(unwritable(out, error)) from None
    with file:
        try:
            lock(file)
        except OSError:
            raise SystemExit(f"another python data.py is preparing {out}; wait for it to end, "
                             "or give this one another --out") from None
        yield


def lock(file):
    """Locks an open file for this process, or raises OSError when another process holds it."""
    if os.name == "nt":
        import msvcrt
        msvcrt.locking(file.fileno(), msvcrt.LK_NBLCK, 1)
    else:
        import fcntl
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ---------------------------------------------------------------- what data.py made, read back

def require(path):
    """Stops with the command that makes it when a file of the data folder is missing."""
    if not Path(path).exists():
        raise SystemExit(f"no {path}: make it with python data.py --source PATH (or python data.py)")


def read_words(path=DATA / "words.json"):
    """The askable words and the nouns among them, as data.py counted them in the train stories
    once, so that no script counts them again at its start."""
    require(path)
    try:
        words = json.loads(Path(path).read_text())
        askable, nouns = words["askable"], words["nouns"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"{path} is damaged; make it again with python data.py") from None
    # Two lists of lowercase words, as the reward reads them (a string would be read letter by letter).
    if not all(isinstance(listed, list) and all(map(is_lowercase_word, listed)) for listed in (askable, nouns)):
        raise SystemExit(f"{path} is damaged (its words are not two lists of lowercase words); "
                         "make it again with python data.py")
    askable, nouns = set(askable), set(nouns)
    if not askable or not nouns <= askable:
        raise SystemExit(f"{path} is damaged (no askable words, or nouns that are not among them); "
                         "make it again with python data.py")
    return askable, nouns


def is_lowercase_word(word):
    return isinstance(word, str) and word.isascii() and word.isalpha() and word.islower()


def read_instructions(path=DATA / "instructions.jsonl", limit=None):
    """The training instructions, or the first `limit` of them, each a dict with words,
    instruction and story; read line by line, so that a limit reads no further than it needs."""
    require(path)
    check_made(path)  # not cut short since data.py made it
    with open(path, encoding="utf-8") as file:
        try:
            instructions = [json.loads(line) for line in itertools.islice(file, limit)]
        except ValueError as error:
            raise SystemExit(f"{path} is damaged ({error}); make it again with python data.py")
    if not instructions:
        raise SystemExit(f"{path} holds no instructions; prepare the data again with python data.py")
    if not all(map(well_formed, instructions)):
        raise SystemExit(f"{path} has a line without its words, instruction and story; make it again with python data.py")
    return instructions


def well_formed(instruction):
    """Whether a line of instructions.jsonl holds its words (a list of words: a string would be
    read letter by letter), its instruction and its story."""
    return (isinstance(instruction, dict) and isinstance(instruction.get("words"), list)
            and all(isinstance(word, str) for word in instruction["words"])
            and isinstance(instruction.get("instruction"), str) and isinstance(instruction.get("story"), str))
