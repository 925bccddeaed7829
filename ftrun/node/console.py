"""What the launcher shows: a live rich view on a terminal, plain timestamped lines elsewhere.

Both consoles take the same calls from the launcher: ``event`` (one event dict, as in events.jsonl),
``status`` (a snapshot of every rank), ``output`` (a line a tailed rank printed) and ``finish``.

The rich view is the job's progress (steps done of the total when the ranks' ``ft.steps(n)`` says
it, steps per second, time left), its goodput so far and the time each fault cost, a table of every
rank (pid, state, step, step time with stragglers marked, metrics, restarts, uptime) and the latest
events. ``ftrun status`` draws the same view from the job's files (:func:`job_view`,
:func:`job_lines`). Goodput, progress and stragglers are computed by :mod:`ftrun.tools.report`.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any, Protocol, Sequence

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from ftrun.tools.report import (
    Fault, JobTimeline, Sample, job_steps_done, job_total_steps, sample_from_status, step_rate, stragglers,
)

_STATE_STYLE = {
    "starting": "yellow",
    "healthy": "green",
    "recovering": "magenta",
    "succeeded": "bold green",
    "failed": "bold red",
    "stopped": "dim",
}
_EVENT_STYLE = {
    "rank_failed": "bold red",
    "job_finished": "bold",
    "recovery_started": "magenta",
    "recovery_finished": "bold magenta",
    "recovery_fallback": "red",
    "job_restarting": "yellow",
    "warning": "yellow",
    "divergence": "bold red",
    "message_rejected": "red",
}
#: Seconds of samples kept for the step rate.
RATE_WINDOW_S = 30.0


class JobConsole(Protocol):
    def event(self, event: dict[str, Any]) -> None: ...
    def status(self, ranks: list[dict[str, Any]]) -> None: ...
    def output(self, rank: int, line: str) -> None: ...
    def finish(self, exit_code: int, last: dict[str, Any] | None) -> None: ...


def _fmt_metrics(metrics: dict[str, Any] | None) -> str:
    if not metrics:
        return ""
    parts = []
    for key, value in metrics.items():
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(parts)


def _fmt_uptime(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _fmt_step_time(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _fmt_seconds(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 600:
        return f"{seconds:.1f} s"
    return _fmt_uptime(seconds)


def _summary_lines(exit_code: int, last: dict[str, Any] | None, checkpoints: dict[str, Any] | None = None) -> list[str]:
    lines = [f"exit code {exit_code}" + (f": {last['message']}" if last else "")]
    if checkpoints:  # the job's last periodic-checkpoint failure (its detail counts them)
        d = checkpoints.get("detail", {})
        lines.append(f"checkpoints: {d.get('failed')} of {d.get('attempted')} periodic checkpoints failed; the last: "
                     f"{d.get('reason')}")
    if last and last.get("detail", {}).get("log_tail"):
        root = last["detail"].get("root_cause", {})
        lines.append(f"last lines of rank {root.get('rank')}'s log:")
        lines.extend("    " + line for line in last["detail"]["log_tail"])
    return lines


# --------------------------------------------------------------------------- the job's view (shared with ftrun status)


def progress_text(rows: Sequence[dict[str, Any]], samples: Sequence[Sample]) -> tuple[int | None, int | None, float | None, float | None]:
    """(steps done, total steps, steps per second, seconds left) of the job; None where unknown."""
    done = job_steps_done(rows)
    total = job_total_steps(rows)
    rate = step_rate(samples)
    eta = (total - done) / rate if done is not None and total is not None and rate else None
    return done, total, rate, eta


def fault_line(index: int, fault: Fault, now: float) -> str:
    """One fault and its cost: ``fault 1: death of rank 1, respawned: 3.21 s lost (detection ...)``."""
    if fault.end is None:
        return f"fault {index}: {fault.label()}: recovering for {_fmt_seconds(fault.lost(now))}"
    split = fault.split()
    resumed = f", resumed at step {fault.resume_step}" if fault.resume_step is not None else ""
    recomputed = f" ({fault.recomputed} recomputed)" if fault.recomputed else ""
    return (f"fault {index}: {fault.label()}, {fault.repair.value}: {_fmt_seconds(fault.lost(now))} lost"
            + (f" ({split})" if split else "") + resumed + recomputed)


def rank_table(title: str, rows: Sequence[dict[str, Any]]) -> Table:
    """The table of every rank; a straggler's step time is marked ``slow xN.N``."""
    slow = stragglers(rows)
    table = Table(title=title, expand=False, title_justify="left")
    for column in ("rank", "pid", "state", "step", "step time", "metrics", "restarts", "uptime"):
        table.add_column(column, justify="right" if column in ("rank", "pid", "step", "step time", "restarts") else "left")
    for r in rows:
        state = r["state"] + (f" ({r['exit']})" if r.get("exit") and r["state"] != "succeeded" else "")
        step_time = Text(_fmt_step_time(r.get("last_step_seconds")))
        if r.get("rank") in slow:
            step_time.append(f" slow x{slow[r['rank']]:.1f}", style="bold yellow")
        table.add_row(
            str(r["rank"]),
            str(r.get("pid") or "-"),
            Text(state, style=_STATE_STYLE.get(r["state"], "")),
            "-" if r.get("step") is None else str(r["step"]),
            step_time,
            _fmt_metrics(r.get("metrics")),
            str(r.get("restarts", 0)),
            _fmt_uptime(r.get("uptime")),
        )
    return table


