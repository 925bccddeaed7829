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
from .contract import RankEnv
from .protocol import Message, MsgType


def open_channel(library: bool, replica_group: Sequence[int], generation: int, env: RankEnv | None = None,
                 **extra: Any) -> Channel | None:
    """Connect to the supervisor named by the rank's environment (``env``, default read from
    ``os.environ``: ``FTRUN_CONTROL_ADDR``, ``FTRUN_TOKEN``, :class:`ftrun.contract.RankEnv`) and
    say hello (pid, generation, replica group, ``extra``). None when the rank runs without one."""
    env = env if env is not None else RankEnv.from_environ(os.environ)
    if not env.control_addr or not env.token:
        return None
    channel = Channel(env.control_addr, env.token, env.rank or 0, env.incarnation or 0, env.heartbeat_interval)
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
        section: ``(name, timeout)`` of the open ``ft.section()``, or None.
        last_report: ``(step, metrics)`` of the last ``ft.report()`` (re-sent with sections).

    Args:
        progress: the rank's :class:`ftrun.recovery.RankProgress` (its current step goes with
            the progress it reports), or None.
    """

    def __init__(self, progress: Any = None) -> None:
        self.progress = progress
        self.section: tuple[str, float | None] | None = None
        self.last_report: tuple[int, dict[str, Any]] = (0, {})
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
            channel.rejoin_fields = self.rejoin_fields

    def rejoin_fields(self) -> dict[str, Any]:
        """On the I/O thread, for a hello to a coordinator that took over: the newest generation
        this rank has seen (an abort the old coordinator sent before it died, which the standby may
        not have been told of)."""
        generation = self.progress.generation if self.progress is not None else 0
        return {"seen": max(self.io_abort_generation, generation)}

    def send(self, msg_type: MsgType, **fields: Any) -> None:
        """Queue a message to the supervisor (never blocks; nothing without a channel)."""
        if self.channel is not None:
            self.channel.send(msg_type, **fields)

    # ------------------------------------------------------------------ progress and sections
    def report(self, step: int, metrics: dict[str, Any]) -> None:
        """Send ``ft.report(step, **metrics)`` (metrics already plain numbers and strings)."""
        self.last_report = (int(step), metrics)
        self.send(MsgType.PROGRESS, step=int(step), metrics=metrics)

    def progress_fields(self) -> dict[str, Any]:
        """A ``progress`` message's fields: the step (the last reported, or the current if later),
        its metrics, and the open section with its timeout."""
        step, metrics = self.last_report
        current = self.progress.current_step if self.progress is not None else None
        if current is not None:
            step = max(step, current)
        fields: dict[str, Any] = {"step": step, "metrics": metrics}
        if self.section is not None:
            fields["section"], fields["section_timeout"] = self.section
        return fields

    def ping(self) -> None:
        """Send a ``progress`` now (the watchdog's step bound counts from it)."""
        self.send(MsgType.PROGRESS, **self.progress_fields())

    def open_section(self, name: str, timeout: float | None) -> tuple[str, float | None] | None:
        """Open a section (``timeout`` seconds, None: unbounded) and say so; returns the one it replaces."""
        previous, self.section = self.section, (str(name), None if timeout is None else float(timeout))
        self.ping()
        return previous

    def close_section(self, previous: tuple[str, float | None] | None) -> None:
        """Close the open section (``previous``: the one it replaced comes back) and say so."""
        self.section = previous
        fields = self.progress_fields()
        fields.setdefault("section", None)
        self.send(MsgType.PROGRESS, **fields)

    def beat_progress(self) -> dict[str, Any] | None:
        """On the I/O thread, at each heartbeat: a ``progress`` while a section is open."""
        return self.progress_fields() if self.section is not None else None

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
        elif msg.type == MsgType.FINISHED:
            self.finished = True

    def poll_abort(self, timeout: float = 0.0, newer_than: int | None = None) -> bool:
        """Take the messages that arrived (:meth:`poll`); True once an abort for a generation newer
        than ``newer_than`` (default: the current one, :attr:`progress`'s) is pending."""
        self.poll(timeout)
        return self.aborted_beyond(self.progress.generation if newer_than is None else newer_than)

    def report_abort(self, msg: Message) -> None:
        """Answer an abort for a newer generation, taken on the training thread (the worker's
        :attr:`on_abort`): report where this rank stands (its step and committed step)."""
        self.send(MsgType.FAULT, generation=msg["generation"], step=self.progress.current_step or -1,
                  committed=self.progress.committed, reason=msg["reason"], kind="abort")

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


def training_thread_probe(thread_id: int | None, waiting: threading.Event | None = None,
                          progress: Any = None) -> Callable[[], dict[str, Any]]:
    """A heartbeat probe: whether the training thread is inside a torch.distributed call now.

    The I/O thread looks at the training thread's innermost Python frames
    (``sys._current_frames``): a rank blocked in a collective sits in ``torch/distributed``; a
    rank stuck in its own code (an endless loop, a deadlock) does not, even if it had announced
    the collective. That separates the culprit of a stalled job from the peers waiting for it.
    ``waiting`` is set by the gradient reducer while it waits for its asynchronous all-reduces
    (``Work.wait()`` runs no Python frame inside torch/distributed). With ``progress`` (a
    :class:`ftrun.recovery.RankProgress`), the heartbeat also says which stage of ftrun's flow the
    training thread is in and the bytes that stage moves: a rank stuck in its own code during
    a recovery or the initial broadcast, while its peers wait for it in torch.distributed, is then
    found within seconds.
    """
    marker = os.sep + os.path.join("torch", "distributed") + os.sep

    def in_dist() -> bool:
        if waiting is not None and waiting.is_set():
            return True
        frame = sys._current_frames().get(thread_id) if thread_id is not None else None
        depth = 0
        while frame is not None and depth < 8:
            if marker in frame.f_code.co_filename:
                return True
            frame, depth = frame.f_back, depth + 1
        return False

    def probe() -> dict[str, Any]:
        if progress is None:
            return {"in_dist": in_dist()}
        return {"in_dist": in_dist(), "stage": progress.stage, "stage_bytes": progress.stage_bytes}

    return probe
