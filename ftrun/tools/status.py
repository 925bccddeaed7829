"""``ftrun status [--log_dir DIR] [--watch]``: a job as its console shows it, from another terminal.

It reads what the job keeps in its log directory, never the job's sockets:

- ``status.json``: the coordinator's snapshot (every rank's row, the job's state), replaced
  atomically at most four times a second and once more, final, when the job ends;
- ``events.jsonl`` and ``progress.jsonl``: faults, goodput and the step rate (:mod:`ftrun.tools.report`).

A status file that says "running" while its supervisor process is gone (SIGKILL, a crashed host) is
reported as "ended without a final status (killed?)". That check needs the supervisor's host: from
another machine (a shared file system) the liveness is not checked, and the line says so.

Exit codes: 0 when the job is running or succeeded; when it failed, its exit code (1 if it has none);
1 when it ended without a final status; 2 when there is no job to read (one line ``ftrun: error:
...``); 130 when ``--watch`` is interrupted.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ftrun.tools.report import (
    EVENTS_FILE, PROGRESS_FILE, STATUS_FILE, JobTimeline, ReportError, Sample, build_timeline, read_events,
    read_progress, read_status, sample_from_status, split_runs,
)

#: Seconds between two reads with ``--watch``.
WATCH_PERIOD_S = 1.0


@dataclass(frozen=True)
class Verdict:
    """What the status file says about the job, checked against the supervisor's process.

    Attributes:
        state: ``running``, ``succeeded``, ``failed`` or ``vanished`` (running, supervisor gone).
        code: the exit code of ``ftrun status``.
        line: one line saying so (and why, when the job failed).
    """

    state: str
    code: int
    line: str

    @property
    def finished(self) -> bool:
        return self.state != "running"


@dataclass
class JobSnapshot:
    """One read of a log directory: the status, the run's timeline and samples, the verdict."""

    log_dir: Path
    status: dict[str, Any]
    timeline: JobTimeline
    samples: list[Sample]
    verdict: Verdict
    problems: int
    now: float