def _progress_bar(done: int | None, total: int | None, rate: float | None, eta: float | None) -> Progress:
    progress = Progress(
        TextColumn("[bold]job"),
        BarColumn(bar_width=40),
        MofNCompleteColumn(),
        TextColumn("steps  {task.fields[rate]}  {task.fields[eta]}"),
        auto_refresh=False,
    )
    progress.add_task(
        "job", total=total, completed=done or 0,
        rate="-" if rate is None else f"{rate:.2f} steps/s",
        eta="" if eta is None else f"ETA {_fmt_uptime(eta)}",
    )
    return progress


def job_view(title: str, rows: Sequence[dict[str, Any]], timeline: JobTimeline, samples: Sequence[Sample],
             now: float, header: Sequence[Text] = ()) -> Group:
    """The job as a rich renderable: header lines, progress bar, goodput, faults, rank table."""
    done, total, rate, eta = progress_text(rows, samples)
    parts: list[RenderableType] = list(header)
    parts.append(_progress_bar(done, total, rate, eta))
    good = timeline.goodput(now)
    line = Text("goodput ", style="bold")
    line.append(good.describe(), style="green" if good.ratio is not None and good.ratio >= 0.9 else "yellow")
    parts.append(line)
    for i, fault in enumerate(timeline.faults, start=1):
        parts.append(Text(fault_line(i, fault, now), style="magenta" if fault.end is None else ""))
    parts.append(rank_table(title, rows))
    return Group(*parts)


def job_lines(rows: Sequence[dict[str, Any]], timeline: JobTimeline, samples: Sequence[Sample], now: float) -> list[str]:
    """The same view as plain lines: progress, goodput, faults, one line per rank."""
    done, total, rate, eta = progress_text(rows, samples)
    lines = []
    if done is not None:
        of = f" of {total} ({100 * done / total:.0f}%)" if total else ""
        speed = f", {rate:.2f} steps/s" if rate is not None else ""
        left = f", ETA {_fmt_uptime(eta)}" if eta is not None else ""
        lines.append(f"progress: {done} steps{of}{speed}{left}")
    lines.append(f"goodput: {timeline.goodput(now).describe()}")
    lines.extend(fault_line(i, f, now) for i, f in enumerate(timeline.faults, start=1))
    slow = stragglers(rows)
    for r in rows:
        parts = [f"rank {r['rank']}: {r['state']}" + (f" ({r['exit']})" if r.get("exit") and r["state"] != "succeeded" else "")]
        if r.get("pid"):
            parts.append(f"pid {r['pid']}")
        if r.get("step") is not None:
            parts.append(f"step {r['step']}" + (f"/{r['total_steps']}" if r.get("total_steps") else ""))
        if r.get("last_step_seconds") is not None:
            parts.append(f"step time {_fmt_step_time(r['last_step_seconds'])}"
                         + (f" (straggler: x{slow[r['rank']]:.1f} the others)" if r["rank"] in slow else ""))
        if r.get("metrics"):
            parts.append(_fmt_metrics(r["metrics"]))
        parts.append(f"restarts {r.get('restarts', 0)}")
        if r.get("uptime") is not None:
            parts.append(f"uptime {_fmt_uptime(r['uptime'])}")
        lines.append(", ".join(parts))
    return lines


