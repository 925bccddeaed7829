"""One rank's side of the control channel (the control client, split out of
:class:`ftrun.worker.Worker`): what it says to its supervisor, and the aborts, recovery plans, save
requests and the end of the job it hears back.

Two threads read what arrives. The channel's I/O thread sees every message first
(:meth:`ControlClient.on_io_message`): an abort for a newer generation sets :attr:`abandon` and
calls ``on_io_abort`` at once, so a training thread blocked in a collective can be released
(:meth:`ftrun.group.TrainingGroup.cut`) without waiting for it to poll. The training thread takes
the messages at its safe points (:meth:`ControlClient.poll`) and acts on them there.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Sequence

from .channel import Channel
from .protocol import Message, MsgType


def open_channel(library: bool, replica_group: Sequence[int], generation: int, **extra: Any) -> Channel | None:
    """Connect to the supervisor named by ``FTRUN_CONTROL_ADDR``/``FTRUN_TOKEN`` and say hello
    (pid, generation, replica group, ``extra``). None when the rank runs without one."""
    addr, token = os.environ.get("FTRUN_CONTROL_ADDR"), os.environ.get("FTRUN_TOKEN")
    if not addr or not token:
        return None
    rank = int(os.environ.get("RANK") or 0)
    incarnation = int(os.environ.get("FTRUN_INCARNATION") or 0)
    channel = Channel(addr, token, rank, incarnation, float(os.environ.get("FTRUN_HEARTBEAT_INTERVAL", "1")))
    channel.send(
        MsgType.HELLO,
        pid=os.getpid(),
        generation=generation,
        replica_group=[int(r) for r in replica_group],
        library=library,
        **extra,
    )
    return channel


class ControlClient:
    """The messages between this rank and its supervisor.

    Attributes:
        channel: the :class:`ftrun.channel.Channel` (None: no supervisor, or a hot spare before
            its promotion); set by :meth:`attach`.
        abort_generation: the newest generation an abort taken on the training thread named
            (None: no recovery pending).
        plan: the coordinator's ``reconfigure`` for a generation, once here.
        save_request: a ``save`` (dying-gasp checkpoint) to write at the next safe point.
        finished: the coordinator said every rank finished (the finish barrier may end).
        io_abort_generation: the newest abort generation the I/O thread has seen (-1: none).
        abandon: set by the I/O thread when an abort for a newer generation arrives: every wait
            of the training thread (a collective, a barrier) gives up.
        on_abort: called on the training thread with each abort for a newer generation (the
            worker answers it with its ``fault`` report).
        on_io_abort: called on the I/O thread with each abort's generation.
    """

    def __init__(self) -> None:
        self.channel: Channel | None = None
        self.abort_generation: int | None = None
        self.plan: Message | None = None
        self.save_request: Message | None = None
        self.finished = False
        self.io_abort_generation = -1
        self.abandon = threading.Event()
        self.on_abort: Callable[[Message], None] = lambda _msg: None
        self.on_io_abort: Callable[[int], None] = lambda _generation: None

    def attach(self, channel: Channel | None, probe: Callable[[], dict[str, Any]] | None = None,
               beat_extra: Callable[[], dict[str, Any] | None] | None = None) -> None:
        """Use ``channel``: its I/O thread reports here; ``probe`` answers the supervisor's
        question whether the training thread is in a collective; ``beat_extra`` adds fields to
        each heartbeat."""
        self.channel = channel
        if channel is not None:
            channel.on_receive = self.on_io_message
            if probe is not None:
                channel.probe = probe
            if beat_extra is not None:
                channel.beat_extra = beat_extra

    def send(self, msg_type: MsgType, **fields: Any) -> None:
        """Queue a message to the supervisor (never blocks; nothing without a channel)."""
        if self.channel is not None:
            self.channel.send(msg_type, **fields)

    def on_io_message(self, msg: Message) -> None:
        """On the channel's I/O thread, for every message before the training thread takes it."""
        if msg.type == MsgType.ABORT:
            self.io_abort_generation = max(self.io_abort_generation, msg["generation"])
            self.on_io_abort(msg["generation"])

    def poll(self, timeout: float = 0.0) -> None:
        """On the training thread: take the messages that arrived (waiting up to ``timeout``
        seconds for the first) and act on each (:meth:`take`)."""
        if self.channel is None:
            return
        msg = self.channel.receive(timeout)
        while msg is not None:
            self.take(msg)
            msg = self.channel.receive(0.0)

    def take(self, msg: Message) -> None:
        """Act on one message: record an abort (and report on it), a plan, a save request, the
        finish; a ``stop`` ends the process (exit code 0)."""
        if msg.type == MsgType.ABORT:
            if self.abort_generation is None or msg["generation"] > self.abort_generation:
                self.abort_generation = msg["generation"]
                self.on_abort(msg)
        elif msg.type == MsgType.RECONFIGURE:
            self.plan = msg
        elif msg.type == MsgType.SAVE:
            self.save_request = msg
        elif msg.type == MsgType.STOP:
            sys.exit(0)
        elif msg.type == MsgType.FINISHED:
            self.finished = True

    def aborted_beyond(self, generation: int) -> bool:
        """Whether an abort for a generation newer than ``generation`` was taken."""
        return self.abort_generation is not None and self.abort_generation > generation

    def io_aborted_beyond(self, generation: int) -> bool:
        """Whether the I/O thread has seen an abort for a generation newer than ``generation``
        (the training thread may not have taken it yet)."""
        return self.io_abort_generation > generation

    def take_plan(self) -> Message | None:
        """The plan for the pending abort's generation, once it arrived (then forgotten here)."""
        plan = self.plan
        if plan is None or plan["generation"] != self.abort_generation:
            return None
        self.plan = None
        return plan

    def drop_stale_plan(self) -> None:
        """Forget a plan for any generation but the pending abort's. A plan for the pending abort
        is kept: an earlier poll can take it with the abort when the coordinator was quick."""
        if self.plan is not None and self.plan["generation"] != self.abort_generation:
            self.plan = None

    def recovered(self, generation: int) -> None:
        """``generation`` stands: no abort is pending any more, and unless a newer abort already
        reached the I/O thread, the training thread's waits are real again."""
        self.abort_generation = None
        if self.io_abort_generation <= generation:
            self.abandon.clear()

    def take_save_request(self) -> Message | None:
        request, self.save_request = self.save_request, None
        return request

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
