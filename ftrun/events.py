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

import json
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import IO, Any


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
        data = asdict(self)
        data["kind"] = self.kind.value
        return {"time": data.pop("time"), "kind": data.pop("kind"), **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Event":
        """Inverse of :meth:`to_json`."""
        values = dict(data)
        values["kind"] = EventKind(values["kind"])
        return cls(**values)


class EventLog:
    """Appends events to a JSON-lines file, one flushed line per event."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, event: Event) -> None:
        self._stream.write(json.dumps(event.to_json(), sort_keys=False, default=str) + "\n")
        self._stream.flush()
