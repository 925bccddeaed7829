"""The rank table: each rank of the job and the process serving it now (its incarnation).

A :class:`Rank` is the job's slot (its global and local rank, its node, its restart count); the
process that serves it is an :class:`Incarnation`, made fresh by each spawn, so nothing of a dead
process (its pid, connection, step, watchdog evidence) can leak into the next one (cf.
torchelastic's ``Worker`` and ``WorkerState``). What a rank's control messages say about its
progress is recorded here (:meth:`Rank.on_heartbeat`, :meth:`Rank.on_step`...); the decisions
those records feed are the watchdog's (:mod:`ftrun.coordinator.watchdog`) and the recovery
rounds' (:mod:`ftrun.coordinator.rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..policy import NO_STATE, RankState, RecoveryPlan


class RankPhase(str, Enum):
    """Where in its step a rank's process is, as its messages say (for the watchdog)."""

    SETUP = "setup"  # started, no step begun yet (imports, the script's set-up, the initial broadcast)
    COMPUTE = "compute"  # between a step's begin (or an update's end) and its collective
    COLLECTIVE = "collective"  # announced the step's gradient all-reduce
    UPDATE = "update"  # in the optimizer update
    RECOVERING = "recovering"  # reported a fault or answered an abort: in a recovery round
    DONE = "done"  # left its step loop (ft.finish() or the end of ft.steps)


@dataclass
class Incarnation:
    """One process serving a rank, from its spawn to its exit (the fields a respawn starts afresh).

    Times are the coordinator's monotonic clock, seconds.
    """

    number: int = -1
    started_at: float = 0.0
    pid: int | None = None
    running: bool = False
    state: RankState = RankState.STARTING
    identity: bytes | None = None  # its control connection (ZeroMQ routing identity), from its hello
    last_heartbeat: float = 0.0
    step: int | None = None
    committed: int = NO_STATE
    metrics: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    exit_desc: str = ""
    # the watchdog's evidence
    phase: RankPhase = RankPhase.SETUP
    last_progress: float = 0.0  # last step/collective/update/progress message
    last_begin: tuple[int, float] | None = None  # (step, time) of the last step begin
    samples: int = 0  # step times observed from this process
    steps_ended: bool = False
    kill_reason: str | None = None  # set when ftrun kills it (a hang)
    hung_since: float = 0.0  # the evidence's start (last heartbeat or progress)
    final_step: int | None = None  # the committed step it claimed when it called ft.finish()
    finished: bool = False  # it called ft.finish(): it waits in the finish barrier, then its code after that runs unwatched
    released: bool = False  # told that every rank finished (it leaves the finish barrier)
    in_dist: bool | None = None  # its last heartbeat: training thread inside torch.distributed (None: unknown)
    stage: str = "setup"  # its last heartbeat: where in ftrun's flow (ftrun.recovery.RankProgress.stage)
    stage_bytes: int = 0  # the bytes that stage moves (a transfer's state)
    outside_since: float | None = None  # first heartbeat of this stage seeing it outside torch.distributed
    section: str | None = None  # a named section it is in (evaluation, checkpoint writing): ft.section()
    section_timeout: float | None = None  # that section's own bound, seconds (None: unbounded)
    section_started: float = 0.0
    section_closed_at: float = 0.0  # when its last section closed (step times across it are not samples)


