"""One rank's side of the control channel (the control client, split out of
:class:`ftrun.rank.worker.Worker`): what it says to its supervisor, and the aborts, recovery plans, save
requests and the end of the job it hears back.

Two threads read what arrives. The channel's I/O thread sees every message first
(:meth:`ControlClient.on_io_message`): an abort for a newer generation sets :attr:`abandon` and
calls ``on_io_abort`` at once, so a training thread blocked in a collective can be released
(:meth:`ftrun.rank.group.TrainingGroup.cut`) without waiting for it to poll. The training thread takes
the messages at its safe points (:meth:`ControlClient.poll`) and acts on them there.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

from ftrun.rank.channel import Channel
from ftrun.common.contract import RELAY_ADDR, STANDBY_LINE, RankEnv
from ftrun.common.protocol import Message, MsgType


def open_channel(library: bool, replica_group: Sequence[int], generation: int, env: RankEnv | None = None,
                 **extra: Any) -> Channel | None:
    """Connect to the supervisor named by the rank's environment (``env``, default read from
    ``os.environ``: ``FTRUN_CONTROL_ADDR``, ``FTRUN_TOKEN``, :class:`ftrun.common.contract.RankEnv`) and
    say hello (pid, generation, replica group, ``extra``). None when the rank runs without one."""
    env = env if env is not None else RankEnv.from_environ(os.environ)
    if not env.control_addr or not env.token:
        return None
    relay = os.environ.get(RELAY_ADDR, "")  # its node agent's heartbeat relay, if the job relays (ftrun.node.relay)
    channel = Channel(env.control_addr, env.token, env.rank or 0, env.incarnation or 0, env.heartbeat_interval,
                      relay=relay if relay.startswith("ipc://") else None)
    # Where to go if that coordinator dies before it announces its standbys to this rank (its
    # node's agent knew the line when it started the rank).
    channel.line = [c for c in os.environ.get(STANDBY_LINE, "").split(",") if c.startswith("tcp://")]
    channel.send(
        MsgType.HELLO,
        pid=os.getpid(),
        generation=generation,
        replica_group=[int(r) for r in replica_group],
        library=library,
        **extra,
    )
    return channel


#: Step-time samples kept for the next heartbeat (more between two beats: the oldest are dropped).
SAMPLES_KEPT = 4096
#: Step times a heartbeat lists one by one (the newest); older new ones go as their maximum.
SAMPLES_LISTED = 64


class StepBoard:
    """Where the training thread is in its steps: written by the training thread with plain
    attribute stores, read by the channel's I/O thread into every heartbeat (:meth:`fields`).

    A rank used to send four messages a step (step begin, collective, update begin, update end):
    on a small model (word_lm, ~10 ms steps, 4 ranks on 2 cores) their encoding, authentication and
    the supervisor's handling were a visible share of every fault-free step (docs/benchmarks.md).
    The watchdog needs where a rank is and for how long, not every transition: the
    heartbeat tells it, as ages (seconds before the beat, so no clocks are compared across hosts),
    at most ``heartbeat_interval`` late. The step and committed step are read from the rank's
    :class:`ftrun.rank.recovery.RankProgress`.

    Attributes:
        phase: ``(name, since)``: one of :class:`ftrun.coordinator.ranks.RankPhase`'s values and
            when it began (``clock`` seconds); one tuple, so the I/O thread reads it whole.
        total: the number of steps the loop runs, when known.
        samples: step times seen so far (intervals between consecutive step begins that span no
            ``ft.section``), the automatic step timeout's evidence.
        last_step, compute: the latest step time, and its begin to its collective (seconds).
    """

    def __init__(self, progress: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.progress = progress
        self.clock = clock
        self.phase: tuple[str, float] = ("setup", clock())
        self.total: int | None = None
        self.began: tuple[int, float] | None = None  # (step, time) of the last step begin
        self.samples = 0
        self.last_step: float | None = None
        self.compute: float | None = None
        self.section_closed_at = 0.0
        self._recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=SAMPLES_KEPT)
        self._told = 0  # the last sample a heartbeat carried

    def enter(self, phase: str) -> None:
        """The training thread moved to ``phase`` (``update``, ``compute`` after an update,
        ``recovering``, ``done``). A step time measured across a recovery says nothing about
        steps: none is taken across one."""
        if phase == "recovering":
            self.began = None
        self.phase = (phase, self.clock())

    def begin(self, step: int, total: int | None) -> None:
        """Step ``step`` begins (``total``: the loop's length, when known)."""
        now = self.clock()
        began = self.began
        if began is not None and began[0] == step - 1 and began[1] >= self.section_closed_at:
            self.samples += 1
            self.last_step = now - began[1]
            self._recent.append((self.samples, self.last_step))
        self.began = (step, now)
        if total is not None:
            self.total = total
        self.phase = ("compute", now)

    def collective(self) -> None:
        """The step's gradient all-reduce starts: the time since the step began is this rank's
        own compute time (stragglers)."""
        now = self.clock()
        if self.phase[0] == "compute" and self.began is not None:
            self.compute = now - self.began[1]
        self.phase = ("collective", now)

    def section_closed(self) -> None:
        """An ``ft.section`` closed: the step interval across it is no sample."""
        self.section_closed_at = self.clock()

    def fields(self) -> dict[str, Any]:
        """On the I/O thread, for a heartbeat: ``phase``, ``phase_age`` (s), ``committed``, and
        where known ``step``, ``total``, ``last_step``, ``compute`` (s) and the step-time samples
        since the previous beat: ``samples`` (how many so far: the number of the newest),
        ``step_times`` (the newest new ones, s, at most :data:`SAMPLES_LISTED`, the last one
        numbered ``samples``) and, for new ones not listed, ``step_max`` (their largest, s) and
        ``step_max_from`` (the number of the first of them). Numbered samples let the coordinator
        leave out each process's warm-up steps however many steps one beat covers."""
        name, since = self.phase
        out: dict[str, Any] = {"phase": name, "phase_age": max(0.0, self.clock() - since)}
        progress = self.progress
        if progress is not None:
            out["committed"] = int(progress.committed)
            if progress.current_step is not None:
                out["step"] = int(progress.current_step)
        for key, value in (("total", self.total), ("last_step", self.last_step), ("compute", self.compute)):
            if value is not None:
                out[key] = value
        new = [s for s in list(self._recent) if s[0] > self._told]
        if new:
            self._told = new[-1][0]
            listed, older = new[-SAMPLES_LISTED:], new[:-SAMPLES_LISTED]
            out.update(samples=new[-1][0], step_times=[t for _, t in listed])
            if older:
                out.update(step_max=max(t for _, t in older), step_max_from=older[0][0])
        return out


class ControlClient:
    """The messages between this rank and its supervisor.

    Attributes:
        channel: the :class:`ftrun.rank.channel.Channel` (None: no supervisor, or a hot spare before
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
        board: the :class:`StepBoard` its heartbeats carry.

    Args:
        progress: the rank's :class:`ftrun.rank.recovery.RankProgress` (its current step goes with
            the progress it reports), or None.
    """

    def __init__(self, progress: Any = None) -> None:
        self.progress = progress
        self.section: tuple[str, float | None] | None = None
        self.last_report: tuple[int, dict[str, Any]] = (0, {})
        self.board = StepBoard(progress)
        self.channel: Channel | None = None
        self.abort_generation: int | None = None
        self.plan: Message | None = None
        self.save_request: Message | None = None
        self.finished = False
        self.io_abort_generation = -1
        self.abandon = threading.Event()
        self.on_abort: Callable[[Message], None] = lambda _msg: None
        self.on_io_abort: Callable[[int], None] = lambda _generation: None
        # Whether this rank's loop can be rolled back in place to a checkpoint (ft.steps: its data
        # and seeds are a function of the step). An epoch loop (ft.epochs, ft.batches) cannot: it
        # would have to rewind its passes and the epochs' ends. Said with each fault report.
        self.rollback_ok = True

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
        """Queue a message to the supervisor (never blocks; nothing without a channel). A fault
        report, a recovery's end and the loop's end move the :attr:`board` first (a heartbeat
        built after the message then says the same)."""
        phase = _PHASE_AFTER.get(msg_type)
        if phase is not None:
            self.board.enter(phase)
        if msg_type == MsgType.FAULT:
            fields.setdefault("rollback", self.rollback_ok)
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
        self.board.section_closed()
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


#: The board's phase once a message of these types is queued.
_PHASE_AFTER = {MsgType.FAULT: "recovering", MsgType.RECOVERED: "compute", MsgType.STEPS_END: "done",
                MsgType.DONE: "done"}


def training_thread_probe(thread_id: int | None, waiting: threading.Event | None = None,
                          progress: Any = None, board: StepBoard | None = None) -> Callable[[], dict[str, Any]]:
    """A heartbeat probe: whether the training thread is inside a torch.distributed call now.

    The I/O thread looks at the training thread's innermost Python frames
    (``sys._current_frames``): a rank blocked in a collective sits in ``torch/distributed``; a
    rank stuck in its own code (an endless loop, a deadlock) does not, even if it had announced
    the collective. That separates the culprit of a stalled job from the peers waiting for it.
    ``waiting`` is set by the gradient reducer while it waits for its asynchronous all-reduces
    (``Work.wait()`` runs no Python frame inside torch/distributed). With ``progress`` (a
    :class:`ftrun.rank.recovery.RankProgress`), the heartbeat also says which stage of ftrun's flow the
    training thread is in and the bytes that stage moves: a rank stuck in its own code during
    a recovery or the initial broadcast, while its peers wait for it in torch.distributed, is then
    found within seconds. With ``board``, the heartbeat carries its :meth:`StepBoard.fields` too.
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
        out: dict[str, Any] = board.fields() if board is not None else {}
        out["in_dist"] = in_dist()
        if progress is not None:
            out.update(stage=progress.stage, stage_bytes=progress.stage_bytes)
        return out

    return probe
