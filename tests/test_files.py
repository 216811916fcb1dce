import errno
import gzip
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import files
from data import SEPARATOR
from files import check_writable


# ---------------------------------------------------------------- a folder that cannot be written


def test_a_folder_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
    check_writable(tmp_path / "checkpoints" / "pretrain", tmp_path / "runs")
    assert [p.name for p in (tmp_path / "checkpoints" / "pretrain").iterdir()] == []

    def full(fd):  # a full disk may refuse the bytes only when they are written out
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(SystemExit, match="no space left on the disk for .*checkpoints"):
        check_writable(tmp_path / "checkpoints" / "pretrain")


@pytest.mark.parametrize("a_file_at", ["checkpoints", "checkpoints/pretrain"])
def test_a_file_where_a_run_needs_a_folder_is_named_in_one_line(a_file_at, tmp_path):
    (tmp_path / a_file_at).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / a_file_at).write_text("a learner's notes, saved under the folder's name")
    with pytest.raises(SystemExit, match=f"^cannot write in .*checkpoints/pretrain: .*{a_file_at} is a file, not a "
                                         "folder; move it away"):
        check_writable(tmp_path / "runs" / "pretrain", tmp_path / "checkpoints" / "pretrain")
    assert (tmp_path / a_file_at).read_text() == "a learner's notes, saved under the folder's name"


def saves_left(folder, stale, running):
    """Two temporary files in folder: stale, an hour old, of a save that was killed; running, of a
    save still being written. Returns running's path."""
    an_hour_ago = time.time() - 3600
    (folder / stale).write_bytes(b"half a file, from a run killed an hour ago")
    os.utime(folder / stale, (an_hour_ago, an_hour_ago))
    (folder / running).write_bytes(b"a save that another run is writing now")
    return folder / running


def test_a_run_starting_in_a_folder_removes_what_any_killed_save_left_there(tmp_path):
    # A run killed while saving rollout-7.pt, resumed from rollout-0.pt: nothing saves rollout-7.pt again.
    running = saves_left(tmp_path, ".rollout-7.pt.99999.tmp", ".rollout-9.pt.88888.tmp")
    check_writable(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [running.name]


def test_each_process_saves_through_a_temporary_file_of_its_own(tmp_path, monkeypatch):
    # Two processes saving one file (two runs of a folder) would write into each other's bytes
    # through a temporary file of the same name: the process's id is in it.
    names = []
    for pid in (1234, 5678):
        monkeypatch.setattr(os, "getpid", lambda: pid)
        with files.atomic(tmp_path / "model.pt") as tmp:
            names.append(tmp.name)
            tmp.write_bytes(f"saved by {pid}".encode())
    assert names == [".model.pt.1234.tmp", ".model.pt.5678.tmp"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert (tmp_path / "model.pt").read_bytes() == b"saved by 5678"


# ---------------------------------------------------------------- download, against a local server

class Server:
    """Serves one file over HTTP on 127.0.0.1, honouring Range requests (unless honours_range is
    False: then always the whole file), and records them; with cut_after set, it closes the
    connection after that many bytes of a response."""

    def __init__(self, content):
        self.content, self.ranges, self.cut_after, self.honours_range = content, [], None, True
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                header = self.headers.get("Range")
                server.ranges.append(header)
                start, end = 0, len(server.content) - 1
                if header and server.honours_range:
                    first, _, last = header.removeprefix("bytes=").partition("-")
                    start, end = int(first), int(last) if last else end
                    if start >= len(server.content):
                        self.send_response(416)
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(server.content)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                self.wfile.write(server.content[start:end + 1][:server.cut_after])

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/TinyStories-train.txt"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    # Straight to 127.0.0.1, whatever proxy the machine names.
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    content = "".join(f"Story number {i} about a kite.\n{SEPARATOR}\n" for i in range(100_000)).encode()
    server = Server(content)
    yield server
    server.close()


def test_download_resumes_from_a_partial_file(server, tmp_path, capsys):
    path = tmp_path / "train.txt"
    partial = 1_234_567
    (tmp_path / "train.txt.part").write_bytes(server.content[:partial])
    files.fetch(server.url, path)
    assert server.ranges == [f"bytes={partial}-"]
    assert path.read_bytes() == server.content
    assert not (tmp_path / "train.txt.part").exists()
    assert "MB/s" in capsys.readouterr().out


def test_download_of_the_first_megabytes_keeps_whole_stories(server, tmp_path):
    path = tmp_path / "train.txt"
    files.fetch(server.url, path, limit=1_000_000, end=f"\n{SEPARATOR}\n".encode())
    assert server.ranges == ["bytes=0-999999"]
    text = path.read_text()
    assert 999_000 < len(text) <= 1_000_000
    assert text.endswith(f"{SEPARATOR}\n") and server.content.decode().startswith(text)


def test_complete_partial_file_is_not_downloaded_again(server, tmp_path):
    (tmp_path / "train.txt.part").write_bytes(server.content)
    files.fetch(server.url, tmp_path / "train.txt")
    assert server.ranges == [f"bytes={len(server.content)}-"]
    assert (tmp_path / "train.txt").read_bytes() == server.content


def test_a_download_the_server_cuts_short_waits_to_be_resumed(server, tmp_path):
    path = tmp_path / "train.txt"
    server.cut_after = 300_000
    with pytest.raises(SystemExit, match="stopped at 300,000 .*run again to resume"):
        files.fetch(server.url, path)
    assert not path.exists() and (tmp_path / "train.txt.part").stat().st_size == 300_000
    server.cut_after = None
    files.fetch(server.url, path)
    assert server.ranges[-1] == "bytes=300000-"
    assert path.read_bytes() == server.content


def test_a_full_disk_while_downloading_stops_in_one_line(server, tmp_path, monkeypatch):
    class FullDisk:
        def __init__(self, path, mode):
            self.path = path

        def __enter__(self):
            return self

        def __exit__(self, *args):
            return False

        def write(self, block):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(files, "open", FullDisk, raising=False)  # the download's .part, as it is written
    with pytest.raises(SystemExit, match="no space left on the disk for .*; free some space"):
        files.fetch(server.url, tmp_path / "train.txt")


def test_unreachable_server_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="--source"):
        files.fetch("http://127.0.0.1:9/TinyStories-train.txt", tmp_path / "train.txt")


def test_a_damaged_gz_file_stops_in_one_line_whatever_the_damage(tmp_path):
    text = "".join(f"Story {i} about a kite, a river and a brave dog.\n{SEPARATOR}\n" for i in range(3000))
    whole = gzip.compress(text.encode(), mtime=0)
    rng = random.Random(0)
    path = tmp_path / "train.txt.gz"
    for _ in range(40):  # 8 bytes overwritten in the compressed stream, somewhere
        damaged = bytearray(whole)
        at = rng.randrange(20, len(whole) - 20)
        damaged[at:at + 8] = bytes(rng.randrange(256) for _ in range(8))
        path.write_bytes(damaged)
        with pytest.raises(SystemExit, match="is damaged"), gzip.open(path, "rb") as file:
            for _ in files.read_lines(file, path):
                pass


def test_a_server_that_ignores_the_range_sends_the_whole_file_once(server, tmp_path):
    server.honours_range = False
    (tmp_path / "train.txt.part").write_bytes(server.content[:100_000])
    files.fetch(server.url, tmp_path / "train.txt")
    assert server.ranges == ["bytes=100000-"]  # asked for the rest, and given the whole file
    assert (tmp_path / "train.txt").read_bytes() == server.content


def test_a_download_of_the_first_megabytes_from_a_server_that_ignores_the_range_keeps_no_more(server, tmp_path):
    # The server sends the whole file a megabyte at a time: what came past the limit is cut off,
    # so data.py's --megabytes means the same on any server.
    server.honours_range = False
    path = tmp_path / "train.txt"
    files.fetch(server.url, path, limit=1_000_000, end=f"\n{SEPARATOR}\n".encode())
    text = path.read_text()
    assert 999_000 < len(text) <= 1_000_000
    assert text.endswith(f"{SEPARATOR}\n") and server.content.decode().startswith(text)


def test_a_file_the_save_cannot_read_keeps_its_own_error(tmp_path):
    # Only the disk or the folder refusing the temporary file is "cannot write in": an input the
    # block reads, and may not, raises its own error, which names that file.
    unreadable = tmp_path / "elsewhere" / "input.txt"
    with pytest.raises(PermissionError):
        with files.atomic(tmp_path / "out.txt") as tmp:
            tmp.write_bytes(b"half")
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(unreadable))
    assert [p.name for p in tmp_path.iterdir()] == []
    with pytest.raises(SystemExit, match="cannot write in"):  # the temporary file's own refusal: one line
        with files.atomic(tmp_path / "out.txt") as tmp:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp))


