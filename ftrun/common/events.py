"""Job events: what happened, to which rank, when.

The job coordinator (node 0) is the single writer of ``LOG_DIR/events.jsonl``: one JSON object per line, with
these keys (the schema is also documented in docs/reference/events.md):

- ``time``: Unix time in seconds (float).
- ``kind``: one of :class:`EventKind`'s values.
- ``node``: node rank of the supervisor that recorded it.
- ``rank``: global rank concerned, or null for job-wide events.
- ``pid``: process id concerned, or null.
- ``incarnation``: which process serving that rank (0 = first), or null.
- ``generation``: process-group generation at the time (bumped on every reconfiguration).
- ``attempt``: whole-job attempt (TORCHELASTIC_RESTART_COUNT).
- ``message``: one human-readable line.
- ``detail``: kind-specific fields (exit codes, signals, steps, seconds, bytes).

Events are also pushed to the launcher, which draws them on the console.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable


class EventKind(str, Enum):
    """Kinds of event; the value is what ``kind`` holds in events.jsonl."""

    JOB_STARTED = "job_started"
    WARNING = "warning"
    RANK_STARTED = "rank_started"
    RANK_JOINED = "rank_joined"
    RANK_EXITED = "rank_exited"
    RANK_FAILED = "rank_failed"
    RANK_HUNG = "rank_hung"
    JOB_RESTARTING = "job_restarting"
    RANK_RESPAWNED = "rank_respawned"
    RECOVERY_STARTED = "recovery_started"
    RECOVERY_PLANNED = "recovery_planned"
    RANK_RECOVERED = "rank_recovered"
    RECOVERY_FINISHED = "recovery_finished"
    RECOVERY_FALLBACK = "recovery_fallback"
    MESSAGE_REJECTED = "message_rejected"
    CHECKPOINT_SAVED = "checkpoint_saved"
    RESUMED = "resumed"
    STOP_REQUESTED = "stop_requested"
    JOB_FINISHED = "job_finished"
    NODE_JOINED = "node_joined"
    NODE_LOST = "node_lost"
    STANDBY_NODE_JOINED = "standby_node_joined"  # a launcher that came after every node had its index waits as a standby
    STANDBY_NODE_LEFT = "standby_node_left"  # a standby's agent is gone (its launcher died or stopped): dropped, no fault
    JOB_SHRUNK = "job_shrunk"  # --nnodes MIN:MAX: an absent node's ranks run on the other nodes
    JOB_GROWN = "job_grown"  # ... and move back to it once it joins
    COORDINATOR_TAKEOVER = "coordinator_takeover"  # the standby coordinator took the job over
    COORDINATOR_STEPPED_DOWN = "coordinator_stepped_down"  # a coordinator that lost its quorum (a partition) stopped its side
    DIVERGENCE = "divergence"  # exactly-once broken: a recomputed step or a replica's parameters differ


@dataclass
class Event:
    """One event (see the module docstring for the meaning of each field)."""

    kind: EventKind
    message: str
    rank: int | None = None
    pid: int | None = None
    incarnation: int | None = None
    generation: int = 0
    attempt: int = 0
    node: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to events.jsonl."""
        # ``detail`` copied one level deep, not every level (``dataclasses.asdict``): a coordinator
        # emits an event per rank in a round of thousands.
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["kind"], data["detail"] = self.kind.value, dict(self.detail)
        return {"time": data.pop("time"), "kind": data.pop("kind"), **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Event":
        """Inverse of :meth:`to_json`."""
        values = dict(data)
        values["kind"] = EventKind(values["kind"])
        return cls(**values)


class AppendLog:
    """A JSON-lines file appended best-effort: writing it never raises.

    The files of the control path (``events.jsonl``, ``progress.jsonl``) sit in the log directory,
    which may fill up or be removed under a running job; the job must not die of its own output.
    Each line is written whole or not at all (a short write on a full disk is cut back), so a reader
    never meets half a line. A removed file or directory is made again and said so; a failed write
    is said once, then retried at every line (space may come back).

    Args:
        path: the file (opened for appending; ``truncate``: emptied first).
        on_trouble: called with one line when writing starts failing (once per cause until it works
            again), when it works again, and when the file had to be made again.
        truncate: start the file afresh.
    """

    def __init__(self, path: Path, on_trouble: Callable[[str], None] = lambda _msg: None, truncate: bool = False) -> None:
        self.path, self.on_trouble = Path(path), on_trouble
        self._fd: int | None = None
        self._failing: str | None = None  # the cause of the current run of failed writes
        self.dropped = 0  # lines not written
        self._open(truncate)

    def _open(self, truncate: bool = False, removed: bool = False) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, flags, 0o644)
            self.on_trouble(f"{self.path}: its directory was removed: made it again (what was in it is lost)")
        else:
            if removed:
                self.on_trouble(f"{self.path} was removed: made it again (what was in it is lost)")

    def _say(self, cause: str) -> None:
        if self._failing != cause:
            self._failing = cause
            self.on_trouble(f"cannot write {self.path}: {cause}; the job goes on")

    def write_line(self, line: str) -> bool:
        """Append ``line`` and a newline; False when it could not be written (said once)."""
        data = (line + "\n").encode("utf-8")
        try:
            if self._fd is None or os.fstat(self._fd).st_nlink == 0:  # removed under us (rm -rf of the log directory)
                removed = self._fd is not None
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                self._open(removed=removed)
            assert self._fd is not None
            size = os.fstat(self._fd).st_size
            written = os.write(self._fd, data)
            if written != len(data):
                os.ftruncate(self._fd, size)  # no half line: cut back what the full disk took
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            self.dropped += 1
            self._say(err.strerror or str(err))
            return False
        if self._failing is not None:
            self.on_trouble(f"writing {self.path} works again ({self.dropped} line(s) were lost)")
            self._failing = None
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class EventLog:
    """Appends events to ``events.jsonl``, one line per event, best-effort (:class:`AppendLog`)."""

    def __init__(self, path: Path, on_trouble: Callable[[str], None] = lambda _msg: None) -> None:
        self.file = AppendLog(path, on_trouble)

    def write(self, event: Event) -> bool:
        """Append ``event``; False when it could not be written (the file's trouble is said once)."""
        return self.file.write_line(json.dumps(event.to_json(), sort_keys=False, default=str))
