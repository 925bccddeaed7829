"""Events and status: what the coordinator tells the world.

Every event goes to ``LOG_DIR/events.jsonl``, to node 0's launcher (which draws the console) and
to the observers (Prometheus metrics); a status snapshot goes to the launcher and to
``LOG_DIR/status.json`` (``ftrun status``) when something changed, at most :data:`STATUS_PERIOD_S`
apart, and at most one every :data:`STATUS_SECONDS_PER_RANK` per rank (a snapshot has a row per rank:
this keeps its share of node 0's CPU the same at any size, where four a second would grow with the
ranks). Event times are wall-clock (Unix) time; deadlines elsewhere use the monotonic clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import zmq

from ftrun.common.events import Event, EventKind, EventLog
from ftrun.common.protocol import MsgType, Sender, encode, events_for
from ftrun.coordinator.ranks import Rank

log = logging.getLogger("ftrun.coordinator")

STATUS_PERIOD_S = 0.25  # at most four console snapshots a second
STATUS_SECONDS_PER_RANK = 1 / 2048  # and, in a larger job, one every this many seconds per rank


def status_gap(ranks: int) -> float:
    """The least time between two status snapshots of a job of ``ranks`` ranks, seconds:
    :data:`STATUS_PERIOD_S`, or :data:`STATUS_SECONDS_PER_RANK` per rank in a larger job (a
    snapshot has a row per rank)."""
    return max(STATUS_PERIOD_S, ranks * STATUS_SECONDS_PER_RANK)


class Publisher:
    """Records and pushes the job's events and status.

    Args:
        log_dir: the job's log directory (``events.jsonl``, ``status.json``).
        node: this node's index (the node of events that name no rank).
        sender: the frame sender for node 0's launcher (:mod:`ftrun.common.protocol`).
        push: a connected ZeroMQ PUSH socket to the launcher, or None.
        clock: the coordinator's monotonic clock (paces the snapshots), seconds.
        audience: the node whose launcher reads the frames (0; after a takeover, the new
            coordinator's node as its launcher knows it).
    """

    def __init__(self, log_dir: Path, node: int, sender: Sender, push: zmq.Socket | None,
                 clock: Callable[[], float], audience: int = 0) -> None:
        self.log_dir = log_dir
        self.node = node
        self.audience = events_for(audience)  # the launcher's (node 0's; a takeover's: its own node's)
        self.sender = sender
        self.push = push
        self.clock = clock
        self._troubles: list[str] = []  # the log directory's failures, to say on the console
        self._status_trouble: str | None = None
        self.event_log = EventLog(log_dir / "events.jsonl", self._troubles.append)
        self.observers: list[Callable[[Event], None]] = []  # called with every event (e.g. metrics)
        self.dirty = True
        self._last_status = 0.0
        self._status_gap = STATUS_PERIOD_S  # the least time to the next snapshot, seconds (grows with the ranks)

    def emit(self, kind: EventKind, message: str, r: Rank | None, generation: int, attempt: int,
             rank: int | None = None, **detail: Any) -> Event:
        """Record an event in events.jsonl, push it to the launcher and hand it to the observers."""
        event = Event(
            kind=kind,
            message=message,
            rank=rank,
            pid=detail.pop("pid", None) or (r.proc.pid if r else None),
            incarnation=r.incarnation if r else None,
            generation=generation,
            attempt=attempt,
            node=r.node if r is not None else self.node,
            detail=detail,
        )
        self.event_log.write(event)
        log.info("%s %s", kind.value, message)
        self._push(event)
        while self._troubles:  # the events file failed: said on the console (and in the log) once
            self.trouble(self._troubles.pop(0))
        for observer in self.observers:
            try:
                observer(event)
            except Exception:  # an observer (metrics) must never break the job
                log.exception("event observer failed")
        self.dirty = True
        return event

    def _push(self, event: Event) -> None:
        if self.push is not None:
            self.push.send(encode(MsgType.EVENT, self.sender, self.audience, event=event.to_json()))

    def trouble(self, message: str) -> None:
        """Say a failure of the job's own output (a full or removed log directory) on the console
        and in the supervisor's log, not in the file that fails."""
        log.warning("%s", message)
        self._push(Event(kind=EventKind.WARNING, message=message, node=self.node, detail={"fault": "log_dir"}))

    def status(self, snapshot: Callable[[], dict[str, Any]], force: bool = False,
               final: Mapping[str, Any] | None = None) -> None:
        """Push a status snapshot (made by ``snapshot()``) to the launcher and keep
        ``LOG_DIR/status.json`` current (``final``: the job's end, written once). Unless ``force``
        or ``final``, only when something changed since the last one (:attr:`dirty`) and at least
        ``max(STATUS_PERIOD_S, ranks x STATUS_SECONDS_PER_RANK)`` after it."""
        now = self.clock()
        if not (force or final or (self.dirty and now - self._last_status >= self._status_gap)):
            return
        data = snapshot()
        self._status_gap = status_gap(len(data["ranks"]))
        data["state"] = "running" if final is None else ("succeeded" if final["exit_code"] == 0 else "failed")
        if final is not None:
            data.update(final)
        if self.push is not None:
            self.push.send(encode(MsgType.STATUS, self.sender, self.audience, ranks=data["ranks"], attempt=data["attempt"],
                                  generation=data["generation"]))
        failed = write_status_file(self.log_dir / "status.json", data)
        if failed != self._status_trouble and failed is not None:
            self.trouble(failed)
        self._status_trouble = failed
        self.dirty = False
        self._last_status = now

    def close(self) -> None:
        if self.push is not None:
            self.push.close(2000)


def status_header() -> dict[str, Any]:
    """The fields of every snapshot that say where and when it was made."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "updated": time.time()}


def write_status_file(path: Path, snapshot: dict[str, Any]) -> str | None:
    """Replace ``path`` with ``snapshot`` as JSON, atomically (a reader never sees half a file); a
    removed directory is made again. Returns why it could not be written (one line), else None."""
    tmp = path.with_name(f".{path.name}.tmp")
    text = json.dumps(snapshot, default=str, check_circular=False)  # a tree of fresh dicts: no cycle to look for
    try:
        try:
            tmp.write_text(text)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return f"cannot write {path}: {err.strerror or err}; the job goes on (ftrun status shows older data)"
    return None
