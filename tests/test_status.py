"""``ftrun status``: against real jobs of the torch-free test worker (running, killed, failed), with no
job at all, and the view it shares with the live console (progress, goodput, faults, stragglers).

Jobs are synchronised on the files their ranks write and on ``status.json``'s content, polled with
generous deadlines; nothing sleeps and hopes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
from rich.console import Console

from conftest import WORKER
from ftrun.cli import main
from ftrun.node.console import PlainConsole, job_lines, job_view
from ftrun.tools.report import JobTimeline, Sample
from ftrun.tools.status import judge, read_snapshot, show

T0 = 1_700_000_000.0


def ftrun_status(log_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m ftrun status --log_dir LOG_DIR`` off a terminal (plain lines)."""
    return subprocess.run([sys.executable, "-m", "ftrun", "status", "--log_dir", str(log_dir), *extra],
                          capture_output=True, text=True, timeout=120)


def poll(predicate: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout} s")
        time.sleep(0.05)


def status_json(log_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((log_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None


def worker_args(tmp_path: Path, *extra: str) -> list[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return ["--worker_num", "2", "--master_port", "0", "--plain", "--log_dir", str(tmp_path / "logs"), *extra,
            WORKER, out]


# --------------------------------------------------------------------------- real jobs


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_status_of_a_running_job_then_of_its_killed_supervisor(ftrun_proc, tmp_path):
    log_dir = tmp_path / "logs"
    job = ftrun_proc([*worker_args(tmp_path, "--max_restarts", "0"), "--wait"])
    job.wait_for_files([tmp_path / "out" / f"ready_{rank}_0.json" for rank in range(2)])
    pids = {rank: json.loads((tmp_path / "out" / f"env_{rank}_0.json").read_text())["pid"] for rank in range(2)}
    # status.json carries both ranks' pids once the coordinator has published after their start
    poll(lambda: (s := status_json(log_dir)) and {r["rank"]: r["pid"] for r in s["ranks"]} == pids, "both pids in status.json")

    result = ftrun_status(log_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ftrun job in {log_dir}: running (supervisor pid ")
    for rank, pid in pids.items():
        assert any(line.startswith(f"rank {rank}: ") and f"pid {pid}" in line for line in lines), result.stdout

    # The supervisor is SIGKILLed: its status file still says "running", but nobody runs it.
    supervisor = next(c for c in psutil.Process(job.pid).children() if "ftrun.node.supervisor" in " ".join(c.cmdline()))
    supervisor.kill()
    job.wait(timeout=60)
    assert status_json(log_dir)["state"] == "running"
    result = ftrun_status(log_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ended without a final status (killed?)" in result.stdout.splitlines()[0]
    assert result.stdout.splitlines()[-1].startswith("why: ended without a final status")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_status_of_a_failed_job_says_why(ftrun_proc, tmp_path):
    log_dir = tmp_path / "logs"
    job = ftrun_proc([*worker_args(tmp_path, "--max_restarts", "0"), "--fail-rank", "1", "--fail-mode", "exit:3",
                      "--wait"])
    assert job.wait().returncode == 3
    result = ftrun_status(log_dir)
    assert result.returncode == 3, result.stdout + result.stderr
    first, last = result.stdout.splitlines()[0], result.stdout.splitlines()[-1]
    assert "failed with exit code 3" in first and "root cause: rank 1 (exit code 3)" in first
    assert last.startswith("why: failed with exit code 3")
    assert any(line.startswith("rank 1: failed") for line in result.stdout.splitlines())
    assert "Traceback" not in result.stderr
    # --watch of a finished job prints it once and ends with the same code
    assert show(log_dir, watch=True, plain=True, stream=io.StringIO()) == 3


# --------------------------------------------------------------------------- no job


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


@pytest.mark.parametrize("layout, expected", [
    ("missing", "is not a directory"),
    ("empty", "status.json does not exist"),
    ("garbage", "is not JSON; it is not a status file written by ftrun"),
    ("foreign", "is not a status file written by ftrun"),
])
def test_no_job_is_one_line_and_exit_2(tmp_path, capsys, layout, expected):
    log_dir = tmp_path / "logs"
    if layout != "missing":
        log_dir.mkdir()
    if layout == "garbage":
        (log_dir / "status.json").write_text("{")
    elif layout == "foreign":
        (log_dir / "status.json").write_text('{"hello": 1}')
    code, out, err = run_cli(["status", "--log_dir", str(log_dir)], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("ftrun: error: ") and expected in err, err


def test_log_dir_defaults_to_ftrun_log_dir_then_ftrun_logs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FTRUN_LOG_DIR", raising=False)
    code, _, err = run_cli(["status"], capsys)
    assert code == 2 and "the default --log_dir ftrun_logs is not a directory" in err
    monkeypatch.setenv("FTRUN_LOG_DIR", str(tmp_path / "elsewhere"))
    code, _, err = run_cli(["status"], capsys)
    assert code == 2 and f"FTRUN_LOG_DIR {tmp_path / 'elsewhere'}" in err


# --------------------------------------------------------------------------- verdicts and the shared view


def test_verdicts():
    running = {"state": "running", "pid": 4242, "ranks": []}
    assert judge(running, alive=lambda pid: True).code == 0
    vanished = judge({**running, "updated": T0}, alive=lambda pid: False)
    assert vanished.state == "vanished" and vanished.code == 1 and "pid 4242" in vanished.line
    elsewhere = judge({**running, "host": "node-a"}, alive=lambda pid: False, host="node-b")
    assert elsewhere.code == 0 and "cannot be checked from this host" in elsewhere.line
    assert judge({"state": "succeeded", "exit_code": 0, "ranks": []}).code == 0
    assert judge({"state": "failed", "exit_code": 137, "message": "job failed: x", "ranks": []}).code == 137
    assert judge({"state": "failed", "exit_code": None, "ranks": []}).code == 1


def rows_and_timeline() -> tuple[list[dict[str, Any]], JobTimeline, list[Sample]]:
    rows = [{"rank": r, "pid": 100 + r, "state": "healthy", "step": 12, "total_steps": 40, "metrics": {"loss": 0.5},
             "restarts": int(r == 1), "uptime": 30.0, "last_step_seconds": 0.25 if r == 2 else 0.1, "exit": None}
            for r in range(3)]
    tl = JobTimeline()
    tl.add({"time": T0, "kind": "job_started", "message": "job started: 3 rank(s)", "detail": {}})
    tl.add({"time": T0 + 6.0, "kind": "rank_failed", "rank": 1, "detail": {"cause": "killed by SIGKILL", "step": 5}})
    tl.add({"time": T0 + 6.0, "kind": "recovery_started", "detail": {"failed": [1], "fault": "death"}})
    tl.add({"time": T0 + 8.0, "kind": "recovery_finished",
            "detail": {"total_seconds": 2.0, "detection_seconds": 0.001, "respawn_seconds": {"1": 1.5},
                       "rebuild_seconds": 0.2, "transfer_seconds": 0.02, "resume_step": 5}})
    samples = [Sample(T0 + t, 0, (s, s, s)) for t, s in ((2.0, 0), (6.0, 4), (8.0, 5), (12.0, 12))]
    for s in samples:
        tl.add_sample(s)
    return rows, tl, samples


def test_the_view_shows_progress_goodput_faults_and_stragglers():
    rows, tl, samples = rows_and_timeline()
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(job_view("train.py", rows, tl, samples, T0 + 12.0))
    text = console.export_text()
    assert "12/40" in text and "ETA" in text and "steps/s" in text
    assert "goodput 66.7% (start-up 2.00 s, 1 fault: 2.00 s lost)" in text
    assert "fault 1: death of rank 1, respawned: 2.00 s lost (detection 0.001 s, respawn 1.50 s" in text
    assert "slow x2.5" in text
    lines = job_lines(rows, tl, samples, T0 + 12.0)
    assert lines[0].startswith("progress: 12 steps of 40 (30%), ")
    assert any("rank 2: healthy" in line and "straggler" in line for line in lines)


def test_plain_console_ends_with_goodput():
    stream = io.StringIO()
    console = PlainConsole(stream)
    rows, tl, _ = rows_and_timeline()
    console.event({"time": T0, "kind": "job_started", "message": "job started: 3 rank(s)", "detail": {}})
    console.status(rows)
    console.event({"time": time.time(), "kind": "job_finished", "message": "job succeeded", "detail": {"exit_code": 0}})
    console.finish(0, {"message": "job succeeded", "detail": {}})
    out = stream.getvalue().splitlines()
    assert "ftrun: goodput " in out[-2] and out[-1].endswith("ftrun: exit code 0: job succeeded")


def test_read_snapshot_of_a_running_job_samples_the_status(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    rows, _, _ = rows_and_timeline()
    (log_dir / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid(), "ranks": rows,
                                                     "attempt": 0, "updated": T0 + 12.0}))
    (log_dir / "events.jsonl").write_text(json.dumps({"time": T0, "kind": "job_started", "message": "m", "detail": {}}) + "\n")
    snap = read_snapshot(log_dir, alive=lambda pid: True, now=T0 + 12.0)
    assert snap.verdict.state == "running" and snap.timeline.first_step_at == T0 + 12.0
    assert snap.timeline.goodput(T0 + 12.0).ratio == 0.0


@pytest.mark.parametrize("phase, shown", [("gasping", "gasping"), ("recovering", "recovering"), ("running", None)])
def test_the_header_names_the_jobs_phase(tmp_path, phase, shown):
    from ftrun.tools.status import _header

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    rows, _, _ = rows_and_timeline()
    (log_dir / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid(), "ranks": rows, "attempt": 1,
                                                     "phase": phase, "updated": T0 + 12.0}))
    (log_dir / "events.jsonl").write_text(json.dumps({"time": T0, "kind": "job_started", "message": "m", "detail": {}}) + "\n")
    parts = _header(read_snapshot(log_dir, alive=lambda pid: True, now=T0 + 12.0)).split("; ")
    assert (shown in parts) if shown else not {"gasping", "recovering", "restarting", "stopping"} & set(parts)


def test_the_header_lists_the_standby_nodes(tmp_path):
    from ftrun.tools.status import _header

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    rows, _, _ = rows_and_timeline()
    (log_dir / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid(), "ranks": rows, "attempt": 0,
                                                     "nnodes": 2, "updated": T0 + 12.0,
                                                     "standby_nodes": [{"host": "spare-a", "pid": 41}, {"host": "spare-b", "pid": 42}]}))
    (log_dir / "events.jsonl").write_text(json.dumps({"time": T0, "kind": "job_started", "message": "m", "detail": {}}) + "\n")
    parts = _header(read_snapshot(log_dir, alive=lambda pid: True, now=T0 + 12.0)).split("; ")
    assert "2 standby node(s) (spare-a/41, spare-b/42)" in parts
