"""``ftrun report`` and the goodput it shares with the console, status and metrics: pure tests on
synthetic ``events.jsonl`` and ``progress.jsonl`` files (times are inputs, nothing runs), and the CLI's
handling of bad input. The report of a real faulted run is checked in test_metrics.py, on the same
2-rank job whose metrics are scraped (one torch job instead of two on a shared machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ftrun.cli import main
from ftrun.tools.report import (
    Repair, Sample, build_timeline, format_report, job_steps_done, load_report, plot_timeline,
    read_events, step_rate, stragglers,
)

T0 = 1_700_000_000.0


def ev(kind: str, t: float, rank: int | None = None, attempt: int = 0, message: str = "", **detail: Any) -> dict[str, Any]:
    """An event as the coordinator writes it, at T0 + t."""
    return {"time": T0 + t, "kind": kind, "message": message or kind.replace("_", " "), "rank": rank, "pid": None,
            "incarnation": None, "generation": 0, "attempt": attempt, "node": 0, "detail": detail}


def started(t: float = 0.0, ranks: int = 2) -> dict[str, Any]:
    return ev("job_started", t, message=f"job started: {ranks} rank(s), {ranks} on node 0",
              script="/x/train.py", args=["--steps", "100"])


def samples(start: float, end: float, first_step: int, rate: float, attempt: int = 0, ranks: int = 2,
            period: float = 1.0) -> list[Sample]:
    """Samples every ``period`` s from ``start`` to ``end`` (job-relative) of ranks stepping at ``rate``."""
    out, t = [], start
    while t <= end + 1e-9:
        step = first_step + int((t - start) * rate)
        out.append(Sample(T0 + t, attempt, (step,) * ranks))
        t += period
    return out


def write_log_dir(path: Path, events: list[dict[str, Any]], progress: list[Sample] = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if progress:
        (path / "progress.jsonl").write_text("".join(json.dumps(s.to_json()) + "\n" for s in progress))
    return path


# --------------------------------------------------------------------------- goodput


def test_arf_recovery_costs_from_the_death_to_the_recovery_end():
    events = [
        started(),
        ev("rank_failed", 50.0, rank=1, cause="killed by SIGKILL", exit_code=137, step=40, detection_seconds=0.5),
        ev("recovery_started", 50.0, failed=[1], fault="death", reason="ARF"),
        ev("recovery_finished", 53.0, failed=[1], resume_step=40, total_seconds=3.5, detection_seconds=0.5,
           respawn_seconds={"1": 2.5}, rebuild_seconds=0.3, transfer_seconds=0.1, bytes=2_000_000, rounds=1),
        ev("job_finished", 100.0, exit_code=0),
    ]
    tl = build_timeline(events, samples(10.0, 100.0, 0, 1.0))
    [fault] = tl.faults
    assert (fault.start, fault.end) == (T0 + 49.5, T0 + 53.0)
    assert (fault.kind, fault.ranks, fault.repair, fault.resume_step) == ("death", [1], Repair.ARF, 40)
    assert (fault.detection_s, fault.respawn_s, fault.rebuild_s, fault.transfer_s, fault.bytes) == (0.5, 2.5, 0.3, 0.1, 2_000_000)
    good = tl.goodput()
    assert good.wall == pytest.approx(100.0) and good.startup == pytest.approx(10.0) and good.lost == pytest.approx(3.5)
    assert good.ratio == pytest.approx((100.0 - 10.0 - 3.5) / 100.0)
    assert good.faults == 1


def test_whole_job_restart_counts_until_the_failed_step_is_reached_again():
    events = [
        started(),
        ev("rank_failed", 50.0, rank=0, cause="exit code 1", exit_code=1, step=40, detection_seconds=0.0),
        ev("recovery_started", 50.0, failed=[0], fault="death"),
        ev("recovery_fallback", 50.5, message="ARF cannot recover: no live replica"),
        ev("job_restarting", 51.0, reason="no live replica"),
        ev("rank_started", 55.0, rank=0, attempt=1),
        ev("rank_started", 55.0, rank=1, attempt=1),
        ev("resumed", 55.5, attempt=1, step=29),
        ev("job_finished", 100.0, attempt=1, exit_code=0),
    ]
    progress = samples(10.0, 50.0, 0, 1.0) + samples(60.0, 100.0, 30, 1.0, attempt=1)
    tl = build_timeline(events, progress)
    [fault] = tl.faults
    assert fault.repair == Repair.RESTART
    assert fault.end == T0 + 70.0  # step 40 begun again 10 s after the restart's first step (30)
    assert (fault.resume_step, fault.recomputed) == (30, 10)
    assert tl.goodput().ratio == pytest.approx((100.0 - 10.0 - 20.0) / 100.0)


def test_restart_of_a_script_without_steps_ends_when_every_rank_is_back():
    events = [started(), ev("rank_failed", 5.0, rank=1, step=None), ev("job_restarting", 5.5),
              ev("rank_started", 8.0, rank=0, attempt=1), ev("rank_started", 9.0, rank=1, attempt=1),
              ev("job_finished", 20.0, attempt=1, exit_code=0)]
    tl = build_timeline(events)
    assert tl.faults[0].end == T0 + 9.0 and tl.faults[0].repair == Repair.RESTART
    assert tl.goodput().ratio is None  # no step was ever reported: no goodput
    assert "n/a" in tl.goodput().describe()
    # the same, with the world size known only from the first attempt's rank_started events
    first = [ev("job_started", 0.0, message="job started"), ev("rank_started", 0.1, rank=0), ev("rank_started", 0.2, rank=1)]
    tl = build_timeline(first + events[1:])
    assert tl.world_size == 2 and tl.faults[0].end == T0 + 9.0


def test_in_place_repair_hang_and_failed_job():
    events = [
        started(),
        ev("recovery_started", 30.0, failed=[], fault="comm_error", reason="HCCE"),
        ev("recovery_finished", 31.0, failed=[], total_seconds=1.0, resume_step=20),
        ev("rank_hung", 40.0, rank=1, fault="no_progress"),
        ev("rank_failed", 40.1, rank=1, cause="no progress for 3 s; killed by ftrun", step=25, detection_seconds=3.1),
        ev("recovery_started", 40.1, failed=[1], fault="hang"),
        ev("recovery_finished", 42.0, failed=[1], total_seconds=5.0, resume_step=25),
        ev("rank_failed", 60.0, rank=0, cause="killed by SIGKILL", exit_code=137, step=30, detection_seconds=0.0),
        ev("checkpoint_saved", 60.5, step=29, bytes=1000, seconds=0.2, path="/c/step_29", reason="dying gasp"),
        ev("job_finished", 61.0, rank=0, exit_code=137, message="job failed: budget; root cause: rank 0 (killed by SIGKILL)",
           root_cause={"rank": 0, "cause": "killed by SIGKILL", "exit_code": 137}, log_tail=["Killed"]),
    ]
    tl = build_timeline(events, samples(5.0, 60.0, 0, 0.5))
    comm, hang, death = tl.faults
    assert (comm.kind, comm.repair, comm.ranks, comm.start) == ("comm_error", Repair.IN_PLACE, [], T0 + 30.0)
    assert (hang.kind, hang.repair, hang.start, hang.end) == ("hang", Repair.ARF, T0 + 37.0, T0 + 42.0)
    assert (death.repair, death.end) == (Repair.FAILED, T0 + 61.0)
    assert tl.exit_code == 137 and tl.root_cause["rank"] == 0
    assert [c.step for c in tl.checkpoints] == [29]
    good = tl.goodput()
    assert good.lost == pytest.approx(1.0 + 5.0 + 1.0) and good.startup == pytest.approx(5.0)


def test_fault_during_startup_is_not_counted_twice_and_open_fault_counts_to_now():
    events = [started(), ev("rank_failed", 2.0, rank=1, step=None), ev("recovery_started", 2.0, failed=[1]),
              ev("recovery_finished", 6.0, failed=[1], total_seconds=4.0)]
    tl = build_timeline(events, samples(8.0, 20.0, 0, 1.0))
    good = tl.goodput(now=T0 + 20.0)
    assert good.startup == pytest.approx(8.0) and good.lost == pytest.approx(0.0)
    assert good.ratio == pytest.approx(12.0 / 20.0)
    tl.add(ev("rank_failed", 21.0, rank=0, step=13))
    assert tl.goodput(now=T0 + 25.0).lost == pytest.approx(4.0)  # still recovering: lost until now
    assert tl.open_fault is not None and tl.open_fault.lost(T0 + 25.0) == pytest.approx(4.0)


def test_ranks_stopped_by_a_stop_request_are_not_faults():
    events = [started(), ev("stop_requested", 10.0), ev("rank_failed", 10.5, rank=0, cause="killed by SIGTERM"),
              ev("job_finished", 11.0, exit_code=143)]
    assert build_timeline(events).faults == []


# --------------------------------------------------------------------------- progress and stragglers


def test_steps_done_rate_and_stragglers():
    rows = [{"rank": 0, "state": "healthy", "step": 12, "last_step_seconds": 0.10},
            {"rank": 1, "state": "healthy", "step": 12, "last_step_seconds": 0.11},
            {"rank": 2, "state": "healthy", "step": 13, "last_step_seconds": 0.26},
            {"rank": 3, "state": "starting", "step": None, "last_step_seconds": 0.9}]
    assert job_steps_done(rows) == 12
    assert job_steps_done([{"rank": 0, "state": "succeeded", "step": 39}]) == 40
    slow = stragglers(rows)
    assert list(slow) == [2] and slow[2] == pytest.approx(0.26 / 0.105)  # over the median of the others
    # compute time (before the collective) wins over the step time when the coordinator reports it
    assert list(stragglers([{**r, "compute_seconds": 0.05} for r in rows[:2]] + [{**rows[2], "compute_seconds": 0.05}])) == []
    # no noise on tiny steps
    assert stragglers([{"rank": 0, "state": "healthy", "last_step_seconds": 0.001},
                       {"rank": 1, "state": "healthy", "last_step_seconds": 0.0025}]) == {}
    assert step_rate(samples(0.0, 10.0, 0, 2.0)) == pytest.approx(2.0)
    assert step_rate([]) is None


# --------------------------------------------------------------------------- reading files


def test_bad_lines_are_reported_line_by_line(tmp_path):
    good = json.dumps(started())
    text = good + "\n{not json\n[1, 2]\n" + json.dumps({"kind": "warning"}) + "\n"
    (tmp_path / "events.jsonl").write_bytes(text.encode() + b"\xff\n" + b'{"time": 1700000001.0, "kind": "rank_fai')
    events, problems = read_events(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events] == ["job_started"]
    assert problems == [
        "events.jsonl line 2: not JSON; skipped",
        "events.jsonl line 3: a JSON list, not an object; skipped",
        "events.jsonl line 4: no 'time'; skipped",
        "events.jsonl line 5: not UTF-8 text (byte 0xff at column 1); skipped",
        "events.jsonl line 6: truncated (the file ends mid-line); skipped",
    ]


def test_report_text_and_plot(tmp_path):
    events = [
        started(),
        ev("job_finished", 0.0),  # an earlier run in the same log directory
        started(100.0),
        ev("rank_failed", 150.0, rank=1, cause="killed by SIGKILL", step=40, detection_seconds=0.01),
        ev("recovery_started", 150.0, failed=[1], fault="death"),
        ev("recovery_finished", 152.0, failed=[1], total_seconds=2.01, detection_seconds=0.01,
           respawn_seconds={"1": 1.5}, rebuild_seconds=0.2, transfer_seconds=0.05, bytes=2_420_000, resume_step=40,
           message="recovered rank(s) [1] in 2.01 s"),
        ev("checkpoint_saved", 160.0, step=50, bytes=2_430_000, seconds=0.03, path="/c/step_50", reason="every 50 steps"),
        ev("job_finished", 200.0, exit_code=0, message="job succeeded"),
    ]
    log_dir = write_log_dir(tmp_path / "logs", events, samples(110.0, 200.0, 0, 1.0, ranks=3))
    report = load_report(log_dir)
    text = "\n".join(format_report(report))
    assert "the last of 2 runs" in text
    assert "/x/train.py --steps 100 on 2 rank(s)" in text and "succeeded" in text
    assert "goodput: 88.0% (start-up 10.0 s, 1 fault: 2.01 s lost)" in text
    assert "recovered rank(s) [1] in 2.01 s" in text
    fault_row = next(line for line in text.splitlines() if "death of rank 1" in line)
    assert fault_row.split()[:2] == ["1", "+49.99"]  # the death, 0.01 s before it was detected and "respawned" in fault_row and "2.42 MB" in fault_row
    assert "+60.00 s  50" in text and "every 50 steps" in text
    assert "root cause" not in text
    png = tmp_path / "timeline.png"
    plot_timeline(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- the command line


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
        raise SystemExit(0)
    out = capsys.readouterr()
    return exc.value.code or 0, out.out, out.err


def test_cli_report_of_a_corrupt_file_names_each_bad_line(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    lines = [json.dumps(started()), "garbage", json.dumps(ev("job_finished", 5.0, exit_code=0)), '{"time": 17000']
    (log_dir / "events.jsonl").write_text("\n".join(lines))
    proc = subprocess.run([sys.executable, "-m", "ftrun", "report", str(log_dir), "--plot", str(tmp_path / "t.png")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["ftrun: events.jsonl line 2: not JSON; skipped",
                                        "ftrun: events.jsonl line 4: truncated (the file ends mid-line); skipped"]
    assert "events.jsonl line 2: not JSON; skipped" in proc.stdout  # listed in the report too
    assert (tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("setup, argv_tail, expected", [
    ("none", [], "is not a directory"),
    ("empty_dir", [], "no events.jsonl in"),
    ("empty_file", [], "holds no readable event"),
    ("garbage", [], "holds no readable event (2 bad line(s))"),
    ("good", ["--plot", "out.txt"], "the plot is a PNG"),
    ("good", ["--plot", "no/such/dir/t.png"], "does not exist"),
])
def test_cli_report_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, argv_tail, expected):
    log_dir = tmp_path / "logs"
    if setup != "none":
        log_dir.mkdir()
    if setup == "empty_file":
        (log_dir / "events.jsonl").write_text("")
    elif setup == "garbage":
        (log_dir / "events.jsonl").write_text("x\ny\n")
    elif setup == "good":
        write_log_dir(log_dir, [started(), ev("job_finished", 1.0, exit_code=0)])
    tail = [str(tmp_path / a) if a.endswith((".txt", ".png")) else a for a in argv_tail]
    code, out, err = run_cli(["report", str(log_dir), *tail], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("ftrun: error: ") and expected in err, err


def test_a_script_named_report_still_runs(tmp_path, capsys):
    # only the exact first argument 'report' is the subcommand; './report' is a script (here a
    # missing one, which the launcher's own check refuses in its usual words)
    code, _, err = run_cli(["./report"], capsys)
    assert code == 2 and "report" in err and "ftrun: error:" in err and "events.jsonl" not in err