def test_a_save_removes_what_a_killed_save_of_the_same_file_left_beside_it(tmp_path):
    # data.py saves into data/ with no check_writable first: a killed run's .train.txt.PID.tmp
    # (up to gigabytes) goes with the next save of train.txt, while another run's save still writing stays.
    running = saves_left(tmp_path, ".train.txt.99999.tmp", ".train.txt.88888.tmp")
    with files.atomic(tmp_path / "train.txt") as tmp:
        tmp.write_bytes(b"the stories")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([running.name, "train.txt"])


def test_a_file_already_downloaded_is_not_downloaded_again(server, tmp_path):
    # data.py fetches at each run: a finished download (2 GB of train stories) is used as it is.
    path = tmp_path / "train.txt"
    files.fetch(server.url, path)
    assert files.fetch(server.url, path) == path
    assert server.ranges == [None]  # one request, the first run's
    assert path.read_bytes() == server.content


def test_a_byte_damaged_past_a_file_s_first_megabyte_changes_what_the_manifest_holds(tmp_path):
    # A token file is a gigabyte, read a megabyte at a time: damage anywhere in it, at its own
    # size, must make data.py's step run again, not only damage in its first megabyte.
    path = tmp_path / "train.bin"
    content = bytearray(3 << 20)
    path.write_bytes(content)
    before = files.outputs_of([path])
    content[(5 << 20) // 2] ^= 1
    path.write_bytes(content)
    after = files.outputs_of([path])
    assert after["train.bin"][0] == before["train.bin"][0] and after != before


def test_a_manifest_with_one_damaged_step_is_read_as_no_manifest(tmp_path):
    # Every step runs again, and every file is read as it is, rather than the damaged step
    # stopping data.py, or a script that checks a file against it, with a traceback.
    good = '{"inputs": {}, "outputs": {"train.bin": [10, "0123456789abcdef"]}}'
    (tmp_path / "manifest.json").write_text(f'{{"tokens": {good}, "instructions": {{"outputs": []}}}}')
    assert files.read_manifest(tmp_path) == {}
    (tmp_path / "instructions.jsonl").write_text("{}\n")
    files.check_made(tmp_path / "instructions.jsonl")  # nothing to check it against
