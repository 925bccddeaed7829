"""Events and status: what the coordinator tells the world.

Every event goes to ``LOG_DIR/events.jsonl``, to node 0's launcher (which draws the console) and
to the observers (Prometheus metrics); a status snapshot goes to the launcher and to
``LOG_DIR/status.json`` (``ftrun status``) at most :data:`STATUS_PERIOD_S` apart. Event times are
wall-clock (Unix) time; deadlines elsewhere use the monotonic clock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import zmq

from ..events import Event, EventKind, EventLog
from ..protocol import MsgType, Sender, encode, events_for
from .ranks import Rank

log = logging.getLogger("ftrun.coordinator")

STATUS_PERIOD_S = 0.25  # at most four console snapshots a second


class Publisher:
    """Records and pushes the job's events and status.

    Args:
        log_dir: the job's log directory (``events.jsonl``, ``status.json``).
        node: this node's index (the node of events that name no rank).
        sender: the frame sender for node 0's launcher (:mod:`ftrun.protocol`).
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
        self.event_log = EventLog(open(log_dir / "events.jsonl", "a", encoding="utf-8"))
        self.observers: list[Callable[[Event], None]] = []  # called with every event (e.g. metrics)
        self.dirty = True
        self._last_status = 0.0

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
        if self.push is not None:
            self.push.send(encode(MsgType.EVENT, self.sender, self.audience, event=event.to_json()))
        for observer in self.observers:
            try:
                observer(event)
            except Exception:  # an observer (metrics) must never break the job
                log.exception("event observer failed")
        self.dirty = True
        return event

    def status(self, snapshot: Callable[[], dict[str, Any]], force: bool = False,
               final: Mapping[str, Any] | None = None) -> None:
        """Push a status snapshot (made by ``snapshot()``) to the launcher and keep
        ``LOG_DIR/status.json`` current (``final``: the job's end, written once)."""
        now = self.clock()
        if not (force or final or (self.dirty and now - self._last_status >= STATUS_PERIOD_S)):
            return
        data = snapshot()
        data["state"] = "running" if final is None else ("succeeded" if final["exit_code"] == 0 else "failed")
        if final is not None:
            data.update(final)
        if self.push is not None:
            self.push.send(encode(MsgType.STATUS, self.sender, self.audience, ranks=data["ranks"], attempt=data["attempt"],
                                  generation=data["generation"]))
        write_status_file(self.log_dir / "status.json", data)
        self.dirty = False
        self._last_status = now

    def close(self) -> None:
        if self.push is not None:
            self.push.close(2000)


def status_header() -> dict[str, Any]:
    """The fields of every snapshot that say where and when it was made."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "updated": time.time()}


def write_status_file(path: Path, snapshot: dict[str, Any]) -> None:
    """Replace ``path`` with ``snapshot`` as JSON, atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(snapshot, default=str))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("cannot write %s: %s", path, err)