def resolve_log_dir(given: str | None, environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> Path:
    """The log directory to read: ``--log_dir``, else ``FTRUN_LOG_DIR``, else ``log_dir`` in
    ``[tool.ftrun]`` of ``./pyproject.toml``, else ``ftrun_logs`` (as ``ftrun`` itself resolves it).

    Raises:
        ReportError: the directory does not exist.
        ftrun.config.ConfigError: a pyproject.toml that ftrun cannot read.
    """
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    source = "--log_dir"
    text = given
    if not text:
        text, source = environ.get("FTRUN_LOG_DIR") or None, "FTRUN_LOG_DIR"
    if not text and (cwd / "pyproject.toml").is_file():
        from ftrun.config import read_toml

        text, source = read_toml(cwd / "pyproject.toml", section=("tool", "ftrun")).get("log_dir"), "log_dir in pyproject.toml"
    if not text:
        from ftrun.config import OPTIONS_BY_NAME

        text, source = OPTIONS_BY_NAME["log_dir"].default, "the default --log_dir"
    path = Path(text) if Path(text).is_absolute() else cwd / text
    if not path.is_dir():
        raise ReportError(f"no job in {text}: {source} {text} is not a directory (give the job's --log_dir)")
    return path


def supervisor_alive(pid: Any) -> bool:
    """Whether ``pid`` is a live ftrun supervisor on this host (a reused pid running something else
    is not)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return "ftrun.node.supervisor" in " ".join(proc.cmdline())
    except psutil.AccessDenied:
        return True  # it exists; another user's supervisor
    except psutil.Error:
        return False


def judge(status: dict[str, Any], alive: Callable[[Any], bool] = supervisor_alive,
          host: str | None = None) -> Verdict:
    """The :class:`Verdict` of a status object.

    Args:
        status: status.json's object.
        alive: tells whether a supervisor pid is alive here.
        host: this host's name (default: ``socket.gethostname()``); compared with the status's
            ``host`` when the coordinator writes one.
    """
    state = status.get("state")
    code = status.get("exit_code")
    message = str(status.get("message") or "")
    if state == "succeeded":
        return Verdict("succeeded", 0, "succeeded" + (f": {message}" if message and message != "job succeeded" else ""))
    if state == "failed":
        exit_code = code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256 else 1
        return Verdict("failed", exit_code, f"failed with exit code {code}: {message or 'no reason recorded'}")
    pid = status.get("pid")
    their_host = status.get("host")
    if their_host is not None:
        import socket

        if their_host != (host or socket.gethostname()):
            return Verdict("running", 0, f"running on {their_host} (supervisor pid {pid}; its liveness cannot be "
                                         "checked from this host)")
    if alive(pid):
        return Verdict("running", 0, f"running (supervisor pid {pid})")
    updated = status.get("updated")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(updated)) if isinstance(updated, (int, float)) else "?"
    return Verdict("vanished", 1, f"ended without a final status (killed?): its supervisor (pid {pid}) is gone; "
                                  f"last update {when}")


def read_snapshot(log_dir: Path, alive: Callable[[Any], bool] = supervisor_alive,
                  now: float | None = None) -> JobSnapshot:
    """Read a log directory once.

    Raises:
        ReportError: no status file, or one that is not ftrun's.
    """
    status = read_status(log_dir / STATUS_FILE)
    verdict = judge(status, alive)
    now = time.time() if now is None else now
    events: list[dict[str, Any]] = []
    problems: list[str] = []
    if (log_dir / EVENTS_FILE).exists():
        events, problems = read_events(log_dir / EVENTS_FILE)
    samples, sample_problems = read_progress(log_dir / PROGRESS_FILE)
    runs = split_runs(events)
    run = runs[-1] if runs else []
    if verdict.state == "running":
        samples = [*samples, sample_from_status(status, now=now)]
    timeline = build_timeline(run, samples, keep_samples=True)
    if verdict.state == "vanished" and timeline.ended_at is None:
        updated = status.get("updated")
        now = float(updated) if isinstance(updated, (int, float)) else now
    return JobSnapshot(log_dir, status, timeline, timeline.samples, verdict, len(problems) + len(sample_problems), now)


def _header(snap: JobSnapshot) -> str:
    s = snap.status
    parts = [f"{len(s.get('ranks') or [])} rank(s) on {s.get('nnodes', 1)} node(s)",
             f"attempt {s.get('attempt', 0)}, generation {s.get('generation', 0)}",
             f"restarts {s.get('restarts_used', 0)}/{s.get('max_restarts', '?')}"]
    phase = s.get("phase")
    if isinstance(phase, str) and phase not in ("running", "finished"):
        parts.append(phase[:20])  # recovering, gasping (a dying-gasp checkpoint), restarting, stopping
    elif s.get("recovering"):
        parts.append("recovering")
    ckpts = s.get("checkpoints") if isinstance(s.get("checkpoints"), dict) else {}
    if ckpts.get("failed"):
        parts.append(f"{ckpts['failed']} of {ckpts['failed'] + (ckpts.get('written') or 0)} checkpoints failed: "
                     f"{str(ckpts.get('last_error') or '?')[:160]}")
    if s.get("lost_nodes"):
        parts.append("lost node(s) " + ", ".join(str(k) for k in s["lost_nodes"]))
    moved = s.get("moved_ranks") if isinstance(s.get("moved_ranks"), dict) else {}
    if moved:  # an elastic job (--nnodes MIN:MAX) going on without some nodes
        parts.append(f"on {s.get('nodes_present', '?')} of {s.get('nnodes', '?')} nodes (ranks of node(s) "
                     + ", ".join(str(k) for k in moved) + " run on the others)")
    standby_nodes = s.get("standby_nodes")
    if isinstance(standby_nodes, list) and standby_nodes:
        parts.append(f"{len(standby_nodes)} standby node(s) (" + ", ".join(
            f"{row.get('host', '?')}/{row.get('pid', '?')}" for row in standby_nodes if isinstance(row, dict)) + ")")
    seats = s.get("standby_coordinators")
    if isinstance(seats, list) and seats:
        parts.append("standby coordinator(s) on node(s) " + ", ".join(str(n) for n in seats if isinstance(n, int)))
    updated = s.get("updated")
    if isinstance(updated, (int, float)) and snap.verdict.state == "running":
        parts.append(f"updated {max(0.0, snap.now - updated):.1f} s ago")
    return "; ".join(parts)


def _title(snap: JobSnapshot) -> str:
    script = Path(snap.timeline.script).name if snap.timeline.script else "job"
    return f"{script} in {snap.log_dir}"


def plain_lines(snap: JobSnapshot) -> list[str]:
    """The snapshot as plain lines (the verdict first; the reason again last when it failed)."""
    lines = [f"ftrun job in {snap.log_dir}: {snap.verdict.line}", _header(snap)]
    from ftrun.node.console import job_lines

    lines.extend(job_lines(snap.status.get("ranks") or [], snap.timeline, snap.samples, snap.now))
    if snap.problems:
        lines.append(f"({snap.problems} unreadable line(s) in the job's record; `ftrun report {snap.log_dir}` lists them)")
    if snap.verdict.state in ("failed", "vanished"):
        lines.append(f"why: {snap.verdict.line}")
    return lines


def rich_view(snap: JobSnapshot) -> Any:
    """The snapshot as the console's rich view, with the verdict above it."""
    from rich.text import Text

    from ftrun.node.console import job_view

    style = {"running": "bold green", "succeeded": "bold green"}.get(snap.verdict.state, "bold red")
    header = [Text(f"ftrun job in {snap.log_dir}: {snap.verdict.line}", style=style), Text(_header(snap), style="dim")]
    return job_view(_title(snap), snap.status.get("ranks") or [], snap.timeline, snap.samples, snap.now, header)


def show(log_dir: Path, watch: bool = False, plain: bool | None = None, period: float = WATCH_PERIOD_S,
         stream: Any = None) -> int:
    """Print the job once, or until it ends with ``watch``; return ``ftrun status``'s exit code.

    Args:
        log_dir: the job's log directory.
        watch: keep reading every ``period`` seconds until the job is no longer running.
        plain: plain lines (default: unless ``stream`` is a terminal).
        stream: where to write (default: stdout).

    Raises:
        ReportError: there is no job status to read (before anything is printed).
    """
    stream = stream or sys.stdout
    plain = (not stream.isatty()) if plain is None else plain
    snap = read_snapshot(log_dir)
    if not watch:
        if plain:
            stream.write("\n".join(plain_lines(snap)) + "\n")
        else:
            from rich.console import Console

            Console(file=stream).print(rich_view(snap))
        return snap.verdict.code
    try:
        if plain:
            last_update: Any = object()
            while True:
                if snap.status.get("updated") != last_update or snap.verdict.finished:
                    last_update = snap.status.get("updated")
                    stream.write(f"----- {time.strftime('%H:%M:%S')}\n" + "\n".join(plain_lines(snap)) + "\n")
                    stream.flush()
                if snap.verdict.finished:
                    return snap.verdict.code
                time.sleep(period)
                snap = _reread(log_dir, snap)
        from rich.console import Console
        from rich.live import Live

        with Live(rich_view(snap), console=Console(file=stream), refresh_per_second=4) as live:
            while not snap.verdict.finished:
                time.sleep(period)
                snap = _reread(log_dir, snap)
                live.update(rich_view(snap))
        return snap.verdict.code
    except KeyboardInterrupt:
        return 130


def _reread(log_dir: Path, previous: JobSnapshot) -> JobSnapshot:
    """Read again; a status file that vanished meanwhile (its directory removed) keeps the last view."""
    try:
        return read_snapshot(log_dir)
    except ReportError:
        return previous