@dataclass
class Rank:
    """One rank of the job (cf. torchelastic's Worker) and its current process, :attr:`proc`.

    The process runs on node ``node`` and is owned by that node's agent; the coordinator knows it
    through the agent's reports: ``proc.running`` from the spawn until its exit is reported,
    ``proc.pid`` once the agent (or the rank's hello) has told it.
    """

    rank: int
    local_rank: int
    node: int = 0
    proc: Incarnation = field(default_factory=Incarnation)
    restarts: int = 0
    library: bool = False  # said hello through the worker library (kept across its incarnations)
    replica_group: tuple[int, ...] = ()
    total_steps: int | None = None  # the number of steps its loop runs (ft.steps(n)), when known
    last_step_seconds: float | None = None  # its latest step time (for stragglers)
    compute_seconds: float | None = None  # its latest step's start to its collective (its own work)

    @property
    def incarnation(self) -> int:
        """The number of the process serving it now (0 for the first; -1 before any spawn)."""
        return self.proc.number

    def respawned(self, now: float) -> Incarnation:
        """Start its next incarnation (a fresh record, running from ``now``) and return it."""
        self.proc = Incarnation(number=self.proc.number + 1, started_at=now, running=True)
        return self.proc

    def alive(self) -> bool:
        return self.proc.running

    def connected(self) -> bool:
        """Alive, said hello, and not being killed by ftrun: a rank the coordinator talks to."""
        return self.proc.running and self.proc.identity is not None and self.proc.kill_reason is None

    def status(self, now: float) -> dict[str, Any]:
        p = self.proc
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": p.pid,
            "state": p.state.value,
            "step": p.step,
            "metrics": p.metrics,
            "restarts": self.restarts,
            "incarnation": p.number,
            "node": self.node,
            "total_steps": self.total_steps,
            "last_step_seconds": self.last_step_seconds,
            "compute_seconds": self.compute_seconds,
            "uptime": (now - p.started_at) if p.running else None,
            "exit": p.exit_desc or None,
        }

    # ---------------------------------------------------------- what its messages say
    def on_heartbeat(self, in_dist: Any, stage: Any, stage_bytes: Any, now: float) -> None:
        """The heartbeat thread's evidence: whether the training thread waits inside a
        torch.distributed call, and in which stage of ftrun's flow (with the bytes it moves)."""
        p = self.proc
        p.in_dist = in_dist if isinstance(in_dist, bool) else None
        if isinstance(stage, str):
            stage = stage[:20]
            if p.in_dist is not False:
                p.outside_since = None
            elif p.outside_since is None or stage != p.stage:
                p.outside_since = now
            p.stage = stage
            p.stage_bytes = stage_bytes if isinstance(stage_bytes, int) and not isinstance(stage_bytes, bool) and stage_bytes > 0 else 0

    def on_step_begin(self, step: int, total: Any, now: float, warmup_steps: int) -> float | None:
        """Step ``step`` began. Returns the previous step's time when it is a sample for the
        automatic step timeout (past ``warmup_steps`` samples of this process; a step interval that
        spans a section is none), else None."""
        p = self.proc
        p.step, p.last_progress = step, now
        sample = None
        if p.last_begin is not None and p.last_begin[0] == step - 1 and p.last_begin[1] >= p.section_closed_at:
            p.samples += 1
            self.last_step_seconds = now - p.last_begin[1]
            if p.samples > warmup_steps:
                sample = self.last_step_seconds
        p.last_begin = (step, now)
        p.phase = RankPhase.COMPUTE
        if isinstance(total, int) and not isinstance(total, bool):
            self.total_steps = total
        return sample

    def on_progress(self, step: int, metrics: dict[Any, Any], now: float) -> None:
        """``ft.report()``: its step and metrics (numbers and short texts only)."""
        p = self.proc
        p.step, p.last_progress = step, now
        p.metrics = {str(k): v for k, v in metrics.items() if isinstance(v, (int, float, str))}

    def on_section(self, name: Any, timeout: Any, now: float) -> None:
        """It opens, keeps or closes a named section (``ft.section()``: an evaluation, a checkpoint
        write) whose own bound replaces the step watchdog's while it is open (NVRx's sections)."""
        p = self.proc
        if isinstance(name, str) and name:
            if p.section != name:
                p.section, p.section_started = name[:100], now
            p.section_timeout = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0 else None
        elif name is None and p.section is not None:
            p.section, p.section_timeout, p.section_closed_at = None, None, now

    def on_collective(self, now: float) -> None:
        """It announced its step's collective; the time since its step began is its own compute
        time (stragglers)."""
        p = self.proc
        if p.last_begin is not None and p.phase == RankPhase.COMPUTE:
            self.compute_seconds = now - p.last_begin[1]
        p.phase, p.last_progress = RankPhase.COLLECTIVE, now

    def on_update(self, now: float) -> None:
        self.proc.phase, self.proc.last_progress = RankPhase.UPDATE, now

    def on_steps_end(self) -> None:
        """It left its step loop: no step watchdog for it from here on."""
        self.proc.steps_ended, self.proc.phase = True, RankPhase.DONE

    def on_update_end(self, step: int, now: float) -> None:
        """Its optimizer update of ``step`` finished: that step is committed on this rank."""
        self.proc.committed = step
        self.proc.phase, self.proc.last_progress = RankPhase.COMPUTE, now


@dataclass
class Failure:
    """A rank's failure, kept for the final summary (root cause = the first of the last round)."""

    rank: int
    pid: int | None
    exit_code: int
    description: str
    time: float
    detection_seconds: float = 0.0  # from the evidence (SIGCHLD, last heartbeat) to detection
    log_tail: tuple[str, ...] = ()  # the end of that incarnation's log (an error code or a crash)


@dataclass
class Recovery:
    """An ARF reconfiguration in progress (one generation; a new fault starts the next)."""

    generation: int
    started_at: float  # the first failure of this recovery (kept across restarted rounds)
    failed: set[int]
    detection_seconds: float = 0.0  # of the failure that started it
    reports: dict[int, int] = field(default_factory=dict)  # rank -> committed step
    plan: RecoveryPlan | None = None
    planned_at: float = 0.0
    recovered: dict[int, dict[str, Any]] = field(default_factory=dict)
    respawned_at: dict[int, float] = field(default_factory=dict)
    joined_at: dict[int, float] = field(default_factory=dict)
    rounds: int = 1
    round_started: float = 0.0  # when the current round began (its deadlines count from here)
