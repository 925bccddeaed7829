"""What the launcher shows: a live rich table on a terminal, plain timestamped lines elsewhere.

Both consoles take the same calls from the launcher: ``event`` (one event dict, as in events.jsonl),
``status`` (a snapshot of every rank), ``output`` (a line a tailed rank printed) and ``finish``.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Any, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

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
    "message_rejected": "red",
}


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


def _summary_lines(exit_code: int, last: dict[str, Any] | None) -> list[str]:
    lines = [f"exit code {exit_code}" + (f": {last['message']}" if last else "")]
    if last and last.get("detail", {}).get("log_tail"):
        root = last["detail"].get("root_cause", {})
        lines.append(f"last lines of rank {root.get('rank')}'s log:")
        lines.extend("    " + line for line in last["detail"]["log_tail"])
    return lines


class PlainConsole:
    """Timestamped lines, for pipes, files and CI."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.ranks: list[dict[str, Any]] = []

    def _line(self, text: str) -> None:
        self.stream.write(f"{time.strftime('%H:%M:%S')} ftrun: {text}\n")
        self.stream.flush()

    def event(self, event: dict[str, Any]) -> None:
        self._line(event["message"])

    def status(self, ranks: list[dict[str, Any]]) -> None:
        self.ranks = ranks

    def output(self, rank: int, line: str) -> None:
        self.stream.write(f"[rank{rank}] {line}\n")
        self.stream.flush()

    def finish(self, exit_code: int, last: dict[str, Any] | None) -> None:
        for r in self.ranks:
            self._line(
                f"rank {r['rank']}: {r['state']}, step {r['step'] if r['step'] is not None else '-'}, "
                f"restarts {r['restarts']}" + (f", {r['exit']}" if r.get("exit") else "")
            )
        for line in _summary_lines(exit_code, last):
            self._line(line)


class RichConsole:
    """A live table of every rank with an event log under it (terminals only)."""

    def __init__(self, title: str, max_events: int = 8) -> None:
        self.console = Console(stderr=False)
        self.title = title
        self.ranks: list[dict[str, Any]] = []
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def _table(self, title: str) -> Table:
        table = Table(title=title, expand=False, title_justify="left")
        for column in ("rank", "pid", "state", "step", "metrics", "restarts", "uptime"):
            table.add_column(column, justify="right" if column in ("rank", "pid", "step", "restarts") else "left")
        for r in self.ranks:
            state = r["state"] + (f" ({r['exit']})" if r.get("exit") and r["state"] != "succeeded" else "")
            table.add_row(
                str(r["rank"]),
                str(r["pid"] or "-"),
                Text(state, style=_STATE_STYLE.get(r["state"], "")),
                "-" if r["step"] is None else str(r["step"]),
                _fmt_metrics(r.get("metrics")),
                str(r["restarts"]),
                _fmt_uptime(r.get("uptime")),
            )
        return table

    def _render(self) -> Group:
        log = Text()
        for ev in self.events:
            stamp = time.strftime("%H:%M:%S", time.localtime(ev["time"]))
            log.append(f"{stamp} ", style="dim")
            log.append(ev["message"] + "\n", style=_EVENT_STYLE.get(ev["kind"], ""))
        return Group(self._table(self.title), log)

    def event(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.live.update(self._render())

    def status(self, ranks: list[dict[str, Any]]) -> None:
        self.ranks = ranks
        self.live.update(self._render())

    def output(self, rank: int, line: str) -> None:
        self.live.console.print(Text(f"[rank{rank}] ", style="cyan") + Text(line), soft_wrap=True)

    def finish(self, exit_code: int, last: dict[str, Any] | None) -> None:
        self.live.update(Group(self._table(f"{self.title}: finished")))
        self.live.stop()
        style = "bold green" if exit_code == 0 else "bold red"
        for i, line in enumerate(_summary_lines(exit_code, last)):
            self.console.print(Text(line, style=style if i == 0 else ""))


def make_console(title: str, force_plain: bool = False) -> JobConsole:
    """A rich live console on a terminal, plain lines otherwise."""
    if not force_plain and sys.stdout.isatty():
        return RichConsole(title)
    return PlainConsole()