class _Tracker:
    """What both consoles keep: the goodput timeline and recent progress samples."""

    def __init__(self) -> None:
        self.timeline = JobTimeline()
        self.samples: deque[Sample] = deque()
        self.ranks: list[dict[str, Any]] = []
        self.checkpoint_failure: dict[str, Any] | None = None  # the last periodic checkpoint that failed

    def event(self, event: dict[str, Any]) -> None:
        self.timeline.add(event)
        if (event.get("detail") or {}).get("fault") == "checkpoint_failed":
            self.checkpoint_failure = event

    def status(self, ranks: list[dict[str, Any]], now: float) -> None:
        self.ranks = ranks
        sample = sample_from_status({"ranks": ranks}, now=now, attempt=self.timeline.attempt)
        self.timeline.add_sample(sample)
        self.samples.append(sample)
        while self.samples and self.samples[0].time < now - RATE_WINDOW_S:
            self.samples.popleft()


# --------------------------------------------------------------------------- the consoles


class PlainConsole:
    """Timestamped lines, for pipes, files and CI."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.tracker = _Tracker()

    @property
    def ranks(self) -> list[dict[str, Any]]:
        return self.tracker.ranks

    def _line(self, text: str) -> None:
        self.stream.write(f"{time.strftime('%H:%M:%S')} ftrun: {text}\n")
        self.stream.flush()

    def event(self, event: dict[str, Any]) -> None:
        self.tracker.event(event)
        self._line(event["message"])

    def status(self, ranks: list[dict[str, Any]]) -> None:
        self.tracker.status(ranks, time.time())

    def output(self, rank: int, line: str) -> None:
        self.stream.write(f"[rank{rank}] {line}\n")
        self.stream.flush()

    def finish(self, exit_code: int, last: dict[str, Any] | None) -> None:
        for r in self.ranks:
            self._line(
                f"rank {r['rank']}: {r['state']}, step {r['step'] if r['step'] is not None else '-'}, "
                f"restarts {r['restarts']}" + (f", {r['exit']}" if r.get("exit") else "")
            )
        if self.tracker.timeline.started_at is not None:
            self._line(f"goodput {self.tracker.timeline.goodput(time.time()).describe()}")
        for line in _summary_lines(exit_code, last, self.tracker.checkpoint_failure):
            self._line(line)


class RichConsole:
    """A live view of the job with the event log under it (terminals only)."""

    def __init__(self, title: str, max_events: int = 8) -> None:
        self.console = Console(stderr=False)
        self.title = title
        self.tracker = _Tracker()
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    @property
    def ranks(self) -> list[dict[str, Any]]:
        return self.tracker.ranks

    def _render(self) -> Group:
        log = Text()
        for ev in self.events:
            stamp = time.strftime("%H:%M:%S", time.localtime(ev["time"]))
            log.append(f"{stamp} ", style="dim")
            log.append(ev["message"] + "\n", style=_EVENT_STYLE.get(ev["kind"], ""))
        t = self.tracker
        return Group(job_view(self.title, t.ranks, t.timeline, list(t.samples), time.time()), log)

    def event(self, event: dict[str, Any]) -> None:
        self.tracker.event(event)
        self.events.append(event)
        self.live.update(self._render())

    def status(self, ranks: list[dict[str, Any]]) -> None:
        self.tracker.status(ranks, time.time())
        self.live.update(self._render())

    def output(self, rank: int, line: str) -> None:
        self.live.console.print(Text(f"[rank{rank}] ", style="cyan") + Text(line), soft_wrap=True)

    def finish(self, exit_code: int, last: dict[str, Any] | None) -> None:
        t = self.tracker
        self.live.update(job_view(f"{self.title}: finished", t.ranks, t.timeline, list(t.samples), time.time()))
        self.live.stop()
        style = "bold green" if exit_code == 0 else "bold red"
        for i, line in enumerate(_summary_lines(exit_code, last, t.checkpoint_failure)):
            self.console.print(Text(line, style=style if i == 0 else ""))


def make_console(title: str, force_plain: bool = False) -> JobConsole:
    """A rich live console on a terminal, plain lines otherwise."""
    if not force_plain and sys.stdout.isatty():
        return RichConsole(title)
    return PlainConsole()
