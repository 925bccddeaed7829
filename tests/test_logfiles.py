"""The job's own output never ends the job: best-effort events, progress and status files on a full
or removed log directory (process-free; the tmpfs case runs in tests/test_hardening.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from coordinator_fixtures import close_coordinators  # noqa: F401  (closes the coordinators a test made)

from ftrun.coordinator.publish import STATUS_PERIOD_S, STATUS_SECONDS_PER_RANK, Publisher, write_status_file
from ftrun.common.events import AppendLog, EventKind
from ftrun.common.procs import LogFile
from ftrun.common.protocol import Sender
from ftrun.tools.report import ProgressRecorder


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_a_removed_log_directory_is_made_again_and_said_once(tmp_path: Path) -> None:
    said: list[str] = []
    log = AppendLog(tmp_path / "logs" / "events.jsonl", said.append)  # the directory itself is made
    assert log.write_line('{"n": 1}') and said == ["%s: its directory was removed: made it again (what was in it is "
                                                   "lost)" % (tmp_path / "logs" / "events.jsonl")]
    shutil.rmtree(tmp_path / "logs")
    assert log.write_line('{"n": 2}') and log.write_line('{"n": 3}')
    assert lines(tmp_path / "logs" / "events.jsonl") == ['{"n": 2}', '{"n": 3}']
    assert said[1:] == said[:1]  # the directory again


def test_a_full_disk_drops_whole_lines_says_so_once_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said: list[str] = []
    path = tmp_path / "events.jsonl"
    log = AppendLog(path, said.append)
    assert log.write_line("first")
    real_write = os.write
    full = {"on": True}

    def write(fd: int, data: bytes) -> int:
        if not full["on"]:
            return real_write(fd, data)
        real_write(fd, data[:3])  # a short write: the disk took three bytes, then filled up
        return 3

    monkeypatch.setattr(os, "write", write)
    assert not log.write_line("second") and not log.write_line("third")
    assert lines(path) == ["first"], "half a line was left in the file"
    assert len(said) == 1 and "No space left on device" in said[0]
    full["on"] = False
    assert log.write_line("fourth") and lines(path) == ["first", "fourth"]
    assert "works again (2 line(s) were lost)" in said[1]

    def refuse(fd: int, data: bytes) -> int:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "write", refuse)
    assert not log.write_line("fifth") and "quota" in said[2].lower()


def test_the_publisher_says_the_trouble_on_the_console_and_status_failures_once(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, 0, Sender("t" * 64), None, clock=lambda: 0.0)
    pushed: list[str] = []
    pub._push = lambda event: pushed.append(f"{event.kind.value}: {event.message}")  # the console's side
    shutil.rmtree(tmp_path)
    pub.emit(EventKind.WARNING, "one", None, 0, 0)
    assert [json.loads(x)["message"] for x in lines(tmp_path / "events.jsonl")] == ["one"]
    assert pushed[0] == "warning: one" and "was removed: made it again" in pushed[1]
    assert write_status_file(tmp_path / "status.json", {"a": 1}) is None
    (tmp_path / ".status.json.tmp").mkdir()  # a write that fails (a directory in the way)
    for _ in range(3):
        pub.status(lambda: {"ranks": [], "attempt": 0, "generation": 0}, force=True)
    assert len([p for p in pushed if "cannot write" in p and "status.json" in p]) == 1


def test_the_progress_recorder_outlives_its_directory(tmp_path: Path) -> None:
    recorder = ProgressRecorder(tmp_path / "logs")
    shutil.rmtree(tmp_path / "logs")
    recorder.sample()  # no status.json: nothing to record, and no error
    recorder.close()  # no exception at the end of the job either


@pytest.mark.parametrize("moved_first", [False, True], ids=["removed", "moved_then_removed"])
def test_a_ranks_log_file_drops_output_on_a_full_disk_and_is_made_again_when_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved_first: bool) -> None:
    """A removed log is made again at the path it was opened at. The path does not come from the
    descriptor's name at that moment: after a rename of the directory, that name follows the moved
    directory, and the log would be made again under the moved name."""
    path = tmp_path / "logs" / "worker_0.log"
    path.parent.mkdir()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        raw = LogFile(fd)
        assert raw.write(b"one\n") == 4
        gone = tmp_path / "logs.moved" if moved_first else tmp_path / "logs"
        if moved_first:
            (tmp_path / "logs").rename(gone)
        shutil.rmtree(gone)
        assert raw.write(b"two\n") == 4  # made again at its path, under the same descriptor
        assert path.read_bytes() == b"two\n" and not (tmp_path / "logs.moved").exists()
        real_write = os.write

        def full(fd_: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", full)
        assert raw.write(b"three\n") == 6 and raw.dropped == 6  # no exception reaches the script's print
        monkeypatch.setattr(os, "write", real_write)
        assert raw.write(b"four\n") == 5 and path.read_bytes() == b"two\nfour\n"
    finally:
        os.close(fd)


GUARDED = """
import os, sys
from ftrun.common import procs
print("before", flush=True)
assert procs.guard_log_output() and not procs.guard_log_output()  # once only
os.unlink(sys.argv[1])
print("after the log was removed", flush=True)
print("to stderr", file=sys.stderr)
"""


def test_guarded_output_of_a_process_survives_its_log_file_removed(tmp_path: Path) -> None:
    log = tmp_path / "worker_0.log"
    with open(log, "ab") as fh:
        proc = subprocess.run([sys.executable, "-c", GUARDED, str(log)], stdout=fh, stderr=subprocess.STDOUT, timeout=60)
    assert proc.returncode == 0
    assert log.read_text() == "after the log was removed\nto stderr\n"


def test_status_snapshots_of_a_large_job_are_spaced_by_its_size(tmp_path: Path) -> None:
    """A snapshot has a row per rank: up to four a second in a job of up to 512 ranks, and in a
    larger one at most one every STATUS_SECONDS_PER_RANK per rank; none when nothing changed."""
    now = [100.0]
    pub = Publisher(tmp_path, 0, Sender("t" * 64), None, clock=lambda: now[0])
    made: list[int] = []

    def snapshot(ranks: int) -> Callable[[], dict]:
        def make() -> dict:
            made.append(ranks)
            return {"ranks": [{"rank": r} for r in range(ranks)], "attempt": 0, "generation": 0}
        return make

    pub.status(snapshot(8))
    now[0] += STATUS_PERIOD_S
    pub.status(snapshot(8))
    assert made == [8]  # nothing changed
    pub.dirty = True
    pub.status(snapshot(8))
    assert made == [8, 8] and json.loads((tmp_path / "status.json").read_text())["ranks"][7] == {"rank": 7}
    pub.dirty = True
    now[0] += STATUS_PERIOD_S
    pub.status(snapshot(8192))
    assert made == [8, 8, 8192]
    gap = 8192 * STATUS_SECONDS_PER_RANK
    for step in (STATUS_PERIOD_S, gap - 2 * STATUS_PERIOD_S):
        now[0] += step
        pub.dirty = True
        pub.status(snapshot(8192))
    assert made == [8, 8, 8192]
    now[0] += STATUS_PERIOD_S
    pub.status(snapshot(8192))
    assert made == [8, 8, 8192, 8192] and len(json.loads((tmp_path / "status.json").read_text())["ranks"]) == 8192
    pub.dirty = True
    pub.status(snapshot(8192), final={"exit_code": 0, "message": "done"})  # the end is written at once
    assert json.loads((tmp_path / "status.json").read_text())["state"] == "succeeded"



def test_a_large_jobs_status_waits_for_a_young_recovery_round(tmp_path: Path) -> None:
    """At 16,384 ranks a snapshot takes a tenth of a second or more, which every rank of a
    round would wait for: a job of more than 1,024 ranks makes none in a round's first
    ROUND_STATUS_HOLD_S, then goes on as before; a small job's round holds nothing."""
    from coordinator_fixtures import hello_all, make

    from ftrun.coordinator.core import ROUND_STATUS_HOLD_S

    for world, held in ((8, False), (2048, True)):
        coord, _agent, clock = make(tmp_path / str(world), world=world, local=8 if world > 8 else world)
        hello_all(coord)
        made: list[float] = []
        real = coord.status_snapshot
        coord.status_snapshot = lambda: made.append(clock.now) or real()  # type: ignore[method-assign]
        coord.rounds.start(set(), "a test's round", kind="comm_error")
        assert coord.rounds.current is not None
        clock.now += 60.0  # past any snapshot gap...
        coord.rounds.current.round_started = clock.now  # ...in a round that just began
        coord.publisher.dirty = True
        coord.publish_status()
        assert made == ([] if held else [clock.now]), world
        clock.now += ROUND_STATUS_HOLD_S
        coord.publish_status()
        assert len(made) == 1, world
